"""The launcher flow: write the run spec, start every learner and syncer shard as its own
process, watch the run through the buckets, and report.

Each worker is a Prefect task run of this flow (``learner us-east/2``) that starts
``python -m flows.worker ...`` as a nested task run (``start learner us-east/2``) and
waits for it. A process that dies (a crash, a SIGKILL, a region that stays down) fails
its ``start`` task run and is started again, with backoff, for as long as the run lasts:
the new process resumes from the buckets. Only a worker that fails
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
import contextvars
import json
import logging
import math
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from prefect import flow, get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.settings import PREFECT_API_URL
from prefect.task_runners import ThreadPoolTaskRunner

from diloco.config import (
    RunConfig,
    deep_merge,
    load_config,
    parse_override,
    validate_config,
)
from diloco.topology import (
    LEARNER_PREFIX,
    home_region,
)
from flows import memory
from flows.display import Display
from flows.display import current as current_display
from flows.metrics import LiveMetrics
from flows.monitor import (
    QUIET_SECONDS,
    Monitor,
    cross_region_bytes,
    loss_plot_png,
    summary_markdown,
)
from flows.observe import (
    PARENT_FLOW_RUN_ENV,
    PARENT_TASK_RUN_ENV,
    artifact_key,
    parent_env,
    tag_flow_run,
)
from flows.run import initialize_run, worker_done
from flows.run_lock import RunLock, RunTakenOver, held
from flows.spares import Spares
from flows.worker import API_DOWN, PARENT_ENV, prefect_api_reachable
from flows.workers import Status, run_workers
from infra.chaos import Chaos, ChaosPlan, kill_to_rejoin, percentiles, read_actions
from infra.processes import read_pids, stop_leftovers, write_pids
from storage_layout import faults
from storage_layout.auth import LEARNER_KEY_ENV, RUN_SECRET_ENV, learner_key, run_secret
from storage_layout.commit import CorruptVersion
from storage_layout.store import RunStore

log = logging.getLogger(__name__)

STOPPING = threading.Event()  # set on Ctrl-C: exits are then expected, not retried
_children: set[subprocess.Popen] = set()
_workers: dict[str, subprocess.Popen] = {}  # writer id -> its live process (for chaos)
_starts: Counter[str] = Counter()  # writer id -> processes started
# Writer id -> (when, state) of its newest process's death by a signal, shown as its
# state until a new process of it reports (its status object still names the phase the
# dead one was in), and how many times the OOM killer killed it.
_deaths: dict[str, tuple[float, str]] = {}
_oom_kills: Counter[str] = Counter()
OOM_KILLED = "killed by the OOM killer"
_lock = threading.Lock()
# Run -> the fault plan its workers run under (DILOCO_FAULTS), if any.
_FAULT_ENV: dict[str, dict[str, str]] = {}


# Run -> its secret, for the worker processes' environments. Never a flow or task
# parameter: Prefect records those.
_RUN_SECRETS: dict[str, str] = {}
STAND_BY = "stand-by"  # the name of a syncer started beside a stalled one ends so


def child_env(
    run: str = "", worker: str = "", secret: str | None = None, start: int = 0
) -> dict[str, str]:
    """A worker process's environment: the launcher's without any key material, the
    Prefect API, and what ``worker`` may hold of the run ``secret``: a syncer shard
    (``syncer-N``) the secret itself, to verify every learner; a learner only its own key
    (``storage_layout.auth``), so it can sign for no other learner."""
    hidden = (RUN_SECRET_ENV, LEARNER_KEY_ENV, faults.ENV_VAR, PARENT_FLOW_RUN_ENV,
              PARENT_TASK_RUN_ENV)  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in hidden}
    if run in _FAULT_ENV:  # salted per start: a restart must not replay its faults
        plan = json.loads(_FAULT_ENV[run][faults.ENV_VAR])
        env[faults.ENV_VAR] = json.dumps({**plan, "salt": f"{worker}/{start}"})
    env["PYTHONUNBUFFERED"] = "1"
    env[PARENT_ENV] = str(os.getpid())  # a worker dies with its launcher (flows.worker)
    url = PREFECT_API_URL.value()
    if url:
        env["PREFECT_API_URL"] = url
    if secret is not None:
        if worker.startswith("syncer-"):
            env[RUN_SECRET_ENV] = secret
        elif worker.startswith(LEARNER_PREFIX):
            env[LEARNER_KEY_ENV] = learner_key(secret, run, worker).hex()
    return env


_SPARES: Spares | None = None  # this launcher's spare workers (processes mode)
FINISHED: dict[str, dict[str, Any]] = {}  # run -> its summary, once this launch has one


@task(name="process", task_run_name="start {name}", cache_policy=NO_CACHE,
      persist_result=False)  # fmt: skip
def run_process(name: str, argv: list[str], log_path: str, run: str = "", worker: str = "") -> int:
    """Run one worker process (``worker``: its writer id, a learner's or ``syncer-N``) to
    its end; a non-zero exit fails the task run."""
    if STOPPING.is_set():
        return 130
    key = name if name.endswith(STAND_BY) else worker or name  # (a stand-by: its own)
    with _lock:
        _starts[key] += 1
        start = _starts[key]
    # parent_env(): the process's flow runs are linked as subflows of this task run
    env = {**child_env(run, worker, _RUN_SECRETS.get(run), start), **parent_env()}
    proc, warm = (_SPARES or Spares(0, log_path, env)).take(argv, log_path, env)
    started = time.monotonic()
    watch = memory.Watch(proc.pid, started)  # why it died, should a signal end it
    get_run_logger().info("%s started (pid %d%s); its output goes to %s", name, proc.pid,
                          ", a spare" if warm else "", log_path)  # fmt: skip
    with _lock:
        _children.add(proc)
        _workers[key] = proc
        _record_pids()
    try:
        code = memory.wait(proc, watch)
    finally:
        with _lock:
            _children.discard(proc)
            if _workers.get(key) is proc:
                del _workers[key]
    if code == 0 or STOPPING.is_set():
        return code
    tail = Path(log_path).read_text(errors="replace")[-800:]
    if code == API_DOWN:
        raise ApiDown(f"{name} could not reach the Prefect API (exit status {code}); log "
                      f"{log_path}:\n{tail}")  # fmt: skip
    if code < 0:
        why, oom = watch.death(code)
        with _lock:
            _deaths[worker or name] = (time.time(), OOM_KILLED if oom else "killed")
            _oom_kills[worker or name] += oom
        if oom:  # it would be again: a crash, so that a loop of them is given up by name
            raise RuntimeError(f"{name} was {why}; log {log_path}:\n{tail}")
        raise Killed(f"{name} was {why}; log {log_path}:\n{tail}",
                     lived=time.monotonic() - started)  # fmt: skip
    raise RuntimeError(f"{name} exited with status {code}; log {log_path}:\n{tail}")


_best_effort_reported: dict[str, float] = {}  # call -> when its failure was last logged
_best_effort_running: dict[str, threading.Thread] = {}  # call -> its call still under way
REPORT_SECONDS = 10.0  # the watch waits at most this long for a report to the Prefect API


def best_effort(call: Callable[..., Any], *args: Any, wait: float = REPORT_SECONDS,
                **kwargs: Any) -> Any:  # fmt: skip
    """``call(*args, **kwargs)`` for what only reports (a progress or summary artifact,
    the live metrics' tables): run off this thread and waited for at most ``wait``
    seconds, so an API that is gone (whose client retries for minutes) never holds up
    the watch or a Ctrl-C; one at a time per call (one still under way skips the next).
    A failure or a call that takes too long is logged by name, at most once every
    ``QUIET_SECONDS`` per call, and never raised: the run needs none of it. The call's
    result, or None."""
    name = getattr(call, "__name__", str(call))

    def report(what: str) -> None:
        now = time.monotonic()
        if now - _best_effort_reported.get(name, -math.inf) >= QUIET_SECONDS:
            _best_effort_reported[name] = now
            log.warning("%s %s; the run goes on without it", name, what)

    busy = _best_effort_running.get(name)
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
    _best_effort_running[name] = thread
    thread.start()
    thread.join(wait)
    if wait > 0 and thread.is_alive():
        report(f"did not answer in {wait:.0f} s")
    return result.get("value")


_PIDS: Path | None = None  # where this launcher records its workers' pids (logs/pids.json)


def _record_pids() -> None:
    """Keep the pids of this launcher's workers (and its spares' zygote) in the run's
    folder, so that a launcher of the run that starts after this one died can stop what
    it left (``stop_predecessors``). Called with ``_lock`` held."""
    if _PIDS is None:
        return
    pids = {name: p.pid for name, p in _workers.items() if p.poll() is None}
    if _SPARES is not None and _SPARES.zygote is not None:
        pids["zygote"] = _SPARES.zygote.proc.pid
    pids[PARENT_ENV] = os.getpid()  # (each of them has it in its environment)
    try:
        write_pids(_PIDS, pids)
    except OSError as exc:
        log.warning("could not record the workers' pids in %s: %s", _PIDS, exc)


def stop_predecessors(pids: Path, log: Any) -> None:
    """Stop the workers a launcher of this run left running on this host when it died
    (its ``pids.json``; each still a ``flows.worker`` process): they would train beside
    the new ones, unsupervised, until fenced. Only with the run's lock held."""
    left = read_pids(pids)
    launcher = left.pop(PARENT_ENV, None)
    if launcher is None:
        return
    found = stop_leftovers(left, "flows.worker", grace=60.0, environ=f"{PARENT_ENV}={launcher}")
    if found:
        log.warning("stopped %d worker processes a launcher of this run left running: %s",
                    len(found), ", ".join(f"{n} (pid {p})" for n, p in sorted(found.items())))  # fmt: skip


class Killed(RuntimeError):
    """A worker process ended by a signal (a machine lost, a kill from outside), not by
    failing on its own: restarted at once, and never counted as a crash loop. ``lived``:
    seconds it ran."""

    def __init__(self, message: str, lived: float = 0.0):
        super().__init__(message)
        self.lived = lived


class ApiDown(RuntimeError):
    """A worker process that failed because the Prefect API was unreachable (its flow
    runs cannot start or end without it): the API is waited for, and no crash counted."""


API_PATIENCE = 1800.0  # seconds a worker waits for the Prefect API before it is given up


def wait_for_api(name: str, log: Any, pause: float = 2.0) -> bool:
    """If the Prefect API is unreachable, say so for ``name`` and wait until it answers
    (or the run stops); True if there was a wait. A restart that needs the API cannot
    succeed before it is back, and must not count towards giving a worker up. After
    ``API_PATIENCE`` seconds the wait ends in an error naming the API (the run then ends
    with its summary rather than waiting for ever)."""
    url = PREFECT_API_URL.value()
    if prefect_api_reachable(url):
        return False
    log.warning("%s: the Prefect API at %s is unreachable; waiting for it before starting "
                "%s again (not counted as a crash)", name, url, name)  # fmt: skip
    down = time.monotonic()
    while not STOPPING.wait(pause):
        if prefect_api_reachable(url):
            log.warning("%s: the Prefect API answers again after %.0f s; restarting %s", name,
                        time.monotonic() - down, name)  # fmt: skip
            break
        if time.monotonic() - down > API_PATIENCE:
            raise ApiDown(f"{name}: the Prefect API at {url} has been unreachable for "
                          f"{API_PATIENCE:.0f} s; giving {name} up")  # fmt: skip
    return True


KILLED_YOUNG = 5.0  # seconds: a process killed sooner is restarted after a pause


def worker_progress(store: RunStore, status: Status) -> Any:
    """What a worker has done so far, as the buckets tell it: a learner's step and its
    newest contribution of each fragment (a learner killed mid-round has committed work
    but not yet its status), a syncer shard's newest versions. A crash after progress is
    a crash, not a crash loop."""
    writer, region, fragments = status
    try:
        if fragments:
            return [store.latest_global(p) for p in fragments]
        sent = [(store.contribution_seqs(writer, p, region) or [0])[-1]
                for p in range(len(store.read_spec()["fragments"]))]  # fmt: skip
        return (store.read_metrics(writer, region) or {}).get("step"), sent
    except Exception:  # any storage error (botocore's are no OSError): progress unknown
        return None


def give_up(store: RunStore, writer: str, reason: str) -> None:
    """Record in the launcher's status object that ``writer`` was given up (syncers read
    it: a learner given up is not waited for)."""
    try:
        status = store.read_metrics("launcher") or {}
        given_up = {**status.get("given_up", {}), writer: reason[-300:]}
        store.write_metrics("launcher", {**status, "given_up": given_up})
    except Exception as exc:  # the launcher's own error names the worker all the same
        log.error("could not record that %s was given up (%s: %s)", writer,
                  type(exc).__name__, exc)  # fmt: skip


@task(name="worker", task_run_name="{name}", cache_policy=NO_CACHE, persist_result=False)
def supervise(
    name: str,
    argv: list[str],
    log_path: str,
    status: Status,
    run: str,
    regions: dict[str, str],
    max_failed_starts: int,
) -> int:
    """Keep one worker process running until it ends its work: restart it after every
    crash (backoff 2 s doubling to 60 s, reset by progress); give it up after
    ``max_failed_starts`` crashes in a row without progress. A process killed by a
    signal counts as no crash (it did not fail, it was lost): it is restarted at once,
    or after 1 s when it had lived less than ``KILLED_YOUNG`` seconds (no restart
    faster than once a second, whatever kills it)."""
    log = get_run_logger()
    store = RunStore(run, regions, home_region(regions), writer="launcher")
    failed, delay = 0, 2.0
    while not STOPPING.is_set():
        before = worker_progress(store, status)
        try:
            return run_process(name, argv, log_path, run, status[0])
        except Killed as exc:
            if STOPPING.is_set():
                return 130
            log.warning("%s was killed (%s); restarting it", name, str(exc).splitlines()[0])
            if getattr(exc, "lived", 0.0) < KILLED_YOUNG:
                STOPPING.wait(1.0)
            continue
        except Exception as exc:
            if STOPPING.is_set():
                return 130
            try:
                if wait_for_api(name, log) or isinstance(exc, ApiDown):
                    continue  # (it failed on the API, not on its own)
            except ApiDown as down:
                give_up(store, status[0], str(down))
                raise
            if worker_progress(store, status) != before:
                failed, delay = 0, 2.0  # it got somewhere: not a crash loop
            failed += 1
            if failed >= max_failed_starts:
                reason = f"{failed} starts in a row failed without progress; last: {exc}"
                give_up(store, status[0], reason)
                raise RuntimeError(f"{name}: {reason}") from exc
            log.warning("%s crashed (%s); restart %d in %.0f s", name,
                        str(exc).splitlines()[0], failed, delay)  # fmt: skip
            STOPPING.wait(delay)
            delay = min(60.0, delay * 2)
    return 130


_flow_runs: set[Any] = set()  # ids of deployment flow runs in progress


@task(name="deployment", task_run_name="run {name}", cache_policy=NO_CACHE,
      persist_result=False)  # fmt: skip
def supervise_deployment(
    name: str,
    deployment: str,
    parameters: dict[str, Any],
    tags: list[str],
    status: Status,
    run: str,
    regions: dict[str, str],
    max_failed_starts: int,
) -> int:
    """Start flow runs of ``deployment`` (on the region's work pool) one after another
    until the worker's status object in the bucket says ``done``, each resuming from the
    buckets; given up after ``max_failed_starts`` failed flow runs in a row without
    progress."""
    from prefect.deployments import run_deployment

    writer, region, _ = status
    store = RunStore(run, regions, region, writer="launcher")
    home = RunStore(run, regions, home_region(regions), writer="launcher")
    failures, delay = 0, 2.0
    log = get_run_logger()
    while not STOPPING.is_set():
        before = worker_progress(home, status)
        try:
            # as_subflow: linked under this task run, in the launcher's flow run
            flow_run = run_deployment(deployment, parameters=parameters, tags=tags, timeout=0,
                                      as_subflow=True)  # fmt: skip
        except Exception:
            if wait_for_api(name, log):  # (no flow run was started: nothing counts)
                continue
            raise
        _flow_runs.add(flow_run.id)
        try:
            state = _wait_flow_run(flow_run.id, name, log)
        finally:
            _flow_runs.discard(flow_run.id)
        if worker_done(store, writer):
            return 0
        if STOPPING.is_set():
            return 130
        if not state.is_completed():
            if worker_progress(home, status) != before:
                failures, delay = 0, 2.0
            failures += 1
            if failures >= max_failed_starts:
                reason = f"{failures} flow runs in a row ended {state.type.value} without progress"
                give_up(home, writer, reason)
                raise RuntimeError(f"{name}: {reason}")
            log.warning(
                "%s: flow run ended %s; starting another in %.0f s", name, state.name, delay
            )
            STOPPING.wait(delay)
            delay = min(60.0, delay * 2)
    return 130


def _wait_flow_run(flow_run_id: Any, name: str, log: Any, poll: float = 2.0) -> Any:
    """The final state of a flow run; while the API is unreachable, waits for it."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        while True:
            try:
                state = client.read_flow_run(flow_run_id).state
            except Exception:
                if wait_for_api(name, log):
                    continue
                raise
            if state is not None and state.is_final():
                return state
            time.sleep(poll)


def cancel_flow_runs() -> None:
    """Ctrl-C with deployments: ask the workers to cancel the flow runs we started."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    with get_client(sync_client=True) as client:
        for flow_run_id in list(_flow_runs):
            client.set_flow_run_state(flow_run_id, Cancelling(), force=True)


def _interrupt_children() -> list[subprocess.Popen]:
    """Mark the run as stopping and send SIGINT to every live worker (each checkpoints)."""
    STOPPING.set()
    with _lock:
        procs = list(_children)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.send_signal(signal.SIGCONT)  # one paused by the chaos driver must hear it
    return procs


def on_interrupt(signum: int, frame: Any) -> None:
    """SIGINT / SIGTERM in the launcher: ask the workers to checkpoint and stop right away
    (the flow's task runner waits for them), then unwind as a KeyboardInterrupt."""
    _interrupt_children()
    raise KeyboardInterrupt


STOP_SECONDS = 60.0  # workers asked to stop are killed after this (they checkpoint first)


def stop_children(timeout: float = STOP_SECONDS) -> None:
    """Ctrl-C: ask every worker to checkpoint and exit, then kill what is left."""
    _interrupt_children()
    reap_children(timeout)


def reap_children(timeout: float = STOP_SECONDS) -> None:
    """Wait for the workers already asked to stop, ``timeout`` seconds in all, then kill
    what is left: a worker that has checkpointed may still wait minutes on a Prefect API
    that is gone to record its flow run's end. (No second SIGINT: it could interrupt a
    checkpoint being written.)"""
    with _lock:
        procs = list(_children)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()


def flush_prefect(timeout: float = 10.0) -> None:
    """Send the logs and events still queued to the API (before a local server stops)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=timeout)


def _start_workers(
    run: str, regions: dict[str, str], cfg: RunConfig, spec: dict, logs: str, via: str
) -> tuple[list[str], list[Any]]:
    """One supervising task per learner and syncer shard: its name and its future."""
    futures, names = [], []
    limit = cfg.pipeline.max_failed_starts
    if via not in ("processes", "deployments"):
        raise ValueError(f"via must be 'processes' or 'deployments', not {via!r}")
    for w in run_workers(run, regions, cfg, spec):
        names.append(w.name)
        if via == "deployments":
            futures.append(supervise_deployment.submit(
                w.name, w.deployment, w.params, w.tags(run), w.status, run, regions, limit
            ))  # fmt: skip
        else:
            path = str(Path(logs) / f"{w.name.replace(' ', '-').replace('/', '-')}.log")
            futures.append(supervise.submit(w.name, w.argv(), path, w.status, run, regions,
                                            limit))  # fmt: skip
    return names, futures


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
) -> dict[str, float]:
    """Evaluate and log progress every ``every`` seconds until every worker's task has
    ended; returns when each ended (its machine was freed: the end of its allocation).
    Each evaluation also updates the progress artifact, the live ``metrics`` and the
    ``display``; a live display also shows the learners' phases every few seconds. A
    syncer shard seen stalled gets a stand-by (``stand_by(name)``: the name and future of
    the worker it started, watched from then on like the others)."""
    display = display or Display()
    last_eval, last_look = time.monotonic(), time.monotonic()
    ended: dict[str, float] = {}
    started = False  # every learner has started up: progress lines from then on
    # The thread pool's own futures, waited on plainly: ``prefect.futures.wait`` with a
    # timeout arms an asynchronous exception (an alarm signal in the main thread), which
    # can land inside a lock and end a run with "release unlocked lock".
    pool = [f.wrapped_future for f in futures]
    while True:
        running = concurrent.futures.wait(pool, timeout=0.5).not_done
        for name, future in zip(names, pool, strict=True):
            if future.done() and name not in ended:
                ended[name] = time.time()
        if not running:
            return ended
        if time.monotonic() - last_eval < every:
            if display.live and time.monotonic() - last_look >= LOOK_SECONDS:
                last_look = time.monotonic()  # (a failed read shows the last state read)
                show_phases(display, monitor.statuses(), monitor.versions())
            continue
        last_eval = last_look = time.monotonic()
        errors = monitor.errors
        statuses = monitor.statuses()
        try:
            point = monitor.evaluate(statuses)
        except CorruptVersion as exc:
            log.error("evaluation failed, trying again in %.0f s: %r", every, exc)
            continue
        except Exception as exc:  # the workers go on; so does watching them
            monitor.storage_error("evaluating the newest versions", exc)
            continue
        if monitor.errors == errors:
            monitor.storage_ok()
        for name in monitor.stalled_syncers(statuses, point["versions"]):
            extra = stand_by(name) if stand_by is not None else None
            if extra is not None:
                names.append(extra[0])
                futures.append(extra[1])
                pool.append(extra[1].wrapped_future)
        pct = monitor.progress(statuses)
        if bar is not None:
            best_effort(update_progress_artifact, bar, pct)
        show_phases(display, statuses, point["versions"], point, pct)
        if metrics is not None:
            best_effort(report_metrics, metrics, monitor, point, statuses, log)
        starting = None if started else startup_line(statuses, point["versions"])
        if starting:
            log.info("%s | validation loss %.4f", starting, point["loss"], extra=SHOWN)
            continue
        started = True
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


LOOK_SECONDS = 2.0  # how often a live display shows the learners' phases between evaluations
SHOWN = {"display": True}  # log lines a live display shows instead (flows/display.py)


def show_phases(
    display: Display,
    statuses: dict[str, dict[str, Any]],
    versions: dict[int, int],
    point: dict[str, Any] | None = None,
    pct: float | None = None,
) -> None:
    """Set the display's learner, first-contribution and training phases from the
    learners' status objects and the newest versions (and ``point``, an evaluation)."""
    if not display.live:
        return
    counts, detail = learner_phases(statuses)
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
            "goodput/so_far": monitor.goodput_so_far(point),
            "bytes/learners_up_down": learner_bytes,
            "bytes/cross_region": cross_region_bytes(traffic),
        }
        metrics.tick(point, extra, statuses)
    except Exception as exc:  # (logged by name, once a minute per kind)
        monitor.storage_error("updating the live metrics", exc)


