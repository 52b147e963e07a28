"""Versions written and read chunk by chunk (``storage_layout.stream``, ``GroupWriter``):
bit-exact round trips, the same objects as ``encode`` and as zarr writes, plain zarr
reads them, damage named by chunk, failed uploads never lost, a bounded number of chunks
held, and versions of the sharded format written before still read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import wait
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import zarr
from zarr.storage import MemoryStore

from protocol.quantize import STORAGE_DTYPE, QuantizedTensor, quantize
from storage_layout.bucket import Bucket
from storage_layout.chunks import ChunkSpool, ObjectSink
from storage_layout.codec import (
    CHUNK,
    ENCODING,
    LOGICAL_DTYPE,
    FormatError,
    GroupWriter,
    TensorInfo,
    decode,
    encode,
    root_objects,
)
from storage_layout.commit import (
    CommitConflict,
    CorruptVersion,
    commit_marker,
    commit_version,
    new_write_id,
    read_marker,
    read_version,
)
from storage_layout.layout import FORMAT_VERSION, data_prefix_of
from storage_layout.stream import VersionReader, verify_version

KEY = "run/globals/f0000/commits/v000000000001.json"
SMALL = 2048  # values per chunk in most tests, so tensors span chunks cheaply
# Odd sizes, one tensor empty, and tensors that span several chunks of SMALL values
SHAPES = {"a.w": (37, 129), "b": (5,), "c.empty": (0,), "d": (3001,), "e.k": (2, 2, 1333)}


def tensors(kind: str, shapes=SHAPES, seed: int = 0) -> dict[str, QuantizedTensor]:
    rng = np.random.default_rng(seed)
    return {n: quantize(rng.normal(size=s).astype(np.float32), kind) for n, s in shapes.items()}


def piece(q: QuantizedTensor, start: int, stop: int) -> QuantizedTensor:
    """Values [start, stop) of ``q`` as a flat piece, cut as a streaming writer cuts it."""
    if start == stop:
        start = stop = 0
    if q.kind == "int4":
        data = q.data[start // 2 : -(-stop // 2)].copy()
        if stop % 2 and stop < q.size:  # the next value's nibble becomes padding
            data[-1] = (data[-1] & 0x0F) | 0x80
    else:
        data = q.data.reshape(-1)[start:stop]
    scales = None
    if q.scales is not None:
        scales = q.scales[start // q.block_size : -(-stop // q.block_size)]
    return QuantizedTensor(q.kind, (stop - start,), data, scales, q.block_size)


def same(a: QuantizedTensor, b: QuantizedTensor) -> None:
    assert (a.kind, tuple(a.shape), a.block_size) == (b.kind, tuple(b.shape), b.block_size)
    assert a.data.dtype == b.data.dtype
    np.testing.assert_array_equal(a.data.reshape(-1), b.data.reshape(-1))
    assert (a.scales is None) == (b.scales is None)
    if a.scales is not None:
        np.testing.assert_array_equal(a.scales, b.scales)


def write_group(put, gname: str, group: dict[str, QuantizedTensor], chunk: int, step: int):
    """``group`` through a ``GroupWriter``, each tensor in pieces of ``step`` values."""
    kind = next(iter(group.values())).kind
    writer = GroupWriter(put, gname, kind, {n: q.shape for n, q in group.items()}, 128, chunk)
    for name in sorted(group):
        q = group[name]
        for start in range(0, q.size, step):
            writer.append(name, piece(q, start, min(q.size, start + step)))
    writer.close()


def commit_streamed(bucket: Bucket, groups, attrs=None, chunk=SMALL, step=640, in_flight=3):
    """A version written as a streaming writer writes it; its marker."""
    write_id = new_write_id()
    prefix = data_prefix_of(KEY, write_id)
    with ObjectSink(bucket, prefix, in_flight) as sink:
        for rel, blob in root_objects(attrs or {"kind": "global"}).items():
            sink.put(rel, blob)
        for gname, group in groups.items():
            write_group(sink.put, gname, group, chunk, step)
        entries = sink.finish()
    return commit_marker(bucket, KEY, prefix, entries, "global", {"v": 1}, "test", write_id)


@pytest.fixture
def local(tmp_path) -> Bucket:
    (tmp_path / "b").mkdir()
    return Bucket(f"file://{tmp_path / 'b'}")


# --- round trips --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8", "int4"])
def test_a_streamed_version_reads_back_bit_exact_whole_and_by_range(local, kind):
    group = tensors(kind)
    marker = commit_streamed(local, {"g": group}, {"kind": "global", "note": "x"})
    assert any(rel.startswith("g/data/c/3") for rel in marker.objects)  # several chunks
    reader = VersionReader(local, read_marker(local, KEY), KEY)
    assert reader.attrs == {"format": FORMAT_VERSION, "kind": "global", "note": "x"}
    assert reader.groups() == ["g"]
    block = 128 if kind in ("int8", "int4") else 0
    assert reader.index("g") == {n: TensorInfo(kind, q.shape, block) for n, q in group.items()}
    assert reader.index("g")["a.w"].size == 37 * 129
    whole = reader.tensors("g")
    assert list(whole) == sorted(group)
    for name, q in group.items():
        same(whole[name], q)
    # ranges that start on a block and stop anywhere, across chunk boundaries
    for name, start, stop in [("a.w", 0, 1), ("a.w", 1280, 4097), ("d", 2944, 3001),
                              ("e.k", 256, 5331), ("e.k", 5248, 5332), ("b", 0, 5),
                              ("c.empty", 0, 0), ("d", 3001, 3001)]:  # fmt: skip
        same(reader.read("g", name, start, stop), piece(group[name], start, stop))
    assert decode(read_version(local, KEY)[1])[0]["g"].keys() == group.keys()


def test_the_real_chunk_size_round_trips(local):
    """``CHUNK`` itself: a tensor one chunk and a few values long, read back across the
    boundary, in two chunks of equal size (the last one padded by less than a value per
    chunk, not by most of a chunk)."""
    group = {"w": quantize(np.arange(CHUNK + 3, dtype=np.float32), "bf16")}
    marker = commit_streamed(local, {"wire": group}, chunk=CHUNK, step=300_000)
    chunks = sorted(rel for rel in marker.objects if rel.startswith("wire/data/c/"))
    assert chunks == ["wire/data/c/0", "wire/data/c/1"]
    assert {marker.objects[rel]["size"] for rel in chunks} == {2 * ((CHUNK + 3 + 1) // 2)}
    reader = VersionReader(local, marker, KEY)
    same(reader.tensors("wire")["w"], group["w"])
    same(reader.read("wire", "w", CHUNK - 5, CHUNK + 2), piece(group["w"], CHUNK - 5, CHUNK + 2))


@pytest.mark.parametrize("kind", ["fp32", "int4"])
def test_the_group_writer_makes_the_objects_encode_and_zarr_make(kind):
    """Pieces through ``GroupWriter``, ``encode`` of the whole tensors, and zarr's own
    writes of the concatenated arrays give the same objects, byte for byte."""
    group = tensors(kind, {"x": (CHUNK // 2 + 7,), "y": (3, CHUNK // 3)})
    streamed: dict[str, bytes] = {}
    write_group(streamed.__setitem__, "g", group, CHUNK, 128 * 1000)
    whole = encode({"g": group}, {"kind": "contribution"})
    assert whole == {**root_objects({"kind": "contribution"}), **streamed}
    assert json.loads(whole["zarr.json"])["attributes"]["format"] == FORMAT_VERSION

    by_zarr: dict[str, Any] = {}
    store = MemoryStore(by_zarr)
    root = zarr.open_group(store=store, mode="w", zarr_format=3)
    sub = root.create_group("g")
    sub.attrs.update(json.loads(whole["g/zarr.json"])["attributes"])
    arrays = {"data": np.concatenate([group[n].data.reshape(-1) for n in sorted(group)])}
    if kind == "int4":
        arrays["scales"] = np.concatenate([group[n].scales for n in sorted(group)])
    for name, values in arrays.items():
        chunk = json.loads(whole[f"g/{name}/zarr.json"])["chunk_grid"]["configuration"]
        arr = sub.create_array(name, shape=values.shape, dtype=values.dtype,
                               chunks=tuple(chunk["chunk_shape"]), compressors=None,
                               fill_value=0, config={"write_empty_chunks": True})  # fmt: skip
        arr[:] = values
    assert {k: v.to_bytes() for k, v in by_zarr.items() if k != "zarr.json"} == streamed
    attrs = json.loads(whole["g/zarr.json"])["attributes"]
    assert (attrs["kind"], attrs["logical_dtype"], attrs["encoding"]) == (
        kind, LOGICAL_DTYPE[kind], ENCODING[kind])  # fmt: skip


def test_plain_zarr_and_fsspec_read_every_array_of_a_streamed_version(local, make_bucket):
    """The recipe of docs/storage-layout.md: ``zarr.open_group`` on the committed data
    prefix, on a local disk and on S3 (moto)."""
    s3 = Bucket(make_bucket("s3"))
    for bucket in (local, s3):
        groups = {"wire": tensors("bf16", seed=1), "delta": tensors("int4", seed=2)}
        marker = commit_streamed(bucket, groups)
        url = f"{bucket.url}/{marker.data_prefix}"
        for g in (
            zarr.open_group(url, mode="r"),
            zarr.open_group(fsspec.get_mapper(url), mode="r"),
        ):
            assert g.attrs["format"] == FORMAT_VERSION
            for gname, group in groups.items():
                sub = g[gname]
                data = sub["data"][:]
                for t in sub.attrs["tensors"]:
                    q = group[t["name"]]
                    np.testing.assert_array_equal(data[slice(*t["data"])], q.data.reshape(-1))
                    if q.scales is not None:
                        np.testing.assert_array_equal(sub["scales"][slice(*t["scales"])], q.scales)
        reader = VersionReader(bucket, read_marker(bucket, KEY), KEY)
        for name, q in groups["delta"].items():
            same(reader.tensors("delta")[name], q)


# --- damage, failures, bounds ---------------------------------------------------------------


def test_a_damaged_chunk_is_named_by_its_key_and_the_others_still_read(local):
    group = {"w": quantize(np.arange(5 * SMALL, dtype=np.float32), "fp32")}
    marker = commit_streamed(local, {"params": group})
    key = f"{marker.data_prefix}/params/data/c/2"
    blob = bytearray(local.get(key))
    blob[100] ^= 1
    local.put(key, bytes(blob))
    reader = VersionReader(local, marker, KEY)
    same(reader.read("params", "w", 0, 2 * SMALL), piece(group["w"], 0, 2 * SMALL))
    same(reader.read("params", "w", 3 * SMALL), piece(group["w"], 3 * SMALL, 5 * SMALL))
    with pytest.raises(CorruptVersion, match=r"params/data/c/2 does not match its sha256"):
        reader.read("params", "w", SMALL, 4 * SMALL)
    local.delete([key])
    with pytest.raises(CorruptVersion, match=r"params/data/c/2 listed in the marker is missing"):
        VersionReader(local, marker, KEY).read("params", "w")


def test_verifying_a_version_reads_every_stored_object_a_few_at_a_time(tmp_path):
    (tmp_path / "b").mkdir()
    bucket = CountingBucket(f"file://{tmp_path / 'b'}")
    marker = commit_streamed(bucket, {"g": tensors("int8"), "h": tensors("bf16")})
    assert verify_version(bucket, marker, KEY, parallel=2) == marker.size
    assert len(bucket.reads) == len(marker.objects) and bucket.most <= 2  # inlined ones too
    for rel in ("h/data/c/1", "g/zarr.json"):  # a chunk; a document the marker inlines
        key = f"{marker.data_prefix}/{rel}"
        good = bucket.get(key)
        bucket.put(key, good[:-1] + bytes([good[-1] ^ 1]))
        with pytest.raises(CorruptVersion, match=f"{rel} does not match its sha256"):
            verify_version(bucket, marker, KEY)
        bucket.put(key, good)


class CountingBucket(Bucket):
    """A real bucket that counts the reads of each key and the most at once."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reads: dict[str, int] = {}
        self.now = self.most = 0
        self.lock = threading.Lock()

    def get(self, key: str, limit: int | None = None) -> bytes:
        with self.lock:
            self.reads[key] = self.reads.get(key, 0) + 1
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            return super().get(key, limit)
        finally:
            with self.lock:
                self.now -= 1


