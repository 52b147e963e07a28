"""Processes that must not outlive the one that started them, and what a process that
died leaves behind.

``die_with_parent``: on Linux, the kernel sends a signal to a process when its parent
dies (``prctl(PR_SET_PDEATHSIG)``): a launcher killed with SIGKILL takes its workers and
its Prefect server with it, instead of leaving them to train on unsupervised. Elsewhere
it does nothing (the run lock and ``stop_leftovers`` still apply).

``stop_leftovers``: processes named in a pid file by a process that died, still alive
and still what they were (their command line says so: a pid is reused), are asked to
stop (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import time
from collections.abc import Iterable
from pathlib import Path

PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None) -> bool:
    """Have ``sig`` sent to this process when its parent dies (Linux); True if set. If
    the parent is already gone (it died before this call: ``parent``, the pid it should
    be, is no longer the parent), ``sig`` is sent at once."""
    if _LIBC is None or _LIBC.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


def dying_with_this_process(argv: list[str]) -> list[str]:
    """``argv``, to run as a child that dies with this process (SIGTERM when it does): it
    starts through this module, which sets the signal and then becomes ``argv`` (exec keeps
    it). Not a ``preexec_fn``, which is unsafe in a process with threads."""
    return [sys.executable, "-m", "infra.processes", str(os.getpid()), *argv]


def command_line(pid: int) -> str:
    """A live process's command line ('' if it is gone, a zombie, or unreadable)."""
    try:
        if Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX":
            return ""
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (OSError, IndexError, UnicodeDecodeError):
        return ""


def environment_holds(pid: int, entry: str) -> bool:
    """Whether the environment ``pid`` started with holds ``entry`` (``NAME=VALUE``)."""
    try:
        return entry.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def write_pids(path: Path, pids: dict[str, int]) -> None:
    """Record ``pids`` (name -> pid) in ``path``, atomically."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(pids, indent=1, sort_keys=True))
    os.replace(tmp, path)


def read_pids(path: Path) -> dict[str, int]:
    try:
        return {str(k): int(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def stop_leftovers(pids: dict[str, int], marker: str, grace: float = 30.0,
                   groups: Iterable[str] = (), environ: str | None = None) -> dict[str, int]:  # fmt: skip
    """Stop each process of ``pids`` that is alive, whose command line holds ``marker``
    and (if given) whose environment holds ``environ`` (a pid reused by another program,
    or by another run's worker, is left alone): SIGTERM (and SIGCONT, should it be
    paused), then SIGKILL after ``grace`` seconds. Names in ``groups`` are process-group
    leaders: their whole group is signalled. Returns the ones found (name -> pid)."""
    found = {n: p for n, p in pids.items() if p != os.getpid() and marker in command_line(p)
             and (environ is None or environment_holds(p, environ))}  # fmt: skip

    def send(name: str, pid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if name in groups:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)

    for name, pid in found.items():
        send(name, pid, signal.SIGTERM)
        send(name, pid, signal.SIGCONT)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(command_line(p) for p in found.values()):
        time.sleep(0.1)
    for name, pid in found.items():
        if command_line(pid):
            send(name, pid, signal.SIGKILL)
    return found


if __name__ == "__main__":  # python -m infra.processes PARENT_PID PROGRAM ARGS...
    die_with_parent(signal.SIGTERM, int(sys.argv[1]))
    os.execvp(sys.argv[2], sys.argv[2:])