# A learner's start-up phases, in order, as its status object names them (``starting``:
# no word from it yet: its process starts, imports, opens its flow run).
STARTUP = ("starting", "compiling", "resuming")


def learner_phases(statuses: dict[str, dict[str, Any]]) -> tuple[Counter, str]:
    """How many learners are in each state (start-up phases first, then training), and
    that as text: ``1 compiling, 3 training``."""
    counts = Counter(s.get("state") or "starting" for s in statuses.values())
    order = [*STARTUP, "training", *sorted(set(counts) - {*STARTUP, "training"})]
    text = ", ".join(f"{counts[phase]} {phase}" for phase in order if counts.get(phase))
    with _lock:
        oom = {w: n for w, n in _oom_kills.items() if n and w in statuses}
    if oom:  # restarted after each, it shows "compiling" most of the time: say so apart
        text += " (" + ", ".join(f"{w} OOM-killed {n}x" for w, n in sorted(oom.items())) + ")"
    return counts, text


def startup_line(statuses: dict[str, dict[str, Any]], versions: dict[int, int]) -> str | None:
    """What the run is doing while it starts, instead of a progress line at 0 %: how many
    learners are in each phase, and whether a contribution has been merged yet. None once
    every learner trains and a version beyond 0 exists (from then on the watch loop logs
    progress, and names the learners that are restarting)."""
    counts, learners = learner_phases(statuses)
    merged = any(v > 0 for v in versions.values())
    if merged and not any(counts.get(phase) for phase in STARTUP):
        return None
    first = "first versions published" if merged else "waiting for the first contribution"
    return f"starting up | learners: {learners} | {first}"


