"""JAX programs compiled once per machine: a cache folder the run's processes share
(``share_compilations``) and one compiler at a time among them (``compile_turn``)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax

from diloco.config import RunConfig


def share_compilations(folder: str | os.PathLike[str]) -> None:
    """Keep the JAX programs this process and the processes it starts compile in
    ``folder`` (unless ``JAX_COMPILATION_CACHE_DIR`` names a folder already), every one
    however quick its compile (JAX keeps only those over a second by default): a learner
    started again (a restart, a spare that takes over, a joiner back after a preemption)
    loads its train step, sends and applies instead of compiling them, about 6 -> 1.4 s
    of `tiny`'s start on these CPUs and minutes of a large model's on a GPU. Through the
    environment, which child processes inherit, and JAX's settings in this one (JAX,
    imported already, read the environment then)."""
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(folder))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))  # fmt: skip


def user_cache() -> Path:
    """This user's cache folder for diloco (``$XDG_CACHE_HOME/diloco``, by default
    ``~/.cache/diloco``; with no home, the temporary folder's): what a machine keeps
    between runs it joins."""
    if base := os.environ.get("XDG_CACHE_HOME"):
        return Path(base) / "diloco"
    try:
        return Path.home() / ".cache" / "diloco"
    except RuntimeError:  # (no HOME, no entry in the password database)
        return Path(tempfile.gettempdir()) / f"diloco-{os.getuid()}"


COMPILE_LOCK = "diloco-compile.lock"  # in the JAX cache folder: one compiler at a time
COMPILE_WAIT_POLL = 0.1  # seconds between two tries of it (``go_on`` asked between)
COMPILE_WAIT_MAX = 900.0  # seconds waited for it at most (a holder frozen, not dead)


@contextlib.contextmanager
def compile_turn(
    cfg: RunConfig, what: str, go_on: Callable[[], None] = lambda: None
) -> Iterator[None]:
    """Compile a learner's programs (``what``: its model's initialization, its step,
    sends and applies) once per machine, not once per process: learners started
    together (a run's, a node's, a kill storm's spares) each compiled the same programs
    at once, on the same cores. With a JAX cache folder on this machine
    (``share_compilations``), the first to come compiles holding ``COMPILE_LOCK`` and
    then marks those programs of ``cfg`` kept; the others wait for it (``_wait_for``,
    asking ``go_on`` between tries), then load them from the cache side by side
    (measured, 4 processes of `tiny` on 2 cores, cache empty: each warm-up 13 to 16 s at
    once; with the lock around the step 8 to 12 s; around the model's initialization
    too, 4.4 to 7.7 s). A compiler that dies releases the lock (the system does),
    unmarked: the next compiles. The lock is a file's ``flock``: the cache folder must be
    on this machine's own disk."""
    folder = os.environ.get("JAX_COMPILATION_CACHE_DIR", "")
    # Not in a bucket (no lock across machines there), nor for a learner of several
    # processes: they run each program together, so one waiting for another would hang.
    if not folder or "://" in folder or jax.process_count() > 1:
        yield
        return
    of = [cfg.model_dump_json(include={"model", "inner", "data", "topology"}),
          str(cfg.pipeline.fsdp), jax.__version__, repr(jax.devices())]  # fmt: skip
    key = hashlib.sha256("\n".join([what, *of]).encode()).hexdigest()[:16]
    marker = Path(folder) / f"diloco-compiled-{key}"
    if marker.exists():
        yield
        return
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        lock = open(Path(folder) / COMPILE_LOCK, "a")  # noqa: SIM115 (closed by the with below)
    except OSError as exc:  # (JAX, unable to write there either, compiles on)
        print(f"no lock in the JAX cache folder ({exc}); compiling here", flush=True)
        yield
        return
    with lock:
        if not _wait_for(lock, what, go_on):  # (the holder is frozen: compile here)
            yield
            return
        if marker.exists():  # compiled while this one waited: load it beside the others
            fcntl.flock(lock, fcntl.LOCK_UN)
            yield
            return
        try:
            yield
            with contextlib.suppress(OSError):  # (unmarked: the next compiles again)
                marker.touch()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _wait_for(lock: Any, what: str, go_on: Callable[[], None]) -> bool:
    """Take ``compile_turn``'s ``lock`` (an open file), asking ``go_on`` between tries;
    False, not holding it, after ``COMPILE_WAIT_MAX`` seconds."""
    since, said = time.monotonic(), False
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            waited = time.monotonic() - since
            if waited > COMPILE_WAIT_MAX:
                print(f"waited {waited:.0f} s for another process's compile (it holds "
                      f"{lock.name}); compiling here", flush=True)  # fmt: skip
                return False
            if not said:
                print(f"another process of this machine compiles the learner's {what}; "
                      "waiting to load it from the cache", flush=True)  # fmt: skip
                said = True
            go_on()
            time.sleep(COMPILE_WAIT_POLL)
