"""The simulator through buckets, and `diloco inspect` on what it wrote."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.config import load_config
from diloco.simulate import simulate
from flows.run import simulation_store
from storage_layout.inspect import inspect_bucket

# (on slots, named: in memory text is dealt to them, through buckets taken in units)
OVER = ["budget.tokens=48000", "sim.eval_points=2", "data.assign=slots"]


@pytest.fixture(scope="module")
def in_process():
    return simulate(load_config("tiny", overrides=OVER))


@pytest.mark.parametrize("backend", ["memory", "file", "s3", "gcs"])
def test_same_results_through_storage(backend, make_bucket, in_process):
    regions = {"us": make_bucket(backend), "eu": make_bucket(backend)}
    stored = simulate(load_config("tiny", overrides=OVER), store=simulation_store("run", regions))
    assert json.dumps(stored.metrics, sort_keys=True) == json.dumps(
        in_process.metrics, sort_keys=True
    )
    report = inspect_bucket(regions["us"], verify=True)
    (run,) = report["runs"]
    assert run["problems"] == [] and run["verified_versions"] > 0
    versions = [m for m in stored.metrics if m["event"] == "version"]
    newest = {m["fragment"]: m["version"] for m in versions}
    assert {f["fragment"]: f["newest"] for f in run["fragments"]} == newest
    assert all(
        f["versions"] == {"us": newest[f["fragment"]], "eu": newest[f["fragment"]]}
        for f in run["fragments"]
    )
    assert sorted(r["learner"] for r in run["learners"]) == [f"learner-{i}" for i in range(4)]
    assert {r["learner"]: r["region"] for r in run["learners"]}["learner-1"] == "eu"
    assert run["traffic"]["eu->us"]["bytes"] > 0  # the syncer (us) read eu's learners


def test_inspect_cli_json_and_verify_fails_on_a_flipped_byte(tmp_path):
    env_bin = [sys.executable, "-m", "flows.cli"]
    store = tmp_path / "bucket"
    args = ["--quiet", "--store", str(store), "--run", "demo", "--out", str(tmp_path / "out")]
    args += ["--set", "budget.tokens=32000", "--set", "sim.eval_points=2"]
    sim = subprocess.run([*env_bin, "simulate", *args], capture_output=True, text=True, timeout=300)
    assert sim.returncode == 0, sim.stderr
    ok = subprocess.run(
        [*env_bin, "inspect", str(store), "--json", "--verify"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    (run,) = json.loads(ok.stdout)["runs"]
    assert run["run"] == "demo" and len(run["learners"]) == 4 and run["verified_versions"] > 0
    # A metadata object: readers use the copy inlined in the marker, --verify the stored one.
    chunk = next(p for p in sorted(Path(store).rglob("zarr.json")) if "/globals/" in str(p))
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0xFF
    chunk.write_bytes(bytes(data))
    bad = subprocess.run(
        [*env_bin, "inspect", str(store), "--verify"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 1 and "does not match its sha256" in bad.stdout
    again = subprocess.run(
        [*env_bin, "simulate", *args], capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 2 and "already holds global versions" in again.stderr


def test_an_outer_adam_resumes_its_step_count_from_the_bucket(tmp_path):
    """With ``outer.optimizer = "adam"`` a syncer that reloads a fragment from its bucket
    (every merge through a bucket store does) takes up Adam's moments and step count
    where the stored version left them: the same run in memory and through a bucket, and
    each version records its fragment's outer steps."""
    over = [*OVER, "outer.optimizer=adam", "outer.lr=0.001"]
    memory = simulate(load_config("tiny", overrides=over))
    (tmp_path / "us").mkdir()
    stored = simulate(load_config("tiny", overrides=over),
                      store=simulation_store("adam", {"us": f"file://{tmp_path / 'us'}"}))  # fmt: skip
    assert json.dumps(stored.metrics, sort_keys=True) == json.dumps(memory.metrics, sort_keys=True)
    versions = [m for m in stored.metrics if m["event"] == "version"]
    assert versions and all(m["outer_steps"] == m["version"] for m in versions)
    assert stored.summary["final_loss"] < stored.summary["initial_loss"]
