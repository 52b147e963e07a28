"""Zarr v3 encoding of a fragment version: named tensor groups -> a few objects.

A version is one Zarr group. Each named subgroup (``delta`` for a contribution;
``params`` and ``momentum`` for a global version) holds one flat ``data`` array, the
concatenation of its tensors' payloads in storage dtype (float32, bf16 bits as uint16,
int8, or int4 packed two per byte as uint8), and for int8 / int4 one flat float32
``scales`` array. Each array is one Zarr shard (1 Mi-element inner chunks, so a reader
may fetch parts), uncompressed. So a fragment of any size is a handful of objects, and
the round trip is bit-exact.

The subgroup's attributes describe it without this code: ``kind``, ``logical_dtype``,
``encoding`` (how to turn the stored values into numbers, in words: ``ENCODING``) and
``tensors``, one record per tensor with named fields::

    {"name": "blocks.0.up.kernel", "shape": [64, 256], "kind": "int4", "dtype": "int4",
     "block_size": 128, "data": [0, 8192], "scales": [0, 128]}

(``data`` and ``scales``: the tensor's [start, stop) in the group's ``data`` and
``scales`` arrays). Groups written before these records had names hold a list per tensor,
``[name, shape, block_size, data start, data stop, scales start, scales stop]``; they
still decode.

Encoding happens in memory (``zarr.storage.MemoryStore``); the commit protocol then
uploads and hashes each object. Anyone can open a committed version with plain zarr.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import zarr
from zarr.core.buffer import cpu
from zarr.storage import MemoryStore

from diloco.quantize import STORAGE_DTYPE, QuantizedTensor
from storage_layout.layout import FORMAT_VERSION

CHUNK = 1 << 20
LOGICAL_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "int8": "int8", "int4": "int4"}
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


def _array(group: zarr.Group, name: str, values: np.ndarray) -> None:
    n = int(values.size)
    chunk = max(1, min(CHUNK, n))
    shard = -(-max(n, 1) // chunk) * chunk
    arr = group.create_array(
        name,
        shape=(n,),
        dtype=values.dtype,
        chunks=(chunk,),
        shards=(shard,),
        compressors=None,
        fill_value=0,
        # Every chunk is stored, zeros too, so a reader can bound what an array may hold
        # by the bytes of its objects before decoding it (``_check_sizes``).
        config={"write_empty_chunks": True},
    )
    if n:
        arr[:] = values


def encode(groups: TensorGroups, attrs: Mapping[str, Any]) -> dict[str, bytes]:
    """Tensor groups + JSON attributes -> ``{relative key: bytes}`` of one Zarr v3 group."""
    objects: dict[str, Any] = {}
    root = zarr.open_group(store=MemoryStore(objects), mode="w", zarr_format=3)
    root.attrs.update({"format": FORMAT_VERSION, **attrs})
    for gname, tensors in groups.items():
        kinds = {q.kind for q in tensors.values()}
        if len(kinds) > 1:
            raise FormatError(f"group {gname!r} mixes payload kinds {sorted(kinds)}")
        kind = kinds.pop() if kinds else "fp32"
        index, data, scales, d0, s0 = [], [], [], 0, 0
        for name in sorted(tensors):
            q = tensors[name]
            ns = 0 if q.scales is None else q.scales.size
            index.append(
                {"name": name, "shape": list(q.shape), "kind": kind,
                 "dtype": LOGICAL_DTYPE[kind], "block_size": q.block_size,
                 "data": [d0, d0 + q.data.size], "scales": [s0, s0 + ns]}
            )  # fmt: skip
            data.append(q.data.reshape(-1))
            if ns:
                scales.append(q.scales)
            d0, s0 = d0 + q.data.size, s0 + ns
        sub = root.create_group(gname)
        sub.attrs.update({"kind": kind, "logical_dtype": LOGICAL_DTYPE[kind],
                          "encoding": ENCODING[kind], "tensors": index})  # fmt: skip
        dtype = STORAGE_DTYPE[kind]
        _array(sub, "data", np.concatenate(data) if data else np.zeros(0, dtype))
        if kind in ("int8", "int4"):
            _array(sub, "scales", np.concatenate(scales) if scales else np.zeros(0, np.float32))
    return {key: buf.to_bytes() for key, buf in objects.items()}


def _tensor_entry(entry: Any) -> tuple[str, list[int], int, int, int, int, int]:
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
    if len(arr.shape) != 1:
        raise FormatError(f"{gname}/{name} has shape {arr.shape}; a flat array was expected")
    declared = int(arr.shape[0]) * arr.dtype.itemsize
    stored = sum(len(v) for k, v in objects.items() if k.startswith(f"{gname}/{name}/c"))
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
    """Inverse of ``encode``. Raises ``FormatError`` naming what does not fit, and
    before reading any array whose metadata claims more than its objects hold."""
    store = MemoryStore({k: cpu.Buffer.from_bytes(v) for k, v in objects.items()})
    try:
        root = zarr.open_group(store=store, mode="r", zarr_format=3)
        attrs = dict(root.attrs)
    except Exception as exc:  # zarr raises several types for unreadable metadata
        raise FormatError(f"not a Zarr v3 group: {exc}") from exc
    fmt = attrs.get("format")
    if fmt != FORMAT_VERSION:
        raise FormatError(f"unknown format version {fmt!r} (this code reads {FORMAT_VERSION})")
    groups: dict[str, dict[str, QuantizedTensor]] = {}
    for gname, sub in root.groups():
        try:
            kind = sub.attrs["kind"]
            dtype = STORAGE_DTYPE[kind]
            arrays = ["data", "scales"] if kind in ("int8", "int4") else ["data"]
            for name in arrays:
                _check_sizes(gname, name, sub[name], objects)
            data = sub["data"][:]
            scales = sub["scales"][:] if "scales" in arrays else None
            tensors = {}
            for entry in sub.attrs["tensors"]:
                name, shape, block, d0, d1, s0, s1 = _tensor_entry(entry)
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
