"""``protocol.quantize`` on the devices: the outer gradient of a sharded tensor quantized
where the tensor lives, so only its codes and scales (a quarter of its bytes at int8)
travel to the host, one tensor at a time.

Each function performs the numpy version's float32 operations in the same order
(division, round half to even, clip, the bf16 cast's rounding), so codes, scales and
error-feedback residuals are bit for bit those of ``quantize.quantize_with_feedback``
(``tests/test_sharded_learner.py``), and a learner's payloads do not depend on whether
it computes them here or on the host.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from protocol.quantize import QMAX


def _blocked(flat: jax.Array, block_size: int) -> jax.Array:
    n = flat.size
    blocks = -(-n // block_size)
    return jnp.pad(flat, (0, blocks * block_size - n)).reshape(blocks, block_size)


def _divide(x: jax.Array, y: jax.Array) -> jax.Array:
    """``x / y`` rounded as IEEE (numpy) rounds it. XLA rewrites ``x / broadcast(y)`` as
    ``x * broadcast(1 / y)``, a product that differs from the quotient in the last bit
    for some values (a scale one ulp off, a code one off at a rounding tie); behind the
    barrier the divisor is an opaque array of ``x``'s shape, so the quotient stays."""
    return x / jax.lax.optimization_barrier(jnp.broadcast_to(y, x.shape))


def quantize(x: jax.Array, kind: str, block_size: int = 128) -> tuple[jax.Array, jax.Array | None]:
    """``quantize.quantize`` as ``(data, scales)`` device arrays (``scales`` None for
    fp32 and bf16); ``QuantizedTensor(kind, shape, data, scales, block_size)`` once on
    the host."""
    x = jnp.asarray(x, dtype=jnp.float32)
    if kind == "fp32":
        return x.reshape(-1), None
    if kind == "bf16":
        return jax.lax.bitcast_convert_type(x.reshape(-1).astype(jnp.bfloat16), jnp.uint16), None
    if kind not in QMAX:
        raise ValueError(f"unknown quantization {kind!r}; choose fp32, bf16, int8 or int4")
    if kind == "int4" and block_size % 2:
        raise ValueError(f"int4 needs an even block size, got {block_size}")
    qmax = QMAX[kind]
    n = x.size
    padded = _blocked(x.reshape(-1), block_size)
    scales = _divide(jnp.abs(padded).max(axis=1), jnp.float32(qmax))
    safe = jnp.where(scales > 0, scales, jnp.float32(1.0))
    codes = jnp.rint(_divide(padded, safe[:, None]))
    codes = jnp.clip(codes, -qmax, qmax).astype(jnp.int8).reshape(-1)
    if kind == "int8":
        return codes[:n], scales
    nibbles = (codes[: n + (n % 2)] + 8).astype(jnp.uint8)  # [-7, 7] -> [1, 15]
    return nibbles[0::2] | (nibbles[1::2] << 4), scales


def dequantize(
    data: jax.Array, scales: jax.Array | None, kind: str, shape: tuple[int, ...], block_size: int
) -> jax.Array:
    """``quantize.dequantize`` of ``quantize``'s device arrays: float32 of ``shape``."""
    if kind == "fp32":
        return data.reshape(shape)
    if kind == "bf16":
        return jax.lax.bitcast_convert_type(data, jnp.bfloat16).astype(jnp.float32).reshape(shape)
    if kind == "int8":
        codes = data.astype(jnp.float32)
    else:
        low = (data & 0x0F).astype(jnp.float32) - 8
        high = (data >> 4).astype(jnp.float32) - 8
        codes = jnp.stack([low, high], axis=1).reshape(-1)
    n = 1
    for s in shape:
        n *= s
    codes = _blocked(codes[:n], block_size)
    return (codes * scales[:, None]).reshape(-1)[:n].reshape(shape)


@partial(jax.jit, static_argnames=("kind", "block_size"))
def _compensated_codes(anchor, theta, carry, kind, block_size):
    compensated = anchor - theta if carry is None else (anchor - theta) + carry
    return (*quantize(compensated, kind, block_size), compensated)


_dequantized = jax.jit(dequantize, static_argnames=("kind", "shape", "block_size"))


def outer_gradient(
    anchor: jax.Array, theta: jax.Array, carry: jax.Array | None, kind: str, block_size: int
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """The quantized outer gradient ``anchor - theta`` (plus the error-feedback ``carry``
    when given) of one tensor: ``(data, scales, residual)``, the residual being what the
    code fails to carry (``quantize.quantize_with_feedback``)."""
    data, scales, compensated = _compensated_codes(anchor, theta, carry, kind, block_size)
    if kind == "fp32":
        return data, scales, jnp.zeros_like(compensated)
    # Three programs, not one: fused, the product and the subtraction would round once
    # (a fused multiply-add, which XLA emits), numpy's two operations round twice.
    carried = _dequantized(data, scales, kind, compensated.shape, block_size)
    return data, scales, jnp.subtract(compensated, carried)
