"""The launcher flow: write the run spec, start every learner and syncer shard through a
launch mode, watch the run through the buckets, and report.

Each worker is a Prefect task run of this flow (``learner us-east/2``) that a launch mode
(``flows.supervision``: local processes, or deployments' flow runs) keeps going under the
one restart policy: the new process resumes from the buckets. Only a worker that fails
``pipeline.max_failed_starts`` times in a row without progress (a learner's step, a
syncer's versions) is given up: it is named with its last error, the launcher records it
in its status object, and syncers stop waiting for a learner given up. Nothing passes
between the processes but the buckets.

While they run, the launcher evaluates the newest global versions every
``pipeline.eval_seconds`` (the held-out loss of the model the syncers publish), logs a
progress line and updates a progress artifact. At the end it writes the summary as a
markdown artifact with the loss curve.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    update_progress_artifact,
)
from prefect.states import Failed, State
from prefect.task_runners import ThreadPoolTaskRunner

from diloco.config import (
    RunConfig,
    deep_merge,
    load_config,
    parse_override,
    validate_config,
)
from flows.compile import share_compilations, user_cache
from flows.display import Display
from flows.display import current as current_display
from flows.launch_chaos import failure_report, start_chaos, worker_faults
from flows.launch_modes import Via, launch_mode
from flows.metrics import LiveMetrics
from flows.monitor import Monitor, RunStalled
from flows.observe import BestEffort, artifact_key, outlive_the_reader, stopped, tag_flow_run
from flows.run import Run
from flows.run_lock import RunLock, RunTakenOver, held
from flows.sinks import check_sinks, open_sinks
from flows.summary import run_plot, run_summary, summary_markdown
from flows.supervision import STAND_BY, STOP_SECONDS, LaunchMode
from flows.watch import (
    first_line,
    progress_note,
    reason,
    report_metrics,
    show_phases,
    watch,
)
from flows.workers import run_workers
from infra.chaos import ChaosPlan
from storage_layout import faults
from storage_layout.auth import LEARNER_KEY_ENV, RUN_SECRET_ENV, Keys, run_secret
from storage_layout.store import RunStore

log = logging.getLogger(__name__)

STOP_GRACE = STOP_SECONDS + 5.0  # a reap under way gets this long from a stopping launch
LAUNCH_ONLY = {"faults", "chaos"}  # pipeline settings a joiner does not take from a launch


class WorkersGivenUp(RuntimeError):
    """The run ended with workers given up (each named with why, ``summary["given_up"]``):
    the others trained on without them. The train flow run ends Failed with this, so no
    view calls the run Completed; ``summary`` is the run's, written as usual."""

    def __init__(self, summary: dict[str, Any]):
        self.summary = summary
        super().__init__(
            "gave up on "
            + "; ".join(f"{name} ({first_line(why)})" for name, why in summary["given_up"].items())
        )


class Launch:
    """A launch under way, as its caller (``diloco train``), its signal handlers and its
    run lock reach it: ``interrupt`` asks every worker to checkpoint and stop (exits are
    then expected, not restarted), ``stop`` also waits for them and kills what is left,
    and ``summary`` is the run's once it has one (should the API not record the flow
    run's end). A caller that makes one puts it in ``LAUNCH`` before it calls
    ``train_flow``; a flow run of the train deployment makes its own."""

    def __init__(self, run: Run | None = None) -> None:
        self.run = run  # the run, if its caller started it already (``Run.start``)
        self.stopping = threading.Event()
        self.signalled = threading.Event()  # a SIGINT or SIGTERM: the watch ends on it too
        self.mode: LaunchMode | None = None
        self.summary: dict[str, Any] | None = None

    def interrupt(self) -> None:
        self.stopping.set()
        if self.mode is not None:
            self.mode.interrupt()

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        self.interrupt()
        if self.mode is not None:
            self.mode.reap(timeout)

    def on_signal(self, signum: int, frame: Any) -> None:
        """SIGINT / SIGTERM in the launcher: ask the workers to checkpoint and stop right
        away (the flow's task runner waits for them), then unwind as a KeyboardInterrupt.
        One raised inside a garbage collector callback (JAX has some) is swallowed by
        Python; ``signalled`` makes the watch raise it again (``watch``)."""
        self.signalled.set()
        self.interrupt()
        raise KeyboardInterrupt


