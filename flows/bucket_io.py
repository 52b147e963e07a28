"""The one adapter between training types and the storage layer.

``storage_layout`` stores named tensors and JSON meta under its commit protocol and
knows nothing of training. This module turns contributions, learner checkpoints
(the inner optimizer state) and global versions (parameters, outer optimizer state,
the version record) into that form and back, and implements the core's ``Store``
(``diloco.transport``) over a run's buckets: the simulator's ``--store`` runs and
the pipeline's learner and syncer processes use this same class.

What it adds to the storage layer is the training-side reading of failures: an
unreadable contribution becomes ``Unreadable`` (the syncer rejects it and goes on), a
corrupt checkpoint falls back to the one before, a corrupt version inside the staleness
window is left out of the syncer's history. It also holds the process's keys
(``storage_layout.auth``): a learner signs its contributions, and a syncer holding the run
secret turns one its learner did not sign into ``Unreadable`` as well.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import lru_cache, partial
from typing import Any

import jax
import numpy as np
import optax

from diloco.config import OuterConfig
from diloco.inner import to_host
from diloco.learner import LearnerCheckpoint
from diloco.loops import GlobalView, StoredFragment, Unreadable
from diloco.outer import Contribution, outer_optimizer
from diloco.records import Record
from diloco.syncer import GlobalVersion
from diloco.tensors import Tensors, materialize, pieces
from diloco.transport import Collect, GlobalDelta, downlink_update
from diloco.units import RegionalLedger, UnitPlan
from diloco.validate import Scan, scan_payload
from flows.ledger import UnitOffers, region_ledger, region_pools
from flows.version_stream import (
    ReaderPayload,
    ReaderTensors,
    StreamedVersion,
    reads_ahead,
    slot_names,
    uploads_in_flight,
)
from protocol.topology import learner_region, run_deal, run_slots
from storage_layout.auth import Keys, Unauthenticated
from storage_layout.bucket import Traffic
from storage_layout.commit import CommitConflict, CorruptVersion, Revoked, patiently, read_marker
from storage_layout.members import SeqNotReserved
from storage_layout.retention import prune_checkpoints
from storage_layout.store import RunStore, poll
from storage_layout.stream import ChunkSpool, VersionReader
from storage_layout.versions import PublishReport

log = logging.getLogger(__name__)

READ_ATTEMPTS = 3  # reads of a contribution before it is rejected as corrupt
# Seqs a learner process reserves at a time (``RunStore.members.reserve_seqs``): one small write
# per this many sends; a restart skips at most this many numbers.
SEQ_BLOCK = 8
LISTING_PATIENCE = 30.0  # seconds a syncer lists its fragment's versions before it gives up
REVOKED_BLOCKS = 4  # the newest blocks of seqs ``revoke_unsent`` holds
# Contribution fields kept in the marker's meta (the tensors are the payload).
_COUNTERS = ("base_version", "anchor_seq", "step", "tokens", "steps", "seconds")


def contribution_meta(c: Contribution) -> dict[str, Any]:
    # "data": the learner's data positions (its batches, one per inner step) whose steps
    # this send carries, [from, to): the audit shows them and checks none merged twice.
    return {**{k: getattr(c, k) for k in _COUNTERS}, "data": [c.step - c.steps, c.step]}


def contribution_from(
    learner: str,
    fragment: int,
    seq: int,
    tensors: Mapping[str, Any] | None,
    meta: Mapping[str, Any],
) -> Contribution:
    """A contribution from its marker's meta; ``tensors`` None: a header (no payload)."""
    return Contribution(
        learner=learner, fragment=fragment, seq=seq, base_version=int(meta["base_version"]),
        tokens=int(meta["tokens"]), steps=int(meta["steps"]), seconds=float(meta["seconds"]),
        payload=None if tensors is None else dict(tensors), step=int(meta.get("step", 0)),
        anchor_seq=int(meta.get("anchor_seq", 0)),
    )  # fmt: skip


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_POSITIONAL = re.compile(r"^\d{4,}$")  # how leaves were named before they had names


