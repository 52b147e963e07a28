"""The ``diloco`` command: the shell that wires the core, the storage layer and Prefect.

    diloco simulate [--preset tiny] [--mode decoupled] [--config run.toml]
                    [--set outer.lr=0.5 ...] [--seed 0] [--out runs/NAME]
                    [--store [REGION=]URL ...] [--run NAME]
    diloco inspect URL [--run NAME] [--verify] [--json]

``simulate`` writes ``config.json``, ``metrics.jsonl`` and ``summary.json`` to the output
folder and prints a summary table; with ``--store`` every contribution and global
version goes through those buckets. ``inspect`` shows what a bucket holds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from diloco.config import PRESETS, ConfigError, RunConfig, load_config
from diloco.data import DataError

console = Console(stderr=True)


def stdout_console() -> Console:
    """Rich wraps at 80 columns when stdout is not a terminal; logs and pipes want lines whole."""
    return Console() if sys.stdout.isatty() else Console(width=200)


def _human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def summary_table(summary: dict, title: str) -> Table:
    table = Table(title=title, show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    rows = [
        ("mode", summary["mode"]),
        ("parameters", f"{summary['params']:,}"),
        ("learners / quorum", f"{summary['learners']} / {summary['quorum']}"),
        ("tokens", f"{summary['tokens']:,}"),
        ("validation loss", f"{summary['initial_loss']:.4f} -> {summary['final_loss']:.4f}"),
        ("simulated time", f"{summary['sim_seconds']:.1f} s"),
        ("goodput", f"{summary['goodput']:.1%}"),
        (
            "bytes up / down",
            f"{_human_bytes(summary['bytes_up'])} / {_human_bytes(summary['bytes_down'])}",
        ),
        ("data-parallel would move", _human_bytes(summary["dp_bytes"])),
        ("bandwidth saving vs dp", f"{summary['bandwidth_ratio_vs_dp']:.1f}x"),
        ("global versions", str(summary["versions"])),
        ("rejected contributions", str(summary["rejected"])),
    ]
    for key, value in rows:
        table.add_row(key, value)
    return table


def _config_from_args(args: argparse.Namespace) -> RunConfig:
    return load_config(
        preset=args.preset,
        file=args.config,
        overrides=args.set or [],
        mode=args.mode,
        seed=args.seed,
    )


def parse_stores(specs: list[str]) -> dict[str, str]:
    """``["us=file:///a", "eu=s3://b"]`` -> regions; a bare URL is region ``default``."""
    regions: dict[str, str] = {}
    for spec in specs:
        name, url = spec.split("=", 1) if "=" in spec.split("://", 1)[0] else ("default", spec)
        if name in regions:
            raise ConfigError(f"--store names region {name!r} twice")
        if url.startswith("file://") or "://" not in url:
            Path(url.removeprefix("file://")).mkdir(parents=True, exist_ok=True)
            url = "file://" + str(Path(url.removeprefix("file://")).resolve())
        regions[name] = url
    return regions


def cmd_simulate(args: argparse.Namespace) -> int:
    from diloco.simulate import simulate  # JAX import is slow: only when needed

    cfg = _config_from_args(args)
    transport = None
    if args.store:
        from flows.sim_transport import storage_transport

        regions = parse_stores(args.store)
        run_name = args.run or f"sim-{cfg.mode}-seed{cfg.seed}"
        transport = storage_transport(run_name, regions)
        console.print(
            f"storage: run {run_name!r} in {', '.join(f'{k}={v}' for k, v in regions.items())}"
        )
    out = Path(args.out or f"runs/simulate-{cfg.mode}-{args.preset or 'custom'}-seed{cfg.seed}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(cfg.model_dump_json(indent=2))
    console.print(
        f"[bold]simulate[/] mode={cfg.mode} learners={cfg.topology.learners} "
        f"quorum={cfg.quorum} fragments={cfg.topology.fragments} H={cfg.topology.inner_steps} "
        f"tokens={cfg.sim.total_tokens:,} -> {out}"
    )
    started = time.perf_counter()
    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:,}/{task.total:,} tokens"),
        TimeElapsedColumn(),
        console=console,
        disable=args.quiet,
    ) as bar:
        task = bar.add_task("training", total=cfg.sim.total_tokens)

        def progress(tokens: int, total: int, loss: float | None) -> None:
            label = f"val loss {loss:.3f}" if loss is not None else "training"
            bar.update(task, completed=min(tokens, total), description=label)

        result = simulate(cfg, progress=progress, transport=transport)
    wall = time.perf_counter() - started
    with (out / "metrics.jsonl").open("w") as f:
        for line in result.metrics:
            f.write(json.dumps(line, sort_keys=True) + "\n")
    (out / "summary.json").write_text(json.dumps(result.summary, indent=2, sort_keys=True))
    stdout_console().print(summary_table(result.summary, f"diloco simulate ({wall:.0f} s wall)"))
    console.print(f"metrics: {out / 'metrics.jsonl'}  summary: {out / 'summary.json'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diloco", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("simulate", help="run M learners and the syncer on a simulated clock")
    sim.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    sim.add_argument("--mode", choices=["dp", "diloco", "decoupled"])
    sim.add_argument("--config", help="a TOML or JSON file of config fields")
    sim.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a field")
    sim.add_argument("--seed", type=int)
    sim.add_argument("--out", help="output folder (default runs/simulate-MODE-PRESET-seedN)")
    sim.add_argument("--quiet", action="store_true", help="no progress bar")
    sim.add_argument(
        "--store",
        action="append",
        metavar="[REGION=]URL",
        help="send everything through these buckets (file://, memory://, s3://, gs://)",
    )
    sim.add_argument("--run", help="run name in the buckets (default sim-MODE-seedN)")
    sim.set_defaults(func=cmd_simulate)
    ins = sub.add_parser("inspect", help="show what a bucket holds")
    ins.add_argument("url", help="a region's bucket URL (file://, s3://, gs://, or a folder)")
    ins.add_argument("--run", help="only this run")
    ins.add_argument("--verify", action="store_true", help="re-check every object's sha256")
    ins.add_argument("--json", action="store_true", help="machine-readable output")
    ins.set_defaults(func=cmd_inspect)
    return parser


def cmd_inspect(args: argparse.Namespace) -> int:
    from storage_layout.inspect import inspect_bucket

    url = args.url if "://" in args.url else "file://" + str(Path(args.url).resolve())
    report = inspect_bucket(url, run=args.run, verify=args.verify)
    problems = [p for r in report["runs"] for p in r["problems"]]
    if args.json:
        print(json.dumps(report, indent=1, sort_keys=True, default=str))
    else:
        out = stdout_console()
        if not report["runs"]:
            out.print(f"no runs in {url}")
        for run in report["runs"]:
            out.print(
                f"[bold]run {run['run']}[/]  regions: "
                + ", ".join(f"{k}={v}" for k, v in run["regions"].items())
            )
            frag = Table("fragment", "newest", "per region", "kept", "size", "consumed", "tokens")
            for f in run["fragments"]:
                regions = " ".join(f"{r}:{v}" for r, v in f["versions"].items())
                frag.add_row(str(f["fragment"]), str(f.get("newest", "-")), regions, str(f.get("kept", 0)),
                             _human_bytes(f.get("bytes", 0)), str(f.get("consumed", "-")), str(f.get("tokens", "-")))  # fmt: skip
            out.print(frag)
            lrn = Table(
                "learner",
                "region",
                "fragment",
                "newest seq",
                "stored",
                "base",
                "staleness",
                "size",
                "checkpoint",
            )
            for row in run["learners"]:
                for p, info in sorted(row["fragments"].items()):
                    lrn.add_row(row["learner"], row["region"], str(p), str(info["newest_seq"]), str(info["stored"]),
                                str(info["base_version"]), str(info["staleness"]), _human_bytes(info["bytes"]),
                                str(row.get("checkpoint_step")))  # fmt: skip
            out.print(lrn)
            if run["traffic"]:
                tr = Table("source -> destination", "bytes", "requests")
                for pair, t in run["traffic"].items():
                    tr.add_row(pair, _human_bytes(t["bytes"]), str(t["requests"]))
                out.print(tr)
            if "verified_versions" in run:
                out.print(f"verified {run['verified_versions']} committed versions")
            for problem in run["problems"]:
                out.print(f"[red]problem:[/] {problem}")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, DataError, OSError, ValueError) as exc:
        console.print(f"[bold red]error:[/] {exc}", soft_wrap=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