@pytest.mark.parametrize("cache", [1, 2])
def test_the_reader_keeps_at_most_cache_chunks_and_fetches_each_once(tmp_path, cache):
    (tmp_path / "b").mkdir()
    bucket = CountingBucket(f"file://{tmp_path / 'b'}")
    values = np.random.default_rng(5).normal(size=10 * SMALL).astype(np.float32)
    group = {"w": quantize(values, "int8")}
    marker = commit_streamed(bucket, {"delta": group})
    reader = VersionReader(bucket, marker, KEY, cache=cache, parallel=3)
    got = [
        reader.read("delta", "w", a, min(a + 1280, 10 * SMALL)) for a in range(0, 10 * SMALL, 1280)
    ]
    np.testing.assert_array_equal(np.concatenate([q.data for q in got]), group["w"].data)
    np.testing.assert_array_equal(np.concatenate([q.scales for q in got]), group["w"].scales)
    chunk_reads = {k: n for k, n in bucket.reads.items() if "/c/" in k}
    assert set(chunk_reads.values()) == {1} and len(chunk_reads) == reader.fetched
    assert 0 < reader.most_kept <= cache
    assert all(len(a.kept) <= cache for g in reader._groups.values() for a in g.arrays.values())
    bucket.reads.clear()
    bucket.most = 0
    fresh = VersionReader(bucket, marker, KEY, cache=cache, parallel=3)
    same(fresh.read("delta", "w"), group["w"])  # ten data chunks and the scales, whole
    assert bucket.most <= 3 and fresh.most_kept <= cache


