"""The ``diloco`` command: the shell that wires the core, the storage layer and Prefect.

    diloco simulate [--preset tiny] [--mode decoupled] [--config run.toml]
                    [--set outer.lr=0.5 ...] [--seed 0] [--out runs/NAME]
                    [--store [REGION=]URL ...] [--run NAME]
    diloco train [--run NAME] [--dir runs] [--preset tiny] [--config run.toml]
                 [--set KEY=VALUE ...] [--tokens N] [--region NAME=URL ...]
    diloco inspect URL [--run NAME] [--verify] [--json]
    diloco inspect [REGION=]URL ... --run NAME --audit [--json]
    diloco gc URL --run NAME [--keep 100] [--orphan-age 3600]

``train`` runs the real pipeline: a learner process per learner and syncer shards as
Prefect flows, linked only by the regions' buckets (by default two ``file://`` regions
under ``runs/NAME/buckets``), with a local Prefect server unless ``PREFECT_API_URL`` is
set. Run it again with the same ``--run`` to resume. ``simulate`` writes ``config.json``, ``metrics.jsonl`` and ``summary.json`` to the output
folder and prints a summary table; with ``--store`` every contribution and global
version goes through those buckets. ``inspect`` shows what a bucket holds; with
``--audit`` it checks a run's invariants in the buckets given (``storage_layout.audit``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from diloco.config import PRESETS, ConfigError, RunConfig, load_config
from diloco.data import DataError
from flows.observe import human_bytes
from flows.train import console, stdout_console


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
            f"{human_bytes(summary['bytes_up'])} / {human_bytes(summary['bytes_down'])}",
        ),
        ("data-parallel would move", human_bytes(summary["dp_bytes"])),
        ("bandwidth saving vs dp", f"{summary['bandwidth_ratio_vs_dp']:.1f}x"),
        ("global versions", str(summary["versions"])),
        ("rejected contributions", str(summary["rejected"])),
    ]
    for key, value in rows:
        table.add_row(key, value)
    return table


def config_from_args(args: argparse.Namespace, default_tokens: int | None = None) -> RunConfig:
    """Preset, file, ``--set`` and the command's own options, validated together: a bad
    ``--tokens`` fails like a bad ``--set budget.tokens`` does, naming the field."""
    overrides = list(args.set or [])
    if default_tokens is not None and args.config is None:
        overrides.insert(0, f"budget.tokens={default_tokens}")
    if getattr(args, "tokens", None) is not None:
        overrides.append(f"budget.tokens={args.tokens}")
    return load_config(preset=args.preset, file=args.config, overrides=overrides,
                       mode=args.mode, seed=args.seed)  # fmt: skip


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

    cfg = config_from_args(args)
    store = None
    if args.store:
        from flows.run import simulation_store

        regions = parse_stores(args.store)
        run_name = args.run or f"sim-{cfg.mode}-seed{cfg.seed}"
        store = simulation_store(run_name, regions)
        console.print(
            f"storage: run {run_name!r} in {', '.join(f'{k}={v}' for k, v in regions.items())}"
        )
    out = Path(args.out or f"runs/simulate-{cfg.mode}-{args.preset or 'custom'}-seed{cfg.seed}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(cfg.model_dump_json(indent=2))
    console.print(
        f"[bold]simulate[/] mode={cfg.mode} learners={cfg.topology.learners} "
        f"quorum={cfg.quorum} fragments={cfg.topology.fragments} H={cfg.topology.inner_steps} "
        f"tokens={cfg.budget.tokens:,} -> {out}"
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
        task = bar.add_task("training", total=cfg.budget.tokens)

        def progress(tokens: int, total: int, loss: float | None) -> None:
            label = f"val loss {loss:.3f}" if loss is not None else "training"
            bar.update(task, completed=min(tokens, total), description=label)

        result = simulate(cfg, progress=progress, store=store)
    wall = time.perf_counter() - started
    with (out / "metrics.jsonl").open("w") as f:
        for line in result.metrics:
            f.write(json.dumps(line, sort_keys=True) + "\n")
    (out / "summary.json").write_text(json.dumps(result.summary, indent=2, sort_keys=True))
    stdout_console().print(summary_table(result.summary, f"diloco simulate ({wall:.0f} s wall)"))
    console.print(f"metrics: {out / 'metrics.jsonl'}  summary: {out / 'summary.json'}")
    return 0


TRAIN_REGIONS = ("us-east", "eu-west")
TRAIN_TOKENS = 1_000_000  # the embedded default run: tiny preset, about 2 minutes on 2 cores


def cmd_train(args: argparse.Namespace) -> int:
    from flows.train import train
    from storage_layout.layout import check_name

    cfg = config_from_args(args, default_tokens=TRAIN_TOKENS)
    check_name("run", args.run)  # before the run's folder is made from it
    root = Path(args.dir) / args.run
    regions = parse_stores(args.region) if args.region else parse_stores(
        [f"{r}={root / 'buckets' / r}" for r in TRAIN_REGIONS]
    )  # fmt: skip
    if len(regions) == 1 and "default" in regions:
        raise ConfigError("--region needs NAME=URL")
    return train(args.run, regions, cfg, root, args.via)


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
    tr = sub.add_parser("train", help="run learners and syncers as Prefect flows over buckets")
    tr.add_argument("--run", default="quickstart", help="run name (same name: resume)")
    tr.add_argument("--dir", default="runs", help="local folder for the run (default runs)")
    tr.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    tr.add_argument("--mode", choices=["diloco", "decoupled"])
    tr.add_argument("--config", help="a TOML or JSON file of config fields")
    tr.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a field")
    tr.add_argument("--seed", type=int)
    tr.add_argument("--tokens", type=int, help=f"token budget (default {TRAIN_TOKENS:,})")
    tr.add_argument(
        "--region",
        action="append",
        metavar="NAME=URL",
        help="a region and its bucket (repeat; the first is the syncers' home); "
        f"default: {', '.join(TRAIN_REGIONS)} under DIR/RUN/buckets",
    )
    tr.add_argument(
        "--via",
        choices=["processes", "deployments"],
        default="processes",
        help="start workers as local processes (default) or as flow runs of the "
        "learner/REGION and syncer/REGION deployments (needs PREFECT_API_URL and workers)",
    )
    tr.set_defaults(func=cmd_train)
    ins = sub.add_parser("inspect", help="show what a bucket holds")
    ins.add_argument("url", nargs="+", metavar="[REGION=]URL",
                     help="a region's bucket URL (file://, s3://, gs://, or a folder)")  # fmt: skip
    ins.add_argument("--run", help="only this run")
    ins.add_argument("--verify", action="store_true", help="re-check every object's sha256")
    ins.add_argument("--audit", action="store_true",
                     help="check the run's invariants in the buckets given (needs --run): "
                     "every contribution accounted for once, versions complete and intact")  # fmt: skip
    ins.add_argument("--json", action="store_true", help="machine-readable output")
    ins.set_defaults(func=cmd_inspect)
    gc = sub.add_parser("gc", help="delete what no learner or syncer of a run can still need")
    gc.add_argument("url", help="the run's home bucket (the syncers' region)")
    gc.add_argument("--run", required=True, help="the run")
    gc.add_argument("--keep", type=int, default=100,
                    help="global versions kept per fragment (at least max_staleness + 2)")  # fmt: skip
    gc.add_argument("--orphan-age", type=float, default=3600.0,
                    help="delete uncommitted data older than this many seconds")  # fmt: skip
    gc.set_defaults(func=cmd_gc)
    return parser


def cmd_gc(args: argparse.Namespace) -> int:
    """Retention by hand (the syncers run it as they go): processed contributions, old
    versions, abandoned writes. Reads the spec only: no training code is loaded."""
    from storage_layout.retention import collect_garbage
    from storage_layout.store import RunStore

    if args.keep < 1:
        raise ConfigError(f"--keep must be at least 1, got {args.keep}")
    url = _bucket_url(args.url)
    spec = RunStore(args.run, {"gc": url}, "gc").read_spec()
    regions = spec["regions"]
    home = next((r for r, u in regions.items() if u.rstrip("/") == url.rstrip("/")), None)
    if home is None:
        raise ConfigError(f"{url} is none of run {args.run!r}'s regions: {regions}")
    window = max(args.keep, int(spec["config"]["outer"]["max_staleness"]) + 2)
    store = RunStore(args.run, regions, home, writer="gc")
    report = collect_garbage(store, len(spec["fragments"]), spec["learners"], window,
                             orphan_age=args.orphan_age)  # fmt: skip
    stdout_console().print(
        f"run {args.run}: deleted {report.contributions_deleted} contributions, "
        f"{report.globals_deleted} global versions, {report.orphans_deleted} abandoned writes "
        f"({human_bytes(report.bytes_freed)}); kept {window} versions per fragment"
    )
    for problem in report.problems:
        console.print(f"[yellow]kept:[/] {problem}")
    return 0


def _bucket_url(url: str) -> str:
    return url if "://" in url else "file://" + str(Path(url).resolve())


def audited_regions(run: str, items: list[str]) -> dict[str, str]:
    """``[REGION=]URL`` arguments -> region -> URL. A bare URL must be one the run's spec
    names (a copy of a bucket elsewhere is given with its region: ``us=/backup/us``)."""
    from storage_layout.store import RunStore

    out: dict[str, str] = {}
    for item in items:
        named = "=" in item.split("://", 1)[0]
        name, url = item.split("=", 1) if named else ("", item)
        url = _bucket_url(url)
        if not name:
            regions = RunStore(run, {"given": url}, "given").read_spec().get("regions", {})
            name = next((r for r, u in regions.items() if u.rstrip("/") == url.rstrip("/")), "")
            if not name:
                raise ConfigError(f"{url} is none of run {run!r}'s regions ({regions}); "
                                  f"name the region it holds: REGION={url}")  # fmt: skip
        if name in out:
            raise ConfigError(f"region {name!r} given twice")
        out[name] = url
    return out


def cmd_audit(args: argparse.Namespace) -> int:
    from storage_layout.audit import INVARIANTS, audit_run

    if not args.run:
        raise ConfigError("--audit needs --run NAME (the run whose invariants to check)")
    report = audit_run(args.run, audited_regions(args.run, args.url))
    if args.json:
        print(json.dumps(report.as_dict(), indent=1, sort_keys=True))
        return 0 if report.ok else 1
    out = stdout_console()
    spec_note = (
        f" (read at the spec's URL: {', '.join(report.from_spec)})" if report.from_spec else ""
    )
    out.print(f"[bold]audit of run {report.run}[/]{spec_note}")
    for region, url in report.regions.items():
        out.print(f"  {region}: {url}")
    table = Table("invariant", "result", "objects")
    for name in INVARIANTS:
        bad = report.violations.get(name, [])
        shown = "\n".join(bad[:10]) + (f"\n... and {len(bad) - 10} more" if len(bad) > 10 else "")
        table.add_row(name, "[red]FAILED[/]" if bad else "[green]ok[/]", shown)
    out.print(table)
    out.print("contributions: " + ", ".join(f"{k} {v}" for k, v in report.outcomes.items()))
    out.print("tokens: " + ", ".join(f"{k} {v:,}" for k, v in report.tokens.items()))
    out.print(f"{report.versions} versions accounted for, {report.objects} markers verified")
    for region, frags in report.lagging.items():
        out.print(f"[yellow]lagging:[/] {region} holds newest versions {frags}")
    return 0 if report.ok else 1


def cmd_inspect(args: argparse.Namespace) -> int:
    from storage_layout.inspect import inspect_bucket

    if args.audit:
        return cmd_audit(args)
    if len(args.url) > 1:
        raise ConfigError("inspect takes one bucket URL (several only with --audit)")
    url = _bucket_url(args.url[0])
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
                             human_bytes(f.get("bytes", 0)), str(f.get("consumed", "-")), str(f.get("tokens", "-")))  # fmt: skip
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
                                str(info["base_version"]), str(info["staleness"]), human_bytes(info["bytes"]),
                                str(row.get("checkpoint_step")))  # fmt: skip
            out.print(lrn)
            if run["traffic"]:
                tr = Table("source -> destination", "bytes", "requests")
                for pair, t in run["traffic"].items():
                    tr.add_row(pair, human_bytes(t["bytes"]), str(t["requests"]))
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