def leaf_names(tree: Any) -> list[str]:
    """Each leaf's path in ``tree``, in leaf order, as a storable name: the keys joined by
    ``/`` (``1/0/mu/blocks.0.up.kernel``: element 1 of the chain, its element 0, field
    ``mu``, dict key ``blocks.0.up.kernel``), any other character than ``[A-Za-z0-9._-]``
    in a key replaced by ``_``."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    names = [
        "/".join(
            _UNSAFE.sub("_", str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))))
            for k in path
        )
        for path, _ in flat
    ]
    if len(set(names)) != len(names):
        raise ValueError(f"two leaves of an optimizer state share a stored name: {names}")
    return names


class _OneHeld:
    """``read(key)``, keeping only the value last read: asked for again, it is not read
    again; asked for another, the one held goes before the next is read (a tensor read
    a piece at a time comes to the host once, and never two at a time)."""

    def __init__(self, read: Callable[[Any], np.ndarray]):
        self.read = read
        self.held: tuple[Any, np.ndarray] | None = None

    def __call__(self, key: Any) -> np.ndarray:
        if self.held is None or self.held[0] != key:
            self.held = None
            self.held = (key, self.read(key))
        return self.held[1]

    def clear(self) -> None:
        self.held = None


class OptimizerLeaves(Mapping[str, np.ndarray]):
    """An optimizer state's leaves as float32 host arrays named by their path in the tree
    (``leaf_names``), so a checkpoint reads without our code; also ``Tensors``, which
    ``RunStore.checkpoints.put_checkpoint`` streams. A leaf comes to the host (``inner.to_host``) only
    when it is read and one at a time, never the whole state: its sharded device arrays
    stay where they are. Each read transfers again; ``piece`` keeps the last leaf."""

    def __init__(self, state: optax.OptState):
        self._leaves = dict(zip(leaf_names(state), jax.tree_util.tree_leaves(state), strict=True))
        self._flat = _OneHeld(lambda name: self[name].reshape(-1))

    def __getitem__(self, name: str) -> np.ndarray:
        return np.asarray(to_host(self._leaves[name], held=True), dtype=np.float32)

    def __contains__(self, name: object) -> bool:  # (Mapping's own reads the value)
        return name in self._leaves

    def __iter__(self):
        return iter(self._leaves)

    def __len__(self) -> int:
        return len(self._leaves)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(np.shape(v)) for n, v in self._leaves.items()}

    def piece(self, name: str, start: int, stop: int) -> np.ndarray:
        return self._flat(name)[start:stop]


def optimizer_leaves(state: optax.OptState) -> OptimizerLeaves:
    """``OptimizerLeaves`` of ``state``: what a checkpoint stores."""
    return OptimizerLeaves(state)


def _positional(names: Sequence[str]) -> bool:
    return bool(names) and all(_POSITIONAL.match(n) for n in names)


@lru_cache(maxsize=64)
def _outer_names(cfg: OuterConfig, shapes: tuple[tuple[str, tuple[int, ...]], ...]) -> list[str]:
    """The stored names of the state's arrays, those of a parameter (its name a key of
    their path): a step count is not stored (the version's ``outer_steps`` holds it)."""
    structs = {n: jax.ShapeDtypeStruct(s, np.float32) for n, s in shapes}
    state = jax.eval_shape(outer_optimizer(cfg).init, structs)
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    return [name for name, path in zip(leaf_names(state), paths, strict=True)
            if any(getattr(k, "key", None) in structs for k in path)]  # fmt: skip


def outer_leaf_names(cfg: OuterConfig, params: Mapping[str, Any]) -> list[str]:
    """The names of a fragment's outer optimizer leaves (``0/trace/blocks.0.up.kernel``),
    in the order ``FragmentSyncer.opt_leaves`` lists them."""
    return list(
        _outer_names(cfg, tuple(sorted((n, tuple(np.shape(v))) for n, v in params.items())))
    )


def outer_names(cfg: OuterConfig, shapes: Mapping[str, Sequence[int]]) -> list[str]:
    """``outer_leaf_names`` from the parameters' shapes alone."""
    return list(_outer_names(cfg, tuple(sorted((n, tuple(int(x) for x in s))
                                               for n, s in shapes.items()))))  # fmt: skip


def named_outer_leaves(
    cfg: OuterConfig, params: Mapping[str, Any], leaves: Sequence[np.ndarray]
) -> dict[str, np.ndarray]:
    """``FragmentSyncer.opt_leaves`` (a list) -> the same leaves by name, as stored."""
    names = outer_leaf_names(cfg, params)
    if len(names) != len(leaves):
        raise ValueError(f"{len(leaves)} outer optimizer leaves, this optimizer has {len(names)}")
    return dict(zip(names, leaves, strict=True))


def ordered_outer_leaves(
    cfg: OuterConfig, params: Mapping[str, Any], names: Sequence[str], leaves: Sequence
) -> list[np.ndarray]:
    """Inverse of ``named_outer_leaves``: a stored version's leaves in the order
    ``FragmentSyncer`` restores them. Versions written before leaves had names (``0000``,
    ``0001``...) are in that order already."""
    if not names or _positional(names):
        return list(leaves)
    stored = dict(zip(names, leaves, strict=True))
    wanted = outer_leaf_names(cfg, params)
    missing = [n for n in wanted if n not in stored]
    if missing or len(stored) != len(wanted):
        raise CorruptVersion(
            f"outer optimizer state has leaves {sorted(stored)[:3]}..., this optimizer "
            f"{len(wanted)} (missing {missing[:3]})"
        )
    return [stored[n] for n in wanted]


def optimizer_state(
    leaves: Mapping[str, np.ndarray], template: optax.OptState, place: Callable[[dict], dict]
) -> optax.OptState:
    """Inverse of ``optimizer_leaves`` into the structure of ``template`` (a freshly
    initialized state: the optimizer's code defines the layout)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    names = leaf_names(template)
    if _positional(list(leaves)) and len(leaves) == len(names):  # written before names
        leaves = {n: leaves[k] for n, k in zip(names, sorted(leaves), strict=True)}
    missing = [n for n in names if n not in leaves]
    if missing or len(leaves) != len(names):
        raise CorruptVersion(
            f"optimizer state has {len(leaves)} leaves, this model's optimizer "
            f"{len(names)} (missing {missing[:3]})"
        )
    placed = []
    for n, (_, t) in zip(names, flat, strict=True):
        # a leaf at a time: ``place`` shards it over this learner's mesh, whatever mesh
        # wrote it (a checkpoint stores the logical arrays, whole or in boxes)
        leaf = _as_leaf(leaves[n], tuple(t.shape), t.dtype)
        placed.append(place({n: leaf})[n])
        if isinstance(leaf, _LeafBoxes):
            leaf.release()
    return jax.tree_util.tree_unflatten(treedef, placed)


def _as_leaf(value: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    if isinstance(value, _LeafBoxes):
        return value.checked(shape, dtype)
    return np.asarray(value, dtype=dtype).reshape(shape)


class _LeafBoxes:
    """One optimizer-state leaf of a checkpoint: the boxes of it that its parts hold (one
    per host of the learner that wrote it; a checkpoint written whole is one box, the
    leaf), read only where they are asked for (``inner.Boxes``): placed on this learner's
    mesh, each device's slice reads the rows of the boxes it overlaps, so no host gathers
    a leaf its devices do not hold."""

    def __init__(self, name: str, key: str):
        self.name, self.key = name, key
        # (box or None: the whole leaf, the tensors holding it, its name there)
        self.boxes: list[tuple[tuple[tuple[int, int], ...] | None, Tensors, str]] = []
        self.shape: tuple[int, ...] = ()
        self.dtype: Any = np.float32
        # the rows of a box last read are kept (a process's devices that replicate a
        # slice ask for the same rows in turn); read again when asked for other rows
        self._rows = _OneHeld(lambda at: at[0].piece(at[1], at[2], at[3]))

    def checked(self, shape: tuple[int, ...], dtype: Any) -> _LeafBoxes:
        """These boxes as a leaf of ``shape``: each inside it, of its stored size, and
        together covering it exactly once (``CorruptVersion`` naming the leaf if not)."""
        whole = tuple((0, n) for n in shape)
        self.boxes = [(whole if box is None else box, t, n) for box, t, n in self.boxes]
        total = 0
        for box, tensors, tname in self.boxes:
            extent = tuple(b - a for a, b in box)
            if len(box) != len(shape) or any(not 0 <= a < b <= n for (a, b), n in
                                              zip(box, shape, strict=False)):  # fmt: skip
                raise CorruptVersion(f"{self.key}: a box {box} of {self.name} is outside {shape}")
            if int(np.prod(tensors.shapes[tname])) != int(np.prod(extent)):
                raise CorruptVersion(f"{self.key}: box {box} of {self.name} holds "
                                     f"{tensors.shapes[tname]} values")  # fmt: skip
            total += int(np.prod(extent))
        overlap = any(_overlap(a[0], b[0]) for i, a in enumerate(self.boxes)
                      for b in self.boxes[i + 1:])  # fmt: skip
        if overlap or total != int(np.prod(shape)):
            raise CorruptVersion(f"{self.key}: the parts' boxes of {self.name} do not tile "
                                 f"its shape {shape} ({len(self.boxes)} boxes)")  # fmt: skip
        self.shape, self.dtype = shape, dtype
        return self

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        want = [sl.indices(n)[:2] for sl, n in zip(index, self.shape, strict=True)]
        out = None
        for box, tensors, tname in self.boxes:
            cut = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(want, box, strict=True)]
            if any(a >= b for a, b in cut):
                continue
            values, src = self._read(box, tensors, tname, cut)
            if cut == want:  # one box holds the slice (a leaf whole, or the writer's mesh)
                return np.asarray(values[src]).astype(self.dtype, copy=False)
            if out is None:
                out = np.empty([b - a for a, b in want], dtype=self.dtype)
            out[tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(cut, want, strict=True))] = (
                values[src]
            )
        return np.empty([b - a for a, b in want], self.dtype) if out is None else out

    def _read(
        self, box: tuple[tuple[int, int], ...], tensors: Tensors, tname: str, cut: list
    ) -> tuple[np.ndarray, tuple[slice, ...]]:
        """The rows of ``box`` that ``cut`` spans (all of them for a scalar), shaped as the
        box's, and where ``cut`` lies in them: a slice split along the leaf's rows reads
        its own rows, one split along another axis the rows it crosses."""
        extent = [b - a for a, b in box]
        if not extent:
            return self._rows((tensors, tname, 0, 1)).reshape(()), ()
        first, last = cut[0][0] - box[0][0], cut[0][1] - box[0][0]
        row = math.prod(extent[1:])
        values = self._rows((tensors, tname, first * row, last * row))
        rest = [slice(a - c, b - c) for (a, b), (c, _) in zip(cut[1:], box[1:], strict=True)]
        src = (slice(0, last - first), *rest)
        return values.reshape([last - first, *extent[1:]]), src

    def release(self) -> None:
        """Drop the rows kept: the leaf is placed."""
        self._rows.clear()


def _overlap(a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]) -> bool:
    return all(max(x0, y0) < min(x1, y1) for (x0, x1), (y0, y1) in zip(a, b, strict=True))


def _stored_parts(reader: VersionReader, parts: Any, key: str) -> dict[str, _LeafBoxes]:
    """A parted checkpoint's leaves (``RunStore.checkpoints.commit_checkpoint_parts``: its meta maps
    each part's group to ``{tensor: {"leaf", "index"}}``), as boxes to read."""
    leaves: dict[str, _LeafBoxes] = {}
    if not isinstance(parts, Mapping):
        raise CorruptVersion(f"{key}: its parts are not a mapping of groups")
    try:
        for gname, boxes in parts.items():
            tensors = ReaderTensors(reader, str(gname))
            for tname, box in boxes.items():
                if tname not in tensors.shapes:
                    raise CorruptVersion(f"{key}: part {gname} lacks tensor {tname!r}")
                name = str(box["leaf"])
                index = tuple((int(a), int(b)) for a, b in box["index"])
                leaves.setdefault(name, _LeafBoxes(name, key)).boxes.append((index, tensors, tname))
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise CorruptVersion(f"{key}: its parts' boxes are malformed: {exc!r}") from exc
    return leaves


class HostPart:
    """This host's part of a learner's optimizer state, for a checkpoint written in parts
    (a learner over several processes whose state is sharded over them): of each leaf,
    the shards this process holds that no other writes (``replica_id`` 0), as
    ``Tensors`` named ``{leaf}#{k}`` (a shard comes to the host when it is read, one at a
    time), and each one's box in its leaf. ``write_id`` is the checkpoint's write, the
    same in every process; ``index`` and ``count`` this process's place among them."""

    def __init__(self, state: optax.OptState, write_id: str, index: int, count: int):
        self.write_id, self.index, self.count = write_id, index, count
        self._shards: dict[str, jax.Array] = {}
        self.slices: dict[str, dict[str, Any]] = {}
        for name, leaf in zip(leaf_names(state), jax.tree_util.tree_leaves(state), strict=True):
            own = [s for s in leaf.addressable_shards if s.replica_id == 0]
            for k, shard in enumerate(own):
                tname = f"{name}#{k}"
                self._shards[tname] = shard.data
                box = [sl.indices(n)[:2] for sl, n in zip(shard.index, leaf.shape, strict=True)]
                self.slices[tname] = {"leaf": name, "index": [list(b) for b in box]}
        self._flat = _OneHeld(
            lambda name: np.asarray(to_host(self._shards[name], held=True), np.float32).ravel()
        )

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(v.shape) for n, v in self._shards.items()}

    def piece(self, name: str, start: int, stop: int) -> np.ndarray:
        return self._flat(name)[start:stop]


