"""The ``diloco`` command: the shell that wires the core, the storage layer and Prefect.

    diloco simulate [--preset tiny] [--mode decoupled] [--config run.toml]
                    [--set outer.lr=0.5 ...] [--seed 0] [--out runs/NAME]
                    [--store [REGION=]URL ...] [--run NAME]
    diloco train [--run NAME] [--dir runs] [--preset tiny] [--config run.toml]
                 [--set KEY=VALUE ...] [--tokens N] [--region NAME=URL ...]
                 [--create-buckets]
    diloco join URL --run NAME --region R [--slot LEARNER] [--speed X]
    diloco join-token URL --run NAME [--dir runs] [--expires 24h] (--learner ID ... | --learners M)
    diloco join-token URL --run NAME --revoke ID
    diloco inspect URL [--run NAME] [--verify] [--json]
    diloco inspect [REGION=]URL ... --run NAME --audit [--json]
    diloco gc URL --run NAME [--keep 100] [--orphan-age 3600]
    diloco data prepare SOURCE --out URL [--tokenizer FILE] [--vocab-size 4096]
                        [--val-percent 5] [--text-field text] [--workers N]
    diloco data show URL
    diloco config show [--preset tiny] [--config run.toml] [--set KEY=VALUE ...]
    diloco plan memory [--preset tiny] [--devices 1 8 ...] [--set KEY=VALUE ...]
    diloco --version
    diloco export URL --run NAME --out FILE|FOLDER [--version V | V0,V1,...]
    diloco eval (URL --run NAME [--version V] | --model FILE) [--data PATH] [--max-bytes N]
    diloco generate (URL --run NAME [--version V] | --model FILE) --prompt TEXT
                    [--max-bytes 256] [--temperature 1] [--top-k 0] [--seed 0]

``train`` runs the real pipeline: a learner process per learner and syncer shards as
Prefect flows, linked only by the regions' buckets (by default two ``file://`` regions
under ``runs/NAME/buckets``), with a local Prefect server unless ``PREFECT_API_URL`` is
set. Run it again with the same ``--run`` to resume (from the stored spec; a larger
``--tokens`` extends the run's budget). ``simulate`` writes ``config.json``, ``metrics.jsonl`` and ``summary.json`` to the output
folder and prints a summary table; with ``--store`` every contribution and global
version goes through those buckets. ``inspect`` shows what a bucket holds; with
``--audit`` it checks a run's invariants in the buckets given (``storage_layout.audit``).
``join`` takes a vacant learner slot of a running run from its region's bucket alone
(``flows.join``; ``join-token`` makes what a joiner needs). ``export``, ``eval`` and
``generate`` use a run's global model (``flows.model_io``).
``data prepare`` tokenizes text into a data set that ``data.source`` can name
(``diloco.dataset``; docs/data.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from diloco.config import PRESETS, ConfigError, RunConfig, load_config
from diloco.data import DataError
from diloco.dataset import CHUNK_TOKENS, DEFAULT_VOCAB
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


def config_from_args(args: argparse.Namespace, stored: dict | None = None) -> RunConfig:
    """Preset, file, ``--set`` and the command's own options, validated together: a bad
    ``--tokens`` fails like a bad ``--set budget.tokens`` does, naming the field.

    ``train`` resuming a run (``stored``: its spec) starts from the stored config, and
    keeps its budget unless ``--tokens`` (or ``--set budget.tokens``) gives another; what
    else is given must match the stored spec. A new run takes the preset's budget; with
    no preset and no file, the quick start's (``TRAIN_TOKENS`` on ``tiny``)."""
    overrides = list(args.set or [])
    preset = args.preset
    base = None
    if stored is not None:
        base = stored["config"]
        overrides.insert(0, f"budget.tokens={base['budget']['tokens']}")
    elif args.command == "train" and preset is None and args.config is None:
        overrides.insert(0, f"budget.tokens={TRAIN_TOKENS}")
    if preset is None and base is None:
        preset = "tiny"
    if getattr(args, "tokens", None) is not None:
        overrides.append(f"budget.tokens={args.tokens}")
    return load_config(preset=preset, file=args.config, overrides=overrides, base=base,
                       mode=args.mode, seed=args.seed)  # fmt: skip


def stored_spec(run: str, regions: dict[str, str]) -> dict | None:
    """The spec of ``run`` in its home bucket (with any extended budget), or None if the
    run does not exist yet."""
    from protocol.topology import home_region
    from storage_layout.store import RunStore

    try:
        return RunStore(run, regions, home_region(regions), writer="launcher").read_spec()
    except FileNotFoundError:
        return None


def parse_stores(specs: list[str], create: bool = True, option: str = "--store") -> dict[str, str]:
    """``["us=file:///a", "eu=s3://b"]`` -> regions; a bare URL is region ``default``. An
    empty URL is refused (it would be the current folder); so is a local folder that does
    not exist, unless ``create`` (a typo would otherwise start a run in a new bucket)."""
    regions: dict[str, str] = {}
    for spec in specs:
        name, url = spec.split("=", 1) if "=" in spec.split("://", 1)[0] else ("default", spec)
        if name in regions:
            raise ConfigError(f"{option} names region {name!r} twice")
        if not url.strip() or url.strip() == "file://":
            raise ConfigError(f"{option} {spec!r}: region {name!r} has an empty bucket URL")
        if url.startswith("file://") or "://" not in url:
            folder = Path(url.removeprefix("file://")).resolve()
            if create:
                folder.mkdir(parents=True, exist_ok=True)
            elif not folder.is_dir():
                raise ConfigError(
                    f"{option} {spec!r}: the folder {folder} of region {name!r} does not exist; "
                    "create it, or pass --create-buckets to have it created"
                )
            url = "file://" + str(folder)
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

    check_name("run", args.run)  # before the run's folder is made from it
    root = Path(args.dir) / args.run
    # The default regions are the run's own folders, made as needed; given ones must exist.
    regions = parse_stores(args.region, args.create_buckets, "--region") if args.region else (
        parse_stores([f"{r}={root / 'buckets' / r}" for r in TRAIN_REGIONS])
    )  # fmt: skip
    if len(regions) == 1 and "default" in regions:
        raise ConfigError("--region needs NAME=URL")
    cfg = config_from_args(args, stored_spec(args.run, regions))
    return train(args.run, regions, cfg, root, args.via)


