"""A fragment's values a piece at a time, so a syncer's memory is flat in model size.

A syncer never needs a whole fragment at once: the merge, the outer step, validation and
quantization are elementwise or blockwise, and the few whole-tensor quantities (norms)
are sums. So the syncer walks a fragment in **pieces**, ``(tensor, start, stop)`` of at
most ``PIECE`` values (a multiple of the quantization block, so blocks never straddle
two pieces), tensors in sorted name order, and holds one piece of each input at a time.

- ``Tensors``: values readable a piece at a time. ``ArrayTensors`` is a plain
  ``{name: ndarray}`` dict that also reads pieces (the simulator, small runs);
  storage-backed ones (``flows.bucket_io``) read the piece's chunk objects from a bucket.
- ``Payload``: a contribution's tensors as stored (quantized): ``QuantizedPayload`` over
  ``{name: QuantizedTensor}``, or a bucket reader; ``payload_view`` wraps either.
- ``VersionSink``: where a merge writes the new version, a piece at a time (in piece
  order): ``MemorySink`` keeps it in arrays; the pipeline's streams it into the buckets.

The piece boundaries depend only on the shapes, so every transport computes the same
values in the same order, bit for bit.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import jax
import numpy as np
import optax

from protocol.quantize import QuantizedTensor, dequantize, payload_bytes

T = TypeVar("T")

PIECE = (
    1 << 18
)  # values: a quarter of a storage chunk (1 Mi values), so pieces walk chunks in order


def piece_size(block_size: int = 128) -> int:
    """``PIECE`` rounded down to whole quantization blocks and to an even count (int4
    packs two values per byte)."""
    unit = math.lcm(max(1, block_size), 2)
    return max(unit, PIECE - PIECE % unit)


def pieces(
    shapes: Mapping[str, Sequence[int]], block_size: int = 128
) -> Iterator[tuple[str, int, int]]:
    """``(name, start, stop)`` over every tensor's flattened values, names sorted."""
    step = piece_size(block_size)
    for name in sorted(shapes):
        n = math.prod(shapes[name])
        for start in range(0, n, step):
            yield name, start, min(n, start + step)


@runtime_checkable
class Tensors(Protocol):
    """Named float32 tensors, read a piece of flattened values at a time."""

    @property
    def shapes(self) -> Mapping[str, tuple[int, ...]]: ...

    def piece(self, name: str, start: int, stop: int) -> np.ndarray:
        """Values ``[start, stop)`` of tensor ``name`` flattened in C order (float32)."""


@runtime_checkable
class KeptTensors(Protocol):
    """Values that can give a tensor as they keep it, undecoded (a version held in a local
    file keeps a bf16 wire's codes: ``storage_layout.spill.SpilledParams``), for a reader
    that widens it where it goes (a learner, on its devices)."""

    def exact(self, name: str) -> np.ndarray:
        """Tensor ``name`` in its shape, as kept: bfloat16 or float32."""


class ArrayTensors(dict):
    """``{name: float32 ndarray}`` that is also ``Tensors``."""

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(v.shape) for n, v in self.items()}

    def piece(self, name: str, start: int, stop: int) -> np.ndarray:
        return self[name].reshape(-1)[start:stop]


def sizes(values: Mapping[str, Any]) -> dict[str, int]:
    """Each tensor's number of values, from its shape where the mapping tells it (a
    ``Tensors``, such as a version kept in a local file) rather than by reading it."""
    if isinstance(values, Tensors):
        return {n: math.prod(s) for n, s in values.shapes.items()}
    return {n: int(np.size(v)) for n, v in values.items()}


def full_bytes(params: Mapping[str, Any], wire_dtype: str) -> int:
    """The bytes of ``params`` stored whole in ``wire_dtype``."""
    return sum(payload_bytes(n, wire_dtype) for n in sizes(params).values())


def as_tensors(values: Tensors | Mapping[str, Any]) -> Tensors:
    """``values`` as ``Tensors``: a mapping of arrays becomes float32 ``ArrayTensors``."""
    if isinstance(values, Tensors) or not isinstance(values, Mapping):
        return values
    return ArrayTensors({n: np.asarray(v, dtype=np.float32) for n, v in values.items()})