# The launch of the flow run in this context (``diloco train`` sets it; see ``Launch``).
LAUNCH: contextvars.ContextVar[Launch] = contextvars.ContextVar("diloco_launch")


def stop_asked(exc: BaseException) -> bool:
    """Whether the launcher ends because the run was told to stop (Ctrl-C, a signal, the
    UI's cancel: ``TerminationSignal``) or cannot go on (``RunStalled``), not because the
    launcher itself failed."""
    from prefect.exceptions import TerminationSignal

    return isinstance(exc, KeyboardInterrupt | TerminationSignal | RunStalled)


class StandBys:
    """Second processes for stalled syncer shards (``LaunchMode.stand_by``), one per shard
    while it lives: each resumes from the newest committed version and publishes the next
    ones; should the stalled one wake up, the commit protocol fences one of the two at
    each version (never a version twice). A second stand-by would only fence the first."""

    def __init__(self, mode: LaunchMode, syncers: Mapping[str, Any], log: Any):
        self.mode, self.syncers, self.log = mode, syncers, log
        self.running: dict[str, Any] = {}  # syncer shard -> its stand-by's future

    def start(self, name: str) -> tuple[str, Any] | None:
        """A stand-by for shard ``name`` (its name and future), or None: the run stops,
        one runs already, or this launch mode starts none."""
        if name not in self.syncers or self.mode.stopping.is_set():
            return None
        if name in self.running and not self.running[name].wrapped_future.done():
            self.log.warning("%s: its stand-by is running already; no second one", name)
            return None
        extra = self.mode.stand_by(self.syncers[name])
        if extra is None:
            self.log.warning("%s: no stand-by syncer (workers run as deployments' flow runs)",
                             name)  # fmt: skip
            return None
        self.running[name] = extra[1]
        self.log.warning("%s: starting a stand-by for fragments %s; the two are fenced by the "
                         "commit protocol", name, self.syncers[name].status[2])  # fmt: skip
        return extra


def authenticate(run: str, folder: Path, local: bool, log: Any, store: RunStore) -> str | None:
    """Sign the run's contributions: the run secret is ``DILOCO_RUN_SECRET`` or, if that
    is not set, one kept in ``folder/run-secret`` (made on the first launch, mode 0600), so
    a resumed run keeps its keys; one that is not the run's (its fingerprint in the
    bucket differs) is refused. Deployments' workers take theirs from their work pools
    (None). The secret is returned, never logged, and never a flow or task parameter:
    Prefect records those. ``local``: the launch's workers are processes here."""
    if not local:
        log.info("contributions are authenticated if the work pools set %s (syncers) and %s "
                 "(learners); see docs/deploy.md", RUN_SECRET_ENV, LEARNER_KEY_ENV)  # fmt: skip
        return None
    secret, source = run_secret(folder / "run-secret")
    assert secret is not None  # (made if there is none)
    store.check_secret(secret, source)
    log.info("contributions are signed: each learner gets its own key, the syncers the run "
             "secret (from %s)", source)  # fmt: skip
    return secret


def default_run_dir(run: str) -> Path:
    """Where a run started without ``logs`` keeps its local files (a deployment's flow run
    starts in a temporary folder): ``$DILOCO_DIR/RUN``, by default ``~/diloco-runs/RUN``."""
    return Path(os.environ.get("DILOCO_DIR") or "~/diloco-runs").expanduser() / run


def launch_config(
    config: RunConfig | None, preset: str = "tiny", overrides: list[str] | None = None
) -> RunConfig:
    """The run's config: ``config`` as it came (validated once, where it was made: by
    ``diloco train``, or by the flow's parameter check from a deployment's JSON) or else
    ``preset``, then ``overrides`` (``KEY=VALUE``, as ``--set``) laid over it; a wrong
    field fails naming it."""
    if config is None:
        return load_config(preset, overrides=overrides or [])
    if not overrides:
        return config
    raw = config.model_dump(mode="json")
    for text in overrides:
        raw = deep_merge(raw, parse_override(text))
    return validate_config(raw)


