"""Transports: where contributions, global versions and checkpoints live, and how long
they take to travel.

- A ``Store`` holds a run's state: committed contributions, global versions (the fp32
  master copy and outer optimizer state for syncers, the wire-dtype view for learners),
  learner checkpoints. ``MemoryStore`` keeps it in this process;
  ``flows.bucket_io.BucketStore`` keeps it in the regions' buckets. Both round globals
  to the wire dtype the same way, so a run gives identical numbers through either.
- ``StoreLearnerView`` is a learner's transport over a store with no delay (the
  pipeline wraps it in background I/O threads).
- ``SimulatedNetwork`` is the simulator's transport over any store: a contribution
  reaches the syncer ``latency + 8 bytes / bandwidth`` seconds after it is sent, a
  global version reaches learners as long after it is published, on the virtual clock.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from diloco import records
from diloco.learner import LearnerCheckpoint
from diloco.loops import GlobalView, StoredFragment, Unreadable
from diloco.outer import Contribution, FlatParams
from diloco.records import Record
from diloco.syncer import GlobalVersion
from diloco.tensors import (
    Payload,
    TensorMeta,
    Tensors,
    as_tensors,
    full_bytes,
    payload_view,
    sizes,
)
from diloco.units import MemoryLedger, UnitLedger, UnitPlan
from protocol.quantize import (
    Pieces,
    QuantizedTensor,
    dequantize,
    payload_bytes,
    piece_step,
    quantize,
)

log = logging.getLogger(__name__)

# What a version's tensors are gathered into as they come, ``(name, float32 values)`` one
# at a time: a dict by default; a learner's pipeline keeps them in a local file instead
# (``storage_layout.spill``), so it never holds a whole fragment (from a bucket the values
# come in pieces, ``storage_layout.store.TensorPieces``: nor a whole tensor).
Collect = Callable[[Iterator[tuple[str, np.ndarray]]], FlatParams]


class Store(Protocol):
    def put_contribution(self, c: Contribution) -> None: ...

    def contributions(
        self, learner: str, fragment: int, after: int
    ) -> list[Contribution | Unreadable]: ...

    def read(self, c: Contribution) -> Contribution | Unreadable:
        """``c`` with its payload, when ``contributions`` listed it as a header."""

    def sent_so_far(self, learner: str) -> tuple[int, int]: ...

    def save_checkpoint(self, learner: str, ckpt: LearnerCheckpoint) -> None: ...

    def load_checkpoint(self, learner: str, step: int | None = None) -> LearnerCheckpoint | None:
        """The newest readable checkpoint of ``learner``, or the one at ``step``."""

    def publish(self, gv: GlobalVersion, opt_leaves: list[Any], record: Record) -> bool: ...

    def newest_version(self, learner: str | None, fragment: int) -> int | None:
        """Newest version of ``fragment`` in ``learner``'s region (None: the syncers')."""

    def read_global(
        self, learner: str, fragment: int, version: int, collect: Collect | None = None
    ) -> GlobalView:
        """Version ``version`` of ``fragment`` as ``learner`` reads it; with ``collect``,
        its tensors handed to it one at a time and its result the version's values."""

    def read_delta(self, learner: str, fragment: int, version: int) -> GlobalDelta | None:
        """The compact update that makes ``version`` from the version before it, as
        ``learner`` reads it (None: this version was published whole only)."""

    def load_fragment(self, fragment: int, window: int) -> StoredFragment: ...

    def ledger(self, plan: UnitPlan) -> UnitLedger:
        """Who takes which data, with ``data.assign = "units"`` (``diloco.units``)."""

    def add_learner(self, learner: str) -> None:
        """``learner`` is added beyond the run's slots (``sim.joins``; ``diloco join`` in
        the pipeline): its region's bucket holds its member record from now on."""

    def close(self, summary: dict[str, Any]) -> None:
        """The run is over (the simulator's summary, for stores that keep one)."""


def wire_view(params: FlatParams, wire_dtype: str) -> FlatParams:
    """What learners download: the parameters rounded to the wire dtype."""
    return {n: dequantize(quantize(v, wire_dtype)) for n, v in params.items()}