def materialize(values: Tensors) -> dict[str, np.ndarray]:
    """Every tensor whole (small fragments, tests): ``{name: float32 ndarray}``."""
    if isinstance(values, Mapping):
        return {n: np.asarray(v, dtype=np.float32) for n, v in values.items()}
    out = {}
    for name, shape in values.shapes.items():
        out[name] = (
            np.concatenate(
                [values.piece(name, a, b) for _, a, b in pieces({name: shape})] or [np.zeros(0)]
            )
            .astype(np.float32)
            .reshape(shape)
        )
    return out


@dataclass(frozen=True)
class TensorMeta:
    """What a payload says of one tensor before any value is read."""

    kind: str
    shape: tuple[int, ...]
    block_size: int
    nbytes: int | None = None  # the stored payload's size where known (in memory)
    dtype: str | None = None  # its storage dtype where known before reading

    @property
    def size(self) -> int:
        return math.prod(self.shape)


class Payload(Protocol):
    """A contribution's tensors as they travel (quantized), read a piece at a time."""

    def index(self) -> Mapping[str, TensorMeta]: ...

    def read(self, name: str, start: int, stop: int) -> QuantizedTensor:
        """Values ``[start, stop)`` of ``name`` as stored (flat), with their scales."""


def slice_quantized(q: QuantizedTensor, start: int, stop: int) -> QuantizedTensor:
    """Values ``[start, stop)`` of ``q`` flattened (``start`` on a block boundary, even for
    int4), as a flat ``QuantizedTensor`` of the same kind."""
    n = stop - start
    if q.kind in ("fp32", "bf16", "int8"):
        data = q.data.reshape(-1)[start:stop]
    else:  # int4: two codes per byte
        data = q.data.reshape(-1)[start // 2 : -(-stop // 2)]
    scales = None
    if q.scales is not None:
        scales = q.scales[start // q.block_size : -(-stop // q.block_size)]
    return QuantizedTensor(q.kind, (n,), data, scales, q.block_size)


class QuantizedPayload:
    """``Payload`` over ``{name: QuantizedTensor}`` held in memory."""

    def __init__(self, tensors: Mapping[str, QuantizedTensor]):
        self.tensors = tensors

    def index(self) -> dict[str, TensorMeta]:
        return {n: TensorMeta(q.kind, tuple(q.shape), q.block_size, q.nbytes, q.data.dtype.name)
                for n, q in self.tensors.items()}  # fmt: skip

    def read(self, name: str, start: int, stop: int) -> QuantizedTensor:
        return slice_quantized(self.tensors[name], start, stop)

    @property
    def nbytes(self) -> int:
        return sum(q.nbytes for q in self.tensors.values())


def payload_view(payload: Any) -> Payload:
    """A contribution's payload as a ``Payload`` (a mapping of tensors is wrapped)."""
    return QuantizedPayload(payload) if isinstance(payload, Mapping) else payload


class PayloadTensors:
    """A payload's values, dequantized a piece at a time (``Tensors``)."""

    def __init__(self, payload: Payload):
        self.payload = payload
        self._index = payload.index()

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: m.shape for n, m in self._index.items()}

    def piece(self, name: str, start: int, stop: int) -> np.ndarray:
        return dequantize(self.payload.read(name, start, stop)).reshape(-1)


class Difference:
    """``a - b`` piece by piece (a cumulative send minus the part already merged)."""

    def __init__(self, a: Tensors, b: Tensors):
        self.a, self.b = a, b

    @property
    def shapes(self) -> Mapping[str, tuple[int, ...]]:
        return self.a.shapes

    def piece(self, name: str, start: int, stop: int) -> np.ndarray:
        return self.a.piece(name, start, stop) - self.b.piece(name, start, stop)


class LastPiece:
    """``Tensors`` that keep the last piece read, for a loop over ``pieces`` in which
    several readers want the same piece: a syncer's current version is read by each
    anchored contribution (``current - base + delta``) and by the outer step, and a
    base version by every contribution made on it; each is read once a piece. Callers
    do not write into what ``piece`` returns."""

    def __init__(self, tensors: Tensors | Mapping[str, Any]):
        self.tensors = as_tensors(tensors)
        self._key: tuple[str, int, int] | None = None
        self._value: np.ndarray | None = None

    @property
    def shapes(self) -> Mapping[str, tuple[int, ...]]:
        return self.tensors.shapes

    def piece(self, name: str, start: int, stop: int) -> np.ndarray:
        if self._key != (name, start, stop):
            self._value, self._key = None, None  # (what was held goes before the read)
            self._value = self.tensors.piece(name, start, stop)
            self._key = (name, start, stop)
        return self._value


OVERLAP_PIECES = 4  # pieces a loop has before ``overlapped`` runs its work on a thread


def overlapped(
    items: Iterable[T], work: Callable[[T], None], depth: int = 2, beside: bool = True
) -> None:
    """``work(item)`` for every item, in order, on one other thread while this thread
    makes the next items: a syncer reads piece ``i + 1`` (its chunks, their decoding)
    while piece ``i`` is merged, stepped and written, so the two share the host's cores
    (NumPy releases the GIL in its array operations). At most ``depth`` items wait for
    ``work``. The first failure of either side is raised here, after the other side has
    stopped, and no ``work`` runs after a failed one (what it writes stays in order).

    ``beside`` False runs it all on this thread: for a loop of a few small pieces (the
    simulator's fragments, a small model's), where a thread's start and the hand-over of
    each item cost more than they save (a merge of three small tensors took 4.6 times as
    long; ``loop_beside`` decides)."""
    if not beside:
        for item in items:
            work(item)
        return
    failed = threading.Event()

    def run(item: T) -> None:
        if failed.is_set():
            return
        try:
            work(item)
        except BaseException:
            failed.set()
            raise

    waiting: deque[Future] = deque()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="overlapped") as pool:
        try:
            for item in items:
                waiting.append(pool.submit(run, item))
                while waiting and (len(waiting) > depth or waiting[0].done()):
                    waiting.popleft().result()
            while waiting:
                waiting.popleft().result()
        except BaseException:
            failed.set()
            for future in waiting:
                future.cancel()
            raise


