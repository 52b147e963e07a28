"""Versions written and read chunk by chunk, so a process holds a bounded number of
chunks whatever a fragment's size.

Writing: ``codec.GroupWriter`` hands each full chunk object to ``ObjectSink.put``, which
uploads it in the background (at most ``in_flight`` uploads, and their bytes, pending)
and records its size and sha256; ``ObjectSink.finish`` gives the marker's entries for
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

import contextlib
import dataclasses
import hashlib
import itertools
import logging
import math
import os
import re
import shutil
import tempfile
import threading
import weakref
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
    discard_data,
    entry,
    fetch_objects,
    patiently,
    put_patiently,
)
from storage_layout.layout import check_key

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


class ObjectSink:
    """Uploads a version's data objects under ``data_prefix`` in the background while
    its producer makes the next ones: at most ``in_flight`` uploads outstanding (``put``
    waits for a free one), each written ``patiently`` (``commit.put_patiently``). A
    failed upload is never lost: the next ``put``, or ``finish``, raises it. For one
    producer thread; a context manager that aborts (deletes the prefix) on an exception.
    """

    def __init__(self, bucket: Bucket, data_prefix: str, in_flight: int = 4):
        if in_flight < 1:
            raise ValueError(f"in_flight must be at least 1, got {in_flight}")
        self.bucket, self.data_prefix = bucket, data_prefix
        self._pool = ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="object-sink")
        self._slots = threading.Semaphore(in_flight)
        self._lock = threading.Lock()
        self._entries: dict[str, dict[str, Any]] = {}
        self._pending: set[Future] = set()
        self._seen: set[str] = set()
        self._failure: BaseException | None = None
        self._done = False

    def __enter__(self) -> ObjectSink:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            try:
                self.abort()
            except Exception:  # the exception under way is the one to report
                log.exception("could not discard %s after a failed write", self.data_prefix)
        elif not self._done:
            self.finish()

    def put(self, rel: str, data: bytes | bytearray) -> None:
        """Upload ``data`` as ``{data_prefix}/{rel}`` in the background. ``bytes``, or a
        ``bytearray`` that is the sink's from now on (its producer writes to it no more:
        ``codec.GroupWriter``'s chunks); any other buffer is copied."""
        self._raise_failure()
        if self._done:
            raise RuntimeError(f"{self.data_prefix}: put of {rel!r} after finish or abort")
        key = check_key(f"{self.data_prefix}/{rel}", "object key")
        if rel in self._seen:
            raise ValueError(f"{key} is put twice")
        self._seen.add(rel)
        if not isinstance(data, bytes | bytearray):
            data = bytes(data)  # the producer may reuse its buffer
        self._slots.acquire()
        try:
            self._raise_failure()
            future = self._pool.submit(self._upload, rel, key, data)
        except BaseException:
            self._slots.release()
            raise
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._settled)

    def _upload(self, rel: str, key: str, data: bytes) -> None:
        try:
            record = entry(data)
            put_patiently(self.bucket, {key: data}, f"writing {key}")
        except BaseException as exc:
            with self._lock:
                if self._failure is None:
                    self._failure = exc
            log.warning("upload of %s failed: %r", key, exc)
            return
        with self._lock:
            self._entries[rel] = record

    def _settled(self, future: Future) -> None:
        with self._lock:
            self._pending.discard(future)
        self._slots.release()

    def _raise_failure(self) -> None:
        with self._lock:
            failure = self._failure
        if failure is not None:
            raise failure

    def _drain(self) -> None:
        with self._lock:
            pending = list(self._pending)
        wait(pending)
        self._pool.shutdown(wait=True)
        self._done = True

    def finish(self) -> dict[str, dict[str, Any]]:
        """Wait for every upload; the marker entries ``{rel: entry(object)}`` sorted by
        ``rel``, or the first upload's failure (raised once all have ended)."""
        self._drain()
        self._raise_failure()
        with self._lock:
            return {rel: self._entries[rel] for rel in sorted(self._entries)}

    def abort(self) -> None:
        """Wait for the uploads under way, then delete everything under the data prefix."""
        self._drain()
        discard_data(self.bucket, self.data_prefix)


class ChunkSpool:
    """Checked chunk objects kept on the local disk for one more read: a syncer scans each
    contribution when it is listed and reads it again to merge; the scan's reader puts
    the chunks it fetched and checked here (``fill``), the merge's reader takes them
    (``reuse``), so each is fetched from the bucket and hashed once. A chunk is keyed by
    its bucket, key and the sha256 its marker records, and dropped once taken. Bounded by
    ``limit`` bytes: when full, the oldest chunks go first (those of contributions that
    were never merged, superseded ones, age out). Its files live in a temporary folder
    of this process (``process_folder``), deleted by ``close`` or when the spool is
    garbage collected. Thread-safe."""

    def __init__(self, limit: int, directory: str | None = None):
        if limit < 1:
            raise ValueError(f"a chunk spool holds at least one byte, not {limit}")
        self.limit = limit
        self.folder = process_folder("chunk-spool", directory)
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self.size = 0  # bytes held
        self.taken = 0  # chunks a read took from here instead of the bucket
        self._lock = threading.Lock()
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.folder, True)

    def _path(self, key: str) -> str:
        return os.path.join(self.folder, hashlib.sha256(key.encode()).hexdigest())

    def put(self, key: str, data: bytes) -> None:
        """Keep ``data`` (already checked) under ``key``, the oldest going if need be;
        not kept if larger than the whole spool."""
        if len(data) > self.limit:
            return
        with self._lock:
            if key in self._sizes:
                return
            while self._sizes and self.size + len(data) > self.limit:
                old, n = self._sizes.popitem(last=False)
                self.size -= n
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self._path(old))
            with open(self._path(key), "wb") as f:
                f.write(data)
            self._sizes[key] = len(data)
            self.size += len(data)

    def take(self, key: str) -> bytes | None:
        """The chunk kept under ``key``, no longer kept; None if it is not here (or its
        file is not whole: read it from the bucket)."""
        with self._lock:
            n = self._sizes.pop(key, None)
            if n is None:
                return None
            self.size -= n
            path = self._path(key)
            try:
                with open(path, "rb") as f:
                    data = f.read()
                os.remove(path)
            except OSError:
                return None
            if len(data) != n:
                return None
            self.taken += 1
            return data

    def close(self) -> None:
        with self._lock:
            self._sizes.clear()
            self.size = 0
        self._cleanup()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def process_folder(kind: str, directory: str | None = None) -> str:
    """A new local folder for this process's ``kind`` of files (``KIND-PID-random`` in
    ``directory``, the temporary directory by default). A process killed outright never
    deletes its own, so this first deletes the ``kind`` folders of processes no longer
    alive (a folder whose owner cannot be told is kept)."""
    directory = directory or tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            m = re.fullmatch(rf"{re.escape(kind)}-(\d+)-\w+", entry.name)
            if m and entry.is_dir(follow_symlinks=False) and not _alive(int(m.group(1))):
                shutil.rmtree(entry.path, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{kind}-{os.getpid()}-", dir=directory)


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
