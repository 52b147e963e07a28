"""One learner over several processes (``diloco.hosts``, ``flows.hosts``): real
processes joined by ``jax.distributed`` on loopback, each with its own CPU devices
(``--xla_force_host_platform_device_count``), over a real file:// bucket.

- 2 processes x 2 devices train what 1 process x 4 devices and 1 x 1 do: the same
  contributions, to float tolerance;
- `diloco train` with ``pipeline.learner_processes=2``: one of a learner's processes
  killed once its first contribution is committed restarts the whole learner, which
  rejoins and trains on as one learner (one id, no seq reused, one generation per start).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from diloco.config import load_config
from diloco.quantize import dequantize
from flows.hosts import run_group
from flows.run import initialize_run
from storage_layout.store import RunStore

STEPS = 8  # inner steps of the learner: fragments 0 and 1 are sent 2 times each
OVERRIDES = [
    f"budget.tokens={STEPS * 8 * 64}",  # tiny: 8 sequences of 64 tokens a step
    "budget.shared=false",
    "topology.learners=1",
    "topology.inner_steps=4",
    "topology.quantization=fp32",  # the contributions compared as trained, not rounded
    "pipeline.round_steps=4",
    "pipeline.checkpoint_every=4",
    "pipeline.poll_seconds=0.05",
]

DRIVER = """
import json, sys
from flows.hosts import join
join()  # before any JAX computation
from flows.learner import LearnerRuntime
run, bucket, region, lid, pipeline = sys.argv[1:]
rt = LearnerRuntime(run, bucket, region, lid, json.loads(pipeline))
while not rt.finished:
    rt.train_round()
rt.checkpoint(wait=True)
rt.close()
"""


def _run(tmp_path: Path, name: str) -> tuple[str, str, str, dict]:
    cfg = load_config("tiny", overrides=OVERRIDES)
    (tmp_path / name).mkdir()
    bucket = f"file://{tmp_path / name}"
    spec = initialize_run(RunStore(name, {"us": bucket}, "us", writer="launcher"), cfg)
    (lid,) = spec["learners"]
    return bucket, lid, cfg.pipeline.model_dump_json(), spec


def _env(devices: int) -> dict[str, str]:
    return {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
            "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.getcwd()}  # fmt: skip


def _contributions(name: str, bucket: str, lid: str) -> dict[tuple[int, int], dict]:
    store = RunStore(name, {"us": bucket}, "us")
    out = {}
    for p in range(2):
        for seq in store.contribution_seqs(lid, p, "us"):
            tensors, meta = store.get_contribution(lid, p, seq, "us")
            out[(p, seq)] = {n: np.asarray(dequantize(t), np.float32) for n, t in tensors.items()}
            out[(p, seq)]["step"] = meta["step"]
    return out


@pytest.mark.slow
def test_a_learner_over_two_processes_sends_what_one_process_sends(tmp_path, monkeypatch):
    """The same run trained by one learner as 2 processes x 2 devices, 1 x 4 and 1 x 1:
    every contribution (fragment, seq, step) is there in each, and its outer gradient
    agrees to 1e-6 absolute: float32 sums over a batch split differently between devices
    and processes differ in their last bits (1.2e-7 at most, seen), against outer
    gradients up to ~8e-3. Followers that trained on other data, or missed an update,
    would differ by far more."""
    found = {}
    for processes, devices in ((2, 2), (1, 4), (1, 1)):
        name = f"p{processes}d{devices}"
        bucket, lid, pipeline, _ = _run(tmp_path, name)
        command = [sys.executable, "-c", DRIVER, name, bucket, "us", lid, pipeline]
        for key, value in _env(devices).items():
            monkeypatch.setenv(key, value)
        assert run_group(command, processes) == 0, name
        found[name] = _contributions(name, bucket, lid)
    two, four, one = found["p2d2"], found["p1d4"], found["p1d1"]
    assert sorted(two) == sorted(four) == sorted(one) == [(0, 1), (0, 3), (1, 2), (1, 4)]
    largest = 0.0
    for key in two:
        for other in (four, one):
            assert other[key]["step"] == two[key]["step"]
            for n, value in two[key].items():
                if n != "step":
                    np.testing.assert_allclose(value, other[key][n], atol=1e-6, rtol=0)
                    largest = max(largest, float(np.abs(value).max()))
    assert largest > 1e-3  # they trained: the gradients are far above the tolerance