def loop_beside(shapes: Mapping[str, Sequence[int]], block_size: int = 128) -> bool:
    """Whether a loop over ``pieces(shapes)`` is long enough to run ``overlapped``'s work
    on a second thread: ``OVERLAP_PIECES`` pieces or more."""
    first = itertools.islice(pieces(shapes, block_size), OVERLAP_PIECES)
    return len(list(first)) == OVERLAP_PIECES


# --- the outer optimizer's state, per parameter --------------------------------------


def state_slots(tx: optax.GradientTransformation, shapes: Mapping[str, Sequence[int]]) -> int:
    """How many state arrays ``tx`` keeps per parameter (0 for plain SGD, 1 with
    momentum, 2 for Adam). A piece is stepped alone, so every array must belong to one
    parameter and have its shape (elementwise state); besides them the state may hold
    step counts (Adam's ``count``: an integer scalar from 0, one more each update), which
    the syncer gives each step (``step_piece``: its fragment's outer steps). Any other
    leaf is refused by name."""
    probe = {n: np.zeros(2, np.float32) for n in shapes}
    state = tx.init(probe)
    stepped = jax.tree_util.tree_leaves(tx.update(probe, state, probe)[1])
    per: dict[str, int] = {n: 0 for n in shapes}
    for (path, leaf), after in zip(jax.tree_util.tree_flatten_with_path(state)[0], stepped,
                                   strict=True):  # fmt: skip
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        if names and names[-1] in per and np.shape(leaf) == (2,):
            per[names[-1]] += 1
        elif not _is_count(leaf, after):
            raise ValueError(f"the outer optimizer's state leaf {jax.tree_util.keystr(path)} is "
                             "neither elementwise per parameter nor a step count; it cannot "
                             "be stepped a piece at a time")  # fmt: skip
    counts = set(per.values())
    if len(counts) > 1:
        raise ValueError(f"the outer optimizer keeps unequal state per parameter: {per}")
    return counts.pop() if counts else 0


def _is_count(leaf: Any, after: Any) -> bool:
    """Whether a state leaf is a step count: an integer scalar, 0 at first and 1 after one
    update."""
    leaf, after = np.asarray(leaf), np.asarray(after)
    return (leaf.shape == () and np.issubdtype(leaf.dtype, np.integer) and int(leaf) == 0
            and int(after) == 1)  # fmt: skip