def _whole_leaves(tensors: Tensors, key: str) -> dict[str, _LeafBoxes]:
    """A checkpoint written whole (its ``opt`` group: a tensor a leaf), each leaf as one
    box, read where it is placed as a parted checkpoint's are."""
    leaves = {name: _LeafBoxes(name, key) for name in tensors.shapes}
    for name, leaf in leaves.items():
        leaf.boxes.append((None, tensors, name))
    return leaves


def read_checkpoint(
    store: RunStore,
    learner: str,
    step: int,
    template: optax.OptState,
    place: Callable[[dict], dict],
) -> tuple[optax.OptState, dict[str, Any]]:
    """Checkpoint ``learner@step`` into the structure of ``template``, with its meta: the
    stored leaves are the logical arrays, so any mesh reads them; each is read, checked
    and placed (``place``: onto this learner's shardings) before the next, each device's
    slice read on its own (``_LeafBoxes``), so the host holds a slice of one leaf at a
    time, never the whole state, nor a whole leaf its devices split."""
    key = store.layout.checkpoint_marker(learner, step)
    marker = read_marker(store.home, key)
    reader = VersionReader(store.home, marker, key, cache=1)
    if "parts" in marker.meta:  # written in parts, one per host (``HostPart``)
        leaves: Mapping[str, Any] = _stored_parts(reader, marker.meta["parts"], key)
    else:
        leaves = _whole_leaves(ReaderTensors(reader, "opt"), key)
    return optimizer_state(leaves, template, place), dict(marker.meta)