@flow(
    name="train",
    flow_run_name="train {run}",
    persist_result=False,
    task_runner=ThreadPoolTaskRunner(max_workers=64),
)
def train_flow(
    run: str,
    regions: dict[str, str],
    config: RunConfig | None = None,
    logs: str | None = None,
    via: Via = "processes",
    preset: str = "tiny",
    overrides: list[str] | None = None,
) -> dict[str, Any] | State:
    """Run ``run`` to its end across ``regions``; the same name resumes it (a run stopped
    by a signal ends its flow run Cancelled).

    Its flow run is tagged ``run:RUN``, ``launcher`` and ``via:VIA``, and every learner
    and syncer flow run it starts is linked under it as a subflow, in both modes.

    Args:
        run: the run's name (letters, digits, dashes)
        regions: region -> bucket URL (s3://, gs://, file://); the first is the syncers' home
        config: a whole RunConfig (what `diloco train` passes; from a deployment or the
            UI, its JSON, checked field by field once); if not given, the preset with the
            overrides
        logs: a folder for the worker processes' output (default
            $DILOCO_DIR/RUN/logs, DILOCO_DIR defaulting to ~/diloco-runs)
        via: "processes" starts the learners and syncers as processes beside this flow
            run; "deployments" as flow runs of the learner/REGION and syncer/REGION
            deployments, picked up by each region's work pool
        preset: tiny, small, base or large
        overrides: config fields as KEY=VALUE, as `diloco train --set` takes them, e.g.
            budget.tokens=1000000 or topology.quorum=3
    """
    log = get_run_logger()
    outlive_the_reader()  # a deployment's: its worker may die first
    tag_flow_run([f"run:{run}", "launcher", f"via:{via}"])
    launch_mode(via)  # (one that exists)
    cfg = launch_config(config, preset, overrides)
    check_sinks(cfg.pipeline.sinks)  # (their libraries installed)
    logs = logs or str(default_run_dir(run) / "logs")
    launch = LAUNCH.get(None) or Launch()
    launch.stopping.clear()
    launch.signalled.clear()
    try:
        summary = _train(run, regions, cfg, logs, via, launch, log)
    except KeyboardInterrupt:
        if not launch.signalled.is_set():
            raise
        # Stopped by its user (Ctrl-C, SIGTERM): the flow run ends Cancelled, not Crashed
        # ("Crash detected!", an error in the log and the UI), and `diloco train` says so.
        return stopped(f"stopped by a signal: the learners and syncers checkpoint; run "
                       f"{run!r} resumes where it stopped")  # fmt: skip
    except RunStalled as exc:  # named, not a traceback: the flow run ends Failed saying it
        log.error("%s", exc)
        return Failed(message=str(exc), data=exc)
    if summary["failed"]:  # the run went on without them: its flow run does not say Completed
        given_up = WorkersGivenUp(summary)
        log.error("%s", given_up)
        return Failed(message=str(given_up), data=given_up)
    return summary


def _train(
    run: str, regions: dict[str, str], cfg: RunConfig, logs: str, via: str, launch: Launch,
    log: Any,
) -> dict[str, Any]:  # fmt: skip
    """``train_flow``'s body, its arguments checked: the run from its spec to its summary."""
    folder = Path(logs).parent
    folder.mkdir(parents=True, exist_ok=True)
    fault_plan = worker_faults(cfg, folder, log)  # both checked before anything is committed
    chaos_plan = ChaosPlan(**cfg.pipeline.chaos)
    current_display().phase("spec", "running", "writing the run spec and version 0, evaluating it")
    opened = (
        launch.run
        if launch.run is not None
        else Run.start(run, regions, cfg, faults.Injector.from_env())
    )
    regions, cfg = opened.regions, opened.cfg
    store = opened.store("launcher")
    lock = held(run)  # `diloco train` took it before starting its Prefect server
    with contextlib.ExitStack() as stack:
        if lock is None:  # a flow run of the train deployment: one launcher per run here too
            lock = RunLock(store, log, on_lost=lambda who: launch.interrupt()).acquire()
            stack.callback(lock.release)
        # for machines that join later (``diloco join``): this launch's settings, less
        # its fault injection
        store.put_pipeline(cfg.pipeline.model_dump(mode="json", exclude=LAUNCH_ONLY))
        mode = launch.mode = _launch_mode(launch, run, regions, cfg, logs, via, store, log,
                                          fault_plan)  # fmt: skip
        stack.callback(mode.close)
        summary = _launch(opened, logs, store, chaos_plan, lock, mode, log, launch.signalled)
    launch.summary = summary  # (should the API not record the flow run's end)
    return summary


