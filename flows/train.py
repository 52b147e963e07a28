"""``diloco train``: one validated config in, one finished (or resumed) run out.

The launcher flow (``flows/launcher.py``) does the work; this module gets it a Prefect
API (the user's ``PREFECT_API_URL`` or a server of the run's own), handles Ctrl-C and
prints the summary. Prefect is imported only after ``PREFECT_HOME`` points at the run.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from diloco.config import ConfigError, RunConfig
from flows.display import open_display
from flows.launch_modes import launch_mode
from flows.observe import human_bytes, train_summary_rows
from flows.sinks import check_sinks
from protocol.topology import (
    SLOT_EVERYWHERE,
    deal_learners,
    home_region,
    run_deal,
    unslotted_regions,
)

if TYPE_CHECKING:  # (Prefect is imported only once PREFECT_HOME is set)
    from flows.launcher import Launch
    from flows.run import Run

console = Console(stderr=True, soft_wrap=True)


def say_error(exc: BaseException) -> None:
    """``error: ...`` on the terminal, the error's text as it is (a ``[wandb]`` in it is
    not taken for markup)."""
    console.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)


def stdout_console() -> Console:
    """Rich wraps at 80 columns when stdout is not a terminal; logs and pipes want lines whole."""
    return Console() if sys.stdout.isatty() else Console(width=200)


def train_summary_table(summary: dict, title: str) -> Table:
    table = Table(title=title, show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    for key, value in train_summary_rows(summary):
        table.add_row(key, value)
    return table


def _bin(name: str) -> str:
    """How to call a console script of this environment from the current folder."""
    path = Path(sys.executable).parent / name
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _inspect_hint(url: str, run: str) -> str:
    """The command that inspects the run's home bucket from the user's shell. A wrapper
    that gave this process an environment of its own (``python -m infra.local_stack run``:
    the stack's endpoints and credentials) names its own command in DILOCO_INSPECT_HINT,
    a template of ``{url}`` and ``{run}``."""
    template = os.environ.get("DILOCO_INSPECT_HINT")
    if template:
        return template.format(url=url, run=run)
    return f"{_bin('diloco')} inspect {url} --run {run}"


UI_PORT = 4200  # where the browse command serves a finished run's Prefect UI


def browse_command(prefect_home: Path, port: int = UI_PORT) -> str:
    """The shell command that serves the Prefect UI of a run's own (stopped) server, and
    where to open it. The UI's API URL is set with the port: the UI asks
    ``PREFECT_SERVER_UI_API_URL``, which a ``PREFECT_API_URL`` in the user's shell would
    otherwise override (and ``--port`` alone does not change)."""
    return (f"PREFECT_HOME={prefect_home} PREFECT_SERVER_UI_API_URL=http://127.0.0.1:{port}/api "
            f"{_bin('prefect')} server start --host 127.0.0.1 --port {port}  "
            f"(then open http://127.0.0.1:{port}/runs)")  # fmt: skip


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _is_complete(opened: Run, root: Path) -> bool:
    """True, with the stored summary printed, if the run ``opened`` (``Run.start``: its
    spec checked, every bucket reached) is done."""
    store, tokens = opened.store("launcher"), opened.cfg.budget.tokens
    if not all(store.progress.done(lid, region, tokens)
               for lid, region in store.members.run_learners(opened.spec).regions.items()):  # fmt: skip
        return False
    console.print(f"run {opened.name!r} is complete (every learner is done, {tokens:,} "
                  "tokens); pass another --run to start a new one, or a larger --tokens to "
                  "extend it")  # fmt: skip
    saved = root / "summary.json"
    if saved.exists():
        summary = json.loads(saved.read_text())
        stdout_console().print(train_summary_table(summary, f"diloco train {opened.name}"))
    return True


def _prefect_api(prefect_home: Path, via: str) -> AbstractContextManager[str]:
    """The user's Prefect API if ``PREFECT_API_URL`` is set (checked now), else a server of
    the run's own under ``prefect_home``."""
    from infra.prefect_server import prefect_server

    external = os.environ.get("PREFECT_API_URL")
    if external:
        try:
            urllib.request.urlopen(f"{external.rstrip('/')}/health", timeout=10).close()
        except OSError as exc:
            raise ConfigError(
                f"the Prefect API at {external} (PREFECT_API_URL) is not reachable: {exc}; "
                "start it, or unset PREFECT_API_URL to run with a server of the run's own"
            ) from None
        return nullcontext(external)
    if not launch_mode(via).local:
        raise ConfigError(
            f"--via {via} needs a Prefect server with a worker per region: set "
            f"PREFECT_API_URL ({_bin('python')} -m infra.local_stack up starts one; see "
            "docs/deploy.md)"
        )
    return prefect_server(prefect_home)


def memory_lines(cfg: RunConfig, num_params: int, via: str,
                 machine: tuple[int, int] | None = None) -> tuple[str, str | None]:  # fmt: skip
    """What a learner process of ``cfg`` needs (``diloco.memory``), and a warning if the
    run's processes on this machine (processes mode: every learner, the syncer shards and
    the launcher) would need more than it has available (``machine``: available and
    total bytes, by default this machine's or its memory cgroup's)."""
    from diloco.memory import learner_memory, process_memory
    from flows.memory import memory_limit
    from protocol.topology import shard_count

    shards = max(cfg.pipeline.fsdp, 1)  # -1 (all devices): counted as one, an upper bound
    each = learner_memory(cfg, num_params, shards)
    per = f" per device (sharded over {shards})" if shards > 1 else ""
    line = (f"memory per learner process{per}: about {human_bytes(each.total)} ("
            + ", ".join(f"{k} {human_bytes(v)}" for k, v in each.parts()) + ")")  # fmt: skip
    if not launch_mode(via).local:
        return line, None
    m = cfg.topology.learners
    others = shard_count(cfg.pipeline.syncer_shards, cfg.topology.fragments) + 1
    need = m * each.total + others * process_memory(num_params)
    available, total = machine or memory_limit()
    line += f"; the run's processes here: about {human_bytes(need)} of {human_bytes(available)} available"
    if need <= available:
        return line, None
    return line, (
        f"the {m} learners (and {others} syncer and launcher processes) would need about "
        f"{human_bytes(need)}, more than the {human_bytes(available)} available (of "
        f"{human_bytes(total)}): expect the OOM killer. Fewer learners "
        "(--set topology.learners=N), smaller batches (--set data.batch_size=N) or a "
        "smaller preset fit; so does another machine per region (--via deployments)"
    )


def train(run: str, regions: dict[str, str], cfg: RunConfig, root: Path, via: str) -> int:
    """Run (or resume) ``run`` to the end of its budget; the exit status."""
    signal.signal(signal.SIGTERM, _raise_interrupt)  # clean up the server on `kill` too
    local = launch_mode(via).local  # (one that exists: before anything starts)
    check_sinks(cfg.pipeline.sinks)  # (their libraries installed: the same)
    from flows.run import Run
    from flows.run_lock import RunLock, RunLocked
    from storage_layout.auth import claims_key, run_secret
    from storage_layout.faults import Injector

    # The spec checked and every bucket reached: a mismatch or a missing bucket is
    # reported before anything starts.
    opened = Run.start(run, regions, cfg, Injector.from_env())
    if _is_complete(opened, root):
        return 0

    # One launcher per run, taken before the run's Prefect server starts (two servers
    # must never share its database): a second `diloco train` of a running run is refused.
    # Its claim is tagged with the run's claims key, where the launcher holds the secret.
    root.mkdir(parents=True, exist_ok=True)
    secret = run_secret(root / "run-secret" if local else None)[0]
    store = opened.store("launcher", claims_key=None if secret is None else claims_key(secret, run))
    # Another launcher that takes the run over (this one's lease went stale) stops the
    # workers; the launcher flow then ends naming who took over. The launch is made once
    # the run's Prefect API is up (``_train``): Prefect reads its settings when it is
    # first imported, and one imported before PREFECT_HOME and PREFECT_API_URL point at
    # the run started an ephemeral server of its own on the run's database (a second
    # server on one SQLite file, left running by a launcher that was killed).
    launches: list[Launch] = []
    try:
        lock = RunLock(store, on_lost=lambda who: [x.interrupt() for x in launches]).acquire()
    except RunLocked as exc:
        say_error(exc)
        return 2
    try:
        return _train(opened, root, via, launches)
    finally:
        lock.release()


def _announce(opened: Run, via: str) -> None:
    """What ``diloco train`` says before it starts: the run, the memory its learners need
    here, and a region no learner starts in."""
    run, regions, cfg = opened.name, opened.regions, opened.cfg
    console.print(
        f"[bold]train[/] run {run!r}: mode={cfg.mode} learners={cfg.topology.learners} "
        f"quorum={cfg.quorum} fragments={cfg.topology.fragments} "
        f"H={cfg.topology.inner_steps} tokens={cfg.budget.tokens:,}"
        + (f" speeds={list(cfg.pipeline.speeds)}" if cfg.pipeline.speeds else "")
        + "\n"
        + "".join(f"  region {r}: {u}\n" for r, u in regions.items())
    )
    estimate, warning = memory_lines(cfg, opened.model.codec.num_params, via)
    console.print(estimate)
    if warning:
        console.print(f"[bold yellow]warning:[/] {warning}")
    if empty := unslotted_regions(deal_learners(cfg.topology.learners, regions), regions):
        # (a run started before deals were recorded has none)
        if cfg.data.assign == "slots" or not run_deal(opened.spec):
            console.print(
                f"[bold yellow]warning:[/] no learner slot in region {', '.join(empty)}: no "
                f"learner trains there and no machine can join there (diloco join); "
                f"{SLOT_EVERYWHERE}", soft_wrap=True,
            )  # fmt: skip
        else:
            console.print(
                f"no learner starts in region {', '.join(empty)}: a machine joins there "
                "with diloco join (it adds a learner); until one does, the learners of "
                "the other regions train its data", soft_wrap=True,
            )  # fmt: skip


def _train(opened: Run, root: Path, via: str, launches: list[Launch]) -> int:
    run, prefect_home = opened.name, root / "prefect"
    os.environ.setdefault("PREFECT_HOME", str(prefect_home.resolve()))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    _announce(opened, via)
    external = os.environ.get("PREFECT_API_URL")
    started = time.perf_counter()
    # On a terminal, a live display of the run's phases (flows/display.py); else log lines.
    with open_display(console, f"diloco train {run}") as display:
        display.phase("server", "running", external or f"starting one (home {prefect_home})")
        with _prefect_api(prefect_home, via) as api_url:
            os.environ["PREFECT_API_URL"] = api_url
            display.phase("server", "done", api_url)
            console.print(
                f"Prefect API {api_url}" + ("" if external else f" (home {prefect_home})")
            )
            from prefect.exceptions import CancelledRun

            from flows import launcher  # (Prefect: its settings are the run's from here)
            from flows.monitor import RunStalled, StorageUnreachable
            from flows.watch import flush_prefect

            launch = launcher.Launch(opened)
            launches.append(launch)
            token = launcher.LAUNCH.set(launch)  # the launcher flow's, its workers' and handlers'

            display.adopt_prefect_logging()
            signal.signal(signal.SIGINT, launch.on_signal)
            signal.signal(signal.SIGTERM, launch.on_signal)
            try:
                summary = launcher.train_flow(run, opened.regions, opened.cfg, str(root / "logs"),
                                              via=via)  # fmt: skip
            except (KeyboardInterrupt, CancelledRun):  # (its flow run ends Cancelled)
                console.print("[yellow]interrupted[/]: stopping learners and syncers (they "
                              "checkpoint)")  # fmt: skip
                launch.stop()
                console.print(f"resume with the same command (run {run!r})")
                return 130
            except launcher.WorkersGivenUp as exc:  # (its flow run ends Failed)
                summary = exc.summary
            except (launcher.RunTakenOver, StorageUnreachable, RunStalled) as exc:
                launch.stop()
                say_error(exc)
                return 1
            except Exception as exc:
                interrupted = launch.stopping.is_set()  # (before the stop below sets it)
                if (summary := _unrecorded(launch, exc, api_url, run)) is None:
                    return 130 if interrupted else 1
            finally:
                flush_prefect()
                launcher.LAUNCH.reset(token)
    return _report(summary, opened, root, time.perf_counter() - started, external)


def _unrecorded(launch: Launch, exc: Exception, api_url: str, run: str) -> dict | None:
    """Prefect's engine raises when it cannot record the flow run's end (the API gone):
    the run's own outcome still stands. The run's summary, or None if it has none (the
    workers are stopped: they checkpoint); ``exc`` again if the API is there."""
    from flows.worker import prefect_api_reachable

    summary = launch.summary
    if summary is None and prefect_api_reachable():
        raise exc
    launch.stop()
    console.print(f"[bold red]error:[/] the Prefect API at {api_url} is unreachable "
                  f"({type(exc).__name__}: {exc}); the launcher's flow run could not be "
                  "recorded", soft_wrap=True)  # fmt: skip
    if summary is None:
        console.print(f"the workers stopped (they checkpoint); resume with the same command "
                      f"(run {run!r})")  # fmt: skip
    return summary


def _report(summary: dict, opened: Run, root: Path, wall: float, external: str | None) -> int:
    """The run's end: its summary kept and shown, where to look next; the exit status."""
    from flows.watch import first_line

    run, regions = opened.name, opened.regions
    root.mkdir(parents=True, exist_ok=True)
    (root / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    stdout_console().print(train_summary_table(summary, f"diloco train {run} ({wall:.0f} s)"))
    console.print(
        f"summary: {root / 'summary.json'}  worker logs: {root / 'logs'}\n"
        f"inspect the buckets:  {_inspect_hint(regions[home_region(regions)], run)}\n"
        f"the curves in TensorBoard:  {_bin('tensorboard')} --logdir {root / 'tensorboard'}\n"
        + (f"browse the run in the Prefect UI:  {browse_command(root / 'prefect')}"
           if not external else f"Prefect UI: {external.removesuffix('/api')}")
    )  # fmt: skip
    for name, why in summary["given_up"].items():
        console.print(f"[bold red]gave up on {name}:[/] {first_line(why)}", soft_wrap=True)
    if summary["failed"]:
        console.print(f"the run went on without {', '.join(summary['failed'])}; see the logs")
        return 1
    return 0
