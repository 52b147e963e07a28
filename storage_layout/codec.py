"""Zarr v3 encoding of a fragment version: named tensor groups -> objects, chunk by chunk.

A version is one Zarr group. Each named subgroup (``delta`` for a contribution;
``params`` and ``momentum`` for a global version) holds one flat ``data`` array, the
concatenation of its tensors' payloads in storage dtype (float32, bf16 bits as uint16,
int8, or int4 packed two per byte as uint8), and for int8 / int4 one flat float32
``scales`` array. Each array is a plain Zarr array of chunks of at most ``CHUNK`` values
(``chunk_len``), uncompressed, every chunk stored, each chunk its own object
(``{group}/{array}/c/{i}``): the little-endian bytes of its values. So a writer emits,
and a reader fetches and checks, one chunk at a time whatever the fragment's size
(``GroupWriter`` here, ``storage_layout.stream`` for the bucket side), and the round trip
is bit-exact. Versions written before held each array as one Zarr shard; they still
decode.

The subgroup's attributes describe it without this code: ``kind``, ``logical_dtype``,
``encoding`` (how to turn the stored values into numbers, in words: ``ENCODING``) and
``tensors``, one record per tensor with named fields::

    {"name": "blocks.0.up.kernel", "shape": [64, 256], "kind": "int4", "dtype": "int4",
     "block_size": 128, "data": [0, 8192], "scales": [0, 128]}

(``data`` and ``scales``: the tensor's [start, stop) in the group's ``data`` and
``scales`` arrays). Groups written before these records had names hold a list per tensor,
``[name, shape, block_size, data start, data stop, scales start, scales stop]``; they
still decode.

The metadata documents are zarr's own (each array is created in a
``zarr.storage.MemoryStore`` without data); the chunks are written here, byte for byte
what zarr writes for them. Anyone can open a committed version with plain zarr.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr
from zarr.core.buffer import cpu
from zarr.storage import MemoryStore

from protocol.quantize import STORAGE_DTYPE, QuantizedTensor
from storage_layout.layout import FORMAT_VERSION

CHUNK = 1 << 20
LOGICAL_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "int8": "int8", "int4": "int4"}
BLOCKED = ("int8", "int4")  # kinds with one float32 scale per block of values
# How a subgroup's stored values become numbers, per kind (its ``encoding`` attribute).
_BLOCKS = (
    "one float32 scale per block of block_size consecutive values of a tensor (flattened "
    "in C order; the last block may be short); value = code * scales[block]"
)
ENCODING = {
    "fp32": "data is float32, the tensors' values flattened in C order",
    "bf16": "data is uint16 holding bfloat16 bit patterns (the high 16 bits of a float32): "
    "float32 = (uint32(data) << 16) viewed as float32",
    "int8": f"data is int8 codes in [-127, 127]; {_BLOCKS}",
    "int4": "data is uint8, two 4-bit codes per byte, low nibble first (value 2i in bits "
    "0-3, value 2i+1 in bits 4-7; an odd-sized tensor pads its last byte), each code "
    f"stored as q + 8 with q in [-7, 7]; {_BLOCKS.replace('code *', 'q *')}",
}

TensorGroups = Mapping[str, Mapping[str, QuantizedTensor]]


class FormatError(ValueError):
    """Objects that do not decode as a fragment version of a known format."""


@dataclass(frozen=True)
class TensorInfo:
    """What a group's index says of one tensor, before any of its values are read."""

    kind: str
    shape: tuple[int, ...]
    block_size: int  # values per scale for int8 / int4; 0 for fp32 and bf16

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def chunk_len(n: int, chunk: int = CHUNK) -> int:
    """Values per chunk of an ``n``-value array: at most ``chunk``, the array spread evenly
    over as few chunks as that allows. Zarr stores the last chunk of a regular grid at
    full size, so equal chunks pad it by less than one value per chunk, where chunks of
    exactly ``chunk`` values could pad it by almost a whole chunk."""
    if n <= 0:
        return 1
    return -(-n // -(-n // chunk))


def payload_lengths(kind: str, n: int, block_size: int) -> tuple[int, int]:
    """(values in ``data``, values in ``scales``) of an ``n``-value tensor of ``kind``."""
    data = -(-n // 2) if kind == "int4" else n
    return data, (-(-n // block_size) if kind in BLOCKED else 0)


def _zarr_metadata(
    gname: str, attrs: Mapping[str, Any], arrays: Mapping[str, tuple[Any, int, int]]
) -> tuple[dict[str, bytes], dict[str, zarr.Array]]:
    """zarr's own ``zarr.json`` documents of group ``gname`` (with ``attrs``) and of its
    flat arrays ``{name: (dtype, length, chunk)}``, created without data; and the arrays,
    whose metadata names their chunk objects."""
    store: dict[str, Any] = {}
    root = zarr.open_group(store=MemoryStore(store), mode="w", zarr_format=3)
    sub = root.create_group(gname)
    sub.attrs.update(attrs)
    made = {
        name: sub.create_array(
            name, shape=(n,), dtype=dtype, chunks=(chunk,), compressors=None, fill_value=0
        )
        for name, (dtype, n, chunk) in arrays.items()
    }
    docs = {k: v.to_bytes() for k, v in store.items() if k != "zarr.json"}
    return docs, made


def root_objects(attrs: Mapping[str, Any]) -> dict[str, bytes]:
    """A version's root ``zarr.json``: its ``format`` and ``attrs``."""
    store: dict[str, Any] = {}
    root = zarr.open_group(store=MemoryStore(store), mode="w", zarr_format=3)
    root.attrs.update({"format": FORMAT_VERSION, **attrs})
    return {k: v.to_bytes() for k, v in store.items()}


class _ChunkedArray:
    """One flat array written chunk by chunk: at most one chunk of values buffered. Each
    chunk is built in a ``bytearray`` of its own, which ``put`` is given (and keeps:
    nothing here writes to it again), so a chunk's bytes are not copied once more to
    make the object (a quarter of a syncer's merge thread at 1 B parameters)."""

    def __init__(self, put: Callable[[str, bytes], None], prefix: str, arr: zarr.Array):
        self.put, self.prefix, self.arr = put, prefix, arr
        self.dtype = np.dtype(arr.dtype).newbyteorder("<")  # the bytes codec's order
        self.chunk = int(arr.chunks[0])
        self._fresh(self.chunk if arr.shape[0] else 0)
        self.fill = self.index = 0

    def _fresh(self, length: int) -> None:
        self.raw = bytearray(length * self.dtype.itemsize)
        self.buf = np.frombuffer(self.raw, self.dtype)

    def append(self, values: np.ndarray) -> None:
        pos = 0
        while pos < values.size:
            take = min(self.chunk - self.fill, values.size - pos)
            self.buf[self.fill : self.fill + take] = values[pos : pos + take]
            self.fill += take
            pos += take
            if self.fill == self.chunk:
                self._emit()

    def _emit(self, last: bool = False) -> None:
        key = self.arr.metadata.encode_chunk_key((self.index,))
        raw = self.raw
        self._fresh(0 if last else self.chunk)  # (before ``put``: it may keep ``raw``)
        self.put(f"{self.prefix}/{key}", raw)
        self.index += 1
        self.fill = 0

    def close(self) -> None:
        if self.fill:  # the last chunk, padded with the fill value as zarr stores it
            self.buf[self.fill :] = 0
            self._emit(last=True)
        self._fresh(0)


class GroupWriter:
    """One subgroup of a version, written piece by piece in bounded memory.

    ``append(name, piece)`` takes the next piece of tensor ``name``: tensors in sorted
    name order, each tensor's pieces in order, a piece flat (``q.shape == (n,)``) and,
    except a tensor's last, a whole number of scale blocks (an even number of values for
    int4, whose bytes hold two). Each chunk of the group's ``data`` and ``scales`` arrays
    goes to ``put(rel_key, bytes)`` as soon as it is full (keys relative to the
    version's data prefix: ``params/data/c/3``); ``close`` writes the last chunks, then the
    metadata documents. So at most one chunk per array is held here, whatever the
    group's size, and the objects are those ``encode`` makes of the same tensors.
    """

    def __init__(
        self,
        put: Callable[[str, bytes], None],
        gname: str,
        kind: str,
        shapes: Mapping[str, Sequence[int]],
        block_size: int = 128,
        chunk: int = CHUNK,
    ):
        if kind not in LOGICAL_DTYPE:
            raise FormatError(f"group {gname!r}: unknown payload kind {kind!r}")
        if kind in BLOCKED and (block_size < 1 or (kind == "int4" and block_size % 2)):
            raise FormatError(f"group {gname!r}: block size {block_size} does not fit {kind}")
        if chunk < 1:
            raise FormatError(f"group {gname!r}: chunks of {chunk} values")
        self.gname, self.kind = gname, kind
        self.block_size = block_size if kind in BLOCKED else 0
        self.shapes = {n: tuple(int(s) for s in shapes[n]) for n in sorted(shapes)}
        self.order = list(self.shapes)
        index, d0, s0 = [], 0, 0
        for name, shape in self.shapes.items():
            nd, ns = payload_lengths(kind, math.prod(shape), self.block_size or 1)
            index.append(
                {"name": name, "shape": list(shape), "kind": kind,
                 "dtype": LOGICAL_DTYPE[kind], "block_size": self.block_size,
                 "data": [d0, d0 + nd], "scales": [s0, s0 + ns]}
            )  # fmt: skip
            d0, s0 = d0 + nd, s0 + ns
        arrays = {"data": (STORAGE_DTYPE[kind], d0, chunk_len(d0, chunk))}
        if kind in BLOCKED:
            arrays["scales"] = (np.float32, s0, chunk_len(s0, chunk))
        attrs = {"kind": kind, "logical_dtype": LOGICAL_DTYPE[kind],
                 "encoding": ENCODING[kind], "tensors": index}  # fmt: skip
        self._docs, made = _zarr_metadata(gname, attrs, arrays)
        self._arrays = {a: _ChunkedArray(put, f"{gname}/{a}", arr) for a, arr in made.items()}
        self.put = put
        self._done = dict.fromkeys(self.order, 0)  # values appended per tensor
        self._at = 0  # index in ``order`` of the tensor being written
        self._closed = False

    def _where(self, name: str) -> str:
        return f"tensor {name!r} of group {self.gname!r}"

    def append(self, name: str, q: QuantizedTensor) -> None:
        if self._closed:
            raise FormatError(f"group {self.gname!r} is closed; {name!r} came after")
        if name not in self.shapes:
            raise FormatError(f"{self._where(name)} is not one of the tensors it was given")
        at = self.order.index(name)
        if at < self._at:
            raise FormatError(
                f"{self._where(name)} comes after {self.order[self._at]!r}: tensors are "
                "written in sorted name order"
            )
        for before in self.order[self._at : at]:
            if self._done[before] < math.prod(self.shapes[before]):
                raise FormatError(f"{self._where(name)} comes before {before!r} is complete")
        if q.kind != self.kind:
            raise FormatError(f"{self._where(name)} is {q.kind}; the group holds {self.kind}")
        n, have, piece = math.prod(self.shapes[name]), self._done[name], q.size
        if have + piece > n:
            raise FormatError(
                f"{self._where(name)} gets values [{have}, {have + piece}); it holds {n}"
            )
        last = have + piece == n
        if not last and self.block_size and piece % self.block_size:
            raise FormatError(
                f"{self._where(name)}: a piece of {piece} values before its last is not a "
                f"whole number of blocks of {self.block_size}"
            )
        if not last and self.kind == "int4" and piece % 2:
            raise FormatError(f"{self._where(name)}: an int4 piece before its last is odd")
        data = np.asarray(q.data).reshape(-1)
        nd, ns = payload_lengths(self.kind, piece, self.block_size or 1)
        if data.dtype != STORAGE_DTYPE[self.kind] or data.size != nd:
            raise FormatError(
                f"{self._where(name)}: a piece of {piece} values has {data.size} {data.dtype} "
                f"data; {nd} {np.dtype(STORAGE_DTYPE[self.kind])} were expected"
            )
        if self.block_size:
            scales = None if q.scales is None else np.asarray(q.scales).reshape(-1)
            if scales is None or scales.dtype != np.float32 or scales.size != ns:
                got = "none" if scales is None else f"{scales.size} {scales.dtype}"
                raise FormatError(
                    f"{self._where(name)}: a piece of {piece} values has {got} scales; "
                    f"{ns} float32 were expected"
                )
            if q.block_size != self.block_size:
                raise FormatError(
                    f"{self._where(name)} has blocks of {q.block_size}; the group's are "
                    f"{self.block_size}"
                )
            self._arrays["scales"].append(scales)
        self._arrays["data"].append(data)
        self._done[name] = have + piece
        self._at = at

    def close(self) -> None:
        """Write the last chunks and the metadata; ``FormatError`` if a tensor is short."""
        if self._closed:
            return
        for name in self.order:
            n = math.prod(self.shapes[name])
            if self._done[name] < n:
                raise FormatError(
                    f"{self._where(name)} has {self._done[name]} of its {n} values at close"
                )
        for arr in self._arrays.values():
            arr.close()
        for key, doc in self._docs.items():
            self.put(key, doc)
        self._closed = True


def encode(groups: TensorGroups, attrs: Mapping[str, Any]) -> dict[str, bytes]:
    """Tensor groups + JSON attributes -> ``{relative key: bytes}`` of one Zarr v3 group
    (in memory: ``GroupWriter`` writes the same objects piece by piece)."""
    objects = root_objects(attrs)
    for gname, tensors in groups.items():
        write_group(objects.__setitem__, gname, tensors)
    return objects


def group_kind(gname: str, tensors: Mapping[str, QuantizedTensor]) -> tuple[str, int]:
    """The one payload kind and block size of a group's tensors; ``FormatError`` if they
    mix kinds or block sizes."""
    kinds = {q.kind for q in tensors.values()}
    if len(kinds) > 1:
        raise FormatError(f"group {gname!r} mixes payload kinds {sorted(kinds)}")
    kind = kinds.pop() if kinds else "fp32"
    blocks = {q.block_size for q in tensors.values()} if kind in BLOCKED else set()
    if len(blocks) > 1:
        raise FormatError(f"group {gname!r} mixes block sizes {sorted(blocks)}")
    return kind, blocks.pop() if blocks else 128


def write_group(
    put: Callable[[str, bytes], None], gname: str, tensors: Mapping[str, QuantizedTensor]
) -> None:
    """Whole tensors as group ``gname``, through a ``GroupWriter`` (one piece each)."""
    kind, block_size = group_kind(gname, tensors)
    shapes = {name: q.shape for name, q in tensors.items()}
    writer = GroupWriter(put, gname, kind, shapes, block_size)
    for name in sorted(tensors):
        q = tensors[name]
        writer.append(name, QuantizedTensor(kind, (q.size,), q.data, q.scales, q.block_size))
    writer.close()


def tensor_entry(entry: Any) -> tuple[str, list[int], int, int, int, int, int]:
    """One tensor's record: named fields, or the unlabelled list of older groups."""
    if isinstance(entry, Mapping):
        (d0, d1), (s0, s1) = entry["data"], entry["scales"]
        return entry["name"], entry["shape"], entry["block_size"], d0, d1, s0, s1
    name, shape, block, d0, d1, s0, s1 = entry
    return name, shape, block, d0, d1, s0, s1


# The smallest inner chunk a reader accepts (elements), for an array that large: fewer,
# larger requests, and a metadata document cannot make a reader loop over millions.
MIN_CHUNK = 1024


def _check_sizes(gname: str, name: str, arr: zarr.Array, objects: Mapping[str, bytes]) -> None:
    """Before an array is read: it declares no more values than its stored chunks hold
    (``encode`` stores every chunk) and no tiny chunks, so a forged or damaged
    ``zarr.json`` claiming a huge array costs nothing to refuse (``FormatError``)."""
    stored = sum(len(v) for k, v in objects.items() if k.startswith(f"{gname}/{name}/c"))
    check_declared(gname, name, arr, stored)


def check_declared(gname: str, name: str, arr: zarr.Array, stored: int) -> None:
    """``_check_sizes`` for an array whose chunk objects hold ``stored`` bytes in all."""
    if len(arr.shape) != 1:
        raise FormatError(f"{gname}/{name} has shape {arr.shape}; a flat array was expected")
    declared = int(arr.shape[0]) * arr.dtype.itemsize
    if declared > stored:
        raise FormatError(
            f"{gname}/{name} declares {arr.shape[0]} values ({declared} bytes) but its "
            f"chunks hold {stored} bytes"
        )
    chunk = int(arr.chunks[0]) if arr.chunks else 0
    if chunk < min(int(arr.shape[0]), MIN_CHUNK):
        raise FormatError(f"{gname}/{name} has chunks of {chunk} values; at least "
                          f"{MIN_CHUNK} are expected")  # fmt: skip


def decode(objects: Mapping[str, bytes]) -> tuple[dict[str, dict[str, QuantizedTensor]], dict]:
    """Inverse of ``encode`` (and of the sharded arrays written before). Raises
    ``FormatError`` naming what does not fit, and before reading any array whose metadata
    claims more than its objects hold."""
    store = MemoryStore({k: cpu.Buffer.from_bytes(v) for k, v in objects.items()})
    try:
        root = zarr.open_group(store=store, mode="r", zarr_format=3)
        attrs = dict(root.attrs)
    except Exception as exc:  # zarr raises several types for unreadable metadata
        raise FormatError(f"not a Zarr v3 group: {exc}") from exc
    check_format(attrs)
    groups: dict[str, dict[str, QuantizedTensor]] = {}
    for gname, sub in root.groups():
        try:
            kind = sub.attrs["kind"]
            dtype = STORAGE_DTYPE[kind]
            arrays = ["data", "scales"] if kind in BLOCKED else ["data"]
            for name in arrays:
                _check_sizes(gname, name, sub[name], objects)
            data = sub["data"][:]
            scales = sub["scales"][:] if "scales" in arrays else None
            tensors = {}
            for entry in sub.attrs["tensors"]:
                name, shape, block, d0, d1, s0, s1 = tensor_entry(entry)
                if d1 > data.size or (scales is not None and s1 > scales.size):
                    raise FormatError(f"tensor {name} of group {gname} runs past its array")
                tensors[name] = QuantizedTensor(
                    kind,
                    tuple(shape),
                    np.asarray(data[d0:d1], dtype=dtype),
                    None if scales is None else np.asarray(scales[s0:s1], np.float32),
                    block,
                )
        except FormatError:
            raise
        except Exception as exc:
            raise FormatError(f"group {gname!r} does not decode: {exc}") from exc
        groups[gname] = tensors
    return groups, attrs


def check_format(attrs: Mapping[str, Any]) -> None:
    fmt = attrs.get("format")
    if fmt != FORMAT_VERSION:
        raise FormatError(f"unknown format version {fmt!r} (this code reads {FORMAT_VERSION})")
