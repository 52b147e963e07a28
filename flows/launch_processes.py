"""The launch mode that runs each worker as a local process (``diloco train``'s default):
started, watched, restarted under the one policy (``flows.supervision.Restarts``), its
output to ``logs/NAME.log``, stopped with the launch."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from diloco.config import RunConfig
from flows import memory
from flows.observe import parent_env
from flows.spares import Spares
from flows.supervision import (
    OOM_KILLED,
    STAND_BY,
    STOP_SECONDS,
    ApiDown,
    Killed,
    LaunchMode,
    as_task,
    child_env,
    log_name,
    run_log,
    stop_predecessors,
)
from flows.worker import API_DOWN, PARENT_ENV
from flows.workers import Status, Worker
from infra.processes import write_pids
from protocol.topology import home_region
from storage_layout import faults
from storage_layout.store import RunStore

log = logging.getLogger(__name__)


class Processes(LaunchMode):
    """Each worker a process beside the launcher (``Worker.argv``), its output in
    ``logs/NAME.log``. A process that dies (a crash, a SIGKILL, a region that stays down)
    fails its ``start`` task run and is started again under ``Restarts``; the new process
    resumes from the buckets. The learners get their keys from ``secret`` (``child_env``),
    the workers run under ``fault_env`` if given, and ``spares`` processes wait warm to
    be taken (``flows.spares``). The pids of the live workers are kept in
    ``logs/pids.json`` (``stop_predecessors``)."""

    local = True

    @classmethod
    def for_launch(cls, run: str, regions: dict[str, str], cfg: RunConfig, logs: Path,
                   stopping: threading.Event, log: Any, secret: str | None,
                   fault_plan: faults.FaultPlan | None) -> LaunchMode:  # fmt: skip
        logs.mkdir(parents=True, exist_ok=True)
        stop_predecessors(logs / "pids.json", log)  # what a launcher that died left running
        return cls(run, regions, cfg.pipeline.max_failed_starts, logs, stopping, secret,
                   fault_plan.to_env() if fault_plan else None, cfg.pipeline.spares)  # fmt: skip

    def __init__(
        self,
        run: str,
        regions: dict[str, str],
        limit: int,
        logs: Path,
        stopping: threading.Event | None = None,
        secret: str | None = None,
        fault_env: dict[str, str] | None = None,
        spares: int = 0,
    ):
        super().__init__(run, regions, limit, stopping)
        self.logs, self.secret, self.fault_env = Path(logs), secret, fault_env
        self.children: set[subprocess.Popen] = set()
        self.workers: dict[str, subprocess.Popen] = {}  # writer id -> its live process
        self.starts: Counter[str] = Counter()  # writer id -> processes started
        self.pids = self.logs / "pids.json"
        home = next(iter(regions))
        warm = {"run": run, "bucket": regions[home], "region": home}
        self.spares = Spares(spares, self.logs / "spares.log", child_env(), warm)
        self.supervise = as_task(self._supervise, name="worker", task_run_name="{name}")
        self.run_process = as_task(self._run_process, name="process", task_run_name="start {name}")

    def start(self, worker: Worker) -> Any:
        path = str(self.logs / log_name(worker.name))
        return self.supervise.submit(worker.name, worker.argv(), path, worker.status)

    def stand_by(self, worker: Worker) -> tuple[str, Any] | None:
        label = f"{worker.name} {STAND_BY}"
        path = str(self.logs / log_name(label))
        return label, self.supervise.submit(label, worker.argv(), path, worker.status)

    def _supervise(self, name: str, argv: list[str], log_path: str, status: Status) -> int:
        """Keep one worker process running until it ends its work, under ``Restarts``."""
        store = RunStore(self.run, self.regions, home_region(self.regions), writer="launcher")
        restarts = self.restarts(name, store, status)
        while not self.stopping.is_set():
            restarts.start()
            try:
                return self.run_process(name, argv, log_path, status[0])
            except Killed as exc:
                if self.stopping.is_set():
                    return 130
                restarts.lost(str(exc).splitlines()[0], exc.lived)
            except Exception as exc:
                if self.stopping.is_set():
                    return 130
                if not restarts.api_waited(exc):  # (one that failed on the API goes again)
                    restarts.crashed(str(exc), exc)
        return 130

    def _run_process(self, name: str, argv: list[str], log_path: str, worker: str) -> int:
        """Run one worker process (``worker``: its writer id, a learner's or ``syncer-N``)
        to its end; a non-zero exit fails the task run."""
        spares = self.spares
        if self.stopping.is_set() or spares is None:  # (None: the launch is over, closed)
            return 130
        key = name if name.endswith(STAND_BY) else worker or name  # (a stand-by: its own)
        with self.lock:
            self.starts[key] += 1
            start = self.starts[key]
        # parent_env(): the process's flow runs are linked as subflows of this task run
        env = {**child_env(self.run, worker, self.secret, start, self.fault_env), **parent_env()}
        proc, warm = spares.take(argv, log_path, env)
        started = time.monotonic()
        watch = memory.Watch(proc.pid, started)  # why it died, should a signal end it
        run_log().info("%s started (pid %d%s); its output goes to %s", name, proc.pid,
                              ", a spare" if warm else "", log_path)  # fmt: skip
        with self.lock:
            self.children.add(proc)
            self.workers[key] = proc
            self._record_pids()
        try:
            code = memory.wait(proc, watch)
        finally:
            with self.lock:
                self.children.discard(proc)
                if self.workers.get(key) is proc:
                    del self.workers[key]
        if code == 0 or self.stopping.is_set():
            return code
        tail = Path(log_path).read_text(errors="replace")[-800:]
        if code == API_DOWN:
            raise ApiDown(f"{name} could not reach the Prefect API (exit status {code}); log "
                          f"{log_path}:\n{tail}")  # fmt: skip
        why, oom = watch.death(code) if code < 0 else (f"exited with status {code}", False)
        self.crash_flow_runs(name.removesuffix(f" {STAND_BY}"), env, f"its process ended: {why}")
        if code < 0:
            with self.lock:
                self.deaths[worker or name] = (time.time(), OOM_KILLED if oom else "killed")
                self.oom_kills[worker or name] += oom
            if oom:  # it would be again: a crash, so that a loop of them is given up by name
                raise RuntimeError(f"{name} was {why}; log {log_path}:\n{tail}")
            raise Killed(f"{name} was {why}; log {log_path}:\n{tail}",
                         lived=time.monotonic() - started)  # fmt: skip
        raise RuntimeError(f"{name} exited with status {code}; log {log_path}:\n{tail}")

    def _record_pids(self) -> None:
        """Keep the pids of the live workers (and the spares' zygote) in ``pids.json``, so
        that a launcher of the run that starts after this one died can stop what it left
        (``stop_predecessors``). Called with ``lock`` held."""
        pids = {name: p.pid for name, p in self.workers.items() if p.poll() is None}
        if self.spares is not None:
            pids["zygote"] = self.spares.zygote.proc.pid
        pids[PARENT_ENV] = os.getpid()  # (each of them has it in its environment)
        try:
            write_pids(self.pids, pids)
        except OSError as exc:
            log.warning("could not record the workers' pids in %s: %s", self.pids, exc)

    def interrupt(self) -> None:
        """Send SIGINT to every live worker (each checkpoints and ends)."""
        self.stopping.set()
        with self.lock:
            procs = list(self.children)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.send_signal(signal.SIGCONT)  # one paused by the chaos driver must hear it

    def reap(self, timeout: float = STOP_SECONDS) -> None:
        """Wait for the workers already asked to stop, ``timeout`` seconds in all, then kill
        what is left: a worker that has checkpointed may still wait minutes on a Prefect
        API that is gone to record its flow run's end. (No second SIGINT: it could
        interrupt a checkpoint being written.)"""
        with self.lock:
            procs = list(self.children)
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()

    def live(self) -> dict[str, int]:
        with self.lock:
            return {name: p.pid for name, p in self.workers.items() if p.poll() is None}

    def close(self) -> None:
        if self.spares is not None:
            self.spares.close()
            self.spares = None