class _Guarded:
    """``Tensors`` that call ``on_damage`` before a read failure propagates."""

    def __init__(self, tensors: Tensors, on_damage: Callable[[], None]):
        self.tensors, self.on_damage = tensors, on_damage

    @property
    def shapes(self) -> Mapping[str, tuple[int, ...]]:
        return self.tensors.shapes

    def piece(self, name: str, start: int, stop: int) -> np.ndarray:
        try:
            return self.tensors.piece(name, start, stop)
        except (CorruptVersion, KeyError, ValueError, OSError):
            self.on_damage()
            raise


class BucketStore:
    """A run's ``Store`` in its regions' buckets (see the module docstring).

    ``learners`` maps learner id -> region; a learner's writes go to its own region
    through a store whose writer is the learner. ``home`` is the region this process
    reads globals from and the syncers publish to first. ``place`` (the trainer's) and
    ``opt_template`` (a freshly initialized inner optimizer state) rebuild checkpoints;
    they are needed only where checkpoints are read. ``keys`` default to the environment's
    (``Keys.from_env``; a learner's own key when ``writer`` is a learner).
    """

    def __init__(
        self,
        run: str,
        regions: Mapping[str, str],
        home: str,
        learners: Mapping[str, str],
        wire_dtype: str,
        writer: str,
        place: Callable[[dict], dict] | None = None,
        opt_template: Callable[[], optax.OptState] | None = None,
        traffic: Traffic | None = None,
        keys: Keys | None = None,
        downlink: str = "full",
        block_size: int = 128,
        syncer_memory_mb: int = 512,
        syncer_spool_mb: int = 2048,
    ):
        self.run, self.regions, self.home = run, dict(regions), home
        self.syncer_memory_mb = syncer_memory_mb
        # chunks per array the syncer's readers fetch ahead of its merge
        self.ahead = reads_ahead(syncer_memory_mb, len(self.regions), len(learners))
        # contributions' chunks checked by the scan, kept on disk for the merge (made on
        # the first scan: learners never need one); 0 MB: none, the merge fetches again
        self.syncer_spool_mb = syncer_spool_mb
        self._spool: ChunkSpool | None = None
        self.downlink, self.block_size = downlink, block_size
        # fragment -> (version, learners' copy) this process published last: the base of
        # the next version's compact update (read back from home when it is not this one)
        self._published: dict[int, tuple[int, dict[str, np.ndarray]]] = {}
        # (fragment, version) -> the version a merge is streaming out, until published
        self._streams: dict[tuple[int, int], StreamedVersion] = {}
        # (fragment, version) whose learners' copy could not be read as a compact
        # update's base: the next version goes out whole
        self._bad_bases: set[tuple[int, int]] = set()
        # (learner, fragment) -> seq -> the marker of a listed contribution not read yet
        self._heads: dict[tuple[str, int], dict[int, Any]] = {}
        # learner -> (claim, first, end) of the block of seqs this process holds
        self._seqs: dict[str, tuple[int | None, int, int]] = {}
        # learner -> the generation this process claimed as it (``claim_generation``)
        self._generations: dict[str, int] = {}
        # (learner, fragment, seq) held by a revoked marker: no contribution there, ever
        self._revoked: set[tuple[str, int, int]] = set()
        self.learners = dict(learners)
        if keys is None:
            keys = Keys.from_env(run, writer if writer in self.learners else None)
        self.keys = keys
        self.wire_dtype = wire_dtype
        self.place, self.opt_template = place, opt_template
        self.traffic = traffic if traffic is not None else Traffic()
        self.checkpoint_traffic = Traffic()  # not synchronization traffic
        self.main = RunStore(run, regions, home, writer=writer, traffic=self.traffic,
                             claims_key=keys.claims_key)  # fmt: skip
        self._writers: dict[str, RunStore] = {}
        self._checkpoints: dict[str, RunStore] = {}
        self.last_report: PublishReport | None = None

    def writer_for(self, learner: str, checkpoints: bool = False) -> RunStore:
        """The store ``learner`` writes through: its own region, itself as the writer."""
        cache = self._checkpoints if checkpoints else self._writers
        if learner not in cache:
            region = self.region_of(learner)
            traffic = self.checkpoint_traffic if checkpoints else self.traffic
            cache[learner] = RunStore(
                self.run,
                {region: self.regions[region]},
                region,
                writer=learner,
                traffic=traffic,
                claims_key=self.keys.claims_key,
            )
        return cache[learner]

    def region_store(self, region: str) -> RunStore:
        """A store of ``region``'s bucket alone, this process its writer."""
        return RunStore(self.run, {region: self.regions[region]}, region, writer=self.main.writer,
                        traffic=self.traffic, claims_key=self.keys.claims_key)  # fmt: skip

    def region_of(self, learner: str) -> str:
        if learner not in self.learners:
            raise ValueError(f"{learner!r} is not a learner of run {self.run!r}")
        return self.learners[learner]

    # learner side ---------------------------------------------------------------------
    def put_contribution(self, c: Contribution) -> None:
        """Commit ``c`` in its learner's region, signed with the learner's key if this
        process holds it (a syncer holding the run secret rejects unsigned ones). Its seq
        must lie in a block this process reserved (``SeqNotReserved`` if another process of
        the learner holds the numbers above it)."""
        self._reserved(c.learner, c.seq)
        self.check_newest(c.learner)  # before the upload, and again just before the marker:
        key = self.keys.signing_key(c.learner)  # a process fenced meanwhile commits nothing
        self.writer_for(c.learner).contributions.put_contribution(
            c.learner, c.fragment, c.seq, c.payload, contribution_meta(c), key=key,
            check=lambda: self.check_newest(c.learner),
        )  # fmt: skip

    def claim_generation(self, learner: str) -> int:
        """Claim the next generation of ``learner`` for this process (``RunStore.
        claim_generation``); every later commit checks that it is still the newest."""
        self._generations[learner] = self.writer_for(learner).members.claim_generation(learner)
        return self._generations[learner]

    def check_newest(self, learner: str) -> None:
        """``SeqNotReserved`` if another process has started as ``learner`` since this one
        claimed its generation, or has reserved seqs above this one's block: the next
        claim's key is read, not listed (a read by key is never stale), just before each
        commit, so a process that is no longer the newest commits nothing, not even a
        seq inside a block it reserved before the newer one started."""
        store = self.writer_for(learner)
        bucket, layout = store.home, store.layout
        nexts = []
        if learner in self._generations:
            nexts.append(("generation", layout.lease_commits(learner),
                          self._generations[learner]))  # fmt: skip
        claim = self._seqs.get(learner, (None, 0, 0))[0]
        if claim is not None:
            nexts.append(("block of seqs", layout.seq_claims(learner), claim))
        for what, prefix, held in nexts:
            key = store.numbered_claim(prefix, held + 1)
            if patiently(lambda: bucket.exists(key), key):  # noqa: B023
                raise SeqNotReserved(
                    f"{learner}: another process runs as this learner now (it holds "
                    f"{what} {held + 1}, this one {held}); this one commits nothing more"
                )

    def _reserved(self, learner: str, seq: int) -> None:
        """Make sure this process holds ``seq`` of ``learner`` (``RunStore.members.reserve_seqs``)."""
        claim, first, end = self._seqs.get(learner, (None, 0, 0))
        if first <= seq < end:
            return
        if seq >= end:
            claim, first, end = self.writer_for(learner).members.reserve_seqs(
                learner, seq, SEQ_BLOCK, after=claim
            )
            self._seqs[learner] = (claim, first, end)
        if first != seq:
            raise SeqNotReserved(
                f"{learner}: seq {seq} is not this process's to commit: another process of "
                f"{learner} has reserved the numbers from {first} on since (it runs as this "
                "learner now); this one must stop"
            )

    def sent_so_far(self, learner: str) -> tuple[int, int]:
        """(newest seq, its step) among ``learner``'s committed contributions, for a process
        that starts as ``learner``: it also reserves the first block of seqs this process
        commits, so the seq returned is the one below that block, never below a seq an
        earlier process may have committed (``RunStore.members.reserve_seqs``), even when the
        listings leave the newest contributions out. The step is that of the newest
        contribution of its own (signed with its key, when it has one: a forged marker
        with a far-future seq must not carry it there), listed or found by key among the
        numbers the earlier processes reserved, so work already sent is not trained
        again."""
        store, region = self.writer_for(learner), self.region_of(learner)
        seq, step = 0, 0  # of the newest own contribution listed
        for p in range(self._fragments()):
            for listed in reversed(store.contributions.contribution_seqs(learner, p, region)):
                if listed <= seq:
                    break
                meta = self._own(learner, p, listed)
                if meta is not None:
                    seq, step = listed, int(meta.get("step", 0))
                    break
        self._seqs[learner] = store.members.reserve_seqs(learner, seq + 1, SEQ_BLOCK)
        first = self._seqs[learner][1]
        # What a stale listing left out: the predecessor's newest is in its last blocks.
        bucket = store.bucket(region)
        for unlisted in range(first - 1, max(seq, first - 1 - 2 * SEQ_BLOCK), -1):
            for p in range(self._fragments()):
                key = store.layout.contribution_marker(learner, p, unlisted)
                if patiently(lambda: bucket.exists(key), key):  # noqa: B023
                    meta = self._own(learner, p, unlisted)
                    if meta is not None:
                        return first - 1, int(meta.get("step", 0))
        return first - 1, step

    def revoke_unsent(self, learner: str, why: str) -> int:
        """Hold the keys of ``learner``'s reserved seqs that hold no contribution, in every
        fragment (its newest ``REVOKED_BLOCKS`` blocks: a process commits only inside the
        blocks it holds, and each syncer that gives the learner's data back reserves one
        more, ``sent_so_far``), so that a commit still under way in a fenced process
        lands nowhere (``RunStore.contributions.revoke_contribution``): what is committed once this
        returns is all that ever will be. Returns how many keys it held."""
        region = self.region_of(learner)
        store = self.region_store(region)
        fragments = range(self._fragments())
        sent = {
            s for p in fragments for s in store.contributions.contribution_seqs(learner, p, region)
        }
        held = 0
        for first, end in store.members.seq_blocks(learner, newest=REVOKED_BLOCKS):
            for seq in range(first, end):
                if seq not in sent:
                    held += sum(
                        store.contributions.revoke_contribution(learner, p, seq, why)
                        for p in fragments
                    )
        return held

    def _own(self, learner: str, fragment: int, seq: int) -> dict[str, Any] | None:
        """The meta of ``learner``'s contribution ``seq`` if its marker reads and is signed
        with the learner's key (when this process holds it); None (and a warning) if not."""
        store, region = self.writer_for(learner), self.region_of(learner)
        key = self.keys.signing_key(learner)
        try:
            marker = patiently(
                lambda: store.contributions.contribution_head(learner, fragment, seq, region, key),
                f"{learner} fragment {fragment} seq {seq}",
                READ_ATTEMPTS,
            )
        except Revoked:
            return None  # held by a syncer: never sent
        except (Unauthenticated, CorruptVersion, FileNotFoundError, KeyError, ValueError) as exc:
            log.warning("%s: not counting contribution %d of fragment %d as its own: %s",
                        learner, seq, fragment, exc)  # fmt: skip
            return None
        return dict(marker.meta)

    def _fragments(self) -> int:
        if not hasattr(self, "_fragment_count"):
            self._fragment_count = len(self.main.read_spec()["fragments"])
        return self._fragment_count

    def _outer(self) -> OuterConfig:
        """The run's outer optimizer config (its state's structure names the stored leaves)."""
        if not hasattr(self, "_outer_cfg"):
            self._outer_cfg = OuterConfig.model_validate(self.main.read_spec()["config"]["outer"])
        return self._outer_cfg

    def _named_opt(
        self, fragment: int, params: Mapping[str, Any], leaves: list[Any]
    ) -> dict[str, np.ndarray] | list[Any]:
        """The outer optimizer leaves by their path in the state tree, as a version stores
        them; by position (as before names) if the run's spec cannot be read just now."""
        try:
            return named_outer_leaves(self._outer(), params, leaves)
        except (CorruptVersion, OSError, KeyError, ValueError) as exc:
            log.warning("fragment %d: outer optimizer leaves stored by position: %s", fragment, exc)
            return leaves

    def save_checkpoint(self, learner: str, ckpt: LearnerCheckpoint) -> None:
        """Commit ``ckpt``; one whose state is a ``HostPart`` (a learner over several
        processes) writes this host's part, and the leader (part 0) commits once every
        part is written (``RunStore.checkpoints.commit_checkpoint_parts``)."""
        store = self.writer_for(learner, checkpoints=True)
        if ckpt.step in store.checkpoints.checkpoint_steps(learner):
            return  # this step is saved already (a flow run ended right after one)
        meta = {"seq": ckpt.seq, "data_position": ckpt.step}
        part = ckpt.opt_state if isinstance(ckpt.opt_state, HostPart) else None
        if part is not None:
            store.checkpoints.put_checkpoint_part(learner, ckpt.step, part.write_id, part.index, part,
                                      part.slices)  # fmt: skip
            if part.index != 0:
                return
        self.check_newest(learner)  # a superseded process mixes no checkpoint in
        try:
            if part is not None:
                store.checkpoints.commit_checkpoint_parts(
                    learner, ckpt.step, part.write_id, part.count, meta
                )
            else:
                store.checkpoints.put_checkpoint(
                    learner, ckpt.step, {"opt": optimizer_leaves(ckpt.opt_state)}, meta
                )
        except CommitConflict as exc:
            log.warning(
                "checkpoint %s@%d already written by another process: %s", learner, ckpt.step, exc
            )
        prune_checkpoints(store, learner, keep=2)

    def load_checkpoint(self, learner: str, step: int | None = None) -> LearnerCheckpoint | None:
        """The newest readable checkpoint (a corrupt one is reported and skipped), or the
        one at ``step`` (its damage raised: another process of the learner read it)."""
        if self.place is None or self.opt_template is None:
            raise ValueError(
                "this store was opened without the trainer; it cannot read checkpoints"
            )
        store = self.writer_for(learner, checkpoints=True)

        def read(step: int) -> LearnerCheckpoint:
            opt, meta = read_checkpoint(store, learner, step, self.opt_template(), self.place)
            return LearnerCheckpoint(step=int(meta["step"]), seq=int(meta["seq"]), opt_state=opt)

        if step is not None:
            return read(step)
        for step in reversed(store.checkpoints.checkpoint_steps(learner)):
            try:
                return read(step)
            except (CorruptVersion, KeyError, ValueError) as exc:
                log.error(
                    "checkpoint %s@%d is unreadable, trying an older one: %s", learner, step, exc
                )
        return None

    def newest_version(self, learner: str | None, fragment: int) -> int | None:
        region = self.home if learner is None else self.region_of(learner)
        store = self.main if learner is None else self.writer_for(learner)
        return store.versions.latest_global(fragment, region)

    def read_global(
        self, learner: str, fragment: int, version: int, collect: Collect | None = None
    ) -> GlobalView:
        state = self.writer_for(learner).versions.get_global(
            fragment, version, learner_view=True, collect=collect
        )
        return GlobalView(fragment, version, state.params, state.meta)

    def read_delta(self, learner: str, fragment: int, version: int) -> GlobalDelta | None:
        got = self.writer_for(learner).versions.get_global_delta(fragment, version)
        if got is None:
            return None
        base, reader, meta = got
        return GlobalDelta(version, base, ReaderPayload(reader, "delta"), meta)

    # syncer side ----------------------------------------------------------------------
    def contributions(
        self, learner: str, fragment: int, after: int
    ) -> list[Contribution | Unreadable]:
        """New committed contributions in seq order, as headers: each marker is read and
        checked, the data is not (``read`` fetches it; a newer contribution from the same
        anchor makes an older one's data unneeded). One whose marker cannot be read yet
        (an ``OSError``) ends the list, to be read on the next look. With the run secret,
        one not signed with its learner's key is ``Unreadable``, named as such."""
        region = self.region_of(learner)
        key = self.keys.verifying_key(learner)
        heads = self._heads.setdefault((learner, fragment), {})
        for seq in [s for s in heads if s <= after]:
            del heads[seq]  # settled: listed, read or passed over
        out: list[Contribution | Unreadable] = []
        for seq in self.main.contributions.contribution_seqs(learner, fragment, region):
            if seq <= after or (learner, fragment, seq) in self._revoked:
                continue
            try:
                head = partial(self.main.contributions.contribution_head, learner, fragment)
                marker = heads.get(seq) or patiently(
                    partial(head, seq, region, key), f"{learner} fragment {fragment} seq {seq}",
                    READ_ATTEMPTS,
                )  # fmt: skip
                heads[seq] = marker
                out.append(contribution_from(learner, fragment, seq, None, marker.meta))
            except Revoked:  # no contribution there, ever (``SilentReleases``)
                self._revoked.add((learner, fragment, seq))
            except Unauthenticated as exc:
                out.append(Unreadable(learner, fragment, seq, f"not authentic: {exc}", True))
            except (CorruptVersion, KeyError, ValueError, TypeError) as exc:
                out.append(Unreadable(learner, fragment, seq, f"unreadable: {exc}"))
            except OSError as exc:
                log.warning(
                    "cannot read %s fragment %d seq %d yet: %s", learner, fragment, seq, exc
                )
                break
        return out

    def read(self, c: Contribution) -> Contribution | Unreadable:
        """``c`` (a header from ``contributions``) with its payload, read a piece at a time
        (``ReaderPayload``), or ``Unreadable`` when its data does not match its marker
        after ``READ_ATTEMPTS`` reads (a read can come back damaged while the object is
        whole; a rejection is for good). Every chunk is read and checked here, and its
        values scanned (``validate.scan_payload``: dtypes, NaN, the norm), in bounded
        memory; the merge reads them again. An ``OSError`` means: not readable yet."""
        if c.payload is not None:
            return c
        learner, fragment, seq = c.learner, c.fragment, c.seq
        marker = self._heads[(learner, fragment)][seq]
        bucket = self.main.bucket(self.region_of(learner))
        where = self.main.layout.contribution_marker(learner, fragment, seq)

        spool = self._contribution_spool()

        def scan() -> Scan:
            reader = VersionReader(bucket, marker, where, cache=1, ahead=self.ahead, fill=spool)
            return scan_payload(ReaderPayload(reader), self.block_size)

        try:
            found = patiently(scan, f"{learner} fragment {fragment} seq {seq}", READ_ATTEMPTS)
        except (CorruptVersion, KeyError, ValueError) as exc:
            return Unreadable(learner, fragment, seq, f"unreadable: {exc}")
        # A fresh reader for the merge: it holds no chunk until then, and takes those
        # the scan kept in the spool instead of fetching them again.
        reader = VersionReader(bucket, marker, where, cache=1, ahead=self.ahead, reuse=spool)
        return replace(c, payload=ReaderPayload(reader), scan=found)

    def _contribution_spool(self) -> ChunkSpool | None:
        if self._spool is None and self.syncer_spool_mb > 0:
            self._spool = ChunkSpool(self.syncer_spool_mb * 2**20)
        return self._spool

    def _reader(self, bucket: Any, marker: Any, key: str) -> VersionReader:
        """A reader for the syncer's merge: one chunk kept per array, ``self.ahead``
        fetched and checked ahead in the background (bounded by ``syncer_memory_mb``)."""
        return VersionReader(bucket, marker, key, cache=1, ahead=self.ahead)

    def version_sink(
        self, fragment: int, version: int, shapes: Mapping[str, Sequence[int]], slots: int
    ) -> StreamedVersion:
        """Where the syncer merges version ``version`` of ``fragment``: straight into the
        buckets (``StreamedVersion``); ``publish`` commits it."""
        names = outer_names(self._outer(), shapes)
        base = None
        if (
            self.downlink != "full"
            and version > 0
            and (fragment, version - 1) not in self._bad_bases
        ):
            base = self._wire_of(fragment, version - 1)
        sink = StreamedVersion(
            self.main, fragment, version, shapes, slot_names(names, shapes, slots),
            self.wire_dtype, self.downlink, self.block_size, base,
            in_flight=uploads_in_flight(self.syncer_memory_mb, len(self.regions),
                                        len(self.learners)),
        )  # fmt: skip
        self._streams[(fragment, version)] = sink
        return sink

    def _wire_of(self, fragment: int, version: int) -> Tensors | None:
        """The learners' copy of ``version`` at home, read a piece at a time (the base of
        the next compact update), or None (that version goes out whole) when it cannot
        be opened; a damaged chunk found while merging marks it (``_bad_bases``), and the
        merge, tried again, sends the version whole."""
        key = self.main.layout.global_marker(fragment, version)
        try:
            reader = self._reader(self.main.home, read_marker(self.main.home, key), key)
            return _Guarded(ReaderTensors(reader, "wire"),
                            lambda: self._bad_bases.add((fragment, version)))  # fmt: skip
        except (CorruptVersion, KeyError, ValueError, OSError) as exc:
            log.warning("fragment %d: the learners' copy of version %d is unreadable (%s); "
                        "version %d goes out whole", fragment, version, exc, version + 1)  # fmt: skip
            return None

    def publish(self, gv: GlobalVersion, opt_leaves: list[Any], record: Record) -> bool:
        streamed = self._streams.pop((gv.fragment, gv.version), None)
        for key in [k for k in self._streams if k[0] == gv.fragment and k[1] < gv.version]:
            del self._streams[key]  # merges that failed before a publish
        if streamed is not None:
            try:
                self.last_report = streamed.commit(record)
            except CommitConflict:
                return False
            return True
        base = self._learners_copy(gv.fragment, gv.version - 1)
        params = materialize(gv.params)
        wire, delta = downlink_update(params, base, self.wire_dtype, self.downlink,
                                      self.block_size)  # fmt: skip
        self._published.pop(gv.fragment, None)
        opt = self._named_opt(gv.fragment, params, opt_leaves)
        try:
            self.last_report = self.main.versions.publish_global(
                gv.fragment, gv.version, params, opt, record, self.wire_dtype,
                wire=wire, delta=delta, delta_base=gv.version - 1,
            )  # fmt: skip
        except CommitConflict:
            return False
        self._published[gv.fragment] = (gv.version, wire)
        return True

    def _learners_copy(self, fragment: int, version: int) -> dict[str, np.ndarray] | None:
        """The learners' copy of ``version`` (the base of the next compact update), or None
        (no update: the next version goes out whole) when the downlink is ``full`` or the
        version cannot be read."""
        if self.downlink == "full" or version < 0:
            return None
        held = self._published.get(fragment)
        if held is not None and held[0] == version:
            return held[1]
        try:
            return self.main.versions.get_global(fragment, version, learner_view=True).params
        except (CorruptVersion, OSError) as exc:
            log.warning("fragment %d: the learners' copy of version %d is unreadable (%s); "
                        "version %d goes out whole", fragment, version, exc, version + 1)  # fmt: skip
            return None

    def load_fragment(self, fragment: int, window: int) -> StoredFragment:
        """Fragment ``fragment``'s newest version that reads at home, and the versions
        inside the staleness window, each read a piece at a time when used (nothing of
        them is held here). The newest is read through once, every chunk checked, so a
        damaged one is found now (and declared lost), not half way through a merge."""
        store = self.main
        # Version 0 is written before any syncer starts: none listed is a listing that
        # left the newest out (a stale one), so it is asked again before it is believed.
        versions = poll(lambda: store.versions.global_versions(fragment), timeout=LISTING_PATIENCE)
        if not versions:
            raise FileNotFoundError(f"run {self.run!r} has no version of fragment {fragment} "
                                    f"(listed for {LISTING_PATIENCE:g} s)")  # fmt: skip
        lost = []
        for version in reversed(versions):  # the newest that reads (only home holds it all)
            try:
                params, slots, meta = self._stored(fragment, version, check=True)
                break
            except (CorruptVersion, KeyError, ValueError) as exc:
                log.error("fragment %d version %d is corrupt at home: %s", fragment, version, exc)
                lost.append(version)
        else:
            raise CorruptVersion(f"no version of fragment {fragment} reads at home")
        history = {}
        for v in versions:
            if version - window <= v < version:
                try:
                    history[v] = self._stored(fragment, v)[0]
                except (CorruptVersion, KeyError, ValueError) as exc:
                    # Contributions based on it are rejected ("no longer held"); the rest merge.
                    log.error("fragment %d version %d is corrupt; left out: %s", fragment, v, exc)
        return StoredFragment(version, params, slots, meta, history, lost)

    def _stored(
        self, fragment: int, version: int, check: bool = False
    ) -> tuple[Tensors, list[Tensors], dict[str, Any]]:
        """A version's master copy and outer optimizer state at home, as ``Tensors``
        (``check``: every chunk read once and checked)."""
        home, key = self.main.home, self.main.layout.global_marker(fragment, version)
        marker = read_marker(home, key)
        if "params/zarr.json" not in marker.objects:
            raise CorruptVersion(f"{home.url}/{key} holds the learner view only; the master "
                                 "copy and the optimizer state are in the syncers' home region")  # fmt: skip
        reader = self._reader(home, marker, key)
        params = ReaderTensors(reader, "params")
        stored = sorted(reader.index("opt"))
        # The stored leaf names in the optimizer's order: the rule whole leaves follow
        # (``ordered_outer_leaves``), applied to the names themselves.
        shaped = {n: jax.ShapeDtypeStruct(s, np.float32) for n, s in params.shapes.items()}
        wanted_in_order = ordered_outer_leaves(self._outer(), shaped, stored, stored)
        count = len(wanted_in_order) // max(1, len(params.shapes))
        slots = [ReaderTensors(reader, "opt", names)
                 for names in slot_names(wanted_in_order, params.shapes, count)]  # fmt: skip
        if check:
            for tensors in (params, *slots):
                for name, start, stop in pieces(params.shapes):
                    tensors.piece(name, start, stop)
            reader = self._reader(home, marker, key)  # one holding no chunk
            params = ReaderTensors(reader, "params")
            slots = [ReaderTensors(reader, "opt", s.names) for s in slots]
        return params, slots, dict(marker.meta)

    def ledger(self, plan: UnitPlan) -> RegionalLedger:
        """The data ledger: each region's pool in its own bucket (``flows.ledger``); the
        pool of a region with no member is offered to the others as the syncers do."""
        pools = region_pools(self.main.read_spec())
        offers = UnitOffers(self.run, self.regions, self.learners, plan, self.main.writer,
                            logging.getLogger("diloco.syncer"), pools, self.traffic,
                            self.keys.claims_key)  # fmt: skip
        return RegionalLedger(
            {r: region_ledger(self.region_store(r), plan, self.learners, r,
                              members=lambda: self.learners, pools=pools)
             for r in pools},
            self.learners, offers.tend,
        )  # fmt: skip

    def add_learner(self, learner: str) -> None:
        """Add ``learner`` beyond the run's slots in its region (``learner_region``), as
        ``diloco join`` does: its member record, signed with its key where this process
        holds one, then its contributions are the run's (``RunStore.members.run_learners``)."""
        spec = self.main.read_spec()
        region = learner_region(learner, run_slots(spec), run_deal(spec))
        self.learners[learner] = region
        record = {"learner": learner, "region": region, "host": "simulator", "time": time.time()}
        if not self.writer_for(learner).members.put_member(
            learner, record, self.keys.signing_key(learner)
        ):
            raise FileExistsError(f"{learner} is added to run {self.run!r} already")

    def close(self, summary: dict[str, Any]) -> None:
        """Record the simulation's summary and the traffic of every writer it drove."""
        self.main.progress.write_metrics("simulator", {"summary": summary})
