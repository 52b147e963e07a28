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
from flows.cli_args import SET_HELP, bucket_url
from flows.cli_buckets import add_bucket_parsers, add_data_parser, run_store
from flows.cli_model import add_model_parsers
from flows.cli_plan import add_plan_parser
from flows.observe import human_bytes
from flows.train import console, say_error, stdout_console


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
    url = bucket_url(args.url)
    stop = threading.Event()
    with noting_ctrl_c(stop, "this joiner leaves before it takes a slot"):
        from flows.join import join_and_train
    return join_and_train(url, args.run, args.region, args.slot, pipeline, args.speed,
                          stop=stop)[1]  # fmt: skip


def cmd_join_token(args: argparse.Namespace) -> int:
    from flows.join_tokens import issue_token, revoke_token
    from protocol.topology import learner_ids
    from storage_layout.auth import RUN_SECRET_ENV, check_secret, join_token

    store = run_store(args.url, args.run, "join-token")
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
    for add in (_add_simulate, _add_train, _add_join, add_bucket_parsers, add_plan_parser,
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
        help="the launch mode (flows.launch_modes.LAUNCH_MODES): start workers as local "
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, DataError, OSError, ValueError) as exc:
        say_error(exc)
        return 2
    except KeyboardInterrupt:  # a Ctrl-C that no command turned into its own ending
        console.print("[yellow]interrupted[/]")
        return 130


if __name__ == "__main__":
    sys.exit(main())