def _launch_mode(
    launch: Launch,
    run: str,
    regions: dict[str, str],
    cfg: RunConfig,
    logs: str,
    via: str,
    store: RunStore,
    log: Any,
    fault_plan: faults.FaultPlan | None,
) -> LaunchMode:
    """The launch mode ``via`` names (``flows.launch_modes.LAUNCH_MODES``), with the run's lock
    held and the run's contributions signed (``authenticate``)."""
    # Workers share this machine's persistent JAX compilation cache, as a joiner and a
    # deployment's learner do: a restarted learner, and the next run of the same model
    # here, load their programs instead of compiling them (the variables reach the
    # workers, and the spares, through child_env()).
    share_compilations(user_cache() / "jax")
    kind = launch_mode(via)
    secret = authenticate(run, Path(logs).parent, kind.local, log, store)
    return kind.for_launch(run, regions, cfg, Path(logs), launch.stopping, log, secret, fault_plan)


def _first_look(opened: Run, monitor: Monitor, store: RunStore, folder: Path,
                display: Display, report: BestEffort, log: Any) -> tuple[dict, LiveMetrics, Any]:  # fmt: skip
    """The run's start, said: the validation loss of the versions it starts from (logged,
    on the display, in TensorBoard) and the progress artifact. Returns that evaluation,
    the live metrics and the progress artifact (None if it could not be made)."""
    run, regions, cfg = opened.name, opened.regions, opened.cfg
    first = monitor.evaluate(monitor.statuses())
    monitor.remember_start(first)
    log.info("run %s: %d learners in %s, validation loss %.4f at versions %s", run,
             cfg.topology.learners, ", ".join(regions), first["loss"], first["versions"])  # fmt: skip
    display.phase("spec", "done", f"{cfg.topology.learners} learners in {', '.join(regions)}; "
                  f"validation loss {first['loss']:.4f}")  # fmt: skip
    sinks = open_sinks(cfg.pipeline.sinks, run, folder, log)  # (W&B's files under folder)
    metrics = LiveMetrics(store, opened.spec, folder, log=log, sinks=sinks)  # + tensorboard/
    log.info("live metrics: tensorboard --logdir %s", metrics.dir)
    report_metrics(metrics, monitor, first, monitor.statuses())
    bar = report(
        create_progress_artifact,
        monitor.progress(monitor.statuses()),
        key=artifact_key(run, "progress"),
        description=f"run {run}: share of all learners' inner steps done",
    )
    return first, metrics, bar


def _given_up(names: list[str], futures: list[Any], log: Any) -> dict[str, str]:
    """The workers given up, each with why (a stand-by's failure is only said: the
    shard's own process is judged, not its help)."""
    failed: dict[str, str] = {}
    for name, future in zip(names, futures, strict=True):
        try:
            future.result()
        except Exception as exc:
            if name.endswith(STAND_BY):
                log.warning("%s failed: %s", name, exc)
                continue
            failed[name] = reason(name, exc)
    return failed


def _last_look(monitor: Monitor, metrics: LiveMetrics, bar: Any, report: BestEffort,
               log: Any) -> None:  # fmt: skip
    """The final evaluation, the progress artifact and TensorBoard brought to the end."""
    try:
        monitor.evaluate(monitor.statuses())
    except Exception as exc:  # the summary still reports the curve so far
        log.error("final evaluation failed: %r", exc)
    statuses = monitor.statuses()
    if bar is not None:
        report(update_progress_artifact, bar, monitor.progress(statuses),
               progress_note(monitor, statuses))  # fmt: skip
    if monitor.curve:
        report(report_metrics, metrics, monitor, monitor.curve[-1], statuses, wait=60.0)
    metrics.close()


