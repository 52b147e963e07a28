import ml_dtypes
import numpy as np
import pytest

from protocol.quantize import dequantize, payload_bytes, quantize, quantize_with_feedback

rng = np.random.default_rng(1)


@pytest.mark.parametrize("kind,qmax", [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("shape", [(1000,), (37, 29), (5,)])
def test_blockwise_error_bound(kind, qmax, shape):
    x = rng.normal(size=shape).astype(np.float32) * 3
    q = quantize(x, kind, block_size=64)
    y = dequantize(q)
    assert y.shape == x.shape and y.dtype == np.float32
    flat = np.zeros(-(-x.size // 64) * 64, np.float32)
    flat[: x.size] = x.reshape(-1)
    absmax = np.abs(flat.reshape(-1, 64)).max(axis=1)
    bound = np.repeat(absmax / qmax / 2, 64)[: x.size].reshape(shape)
    assert np.all(np.abs(x - y) <= bound * (1 + 1e-6) + 1e-12)


@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("size", [1, 63, 64, 1001])
def test_payload_bytes_are_exact(kind, size):
    q = quantize(rng.normal(size=size).astype(np.float32), kind, block_size=64)
    blocks = -(-size // 64)
    expected = {"fp32": 4 * size, "bf16": 2 * size, "int8": size + 4 * blocks,
                "int4": (size + 1) // 2 + 4 * blocks}[kind]  # fmt: skip
    assert q.nbytes == expected == payload_bytes(size, kind, 64)


def test_int4_packs_two_values_per_byte():
    x = np.array([7.0, -7.0, 1.0, 0.0], np.float32)  # absmax 7 -> scale 1, codes exact
    q = quantize(x, "int4", block_size=4)
    assert q.data.dtype == np.uint8 and q.data.size == 2
    # codes + 8: [15, 1, 9, 8]; low nibble first
    assert q.data.tolist() == [15 | (1 << 4), 9 | (8 << 4)]
    np.testing.assert_array_equal(dequantize(q), x)


def test_fp32_exact_and_bf16_matches_ml_dtypes():
    x = rng.normal(size=(17, 3)).astype(np.float32)
    np.testing.assert_array_equal(dequantize(quantize(x, "fp32")), x)
    expected = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(dequantize(quantize(x, "bf16")), expected)
    assert quantize(x, "bf16").data.dtype == np.uint16


def test_zero_block_round_trips():
    np.testing.assert_array_equal(dequantize(quantize(np.zeros(200, np.float32), "int4")), 0)


def test_unknown_kind_and_odd_int4_block_rejected():
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize(np.ones(3), "int2")
    with pytest.raises(ValueError, match="even block"):
        quantize(np.ones(3), "int4", block_size=3)


def test_error_feedback_carries_residual():
    x = rng.normal(size=256).astype(np.float32)
    q1, r1 = quantize_with_feedback(x, None, "int4", 64)
    np.testing.assert_allclose(r1, x - dequantize(q1), rtol=1e-6)
    q2, r2 = quantize_with_feedback(x, r1, "int4", 64)
    np.testing.assert_allclose(r2, x + r1 - dequantize(q2), rtol=1e-6)
    # Sending the same value twice: the sum of what was sent tracks 2x better than without EF.
    sent = dequantize(q1) + dequantize(q2)
    without = 2 * dequantize(quantize(x, "int4", 64))
    assert np.abs(sent - 2 * x).sum() < np.abs(without - 2 * x).sum()


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("size", [0, 1, 127, 128, 129, 1000, 4096])
def test_dequantize_is_each_code_times_its_blocks_scale_bit_for_bit(kind, size):
    """Every value is its code (int4: its nibble less 8) times its block's scale, one
    float32 product, the short last block included; a payload with fewer scales than its
    blocks is refused, naming the counts."""
    from protocol.quantize import QuantizedTensor

    rng = np.random.default_rng(size)
    x = (rng.standard_normal(size) * 3).astype(np.float32)
    q = quantize(x, kind, 64)
    if kind == "int8":
        codes = q.data.astype(np.int64)
    else:
        nibbles = np.stack([q.data & 0x0F, q.data >> 4], axis=1).reshape(-1)[:size]
        codes = nibbles.astype(np.int64) - 8
    want = np.array([np.float32(c) * q.scales[i // 64] for i, c in enumerate(codes)],
                    np.float32)  # fmt: skip
    assert dequantize(q).tobytes() == want.tobytes()
    if size:
        short = QuantizedTensor(kind, q.shape, q.data, q.scales[:-1], 64)
        with pytest.raises(ValueError, match=rf"scales for {size} values in blocks of 64"):
            dequantize(short)
