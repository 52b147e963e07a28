"""One learner over several processes (hosts), joined by ``jax.distributed``.

JAX's multi-controller model runs the same program in every process: each runs the same
jitted computations in the same order over a mesh of all processes' devices. The
learner's loop makes decisions from what its transport answers (which global version to
apply, whether the uploads are backed up, where to resume), so those answers must agree.
Process 0, the leader, owns the bucket transport; ``ReplicatedTransport`` gives every
process, the leader included, what the leader read, broadcast over the devices
(``multihost_utils.broadcast_one_to_all``), and writes (contributions, checkpoints) go
through the leader only. To the syncers the N processes are one learner: one id, one
stream of contributions, one checkpoint, one generation claim (``docs/architecture.md``,
"A learner over several hosts").

With one process every call here is a plain pass-through: the single-process learner
runs no collective it did not run before.
"""

from __future__ import annotations

import pickle
from typing import Any

import jax
import numpy as np
import optax

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


def host_tree(tree: Any) -> Any:
    """``tree``'s arrays as NumPy on every process (replicated or sharded over the
    processes: ``inner.to_host``), in one order on all of them."""
    from diloco.inner import to_host

    return jax.tree.map(to_host, tree)


class ReplicatedTransport:
    """A learner transport that answers alike in every process of one learner.

    ``inner`` is the leader's transport (``BackgroundIO`` over the bucket) and None in
    the other processes. Every call is made by every process in the same order (the
    loop is the same program everywhere); an answer is read by the leader and
    broadcast. A global version travels once per new version: each call broadcasts only
    the version number, and the parameters when the number is one this process has not
    cached. ``place`` puts a host optimizer state on the learner's mesh (the
    checkpoint's state is broadcast as host arrays and placed by each process)."""

    def __init__(self, inner: LearnerTransport | None, place: Any):
        self.inner = inner
        self.place = place
        self.leader = is_leader()
        if self.leader != (inner is not None):
            raise ValueError("the leader (process 0) and only it holds the bucket transport")
        self.cache: dict[int, GlobalView | None] = {}

    def __getattr__(self, name: str) -> Any:  # counters the runtime reports (leader's)
        if name in ("inner", "place", "leader", "cache"):
            raise AttributeError(name)
        if self.inner is not None:
            return getattr(self.inner, name)
        return None if name == "fenced" else 0

    def send(self, c: Contribution) -> None:
        if self.inner is not None:
            self.inner.send(c)

    def want(self, fragment: int, above: int) -> None:
        if self.inner is not None:
            self.inner.want(fragment, above)

    def backed_up(self) -> bool:
        return bool(broadcast_object(self.inner.backed_up() if self.inner else None))

    def latest_global(self, fragment: int) -> GlobalView | None:
        view = self.inner.latest_global(fragment) if self.inner else None
        version = broadcast_object(view.version if view is not None else None)
        held = self.cache.get(fragment)
        if version is None:
            return None
        if held is None or held.version != version:  # alike in every process
            self.cache[fragment] = held = broadcast_object(view)
        return held

    def save_checkpoint(self, ckpt: LearnerCheckpoint) -> None:
        # Brought to the host here, by every process in the loop's order (a state sharded
        # over processes is gathered by a collective): the leader's upload thread then
        # writes host arrays only.
        host = LearnerCheckpoint(step=ckpt.step, seq=ckpt.seq, opt_state=host_tree(ckpt.opt_state))
        if self.inner is not None:
            self.inner.save_checkpoint(host)

    def load_checkpoint(self) -> LearnerCheckpoint | None:
        ckpt = self.inner.load_checkpoint() if self.inner else None
        if ckpt is not None:
            ckpt = LearnerCheckpoint(ckpt.step, ckpt.seq, host_tree(ckpt.opt_state))
        ckpt = broadcast_object(ckpt)
        if ckpt is None:
            return None
        opt: optax.OptState = self.place(ckpt.opt_state)
        return LearnerCheckpoint(step=ckpt.step, seq=ckpt.seq, opt_state=opt)

    def sent_so_far(self) -> tuple[int, int]:
        return tuple(broadcast_object(self.inner.sent_so_far() if self.inner else None))

    def flush(self, timeout: float | None = None) -> bool:
        """The leader waits for its writes; the others have none (no collective here: a
        process may flush alone, on its way out)."""
        return self.inner.flush(timeout) if self.inner is not None else True

    def close(self, wait: bool = True) -> None:
        if self.inner is not None:
            self.inner.close(wait)