SET_HELP = (
    "override a config field, e.g. outer.lr=0.5 (values are JSON when they parse); "
    "`diloco config show` lists every KEY with its value and meaning"
)
INSPECT_LEGEND = """\
columns:
  fragments  newest: newest global version in the bucket given; per region: each
             region's newest; kept: versions held there; size: bytes of the newest
             version; consumed, tokens: contributions and tokens it merged;
             quorum / members: the quorum it merged under, of the learners the
             syncer counted as members then
  learners   state: what its status object says, and how long ago (never started:
             none yet); joins: times the slot was taken by `diloco join`;
             (added by HOST, DEVICES, speed X): a slot a joiner on HOST added beyond
             the run's (`members/`), with the devices and `--speed` hint it recorded;
             newest seq: the learner's newest committed contribution to the fragment;
             stored: its contributions still held; base: the global version that one
             started from; staleness: newest version - base; size: its payload bytes;
             checkpoint: inner step of its newest checkpoint
  traffic    bytes and requests per source -> destination region, over every writer"""


def package_version() -> str:
    """This package's version: from its installed metadata, else from pyproject.toml."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("decoupled-diloco")
    except PackageNotFoundError:
        import tomllib

        try:
            with (Path(__file__).resolve().parents[1] / "pyproject.toml").open("rb") as f:
                return f"{tomllib.load(f)['project']['version']} (not installed)"
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown (not installed)"


def add_config_parser(sub: argparse._SubParsersAction) -> None:
    """``diloco config show``: every config field, its value and its meaning."""
    cfg = sub.add_parser("config", help="show the config fields, their values and meanings")
    actions = cfg.add_subparsers(dest="config_command", required=True)
    show = actions.add_parser("show", help="every field of a config with its value and meaning")
    show.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    show.add_argument("--config", help="a TOML or JSON file of config fields")
    show.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a field")
    show.set_defaults(func=cmd_config_show)


def config_rows(cfg: RunConfig) -> list[tuple[str, str, str]]:
    """(dotted key, value as ``--set`` takes it, meaning) of every field; a section's row
    has an empty value and its model's description."""
    from pydantic import BaseModel

    rows: list[tuple[str, str, str]] = []

    def walk(model: BaseModel, dumped: dict[str, Any], prefix: str) -> None:
        for name, field in type(model).model_fields.items():
            value, key = getattr(model, name), prefix + name
            if isinstance(value, BaseModel):
                doc = " ".join((type(value).__doc__ or "").replace("``", "").split())
                rows.append((key, "", doc))
                walk(value, dumped[name], key + ".")
            else:
                shown = dumped[name]
                text = shown if isinstance(shown, str) else json.dumps(shown)
                rows.append((key, text, field.description or ""))

    walk(cfg, cfg.model_dump(mode="json"), "")
    return rows


def cmd_join(args: argparse.Namespace) -> int:
    """``flows.join.join_and_train``, with a Ctrl-C noted from before JAX is imported
    (``flows.notice.noting_ctrl_c``): one that came while the imports ran was raised by
    Python's own handler, at times inside one of JAX's garbage collector callbacks, where
    it was swallowed, and the joiner went on to take a slot."""
    from flows.notice import noting_ctrl_c

    try:
        pipeline = json.loads(args.pipeline)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--pipeline is not a JSON object: {exc}") from exc
    url = _bucket_url(args.url)
    stop = threading.Event()
    with noting_ctrl_c(stop, "this joiner leaves before it takes a slot"):
        from flows.join import join_and_train
    return join_and_train(url, args.run, args.region, args.slot, pipeline, args.speed,
                          stop=stop)[1]  # fmt: skip


def cmd_join_token(args: argparse.Namespace) -> int:
    from flows.join import issue_token, revoke_token
    from protocol.topology import learner_ids
    from storage_layout.auth import RUN_SECRET_ENV, check_secret, join_token

    store = _run_store(args.url, args.run, "join-token")
    if args.revoke:
        revoke_token(store, args.revoke)
        console.print(f"join token {args.revoke} of run {args.run} is revoked in "
                      f"{', '.join(store.urls)}: no joiner takes a slot with it", soft_wrap=True)  # fmt: skip
        return 0
    path = Path(args.dir) / args.run / "run-secret"
    if os.environ.get(RUN_SECRET_ENV):
        secret = check_secret(os.environ[RUN_SECRET_ENV])
    elif path.exists():
        secret = check_secret(path.read_text().strip(), str(path))
    else:
        raise ConfigError(f"no run secret: set {RUN_SECRET_ENV} or give the --dir whose "
                          f"{args.run}/run-secret `diloco train` made ({path} does not exist)")  # fmt: skip
    if args.learner:
        learners = list(args.learner)
    elif args.learners:
        learners = learner_ids(args.learners)
    else:
        raise ConfigError("name the slots the token opens: --learner ID (repeat) or "
                          "--learners M for every slot of a run of M learners")  # fmt: skip
    token = join_token(secret, args.run, learners, parse_duration(args.expires, "--expires"))
    issue_token(store, token)
    until = "until revoked" if token.expires is None else f"for {args.expires}"
    console.print(f"join token {token.id} of run {args.run}: {', '.join(learners)}, valid "
                  f"{until} (`diloco join-token --revoke {token.id}` ends it)", soft_wrap=True)  # fmt: skip
    print(token.text)
    return 0


