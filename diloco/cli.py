"""The ``diloco`` command.

    diloco simulate [--preset tiny] [--mode decoupled] [--config run.toml]
                    [--set outer.lr=0.5 ...] [--seed 0] [--out runs/NAME]

Writes ``config.json``, ``metrics.jsonl`` and ``summary.json`` to the output folder and
prints a summary table.
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


def cmd_simulate(args: argparse.Namespace) -> int:
    from diloco.simulate import simulate  # JAX import is slow: only when needed

    cfg = _config_from_args(args)
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

        result = simulate(cfg, progress=progress)
    wall = time.perf_counter() - started
    with (out / "metrics.jsonl").open("w") as f:
        for line in result.metrics:
            f.write(json.dumps(line, sort_keys=True) + "\n")
    (out / "summary.json").write_text(json.dumps(result.summary, indent=2, sort_keys=True))
    Console().print(summary_table(result.summary, f"diloco simulate ({wall:.0f} s wall)"))
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
    sim.set_defaults(func=cmd_simulate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, DataError) as exc:
        console.print(f"[bold red]error:[/] {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