def authenticate(run: str, folder: Path, via: str, log: Any, store: RunStore) -> None:
    """Sign the run's contributions: the run secret is ``DILOCO_RUN_SECRET`` or, if that
    is not set, one kept in ``folder/run-secret`` (made on the first launch, mode 0600), so
    a resumed run keeps its keys; one that is not the run's (its fingerprint in the
    bucket differs) is refused. Deployments' workers take theirs from their work pools."""
    if via != "processes":
        log.info("contributions are authenticated if the work pools set %s (syncers) and %s "
                 "(learners); see docs/deploy.md", RUN_SECRET_ENV, LEARNER_KEY_ENV)  # fmt: skip
        return
    secret, source = run_secret(folder / "run-secret")
    store.check_secret(secret, source)
    _RUN_SECRETS[run] = secret
    log.info("contributions are signed: each learner gets its own key, the syncers the run "
             "secret (from %s)", source)  # fmt: skip


def worker_faults(run: str, cfg: RunConfig, folder: Path, log: Any) -> faults.FaultPlan | None:
    """The storage fault plan the run's workers get (``pipeline.faults``), checked before
    the run starts: one ``t0`` for all (a restarted worker keeps the outage window) and a
    shared fault log, ``folder/faults.jsonl``. The launcher itself stays fault-free."""
    _FAULT_ENV.pop(run, None)
    if not cfg.pipeline.faults:
        return None
    data = {"log_path": str(folder / "faults.jsonl"), **cfg.pipeline.faults, "t0": time.time()}
    plan = faults.FaultPlan.from_dict(data, source="pipeline.faults")
    _FAULT_ENV[run] = plan.to_env()
    log.warning("the workers run with injected storage faults: %s", plan.to_json())
    return plan