def _launch(
    opened: Run,
    logs: str,
    store: RunStore,
    chaos_plan: ChaosPlan,
    lock: RunLock,
    mode: LaunchMode,
    log: Any,
    signalled: threading.Event | None = None,
) -> dict[str, Any]:
    """The launch itself, with the run's lock held, its workers started by ``mode``."""
    run, regions, cfg, spec = opened.name, opened.regions, opened.cfg, opened.spec
    folder = Path(logs).parent
    display = current_display()
    report = BestEffort()
    Path(logs).mkdir(parents=True, exist_ok=True)
    keys = Keys(run, mode.secret)  # (deployments' workers hold theirs: None here)
    monitor = Monitor(opened, store, log, mode.deaths, verifying_key=keys.verifying_key)
    first, metrics, bar = _first_look(opened, monitor, store, folder, display, report, log)
    started = time.time()
    workers = run_workers(run, regions, cfg, spec)
    names = [w.name for w in workers]
    futures = [mode.start(w) for w in workers]
    show_phases(display, monitor.statuses(), first["versions"], oom=mode.oom_kills)
    chaos = start_chaos(chaos_plan, folder, mode, log, monitor)
    syncers = {w.name: w for w in workers if w.role == "syncer"}
    stand_by = StandBys(mode, syncers, log)
    try:
        ended = watch(names, futures, monitor, bar, cfg.pipeline.eval_seconds, log, display,
                       metrics, stand_by.start, mode.oom_kills, report, signalled)  # fmt: skip
    except BaseException as exc:
        _on_exit(mode, exc, report, log)
        raise
    finally:
        if chaos is not None:
            chaos.stop()
    if lock.lost:
        raise RunTakenOver(f"run {run} was taken over by {lock.lost}; this launcher stopped "
                           "its workers")  # fmt: skip
    failed = _given_up(names, futures, log)
    display.phase("training", "failed" if failed else "done")
    display.phase("finishing", "running", "final evaluation, summary, loss curve")
    now = time.time()
    wall = now - started
    monitor.wait_for_storage()
    monitor.learners(fresh=True)  # every learner a joiner added, to the last
    # Allocated learner time: each learner from the launch until its worker ended.
    allocated = sum(ended.get(n, now) - started for n in names if n.startswith("learner"))
    _last_look(monitor, metrics, bar, report, log)
    summary = run_summary(monitor, wall, allocated)
    summary["failed"], summary["given_up"] = list(failed), failed
    if cfg.pipeline.faults or chaos_plan.active:
        summary["chaos"] = failure_report(store, spec, folder, chaos.missed if chaos else [])
    png = run_plot(summary, monitor.curve, metrics, f"run {run}")
    store.home.put(f"{run}/metrics/loss.png", png)
    report(create_markdown_artifact, summary_markdown(summary, png),
           key=artifact_key(run, "summary"), description=f"run {run}: summary and loss curve")  # fmt: skip
    display.phase("finishing", "done", f"summary: Prefect artifact {artifact_key(run, 'summary')}")
    return summary


def _on_exit(mode: LaunchMode, exc: BaseException, report: BestEffort, log: Any) -> None:
    """The launcher ends with ``exc`` before its run does: a deployment's workers go on in
    their regions (a launcher run again adopts them); otherwise (cancelled from the UI,
    the worker's SIGTERM, or interrupted) the workers stop with it, each checkpointing,
    rather than run on unsupervised."""
    if mode.outlives_launcher and not mode.stopping.is_set() and not stop_asked(exc):
        log.error("the launcher ends (%r); the workers' flow runs go on in their regions: "
                  "run the train deployment again, and it adopts them", exc)  # fmt: skip
        return
    if not mode.stopping.is_set():
        mode.interrupt()
    report(mode.reap, wait=STOP_GRACE)
