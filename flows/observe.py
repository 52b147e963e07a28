"""What the flows show people: run loggers, artifact keys, flow-run tags and the rows of
a run's summary (the CLI's table and the launcher's markdown artifact share them).

Prefect is imported inside the functions: the `diloco` command imports this module at
start-up and most of its subcommands never touch Prefect.
"""

from __future__ import annotations

import logging
import re
from typing import Any


def run_logger(fallback: str) -> Any:
    """Prefect's run logger inside a flow or task run, else the standard logger
    ``fallback`` (the runtimes are also driven directly, in tests)."""
    from prefect import get_run_logger

    try:
        return get_run_logger()
    except Exception:
        return logging.getLogger(fallback)


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys: lowercase letters, digits and dashes."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")


def tag_flow_run(tags: list[str]) -> None:
    """Tag the current flow run (run, region, role) so the UI can filter on them.

    Set on the flow run itself rather than through ``prefect.tags(...)``: task runs
    inherit context tags, and a tagged task run makes two concurrency-limit calls to the
    API on every start and end, which stalls rounds whenever the API is busy."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    try:
        with get_client(sync_client=True) as client:
            current = client.read_flow_run(flow_run.id).tags or []
            client.update_flow_run(flow_run.id, tags=sorted(set(current) | set(tags)))
    except Exception as exc:  # tags are for people; never stop training for them
        run_logger("diloco").warning("could not tag the flow run: %s", exc)


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def train_summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(metric, value) rows of a `diloco train` summary."""
    loss = "-"
    if summary.get("final_loss") is not None:
        start = summary.get("initial_loss")
        loss = f"{'?' if start is None else format(start, '.4f')} -> {summary['final_loss']:.4f}"
        if summary.get("launch_loss") not in (None, start):  # a resumed run
            loss += f" (this launch began at {summary['launch_loss']:.4f})"
    ratio = summary.get("bandwidth_ratio_vs_dp")
    return [*_base_rows(summary, loss, ratio), *_chaos_rows(summary.get("chaos"))]


def _chaos_rows(chaos: dict[str, Any] | None) -> list[tuple[str, str]]:
    """What was done to the run on purpose, and what a learner kill cost."""
    if not chaos:
        return []
    rejoin = chaos.get("kill_to_rejoin") or {}
    return [
        ("chaos", " · ".join(f"{k.replace('_', ' ')} {v}" for k, v in chaos["actions"].items()) or "-"),
        ("storage faults", " · ".join(f"{k} {v}" for k, v in chaos["faults"].items()) or "-"),
        ("kill to next contribution",
         f"median {rejoin['median']:.1f} s · p90 {rejoin['p90']:.1f} s ({rejoin['n']} kills)"
         if rejoin else "-"),
    ]  # fmt: skip


def _base_rows(summary: dict[str, Any], loss: str, ratio: float | None) -> list[tuple[str, str]]:
    return [
        ("mode", summary["mode"]),
        ("parameters", f"{summary['params']:,}"),
        ("learners / quorum", f"{summary['learners']} / {summary['quorum']}"),
        ("tokens", f"{summary['tokens']:,}"),
        ("validation loss", loss),
        ("wall time", f"{summary['wall_seconds']:.0f} s"),
        ("goodput", f"{summary['goodput']:.1%}"),
        (
            "learner time",
            " · ".join(f"{k} {v:.0%}" for k, v in summary.get("time_breakdown", {}).items()) or "-",
        ),
        ("global versions", " ".join(f"f{p}:v{v}" for p, v in summary["versions"].items())),
        ("rejected contributions", str(summary["rejected"])),
        *[(f"bytes {pair}", human_bytes(t["bytes"])) for pair, t in summary["traffic"].items()],
        ("learners' bytes up + down", human_bytes(summary["learner_bytes"])),
        ("cross-region bytes", human_bytes(summary["cross_region_bytes"])),
        ("data-parallel would move", human_bytes(summary["dp_bytes"])),
        ("bandwidth saving vs dp", f"{ratio:.1f}x" if ratio else "-"),
    ]
