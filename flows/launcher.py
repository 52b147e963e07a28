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

import concurrent.futures
import contextlib
import contextvars
import logging
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
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
from flows.compile import share_compilations
from flows.display import Display
from flows.display import current as current_display
from flows.metrics import LiveMetrics
from flows.monitor import (
    QUIET_SECONDS,
    Monitor,
    RunStalled,
    cross_region_bytes,
    loss_plot_png,
    summary_markdown,
)
from flows.observe import artifact_key, outlive_the_reader, stopped, tag_flow_run
from flows.run import Run
from flows.run_lock import RunLock, RunTakenOver, held
from flows.supervision import (
    STAND_BY,
    STOP_SECONDS,
    LaunchMode,
    Via,
    launch_mode,
)
from flows.workers import run_workers
from infra.chaos import Chaos, ChaosPlan, kill_to_rejoin, percentiles, read_actions
from storage_layout import faults
from storage_layout.auth import LEARNER_KEY_ENV, RUN_SECRET_ENV, Keys, run_secret
from storage_layout.commit import CorruptVersion
from storage_layout.store import RunStore

log = logging.getLogger(__name__)

STOP_GRACE = STOP_SECONDS + 5.0  # a reap under way gets this long from a stopping launch
LAUNCH_ONLY = {"faults", "chaos"}  # pipeline settings a joiner does not take from a launch


def first_line(text: str) -> str:
    return text.splitlines()[0].removesuffix(":") if text else text


def reason(name: str, exc: BaseException) -> str:
    """Why worker ``name`` was given up: its error, less its name."""
    return str(exc).removeprefix(f"{name}: ")


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
        Python; ``signalled`` makes the watch raise it again (``_watch``)."""
        self.signalled.set()
        self.interrupt()
        raise KeyboardInterrupt


# The launch of the flow run in this context (``diloco train`` sets it; see ``Launch``).
LAUNCH: contextvars.ContextVar[Launch] = contextvars.ContextVar("diloco_launch")


REPORT_SECONDS = 10.0  # the watch waits at most this long for a report to the Prefect API


class BestEffort:
    """Calls for what only reports (a progress or summary artifact, the live metrics'
    tables): each run off the calling thread and waited for at most ``wait`` seconds, so
    an API that is gone (whose client retries for minutes) never holds up the watch or a
    Ctrl-C; one at a time per call (one still under way skips the next). A failure or a
    call that takes too long is logged by name, at most once every ``QUIET_SECONDS`` per
    call, and never raised: the run needs none of it. One per launch."""

    def __init__(self) -> None:
        self.reported: dict[str, float] = {}  # call -> when its failure was last logged
        self.running: dict[str, threading.Thread] = {}  # call -> its call still under way

    def __call__(self, call: Callable[..., Any], *args: Any, wait: float = REPORT_SECONDS,
                 **kwargs: Any) -> Any:  # fmt: skip
        """``call(*args, **kwargs)``'s result, or None."""
        name = getattr(call, "__name__", str(call))

        def report(what: str) -> None:
            now = time.monotonic()
            if now - self.reported.get(name, -math.inf) >= QUIET_SECONDS:
                self.reported[name] = now
                log.warning("%s %s; the run goes on without it", name, what)

        busy = self.running.get(name)
        if busy is not None and busy.is_alive():
            busy.join(wait)
            if busy.is_alive():
                report("is still waiting on an earlier call (the Prefect API may be down)")
                return None
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["value"] = call(*args, **kwargs)
            except Exception as exc:
                report(f"failed ({type(exc).__name__}: {str(exc)[:300]})")

        context = contextvars.copy_context()  # (the flow run's, for the artifacts' links)
        thread = threading.Thread(target=context.run, args=(run,), daemon=True, name=name)
        self.running[name] = thread
        thread.start()
        thread.join(wait)
        if wait > 0 and thread.is_alive():
            report(f"did not answer in {wait:.0f} s")
        return result.get("value")


