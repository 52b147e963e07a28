"""How long a learner's apply takes to place a held global version on its device: the
float32 values from their spill file (as before e48a362) against the bf16 wire's codes
from theirs, widened to float32 on the device (``diloco.learner.widen``), for 16
tensors of 8 Mi values. Prints seconds a pass and checks both give the same bits.

    TMPDIR=/dev/shm python bench/scale/apply.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from diloco.learner import widen
from storage_layout.spill import SpilledParams

SHAPE, COUNT, PASSES = (4096, 2048), 16, 3


def main() -> None:
    rng = np.random.default_rng(0)
    names = [f"t{i}" for i in range(COUNT)]
    codes = {n: rng.standard_normal(SHAPE, np.float32).astype(ml_dtypes.bfloat16) for n in names}
    folder = tempfile.mkdtemp()
    f32 = SpilledParams.write(
        f"{folder}/f32", [(n, c.astype(np.float32)) for n, c in codes.items()]
    )
    bf16 = SpilledParams.write(f"{folder}/bf16", codes.items())
    del codes
    device = jax.devices()[0]

    def float32_file() -> list[jax.Array]:
        return [jax.device_put(np.asarray(f32[n], np.float32), device) for n in names]

    def bf16_file() -> list[jax.Array]:
        return [widen(jax.device_put(bf16.exact(n), device)) for n in names]

    print(f"device {device.platform}: {device.device_kind}; {COUNT} x {SHAPE} values")
    for place, held in ((float32_file, f32), (bf16_file, bf16)):
        jax.block_until_ready(place())  # compiled, the file in the page cache
        times = []
        for _ in range(PASSES):
            start = time.perf_counter()
            jax.block_until_ready(place())
            times.append(time.perf_counter() - start)
        size = os.path.getsize(held.path) / 1e9
        print(f"{place.__name__}: {min(times):.3f} s (best of {PASSES}), file {size:.2f} GB")
    same = all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
               for a, b in zip(float32_file(), bf16_file(), strict=True))  # fmt: skip
    print("same bits:", same)
    f32.close()
    bf16.close()
    os.rmdir(folder)


if __name__ == "__main__":
    main()
