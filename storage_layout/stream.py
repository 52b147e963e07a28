"""Versions written and read chunk by chunk, so a process holds a bounded number of
chunks whatever a fragment's size.

Writing: ``codec.GroupWriter`` hands each full chunk object to ``ObjectSink.put``
(``storage_layout.chunks``), which uploads it in the background (at most ``in_flight``
uploads, and their bytes, pending) and records its size and sha256; ``ObjectSink.finish`` gives the marker's entries for
``commit.commit_marker``::

    with ObjectSink(bucket, data_prefix) as sink:
        for rel, blob in root_objects(attrs).items():
            sink.put(rel, blob)
        writer = GroupWriter(sink.put, "params", "fp32", shapes)
        for name, piece in pieces:  # sorted names, each tensor's pieces in order
            writer.append(name, piece)
        writer.close()
        entries = sink.finish()
    commit_marker(bucket, marker_key, data_prefix, entries, kind, meta, writer, write_id)

Reading: ``VersionReader`` fetches a tensor's range chunk object by chunk object, each
checked against the size and sha256 its marker records (a damaged one is
``CorruptVersion`` naming its key), a few at a time, keeping at most ``cache`` chunks per
array. Versions written before (one shard per array, small) are fetched group by group
and decoded whole.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zarr
from zarr.codecs import BytesCodec
from zarr.core.buffer import cpu
from zarr.storage import MemoryStore

from protocol.quantize import STORAGE_DTYPE, QuantizedTensor
from storage_layout.bucket import Bucket, ObjectTooLarge
from storage_layout.chunks import ChunkSpool
from storage_layout.codec import (
    BLOCKED,
    FormatError,
    TensorInfo,
    check_declared,
    check_format,
    decode,
    payload_lengths,
    tensor_entry,
)
from storage_layout.commit import (
    CommitMarker,
    CorruptVersion,
    _checked,
    fetch_objects,
    patiently,
)

log = logging.getLogger(__name__)

PARALLEL = 8  # chunk objects a reader fetches at once (a whole tensor's read)
AHEAD = 0  # chunks per array read ahead (see below); a syncer sets it by its memory setting
_AHEAD_POOL: ThreadPoolExecutor | None = None  # shared by every reader's read-ahead
_AHEAD_LOCK = threading.Lock()


def _ahead_pool() -> ThreadPoolExecutor:
    global _AHEAD_POOL
    with _AHEAD_LOCK:
        if _AHEAD_POOL is None:
            _AHEAD_POOL = ThreadPoolExecutor(max_workers=2 * PARALLEL,
                                             thread_name_prefix="read-ahead")  # fmt: skip
        return _AHEAD_POOL


@dataclass
class _Array:
    """A plain chunked array of a group: its chunk objects and the chunks kept."""

    name: str  # group/array
    dtype: np.dtype
    length: int
    chunk: int
    keys: list[str]  # chunk i's object key, relative to the data prefix
    kept: OrderedDict[int, np.ndarray] = field(default_factory=OrderedDict)
    coming: dict[int, Future] = field(default_factory=dict)  # chunks read ahead
    # (chunk, first value, values from it to the chunk's end): the start of a range that
    # straddled a chunk no longer kept
    tail: tuple[int, int, np.ndarray] = (-1, 0, np.empty(0))


@dataclass(frozen=True)
class _Tensor:
    info: TensorInfo
    data: tuple[int, int]  # [start, stop) in the group's data array
    scales: tuple[int, int]


@dataclass
class _Group:
    kind: str
    tensors: dict[str, _Tensor]
    arrays: dict[str, _Array]
    whole: dict[str, QuantizedTensor] | None = None  # an old sharded group, decoded


class VersionReader:
    """A committed version, read tensor range by tensor range.

    Every object is checked against the size and sha256 the marker records before it is
    used (a mismatch is read again, ``patiently``, then ``CorruptVersion`` naming its
    key); every array's metadata against the sizes of its chunk objects before any is
    fetched (``FormatError``). A range spanning several chunks fetches up to ``parallel``
    at once; each array keeps at most ``cache`` chunks (the most recently used) between
    reads, so consecutive pieces of a tensor fetch each chunk once. After each range,
    the ``ahead`` chunks of the array that follow it are fetched and checked in the
    background (a few threads shared by all readers), so a tensor read in order finds
    its next chunk there while the caller works on this one; a failure of one is raised
    by the read that needs it, and one the reads never reach is dropped. So an array
    holds at most ``cache + ahead`` chunks. With ``fill``, each chunk fetched and checked
    is also kept in that ``ChunkSpool`` (on disk); with ``reuse``, a chunk found there is
    taken instead of fetched (not hashed again: this process checked it before keeping
    it). Not thread-safe: one reader per thread.
    """

    def __init__(
        self,
        bucket: Bucket,
        marker: CommitMarker,
        marker_key: str,
        cache: int = 2,
        parallel: int = PARALLEL,
        ahead: int = AHEAD,
        fill: ChunkSpool | None = None,
        reuse: ChunkSpool | None = None,
    ):
        if cache < 1 or parallel < 1 or ahead < 0:
            raise ValueError(f"cache and parallel must be at least 1 and ahead at least 0, "
                             f"got {cache}, {parallel}, {ahead}")  # fmt: skip
        self.bucket, self.marker, self.marker_key = bucket, marker, marker_key
        self.cache, self.parallel, self.ahead = cache, parallel, ahead
        self.fill, self.reuse = fill, reuse  # where checked chunks go, where they come from
        self.fetched = 0  # chunk objects fetched from the bucket
        self.most_kept = 0  # the most chunks any array has kept at once
        self._groups: dict[str, _Group] = {}
        self._root = self._object("zarr.json", FormatError)
        self.attrs = dict(self._open({"zarr.json": self._root}).attrs)
        check_format(self.attrs)

    # objects --------------------------------------------------------------------------
    def _object(self, rel: str, missing: type[Exception] = CorruptVersion) -> bytes:
        return checked_object(self.bucket, self.marker, self.marker_key, rel, missing)

    def _open(self, docs: Mapping[str, bytes]) -> zarr.Group:
        store = MemoryStore({k: cpu.Buffer.from_bytes(v) for k, v in docs.items()})
        try:
            return zarr.open_group(store=store, mode="r", zarr_format=3)
        except Exception as exc:  # zarr raises several types for unreadable metadata
            raise FormatError(f"{self.marker_key}: not a Zarr v3 group: {exc}") from exc

    # groups and their index ----------------------------------------------------------
    def groups(self) -> list[str]:
        return sorted(
            rel.split("/")[0]
            for rel in self.marker.objects
            if rel.count("/") == 1 and rel.endswith("/zarr.json")
        )

    def index(self, gname: str) -> dict[str, TensorInfo]:
        """What group ``gname`` holds, tensor by tensor (no values are read)."""
        return {name: t.info for name, t in self._group(gname).tensors.items()}

    def _group(self, gname: str) -> _Group:
        if gname not in self._groups:
            try:
                self._groups[gname] = self._load(gname)
            except (FormatError, CorruptVersion):
                raise
            except Exception as exc:
                raise FormatError(f"{self.marker_key}: group {gname!r}: {exc}") from exc
        return self._groups[gname]

    def _load(self, gname: str) -> _Group:
        if f"{gname}/zarr.json" not in self.marker.objects:
            raise FormatError(f"{self.marker_key} has no group {gname!r}")
        docs = {"zarr.json": self._root, f"{gname}/zarr.json": self._object(f"{gname}/zarr.json")}
        sub = self._open(docs)[gname]
        kind = sub.attrs.get("kind")
        if kind not in STORAGE_DTYPE:
            raise FormatError(f"{self.marker_key}: group {gname!r} has unknown kind {kind!r}")
        names = ["data", "scales"] if kind in BLOCKED else ["data"]
        for a in names:
            docs[f"{gname}/{a}/zarr.json"] = self._object(f"{gname}/{a}/zarr.json", FormatError)
        sub = self._open(docs)[gname]
        expected = {"data": STORAGE_DTYPE[kind], "scales": np.float32}
        arrays = {a: sub[a] for a in names}
        if not all(_plain(arr) for arr in arrays.values()):
            return self._load_whole(gname, kind, sub.attrs["tensors"])
        plain = {a: self._plain_array(gname, a, arr, expected[a]) for a, arr in arrays.items()}
        lengths = {a: arr.length for a, arr in plain.items()}
        return _Group(kind, _index(gname, kind, sub.attrs["tensors"], lengths), plain)

    def _plain_array(self, gname: str, name: str, arr: zarr.Array, dtype: Any) -> _Array:
        """Array ``name``'s chunk objects, checked against the marker before any is read:
        the declared values fit in them, chunks are not tiny, and each chunk object the
        grid needs is listed with the size of a whole chunk."""
        prefix = f"{gname}/{name}/"
        if np.dtype(arr.dtype) != np.dtype(dtype):
            raise FormatError(f"{gname}/{name} is {arr.dtype}; {np.dtype(dtype)} was expected")
        stored = sum(o["size"] for rel, o in self.marker.objects.items()
                     if rel.startswith(f"{prefix}c"))  # fmt: skip
        check_declared(gname, name, arr, stored)
        length, chunk = int(arr.shape[0]), int(arr.chunks[0])
        nbytes = chunk * np.dtype(dtype).itemsize
        keys = []
        for i in range(-(-length // chunk)):
            rel = prefix + arr.metadata.encode_chunk_key((i,))
            size = self.marker.objects.get(rel, {}).get("size")
            if size != nbytes:
                held = "is not listed" if size is None else f"holds {size} bytes"
                raise FormatError(
                    f"{self.marker_key}: chunk object {rel} {held}; a chunk of {chunk} "
                    f"{np.dtype(dtype)} values is {nbytes} bytes"
                )
            keys.append(rel)
        return _Array(f"{gname}/{name}", np.dtype(dtype).newbyteorder("<"), length, chunk, keys)

    def _load_whole(self, gname: str, kind: str, records: Any) -> _Group:
        """A group of the sharded format written before: fetched and decoded whole."""
        objects = fetch_objects(self.bucket, self.marker, self.marker_key, groups=(gname,))
        whole = decode(objects)[0][gname]
        tensors = _index(gname, kind, records, {"data": math.inf, "scales": math.inf})
        return _Group(kind, tensors, {}, whole)

    # values ---------------------------------------------------------------------------
    def read(
        self, gname: str, name: str, start: int = 0, stop: int | None = None
    ) -> QuantizedTensor:
        """Values [start, stop) of tensor ``name`` (flattened in C order) as stored: flat
        payload of shape ``(stop - start,)``, with its scales for int8 / int4. ``start``
        must begin a block (and be even for int4); an int4 range with an odd ``stop``
        inside the tensor pads its last byte as ``quantize`` does."""
        group = self._group(gname)
        if name not in group.tensors:
            raise KeyError(f"{self.marker_key}: group {gname!r} has no tensor {name!r}")
        t = group.tensors[name]
        n, kind, block = t.info.size, group.kind, t.info.block_size
        stop = n if stop is None else stop
        if not 0 <= start <= stop <= n:
            raise ValueError(f"range [{start}, {stop}) of {gname}/{name} is outside [0, {n})")
        if start == stop:  # nothing, wherever it starts
            start = stop = 0
        if kind in BLOCKED and start % block:
            raise ValueError(f"{gname}/{name}: start {start} is not a multiple of block {block}")
        if kind == "int4" and start % 2:
            raise ValueError(f"{gname}/{name}: an int4 range starts at an even value, not {start}")
        da, db = (start // 2, -(-stop // 2)) if kind == "int4" else (start, stop)
        sa, sb = (start // block, -(-stop // block)) if kind in BLOCKED else (0, 0)
        if group.whole is not None:
            q = group.whole[name]
            data = np.array(q.data.reshape(-1)[da:db])
            scales = None if q.scales is None else np.array(q.scales[sa:sb])
        else:
            data = self._values(group.arrays["data"], t.data[0] + da, t.data[0] + db)
            scales = None
            if kind in BLOCKED:
                scales = self._values(group.arrays["scales"], t.scales[0] + sa, t.scales[0] + sb)
        if kind == "int4" and stop % 2 and stop < n:
            data[-1] = (data[-1] & 0x0F) | 0x80  # the next value's nibble: padding (code 0)
        return QuantizedTensor(kind, (stop - start,), data, scales, block)

    def tensors(self, gname: str) -> dict[str, QuantizedTensor]:
        """Every tensor of group ``gname`` whole, with its shape (as ``codec.decode``
        gives them): for groups small enough to hold."""
        got = dict(self.each(gname))
        return {name: got[name] for name in self.index(gname)}

    def in_order(self, gname: str) -> list[str]:
        """Group ``gname``'s tensors in the order they lie in its arrays (what read ahead
        fetches next)."""
        index = self._group(gname).tensors
        return sorted(index, key=lambda n: index[n].data[0])

    def each(self, gname: str) -> Iterator[tuple[str, QuantizedTensor]]:
        """(name, tensor) of every tensor of group ``gname``, whole and shaped, in the
        order they lie in the group's arrays. Each read fetches the ``parallel`` chunks
        after it in the background, so a group of many small tensors keeps ``parallel``
        requests in flight rather than one or two (what a store far away needs), and a
        caller that decodes each tensor as it comes does so while the next ones arrive."""
        index = self._group(gname).tensors
        ahead, self.ahead = self.ahead, max(self.ahead, self.parallel)
        try:
            for name in self.in_order(gname):
                got = self.read(gname, name)
                yield name, dataclasses.replace(got, shape=index[name].info.shape)
        finally:
            self.ahead = ahead

    def _values(self, arr: _Array, start: int, stop: int) -> np.ndarray:
        """Values [start, stop) of a plain array, chunk object by chunk object."""
        out = np.empty(stop - start, arr.dtype.newbyteorder("="))
        if stop <= start:
            return out

        def place(i: int, values: np.ndarray) -> None:
            lo, hi = max(start, i * arr.chunk), min(stop, (i + 1) * arr.chunk)
            out[lo - start : hi - start] = values[lo - i * arr.chunk : hi - i * arr.chunk]

        missing, arrived = [], []
        first = start // arr.chunk
        for i in range(first, (stop - 1) // arr.chunk + 1):
            if i in arr.kept:
                arr.kept.move_to_end(i)
                place(i, arr.kept[i])
            elif arr.tail[0] == i and arr.tail[1] <= max(start, i * arr.chunk) - i * arr.chunk:
                lo, hi = max(start, i * arr.chunk), min(stop, (i + 1) * arr.chunk)
                at = i * arr.chunk + arr.tail[1]
                out[lo - start : hi - start] = arr.tail[2][lo - at : hi - at]
            elif i in arr.coming:
                arrived.append(i)
            else:
                missing.append(i)
        # The range's last chunks are kept (in order, the last most recent): the next
        # piece of a tensor read in order starts in the last one.
        last = (stop - 1) // arr.chunk
        keep = {}
        # (one chunk at a time as it comes: a list of them held every chunk of the range)
        for i, values in itertools.chain(self._arrived(arr, arrived),
                                         self._fetch_chunks(arr, missing)):  # fmt: skip
            place(i, values)
            if i > last - self.cache:
                keep[i] = values
        for i in sorted(keep):
            arr.kept[i] = keep[i]
            while len(arr.kept) > self.cache:
                arr.kept.popitem(last=False)
            self.most_kept = max(self.most_kept, len(arr.kept))
        # A range that begins in a chunk no longer kept keeps its own values from that
        # chunk (at most a range's worth): the merge reads the same range of a version
        # once per contribution, and would fetch that chunk again each time.
        if first not in arr.kept and first < last:
            arr.tail = (first, start - first * arr.chunk,
                        out[: (first + 1) * arr.chunk - start].copy())  # fmt: skip
        self._read_ahead(arr, last)
        return out

    def _arrived(self, arr: _Array, wanted: list[int]) -> Iterator[tuple[int, np.ndarray]]:
        for i in wanted:
            yield i, arr.coming.pop(i).result()

    def _read_ahead(self, arr: _Array, last: int) -> None:
        """Fetch the ``ahead`` chunks after chunk ``last`` in the background; drop those
        read ahead for a range that was not read after all (a jump)."""
        wanted = range(last + 1, min(len(arr.keys), last + 1 + self.ahead))
        for i in [i for i in arr.coming if i not in wanted]:
            arr.coming.pop(i).cancel()
        for i in wanted:
            if i not in arr.kept and i not in arr.coming:
                arr.coming[i] = _ahead_pool().submit(self._chunk, arr, i)

    def _chunk(self, arr: _Array, i: int) -> np.ndarray:
        rel = arr.keys[i]
        expect = self.marker.objects[rel]
        if "inline" in expect:
            return np.frombuffer(self._object(rel), arr.dtype)
        key = f"{self.bucket.url}/{self.marker.data_prefix}/{rel}@{expect['sha256']}"
        data = None if self.reuse is None else self.reuse.take(key)
        if data is None:
            data = self._object(rel)
            self.fetched += 1
            if self.fill is not None:
                self.fill.put(key, data)
        return np.frombuffer(data, arr.dtype)

    def _fetch_chunks(self, arr: _Array, wanted: list[int]) -> Iterator[tuple[int, np.ndarray]]:
        """(i, values) of chunks ``wanted``, as they arrive, at most ``parallel`` at once."""
        if len(wanted) <= 1:
            yield from ((i, self._chunk(arr, i)) for i in wanted)
            return
        todo = iter(wanted)
        with ThreadPoolExecutor(max_workers=min(self.parallel, len(wanted))) as pool:
            pending: dict[Future, int] = {}

            def submit() -> None:
                i = next(todo, None)
                if i is not None:
                    pending[pool.submit(self._chunk, arr, i)] = i

            for _ in range(self.parallel):
                submit()
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    i = pending.pop(future)
                    yield i, future.result()
                    submit()


def checked_object(
    bucket: Bucket,
    marker: CommitMarker,
    marker_key: str,
    rel: str,
    missing: type[Exception] = CorruptVersion,
    use_inline: bool = True,
) -> bytes:
    """Object ``rel`` of a version (its inlined copy unless ``use_inline`` is False),
    checked against the size and sha256 ``marker`` records: read again on a mismatch
    (``patiently``), then ``CorruptVersion`` naming its key. An object the marker does not
    list raises ``missing``."""
    expect = marker.objects.get(rel)
    if expect is None:
        raise missing(f"{marker_key} lists no object {rel}")
    key = f"{marker.data_prefix}/{rel}"
    if use_inline and "inline" in expect:
        return _checked(expect["inline"].encode("utf-8"), expect, key, marker_key)

    def fetch() -> bytes:
        try:
            data = bucket.get(key, limit=expect["size"])
        except FileNotFoundError as exc:
            raise CorruptVersion(
                f"{marker_key}: object {key} listed in the marker is missing"
            ) from exc
        except ObjectTooLarge as exc:
            raise CorruptVersion(f"{marker_key}: object {key}: {exc}") from exc
        return _checked(data, expect, key, marker_key)

    return patiently(fetch, key)


def verify_version(
    bucket: Bucket, marker: CommitMarker, marker_key: str, parallel: int = PARALLEL
) -> int:
    """Read every object ``marker`` lists from the bucket (the inlined ones too) and
    check it, at most ``parallel`` at once: what ``fetch_objects(..., use_inline=False)``
    checks, in bounded memory whatever the version's size. Returns the bytes checked;
    raises the first ``CorruptVersion`` (naming the object's key) or read failure."""

    def check(rel: str) -> int:
        return len(checked_object(bucket, marker, marker_key, rel, use_inline=False))

    checked = 0
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        pending: set[Future] = set()
        for rel in sorted(marker.objects):
            if len(pending) >= parallel:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                checked += sum(f.result() for f in done)
            pending.add(pool.submit(check, rel))
        checked += sum(f.result() for f in wait(pending).done)
    return checked


def _plain(arr: zarr.Array) -> bool:
    """Whether ``arr`` is stored as plain chunks: its values' little-endian bytes, one
    object per chunk (the format ``GroupWriter`` writes), not shards or compressed."""
    codecs = arr.metadata.codecs
    if len(arr.shape) != 1 or len(codecs) != 1 or not isinstance(codecs[0], BytesCodec):
        return False
    endian = codecs[0].endian
    return endian is None or getattr(endian, "value", endian) == "little"


def _index(gname: str, kind: str, records: Any, lengths: Mapping[str, float]) -> dict[str, _Tensor]:
    """A group's ``tensors`` attribute, each record checked: its ranges hold exactly its
    payload and lie inside the group's arrays."""
    out: dict[str, _Tensor] = {}
    for record in records:
        name, shape, block, d0, d1, s0, s1 = tensor_entry(record)
        shape = tuple(int(s) for s in shape)
        where = f"tensor {name!r} of group {gname!r}"
        if any(s < 0 for s in shape) or (
            kind in BLOCKED and (block < 1 or (kind == "int4" and block % 2))
        ):
            raise FormatError(f"{where} has shape {shape} and block size {block}")
        nd, ns = payload_lengths(kind, math.prod(shape), block if kind in BLOCKED else 1)
        if (d1 - d0, s1 - s0 if kind in BLOCKED else 0) != (nd, ns) or min(d0, s0) < 0:
            raise FormatError(f"{where}: data {[d0, d1]} and scales {[s0, s1]} do not hold "
                              f"its {nd} and {ns} values")  # fmt: skip
        if d1 > lengths["data"] or (kind in BLOCKED and s1 > lengths["scales"]):
            raise FormatError(f"{where} runs past its array")
        out[str(name)] = _Tensor(TensorInfo(kind, shape, int(block)), (d0, d1), (s0, s1))
    return out
