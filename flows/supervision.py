"""Keeping a run's workers going: one restart policy and the launch modes.

A launch mode starts each of the run's workers (``flows.workers.Worker``: a learner or a
syncer shard) as a Prefect task run of the launcher's flow run, and keeps it going until
its work is done:

- ``Processes`` (``flows.launch_processes``): a process beside the launcher (``python -m
  flows.worker ...``), each start a nested task run (``start learner us-east/2``);
- ``Deployments`` (``flows.launch_deployments``): flow runs of the region's deployment,
  one after another, each picked up by the region's work pool.

Both restart a worker under the one policy (``Restarts``) and answer the launcher
through one interface (``LaunchMode``): ``start`` a worker, start a ``stand_by`` beside a
stalled syncer, ``interrupt`` every worker (each checkpoints), ``reap`` what is left,
``close``, and the deaths the monitor shows. A mode holds all of its launch's state (its
processes, their starts and deaths, the run secret, the spares), none of it at module
level: two launches in one process never share any, and a new way to launch is one
class in a file of its own and its name in ``flows.launch_modes``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from diloco.config import RunConfig
from flows.observe import PARENT_FLOW_RUN_ENV, PARENT_TASK_RUN_ENV, BestEffort, crash_linked
from flows.worker import PARENT_ENV, api_away, prefect_api_reachable
from flows.workers import Status, Worker
from infra.processes import read_pids, stop_leftovers
from protocol.topology import LEARNER_PREFIX
from storage_layout import faults
from storage_layout.auth import (
    CLAIMS_KEY_ENV,
    LEARNER_KEY_ENV,
    RUN_SECRET_ENV,
    claims_key,
    learner_key,
)
from storage_layout.store import RunStore

log = logging.getLogger(__name__)

OOM_KILLED = "killed by the OOM killer"
STAND_BY = "stand-by"  # the name of a syncer started beside a stalled one ends so
KILLED_YOUNG = 5.0  # seconds: a process killed sooner is restarted after a pause
API_PATIENCE = 1800.0  # seconds a worker waits for the Prefect API before it is given up
BLIP_SECONDS = 5.0  # after a 5xx or 429 from a reachable API, a call is made again this late
STOP_SECONDS = 60.0  # workers asked to stop are killed after this (they checkpoint first)


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


# Prefect is imported on first use, not with this module: ``diloco train`` picks its launch
# mode (``launch_mode``) before PREFECT_HOME points at the run, and Prefect reads its
# settings when it is first imported.
def api_url() -> str | None:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def run_log() -> Any:
    from prefect import get_run_logger

    return get_run_logger()


def as_task(fn: Any, **names: str) -> Any:
    from prefect import task
    from prefect.cache_policies import NO_CACHE

    return task(**names, cache_policy=NO_CACHE, persist_result=False)(fn)


def child_env(
    run: str = "",
    worker: str = "",
    secret: str | None = None,
    start: int = 0,
    fault_env: dict[str, str] | None = None,
) -> dict[str, str]:
    """A worker process's environment: the launcher's without any key material, the
    Prefect API, and what ``worker`` may hold of the run ``secret``: a syncer shard
    (``syncer-N``) the secret itself, to verify every learner; a learner only its own key
    and the run's claims key (``storage_layout.auth``), so it can sign for no other
    learner. ``fault_env``: the
    run's storage fault plan (``DILOCO_FAULTS``), salted per start (a restart must not
    replay its faults)."""
    hidden = (RUN_SECRET_ENV, LEARNER_KEY_ENV, CLAIMS_KEY_ENV, faults.ENV_VAR, PARENT_FLOW_RUN_ENV,
              PARENT_TASK_RUN_ENV)  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in hidden}
    if fault_env:
        plan = json.loads(fault_env[faults.ENV_VAR])
        env[faults.ENV_VAR] = json.dumps({**plan, "salt": f"{worker}/{start}"})
    env["PYTHONUNBUFFERED"] = "1"
    env[PARENT_ENV] = str(os.getpid())  # a worker dies with its launcher (flows.worker)
    url = api_url()
    if url:
        env["PREFECT_API_URL"] = url
    if secret is not None:
        if worker.startswith("syncer-"):
            env[RUN_SECRET_ENV] = secret
        elif worker.startswith(LEARNER_PREFIX):
            env[LEARNER_KEY_ENV] = learner_key(secret, run, worker).hex()
            env[CLAIMS_KEY_ENV] = claims_key(secret, run).hex()
    return env


def wait_for_api(
    name: str, log: Any, stopping: threading.Event, pause: float = 2.0,
    exc: BaseException | None = None,
) -> bool:  # fmt: skip
    """If the Prefect API is away, say so for ``name`` and wait (or until the run stops);
    True if there was a wait. Away: unreachable (waited for until it answers), or, where
    ``exc`` is what a call got, an answer of 5xx or 429 or a dropped connection
    (``flows.worker.api_away``: a loaded or restarting server, waited ``BLIP_SECONDS``).
    A call that needs the API cannot succeed before it is back, and must not count
    towards giving a worker up. After ``API_PATIENCE`` seconds unreachable the wait ends
    in an error naming the API (the run then ends with its summary rather than waiting
    for ever)."""
    url = api_url()
    if prefect_api_reachable(url):
        if exc is None or not api_away(exc):
            return False
        log.warning("%s: the Prefect API at %s answered %s; asking again in %.0f s (not "
                    "counted as a crash)", name, url, str(exc).splitlines()[0][:200],
                    BLIP_SECONDS)  # fmt: skip
        stopping.wait(BLIP_SECONDS)
        return True
    log.warning("%s: the Prefect API at %s is unreachable; waiting for it before starting "
                "%s again (not counted as a crash)", name, url, name)  # fmt: skip
    down = time.monotonic()
    while not stopping.wait(pause):
        if prefect_api_reachable(url):
            log.warning("%s: the Prefect API answers again after %.0f s; restarting %s", name,
                        time.monotonic() - down, name)  # fmt: skip
            break
        if time.monotonic() - down > API_PATIENCE:
            raise ApiDown(f"{name}: the Prefect API at {url} has been unreachable for "
                          f"{API_PATIENCE:.0f} s; giving {name} up")  # fmt: skip
    return True


def worker_progress(store: RunStore, status: Status) -> Any:
    """What a worker has done so far, as the buckets tell it: a learner's step and its
    newest contribution of each fragment (a learner killed mid-round has committed work
    but not yet its status), a syncer shard's newest versions. A crash after progress is
    a crash, not a crash loop."""
    writer, region, fragments = status
    try:
        if fragments:
            return [store.versions.latest_global(p) for p in fragments]
        sent = [(store.contributions.contribution_seqs(writer, p, region) or [0])[-1]
                for p in range(len(store.read_spec()["fragments"]))]  # fmt: skip
        return (store.progress.read_metrics(writer, region) or {}).get("step"), sent
    except Exception:  # any storage error (botocore's are no OSError): progress unknown
        return None


def give_up(store: RunStore, writer: str, reason: str) -> None:
    """Record in the launcher's status object that ``writer`` was given up (syncers read
    it: a learner given up is not waited for)."""
    try:
        status = store.progress.read_metrics("launcher") or {}
        given_up = {**status.get("given_up", {}), writer: reason[-300:]}
        store.progress.write_metrics("launcher", {**status, "given_up": given_up})
    except Exception as exc:  # the launcher's own error names the worker all the same
        log.error("could not record that %s was given up (%s: %s)", writer,
                  type(exc).__name__, exc)  # fmt: skip


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


class Restarts:
    """The one restart policy of a worker, however it is launched: call ``start()``
    before each start; a start that ended by a signal is ``lost`` (restarted at once, or
    after 1 s when it had lived less than ``KILLED_YOUNG`` seconds: no restart faster than
    once a second, whatever kills it); one that failed on its own is ``crashed`` (backoff
    2 s doubling to 60 s, reset by progress), and after ``limit`` crashes in a row without
    progress the worker is given up: recorded for the syncers (``give_up``) and a
    ``RuntimeError`` naming it. A failure to reach the Prefect API counts as neither: it
    is waited out (``api_waited``)."""

    def __init__(self, name: str, store: RunStore, status: Status, limit: int, log: Any,
                 stopping: threading.Event, unit: str = "starts",
                 deaths: dict[str, tuple[float, str]] | None = None):  # fmt: skip
        self.name, self.store, self.status, self.limit, self.log = name, store, status, limit, log
        self.stopping = stopping
        self.deaths = {} if deaths is None else deaths  # (the mode's: given up, it is shown so)
        self.unit = unit  # what is counted: "starts" of a process, "flow runs"
        self.failed, self.delay, self.before = 0, 2.0, None

    def start(self) -> None:
        self.before = worker_progress(self.store, self.status)

    def lost(self, why: str, lived: float) -> None:
        self.log.warning("%s was killed (%s); restarting it", self.name, why)
        if lived < KILLED_YOUNG:
            self.stopping.wait(1.0)

    def api_waited(self, exc: Exception) -> bool:
        """Whether ``exc`` came of an unreachable Prefect API, now answering again (the
        worker is given up if it stays unreachable for ``API_PATIENCE``)."""
        try:
            return wait_for_api(self.name, self.log, self.stopping, exc=exc) or isinstance(
                exc, ApiDown)  # fmt: skip
        except ApiDown as down:
            self.give_up(str(down))
            raise

    def give_up(self, reason: str) -> None:
        """Record that the worker is given up: for the syncers (``give_up``), and as its
        state until a process of its slot reports again (a joiner's)."""
        give_up(self.store, self.status[0], reason)
        self.deaths[self.status[0]] = (time.time(), "given up")

    def crashed(self, why: str, exc: BaseException | None = None, ended: str = "failed") -> None:
        """Count a failed start (``why``: what failed; ``exc``: the error, whose whole
        text, its log's tail included, names a worker given up), then wait the backoff;
        raises once the worker is given up."""
        if worker_progress(self.store, self.status) != self.before:
            self.failed, self.delay = 0, 2.0  # it got somewhere: not a crash loop
        self.failed += 1
        if self.failed >= self.limit:
            last = why if exc is None else str(exc)
            reason = f"{self.failed} {self.unit} in a row {ended} without progress; last: {last}"
            self.give_up(reason)
            raise RuntimeError(f"{self.name}: {reason}") from exc
        self.log.warning("%s crashed (%s); restart %d in %.0f s", self.name,
                         why.splitlines()[0], self.failed, self.delay)  # fmt: skip
        self.stopping.wait(self.delay)
        self.delay = min(60.0, self.delay * 2)


def log_name(name: str) -> str:
    return f"{name.replace(' ', '-').replace('/', '-')}.log"


class LaunchMode:
    """How a launch starts and keeps its workers; see the module docstring. ``stopping``
    is set once the run stops (Ctrl-C, the run taken over): exits are then expected, not
    restarted. ``deaths``: writer id -> (when, how) its newest process died by a signal,
    shown as its state until a new process of it reports (its status object still names
    the phase the dead one was in); ``oom_kills``: how many times the OOM killer killed
    it."""

    def __init__(self, run: str, regions: dict[str, str], limit: int,
                 stopping: threading.Event | None = None):  # fmt: skip
        self.run, self.regions, self.limit = run, regions, limit
        self.stopping = stopping or threading.Event()
        self.deaths: dict[str, tuple[float, str]] = {}
        self.oom_kills: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.secret: str | None = None  # the run secret, where this launch holds it
        self.report = BestEffort()  # what is only for people, off the supervisors' threads

    # Whether the workers go on when the launcher dies of anything but a stop (a signal,
    # the UI's cancel, a run that cannot progress): a deployment's flow runs, in their
    # regions' pools, do; a local process dies with its launcher.
    outlives_launcher = False
    # Whether the workers are processes on this machine: their memory counts here, and
    # the run secret is kept beside the run (else each region's work pool holds its
    # workers' keys, and the workers reach the Prefect API the launcher uses: a server
    # of the run's own will not do).
    local = False

    @classmethod
    def for_launch(cls, run: str, regions: dict[str, str], cfg: RunConfig, logs: Path,
                   stopping: threading.Event, log: Any, secret: str | None,
                   fault_plan: faults.FaultPlan | None) -> LaunchMode:  # fmt: skip
        """The mode for one launch of ``run``, the run's lock held."""
        raise NotImplementedError

    def start(self, worker: Worker) -> Any:
        """Submit the task that keeps ``worker`` going; its future."""
        raise NotImplementedError

    def stand_by(self, worker: Worker) -> tuple[str, Any] | None:
        """A second worker beside a stalled syncer shard (its name and future), or None
        where this mode cannot start one."""
        return None

    def crash_flow_runs(self, name: str, env: dict[str, str], why: str) -> None:
        """The flow runs a worker process left unfinished as it died, Crashed with ``why``
        (``observe.crash_linked``): the UI would show them running for ever. Not waited
        for: with the API away, its client retries for a minute, and the worker's restart
        must not wait on what is only shown."""
        self.report(crash_linked, env, name, why, wait=0,
                    label=f"marking {name}'s flow runs Crashed")  # fmt: skip

    def interrupt(self) -> None:
        """The run stops: ask every worker to checkpoint and end."""
        self.stopping.set()

    def reap(self, timeout: float = STOP_SECONDS) -> None:
        """Wait, at most ``timeout`` seconds, for the workers asked to stop."""

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        self.interrupt()
        self.reap(timeout)

    def live(self) -> dict[str, int]:
        """Writer id -> pid of each live worker process on this machine (for chaos)."""
        return {}

    def close(self) -> None:
        """The launch is over: free what the mode holds (spare processes)."""

    def restarts(
        self, name: str, store: RunStore, status: Status, unit: str = "starts"
    ) -> Restarts:
        return Restarts(name, store, status, self.limit, run_log(), self.stopping, unit,
                        self.deaths)  # fmt: skip
