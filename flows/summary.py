"""A run's summary at its end (``run_summary``: totals read from the buckets, goodput from
the versions, the share of learner time each way went) and how it is shown: the loss
plot and the markdown artifact."""

from __future__ import annotations

import base64
import io
from typing import Any

from diloco import records
from diloco.cost import bill, dp_egress
from diloco.simulate import dp_bytes_per_step
from flows.monitor import Monitor, cross_region_bytes, learner_seconds
from flows.observe import train_summary_rows
from protocol.topology import learner_index, run_slots


def time_breakdown(monitor: Monitor, statuses: dict[str, dict], useful: float,
               allocated: float) -> dict[str, float]:  # fmt: skip
    """Shares of the allocated learner time (since this launch): start-up (compile,
    resume), training whose work reached a global version (kept) or did not (lost),
    and other: process start, checkpoints, restarts and time between flow runs."""
    if allocated <= 0:
        return {}
    startup = train = 0.0
    for learner, status in statuses.items():
        now, then = learner_seconds(status), monitor.before.get(learner, (0.0, 0.0))
        startup += now[0] - then[0]
        train += now[1] - then[1]
    return {
        "start-up": startup / allocated,
        "kept": useful / allocated,
        "lost": max(0.0, train - useful) / allocated,
        "other": max(0.0, allocated - startup - max(train, useful)) / allocated,
    }