Delta = dict[str, QuantizedTensor]


@dataclass(frozen=True)
class GlobalDelta:
    """A version's compact update: ``delta`` turns the learners' copy of ``base`` into
    theirs of ``version`` (``apply_delta``)."""

    version: int
    base: int
    delta: Payload | Delta  # read a piece at a time (``Payload``) or held (the simulator)
    meta: Mapping[str, Any]


def learners_copy(base: np.ndarray, delta: QuantizedTensor, wire_dtype: str) -> QuantizedTensor:
    """The learners' copy of a tensor (or a piece of one) from their copy of the base
    version and the compact update: ``round(base + dequantize(delta))`` in float32, on
    the wire dtype's grid. Learners applying an update and the syncer building the full
    copy both come here, so both ways give the same bits."""
    return quantize(np.asarray(base, np.float32) + dequantize(delta), wire_dtype)


def downlink_piece(
    params: np.ndarray, base: np.ndarray | None, wire_dtype: str, downlink: str, block_size: int
) -> tuple[QuantizedTensor, QuantizedTensor | None]:
    """The downlink rule for one tensor, or a piece of one that starts on a quantization
    block (a streamed merge writes a version piece by piece): the learners' copy as
    stored (the wire dtype), and with ``downlink`` int4 or int8 and the previous copy
    ``base`` at hand, the quantized difference that turns ``base`` into it.

    With a difference, the copy is not ``params`` rounded but ``base`` plus the
    difference: the learners' copy, which both ways reach bit for bit. What the
    difference leaves out (``params`` minus that copy) is in the next difference, which is
    taken against the copy and not against the previous ``params``: the syncer carries
    the residual, and learners' copies track the master copy instead of drifting away."""
    if downlink == "full" or base is None:
        return quantize(params, wire_dtype, block_size), None
    delta = quantize(params - base, downlink, block_size)
    return learners_copy(base, delta, wire_dtype), delta


class UpdatedTensor(Pieces):
    """Tensor ``name`` of a version, the learners' copy of its base plus the compact
    update (``learners_copy``), made a piece at a time (``protocol.quantize.Pieces``): the
    base's piece, the update's piece as stored, and their sum in float32."""

    def __init__(self, base: Tensors, update: Payload, name: str, meta: TensorMeta,
                 wire_dtype: str):  # fmt: skip
        self.base, self.update, self.name, self.wire_dtype = base, update, name, wire_dtype
        self.shape, self.step = meta.shape, piece_step(meta.block_size)

    def pieces(self) -> Iterator[np.ndarray]:
        n = math.prod(self.shape)
        for a in range(0, n, self.step):
            b = min(n, a + self.step)
            piece = self.base.piece(self.name, a, b)
            copy = learners_copy(piece, self.update.read(self.name, a, b), self.wire_dtype)
            yield dequantize(copy, owned=True).reshape(-1)


def apply_delta(
    wire: Tensors | FlatParams,
    delta: Payload | Delta,
    wire_dtype: str,
    collect: Collect | None = None,
) -> FlatParams:
    """The learners' copy of a version from their copy of its base and the compact update
    (``learners_copy``), in float32: each tensor handed to ``collect`` as it is made, a
    piece at a time (``UpdatedTensor``: a learner's spill file writes it without holding
    it), in the order the update's tensors lie; without ``collect``, whole arrays. An
    update whose tensors are not the base's (names or shapes) is a ``ValueError``."""
    base, update = as_tensors(wire), payload_view(delta)
    index = update.index()
    shapes = {n: tuple(s) for n, s in base.shapes.items()}
    if shapes != {n: tuple(m.shape) for n, m in index.items()}:
        theirs = {n: tuple(m.shape) for n, m in index.items()}
        raise ValueError(f"the update's tensors {theirs} are not the held version's {shapes}")
    items = ((n, UpdatedTensor(base, update, n, m, wire_dtype)) for n, m in index.items())
    if collect is None:
        return {n: np.asarray(t) for n, t in items}
    return collect(items)


