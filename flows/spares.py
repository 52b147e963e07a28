"""Spare worker processes, so that a killed learner or syncer is replaced in a second.

A worker's start-up is mostly imports (JAX, Flax, Prefect: about 2.5 s of CPU, several
times that on cores busy with training), then its model, compiled step and corpus. A
spare (``python -m flows.worker standby``) has done all of that ahead of need and waits
on its stdin for the command, environment and log of the worker it is to become.

Spares, and every worker the launcher starts, are forked from a *zygote* (``python -m
flows.worker zygote``) that did the imports once, so each costs only its warm-up: a run of
eight workers pays for its imports once, not eight times, and in a kill storm restarts
no longer take a core's worth of imports from the learners training beside them. A
forked spare is the zygote's child, not the launcher's: ``Forked`` is the part of ``subprocess.Popen`` the launcher
uses, its exit status told by the zygote. Should the zygote die, spares start as
processes of their own again (and a forked one's end is seen from its pid).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

WORKER_COMMAND = [sys.executable, "-m", "flows.worker"]  # + the role and its options


class Forked:
    """A spare forked by the zygote, as the launcher sees it: ``pid``, ``poll``, ``wait``,
    ``send_signal`` and ``kill`` as on a ``Popen``."""

    def __init__(self, zygote: Zygote, spare: int):
        self.zygote, self.spare = zygote, spare
        self.returncode: int | None = None
        self._pid: int | None = None
        self._forked = threading.Event()
        self._ended = threading.Event()

    @property
    def pid(self) -> int:
        """Its process id (waits for the fork: the zygote may still be importing)."""
        self._forked.wait()
        return self._pid if self._pid is not None else -1

    def _started(self, pid: int) -> None:
        self._pid = pid
        self._forked.set()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._forked.set()
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"spare {self.spare}", timeout or 0.0)
        return self.returncode if self.returncode is not None else 1

    def send_signal(self, sig: int) -> None:
        if self.returncode is None and self._pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def give(self, job: bytes) -> None:
        """Its job, the line a standby reads from its stdin."""
        self.zygote.send({"job": self.spare, "line": job.decode()})

    def _orphaned(self) -> None:
        """The zygote is gone: the exit status is lost, so watch the pid end (the process
        is re-parented and reaped elsewhere) and report it as a failure (1)."""
        if self._pid is None:
            self._exited(1)
            return

        def watch() -> None:
            while True:
                try:
                    os.kill(self._pid, 0)
                    status = Path(f"/proc/{self._pid}/stat").read_text().split(") ")[1][0]
                    if status in "ZX":
                        break
                except (ProcessLookupError, FileNotFoundError):
                    break
                except (OSError, IndexError):  # no /proc (macOS): kill(0) alone decides
                    pass
                time.sleep(0.2)
            self._exited(1)

        threading.Thread(target=watch, daemon=True, name=f"orphan-{self.spare}").start()


class Zygote:
    """The launcher's side of ``flows.worker.zygote``: it asks for spares and hears of
    their ends on the zygote's stdin and stdout."""

    def __init__(self, log_path: Path | str, env: dict[str, str]):
        self.log_path = Path(log_path)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen([*WORKER_COMMAND, "zygote"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=out, env=env)  # fmt: skip
        self.forked: dict[int, Forked] = {}
        self.count = 0
        self.lock = threading.Lock()
        self.alive = True
        threading.Thread(target=self._listen, daemon=True, name="zygote").start()

    def send(self, msg: dict[str, Any]) -> None:
        with self.lock:
            if not self.alive:
                raise OSError("the zygote has ended")
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()

    def spawn(self, log_path: Path | str, warm: dict[str, str] | None) -> Forked:
        with self.lock:
            self.count += 1
            spare = self.forked[self.count] = Forked(self, self.count)
        try:
            self.send({"spawn": spare.spare, "log": str(Path(log_path).resolve()), "warm": warm})
        except OSError:
            with self.lock:
                self.forked.pop(spare.spare, None)
            raise
        return spare

    def _listen(self) -> None:
        """Its answers, until it ends (a thread: it never raises; what it cannot read is
        logged and the zygote counted as gone)."""
        try:
            for line in self.proc.stdout:
                msg = json.loads(line)
                with self.lock:
                    spare = self.forked.get(msg.get("spawned", msg.get("exit")))
                    if "exit" in msg:
                        self.forked.pop(msg["exit"], None)
                if spare is None:
                    continue
                if "spawned" in msg:
                    spare._started(int(msg["pid"]))
                else:
                    spare._exited(int(msg["code"]))
        except Exception as exc:
            log.error("the spares' zygote said something unreadable: %r", exc)
        with self.lock:
            self.alive, orphans, self.forked = False, list(self.forked.values()), {}
        code = self.proc.wait()
        if orphans or code != 0:
            log.warning("the spares' zygote ended (exit %s) with %d of its workers live; "
                        "new spares start as processes of their own (see %s)",
                        code, len(orphans), self.log_path)  # fmt: skip
        for spare in orphans:
            spare._orphaned()

    def close(self) -> None:
        """No more spares: the idle ones end; the zygote ends after its last child."""
        with self.lock, contextlib.suppress(OSError):
            self.proc.stdin.close()


class Spares:
    """The launcher's worker processes, each forked from the zygote (see the module's
    docstring), and ``count`` spares kept idle and warm beside them. A restarted worker
    takes a spare and skips the start-up; the pool is refilled at once, off the restart's
    path. With ``count`` 0 (or none left) a worker is forked when it is needed and warms
    up as it starts, through the same standby entry point; should the zygote be gone, it
    starts as a process of its own.

    Only what is read when used may differ from the spare's own environment (the keys,
    the fault plan's salt); Prefect's and JAX's settings are the launcher's for both."""

    def __init__(
        self,
        count: int,
        log_path: Path | str,
        env: dict[str, str],
        warm: dict[str, str] | None = None,
    ):
        self.count, self.log_path, self.env = count, Path(log_path), env
        # {"run", "bucket", "region"}: a spare also builds the run's model and compiles its
        # train step while it waits (``flows.learner_runtime.warm_up``).
        self.warm = warm
        self.zygote = Zygote(self.log_path, env)
        self.idle: list[Any] = []
        self.lock = threading.Lock()
        self.closed = False
        self._fill()

    def _spawn(self, log_path: Path | str, env: dict[str, str]) -> Any:
        if self.zygote.alive:
            with contextlib.suppress(OSError):  # it just ended: start one of its own
                return self.zygote.spawn(log_path, self.warm)
        with open(log_path, "ab") as out:
            extra = ["--warm", json.dumps(self.warm)] if self.warm else []
            return subprocess.Popen([*WORKER_COMMAND, "standby", *extra],
                                    stdin=subprocess.PIPE, stdout=out,
                                    stderr=subprocess.STDOUT, env=env)  # fmt: skip

    def _fill(self) -> None:
        with self.lock:
            self.idle = [p for p in self.idle if p.poll() is None]
            while not self.closed and len(self.idle) < self.count:
                self.idle.append(self._spawn(self.log_path, self.env))

    @staticmethod
    def _give(proc: Any, job: bytes) -> None:
        if isinstance(proc, Forked):
            proc.give(job)
        else:
            proc.stdin.write(job)
            proc.stdin.close()

    def take(self, argv: list[str], log_path: str, env: dict[str, str]) -> tuple[Any, bool]:
        """A process running ``argv`` with ``env`` and its output appended to
        ``log_path``, and whether it was a spare (warm). Only ``flows.worker`` command
        lines can take a spare; any other starts as it is."""
        if argv[:3] != WORKER_COMMAND:
            with open(log_path, "ab") as out:
                return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env), False
        with self.lock:
            live = [p for p in self.idle if p.poll() is None]
            proc = live.pop(0) if live else None
            self.idle = live
        job = (json.dumps({"argv": argv[3:], "env": env, "log": str(Path(log_path).resolve())})
               + "\n").encode()  # fmt: skip
        warm = proc is not None
        if proc is not None:
            try:
                self._give(proc, job)
            except OSError:  # it (or its zygote) ended between the check and the job
                proc.kill()
                proc, warm = None, False
        if proc is None:
            proc = self._spawn(log_path, env)
            self._give(proc, job)
        self._fill()
        return proc, warm

    def close(self, timeout: float = 5.0) -> None:
        """End the idle spares (a closed stdin tells a spare it is not needed)."""
        with self.lock:
            self.closed, idle, self.idle = True, self.idle, []
        self.zygote.close()
        for proc in idle:
            try:
                if not isinstance(proc, Forked):
                    proc.stdin.close()
                proc.wait(timeout=timeout)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait(timeout=timeout)