def test_a_range_read_again_and_again_fetches_its_chunks_once(tmp_path):
    """The merge reads the same piece of a version once per contribution (the anchored
    outer gradient: current - base + delta) through a reader keeping one chunk: a piece
    that straddles two chunks must not fetch the first again each time."""
    (tmp_path / "b").mkdir()
    bucket = CountingBucket(f"file://{tmp_path / 'b'}")
    values = np.arange(6 * SMALL, dtype=np.float32)
    marker = commit_streamed(bucket, {"params": {"w": quantize(values, "fp32")}})
    reader = VersionReader(bucket, marker, KEY, cache=1, ahead=0)
    step = SMALL // 2 + 256  # pieces that straddle chunk boundaries now and then
    for a in range(0, values.size, step):
        b = min(values.size, a + step)
        for _ in range(9):
            np.testing.assert_array_equal(reader.read("params", "w", a, b).data, values[a:b])
    chunk_reads = {k: n for k, n in bucket.reads.items() if "/c/" in k}
    assert len(chunk_reads) == 6 and set(chunk_reads.values()) == {1}, chunk_reads
    # One chunk kept, and of the one before only the range's part (at most a range).
    arr = reader._groups["params"].arrays["data"]
    assert reader.most_kept == 1 and arr.tail[2].size <= step


