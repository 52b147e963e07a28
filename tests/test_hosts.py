"""One learner over several processes (``diloco.hosts``, ``flows.hosts``): real
processes joined by ``jax.distributed`` on loopback, each with its own CPU devices
(``--xla_force_host_platform_device_count``), over a real file:// bucket.

- 2 processes x 2 devices (replicated, sharded within each, FSDP across both) train what
  1 process x 1 device does: the same contributions, to float tolerance; started again,
  it restores its checkpoint, and that checkpoint restores on fewer devices too;
- `diloco train` with ``pipeline.learner_processes=2``: one of a learner's processes
  killed once its first contribution is committed restarts the whole learner, which
  rejoins and trains on as one learner (one id, no seq reused, one generation per start).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from diloco.config import load_config
from flows.hosts import run_group
from flows.run import initialize_run
from protocol.quantize import dequantize
from protocol.topology import run_slots
from storage_layout.audit import audit_run
from storage_layout.commit import read_marker
from storage_layout.inspect import inspect_bucket
from storage_layout.store import RunStore
from tests.test_pipeline import group_members

STEPS = 8  # inner steps of the learner: fragments 0 and 1 are sent in turn, then 0 again
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
import json, os, sys
from flows.hosts import join
join()  # before any JAX computation
if os.environ.get("NO_GATHER"):  # every process holds every tensor: to_host gathers none
    from jax.experimental import multihost_utils
    gather = multihost_utils.process_allgather
    def refused(*args, **kwargs):
        if sys._getframe(1).f_code.co_name == "to_host":
            raise AssertionError("to_host gathered a tensor across processes")
        return gather(*args, **kwargs)  # (JAX's own checks gather too)
    multihost_utils.process_allgather = refused
from flows.learner_runtime import LearnerRuntime
run, bucket, region, lid, pipeline = sys.argv[1:]
rt = LearnerRuntime(run, bucket, region, lid, json.loads(pipeline))
while not rt.finished:
    rt.train_round()
rt.checkpoint(wait=True)
rt.close()
"""


def _run(tmp_path: Path, name: str, fsdp: int = 1, units: str | None = None
         ) -> tuple[str, str, str, dict]:  # fmt: skip
    """A run of one learner; ``units``: a prepared data set it takes in units."""
    data = [f"data.source={units}", "model.vocab_size=512", "data.assign=units"] if units else []
    cfg = load_config("tiny", overrides=[*OVERRIDES, f"pipeline.fsdp={fsdp}", *data])
    (tmp_path / name).mkdir()
    bucket = f"file://{tmp_path / name}"
    spec = initialize_run(RunStore(name, {"us": bucket}, "us", writer="launcher"), cfg)
    (lid,) = run_slots(spec)
    return bucket, lid, cfg.pipeline.model_dump_json(), spec


