"""``bench/gpu_run``'s CPU path (the tiny preset, a little text): the one call a lent
GPU runs, prepared and tested here. It prepares a BPE data set, trains decoupled through
``diloco train`` and data-parallel through ``diloco simulate``, and writes one table."""

import json
import math

import pytest

from bench.gpu_run.run import main, table


@pytest.mark.slow
def test_the_gpu_run_on_cpus_writes_its_table(tmp_path, prefect_api):
    assert main(["--cpu", "--learners", "2", "--out", str(tmp_path), "--minutes", "9"]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["cut"] == [] and result["device"] == "CPU"
    train, dp = result["train"], result["dp"]
    assert train["tokens"] > 0 and dp["tokens"] >= result["tokens"]
    assert math.isfinite(result["loss_ratio"]) and 0.5 < result["loss_ratio"] < 2.0, result
    assert set(train["learner_tokens_per_s"]) == {"learner-0", "learner-1"}
    assert all(rate > 0 for rate in train["learner_tokens_per_s"].values())
    assert train["bandwidth_ratio_vs_dp"] > 1 and 0 < train["goodput"] <= 1
    assert train["mfu"] is None and train["peak_device_bytes"] is None  # no datasheet, no GPU
    text = (tmp_path / "results.md").read_text()
    assert text == table(result) and f"| decoupled / dp loss | {result['loss_ratio']:.4f} |" in text


def test_a_run_cut_short_keeps_what_it_measured_and_says_so():
    result = {"device": "NVIDIA H100 80GB HBM3", "command": "c", "machine": "m",
              "preset": "llama-150m", "overrides": [], "learners": 4, "minutes": 9.0,
              "train": {"final_loss": 3.2, "tokens": 1000, "params": 10},
              "cut": ["dp (timed out)"]}  # fmt: skip
    text = table(result)
    assert "| validation loss | 3.2000 | - |" in text
    assert "Cut short: dp (timed out) (at --minutes 9)." in text