def step_piece(
    tx: optax.GradientTransformation,
    name: str,
    params: np.ndarray,
    slots: Sequence[np.ndarray],
    merged: np.ndarray,
    steps: int = 0,
) -> tuple[np.ndarray, list[np.ndarray]]:
    """One outer step on one piece of tensor ``name``: new values and state slots, the
    optimizer's step counts being ``steps`` (the outer steps its fragment has taken). The
    optimizer is elementwise, so stepping pieces apart gives the bits stepping the whole
    tensor gives.

    optax's elementwise transforms (``sgd``, its momentum and Nesterov) map NumPy leaves
    to NumPy leaves, so the step runs in NumPy, one array operation after another as
    JAX's eager dispatch runs them (the same bits). What would dispatch to JAX is kept
    out of the loop: the state's structure is made once per tensor (``tx.init`` makes
    zeros on a device), and the update is added as ``optax.apply_updates`` adds it
    (``p + u`` in the parameter's dtype) without the round trip through a device array:
    a piece's step took 1.4 ms that way, 0.2 ms this way."""
    structure, counts = _state_structure(tx, name)
    given = iter(slots)
    leaves = [np.asarray(steps, np.int32) if c else next(given) for c in counts]
    state = jax.tree_util.tree_unflatten(structure, leaves)
    updates, state = tx.update({name: merged}, state, {name: params})
    new = np.asarray(params + updates[name], dtype=np.float32)
    stepped = jax.tree_util.tree_leaves(state)
    return new, [np.asarray(x, dtype=np.float32) for x, c in zip(stepped, counts, strict=True)
                 if not c]  # fmt: skip


@functools.lru_cache(maxsize=4096)
def _state_structure(tx: optax.GradientTransformation, name: str) -> tuple[Any, tuple[bool, ...]]:
    """The tree structure of ``tx``'s state for one tensor named ``name``, and which of
    its leaves are step counts (the scalars: the tensor's own are arrays)."""
    state = tx.init({name: np.zeros(2, np.float32)})
    counts = tuple(np.shape(x) == () for x in jax.tree_util.tree_leaves(state))
    return jax.tree_util.tree_structure(state), counts


def slot_leaves(slots: Sequence[Tensors], shapes: Mapping[str, Sequence[int]]) -> list[np.ndarray]:
    """The optimizer state as optax lists its leaves (slot by slot, names sorted), whole."""
    whole = [materialize(s) for s in slots]
    return [w[n] for w in whole for n in sorted(shapes)]


def leaves_to_slots(
    leaves: Sequence[Any], shapes: Mapping[str, Sequence[int]], slots: int
) -> list[Tensors]:
    """Inverse of ``slot_leaves``: leaves (arrays, or ``Tensors`` already) -> slots."""
    if len(leaves) and not isinstance(leaves[0], np.ndarray | jax.Array):
        return [as_tensors(x) for x in leaves]
    names = sorted(shapes)
    if len(leaves) != slots * len(names):
        raise ValueError(f"{len(leaves)} optimizer leaves for {len(names)} tensors and "
                         f"{slots} state arrays each")  # fmt: skip
    return [ArrayTensors({n: np.asarray(leaves[k * len(names) + i], np.float32)
                          for i, n in enumerate(names)}) for k in range(slots)]  # fmt: skip


# --- where a merge writes --------------------------------------------------------------


class VersionSink(Protocol):
    """A new version being written, a piece at a time in ``pieces`` order."""

    def write(
        self, name: str, start: int, params: np.ndarray, slots: Sequence[np.ndarray]
    ) -> None: ...

    def finish(self) -> tuple[Tensors, list[Tensors]]:
        """Everything written: the version's parameters and state slots, readable."""

    def abort(self) -> None:
        """Drop what was written (a merge that failed half way)."""


SinkFactory = Callable[[int, int, Mapping[str, Sequence[int]], int], VersionSink]


class MemorySink:
    """A version held in arrays (the simulator, small runs)."""

    def __init__(
        self, fragment: int, version: int, shapes: Mapping[str, Sequence[int]], slots: int
    ):
        self.params = ArrayTensors({n: np.empty(tuple(s), np.float32) for n, s in shapes.items()})
        self.slots = [ArrayTensors({n: np.empty(tuple(s), np.float32) for n, s in shapes.items()})
                      for _ in range(slots)]  # fmt: skip

    def write(self, name: str, start: int, params: np.ndarray, slots: Sequence[np.ndarray]) -> None:
        stop = start + params.size
        self.params[name].reshape(-1)[start:stop] = params
        for held, values in zip(self.slots, slots, strict=True):
            held[name].reshape(-1)[start:stop] = values

    def finish(self) -> tuple[Tensors, list[Tensors]]:
        return self.params, self.slots

    def abort(self) -> None:
        pass
