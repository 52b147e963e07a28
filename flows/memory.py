"""The machine's memory as the launcher sees it: what is available to the run's
processes, and whether a worker killed by SIGKILL was killed by the OOM killer.

A worker the kernel kills for memory dies by SIGKILL like one killed from outside (a
chaos kill, an operator). The kernel says which it was in two places: its log
(``/dev/kmsg``: "Out of memory: Killed process PID"), where it names the process, and
the ``oom_kill`` count of the memory cgroup the run lives in (cgroup v2
``memory.events``, v1 ``memory.oom_control``), which only counts. Either may be
unreadable (no privilege, another kernel): then a SIGKILL while the machine was short
of memory is "likely out of memory", and any other SIGKILL just that. The worker's peak
resident memory (``VmHWM``) and the memory available at its last look go with it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from flows.observe import human_bytes

CGROUP_ROOT = Path("/sys/fs/cgroup")
KMSG = "/dev/kmsg"
SHORT = 0.1  # available memory below this share of the total: the machine was short


def _cgroup_dirs() -> list[Path]:
    """This process's memory cgroup folders (v2, then v1), innermost first."""
    out = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            out.append(CGROUP_ROOT / path.lstrip("/"))
        elif "memory" in controllers.split(","):
            out.append(CGROUP_ROOT / "memory" / path.lstrip("/"))
    out += [CGROUP_ROOT, CGROUP_ROOT / "memory"]  # a container sees its own at the root
    return out


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:  # not there, or not ours to read
        return None


def _read_number(path: Path) -> int | None:
    text = (_read(path) or "").strip()
    return int(text) if text.isdigit() else None


def memory_limit() -> tuple[int, int]:
    """(available, total) bytes for the run's processes: the machine's, or its memory
    cgroup's limit and what is left under it, whichever is less."""
    vm = psutil.virtual_memory()
    available, total = int(vm.available), int(vm.total)
    for folder in _cgroup_dirs():
        limit = _read_number(folder / "memory.max") or _read_number(
            folder / "memory.limit_in_bytes"
        )
        if limit is None or limit >= total:
            continue
        used = _read_number(folder / "memory.current") or _read_number(
            folder / "memory.usage_in_bytes"
        )
        return min(available, max(0, limit - (used or 0))), limit
    return available, total


def oom_kill_count() -> int | None:
    """How many processes the OOM killer has killed in this process's memory cgroup (and
    below it), or None if no cgroup says."""
    for folder in _cgroup_dirs():
        for name in ("memory.events", "memory.oom_control"):
            count = parse_oom_kill(_read(folder / name) or "")
            if count is not None:
                return count
    return None


def parse_oom_kill(text: str) -> int | None:
    """The ``oom_kill N`` line of a cgroup's ``memory.events`` or ``memory.oom_control``."""
    found = re.search(r"^oom_kill (\d+)$", text, re.MULTILINE)
    return int(found.group(1)) if found else None


def kernel_oom_record(pid: int, since: float, kmsg: str = KMSG) -> str | None:
    """The kernel log's record of the OOM killer killing ``pid`` no earlier than
    ``since`` (``time.monotonic()``, the clock of the log's time stamps), or None (no
    such record, or the log is not readable)."""
    try:
        fd = os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    found: list[str] = []
    try:
        while True:
            try:
                raw = os.read(fd, 8192)
            except BrokenPipeError:  # records overwritten while reading: go on
                continue
            except OSError:  # BlockingIOError: read to the end
                break
            if not raw:
                break
            record = match_oom_record(raw.decode(errors="replace"), pid, since)
            if record:
                found.append(record)
    finally:
        os.close(fd)
    # "Killed process PID (name) total-vm:..., anon-rss:..." says the most; "oom-kill:" the cgroup
    return max(found, key=lambda r: "Killed process" in r, default=None)


def match_oom_record(record: str, pid: int, since: float) -> str | None:
    """The message of a ``/dev/kmsg`` record (``PRIO,SEQ,MICROSECONDS,FLAGS;MESSAGE``) if
    it is the OOM killer's kill of ``pid`` at ``since`` or later."""
    head, _, message = record.partition(";")
    fields = head.split(",")
    try:
        stamp = int(fields[2]) / 1e6
    except (IndexError, ValueError):
        return None
    message = message.splitlines()[0] if message else ""
    killed = re.search(rf"(Killed process {pid}\b|oom-kill:.*\bpid={pid}\b)", message)
    return message.strip() if killed and stamp >= since - 5.0 else None


_attributed = {"count": None}  # the oom_kill count up to which kills were attributed
_lock = threading.Lock()


@dataclass
class Watch:
    """One worker process as it runs: its peak resident memory and the memory available
    to the run, sampled while the launcher waits on it, to say why it died."""

    pid: int
    started: float  # time.monotonic() at its start
    peak: int = 0
    available: int | None = None
    total: int | None = None

    def __post_init__(self) -> None:
        with _lock:
            if _attributed["count"] is None:
                _attributed["count"] = oom_kill_count()

    def sample(self) -> None:
        """Read the process's peak resident set (VmHWM) and the memory available now."""
        status = _read(Path(f"/proc/{self.pid}/status")) or ""
        found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
        if found:
            self.peak = max(self.peak, int(found.group(1)) * 1024)
        self.available, self.total = memory_limit()

    def death(self, code: int) -> tuple[str, bool]:
        """Why a process that ended with ``code`` (negative: a signal) died, and whether
        the OOM killer killed it."""
        if code != -signal.SIGKILL:
            return f"killed by signal {-code} ({signal.Signals(-code).name})", False
        figures = self._figures()
        record = kernel_oom_record(self.pid, self.started)
        if record is not None:
            return f"killed by the OOM killer ({figures}; kernel: {record})", True
        with _lock:
            count, before = oom_kill_count(), _attributed["count"]
            if count is not None and before is not None and count > before:
                _attributed["count"] = before + 1  # this death takes one of them
                return (f"killed by the OOM killer ({figures}; the memory cgroup's oom_kill "
                        f"count rose to {count})"), True  # fmt: skip
        if self.available is not None and self.total and self.available < SHORT * self.total:
            return f"killed by SIGKILL, likely out of memory ({figures})", False
        return f"killed by SIGKILL ({figures})", False

    def _figures(self) -> str:
        peak = f"peak {human_bytes(self.peak)} resident" if self.peak else "peak unknown"
        if self.available is None or not self.total:
            return peak
        return (f"{peak}; {human_bytes(self.available)} of {human_bytes(self.total)} "
                "available at its last look")  # fmt: skip


def wait(proc: Any, watch: Watch, every: float = 1.0) -> int:
    """``proc.wait()``, sampling ``watch`` meanwhile."""
    while True:
        watch.sample()
        try:
            return proc.wait(timeout=every)
        except subprocess.TimeoutExpired:
            continue