def _env(devices: int) -> dict[str, str]:
    return {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
            "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.getcwd()}  # fmt: skip


def _contributions(name: str, bucket: str, lid: str) -> dict[tuple[int, int], dict]:
    store = RunStore(name, {"us": bucket}, "us")
    out = {}
    for p in range(2):
        for seq in store.contributions.contribution_seqs(lid, p, "us"):
            tensors, meta = store.contributions.get_contribution(lid, p, seq, "us")
            out[(p, seq)] = {n: np.asarray(dequantize(t), np.float32) for n, t in tensors.items()}
            out[(p, seq)]["step"] = meta["step"]
    return out


def _parts(name: str, bucket: str, lid: str) -> dict[str, int] | None:
    """The values each host's part of the newest checkpoint holds (None: not in parts)."""
    store = RunStore(name, {"us": bucket}, "us")
    key = store.layout.checkpoint_marker(lid, store.checkpoints.checkpoint_steps(lid)[-1])
    meta = read_marker(store.home, key).meta
    if "parts" not in meta:
        return None
    return {group: sum(int(np.prod([b - a for a, b in box["index"]])) for box in boxes.values())
            for group, boxes in meta["parts"].items()}  # fmt: skip


def _takes(name: str, bucket: str, lid: str) -> list:
    """The spans the learner's data ledger records it took, in order."""
    store = RunStore(name, {"us": bucket}, "us")
    return [r["take"] for _, r in store.units.unit_records(lid) if "take" in r]


class _Restored:
    def __init__(self, step: int, opt_state):
        import jax

        self.step = step
        self.leaves = [np.asarray(x) for x in jax.tree.leaves(opt_state)]


def _checkpoint(name: str, bucket: str, lid: str) -> _Restored:
    """The learner's newest checkpoint, restored on this process's devices."""
    from flows.run import bucket_store, build_model
    from flows.spec import config_from_spec

    spec = RunStore(name, {"us": bucket}, "us").read_spec()
    cfg = config_from_spec(spec)
    build_model(cfg)
    ckpt = bucket_store(name, {"us": bucket}, spec, cfg, lid, home="us").load_checkpoint(lid)
    return _Restored(ckpt.step, ckpt.opt_state)


@pytest.mark.slow
def test_a_learner_over_two_processes_sends_what_one_process_sends(tmp_path, monkeypatch):
    """The same run trained by one learner as 2 processes x 2 devices (parameters
    replicated; sharded over each process's 2 devices, replicated across processes, so
    that a tensor comes to the host from the process's own devices, never gathered
    across processes; and sharded over all 4 devices of both processes: FSDP across
    hosts) and 1 x 1 (one process over 4 devices is ``tests/test_sharded_learner.py``'s):
    every contribution (fragment, seq, step) is there in each, and its outer gradient
    agrees to 1e-6 absolute: float32 sums over a batch split differently between devices
    and processes differ in their last bits (1.2e-7 at most, seen), against outer
    gradients up to ~8e-3. Followers that trained on other data, or missed an update,
    would differ by far more. The data is taken in units (``data.assign = "units"``)
    small enough that the run takes several: process 0 takes them, the other process
    follows its records (``flows.ledger.FollowedLedger``), and every process reads the
    same stream."""
    from tests.test_units import prepare_stdlib

    (tmp_path / "data").mkdir()
    units = prepare_stdlib(tmp_path / "data", chunk_tokens=256)
    found, ckpts, parts, takes = {}, {}, {}, {}
    for processes, devices, fsdp in ((2, 2, 1), (2, 2, 2), (2, 2, 4), (1, 1, 1)):
        name = f"p{processes}d{devices}" + (f"f{fsdp}" if fsdp > 1 else "")
        bucket, lid, pipeline, _ = _run(tmp_path, name, fsdp, units)
        command = [sys.executable, "-c", DRIVER, name, bucket, "us", lid, pipeline]
        for key, value in _env(devices).items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("NO_GATHER", "1" if fsdp == 2 else "")
        assert run_group(command, processes) == 0, name
        if fsdp == 4:  # started again, each process restores its part (and it is done);
            # a replicated group restarts in the next test
            assert run_group(command, processes) == 0, name
            assert RunStore(name, {"us": bucket}, "us").members.newest_generation(lid) == 2
        found[name] = _contributions(name, bucket, lid)
        takes[name] = _takes(name, bucket, lid)
        ckpts[name] = _checkpoint(name, bucket, lid)
        parts[name] = _parts(name, bucket, lid)
    two, one = found["p2d2"], found["p1d1"]
    sharded, within = found["p2d2f4"], found["p2d2f2"]
    # Sent at steps 2, 4, 6, 8 in turn; at the end, fragment 0's steps since (seq 5). No
    # global answers them (no syncer), so a fragment's sends are cumulative from version
    # 0: an upload whose turn comes while a newer one of its fragment waits is skipped
    # (that one carries its steps), which the upload thread's pace decides. Every
    # variant holds each fragment's newest send, and those it has in common are compared.
    for variant in (two, one, sharded, within):
        assert {(0, 5), (1, 4)} <= set(variant) <= {(0, 1), (0, 3), (0, 5), (1, 2), (1, 4)}
    common = set(two) & set(one) & set(sharded) & set(within)
    largest = 0.0
    for key in common:
        for other in (one, sharded, within):
            assert other[key]["step"] == two[key]["step"]
            for n, value in two[key].items():
                if n != "step":
                    np.testing.assert_allclose(value, other[key][n], atol=1e-6, rtol=0)
                    largest = max(largest, float(np.abs(value).max()))
    assert largest > 1e-3  # they trained: the gradients are far above the tolerance
    # Each took the same spans, several, and recorded each once (process 0 only).
    assert len(takes["p1d1"]) > 2 and all(t == takes["p1d1"] for t in takes.values()), takes
    # The checkpoints written over 4 devices of 2 processes restore in this process,
    # on fewer devices, and hold one optimizer state.
    import jax

    assert jax.device_count() < 4
    assert {c.step for c in ckpts.values()} == {STEPS}
    for other in ("p1d1", "p2d2f4", "p2d2f2"):
        for a, b in zip(ckpts["p2d2"].leaves, ckpts[other].leaves, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4)
    # Over 2 processes each wrote its own part: with the state sharded over both, each
    # holds half of every sharded leaf; replicated, process 0 holds it all. One process
    # writes the whole state as one group.
    assert parts["p1d1"] is None
    assert set(parts["p2d2"]) == set(parts["p2d2f4"]) == {"opt.p0000", "opt.p0001"}
    assert parts["p2d2"]["opt.p0001"] == 0 < parts["p2d2"]["opt.p0000"]
    assert parts["p2d2f4"]["opt.p0000"] == pytest.approx(parts["p2d2f4"]["opt.p0001"], rel=0.05)
    # Committed as one checkpoint: every part's objects re-hash against its marker.
    report = inspect_bucket(f"file://{tmp_path / 'p2d2f4'}", run="p2d2f4", verify=True)
    assert report["runs"][0]["problems"] == [] and report["runs"][0]["verified_versions"] > 0


def _wait(predicate, what: str, proc: subprocess.Popen, timeout: float = 600):
    """``predicate()``'s first truthy value; fails if the run ends first. The timeout only
    guards against a hang: what is waited for is a point of the run's own progress."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before {what}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_a_learner_of_two_processes_restarts_as_a_whole_when_one_is_killed(prefect_api, tmp_path):
    """`diloco train` with one learner of 2 processes x 2 CPU devices. Once its first
    contribution is committed, its process 1 (not the one that writes) is SIGKILLed: the
    group stops its other process, the launcher restarts the learner as a whole, and it
    rejoins and trains its budget. The syncers saw one learner: contributions under one
    id only, every seq once, two generations (the first start and the restart), and a
    clean audit."""
    run, steps = "hosts", 60
    bucket = f"file://{tmp_path / 'us'}"
    argv = [sys.executable, "-m", "flows.cli", "train", "--dir", str(tmp_path), "--run", run,
            "--tokens", str(steps * 8 * 64), "--create-buckets", f"--region=us={bucket}"]  # fmt: skip
    argv += [f"--set={o}" for o in ("topology.learners=1", "topology.inner_steps=4",
             "pipeline.learner_processes=2", "pipeline.syncer_shards=1",
             "pipeline.round_steps=20", "pipeline.checkpoint_every=20",
             "pipeline.poll_seconds=0.05", "pipeline.eval_seconds=5",
             "pipeline.keep_versions=1000")]  # fmt: skip
    log = (tmp_path / "train.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=_env(2))
    store = RunStore(run, {"us": bucket}, "us")
    try:

        def first_send():
            try:
                (lid,) = run_slots(store.read_spec())
            except (OSError, ValueError):
                return None
            if not any(store.contributions.contribution_seqs(lid, p, "us") for p in range(2)):
                return None
            text = (tmp_path / "train.log").read_text(errors="replace")
            groups = re.findall(r"learner us/0 started \(pid (\d+)", text)
            members = group_members(int(groups[-1])) if groups else {}
            return (lid, members[1]) if 1 in members else None

        lid, pid = _wait(first_send, "the learner's first committed contribution", proc)
        step = (store.progress.read_metrics(lid) or {}).get("step", 0)
        # Early, so that the restarted learner still has work: a kill later than a quarter
        # of the budget would not show that it trains on.
        assert step < steps / 4, f"the learner was at step {step} of {steps} at its first send"
        sent_before_kill = max(
            s for p in range(2) for s in store.contributions.contribution_seqs(lid, p, "us")
        )
        os.kill(pid, signal.SIGKILL)
        code = proc.wait(timeout=900)  # a guard against a hang, not a measure
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=90)
        log.close()
    output = (tmp_path / "train.log").read_text(errors="replace")
    assert code == 0, output[-3000:]
    assert "learner us/0 was killed" in output  # the group ended as its member did
    assert store.members.newest_generation(lid) == 2  # one claim per start of the group
    assert (
        store.progress.read_metrics(lid)["state"] == "done"
        and store.progress.read_metrics(lid)["step"] >= steps
    )
    learners = sorted(p.name for p in (tmp_path / "us" / run / "learners").iterdir())
    assert learners == [lid], learners  # one writer: no process wrote under another id
    # What the syncers merged (every version is kept): one learner's, each seq once,
    # and the restarted learner's too (its seqs after those of the killed group).
    consumed = [tuple(c[:2]) for p in range(2) for v in store.versions.global_versions(p, "us")
                for c in store.versions.global_marker(p, v).meta.get("consumed", [])]  # fmt: skip
    assert {who for who, _ in consumed} == {lid}, consumed
    seqs = [seq for _, seq in consumed]
    assert len(seqs) == len(set(seqs)) and max(seqs) > sent_before_kill, (seqs, sent_before_kill)
    report = audit_run(run, {"us": bucket})
    assert report.ok, dict(report.violations)
    summary = json.loads((tmp_path / run / "summary.json").read_text())
    assert summary["failed"] == [] and summary["learner_states"] == {lid: "done"}
