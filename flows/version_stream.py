"""Global versions and contributions through the buckets a piece at a time: the syncer's
side of ``diloco.tensors`` over ``storage_layout.stream``.

- ``StreamedVersion`` is the ``VersionSink`` a bucket-backed syncer merges into: each
  piece of the new version goes out as it is made. The master copy (``params``) and the
  outer optimizer state (``opt``) go to the home region only; the learners' copy
  (``wire``, and the compact update ``delta`` when the downlink is quantized) to every
  region, each region's chunk objects uploading in the background (``ObjectSink``).
  Nothing is visible until ``commit`` writes the markers: home first (the arbiter), then
  the other regions. A merge that fails half way aborts, and the objects written so far
  are deleted (they are under a fresh write id that no marker names).
- ``ReaderTensors`` and ``ReaderPayload`` read a committed (or just uploaded) version's
  group a piece at a time, every chunk checked against its marker.

So a syncer shard holds a few chunks per input and per output whatever the model's
size: its memory is flat in model size.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from diloco import records
from diloco.config import TopologyConfig
from diloco.tensors import TensorMeta, Tensors, pieces
from diloco.transport import downlink_piece
from protocol.quantize import QuantizedTensor, dequantize
from storage_layout.chunks import ObjectSink
from storage_layout.codec import CHUNK, GroupWriter, root_objects
from storage_layout.commit import (
    CommitConflict,
    CommitMarker,
    commit_marker,
    discard_data,
    new_write_id,
)
from storage_layout.store import RunStore
from storage_layout.stream import VersionReader
from storage_layout.versions import PublishReport

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 * CHUNK  # the largest chunk object: 1 Mi float32 values
MAX_IN_FLIGHT = 16  # chunk uploads outstanding per region, at most
MAX_AHEAD = 2  # chunk objects per array a merge's readers fetch ahead, at most


def _read_arrays(learners: int) -> int:
    """Arrays a merge reads a chunk at a time: each contribution's data and scales, the
    master copy, the momentum and the previous learners' copy."""
    return 2 * learners + 3