def start_chaos(plan: ChaosPlan, folder: Path, via: str, log: Any,
                monitor: Monitor | None = None) -> Chaos | None:  # fmt: skip
    """The process chaos driver over this launcher's live workers, if ``plan`` acts; its
    actions at shares of the run follow the learners' status objects (``monitor``)."""
    if not plan.active:
        return None
    if via != "processes":
        log.warning("pipeline.chaos needs the workers as local processes; no chaos")
        return None

    def live() -> dict[str, int]:
        with _lock:
            return {name: p.pid for name, p in _workers.items() if p.poll() is None}

    def progress() -> tuple[float, set[str]]:
        assert monitor is not None
        statuses, cap = monitor.statuses(), monitor.cfg.learner_step_cap
        steps = sum(min(int(s.get("step", 0)), cap) for s in statuses.values())
        training = {lid for lid, s in statuses.items() if s.get("state") == "training"}
        return steps / monitor.cfg.budget_steps, training

    log.warning("chaos on: %s; its actions go to %s", plan.model_dump(), folder / "chaos.jsonl")
    return Chaos(plan, live, folder / "chaos.jsonl", log, progress if monitor else None).start()


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
    config: dict | None, preset: str = "tiny", overrides: list[str] | None = None
) -> RunConfig:
    """The run's config: ``config`` (a whole ``RunConfig`` as a dict) or else ``preset``,
    then ``overrides`` (``KEY=VALUE``, as ``--set``); a wrong field fails naming it."""
    if config is None:
        return load_config(preset, overrides=overrides or [])
    raw = dict(config)
    for text in overrides or []:
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
    config: dict | None = None,
    logs: str | None = None,
    via: Literal["processes", "deployments"] = "processes",
    preset: str = "tiny",
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Run ``run`` to its end across ``regions``; the same name resumes it.

    Its flow run is tagged ``run:RUN``, ``launcher`` and ``via:VIA``, and every learner
    and syncer flow run it starts is linked under it as a subflow, in both modes.

    Args:
        run: the run's name (letters, digits, dashes)
        regions: region -> bucket URL (s3://, gs://, file://); the first is the syncers' home
        config: a whole RunConfig as a dict (what `diloco train` passes); if not given,
            the preset with the overrides
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
    tag_flow_run([f"run:{run}", "launcher", f"via:{via}"])
    cfg = launch_config(config, preset, overrides)
    logs = logs or str(default_run_dir(run) / "logs")
    STOPPING.clear()
    folder = Path(logs).parent
    folder.mkdir(parents=True, exist_ok=True)
    worker_faults(run, cfg, folder, log)  # both checked before anything is committed
    chaos_plan = ChaosPlan(**cfg.pipeline.chaos)
    store = RunStore(run, regions, home_region(regions), writer="launcher")
    display = current_display()
    display.phase("spec", "running", "writing the run spec and version 0, evaluating it")
    spec = initialize_run(store, cfg)
    lock = held(run)  # `diloco train` took it before starting its Prefect server
    if lock is None:  # a flow run of the train deployment: one launcher per run here too
        lock = RunLock(store, log, on_lost=lambda who: _interrupt_children()).acquire()
        try:
            return _launch(run, regions, cfg, logs, via, store, spec, chaos_plan, lock, log)
        finally:
            lock.release()
    return _launch(run, regions, cfg, logs, via, store, spec, chaos_plan, lock, log)


def _launch(
    run: str,
    regions: dict[str, str],
    cfg: RunConfig,
    logs: str,
    via: str,
    store: RunStore,
    spec: dict[str, Any],
    chaos_plan: ChaosPlan,
    lock: RunLock,
    log: Any,
) -> dict[str, Any]:
    """The launch itself, with the run's lock held."""
    global _SPARES, _PIDS
    folder = Path(logs).parent
    display = current_display()
    Path(logs).mkdir(parents=True, exist_ok=True)
    _PIDS = Path(logs) / "pids.json"
    if via == "processes":
        stop_predecessors(_PIDS, log)
    authenticate(run, folder, via, log, store)
    # Workers share a persistent JAX compilation cache: a restarted learner does not
    # compile its step again (the variables reach them through child_env()).
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(logs).parent / "jax-cache"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    monitor = Monitor(store, cfg, spec, log, _deaths)
    first = monitor.evaluate(monitor.statuses())
    monitor.remember_start(first)
    log.info(
        "run %s: %d learners in %s, validation loss %.4f at versions %s",
        run,
        cfg.topology.learners,
        ", ".join(regions),
        first["loss"],
        first["versions"],
    )
    display.phase("spec", "done", f"{cfg.topology.learners} learners in {', '.join(regions)}; "
                  f"validation loss {first['loss']:.4f}")  # fmt: skip
    metrics = LiveMetrics(store, spec, folder, log=log)  # runs/NAME/tensorboard
    log.info("live metrics: tensorboard --logdir %s", metrics.dir)
    report_metrics(metrics, monitor, first, monitor.statuses(), log)
    bar = best_effort(
        create_progress_artifact,
        monitor.progress(monitor.statuses()),
        key=artifact_key(run, "progress"),
        description=f"run {run}: share of all learners' inner steps done",
    )
    started = time.time()
    if via == "processes":
        home = next(iter(regions))
        warm = {"run": run, "bucket": regions[home], "region": home}
        _SPARES = Spares(cfg.pipeline.spares, Path(logs) / "spares.log", child_env(), warm)
    names, futures = _start_workers(run, regions, cfg, spec, logs, via)
    show_phases(display, monitor.statuses(), first["versions"])
    chaos = start_chaos(chaos_plan, folder, via, log, monitor)
    syncers = {w.name: (w.argv(), w.status) for w in run_workers(run, regions, cfg, spec)
               if w.role == "syncer"}  # fmt: skip

    def stand_by(name: str) -> tuple[str, Any] | None:
        """A second process for a stalled syncer shard: it resumes from the newest
        committed version and publishes the next ones; should the stalled one wake up,
        the commit protocol fences one of the two at each version (never a version twice)."""
        if via != "processes" or name not in syncers or STOPPING.is_set():
            log.warning("%s: no stand-by syncer (workers run as deployments' flow runs)", name)
            return None
        argv, status = syncers[name]
        label = f"{name} {STAND_BY}"
        path = str(Path(logs) / f"{label.replace(' ', '-').replace('/', '-')}.log")
        log.warning("%s: starting a stand-by for fragments %s; the two are fenced by the "
                    "commit protocol", name, status[2])  # fmt: skip
        future = supervise.submit(label, argv, path, status, run, regions,
                                  cfg.pipeline.max_failed_starts)  # fmt: skip
        return label, future

    try:
        ended = _watch(names, futures, monitor, bar, cfg.pipeline.eval_seconds, log, display,
                       metrics, stand_by)  # fmt: skip
    except BaseException:
        # Cancelled from the UI (the worker's SIGTERM) or interrupted: the workers stop with
        # this flow run (each checkpoints) rather than run on unsupervised.
        if not STOPPING.is_set():
            _interrupt_children()
        if via == "deployments":
            best_effort(cancel_flow_runs, wait=30.0)
        else:
            reap_children()
        raise
    finally:
        if chaos is not None:
            chaos.stop()
        if _SPARES is not None:
            _SPARES.close()
            _SPARES = None
    if lock.lost:
        raise RunTakenOver(f"run {run} was taken over by {lock.lost}; this launcher stopped "
                           "its workers")  # fmt: skip
    failed = []
    for name, future in zip(names, futures, strict=True):
        try:
            future.result()
        except Exception as exc:
            if name.endswith(STAND_BY):  # the shard's own process is judged, not its help
                log.warning("%s failed: %s", name, exc)
                continue
            log.error("%s failed for good: %s", name, exc)
            failed.append(name)
    display.phase("training", "failed" if failed else "done")
    display.phase("finishing", "running", "final evaluation, summary, loss curve")
    now = time.time()
    wall = now - started
    monitor.wait_for_storage()
    # Allocated learner time: each learner from the launch until its worker ended.
    allocated = sum(ended.get(n, now) - started for n in names if n.startswith("learner"))
    try:
        monitor.evaluate(monitor.statuses())
    except Exception as exc:  # the summary still reports the curve so far
        log.error("final evaluation failed: %r", exc)
    statuses = monitor.statuses()
    if bar is not None:
        best_effort(update_progress_artifact, bar, monitor.progress(statuses))
    if monitor.curve:
        best_effort(report_metrics, metrics, monitor, monitor.curve[-1], statuses, log,
                    wait=60.0)  # fmt: skip
    metrics.close()
    summary = monitor.summary(wall, allocated)
    summary["failed"] = failed
    if cfg.pipeline.faults or chaos_plan.active:
        summary["chaos"] = failure_report(store, spec, folder, chaos.missed if chaos else [])
    png = loss_plot_png(monitor.curve, f"run {run}", metrics.training_curve())
    store.home.put(f"{run}/metrics/loss.png", png)
    best_effort(
        create_markdown_artifact,
        summary_markdown(summary, png),
        key=artifact_key(run, "summary"),
        description=f"run {run}: summary and loss curve",
    )
    display.phase("finishing", "done", f"summary: Prefect artifact {artifact_key(run, 'summary')}")
    if failed:
        log.error("gave up on %s (each failed %d starts in a row without progress)",
                  failed, cfg.pipeline.max_failed_starts)  # fmt: skip
    FINISHED[run] = summary  # (should the API not record the flow run's end)
    return summary