def downlink_update(
    params: FlatParams, base: FlatParams | None, wire_dtype: str, downlink: str, block_size: int
) -> tuple[FlatParams, Delta | None]:
    """What learners get of a new version: the full copy (in float32), and (``downlink``
    int4 or int8, with the previous version's copy ``base`` at hand) the quantized
    difference that turns ``base`` into it: ``downlink_piece`` on each tensor."""
    if downlink == "full" or base is None or base.keys() != params.keys():
        return wire_view(params, wire_dtype), None
    out = {n: downlink_piece(v, base[n], wire_dtype, downlink, block_size)
           for n, v in params.items()}  # fmt: skip
    return {n: dequantize(w) for n, (w, _) in out.items()}, {n: d for n, (_, d) in out.items()}


def delta_bytes(delta: Payload | Delta) -> int:
    """The bytes of a compact update as stored (its values are not read)."""
    index = payload_view(delta).index().values()
    return sum(payload_bytes(m.size, m.kind, m.block_size) for m in index)


class MemoryStore:
    """A run's state in this process. Keeps the versions a syncer or learner can still
    ask for (the staleness window and a little more), not the whole history."""

    def __init__(
        self, init: Sequence[FlatParams], wire_dtype: str, window: int, downlink: str = "full",
        block_size: int = 128,
    ):  # fmt: skip
        self.wire_dtype, self.downlink, self.block_size = wire_dtype, downlink, block_size
        self.keep = window + 2
        self.sent: dict[tuple[str, int], list[Contribution]] = defaultdict(list)
        self.last_sent: dict[str, tuple[int, int]] = {}
        self.checkpoints: dict[str, LearnerCheckpoint] = {}
        # fragment -> version -> (master params, optimizer leaves or None, record, wire view,
        # the delta from the version before or None)
        self.versions: dict[int, dict[int, tuple]] = {
            p: {0: (dict(params), None, records.initial_version(p, 0.0),
                    wire_view(params, wire_dtype), None)}
            for p, params in enumerate(init)
        }  # fmt: skip

    def put_contribution(self, c: Contribution) -> None:
        self.sent[(c.learner, c.fragment)].append(c)
        seq, _ = self.last_sent.get(c.learner, (0, 0))
        if c.seq > seq:
            self.last_sent[c.learner] = (c.seq, c.step)

    def contributions(self, learner: str, fragment: int, after: int) -> list[Contribution]:
        return [c for c in self.sent[(learner, fragment)] if c.seq > after]

    def read(self, c: Contribution) -> Contribution:
        return c  # held whole

    def add_learner(self, learner: str) -> None:
        pass  # any learner's contributions are held

    def settle(self, learner: str, fragment: int, cursor: int) -> None:
        """Forget contributions a committed version has processed (memory stays flat)."""
        key = (learner, fragment)
        self.sent[key] = [c for c in self.sent[key] if c.seq > cursor]

    def sent_so_far(self, learner: str) -> tuple[int, int]:
        return self.last_sent.get(learner, (0, 0))

    def save_checkpoint(self, learner: str, ckpt: LearnerCheckpoint) -> None:
        self.checkpoints[learner] = ckpt

    def load_checkpoint(self, learner: str, step: int | None = None) -> LearnerCheckpoint | None:
        held = self.checkpoints.get(learner)
        return held if step is None or (held is not None and held.step == step) else None

    def publish(self, gv: GlobalVersion, opt_leaves: list[Any], record: Record) -> bool:
        held = self.versions[gv.fragment]
        if gv.version in held:
            return False
        base = held.get(gv.version - 1)
        wire, delta = downlink_update(
            gv.params, base[3] if base else None, self.wire_dtype, self.downlink, self.block_size
        )
        held[gv.version] = (gv.params, opt_leaves, record, wire, delta)
        for v in [v for v in held if v < gv.version - self.keep]:
            del held[v]
        for learner, cursor in gv.cursor.items():
            self.settle(learner, gv.fragment, cursor)
        return True

    def newest_version(self, learner: str | None, fragment: int) -> int | None:
        return max(self.versions[fragment])

    def read_global(
        self, learner: str, fragment: int, version: int, collect: Collect | None = None
    ) -> GlobalView:
        _, _, record, wire, _ = self.versions[fragment][version]
        if collect is not None:
            wire = collect(iter(wire.items()))
        return GlobalView(fragment, version, wire, record)

    def read_delta(self, learner: str, fragment: int, version: int) -> GlobalDelta | None:
        held = self.versions[fragment].get(version)
        if held is None or held[4] is None:
            return None
        return GlobalDelta(version, version - 1, held[4], held[2])

    def load_fragment(self, fragment: int, window: int) -> StoredFragment:
        held = self.versions[fragment]
        newest = max(held)
        params, opt, record = held[newest][:3]
        history = {v: held[v][0] for v in held if newest - window <= v < newest}
        return StoredFragment(newest, params, opt, record, history)

    def ledger(self, plan: UnitPlan) -> UnitLedger:
        return MemoryLedger(plan)

    def close(self, summary: dict[str, Any]) -> None:
        pass