def flush_prefect(timeout: float = 10.0) -> None:
    """Send the logs and events still queued to the API (before a local server stops)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=timeout)


def _watch(
    names: list[str],
    futures: list[Any],
    monitor: Monitor,
    bar: Any,
    every: float,
    log: Any,
    display: Display | None = None,
    metrics: LiveMetrics | None = None,
    stand_by: Callable[[str], tuple[str, Any] | None] | None = None,
    oom: Mapping[str, int] | None = None,
    report: BestEffort | None = None,
    signalled: threading.Event | None = None,
) -> dict[str, float]:
    """Evaluate and log progress every ``every`` seconds until every worker's task has
    ended; returns when each ended (its machine was freed: the end of its allocation).
    Each evaluation also updates the progress artifact, the live ``metrics`` and the
    ``display``; a live display also shows the learners' phases every few seconds. A
    syncer shard seen stalled gets a stand-by (``stand_by(name)``: the name and future of
    the worker it started, watched from then on like the others). ``oom``: how many times
    the OOM killer killed each worker (``LaunchMode.oom_kills``). ``signalled`` (the
    launch's: a Ctrl-C whose KeyboardInterrupt may have been swallowed on its way) ends
    the watch with a KeyboardInterrupt within half a second."""
    display, report = display or Display(), report or BestEffort()
    last_eval, last_look = time.monotonic(), time.monotonic()
    ended: dict[str, float] = {}
    given_up: list[str] = []
    started = False  # every learner has started up: progress lines from then on
    # The thread pool's own futures, waited on plainly: ``prefect.futures.wait`` with a
    # timeout arms an asynchronous exception (an alarm signal in the main thread), which
    # can land inside a lock and end a run with "release unlocked lock".
    pool = [f.wrapped_future for f in futures]
    while True:
        if signalled is not None and signalled.is_set():
            raise KeyboardInterrupt
        running = concurrent.futures.wait(pool, timeout=0.5).not_done
        _note_ends(names, pool, ended, given_up, log)
        if not running:
            return ended
        if time.monotonic() - last_eval < every:
            if display.live and time.monotonic() - last_look >= LOOK_SECONDS:
                last_look = time.monotonic()  # (a failed read shows the last state read)
                show_phases(display, monitor.statuses(), monitor.versions(), oom=oom)
            continue
        last_eval = last_look = time.monotonic()
        errors, statuses = monitor.errors, monitor.statuses()
        point = _evaluate(monitor, statuses, errors, every, log)
        if point is None:
            continue
        pct = monitor.progress(statuses)
        verdicts = monitor.verdicts(statuses)
        still = monitor.standstill(point["versions"], verdicts)
        if still is not None:  # why, in place of the same progress line again
            log.warning("%5.1f%% | %s", pct, still[1], extra=SHOWN)
        if still is not None and monitor.hopeless(still[0], verdicts):
            raise RunStalled(
                f"the run cannot make progress by itself: {still[1]}. Every learner not done "
                "is silent and nobody takes its slot (a hung process holds it, or a dead one "
                "is not restarted): mend that, and the same command resumes the run"
            )
        for name in monitor.stalled_syncers(statuses, point["versions"]):
            extra = stand_by(name) if stand_by is not None else None
            if extra is not None:  # watched from now on like the others
                names.append(extra[0])
                futures.append(extra[1])
                pool.append(extra[1].wrapped_future)
        if bar is not None:
            report(update_progress_artifact, bar, pct, progress_note(monitor, statuses))
        show_phases(display, statuses, point["versions"], point, pct, oom)
        if metrics is not None:
            report(report_metrics, metrics, monitor, point, statuses, log)
        if still is None:  # (else said above)
            started = _progress_line(log, statuses, point, pct, oom, started)


def _evaluate(monitor: Monitor, statuses: dict[str, dict], errors: int, every: float,
              log: Any) -> dict[str, Any] | None:  # fmt: skip
    """The newest versions' evaluation, or None when it failed (said: the workers go on,
    and so does watching them); storage is said to answer again if no read failed since
    the monitor counted ``errors``."""
    try:
        point = monitor.evaluate(statuses)
    except CorruptVersion as exc:
        log.error("evaluation failed, trying again in %.0f s: %r", every, exc)
        return None
    except Exception as exc:
        monitor.storage_error("evaluating the newest versions", exc)
        return None
    if monitor.errors == errors:
        monitor.storage_ok()
    return point


def _note_ends(names: list[str], pool: list[Any], ended: dict[str, float],
               given_up: list[str], log: Any) -> None:  # fmt: skip
    """Note when each worker whose task ended since the last look ended; name each one
    given up (a stand-by's end is only noted)."""
    for name, future in zip(names, pool, strict=True):
        if future.done() and name not in ended:
            ended[name] = time.time()
            why = None if name.endswith(STAND_BY) else failure(future)
            if why is not None:
                given_up.append(name)
                log.error("%s", given_up_line(name, why, names, given_up))


def _progress_line(log: Any, statuses: dict[str, dict], point: dict[str, Any], pct: float,
                   oom: Mapping[str, int] | None, started: bool) -> bool:  # fmt: skip
    """Log where the learners' start-up is until every learner has started, then the
    progress line; returns whether they all have (``started``: they had already)."""
    starting = None if started else startup_line(statuses, point["versions"], oom)
    if starting:
        log.info("%s | validation loss %.4f", starting, point["loss"], extra=SHOWN)
        return False
    restarting = Counter(s.get("state") for s in statuses.values() if s.get("state") in STARTUP)
    log.info(
        "%5.1f%% | tokens %s | validation loss %.4f | versions %s%s",
        pct,
        f"{point['tokens']:,}",
        point["loss"],
        " ".join(f"f{p}:v{v}" for p, v in point["versions"].items()),
        "".join(f" | {n} restarting ({phase})" for phase, n in restarting.items()),
        extra=SHOWN,
    )
    return True


def stop_asked(exc: BaseException) -> bool:
    """Whether the launcher ends because the run was told to stop (Ctrl-C, a signal, the
    UI's cancel: ``TerminationSignal``) or cannot go on (``RunStalled``), not because the
    launcher itself failed."""
    from prefect.exceptions import TerminationSignal

    return isinstance(exc, KeyboardInterrupt | TerminationSignal | RunStalled)


def progress_note(monitor: Monitor, statuses: dict[str, dict[str, Any]]) -> str:
    """The progress artifact's description: what it measures, and who trains where."""
    return (f"run {monitor.store.run}: share of all learners' inner steps done; "
            f"{monitor.by_region(statuses)}")  # fmt: skip


def failure(future: concurrent.futures.Future) -> BaseException | None:
    """The error a worker's finished task (its thread's future: a Prefect state) ended
    with; None when it ended well or was cancelled."""
    if future.cancelled():
        return None
    outcome = future.exception() or future.result()
    if isinstance(outcome, State) and outcome.is_failed():
        error = outcome.result(raise_on_failure=False)
        return error if isinstance(error, BaseException) else RuntimeError(outcome.message)
    return outcome if isinstance(outcome, BaseException) else None


def given_up_line(name: str, exc: BaseException, names: list[str], given_up: list[str]) -> str:
    """What the launcher says as it gives ``name`` up (``exc``: why), the moment it does:
    and, for a learner, when its region has no learner left (``names``: every worker
    watched; ``given_up``: those given up so far, ``name`` included)."""
    line = f"gave up on {name} ({first_line(reason(name, exc))}): the run goes on without it"
    region = name.split(" ")[-1].split("/")[0]
    mates = [n for n in names if n.startswith(f"learner {region}/")]
    if name.startswith("learner ") and set(mates) <= set(given_up):
        line += f"; region {region} has no learner left"
    return line


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


LOOK_SECONDS = 2.0  # how often a live display shows the learners' phases between evaluations
SHOWN = {"display": True}  # log lines a live display shows instead (flows/display.py)


def show_phases(
    display: Display,
    statuses: dict[str, dict[str, Any]],
    versions: dict[int, int],
    point: dict[str, Any] | None = None,
    pct: float | None = None,
    oom: Mapping[str, int] | None = None,
) -> None:
    """Set the display's learner, first-contribution and training phases from the
    learners' status objects and the newest versions (and ``point``, an evaluation)."""
    if not display.live:
        return
    counts, detail = learner_phases(statuses, oom)
    display.phase("learners", "running" if any(counts.get(p) for p in STARTUP) else "done", detail)
    shown = " ".join(f"f{p}:v{v}" for p, v in versions.items())
    if any(v > 0 for v in versions.values()):
        if display.state("first") != "done":  # the first versions merged, and when
            display.phase("first", "done", f"versions {shown}")
    else:
        display.phase("first", "running", "waiting for the first contribution to be merged")
    if counts.get("training") or counts.get("done") or any(v > 0 for v in versions.values()):
        display.phase("training", "running", "")
    if point is not None and pct is not None:
        display.progress(pct, f"tokens {point['tokens']:,} · validation loss "
                              f"{point['loss']:.4f} · versions {shown}")  # fmt: skip


def report_metrics(
    metrics: LiveMetrics,
    monitor: Monitor,
    point: dict[str, Any],
    statuses: dict[str, dict[str, Any]],
    log: Any,
) -> None:
    """Add what is new to the live metrics (TensorBoard, Prefect tables); a failure is
    logged and the run goes on."""
    try:
        traffic, learner_bytes, _ = monitor.traffic()
        extra = {
            "goodput/so_far": monitor.goodput_so_far(point, statuses),
            "bytes/learners_up_down": learner_bytes,
            "bytes/cross_region": cross_region_bytes(traffic),
        }
        metrics.tick(point, extra, statuses)
    except Exception as exc:  # (logged by name, once a minute per kind)
        monitor.storage_error("updating the live metrics", exc)


# A learner's start-up phases, in order, as its status object names them (``starting``:
# no word from it yet: its process starts, imports, opens its flow run).
STARTUP = ("starting", "compiling", "resuming")


def learner_phases(
    statuses: dict[str, dict[str, Any]], oom: Mapping[str, int] | None = None
) -> tuple[Counter, str]:
    """How many learners are in each state (start-up phases first, then training), and
    that as text: ``1 compiling, 3 training``; with ``oom`` (worker -> OOM kills), those
    the OOM killer killed, and how often."""
    counts = Counter(s.get("state") or "starting" for s in statuses.values())
    order = [*STARTUP, "training", *sorted(set(counts) - {*STARTUP, "training"})]
    text = ", ".join(f"{counts[phase]} {phase}" for phase in order if counts.get(phase))
    oom = {w: n for w, n in dict(oom or {}).items() if n and w in statuses}
    if oom:  # restarted after each, it shows "compiling" most of the time: say so apart
        text += " (" + ", ".join(f"{w} OOM-killed {n}x" for w, n in sorted(oom.items())) + ")"
    return counts, text


def startup_line(
    statuses: dict[str, dict[str, Any]],
    versions: dict[int, int],
    oom: Mapping[str, int] | None = None,
) -> str | None:
    """What the run is doing while it starts, instead of a progress line at 0 %: how many
    learners are in each phase, and whether a contribution has been merged yet. None once
    every learner trains and a version beyond 0 exists (from then on the watch loop logs
    progress, and names the learners that are restarting)."""
    counts, learners = learner_phases(statuses, oom)
    merged = any(v > 0 for v in versions.values())
    if merged and not any(counts.get(phase) for phase in STARTUP):
        return None
    first = "first versions published" if merged else "waiting for the first contribution"
    return f"starting up | learners: {learners} | {first}"


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


def worker_faults(cfg: RunConfig, folder: Path, log: Any) -> faults.FaultPlan | None:
    """The storage fault plan the run's workers get (``pipeline.faults``), checked before
    the run starts: one ``t0`` for all (a restarted worker keeps the outage window) and a
    shared fault log, ``folder/faults.jsonl``. The launcher itself stays fault-free."""
    if not cfg.pipeline.faults:
        return None
    data = {"log_path": str(folder / "faults.jsonl"), **cfg.pipeline.faults, "t0": time.time()}
    plan = faults.FaultPlan.from_dict(data, source="pipeline.faults")
    log.warning("the workers run with injected storage faults: %s", plan.to_json())
    return plan


def start_chaos(plan: ChaosPlan, folder: Path, mode: LaunchMode, log: Any,
                monitor: Monitor | None = None) -> Chaos | None:  # fmt: skip
    """The process chaos driver over the launch's live worker processes (``mode.live``),
    if ``plan`` acts; its actions at shares of the run follow the learners' status
    objects (``monitor``)."""
    if not plan.active:
        return None
    if not mode.local:
        log.warning("pipeline.chaos needs the workers as local processes; no chaos")
        return None

    def progress() -> tuple[float, set[str]]:
        assert monitor is not None
        statuses, cap = monitor.statuses(), monitor.cfg.learner_step_cap
        steps = sum(min(int(s.get("step", 0)), cap) for s in statuses.values())
        training = {lid for lid, s in statuses.items() if s.get("state") == "training"}
        return steps / monitor.cfg.budget_steps, training

    log.warning("chaos on: %s; its actions go to %s", plan.model_dump(), folder / "chaos.jsonl")
    return Chaos(plan, mode.live, folder / "chaos.jsonl", log,
                 progress if monitor else None).start()  # fmt: skip


def failure_report(store: RunStore, spec: dict, folder: Path,
                   missed: list[str] | None = None) -> dict[str, Any]:  # fmt: skip
    """What was done to the run on purpose (chaos actions and injected storage faults,
    by kind), the chaos actions at shares of the run that were ``missed`` (it ended
    first), and what a learner kill cost: the seconds to its next contribution."""
    actions = read_actions(folder / "chaos.jsonl")
    injected = read_actions(folder / "faults.jsonl")
    kills = [a for a in actions if a["action"] == "kill_learner"]
    for fault in injected:  # a learner's own death during an upload or checkpoint write
        parts = fault["key"].split("/")
        if fault["kind"] == "crash" and "learners" in parts:
            kills.append({"time": fault["time"], "worker": parts[parts.index("learners") + 1]})
    return {
        "actions": dict(Counter(a["action"] for a in actions)),
        "missed": list(missed or []),
        "faults": dict(Counter(f["kind"] for f in injected)),
        "kill_to_rejoin": percentiles(kill_to_rejoin(store, spec, kills)),
    }


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
    opened = launch.run if launch.run is not None else Run.start(run, regions, cfg)
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
    """The launch mode ``via`` names (``supervision.LAUNCH_MODES``), with the run's lock
    held and the run's contributions signed (``authenticate``)."""
    # Workers share a persistent JAX compilation cache: a restarted learner does not
    # compile its step again (the variables reach them, and the spares, through
    # child_env()).
    share_compilations(Path(logs).parent / "jax-cache")
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
    metrics = LiveMetrics(store, opened.spec, folder, log=log)  # runs/NAME/tensorboard
    log.info("live metrics: tensorboard --logdir %s", metrics.dir)
    report_metrics(metrics, monitor, first, monitor.statuses(), log)
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
        report(report_metrics, metrics, monitor, monitor.curve[-1], statuses, log, wait=60.0)
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
        ended = _watch(names, futures, monitor, bar, cfg.pipeline.eval_seconds, log, display,
                       metrics, stand_by.start, mode.oom_kills, report, signalled)  # fmt: skip
    except BaseException as exc:
        if mode.outlives_launcher and not mode.stopping.is_set() and not stop_asked(exc):
            log.error("the launcher ends (%r); the workers' flow runs go on in their regions: "
                      "run the train deployment again, and it adopts them", exc)  # fmt: skip
            raise
        # Cancelled from the UI (the worker's SIGTERM) or interrupted: the workers stop with
        # this flow run (each checkpoints) rather than run on unsupervised.
        if not mode.stopping.is_set():
            mode.interrupt()
        report(mode.reap, wait=STOP_GRACE)
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
    summary = monitor.summary(wall, allocated)
    summary["failed"], summary["given_up"] = list(failed), failed
    if cfg.pipeline.faults or chaos_plan.active:
        summary["chaos"] = failure_report(store, spec, folder, chaos.missed if chaos else [])
    png = loss_plot_png(monitor.curve, f"run {run}", metrics.training_curve())
    store.home.put(f"{run}/metrics/loss.png", png)
    report(
        create_markdown_artifact,
        summary_markdown(summary, png),
        key=artifact_key(run, "summary"),
        description=f"run {run}: summary and loss curve",
    )
    display.phase("finishing", "done", f"summary: Prefect artifact {artifact_key(run, 'summary')}")
    return summary
