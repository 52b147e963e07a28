"""Quantization of outer gradients: fp32, bf16, and blockwise-absmax int8 / int4.

A tensor is flattened and cut into blocks of ``block_size`` values; each block keeps one
float32 scale ``absmax / qmax`` and its values as ``round(x / scale)`` in
``[-qmax, qmax]`` (qmax 127 for int8, 7 for int4). int4 codes are stored offset by 8
and packed two per byte (low nibble first), so the payload really is half a byte per
value. The error per value is at most ``scale / 2``.

The payload is what travels and what storage writes; ``QuantizedTensor.nbytes`` is its
exact size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

QMAX = {"int8": 127, "int4": 7}
STORAGE_DTYPE = {"fp32": np.float32, "bf16": np.uint16, "int8": np.int8, "int4": np.uint8}


@dataclass(frozen=True)
class QuantizedTensor:
    kind: str  # fp32 | bf16 | int8 | int4
    shape: tuple[int, ...]
    data: np.ndarray  # float32 | uint16 (bf16 bits) | int8 | uint8 (two int4 codes per byte)
    scales: np.ndarray | None = None  # float32 [ceil(n / block_size)] for int8 / int4
    block_size: int = 0

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.scales is None else self.scales.nbytes)


def payload_bytes(size: int, kind: str, block_size: int = 128) -> int:
    """Exact payload size of a ``size``-value tensor, without building it."""
    blocks = -(-size // block_size)
    return {
        "fp32": 4 * size,
        "bf16": 2 * size,
        "int8": size + 4 * blocks,
        "int4": -(-size // 2) + 4 * blocks,
    }[kind]


def quantize(x: np.ndarray, kind: str, block_size: int = 128) -> QuantizedTensor:
    x = np.asarray(x, dtype=np.float32)
    shape = tuple(x.shape)
    if kind == "fp32":
        return QuantizedTensor(kind, shape, x.reshape(-1).copy())
    if kind == "bf16":
        return QuantizedTensor(
            kind, shape, x.reshape(-1).astype(ml_dtypes.bfloat16).view(np.uint16)
        )
    if kind not in QMAX:
        raise ValueError(f"unknown quantization {kind!r}; choose fp32, bf16, int8 or int4")
    if kind == "int4" and block_size % 2:
        raise ValueError(f"int4 needs an even block size, got {block_size}")
    qmax = QMAX[kind]
    flat = x.reshape(-1)
    n = flat.size
    blocks = -(-n // block_size)
    padded = np.zeros(blocks * block_size, dtype=np.float32)
    padded[:n] = flat
    padded = padded.reshape(blocks, block_size)
    scales = np.abs(padded).max(axis=1) / qmax
    safe = np.where(scales > 0, scales, 1.0)
    codes = np.clip(np.rint(padded / safe[:, None]), -qmax, qmax).astype(np.int8).reshape(-1)
    if kind == "int8":
        return QuantizedTensor(kind, shape, codes[:n].copy(), scales.astype(np.float32), block_size)
    nibbles = (codes[: n + (n % 2)] + 8).astype(np.uint8)  # [-7, 7] -> [1, 15]
    packed = nibbles[0::2] | (nibbles[1::2] << 4)
    return QuantizedTensor(kind, shape, packed, scales.astype(np.float32), block_size)


def dequantize(q: QuantizedTensor, owned: bool = False) -> np.ndarray:
    """Back to float32 of the original shape: a new array, or, ``owned`` (``q`` is the
    caller's to give away: a tensor just read from storage), an fp32 tensor's own data,
    not copied (a restore held one more copy of its largest leaf)."""
    n = q.size
    if q.kind == "fp32":
        return q.data.astype(np.float32, copy=not owned).reshape(q.shape)
    if q.kind == "bf16":
        return q.data.view(ml_dtypes.bfloat16).astype(np.float32).reshape(q.shape)
    if q.kind == "int8":
        codes = q.data.astype(np.float32)
    elif q.kind == "int4":
        codes = np.empty(q.data.size * 2, dtype=np.float32)
        codes[0::2] = q.data & 0x0F
        codes[1::2] = q.data >> 4
        codes -= 8  # [1, 15] -> [-7, 7], exact in float32
        codes = codes[:n]
    else:
        raise ValueError(f"unknown quantization {q.kind!r}")
    # Each block's codes times its scale, in place (the same float32 products as with
    # the scales repeated to every value, without that array: 2 to 2.5x faster).
    b = q.block_size
    full, blocks = n // b * b, -(-n // b)
    if codes.size != n or q.scales is None or q.scales.size < blocks:
        raise ValueError(f"{codes.size} codes and {0 if q.scales is None else q.scales.size} "
                         f"scales for {n} values in blocks of {b}")  # fmt: skip
    whole_blocks = codes[:full].reshape(-1, b)  # a view: multiplied in place
    whole_blocks *= q.scales[: full // b, None]
    if full < n:  # the last block, short
        codes[full:] *= q.scales[blocks - 1]
    return codes.reshape(q.shape)


def exact_values(q: QuantizedTensor, owned: bool = False) -> np.ndarray:
    """``q``'s values in the narrowest type that holds them exactly, of the original
    shape: a bf16 tensor's codes as ``bfloat16`` (nothing decoded), any other
    ``dequantize``'d to float32. What a held copy keeps (``storage_layout.spill``: half
    the bytes of float32 for a bf16 wire)."""
    if q.kind == "bf16":
        return q.data.view(ml_dtypes.bfloat16).reshape(q.shape)
    return dequantize(q, owned)


def quantize_with_feedback(
    x: np.ndarray, carry: np.ndarray | None, kind: str, block_size: int = 128
) -> tuple[QuantizedTensor, np.ndarray]:
    """Error feedback: quantize ``x + carry`` and return the code with its new residual
    (what the code fails to carry), to be added to a later value."""
    compensated = x if carry is None else x + carry
    q = quantize(compensated, kind, block_size)
    return q, compensated - dequantize(q)


# Values of a tensor a learner decodes at a time into the copy of a version it holds
# (``Pieces``): 32 MiB of float32, the chunks one whole-tensor read fetches at once
# (``storage_layout.stream.PARALLEL`` x ``storage_layout.codec.CHUNK``).
PIECE_VALUES = 8 << 20


def piece_step(block_size: int) -> int:
    """``PIECE_VALUES`` rounded to whole quantization blocks and an even count, so a piece
    starts on a block (and on an int4 byte)."""
    unit = math.lcm(max(block_size, 1), 2)
    return max(unit, PIECE_VALUES // unit * unit)


class Pieces:
    """A float32 tensor made a piece at a time (a whole tensor's read and decode held 1.5 to
    3 times it at once: 3.8 GB and more for a 12 B model's embedding). ``shape``;
    ``pieces()`` gives its flat pieces in order; ``np.asarray`` makes it whole. What a
    learner's spill file (``storage_layout.spill``) writes without holding the tensor."""

    shape: tuple[int, ...]
    dtype = np.dtype(np.float32)

    def pieces(self) -> Iterator[np.ndarray]:
        raise NotImplementedError

    def exact_pieces(self) -> Iterator[np.ndarray]:
        """The pieces in the narrowest type that holds them exactly (``exact_values``):
        float32 here, bfloat16 where the tensor is stored so."""
        return self.pieces()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.empty(math.prod(self.shape), np.float32)
        at = 0
        for piece in self.pieces():
            out[at : at + piece.size] = piece
            at += piece.size
        if at != out.size:
            raise ValueError(f"{at} values in the pieces of a tensor of shape {self.shape}")
        out = out.reshape(self.shape)
        return out if dtype is None else out.astype(dtype)