class StoreLearnerView:
    """One learner's transport over a store, with no delay. A version already read is
    not read again.

    A newer version is reached from the one held through the versions' compact updates
    (``topology.downlink``) while that moves fewer bytes than the full copy; otherwise,
    or when an update is missing or unreadable, the full copy is read.

    ``keep(fragment, version)``, where given, makes the ``Collect`` each version read is
    gathered into (the pipeline's learner: a local file, ``storage_layout.spill``, read
    back a tensor at a time as it applies the version; by default a dict in memory)."""

    def __init__(
        self, store: Store, learner: str, keep: Callable[[int, int], Collect] | None = None
    ):
        self.store = store
        self.learner = learner
        self.keep = keep
        self.cache: dict[int, GlobalView] = {}

    def send(self, c: Contribution) -> None:
        self.store.put_contribution(c)

    def want(self, fragment: int, above: int) -> None:
        pass

    def backed_up(self) -> bool:
        return False  # each send is written before ``send`` returns

    def latest_global(self, fragment: int) -> GlobalView | None:
        newest = self.store.newest_version(self.learner, fragment)
        return None if newest is None else self.read(fragment, newest)

    def read(self, fragment: int, version: int) -> GlobalView:
        held = self.cache.get(fragment)
        if held is None or held.version != version:
            newer = self._through_deltas(held, version) if held is not None else None
            if newer is None:
                collect = None if self.keep is None else self.keep(fragment, version)
                newer = self.store.read_global(self.learner, fragment, version, collect)
            held = self.cache[fragment] = newer
        return held

    def _through_deltas(self, held: GlobalView, version: int) -> GlobalView | None:
        """``version`` rebuilt from ``held`` by the updates in between, or None when that
        is not possible (an update missing, unreadable or from another base) or would
        move as many bytes as the full copy."""
        store = self.store
        if getattr(store, "downlink", "full") == "full":
            return None
        full = full_bytes(held.params, store.wire_dtype)
        each = sum(payload_bytes(n, store.downlink, store.block_size)
                   for n in sizes(held.params).values())  # fmt: skip
        if (version - held.version) * each >= full:
            return None
        moved, view = 0, held
        for v in range(held.version + 1, version + 1):
            collect = None if self.keep is None else self.keep(held.fragment, v)
            try:
                d = store.read_delta(self.learner, held.fragment, v)
                if d is None or d.base != view.version:
                    return None
                params = apply_delta(view.params, d.delta, store.wire_dtype, collect)
            except (ValueError, LookupError, FileNotFoundError) as exc:  # corrupt or gone
                log.warning("fragment %d version %d: reading it whole, as its update "
                            "cannot be applied: %s", held.fragment, v, exc)  # fmt: skip
                return None
            moved += delta_bytes(d.delta)
            view = GlobalView(held.fragment, v, params, d.meta, moved)
        return view

    def save_checkpoint(self, ckpt: LearnerCheckpoint) -> None:
        self.store.save_checkpoint(self.learner, ckpt)

    def load_checkpoint(self) -> LearnerCheckpoint | None:
        return self.store.load_checkpoint(self.learner)

    def sent_so_far(self) -> tuple[int, int]:
        return self.store.sent_so_far(self.learner)