def test_a_version_read_twice_through_a_spool_is_fetched_and_hashed_once(tmp_path):
    """A syncer scans a contribution, then merges it: the scan's reader keeps the chunks
    it checked in a ``ChunkSpool`` on disk, the merge's takes them from there; a chunk
    the spool could not keep (full: the oldest went) or lost is fetched again."""
    (tmp_path / "b").mkdir()
    bucket = CountingBucket(f"file://{tmp_path / 'b'}")
    group = {"w": quantize(np.random.default_rng(7).normal(size=6 * SMALL).astype(np.float32),
                           "int8")}  # fmt: skip
    marker = commit_streamed(bucket, {"delta": group})
    spool = ChunkSpool(10**9, str(tmp_path))
    first = VersionReader(bucket, marker, KEY, cache=1, fill=spool)
    same(first.read("delta", "w"), group["w"])
    fetched = dict(bucket.reads)
    assert first.fetched > 0 and spool.size > 0
    again = VersionReader(bucket, marker, KEY, cache=1, reuse=spool)
    same(again.read("delta", "w"), group["w"])
    assert bucket.reads == fetched and again.fetched == 0  # nothing from the bucket
    assert spool.taken == first.fetched and spool.size == 0  # each taken once, then gone
    # A spool too small for the version keeps its newest chunks; the rest are fetched.
    chunk = 4 * SMALL  # an fp32 chunk object's bytes
    small = ChunkSpool(2 * chunk, str(tmp_path))
    values = np.arange(4 * SMALL, dtype=np.float32)
    (tmp_path / "c").mkdir()
    bucket = CountingBucket(f"file://{tmp_path / 'c'}")
    other = commit_streamed(bucket, {"params": {"v": quantize(values, "fp32")}})
    # One fetch at a time: the chunks arrive in order, so the newest kept are 2 and 3
    # (fetched at once, they arrive in any order, and which two stay is chance).
    VersionReader(bucket, other, KEY, cache=1, parallel=1, fill=small).read("params", "v")
    assert small.size == 2 * chunk
    bucket.reads.clear()
    reader = VersionReader(bucket, other, KEY, cache=1, reuse=small)
    np.testing.assert_array_equal(reader.read("params", "v").data, values)
    data = {k.rsplit("/", 1)[-1]: n for k, n in bucket.reads.items() if "/params/data/c/" in k}
    assert data == {"0": 1, "1": 1} and small.taken == 2
    # A kept file that is not whole is not used: the chunk comes from the bucket.
    VersionReader(bucket, other, KEY, cache=1, fill=small).read("params", "v", 3 * SMALL)
    for path in (tmp_path / small.folder).iterdir():
        path.write_bytes(path.read_bytes()[:-4])
    bucket.reads.clear()
    reader = VersionReader(bucket, other, KEY, cache=1, reuse=small)
    np.testing.assert_array_equal(reader.read("params", "v", 3 * SMALL).data, values[3 * SMALL :])
    assert reader.fetched == 1 and small.taken == 2
    folder = small.folder
    small.close()
    assert not (tmp_path / folder).exists()