def parse_duration(text: str | None, what: str) -> float | None:
    """Seconds in ``90s``, ``30m``, ``24h`` or ``7d`` (None: none given)."""
    if text is None:
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*", text)
    if not match or float(match[1]) <= 0:
        raise ConfigError(f"{what} {text!r} is not a duration such as 90s, 30m, 24h or 7d")
    return float(match[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match[2]]


def cmd_config_show(args: argparse.Namespace) -> int:
    cfg = load_config(preset=args.preset, file=args.config, overrides=list(args.set or []))
    table = Table(title=f"config: preset {args.preset}"
                  + (f" + {args.config}" if args.config else "")
                  + "".join(f" + {s}" for s in args.set or []))  # fmt: skip
    table.add_column("key", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    table.add_column("meaning")
    for key, value, meaning in config_rows(cfg):
        style = "" if value else "cyan"  # a section: its model's description
        table.add_row(Text(key, style), Text(value), Text(meaning, style))
    stdout_console().print(table)
    if cfg.model.factory is None:
        from diloco.memory import learner_memory, param_count

        params = param_count(cfg.model)
        need = learner_memory(cfg, params).total
        console.print(f"model: {params:,} parameters; one learner on one device needs about "
                      f"{human_bytes(need)} (per device over N: diloco plan memory "
                      f"--preset {args.preset} --devices N)")  # fmt: skip
    console.print("set any of them with --set KEY=VALUE (diloco simulate / diloco train)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diloco", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"diloco {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_simulate, _add_train, _add_join, _add_inspect, add_plan_parser,
                add_data_parser, add_config_parser, add_model_parsers):  # fmt: skip
        add(sub)
    return parser


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    sim = sub.add_parser("simulate", help="run M learners and the syncer on a simulated clock")
    sim.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    sim.add_argument("--mode", choices=["dp", "diloco", "decoupled"])
    sim.add_argument("--config", help="a TOML or JSON file of config fields")
    sim.add_argument("--set", action="append", metavar="KEY=VALUE", help=SET_HELP)
    sim.add_argument("--seed", type=int)
    sim.add_argument("--tokens", type=int,
                     help="token budget (default: the preset's; as --set budget.tokens=N)")  # fmt: skip
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


def _add_train(sub: argparse._SubParsersAction) -> None:
    tr = sub.add_parser("train", help="run learners and syncers as Prefect flows over buckets")
    tr.add_argument("--run", default="quickstart", help="run name (same name: resume)")
    tr.add_argument("--dir", default="runs", help="local folder for the run (default runs)")
    tr.add_argument("--preset", choices=sorted(PRESETS),
                    help="model size and token budget (default: a new run is tiny at "
                    f"{TRAIN_TOKENS:,} tokens, the quick start; a resumed run keeps its own)")  # fmt: skip
    tr.add_argument("--mode", choices=["diloco", "decoupled"])
    tr.add_argument("--config", help="a TOML or JSON file of config fields")
    tr.add_argument("--set", action="append", metavar="KEY=VALUE", help=SET_HELP)
    tr.add_argument("--seed", type=int)
    tr.add_argument("--tokens", type=int,
                    help="token budget (default: the preset's; resuming, the run's own; a "
                    "larger one extends a run's budget, a smaller one is refused)")  # fmt: skip
    tr.add_argument(
        "--region",
        action="append",
        metavar="NAME=URL",
        help="a region and its bucket (repeat; the first is the syncers' home); "
        f"default: {', '.join(TRAIN_REGIONS)} under DIR/RUN/buckets",
    )
    tr.add_argument("--create-buckets", action="store_true",
                    help="create the folders of file:// (or plain path) regions that do not "
                    "exist yet (without it, such a region is refused as a likely typo)")  # fmt: skip
    tr.add_argument(
        "--via",
        default="processes",
        help="the launch mode (flows.supervision.LAUNCH_MODES): start workers as local "
        "processes (processes, the default) or as flow runs of the "
        "learner/REGION and syncer/REGION deployments (needs PREFECT_API_URL and workers)",
    )
    tr.set_defaults(func=cmd_train)


def _add_join(sub: argparse._SubParsersAction) -> None:
    """``diloco join`` and ``diloco join-token``."""
    jn = sub.add_parser("join", help="take a vacant learner slot of a running run (from its "
                        "region's bucket alone) and train as its learner")  # fmt: skip
    jn.add_argument("url", metavar="URL", help="the bucket of the region to train in")
    jn.add_argument("--run", required=True, help="the run to join")
    jn.add_argument("--region", required=True, help="the region whose bucket URL is")
    jn.add_argument("--slot", metavar="LEARNER",
                    help="take this learner's slot (default: the first vacant one in the region)")  # fmt: skip
    jn.add_argument("--speed", type=float,
                    help="a hint of this machine's speed, kept in its join and member "
                    "records (diloco inspect shows it for a slot it adds)")  # fmt: skip
    jn.add_argument("--pipeline", default="{}", help="JSON object of pipeline.* fields")
    jn.set_defaults(func=cmd_join)
    tok = sub.add_parser("join-token", help="print a token that lets a machine join a run "
                         "(the keys of the learner slots it may take, not the run secret)")  # fmt: skip
    tok.add_argument("url", metavar="URL", help="the run's bucket (any region's): the token's "
                     "record is kept in every region's, to check it against when one joins")  # fmt: skip
    tok.add_argument("--run", required=True)
    tok.add_argument("--expires", metavar="DURATION",
                     help="how long the token lets machines join: 90s, 30m, 24h, 7d "
                     "(default: until revoked)")  # fmt: skip
    tok.add_argument("--revoke", metavar="ID",
                     help="revoke the token of this id (printed when it was made) instead")  # fmt: skip
    tok.add_argument("--dir", default="runs",
                     help="the run's local folder's parent, where `diloco train` keeps the run "
                     "secret (DIR/RUN/run-secret; DILOCO_RUN_SECRET wins)")  # fmt: skip
    tok.add_argument("--learner", action="append", metavar="LEARNER",
                     help="a slot it may take (repeat; default: every slot of the run)")  # fmt: skip
    tok.add_argument(
        "--learners",
        type=int,
        metavar="M",
        help="every slot of a run of M learners (learner-0 .. learner-M-1)",
    )
    tok.set_defaults(func=cmd_join_token)


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    """``diloco inspect`` and ``diloco gc``."""
    ins = sub.add_parser("inspect", help="show what a bucket holds", epilog=INSPECT_LEGEND,
                         formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
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
    gc.add_argument("--keep", type=int, default=None,
                    help="global versions kept per fragment (at least max_staleness + 2; "
                         "default: what the run keeps, its launch's pipeline.keep_versions "
                         "or max_staleness + 2)")  # fmt: skip
    gc.add_argument("--orphan-age", type=float, default=3600.0,
                    help="delete uncommitted data and temporaries older than this many "
                         "seconds")  # fmt: skip
    gc.set_defaults(func=cmd_gc)


def _model_source(parser: argparse.ArgumentParser, file_too: bool) -> None:
    """The global model's arguments: a bucket URL, ``--run`` and ``--version`` (and, for
    ``eval`` and ``generate``, ``--model FILE``, an export, instead)."""
    parser.add_argument("url", nargs=None if not file_too else "?", metavar="URL",
                        help="a bucket of the run (any region; the syncers' home holds the "
                        "fp32 master copy, the others the wire copy)")  # fmt: skip
    parser.add_argument("--run", required=not file_too, help="the run")
    parser.add_argument("--version", metavar="V|V0,V1,...",
                        help="global version of every fragment, or one per fragment "
                        "(default: the newest of each)")  # fmt: skip
    if file_too:
        parser.add_argument("--model", metavar="FILE",
                            help="a file (a Llama: the folder) `diloco export` wrote, instead "
                            "of URL and --run")  # fmt: skip


def add_model_parsers(sub: argparse._SubParsersAction) -> None:
    """``diloco export``, ``diloco eval`` and ``diloco generate``: use a run's model."""
    ex = sub.add_parser("export", help="write a run's global model to a safetensors file "
                        "(a Llama: a Hugging Face Llama folder for transformers)")  # fmt: skip
    _model_source(ex, file_too=False)
    ex.add_argument("--out", required=True, metavar="FILE|FOLDER",
                    help="the file to write (a Llama: the folder)")  # fmt: skip
    ex.set_defaults(func=cmd_export)
    ev = sub.add_parser("eval", help="validation loss and bits per byte of a run's model")
    _model_source(ev, file_too=True)
    ev.add_argument("--data", metavar="PATH",
                    help="a text file, a folder of text files or an fsspec URL (default: the "
                    "run's validation batches, as the launcher evaluates)")  # fmt: skip
    ev.add_argument("--max-bytes", type=_count, default=1_000_000,
                    help="evaluate on at most this many bytes of --data (default 1e6)")  # fmt: skip
    ev.add_argument("--batch-size", type=int, help="windows per batch (default the run's)")
    ev.add_argument("--json", action="store_true", help="machine-readable output")
    ev.set_defaults(func=cmd_eval)
    gen = sub.add_parser("generate", help="sample bytes from a run's model")
    _model_source(gen, file_too=True)
    gen.add_argument("--prompt", default="", help="text the sample continues (default: none)")
    gen.add_argument("--max-bytes", "--max-tokens", type=_count, default=256,
                     help="bytes (a model with a tokenizer: tokens) to sample (default 256)")  # fmt: skip
    gen.add_argument("--temperature", type=float, default=1.0,
                     help="softmax temperature; 0 is greedy (default 1)")  # fmt: skip
    gen.add_argument("--top-k", type=int, default=0,
                     help="sample among the k likeliest bytes (default 0: all)")  # fmt: skip
    gen.add_argument("--seed", type=int, default=0, help="same seed, same sample (default 0)")
    gen.set_defaults(func=cmd_generate)


def _open_model(args: argparse.Namespace) -> Any:
    from flows.model_io import open_model

    url = None if args.url is None else _bucket_url(args.url)
    return open_model(url, args.run, getattr(args, "model", None), args.version)


def cmd_export(args: argparse.Namespace) -> int:
    from diloco.archs import ARCHS
    from flows.model_io import export_model

    model = _open_model(args)
    size = export_model(model, args.out)
    family = ARCHS[model.config.arch].hugging_face
    layout = f" (a Hugging Face {family} folder)" if family else ""
    stdout_console().print(
        f"exported {model.label}: {model.codec.num_params:,} parameters, "
        f"{human_bytes(size)} -> {args.out}{layout}"
    )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from flows.model_io import evaluate

    model = _open_model(args)
    score, what = evaluate(model, args.data, args.max_bytes, args.batch_size)
    if args.json:
        print(json.dumps({"model": model.source, "versions": model.versions,
                          "params_dtype": model.dtype, "data": what, "bytes": score.bytes,
                          "tokens": score.tokens or score.bytes, "loss": score.loss,
                          "bits_per_byte": score.bits_per_byte}))  # fmt: skip
        return 0
    out = stdout_console()
    unit = "token" if model.tokenizer is not None else "byte"
    out.print(f"model: {model.label}")
    count = (f"{score.tokens:,} tokens, {score.bytes:,} bytes" if score.tokens
             else f"{score.bytes:,} {unit}s")  # fmt: skip
    out.print(f"data:  {what} ({count} predicted)")
    out.print(f"validation loss {score.loss:.4f} nats/{unit}, {score.bits_per_byte:.4f} bits/byte")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from diloco.sample import Sampler

    model = _open_model(args)
    console.print(f"model: {model.label}")
    sampler = Sampler(model.codec, model.config.context)
    if model.tokenizer is not None:  # text in, text out; --max-bytes counts tokens
        text = sampler.generate_text(model.params, model.tokenizer, args.prompt,
                                     args.max_bytes, args.temperature, args.top_k,
                                     args.seed).encode()  # fmt: skip
    else:  # the byte model: its raw bytes
        text = sampler.generate(model.params, args.prompt.encode(), args.max_bytes,
                                args.temperature, args.top_k, args.seed)  # fmt: skip
    sys.stdout.buffer.write(text)
    if sys.stdout.isatty() and not text.endswith(b"\n"):
        sys.stdout.buffer.write(b"\n")
    sys.stdout.buffer.flush()
    return 0


def _count(text: str) -> int:
    """``1.2e6`` or ``1200000`` -> 1200000 (chip counts read better in e-notation)."""
    return int(float(text))


def _model_flag(parser: argparse.ArgumentParser, model: Any, name: str, kind: type,
                text: str) -> None:  # fmt: skip
    """``--NAME`` for field ``name`` of a planner model, defaulting to the model's value."""
    default = getattr(model, name)
    parser.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=default,
                        help=f"{text} (default {default:g})")  # fmt: skip


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    """``diloco plan goodput`` and ``diloco plan bandwidth``: every constant of
    ``diloco.plan`` a flag, defaulting to the model's own default (numpy only: no JAX)."""
    from diloco.plan import CHIPS, LEARNERS, BandwidthModel, FailureModel

    fm, bm = FailureModel(), BandwidthModel()
    plan = sub.add_parser("plan", help="goodput and bandwidth at datacenter scale (no training)")
    kinds = plan.add_subparsers(dest="plan", required=True)
    gp = kinds.add_parser("goodput", help="failure simulation of N chips: dp, elastic dp, "
                          "Decoupled DiLoCo with M learners")  # fmt: skip
    gp.add_argument("--chips", type=_count, nargs="+", default=list(CHIPS), metavar="N")
    gp.add_argument("--learners", type=int, nargs="+", default=list(LEARNERS), metavar="M")
    gp.add_argument("--quorum", type=int, default=1, help="K (default 1; at most M)")
    for name, kind, text in (
        ("mtbi_hours", float, "mean time between interruptions per chip"),
        ("recovery_seconds", float, "a failed slice is back after this (fitted to 88 %%)"),
        ("restart_seconds", float, "dp: then the whole job restarts (fitted to 27 %%)"),
        ("checkpoint_seconds", float, "dp progress between checkpoints; 0: no rollback"),
        ("downscale_seconds", float, "elastic dp: all stop while the job shrinks (fitted: 40 %%)"),
        ("upscale_seconds", float, "elastic dp: all stop while slices are re-added (fitted)"),
        ("elastic_slice_chips", int, "elastic dp: chips dropped per failure"),
        ("step_seconds", float, "one inner step (decoupled sync period = H steps)"),
        ("inner_steps", int, "H: inner steps between two sends of one fragment"),
        ("fragments", int, "P"),
        ("duration_hours", float, "simulated time per cell"),
    ):
        _model_flag(gp, fm, name, kind, text)
    gp.add_argument("--seed", type=int, default=0)
    gp.add_argument("--json", action="store_true", help="a list of cells")
    gp.add_argument("--plot", metavar="FILE.png", help="goodput against chips")
    gp.set_defaults(func=cmd_plan_goodput)
    bw = kinds.add_parser("bandwidth", help="bandwidth dp and Decoupled DiLoCo need, and "
                          "time per step at a given link")  # fmt: skip
    for name, kind, text in (
        ("params", float, "|theta|, parameters"),
        ("step_seconds", float, "compute time of one step"),
        ("sites", int, "data centers or regions (one learner each)"),
        ("inner_steps", int, "H"),
        ("fragments", int, "P"),
        ("tau", int, "steps an exchange may take"),
        ("bits", float, "bits per value of outer gradients (up)"),
        ("down_bits", float, "bits per value of merged fragments (down)"),
        ("dp_bits", float, "bits per value of dp's gradients"),
    ):
        _model_flag(bw, bm, name, kind, text)
    bw.add_argument("--link", choices=["shared", "duplex"], default=bm.link,
                    help="shared: in + out on one link (default); duplex: each direction at "
                    "the full rate")  # fmt: skip
    bw.add_argument("--wan-gbps", type=float, nargs="+", default=[], metavar="GBPS",
                    help="links to time a step at")  # fmt: skip
    bw.add_argument("--target", type=float, default=20.0,
                    help="speed-up whose break-even compute step is reported (default 20)")  # fmt: skip
    bw.add_argument("--json", action="store_true")
    bw.set_defaults(func=cmd_plan_bandwidth)
    mem = kinds.add_parser("memory", help="memory per device of one learner of a preset, "
                           "sharded over N devices (diloco/memory.py)")  # fmt: skip
    mem.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    mem.add_argument("--config", help="a TOML or JSON file of config fields")
    mem.add_argument("--set", action="append", metavar="KEY=VALUE", help=SET_HELP)
    mem.add_argument("--devices", type=int, nargs="+", default=[1, 8], metavar="N",
                     help="devices a learner shards its model over (FSDP; default 1 8)")  # fmt: skip
    mem.add_argument("--json", action="store_true")
    mem.set_defaults(func=cmd_plan_memory)


def cmd_plan_goodput(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from diloco.plan import FailureModel, goodput_table

    fm = FailureModel(**{f.name: getattr(args, f.name) for f in fields(FailureModel)})
    if args.quorum < 1 or any(m < 1 for m in args.learners) or any(n < 1 for n in args.chips):
        raise ConfigError("--quorum, --learners and --chips must be at least 1")
    negative = [f.name for f in fields(FailureModel) if f.name.endswith("_seconds")
                and getattr(fm, f.name) < 0]  # fmt: skip
    if negative:
        flags = ", ".join("--" + name.replace("_", "-") for name in negative)
        raise ConfigError(f"{flags}: a time must not be negative")
    started = time.perf_counter()
    cells = goodput_table(tuple(args.chips), tuple(args.learners), args.quorum, fm, args.seed)
    wall = time.perf_counter() - started
    if args.plot:
        plot_goodput(cells, args.plot)
    if args.json:
        print(json.dumps([c.as_dict() for c in cells], indent=1))
        return 0
    columns = [("dp", 1, "dp"), ("dp_elastic", 1, "dp elastic")] + [
        ("decoupled", m, f"M = {m}") for m in args.learners
    ]
    table = Table(title=f"goodput (uptime), K = {args.quorum}, {fm.duration_hours:g} h "
                  f"simulated per cell, seed {args.seed} ({wall:.1f} s wall)")  # fmt: skip
    table.add_column("chips", justify="right", style="bold")
    for *_, label in columns:
        table.add_column(label, justify="right")
    by_key = {(c.mode, c.learners, c.chips): c for c in cells}
    for n in args.chips:
        row = [by_key[(mode, m, n)] for mode, m, _ in columns]
        table.add_row(f"{n:,}", *(f"{c.goodput:.1%} ({c.uptime:.0%})" for c in row))
    out = stdout_console()
    out.print(table)
    checkpoint = (f"a checkpoint every {fm.checkpoint_seconds:g} s" if fm.checkpoint_seconds > 0
                  else "no rollback")  # fmt: skip
    out.print(
        f"MTBI {fm.mtbi_hours:g} h per chip, recovery {fm.recovery_seconds:g} s, restart "
        f"{fm.restart_seconds:g} s and {checkpoint} (dp), downscale / upscale "
        f"{fm.downscale_seconds:g} / {fm.upscale_seconds:g} s on {fm.elastic_slice_chips:,}-chip "
        f"slices (elastic dp), sync every {fm.inner_steps} x {fm.step_seconds:g} s over "
        f"{fm.fragments} fragments (decoupled)"
    )
    if args.plot:
        out.print(f"plot: {args.plot}")
    return 0


def plot_goodput(cells: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list] = {}
    for c in cells:
        label = {"dp": "data-parallel", "dp_elastic": "elastic data-parallel"}.get(
            c.mode, f"Decoupled DiLoCo, M = {c.learners}"
        )
        series.setdefault(label, []).append(c)
    for label, row in series.items():
        style = "--" if "data-parallel" in label else "-"
        ax.plot([c.chips for c in row], [100 * c.goodput for c in row], style, marker="o",
                label=label)  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("chips")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_plan_bandwidth(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from diloco.plan import BandwidthModel, bandwidth_plan, breakeven_step_seconds

    bm = BandwidthModel(**{f.name: getattr(args, f.name) for f in fields(BandwidthModel)})
    if min(bm.params, bm.step_seconds, bm.fragments, bm.inner_steps) <= 0:
        raise ConfigError(
            "--params, --step-seconds, --fragments and --inner-steps must be positive"
        )
    base = bandwidth_plan(bm)
    timed = [bandwidth_plan(bm, g) for g in args.wan_gbps]
    breakeven = {g: breakeven_step_seconds(bm, g, args.target) for g in args.wan_gbps}
    if args.json:
        print(json.dumps({"model": {f.name: getattr(bm, f.name) for f in fields(bm)},
                          "required": base.as_dict(),
                          "links": [dict(p.as_dict(), breakeven_step_seconds=breakeven[p.wan_gbps])
                                    for p in timed]}, indent=1))  # fmt: skip
        return 0
    out = stdout_console()
    out.print(
        f"{bm.params / 1e9:g} B parameters, {bm.step_seconds:g} s per step, {bm.sites} sites; "
        f"dp: ring all-reduce at {bm.dp_bits:g} bits; decoupled: H = {bm.inner_steps}, "
        f"P = {bm.fragments}, tau = {bm.tau}, {bm.bits:g} bits up / {bm.down_bits:g} down; "
        f"link {bm.link}"
    )
    req = Table(title="bandwidth needed to hide communication behind compute")
    req.add_column("", style="bold")
    req.add_column("bits per step per site", justify="right")
    req.add_column("needed", justify="right")
    req.add_row(
        "data-parallel", f"{base.dp_bits_per_step:.3g}", f"{base.dp_required_gbps:.3g} Gbps"
    )
    req.add_row("Decoupled DiLoCo", f"{base.decoupled_bits_per_step:.3g}",
                f"{base.decoupled_required_gbps:.3g} Gbps")  # fmt: skip
    req.add_row("ratio", "", f"{base.ratio:.1f}x")
    out.print(req)
    if timed:
        t = Table(title="time per step at a given link")
        bound = f"{args.target:g}x while the step is under"
        for col in ("link", "dp", "Decoupled DiLoCo", "exchange", "speed-up", bound):
            t.add_column(col, justify="right")
        for p in timed:
            t.add_row(f"{p.wan_gbps:g} Gbps", f"{p.dp_step_seconds:.3g} s",
                      f"{p.decoupled_step_seconds:.3g} s", f"{p.exchange_steps:.2g} steps",
                      f"{p.speedup:.1f}x", f"{breakeven[p.wan_gbps]:.3g} s")  # fmt: skip
        out.print(t)
    return 0


def cmd_plan_memory(args: argparse.Namespace) -> int:
    """Per device, what one learner of the preset needs at each device count, by part,
    with and without rematerialization (numpy only: the model is counted, not built)."""
    from diloco.archs import ARCHS
    from diloco.memory import learner_memory, param_count

    cfg = load_config(preset=args.preset, file=args.config, overrides=list(args.set or []))
    if any(n < 1 for n in args.devices):
        raise ConfigError("--devices: a device count is at least 1")
    params = param_count(cfg.model)
    m = cfg.model
    estimates = {n: learner_memory(cfg, params, n) for n in args.devices}
    remat = ARCHS[m.arch].remat(m)  # None: the architecture has no such choice
    other = None if remat is None else not remat
    flipped = (
        {n: learner_memory(cfg, params, n, other) for n in args.devices}
        if other is not None
        else {}
    )
    if args.json:
        print(json.dumps({"preset": args.preset, "params": params, "remat": m.remat,
                          "per_device": {n: dict(e.parts(), total=e.total)
                                         for n, e in estimates.items()},
                          "total_other_remat": {n: e.total for n, e in flipped.items()}},
                         indent=1))  # fmt: skip
        return 0
    tokens = cfg.data.batch_size * m.context
    table = Table(title=f"memory per device of one learner: preset {args.preset}, "
                  f"{params / 1e6:,.1f} M parameters, {cfg.data.batch_size} x {m.context} "
                  f"= {tokens:,} tokens a step"
                  + (f", {m.compute_dtype} compute, remat {'on' if m.remat else 'off'}"
                     if remat is not None else ""))  # fmt: skip
    table.add_column("", style="bold")
    for n in args.devices:
        table.add_column(f"{n} device{'s' if n > 1 else ''}", justify="right")
    for i, (part, _) in enumerate(estimates[args.devices[0]].parts()):
        table.add_row(part, *(human_bytes(e.parts()[i][1]) for e in estimates.values()))
    table.add_row("total", *(human_bytes(e.total) for e in estimates.values()), style="bold")
    if flipped:
        label = "total without remat" if m.remat else "total with remat"
        table.add_row(label, *(human_bytes(e.total) for e in flipped.values()))
    stdout_console().print(table)
    console.print("parameters, gradients, AdamW state and anchors sharded over the devices "
                  "(FSDP), the batch split over them; float32 but for bf16 compute's weight "
                  "copies and activations; the total counts the larger of the activations "
                  "and the new state at the update, which are not held together "
                  "(diloco/memory.py)")  # fmt: skip
    return 0


def _run_store(url: str, run: str, writer: str) -> Any:
    """A ``RunStore`` of every region of ``run``, from one region's bucket ``url`` (its
    spec's), that region as its client's."""
    from storage_layout.auth import Keys
    from storage_layout.bucket import same_bucket
    from storage_layout.store import RunStore

    url = _bucket_url(url)
    regions = RunStore(run, {"given": url}, "given").read_spec().get("regions") or {}
    region = next((r for r, u in regions.items() if same_bucket(str(u), url)), None)
    if region is None:
        raise ConfigError(f"{url} is none of run {run!r}'s regions: {regions}")
    # with DILOCO_RUN_SECRET set, the run's claims are checked (``storage_layout.auth``)
    return RunStore(run, regions, region, writer=writer, claims_key=Keys.from_env(run).claims_key)


def cmd_gc(args: argparse.Namespace) -> int:
    """Retention by hand (the syncers run it as they go): processed contributions, old
    versions, abandoned writes. Reads the spec only: no training code is loaded."""
    from storage_layout.auth import Keys
    from storage_layout.retention import collect_garbage

    if args.keep is not None and args.keep < 1:
        raise ConfigError(f"--keep must be at least 1, got {args.keep}")
    store = _run_store(args.url, args.run, "gc")
    spec = store.read_spec()
    keep = args.keep if args.keep is not None else _launched_keep(store)
    window = max(keep or 0, int(spec["config"]["outer"]["max_staleness"]) + 2)
    learners = store.members.run_learners(spec, Keys.from_env(args.run).verifying_key).regions
    report = collect_garbage(store, len(spec["fragments"]), learners, window,
                             orphan_age=args.orphan_age, keys=Keys.from_env(args.run))  # fmt: skip
    stdout_console().print(
        f"run {args.run}: deleted {report.contributions_deleted} contributions, "
        f"{report.globals_deleted} global versions, {report.orphans_deleted} abandoned writes "
        f"and {report.temporaries_deleted} temporaries "
        f"({human_bytes(report.bytes_freed)}); kept {window} versions per fragment"
    )
    for problem in report.problems:
        console.print(f"[yellow]kept:[/] {problem}")
    return 0


def _launched_keep(store: Any) -> int | None:
    """``pipeline.keep_versions`` of the run's newest launch (None: what the run needs)."""
    from pydantic import ValidationError

    from diloco.config import PipelineConfig
    from flows.spec import launched_pipeline

    settings = launched_pipeline(store)
    try:
        return PipelineConfig.model_validate(settings).keep_versions
    except ValidationError as exc:
        raise ConfigError(f"run {store.run!r}: the pipeline settings of its newest launch "
                          f"({store.layout.pipeline}) do not read: {exc}") from None  # fmt: skip


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
    from flows.ledger import audit_units
    from storage_layout.audit import INVARIANTS, audit_run

    if not args.run:
        raise ConfigError("--audit needs --run NAME (the run whose invariants to check)")
    report = audit_run(args.run, audited_regions(args.run, args.url))
    audit_units(report)
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
    for learner, spans in sorted(report.data.items()):
        ranges = ", ".join(f"{lo}-{hi}" for lo, hi in spans)
        out.print(f"data merged from {learner} (its batches, [from, to)): {ranges}")
    for region, pool in sorted(report.units.items()):
        back = pool["given_back_waiting"]
        windows = sum(end - start for _, _, start, end in back)
        orphans = ", ".join(pool["orphan_claims"]) or "none"
        lost = ", ".join(pool.get("moved_not_offered", [])) or "none"
        out.print(f"data units of {region}'s pool: {pool['units_handed_out']} handed out, "
                  f"{len(back)} spans ({windows} windows) given back or offered and not "
                  f"taken yet, claims no learner recorded: {orphans}, {pool['moved_out']} "
                  f"spans offered to other regions (not offered where they went: {lost})")  # fmt: skip
    for learner, acc in sorted(report.learners.items()):
        tokens = ", ".join(f"{k} {v:,}" for k, v in acc["tokens"].items() if v)
        unsent = "" if acc.get("unsent") is None else f", unsent {acc['unsent']}"
        if acc.get("joins"):
            unsent += f", joined {len(acc['joins'])}x (last from {acc['joins'][-1]['host']})"
        where = f"{acc.get('region')}, added" if acc.get("added") else acc.get("region")
        out.print(f"learner {learner} ({where}): {acc.get('state') or 'no status'}; "
                  f"batches trained {acc.get('trained')}, sent {acc.get('sent')}{unsent}; "
                  f"tokens {tokens or 'none'}")  # fmt: skip
    for damage in report.unread_damage:
        out.print(f"[yellow]damaged, never read:[/] {damage}")
    for region, frags in report.lagging.items():
        out.print(f"[yellow]lagging:[/] {region} holds newest versions {frags}")
    return 0 if report.ok else 1


def cmd_inspect(args: argparse.Namespace) -> int:
    from storage_layout.inspect import inspect_bucket

    if args.audit:
        return cmd_audit(args)
    named = any("=" in item.split("://", 1)[0] for item in args.url)
    if (len(args.url) > 1 or named) and not args.run:
        raise ConfigError("several buckets, or REGION=URL, need --run NAME")
    # Verification reads the buckets given, each in its region, never the spec's URLs.
    given = audited_regions(args.run, args.url) if named or (args.verify and args.run) else None
    url = next(iter(given.values())) if given else _bucket_url(args.url[0])
    report = inspect_bucket(url, run=args.run, verify=args.verify, given=given)
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
            frag = Table("fragment", "newest", "per region", "kept", "size", "consumed", "tokens",
                         "quorum / members")  # fmt: skip
            for f in run["fragments"]:
                regions = " ".join(f"{r}:{v}" for r, v in f["versions"].items())
                quorum = "-" if f.get("quorum") is None else f"{f['quorum']} / {len(f['members'])}"
                frag.add_row(str(f["fragment"]), str(f.get("newest", "-")), regions, str(f.get("kept", 0)),
                             human_bytes(f.get("bytes", 0)), str(f.get("consumed", "-")), str(f.get("tokens", "-")),
                             quorum)  # fmt: skip
            out.print(frag)
            lrn = Table("learner", "region", "state", "joins", "fragment", "newest seq", "stored",
                        "base", "staleness", "size", "checkpoint")  # fmt: skip
            for row in run["learners"]:
                state = row.get("state") or ("never started" if "joins" in row else "-")
                if row.get("status_age_s") is not None:
                    state += f", {row['status_age_s']:.0f} s ago"
                if row.get("beat"):  # (alive: its heartbeat, apart from its status)
                    beat = row["beat"]
                    state += f"; heartbeat {beat['age_s']:.0f} s ago ({beat['state']})"
                machine = [row.get("host"), row.get("devices") and f"devices {row['devices']}"]
                if row.get("speed") is not None:
                    machine.append(f"speed {row['speed']:g}")
                added = (
                    f" (added by {', '.join(m for m in machine if m)})" if row.get("added") else ""
                )
                name = row["learner"] + added
                head = [name, row["region"], state, str(row.get("joins", "-"))]
                step = row.get("checkpoint_step")
                ckpt = "-" if step is None else str(step)
                for p, info in sorted(row["fragments"].items()) or [(None, None)]:
                    if info is None:  # nothing sent: the slot still shows
                        lrn.add_row(*head, *["-"] * 6, ckpt)
                        continue
                    lrn.add_row(*head, str(p), str(info["newest_seq"]), str(info["stored"]),
                                str(info["base_version"]), str(info["staleness"]), human_bytes(info["bytes"]),
                                ckpt)  # fmt: skip
            out.print(lrn)
            for region, pool in sorted(run.get("units", {}).items()):
                out.print(f"data units of {region}'s pool: {pool['handed_out']} handed out, "
                          f"{pool['offered_here']} spans offered from other regions' pools, "
                          f"{pool['returns_taken']} spans given back or offered and taken "
                          "(--audit checks the ledger)")  # fmt: skip
            if run["traffic"]:
                tr = Table("source -> destination", "bytes", "requests")
                for pair, t in run["traffic"].items():
                    tr.add_row(pair, human_bytes(t["bytes"]), str(t["requests"]))
                out.print(tr)
            out.print(INSPECT_LEGEND, style="dim", markup=False, highlight=False)
            if "verified_versions" in run:
                where = ", ".join(f"{r}={u}" for r, u in run["verified"].items())
                out.print(f"verified {run['verified_versions']} committed versions in {where}")
            for problem in run["problems"]:
                out.print(f"[red]problem:[/] {problem}")
    return 1 if problems else 0


def add_data_parser(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="tokenize text into a data set in a bucket")
    dsub = data.add_subparsers(dest="data_command", required=True)
    prep = dsub.add_parser("prepare", help="tokenize SOURCE into token shards at --out")
    prep.add_argument("source", help="text file, JSON lines or Parquet file, folder of them, "
                      "or fsspec URL")  # fmt: skip
    prep.add_argument("--out", required=True, help="the data set's folder or bucket URL")
    prep.add_argument("--tokenizer", help="a tokenizer.json or SentencePiece .model to use "
                      "(default: train a byte-level BPE on SOURCE)")  # fmt: skip
    prep.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB,
                      help=f"the trained BPE's vocabulary (default {DEFAULT_VOCAB})")  # fmt: skip
    prep.add_argument("--val-percent", type=int, default=5,
                      help="percent of documents held out for validation (default 5)")  # fmt: skip
    prep.add_argument("--text-field", default="text",
                      help="the JSON lines field or Parquet column holding the text")  # fmt: skip
    prep.add_argument("--workers", type=int, help="tokenizer threads (default: all cores)")
    prep.add_argument("--chunk-tokens", type=int, default=CHUNK_TOKENS,
                      help="tokens per chunk: what a learner reads and checks at a time, and "
                      f"the unit dealt to learners (default {CHUNK_TOKENS:,})")  # fmt: skip
    prep.add_argument("--quiet", action="store_true", help="no progress bar")
    prep.set_defaults(func=cmd_data_prepare)
    show = dsub.add_parser("show", help="print a data set's manifest summary")
    show.add_argument("url", help="the data set's folder or bucket URL")
    show.set_defaults(func=cmd_data_show)


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from diloco.dataset import prepare

    if not 0 <= args.val_percent <= 50:
        raise DataError(f"--val-percent {args.val_percent} is not between 0 and 50")
    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
               TimeElapsedColumn()]  # fmt: skip
    with Progress(*columns, console=console, disable=args.quiet) as bar:
        tasks: dict[str, Any] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done)

        prepare(args.source, args.out, args.tokenizer, args.vocab_size, args.val_percent,
                args.text_field, args.workers, args.chunk_tokens, progress=progress)  # fmt: skip
    return cmd_data_show(argparse.Namespace(url=args.out))


def cmd_data_show(args: argparse.Namespace) -> int:
    from diloco.dataset import open_dataset

    ds = open_dataset(args.url)
    m = ds.manifest
    table = Table(title=f"data set {args.url}")
    for col in ("split", "shards", "chunks", "documents", "tokens", "bytes"):
        table.add_column(col, justify="left" if col == "split" else "right")
    for split, totals in m["totals"].items():
        shards = [s for s in m["shards"] if s["split"] == split]
        table.add_row(split, str(len(shards)), str(sum(len(s["chunk_sha256"]) for s in shards)),
                      f"{totals['documents']:,}", f"{totals['tokens']:,}",
                      human_bytes(totals["tokens"] * ds.dtype.itemsize))  # fmt: skip
    stdout_console().print(table)
    tok = m["tokenizer"]
    stdout_console().print(
        f"tokenizer {tok['file']} ({tok['kind']}), vocabulary {tok['vocab_size']:,}, eos "
        f"{tok['eos_id']}, tokens {m['dtype']}, chunks of {m['chunk_tokens']:,} tokens; "
        f"source {m['source']['url']} ({m['source']['files']:,} files, "
        f"{human_bytes(m['source']['bytes'])}); train with "
        f"--set data.source={args.url} --set model.vocab_size={tok['vocab_size']}",
        soft_wrap=True,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, DataError, OSError, ValueError) as exc:
        console.print(f"[bold red]error:[/] {exc}", soft_wrap=True)
        return 2
    except KeyboardInterrupt:  # a Ctrl-C that no command turned into its own ending
        console.print("[yellow]interrupted[/]")
        return 130


if __name__ == "__main__":
    sys.exit(main())
