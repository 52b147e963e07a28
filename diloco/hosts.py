"""One learner over several processes (hosts), joined by ``jax.distributed``.

JAX's multi-controller model runs the same program in every process: each runs the same
jitted computations in the same order over a mesh of all processes' devices. The
learner's loop makes decisions from what its transport answers (which global version to
apply, whether the uploads are backed up, where to resume), so those answers must agree.
Process 0, the leader, decides: ``ReplicatedTransport`` broadcasts its answers over the
devices (``multihost_utils.broadcast_one_to_all``), small values only. What one host
alone may be told (its machine's preemption notice) is gathered instead: the group acts
when any process was (``any_process``). The data they name each process reads from the
bucket itself (a global version; its own slices of a checkpoint), and each writes its
own part of a checkpoint, which the leader commits as one; contributions go through the
leader only. To the syncers the N processes are one
learner: one id, one stream of contributions, one checkpoint, one generation claim
(``docs/architecture.md``, "A learner over several hosts").

With one process every call here is a plain pass-through: the single-process learner
runs no collective it did not run before.
"""

from __future__ import annotations

import pickle
import secrets
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from diloco.learner import LearnerCheckpoint
from diloco.loops import GlobalView, LearnerTransport
from diloco.outer import Contribution


def process_count() -> int:
    return jax.process_count()


def is_leader() -> bool:
    """Whether this process writes for the learner (process 0 of its group)."""
    return jax.process_index() == 0


def _padded(n: int) -> int:
    """The broadcast length for ``n`` bytes: a power of two (at least 1 KiB), so that a
    few shapes are compiled for the whole run, not one per message."""
    return max(1024, 1 << (max(n, 1) - 1).bit_length())


def broadcast_object(value: Any = None) -> Any:
    """The leader's ``value`` (any picklable object), in every process: its length, then
    its bytes, each a broadcast from process 0. Every process must call it at the same
    point of the program (followers pass nothing)."""
    if process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    leader = is_leader()
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL) if leader else b""
    size = np.array([len(data)], dtype=np.int32)
    size = int(np.asarray(multihost_utils.broadcast_one_to_all(size, is_source=leader))[0])
    buf = np.zeros(_padded(size), dtype=np.uint8)
    if leader:
        buf[:size] = np.frombuffer(data, dtype=np.uint8)
    buf = np.asarray(multihost_utils.broadcast_one_to_all(buf, is_source=leader))
    return value if leader else pickle.loads(buf[:size].tobytes())


def any_process(flag: bool) -> bool:
    """Whether ``flag`` is true in any process of the group (each process's own flag,
    gathered to all): what one host alone was told, such as its machine's preemption
    notice, the whole group acts on at the same point. Every process must call it at
    the same point of the program."""
    if process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.array([flag], dtype=np.int32))
    return bool(np.asarray(flags).any())


class ReplicatedTransport:
    """A learner transport that answers alike in every process of one learner.

    ``own`` is this process's transport over the bucket (``BackgroundIO``): every process
    has one. Every call is made by every process in the same order (the loop is the
    same program everywhere). Decisions are the leader's, broadcast: what it sent, whether
    its uploads are backed up, which version of a fragment is newest, which checkpoint
    to resume from. Data is not broadcast: each process reads what the leader named
    from the bucket itself, so no host holds more than it would alone.

    - ``read(fragment, version)``: this process's own read of a global version (the
      leader's comes from its poller);
    - ``load(step)``: this process's own read of the checkpoint at ``step``, each leaf
      placed on its devices from the parts that overlap them;
    - ``part(state, write_id)``: this process's part of a checkpoint of ``state`` (its
      shards), which ``own`` writes; the leader's also commits the whole once every
      part is written. ``write_id`` names the checkpoint's write, the same in all.

    Only the leader sends contributions and polls for versions."""

    def __init__(
        self,
        own: LearnerTransport,
        read: Callable[[int, int], GlobalView],
        load: Callable[[int], LearnerCheckpoint | None],
        part: Callable[[Any, str], Any],
    ):
        self.own, self.read, self.load, self.part = own, read, load, part
        self.leader = is_leader()

    def __getattr__(self, name: str) -> Any:  # counters the runtime reports (this process's)
        if name in ("own", "read", "load", "part", "leader"):
            raise AttributeError(name)
        return getattr(self.own, name)

    def send(self, c: Contribution) -> None:
        if self.leader:
            self.own.send(c)

    def want(self, fragment: int, above: int) -> None:
        if self.leader:
            self.own.want(fragment, above)

    def backed_up(self) -> bool:
        return bool(broadcast_object(self.own.backed_up() if self.leader else None))

    def latest_global(self, fragment: int) -> GlobalView | None:
        view = self.own.latest_global(fragment) if self.leader else None
        version = broadcast_object(view.version if view is not None else None)
        if version is None:
            return None
        return view if view is not None else self.read(fragment, version)

    def save_checkpoint(self, ckpt: LearnerCheckpoint) -> None:
        write_id = broadcast_object(secrets.token_hex(8) if self.leader else None)
        part = self.part(ckpt.opt_state, write_id)
        self.own.save_checkpoint(LearnerCheckpoint(step=ckpt.step, seq=ckpt.seq, opt_state=part))

    def load_checkpoint(self) -> LearnerCheckpoint | None:
        ckpt = self.own.load_checkpoint() if self.leader else None
        step = broadcast_object(ckpt.step if ckpt is not None else None)
        if step is None or ckpt is not None:
            return ckpt
        return self.load(step)

    def sent_so_far(self) -> tuple[int, int]:
        return tuple(broadcast_object(self.own.sent_so_far() if self.leader else None))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for this process's writes (the leader's uploads and checkpoints, another's
        checkpoint parts); no collective here: a process may flush alone, on its way out."""
        return self.own.flush(timeout)

    def close(self, wait: bool = True) -> None:
        self.own.close(wait)