def run_summary(monitor: Monitor, wall: float, allocated: float) -> dict[str, Any]:
    """Totals from the buckets: traffic of every writer, goodput from the versions.
    ``allocated``: the time of the learners this launcher started (its workers'); the
    joiners' (``joined``) is added to it."""
    store, spec = monitor.store, monitor.spec
    statuses = monitor.statuses()
    joined = monitor.joined(statuses)
    allocated += sum(joined.values())
    traffic, learner_bytes, rejected = monitor.traffic()
    merged = monitor.merged_seconds()
    versions = monitor.versions()
    since = [
        {"fragment": p, "seconds": s - monitor.merged_before.get(p, 0.0)} for p, s in merged.items()
    ]
    useful = records.useful_seconds(since, monitor.model.shares)
    m = len(run_slots(spec))
    tokens = monitor.tokens(statuses)
    cross = cross_region_bytes(traffic)
    num_params = monitor.model.codec.num_params
    dp_bytes = dp_bytes_per_step(num_params, m) * (tokens // (m * monitor.cfg.tokens_per_step))
    first, last = (monitor.curve[0], monitor.curve[-1]) if monitor.curve else ({}, {})
    prices = monitor.cfg.cost
    spent = bill(traffic, prices)
    dp_cross, dp_dollars = dp_egress(dp_bytes, m, list(store.urls), prices)
    return {
        "run": store.run,
        "mode": monitor.cfg.mode,
        "params": num_params,
        "learners": m,
        "started": len(monitor.launched),
        "joined": sorted(joined, key=learner_index),
        "quorum": monitor.cfg.quorum,
        "tokens": tokens,
        "initial_loss": monitor.initial_loss,
        "launch_loss": first.get("loss"),
        "final_loss": last.get("loss"),
        "wall_seconds": round(wall, 1),
        # this launch's speed: the tokens merged since it began (a resumed run's earlier
        # ones left out) over its wall time
        "tokens_per_second": round((tokens - first.get("tokens", 0)) / wall, 1)
        if wall > 0
        else None,
        "goodput": records.goodput(since, monitor.model.shares, allocated),
        "time_breakdown": time_breakdown(monitor, statuses, useful, allocated),
        "versions": versions,
        "rejected": rejected,
        "traffic": traffic,
        "learner_bytes": learner_bytes,
        "cross_region_bytes": cross,
        "dp_bytes": dp_bytes,
        "bandwidth_ratio_vs_dp": dp_bytes / learner_bytes if learner_bytes else None,
        "cost": {
            **spent.as_dict(),
            "projected": spent.projected(tokens, monitor.cfg.budget.tokens),
            "dp_cross_region_bytes": dp_cross,
            "dp_egress": dp_dollars,
        },
        "learner_states": {k: v.get("state", "not started") for k, v in statuses.items()},
        "curve": monitor.curve,
    }


def loss_plot_png(
    curve: list[dict[str, Any]],
    title: str,
    training: list[tuple[float, float]] | None = None,
    staleness: list[int] | None = None,
    costs: list[tuple[float, float]] | None = None,
    dp_per_token: float | None = None,
) -> bytes:
    """Four panels: the validation loss of each global model evaluated, at the tokens
    merged into it (with ``training``: (tokens, loss) pairs from the learners' history,
    the learners' training loss per round, at the tokens all learners had processed by
    then); the same validation loss against the launch's wall time; how stale the merged
    contributions were (``staleness``: versions behind, one per contribution); and what
    the traffic had cost at each point (``costs``: (tokens, dollars)), beside what
    data-parallel's egress would have (``dp_per_token``: dollars a token)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ((tokens, wall), (stale, cost)) = plt.subplots(2, 2, figsize=(11, 7))
    if training:
        tokens.plot([t for t, _ in training], [loss for _, loss in training], ".", ms=3,
                    alpha=0.35, color="tab:gray", label="learners' training loss (tokens processed)")  # fmt: skip
    tokens.plot([c["tokens"] for c in curve], [c["loss"] for c in curve], marker="o",
                label="validation loss of the global model (tokens merged)")  # fmt: skip
    if training:
        tokens.legend(fontsize=7)
    tokens.set_xlabel("tokens (all learners)")
    timed = [c for c in curve if c.get("seconds") is not None]
    wall.plot([c["seconds"] / 60 for c in timed], [c["loss"] for c in timed], marker="o")
    wall.set_xlabel("wall time of this launch (minutes)")
    for ax in (tokens, wall):
        ax.set_ylabel("validation loss (nats/token)" if ax is wall else "loss (nats/token)")
        ax.grid(alpha=0.3)
    if staleness:
        stale.hist(staleness, bins=range(max(staleness) + 2), align="left", rwidth=0.8)
    stale.set_xlabel("staleness of a merged contribution (versions behind)")
    stale.set_ylabel("contributions")
    stale.grid(alpha=0.3, axis="y")
    if costs:
        cost.plot([t for t, _ in costs], [d for _, d in costs], marker=".", label="this run")
        if dp_per_token:
            ends = [0.0, max(t for t, _ in costs)]
            cost.plot(ends, [dp_per_token * t for t in ends], "--", color="tab:red",
                      label="data-parallel's egress, same tokens")  # fmt: skip
        cost.legend(fontsize=7)
    cost.set_xlabel("tokens merged")
    cost.set_ylabel("traffic cost so far (US$, docs/cost.md)")
    cost.grid(alpha=0.3)
    fig.suptitle(title)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def run_plot(summary: dict[str, Any], curve: list[dict[str, Any]], metrics: Any, title: str
             ) -> bytes:  # fmt: skip
    """``loss_plot_png`` of a run at its end: its curve, and what ``metrics`` (the launch's
    ``LiveMetrics``) read; data-parallel's egress per token from the ``summary``."""
    tokens = summary["tokens"]
    dp = summary["cost"]["dp_egress"] / tokens if tokens else None
    return loss_plot_png(curve, title, metrics.training_curve(), metrics.merged_staleness(),
                         metrics.cost_curve(), dp)  # fmt: skip


def summary_markdown(summary: dict[str, Any], png: bytes | None) -> str:
    rows = train_summary_rows(summary)
    lines = [f"# Run {summary['run']}", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    if png:
        lines += ["", f"![loss curve](data:image/png;base64,{base64.b64encode(png).decode()})"]
    return "\n".join(lines)
