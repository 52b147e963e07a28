"""Dequantizing a piece (8 Mi values, blocks of 128) of an int8 or int4 contribution,
as the syncer's scan and merge do for each contribution: ``protocol.quantize.dequantize``
(each block's codes times its scale, in place) against the rule before 7c6d936 (the
scales repeated to every value, then one product), which it must equal bit for bit.

    python bench/scale/dequantize.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from protocol.quantize import QuantizedTensor, dequantize, quantize

VALUES, BLOCK, PASSES = 8 << 20, 128, 20


def repeated_scales(q: QuantizedTensor) -> np.ndarray:
    """The rule before: codes as float32, the scales repeated to each value, a product."""
    n = q.size
    if q.kind == "int8":
        codes = q.data.astype(np.float32)
    else:
        codes = np.empty(q.data.size * 2, dtype=np.float32)
        codes[0::2] = (q.data & 0x0F).astype(np.float32) - 8
        codes[1::2] = (q.data >> 4).astype(np.float32) - 8
        codes = codes[:n]
    return (codes * np.repeat(q.scales, q.block_size)[:n]).reshape(q.shape)


def best(f, q: QuantizedTensor) -> float:
    times = []
    for _ in range(PASSES):
        start = time.perf_counter()
        f(q)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    x = np.random.default_rng(0).standard_normal(VALUES, np.float32)
    for kind in ("int8", "int4"):
        q = quantize(x, kind, BLOCK)
        if dequantize(q).tobytes() != repeated_scales(q).tobytes():
            raise SystemExit(f"{kind}: the two rules differ")
        before, after = best(repeated_scales, q), best(dequantize, q)
        print(f"{kind}: {1e3 * before:.1f} ms -> {1e3 * after:.1f} ms a piece "
              f"(best of {PASSES}; the same bits)")  # fmt: skip


if __name__ == "__main__":
    main()