def reads_ahead(memory_mb: int, regions: int, learners: int) -> int:
    """Chunks per array a merge's readers fetch ahead (``VersionReader``'s ``ahead``), so
    the fetch, sha256 check and decode of the next chunk of every input go on in the
    background while this one is merged: as many as ``memory_mb`` holds beside what a
    merge holds anyway and one upload per region, up to ``MAX_AHEAD``; 0 when it
    holds none."""
    held = (_read_arrays(learners) + 5 + max(1, regions)) * CHUNK_BYTES
    room = memory_mb * 2**20 - held
    return int(max(0, min(MAX_AHEAD, room // (_read_arrays(learners) * CHUNK_BYTES))))


def uploads_in_flight(memory_mb: int, regions: int, learners: int) -> int:
    """Chunk uploads per region that fit ``memory_mb`` beside what a merge holds: one
    chunk per array read (``_read_arrays``) and those read ahead (``reads_ahead``), and
    about five being built (``params``, ``opt``, ``wire``, ``delta`` and its scales);
    each upload holds its chunk's bytes."""
    ahead = reads_ahead(memory_mb, regions, learners)
    held = ((1 + ahead) * _read_arrays(learners) + 5) * CHUNK_BYTES
    room = memory_mb * 2**20 - held
    return int(max(1, min(MAX_IN_FLIGHT, room // (max(1, regions) * CHUNK_BYTES))))


class ReaderTensors:
    """Group ``gname`` of a version as ``Tensors`` (float32 values, dequantized).
    ``names`` maps a parameter's name to the stored tensor's (the ``opt`` group stores
    leaves by their path in the optimizer's state: ``0/trace/blocks.0.up.kernel``)."""

    def __init__(self, reader: VersionReader, gname: str, names: Mapping[str, str] | None = None):
        self.reader, self.gname = reader, gname
        index = reader.index(gname)
        self.names = dict(names) if names is not None else {n: n for n in index}
        missing = [s for s in self.names.values() if s not in index]
        if missing:
            raise KeyError(f"{reader.marker_key}: group {gname!r} lacks {missing[:3]}")
        self._shapes = {n: tuple(index[s].shape) for n, s in self.names.items()}

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return self._shapes

    def piece(self, name: str, start: int, stop: int) -> np.ndarray:
        q = self.reader.read(self.gname, self.names[name], start, stop)  # (read here: ours)
        return dequantize(q, owned=True).reshape(-1)


class ReaderPayload:
    """A version's group of quantized tensors (a contribution's, a global version's
    compact update: ``delta``) as a ``diloco.tensors.Payload``."""

    def __init__(self, reader: VersionReader, gname: str = "delta"):
        self.reader, self.gname = reader, gname

    def index(self) -> dict[str, TensorMeta]:
        """Tensor by tensor, in the order they lie in the group (what read ahead fetches
        next)."""
        index = self.reader.index(self.gname)
        return {n: TensorMeta(index[n].kind, tuple(index[n].shape), index[n].block_size)
                for n in self.reader.in_order(self.gname)}  # fmt: skip

    def read(self, name: str, start: int, stop: int) -> QuantizedTensor:
        return self.reader.read(self.gname, name, start, stop)

    @property
    def nbytes(self) -> int:
        return self.reader.marker.size


def slot_names(leaf_names: Sequence[str], shapes: Mapping[str, Any], slots: int) -> list[dict]:
    """Per state slot, parameter name -> its stored leaf name (``leaf_names`` as optax
    lists the leaves: slot by slot, parameters sorted)."""
    names = sorted(shapes)
    if len(leaf_names) != slots * len(names):
        raise ValueError(f"{len(leaf_names)} optimizer leaves for {len(names)} tensors and "
                         f"{slots} state arrays each")  # fmt: skip
    return [{n: leaf_names[k * len(names) + i] for i, n in enumerate(names)} for k in range(slots)]


def publish_initial(
    store: RunStore,
    fragment: int,
    params: Mapping[str, np.ndarray],
    leaf_names: Sequence[str],
    topo: TopologyConfig,
) -> None:
    """Version 0 of ``fragment``: ``params``, and the outer optimizer's state (its stored
    ``leaf_names``, as optax lists them) at zero, as a syncer's ``FragmentSyncer`` starts
    it. Written a piece at a time as a merge writes a version: each chunk encoded, hashed
    and uploaded as it is made, never the whole version's objects at once.
    ``CommitConflict`` if version 0 is there."""
    shapes = {n: tuple(np.shape(v)) for n, v in params.items()}
    names = slot_names(leaf_names, shapes, len(leaf_names) // max(1, len(shapes)))
    sink = StreamedVersion(store, fragment, 0, shapes, names, topo.global_dtype, "full",
                           topo.block_size)  # fmt: skip
    try:
        for name, a, b in pieces(shapes, topo.block_size):
            values = np.asarray(params[name], np.float32).reshape(-1)[a:b]
            sink.write(name, a, values, [np.zeros(b - a, np.float32) for _ in names])
        sink.finish()
    except BaseException:
        sink.abort()
        raise
    sink.commit(records.initial_version(fragment, 0.0))


class _StateOrder:
    """The outer optimizer's state slots into the ``opt`` group, whose tensors go in
    sorted order of their stored names, while a merge makes every slot's piece of one
    parameter at a time. The slot whose names sort first (when each of them sorts before
    every other slot's: SGD's momentum, Adam's ``mu`` before ``nu``) is appended as it
    comes (``direct``); the others' pieces wait in a temporary file on this machine's disk
    and are appended in order at the end (``kept``), a piece at a time: memory stays a
    piece, whatever the model's size."""

    def __init__(self, leaf_names: list[dict[str, str]]):
        self.leaf_names = leaf_names
        first = [names[n] for names in leaf_names[:1] for n in sorted(names)]  # as they come
        rest = [n for names in leaf_names[1:] for n in names.values()]
        ahead = first == sorted(first) and all(first[-1] < n for n in rest)
        self.direct = 0 if first and ahead else None
        self.file: Any = None
        self.pieces: dict[str, list[tuple[int, int]]] = {}  # stored name -> (offset, values)

    def keep(self, slot: int, name: str, values: np.ndarray) -> None:
        if self.file is None:
            self.file = tempfile.TemporaryFile(prefix="diloco-opt-")  # noqa: SIM115 (closed in kept)
        data = np.ascontiguousarray(values, np.float32)
        self.pieces.setdefault(self.leaf_names[slot][name], []).append(
            (self.file.tell(), data.size)
        )
        self.file.write(data.tobytes())

    def kept(self) -> Iterator[tuple[str, np.ndarray]]:
        """The kept pieces in the group's order: by stored name, each tensor's in order."""
        try:
            for leaf in sorted(self.pieces):
                for offset, size in self.pieces[leaf]:
                    self.file.seek(offset)
                    yield leaf, np.frombuffer(self.file.read(4 * size), np.float32)
        finally:
            self.close()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


class StreamedVersion:
    """Version ``version`` of ``fragment`` written to the buckets as it is merged (see
    the module docstring). ``base`` is the learners' copy of the previous version (its
    ``wire`` group) when the downlink sends compact updates; None sends the copy whole."""

    def __init__(
        self,
        store: RunStore,
        fragment: int,
        version: int,
        shapes: Mapping[str, Sequence[int]],
        leaf_names: list[dict[str, str]],
        wire_dtype: str,
        downlink: str = "full",
        block_size: int = 128,
        base: Tensors | None = None,
        write_id: str | None = None,
        in_flight: int = 4,
    ):
        self.store, self.fragment, self.version = store, fragment, version
        self.shapes = {n: tuple(int(x) for x in s) for n, s in shapes.items()}
        self.wire_dtype, self.downlink, self.block_size = wire_dtype, downlink, block_size
        self.base = base if downlink != "full" else None
        self.leaf_names = leaf_names
        self.state = _StateOrder(leaf_names)
        self.write_id = write_id or new_write_id()
        layout = store.layout
        self.marker_key = layout.global_marker(fragment, version)
        self.data_prefix = layout.global_data(fragment, version, self.write_id)
        self.home = store.client_region
        self.sinks: dict[str, ObjectSink] = {}
        self.lagging: dict[str, str] = {}  # region -> why its copy is not written
        for region in store.urls:
            try:
                self.sinks[region] = ObjectSink(store.bucket(region), self.data_prefix, in_flight)
            except OSError as exc:
                if region == self.home:
                    raise
                self._lag(region, exc)
        home = self._to(self.home)
        everywhere = self._to_all
        self.groups = {
            "params": GroupWriter(home, "params", "fp32", self.shapes),
            "opt": GroupWriter(home, "opt", "fp32", {names[n]: s for names in leaf_names
                                                     for n, s in self.shapes.items()}),
            "wire": GroupWriter(everywhere, "wire", wire_dtype, self.shapes, block_size),
        }  # fmt: skip
        if self.base is not None:
            self.groups["delta"] = GroupWriter(everywhere, "delta", downlink, self.shapes,
                                               block_size)  # fmt: skip
        self.entries: dict[str, dict[str, dict]] = {}

    # writing ----------------------------------------------------------------------------
    def _lag(self, region: str, exc: BaseException) -> None:
        self.lagging[region] = f"unreachable: {exc}"
        sink = self.sinks.pop(region, None)
        if sink is not None:
            try:
                sink.abort()
            except Exception as err:  # its data is under a write id no marker will name
                log.warning("could not discard %s in region %s: %s", self.data_prefix, region, err)
        log.warning("region %s is behind on fragment %d: %s", region, self.fragment, exc)

    def _to(self, region: str):
        def put(rel: str, data: bytes) -> None:
            self.sinks[region].put(rel, data)

        return put

    def _to_all(self, rel: str, data: bytes) -> None:
        self._to(self.home)(rel, data)  # home's failure fails the version
        for region in [r for r in self.sinks if r != self.home]:
            try:
                self.sinks[region].put(rel, data)
            except OSError as exc:
                self._lag(region, exc)

    def write(self, name: str, start: int, params: np.ndarray, slots: Sequence[np.ndarray]) -> None:
        n = params.size
        self.groups["params"].append(name, QuantizedTensor("fp32", (n,), params))
        for k, values in enumerate(slots):
            if k == self.state.direct:
                self.groups["opt"].append(self.leaf_names[k][name],
                                          QuantizedTensor("fp32", (n,), values))  # fmt: skip
            else:
                self.state.keep(k, name, values)
        base = None if self.base is None else self.base.piece(name, start, start + n)
        wire, delta = downlink_piece(params, base, self.wire_dtype, self.downlink,
                                     self.block_size)  # fmt: skip
        if self.base is not None:
            self.groups["delta"].append(name, delta)
        self.groups["wire"].append(name, wire)

    def finish(self) -> tuple[Tensors, list[Tensors]]:
        """Close every group, write the root metadata, wait for the uploads; the new
        version's master copy and state, readable from home (not yet committed)."""
        for leaf, values in self.state.kept():
            self.groups["opt"].append(leaf, QuantizedTensor("fp32", values.shape, values))
        for group in self.groups.values():
            group.close()
        attrs = {"kind": "global", "wire_dtype": self.wire_dtype, "fragment": self.fragment,
                 "version": self.version}  # fmt: skip
        if self.base is not None:
            attrs["delta_base"] = self.version - 1
        for rel, data in root_objects(attrs).items():
            self._to_all(rel, data)
        for region in list(self.sinks):
            try:
                self.entries[region] = self.sinks[region].finish()
            except OSError as exc:
                if region == self.home:
                    raise
                self._lag(region, exc)
        marker = CommitMarker("global", self.data_prefix, self.entries[self.home],
                              self.store.writer, self.write_id, {})  # fmt: skip
        reader = VersionReader(self.store.home, marker, self.marker_key, cache=1)
        params = ReaderTensors(reader, "params")
        slots = [ReaderTensors(reader, "opt", names) for names in self.leaf_names]
        return params, slots

    def abort(self) -> None:
        self.state.close()
        for region, sink in list(self.sinks.items()):
            try:
                sink.abort()
            except Exception as exc:
                log.warning("could not discard %s in region %s: %s", self.data_prefix, region, exc)
        self.sinks.clear()

    # committing -------------------------------------------------------------------------
    def commit(self, meta: Mapping[str, Any]) -> PublishReport:
        """The markers: home first (``CommitConflict`` if another syncer holds this
        version there: every copy of ours is deleted), then the other regions, each on
        its own (one that fails is ``lagging``, caught up later by ``sync_regions``)."""
        meta = {"fragment": self.fragment, "version": self.version, **meta}
        if self.base is not None:
            meta["delta_base"] = self.version - 1
        store, report = self.store, PublishReport(self.version, lagging=dict(self.lagging))

        def commit_in(region: str) -> None:
            commit_marker(store.bucket(region), self.marker_key, self.data_prefix,
                          self.entries[region], "global", meta, store.writer, self.write_id)  # fmt: skip
            store.versions.point_latest(region, self.fragment, self.version, self.write_id)

        try:
            commit_in(self.home)
        except CommitConflict:
            for region in self.entries:
                if region != self.home:
                    discard_data(store.bucket(region), self.data_prefix)
            raise
        others = [r for r in self.entries if r != self.home]
        return store.versions.commit_elsewhere(self.fragment, commit_in, others, report)