def test_a_spool_left_by_a_killed_process_is_deleted_by_the_next_one(tmp_path):
    """A syncer killed outright never closes its spool: the next spool made in the same
    folder deletes it, and keeps those of processes still alive."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = tmp_path / f"chunk-spool-{dead.pid}-abc123"
    left.mkdir()
    (left / "chunk").write_bytes(b"x" * 10)
    alive = tmp_path / f"chunk-spool-{os.getppid()}-def456"
    alive.mkdir()
    other = tmp_path / "not-a-spool"
    other.mkdir()
    spool = ChunkSpool(10**6, str(tmp_path))
    assert not left.exists() and alive.exists() and other.exists()
    assert Path(spool.folder).name.startswith(f"chunk-spool-{os.getpid()}-")
    spool.close()


def test_the_next_chunk_is_read_ahead_and_fetched_once(tmp_path):
    (tmp_path / "b").mkdir()
    bucket = CountingBucket(f"file://{tmp_path / 'b'}")
    values = np.arange(4 * SMALL, dtype=np.float32)
    marker = commit_streamed(bucket, {"params": {"w": quantize(values, "fp32")}})
    reader = VersionReader(bucket, marker, KEY, cache=1, ahead=2)
    chunk = lambda i: f"{marker.data_prefix}/params/data/c/{i}"  # noqa: E731
    np.testing.assert_array_equal(reader.read("params", "w", 0, 100).data, values[:100])
    arr = reader._groups["params"].arrays["data"]
    assert sorted(arr.coming) == [1, 2]  # the two chunks after the range, under way
    wait(list(arr.coming.values()))
    assert [bucket.reads.get(chunk(i), 0) for i in range(4)] == [1, 1, 1, 0]
    for a in range(100, values.size, 700):  # the rest in order: nothing fetched twice
        b = min(values.size, a + 700)
        np.testing.assert_array_equal(reader.read("params", "w", a, b).data, values[a:b])
    assert [bucket.reads.get(chunk(i), 0) for i in range(4)] == [1, 1, 1, 1]
    assert not arr.coming  # nothing after the last chunk


def test_a_damaged_chunk_read_ahead_fails_the_read_that_needs_it_only(local):
    group = {"w": quantize(np.arange(4 * SMALL, dtype=np.float32), "fp32")}
    marker = commit_streamed(local, {"params": group})
    key = f"{marker.data_prefix}/params/data/c/1"
    blob = bytearray(local.get(key))
    blob[7] ^= 1
    local.put(key, bytes(blob))
    reader = VersionReader(local, marker, KEY, cache=1, ahead=1)
    same(reader.read("params", "w", 0, 100), piece(group["w"], 0, 100))
    arr = reader._groups["params"].arrays["data"]
    wait(list(arr.coming.values()))  # chunk 1 read ahead, and found damaged
    assert arr.coming[1].exception() is not None
    same(reader.read("params", "w", 3 * SMALL), piece(group["w"], 3 * SMALL, 4 * SMALL))
    with pytest.raises(CorruptVersion, match=r"params/data/c/1 does not match its sha256"):
        reader.read("params", "w", SMALL, SMALL + 10)
    reader = VersionReader(local, marker, KEY, cache=1, ahead=1)
    reader.read("params", "w", 0, 100)
    with pytest.raises(CorruptVersion, match=r"params/data/c/1 does not match its sha256"):
        reader.read("params", "w", SMALL, SMALL + 10)  # the failure read ahead, raised here


class FailingBucket(Bucket):
    """A real bucket whose writes of keys containing ``fail`` are refused."""

    fail = "/c/2"

    def put_many(self, objects):
        for key in objects:
            if self.fail in key:
                raise PermissionError(f"{key}: refused")
        super().put_many(objects)


def test_a_failed_upload_is_raised_and_an_aborted_write_leaves_nothing(tmp_path):
    (tmp_path / "b").mkdir()
    bucket = FailingBucket(f"file://{tmp_path / 'b'}")
    prefix = data_prefix_of(KEY, new_write_id())
    sink = ObjectSink(bucket, prefix, in_flight=2)
    for i in range(3):  # the failing one last: only finish can raise it
        sink.put(f"g/data/c/{i}", b"x")
    with pytest.raises(PermissionError, match=r"g/data/c/2: refused"):
        sink.finish()
    assert bucket.list(f"{prefix}/g/data/c") == ["0", "1"]  # the others were written
    sink.abort()
    assert bucket.list(prefix) == [] and not (tmp_path / "b" / prefix).exists()

    # a writer's chunks: the failure comes out of a later put or out of finish
    group = {"w": quantize(np.arange(6 * SMALL, dtype=np.float32), "fp32")}
    sink = ObjectSink(bucket, prefix, in_flight=2)
    with pytest.raises(PermissionError, match=r"g/data/c/2: refused"):
        write_group(sink.put, "g", group, SMALL, 1000)
        sink.finish()
    sink.abort()
    assert bucket.list(prefix) == []

    # with one upload in flight, the put after the failed one raises it
    sink = ObjectSink(bucket, prefix, in_flight=1)
    for i in range(3):
        sink.put(f"g/data/c/{i}", b"x")
    with pytest.raises(PermissionError, match="refused"):
        sink.put("g/data/c/3", b"x")
    sink.abort()
    assert bucket.list(prefix) == []

    # as a context manager: an exception inside discards what was written
    with pytest.raises(RuntimeError, match="producer failed"), ObjectSink(bucket, prefix) as sink:
        sink.put("g/data/c/0", b"x")
        raise RuntimeError("producer failed")
    assert bucket.list(prefix) == []


def test_a_sink_keeps_at_most_in_flight_uploads_and_records_every_object(tmp_path):
    (tmp_path / "b").mkdir()

    class Gauge(Bucket):
        now = most = 0
        lock = threading.Lock()

        def put_many(self, objects):
            with self.lock:
                Gauge.now += 1
                Gauge.most = max(Gauge.most, Gauge.now)
            try:
                super().put_many(objects)
            finally:
                with self.lock:
                    Gauge.now -= 1

    bucket = Gauge(f"file://{tmp_path / 'b'}")
    prefix = data_prefix_of(KEY, new_write_id())
    blobs = {f"g/data/c/{i}": bytes([i]) * 5000 for i in range(12)}
    with ObjectSink(bucket, prefix, in_flight=3) as sink:
        for rel, blob in blobs.items():
            sink.put(rel, blob)
        entries = sink.finish()
    assert list(entries) == sorted(blobs) and 1 <= Gauge.most <= 3
    for rel, blob in blobs.items():
        assert bucket.get(f"{prefix}/{rel}") == blob and entries[rel]["size"] == 5000
    other = data_prefix_of(KEY, new_write_id())
    with ObjectSink(bucket, other) as sink:
        sink.put("a", b"1")
        with pytest.raises(ValueError, match=r"/a is put twice"):
            sink.put("a", b"2")
    assert bucket.get(f"{other}/a") == b"1"


def test_a_losing_streamed_commit_discards_its_data(local):
    commit_streamed(local, {"g": tensors("fp32")})
    with pytest.raises(CommitConflict):
        commit_streamed(local, {"g": tensors("fp32")})
    data = KEY.replace("commits/v000000000001.json", "data")
    assert len(local.list(data)) == 1  # the winner's prefix only


# --- bad input --------------------------------------------------------------------------------


def test_the_group_writer_refuses_what_does_not_fit():
    q = quantize(np.ones(300, np.float32), "int8")
    shapes = {"a": (300,), "b": (300,)}
    w = GroupWriter(lambda k, v: None, "g", "int8", shapes)
    with pytest.raises(FormatError, match="'b' of group 'g' comes before 'a' is complete"):
        w.append("b", q)
    with pytest.raises(FormatError, match="'a' of group 'g' is fp32; the group holds int8"):
        w.append("a", quantize(np.ones(300, np.float32), "fp32"))
    with pytest.raises(FormatError, match="a piece of 100 values before its last"):
        w.append("a", piece(q, 0, 100))
    with pytest.raises(FormatError, match="'zz' of group 'g' is not one of"):
        w.append("zz", q)
    w.append("a", piece(q, 0, 128))
    with pytest.raises(FormatError, match=r"'a' of group 'g' gets values \[128, 428\)"):
        w.append("a", q)
    w.append("a", piece(q, 128, 300))
    with pytest.raises(FormatError, match="'b' of group 'g' has 0 of its 300 values at close"):
        w.close()
    w.append("b", q)
    with pytest.raises(FormatError, match="'a' of group 'g' comes after 'b'"):
        w.append("a", q)
    w.close()
    with pytest.raises(FormatError, match="unknown payload kind 'int3'"):
        GroupWriter(lambda k, v: None, "g", "int3", shapes)


def test_a_reader_refuses_misaligned_ranges_and_unknown_names(local):
    commit_streamed(local, {"g": tensors("int4")})
    reader = VersionReader(local, read_marker(local, KEY), KEY)
    with pytest.raises(ValueError, match="start 100 is not a multiple of block 128"):
        reader.read("g", "d", 100)
    with pytest.raises(ValueError, match=r"range \[0, 3002\) of g/d is outside"):
        reader.read("g", "d", 0, 3002)
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        reader.read("g", "nope")
    with pytest.raises(FormatError, match="has no group 'params'"):
        reader.index("params")


@pytest.mark.parametrize(
    ("shape", "chunk", "named"),
    [([20_000 << 20], [1 << 20], "declares 20971520000 values"),
     ([16], [1], "chunks of 1 values"),
     ([5 * SMALL], [4 * SMALL], "g/data/c/0 holds 40960 bytes; a chunk of 8192 float32")],
)  # fmt: skip
def test_a_reader_refuses_a_metadata_bomb_before_fetching_a_chunk(tmp_path, shape, chunk, named):
    (tmp_path / "b").mkdir()
    bucket = CountingBucket(f"file://{tmp_path / 'b'}")
    objects = encode({"g": {"w": quantize(np.ones(5 * SMALL, np.float32), "fp32")}}, {})
    meta = json.loads(objects["g/data/zarr.json"])
    meta["shape"], meta["chunk_grid"]["configuration"]["chunk_shape"] = shape, chunk
    objects["g/data/zarr.json"] = json.dumps(meta).encode()
    commit_version(bucket, KEY, data_prefix_of(KEY, "0" * 16), objects, "global", {}, "t", "0" * 16)
    reader = VersionReader(bucket, read_marker(bucket, KEY), KEY)
    with pytest.raises(FormatError, match=named):
        reader.read("g", "w")
    assert not [k for k in bucket.reads if "/c/" in k]


# --- the format written before --------------------------------------------------------------


def sharded_encode(groups, attrs) -> dict[str, bytes]:
    """``codec.encode`` as it was before chunks became objects: each array one shard."""
    objects: dict[str, Any] = {}
    root = zarr.open_group(store=MemoryStore(objects), mode="w", zarr_format=3)
    root.attrs.update({"format": FORMAT_VERSION, **attrs})
    for gname, group in groups.items():
        kind = next(iter(group.values())).kind
        index, data, scales, d0, s0 = [], [], [], 0, 0
        for name in sorted(group):
            q = group[name]
            ns = 0 if q.scales is None else q.scales.size
            index.append({"name": name, "shape": list(q.shape), "kind": kind,
                          "dtype": LOGICAL_DTYPE[kind], "block_size": q.block_size,
                          "data": [d0, d0 + q.data.size], "scales": [s0, s0 + ns]})  # fmt: skip
            data.append(q.data.reshape(-1))
            if ns:
                scales.append(q.scales)
            d0, s0 = d0 + q.data.size, s0 + ns
        sub = root.create_group(gname)
        sub.attrs.update({"kind": kind, "logical_dtype": LOGICAL_DTYPE[kind],
                          "encoding": ENCODING[kind], "tensors": index})  # fmt: skip
        arrays = {"data": np.concatenate(data)}
        if kind in ("int8", "int4"):
            arrays["scales"] = np.concatenate(scales)
        for name, values in arrays.items():
            n = values.size
            chunk = max(1, min(CHUNK, n))
            arr = sub.create_array(name, shape=(n,), dtype=values.dtype, chunks=(chunk,),
                                   shards=(-(-n // chunk) * chunk,), compressors=None,
                                   fill_value=0, config={"write_empty_chunks": True})  # fmt: skip
            arr[:] = values
            assert np.dtype(values.dtype) == np.dtype(STORAGE_DTYPE[kind]) or name == "scales"
    return {key: buf.to_bytes() for key, buf in objects.items()}


@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8", "int4"])
def test_versions_of_the_sharded_format_still_read(local, kind):
    groups = {"wire": tensors(kind, seed=3), "opt": tensors("fp32", seed=4)}
    objects = sharded_encode(groups, {"kind": "global"})
    meta = json.loads(objects["wire/data/zarr.json"])
    assert meta["codecs"][0]["name"] == "sharding_indexed"  # (really the old format)
    commit_version(local, KEY, data_prefix_of(KEY, "1" * 16), objects, "global", {}, "t", "1" * 16)
    reader = VersionReader(local, read_marker(local, KEY), KEY)
    assert reader.groups() == ["opt", "wire"]
    for gname, group in groups.items():
        got = reader.tensors(gname)
        for name, q in group.items():
            same(got[name], q)
    same(reader.read("wire", "e.k", 256, 4001), piece(groups["wire"]["e.k"], 256, 4001))
    decoded = decode(objects)[0]
    for name, q in groups["wire"].items():
        same(decoded["wire"][name], q)


def test_a_metadata_bomb_of_the_sharded_format_is_refused(local):
    objects = sharded_encode({"g": tensors("int4")}, {})
    meta = json.loads(objects["g/data/zarr.json"])
    meta["shape"] = meta["chunk_grid"]["configuration"]["chunk_shape"] = [20_000 << 20]
    meta["codecs"][0]["configuration"]["chunk_shape"] = [1 << 20]  # the shard's inner chunks
    objects["g/data/zarr.json"] = json.dumps(meta).encode()
    with pytest.raises(FormatError, match="declares 20971520000 values"):
        decode(objects)
    commit_version(local, KEY, data_prefix_of(KEY, "2" * 16), objects, "global", {}, "t", "2" * 16)
    with pytest.raises(FormatError, match="declares 20971520000 values"):
        VersionReader(local, read_marker(local, KEY), KEY).tensors("g")


def test_a_version_many_chunks_large_streams_through_in_bounded_memory(local):
    """64 chunks written piece by piece and read back piece by piece: at no moment does
    the process hold more than a few chunks (traced allocations, not timing)."""
    import tracemalloc

    chunk, chunks = 1 << 16, 64  # 256 KiB fp32 chunks, 16 MiB in all
    n, step = chunk * chunks, chunk // 2 + 64
    value = lambda a, b: np.arange(a, b, dtype=np.float32)  # noqa: E731
    write_id = new_write_id()
    prefix = data_prefix_of(KEY, write_id)
    bound = 12 * chunk * 4  # a few chunks: the pieces, the writer's, the uploads, the cache
    tracemalloc.start()
    try:
        with ObjectSink(local, prefix, in_flight=3) as sink:
            sink.put("zarr.json", root_objects({})["zarr.json"])
            writer = GroupWriter(sink.put, "params", "fp32", {"w": (n,)}, chunk=chunk)
            for a in range(0, n, step):
                writer.append("w", quantize(value(a, min(n, a + step)), "fp32"))
            writer.close()
            entries = sink.finish()
        _, written_peak = tracemalloc.get_traced_memory()
        marker = commit_marker(local, KEY, prefix, entries, "global", {}, "test", write_id)
        tracemalloc.reset_peak()
        reader = VersionReader(local, marker, KEY)
        for a in range(0, n, step):
            got = reader.read("params", "w", a, min(n, a + step))
            assert np.array_equal(got.data, value(a, min(n, a + step)))
        _, read_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len([k for k in entries if "/c/" in k]) == chunks
    assert written_peak < bound and read_peak < bound, (written_peak, read_peak, bound)
