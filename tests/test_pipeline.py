"""End-to-end: learners and syncers as real processes, a real Prefect API (the test
harness's server), real buckets (moto S3, fake-gcs-server, local disk).

- a two-region run on S3 + GCS under process chaos and storage faults: the loss falls,
  every committed version verifies, the audit is clean, and the Prefect UI reads like the
  run (flow runs, task runs, tags, artifacts);
- `diloco train` on a prepared data set, with a learner SIGKILLed mid-run (Prefect
  retries it; it rejoins from its checkpoint while the others go on, and takes no data
  twice) and a syncer SIGKILLed and restarted (no contribution lost or merged twice);
- a duplicate syncer fenced off by the commit protocol; bad input refused up front.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import fsspec
import httpx
import numpy as np
import pytest

from diloco.config import CostConfig, LivenessConfig, load_config
from diloco.cost import bill
from diloco.liveness import Liveness
from diloco.outer import Contribution
from diloco.records import version_id
from diloco.tensors import materialize
from diloco.transport import StoreLearnerView
from flows import syncer_buckets, workers
from flows.cli import main as cli_main
from flows.hosts import PROCESS_ID_ENV
from flows.launch_processes import Processes
from flows.learner_buckets import SEQ_BLOCK, contribution_meta
from flows.monitor import Monitor, cross_region_bytes
from flows.notice import NOTICE_ENV
from flows.process import WorkerProcess, this_process, worker_process
from flows.run import Run, bucket_store, build_model, initialize_run
from flows.spares import WORKER_COMMAND, Spares
from flows.spec import config_from_spec
from flows.supervision import child_env, give_up
from flows.syncer import SyncerRuntime
from flows.watch import startup_line, watch
from infra.chaos import read_actions
from infra.local_servers import LocalMetadata
from protocol.quantize import quantize
from protocol.topology import learner_index, run_slots
from storage_layout.audit import audit_run
from storage_layout.auth import RUN_SECRET_ENV, claims_key, learner_key, sign_record
from storage_layout.commit import read_marker
from storage_layout.faults import ENV_VAR as FAULTS_ENV
from storage_layout.faults import Injector
from storage_layout.inspect import inspect_bucket
from storage_layout.members import SeqNotReserved
from storage_layout.store import RunStore
from tests.iam import writes_outside_policy
from tests.prefect_runs import subflow_of

PIPELINE = {
    "round_steps": 20,
    "rounds_per_flow_run": 3,  # several flow runs per learner: resuming is the normal path
    "checkpoint_every": 20,
    "poll_seconds": 0.1,
    "eval_seconds": 5.0,
    "syncer_shards": 2,
}


def tiny(tokens: int, **top):
    overrides = [f"budget.tokens={tokens}"] + [f"pipeline.{k}={v}" for k, v in PIPELINE.items()]
    return load_config("tiny", overrides=overrides, **top)


def _new(fs_name: str) -> str:
    name = f"e2e-{uuid.uuid4().hex[:10]}"
    fsspec.filesystem(fs_name).mkdir(name)
    return name


def _started_after(log: str, line: str, when: float) -> bool:
    """Whether ``log`` (Prefect's ``HH:MM:SS.mmm | ...`` lines, this machine's time) has
    ``line`` logged after Unix time ``when``: a worker killed then started again (killed
    on a busy machine before its first start, it has that line only once)."""
    after = dt.datetime.fromtimestamp(when).strftime("%H:%M:%S.%f")[:-3]
    return any(row[:12] >= after for row in log.splitlines() if line in row)


@pytest.mark.slow
def test_a_two_region_run_on_s3_and_gcs_under_chaos(prefect_api, s3_server, gcs_server, tmp_path,
                                                    monkeypatch):  # fmt: skip
    """A short run over S3 and GCS under process chaos (kills, a pause) and injected
    storage faults (errors, lost responses, damaged reads, stale listings, a learner dying
    mid-write): every learner finishes, the loss falls, both directions crossed regions,
    every committed version verifies, the audit finds nothing lost and nothing counted
    twice, and the Prefect UI reads like the run (flow runs, task runs, tags, artifacts).
    The chaos follows the run's progress, not the clock: each action is taken at its share
    of the run's inner steps, however fast the machine."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterTags,
        TaskRunFilter,
        TaskRunFilterName,
    )
    from prefect.client.schemas.sorting import FlowRunSort, TaskRunSort

    from flows.launcher import train_flow
    from storage_layout.audit import audit_run
    from storage_layout.history import learner_rounds

    regions = {"us-east": f"s3://{_new('s3')}", "eu-west": f"gs://{_new('gs')}"}
    run = f"chaos-{uuid.uuid4().hex[:6]}"
    chaos = {
        "seed": 3,
        "learner_kill_at": [0.1],  # once some learners have trained a round
        "syncer_kill_at": [0.3],
        "pause_at": [0.45],
        "pause_seconds": 5.0,
    }
    faults = {
        "seed": 3,
        "error_rate": 0.02,
        "timeout_after_rate": 0.02,
        "truncate_rate": 0.01,
        "corrupt_rate": 0.01,
        "stale_list_rate": 0.05,
        "crash_rate": 0.01,
    }
    trace = tmp_path / "trace.jsonl"  # every request each process makes, the launcher's too
    faults["trace_path"] = str(trace)
    cfg = tiny(160_000)
    cfg = cfg.model_copy(update={"pipeline": cfg.pipeline.model_copy(
        update={"chaos": chaos, "faults": faults})})  # fmt: skip
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"trace_path": str(trace)}))  # the launcher's
    summary = train_flow(run, regions, cfg.model_dump(mode="json"), str(tmp_path / "logs"))

    assert summary["failed"] == [], summary["failed"]
    assert set(summary["learner_states"].values()) == {"done"}, summary["learner_states"]
    chaos = summary["chaos"]
    assert chaos["missed"] == [], chaos
    assert chaos["actions"] == {"kill_learner": 1, "kill_syncer": 1, "pause_learner": 1,
                                "resume_learner": 1}, chaos  # fmt: skip
    # What the driver did happened to the workers: the killed ones started again, the
    # paused one was resumed.
    actions = {a["action"]: a for a in read_actions(tmp_path / "chaos.jsonl")}
    learners = run_slots(RunStore(run, regions, "us-east").read_spec())
    killed = actions["kill_learner"]["worker"]
    name = f"learner-{learners[killed]}-{killed.removeprefix('learner-')}"
    log = (tmp_path / "logs" / f"{name}.log").read_text()
    assert log.count("resumes from") >= 2, log[-3000:]
    shard = actions["kill_syncer"]["worker"].removeprefix("syncer-")
    log = (tmp_path / "logs" / f"syncer-us-east-{shard}.log").read_text()
    assert _started_after(log, "resumes at versions", actions["kill_syncer"]["time"]), log[-3000:]
    paused, resumed = actions["pause_learner"], actions["resume_learner"]
    assert (paused["worker"], paused["pid"]) == (resumed["worker"], resumed["pid"])
    assert resumed["time"] > paused["time"] + 4.5  # its pause_seconds (5), or the run waits
    # The storage misbehaved: the requests follow the work (uploads, reads, publishes),
    # about 2,000 of them, so at these rates dozens of faults whatever the speed.
    assert sum(chaos["faults"].values()) >= 10, chaos
    report = audit_run(run, regions)
    assert report.ok, dict(report.violations)
    assert report.outcomes["lost"] == 0 and report.outcomes["merged"] > 0
    assert summary["final_loss"] < summary["initial_loss"] - 0.5, summary["curve"]
    # Each write and delete of every process is one its role's bucket policy grants
    # (infra/terraform/main.tf: deployable for real without a denied request).
    outside, roles = writes_outside_policy(trace, run)
    assert roles == {"learner", "syncer", "launcher"} and outside == [], (roles, outside)
    versions = summary["versions"]
    assert min(versions.values()) >= 1 and sum(versions.values()) > len(versions), versions
    shares = summary["time_breakdown"]  # summed over the learners' several flow runs
    assert shares["start-up"] > 0 and shares["kept"] > 0, shares
    assert sum(shares.values()) == pytest.approx(1.0), shares
    assert shares["kept"] == pytest.approx(summary["goodput"])
    assert {"us-east->eu-west", "eu-west->us-east"} <= set(summary["traffic"])
    # What it cost at the default prices: its bytes between the two regions and every
    # request; less than data-parallel's egress for the same tokens would have.
    cost = summary["cost"]
    assert cost == {**bill(summary["traffic"], CostConfig()).as_dict(), **{
        k: cost[k] for k in ("projected", "dp_cross_region_bytes", "dp_egress")}}  # fmt: skip
    assert cost["egress"] > 0 and cost["pairs"]["us-east->eu-west"] > 0
    assert 0 < cost["egress"] < cost["dp_egress"], cost
    for url in regions.values():
        report = inspect_bucket(url, run=run, verify=True)
        (r,) = report["runs"]
        assert r["problems"] == [], r["problems"]
        assert r["verified_versions"] > 0
    store = RunStore(run, regions, "us-east")
    labels = {lid: f"learner {reg}/{learner_index(lid)}"
              for lid, reg in run_slots(store.read_spec()).items()}  # fmt: skip
    rounds = learner_rounds(store).rounds
    spared = [lid for lid in rounds if lid != killed]
    busiest = max(spared, key=lambda lid: len(rounds[lid]))
    with get_client(sync_client=True) as client:
        flows = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"run:{run}"])),
            sort=FlowRunSort.START_TIME_ASC,
            limit=200,
        )
        names = {f.name for f in flows}
        assert {"learner us-east/0", "learner eu-west/1", "syncer us-east/0"} <= names
        tags = {t for f in flows for t in f.tags}
        assert {"region:us-east", "region:eu-west", "learner:3"} <= tags
        # every learner and syncer flow run is a subflow of the launcher's, under the task
        # run that started its process (tests/test_deploy.py: launched as deployments)
        (launcher,) = [f for f in flows if "launcher" in f.tags]
        assert {f"run:{run}", "launcher", "via:processes"} <= set(launcher.tags), launcher.tags
        for child in flows:
            if child.id != launcher.id:
                subflow_of(client, child, launcher.id, "start")
        # A worker that died (killed, or crashed by a storage fault) could not end its
        # flow run: its launcher did, Crashed with why, and a flow run of that name
        # completed after it.
        left = [(f.name, f.state) for f in flows if not f.state.is_final()]
        assert left == [], left
        assert any(f.name == labels[killed] and f.state.is_crashed()
                   and "ended: killed by" in f.state.message for f in flows), flows  # fmt: skip
        unfinished = [(f.name, f.state) for f in flows if not f.state.is_completed() and not any(
            g.name == f.name and g.state.is_completed()
            and (f.start_time is None or g.start_time > f.start_time)
            for g in flows)]  # fmt: skip
        assert unfinished == [], unfinished
        # Bounded flow runs, 3 rounds each: the learner not killed that trained the most
        # rounds (at least its even share of the budget, 4 rounds) had at least two.
        # (Which one it is depends on the machine: one that starts late may find the
        # budget spent.)
        for lid, rows in rounds.items():
            mine = [f for f in flows if f.name == labels[lid]]
            assert len(mine) >= -(-len(rows) // PIPELINE["rounds_per_flow_run"]), (lid, mine)
        assert len(rounds[busiest]) >= 4, rounds
        for name in (f"{labels[busiest]} round 1", "syncer us-east/1 f1 v1"):
            found = client.read_task_runs(
                task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=[name])),
                sort=TaskRunSort.EXPECTED_START_TIME_ASC,
                limit=10,
            )
            # (a worker killed mid-task leaves that one running: its successor's completes)
            assert any(t.state.is_completed() for t in found), (name, found)
    # The client's artifact query sends None for fields this server requires: ask the REST
    # API directly.
    # learners, versions, curve: the live tables, updated during the run
    kinds = (f"{busiest}-rounds", "syncer-1-versions", "summary", "progress", "learners")
    kinds += ("versions", "curve", "workers")
    expected = {f"{run}-{k}" for k in kinds}
    body = {"artifacts": {"key": {"any_": sorted(expected)}}, "limit": 50, "offset": 0}
    body["sort"] = "KEY_ASC"
    artifacts = httpx.post(f"{prefect_api}/artifacts/filter", json=body).json()
    assert {a["key"] for a in artifacts} == expected
    table = next(a for a in artifacts if a["key"] == f"{run}-{busiest}-rounds")
    first = json.loads(table["data"])[0]
    columns = {
        "loss",
        "tokens",
        "steps",
        "step",
        "staleness",
        "merge_weight",
        "bytes_up",
        "bytes_down",
    }
    assert columns <= set(first)
    # one artifact per table, updated in place (a version each change was hundreds), its
    # data the end's; a learner's rounds: one per flow run, written round by round
    versions = {k: sum(a["key"] == k for a in artifacts) for k in expected}
    assert versions[f"{run}-learners"] == versions[f"{run}-curve"] == 1, versions
    learners = json.loads(next(a for a in artifacts if a["key"] == f"{run}-learners")["data"])
    assert {row["state"] for row in learners} == {"done"}, learners
    workers = json.loads(next(a for a in artifacts if a["key"] == f"{run}-workers")["data"])
    assert versions[f"{run}-workers"] == 1 and len(workers) == len(learners) + 2, workers
    assert {row["worker"] for row in workers} >= {"syncer us-east/0", "syncer us-east/1"}
    runs = len([f for f in flows if f.name == labels[busiest]])  # (a last one may train none)
    per_run = PIPELINE["rounds_per_flow_run"]
    assert -(-len(rounds[busiest]) // per_run) <= versions[f"{run}-{busiest}-rounds"] <= runs
    assert len(json.loads(table["data"])) <= per_run
    progress = next(a for a in artifacts if a["key"] == f"{run}-progress")
    assert re.search(r"us-east: 0 of \d learners training · eu-west: 0 of \d learners training",
                     progress["description"]), progress["description"]  # fmt: skip


def _workers(log: Path) -> dict[str, int]:
    """PID of each live worker process, by role ("learner 1", "syncer 0"), as the
    launcher's log names them ("learner eu-west/1 started (pid 1234, a spare)"): a worker
    that took a spare runs as ``flows.worker standby``, so its command line does not say."""
    out = {}
    text = log.read_text(errors="replace") if log.exists() else ""
    for role, index, pid in re.findall(r"(learner|syncer) [\w-]+/(\d+) started \(pid (\d+)", text):
        out[f"{role} {index}"] = int(pid)  # the newest start of each wins
    return {k: pid for k, pid in out.items() if _alive(pid)}


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX"
    except (OSError, IndexError):
        return False


def group_members(group: int) -> dict[int, int]:
    """The live processes of the learner group ``group`` (a ``flows.hosts`` pid), by
    their ``DILOCO_PROCESS_ID``."""
    out = {}
    try:
        children = Path(f"/proc/{group}/task/{group}/children").read_text().split()
    except OSError:
        return out
    for pid in map(int, children):
        if _alive(pid):
            with contextlib.suppress(OSError):
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                for entry in env:
                    if entry.startswith(f"{PROCESS_ID_ENV}=".encode()):
                        out[int(entry.split(b"=", 1)[1])] = pid
    return out


def _wait(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None):
    """``predicate()``'s first truthy value; fails if ``proc`` (the run) ends first. The
    timeout only guards against a hang: what is waited for is a point of the run's own
    progress, which comes however slow the machine."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended before {what}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def faulty_run(prefect_api, tmp_path_factory):
    """`diloco data prepare` on about 2 MB of text, then `diloco train` on its tokens
    over two file:// regions with the CPU Llama preset (llama-tiny, its vocabulary cut to
    the data set's 1024), the data taken in units (``data.assign = "units"``, each
    region's pool in its bucket). A learner and syncer shard 0 are SIGKILLed mid-run,
    each at a point of the run's own progress: the learner once it has a checkpoint and
    trains while another learner does too, before a quarter of the run's inner steps are
    done; the syncer once fragment 0 has a version newer than at that kill, before three
    quarters. Returns (run, regions, root, summary, events)."""
    from tests.test_dataset import STDLIB

    root = tmp_path_factory.mktemp("faulty")
    src = root / "text"
    for name in ("email", "logging", "json", "http", "xml", "asyncio"):
        for f in sorted((STDLIB / name).rglob("*.py")):
            (src / f.relative_to(STDLIB)).parent.mkdir(parents=True, exist_ok=True)
            (src / f.relative_to(STDLIB)).write_text(f.read_text())
    assert sum(f.stat().st_size for f in src.rglob("*.py")) > 1_500_000
    tokens = root / "tokens"
    assert cli_main(["data", "prepare", str(src), "--out", str(tokens), "--vocab-size", "1024",
                     "--chunk-tokens", "16384", "--quiet"]) == 0  # fmt: skip
    run = "faulty"
    regions = {r: f"file://{root / 'buckets' / r}" for r in ("us-east", "eu-west")}
    argv = [sys.executable, "-m", "flows.cli", "train", "--dir", str(root), "--run", run,
            "--tokens", "400000", "--create-buckets", "--preset", "llama-tiny",
            f"--set=data.source={tokens}", "--set=model.vocab_size=1024",
            "--set=topology.learners=2", "--set=data.assign=units",
            "--set=topology.keep_unsent=true"]  # fmt: skip
    argv += [f"--region={r}={u}" for r, u in regions.items()]
    argv += [f"--set=pipeline.{k}={v}" for k, v in PIPELINE.items()]
    # Every version is kept: the tests read each one's record (the audit, which reads
    # the ledger too, checks runs whose old versions are deleted).
    argv += ["--set=pipeline.keep_versions=1000"]
    log = (root / "train.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    store = RunStore(run, regions, "us-east")
    events = {}

    def statuses() -> tuple[dict[str, str], dict[str, dict], int] | None:
        """The learners' regions and status objects, and the run's inner steps in all
        (None before the run spec is written)."""
        try:
            spec = store.read_spec()
        except (OSError, ValueError):
            return None
        learners = run_slots(spec)
        status = {lid: store.progress.read_metrics(lid, reg) or {} for lid, reg in learners.items()}
        return learners, status, config_from_spec(spec).budget_steps

    syncer_log = root / run / "logs" / "syncer-us-east-0.log"
    held: list[int] = []  # learners stopped until syncer shard 0 is up

    def hold_learners_until_syncer_0_is_up() -> bool:
        """Syncer 0 may start late (a spare still warming up on a busy machine: 41 s
        once): the learners wait for it (SIGSTOP), or they could spend three quarters of
        the budget before fragment 0 has a version to kill it at. True once it is up."""
        if syncer_log.exists() and "owns fragments" in syncer_log.read_text(errors="replace"):
            while held:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(held.pop(), signal.SIGCONT)
            return True
        for k, p in _workers(root / "train.log").items():
            if k.startswith("learner") and p not in held:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGSTOP)
                    held.append(p)
        return False

    try:

        def learner_mid_run():
            seen = statuses()
            if seen is None or not hold_learners_until_syncer_0_is_up():
                return None
            learners, status, budget = seen
            training = {lid for lid, s in status.items() if s.get("state") == "training"}
            # Early (a quarter of the run), so that its next process still finds work when
            # it starts: killed later on a busy machine, the others may spend the shared
            # budget before it is back, and it trains no round to check.
            if len(training) < 2 or sum(s.get("step", 0) for s in status.values()) >= budget / 4:
                return None
            w = _workers(root / "train.log")
            for lid in sorted(training):
                pid = w.get(f"learner {learner_index(lid)}")
                steps = store.checkpoints.checkpoint_steps(lid, learners[lid])
                if pid and steps:
                    return lid, learners[lid], pid, steps[-1], status
            return None

        what = "a learner with a checkpoint training beside another before a quarter of the run"
        lid, region, pid, step, status = _wait(learner_mid_run, 420, what, proc)
        events["learner"], events["label"] = lid, f"{region}/{learner_index(lid)}"
        events["checkpoint_before_kill"] = step
        events["others_at_kill"] = {
            other: (s.get("state"), s.get("step", 0)) for other, s in status.items() if other != lid
        }
        v0 = store.versions.latest_global(0) or 0
        # The other learners wait (stopped) until the killed one is back, so that its next
        # process finds work to do however long a restart takes on this machine: tiny
        # learners can spend the rest of the budget before it is up.
        others = [p for k, p in _workers(root / "train.log").items()
                  if k.startswith("learner") and p != pid]  # fmt: skip
        for other in others:
            os.kill(other, signal.SIGSTOP)
        try:
            os.kill(pid, signal.SIGKILL)
            _wait(lambda: not _alive(pid), 60, f"{lid} to die")
            # The newest checkpoint the killed process left (its successor takes seconds
            # to start and a round to write one).
            events["checkpoint_at_kill"] = store.checkpoints.checkpoint_steps(lid, region)[-1]
            mine = RunStore(run, regions, region)
            _wait(
                lambda: mine.members.newest_generation(lid) >= 2, 420, f"{lid} to start again", proc
            )
        finally:
            for other in others:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(other, signal.SIGCONT)

        def syncer_mid_run():
            seen = statuses()
            pid = _workers(root / "train.log").get("syncer 0")
            if seen is None or not pid or (store.versions.latest_global(0) or 0) <= v0:
                return None
            _, status, budget = seen
            return pid if sum(s.get("step", 0) for s in status.values()) < 0.75 * budget else None

        what = "a newer version of fragment 0 before three quarters of the run"
        pid = _wait(syncer_mid_run, 420, what, proc)
        events["syncer_killed_at_version"] = store.versions.latest_global(0)
        os.kill(pid, signal.SIGKILL)
        code = proc.wait(timeout=900)  # a guard against a hang, not a measure
    finally:
        for p in held:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGCONT)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=90)
        log.close()
    output = (root / "train.log").read_text()
    assert code == 0, output[-3000:]
    summary = json.loads((root / run / "summary.json").read_text())
    return run, regions, root, summary, events


@pytest.mark.slow
def test_killed_learner_is_retried_and_rejoins_from_its_checkpoint(faulty_run):
    run, regions, root, summary, events = faulty_run
    assert summary["failed"] == []
    assert set(summary["learner_states"].values()) == {"done"}
    assert summary["final_loss"] < summary["initial_loss"] - 1.0
    label = events["label"]
    log = (root / run / "logs" / f"learner-{label.replace('/', '-')}.log").read_text()
    resumes = [line for line in log.splitlines() if "resumes from" in line]
    assert len(resumes) >= 2, resumes  # its first start, and its restart after the kill
    resumed = re.search(r"checkpoint at step (\d+) ", resumes[1])
    assert resumed, resumes
    # from the newest checkpoint the killed process had committed
    assert events["checkpoint_before_kill"] <= int(resumed[1]) <= events["checkpoint_at_kill"]
    # The others that were training kept training while it was down and restarting, and
    # the learners shared the budget: together they trained all of it (the killed one,
    # set back by its kill, less than its even share and the others more, or as much).
    # A learner still starting at the kill may have found the budget spent by the time
    # it could train (on a busy machine): it then trained nothing, and that is allowed.
    store = RunStore(run, regions, "us-east")
    spec = store.read_spec()
    cfg = config_from_spec(spec)
    final = {
        lid: (store.progress.read_metrics(lid, reg) or {})["step"]
        for lid, reg in run_slots(spec).items()
    }
    training = {k: step for k, (state, step) in events["others_at_kill"].items()
                if state == "training"}  # fmt: skip
    assert training, events["others_at_kill"]
    for other, before in training.items():
        assert before < final[other] <= cfg.learner_step_cap, (other, before, final)
    # (a little more: each learner ends once it sees the others' steps, a round trip late)
    assert cfg.budget_steps <= sum(final.values()) <= 1.15 * cfg.budget_steps, final
    train_log = (root / "train.log").read_text()
    assert f"'start learner {label}' - Task run failed" in train_log
    # Killed (not failed on its own): restarted at once, no crash loop counted; a SIGKILL
    # from outside, with the process's peak memory, not the OOM killer's.
    assert f"learner {label} was killed (learner {label} was killed by SIGKILL" in train_log
    assert "OOM killer" not in train_log
    assert f"learner {label} crashed" not in train_log


@pytest.mark.slow
def test_the_killed_learner_skips_no_data_and_repeats_none(faulty_run):
    """The run learned on its prepared tokens (validation loss 1.0 at least below about
    ln 1024 = 6.9), and the killed learner's restart read its slot's spans again: the
    audit finds each learner's merged data one run of its batches from 0
    (``topology.keep_unsent``: the steps after a send count towards the next one), no
    window merged from two learners, and no claim that no learner recorded: nothing merged
    twice (data-once), nothing skipped."""
    from flows.ledger_audit import audit_units

    run, regions, _, summary, _ = faulty_run
    assert summary["final_loss"] < summary["initial_loss"] - 1.0, summary["curve"]
    report = audit_run(run, regions)
    audit_units(report)
    assert report.ok, dict(report.violations)
    assert sorted(report.data) == sorted(run_slots(RunStore(run, regions, "us-east").read_spec()))
    for learner, spans in report.data.items():
        assert len(spans) == 1 and spans[0][0] == 0, (learner, spans)
    assert sorted(report.units) == sorted(regions), report.units  # a pool per region
    assert all(pool["orphan_claims"] == [] for pool in report.units.values()), report.units


@pytest.mark.slow
def test_the_killed_learners_history_and_its_curves_hold_every_round_once(faulty_run):
    """The history the killed learner kept in its bucket has every round from the first
    to the last, each once, across its kill (a newer generation after it); the launcher's
    TensorBoard folder has each of those rounds once, and the run's validation curve. A
    learner that never trained a round (it started after the budget was spent) has an
    empty history."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from storage_layout.history import learner_rounds

    run, regions, root, summary, events = faulty_run
    store = RunStore(run, regions, "us-east")
    history = learner_rounds(store)
    assert history.damaged == []
    assert set(history.rounds) == set(run_slots(store.read_spec()))
    for lid, rows in history.rounds.items():
        assert [r["round"] for r in rows] == list(range(1, len(rows) + 1)), lid
    cfg = config_from_spec(store.read_spec())
    assert sum(rows[-1]["step"] for rows in history.rounds.values() if rows) >= cfg.budget_steps
    killed = history.rounds[events["learner"]]
    assert len({r["generation"] for r in killed}) >= 2  # the kill is in the middle
    curves = EventAccumulator(str(root / run / "tensorboard" / events["learner"]))
    curves.Reload()
    assert [e.step for e in curves.Scalars("loss/train")] == [r["step"] for r in killed]
    validation = EventAccumulator(str(root / run / "tensorboard" / "global"))
    validation.Reload()
    steps = [e.step for e in validation.Scalars("loss/validation")]
    # every evaluation of the run once, at its tokens merged: from version 0 to the end
    assert steps == sorted({point["tokens"] for point in summary["curve"]}), steps
    assert steps[0] == 0 and len(steps) >= 2, steps


@pytest.mark.slow
def test_killed_syncer_restarts_without_losing_or_double_counting(faulty_run):
    run, regions, root, summary, events = faulty_run
    store = RunStore(run, regions, "us-east")
    assert summary["failed"] == []
    assert store.versions.latest_global(0) > events["syncer_killed_at_version"]  # it went on
    log = (root / run / "logs" / "syncer-us-east-0.log").read_text()
    assert log.count("owns fragments [0], resumes at versions") >= 2
    spec = store.read_spec()
    rejected = {
        (r["learner"], r["seq"])
        for r in (store.progress.read_metrics("syncer-0") or {})["rejected"]
    }
    for p in range(2):
        versions = store.versions.global_versions(p)
        assert versions == list(range(versions[-1] + 1))  # no gap, no overwrite
        metas = [store.versions.global_marker(p, v).meta for v in versions]
        consumed = [tuple(k) for m in metas for k in m["consumed"]]
        assert len(consumed) == len(set(consumed)), "a contribution was merged twice"
        final_cursor = metas[-1]["cursor"]
        for learner, region in run_slots(spec).items():
            bucket = store.bucket(region)
            by_base: dict[int, list[int]] = {}
            for seq in store.contributions.contribution_seqs(learner, p, region):
                key = store.layout.contribution_marker(learner, p, seq)
                by_base.setdefault(read_marker(bucket, key).meta["base_version"], []).append(seq)
            for base, seqs in by_base.items():
                # The newest contribution from each anchor carries all its work: it was
                # merged or rejected. Nothing is left pending: the end of a run merges it.
                newest = max(seqs)
                assert newest <= final_cursor.get(learner, 0), (p, learner, newest)
                assert (
                    (learner, newest) in consumed
                    or (learner, newest) in rejected
                    or any((learner, s) in consumed for s in seqs)
                ), (p, learner, base, seqs)


def _contribution(model, p: int, learner: str, seq: int, rng) -> Contribution:
    payload = {
        n: quantize(rng.normal(0, 1e-3, model.init[n].shape).astype(np.float32), "int4", 128)
        for n in model.plan[p]
    }
    return Contribution(learner, p, seq, 0, 512, 1, 0.1, payload, step=seq,
                        base_id=version_id(p, 0, []))  # fmt: skip


def _local_run(tmp_path: Path, run: str, only_region: str | None = None):
    """A tiny run on two file:// regions with one contribution of fragment 0 from every
    learner (of ``only_region`` if given). Returns (cfg, regions, model, learner ids)."""
    cfg = tiny(20_000)
    regions = {"us-east": f"file://{tmp_path / 'us'}", "eu-west": f"file://{tmp_path / 'eu'}"}
    for path in ("us", "eu"):
        (tmp_path / path).mkdir()
    store = RunStore(run, regions, "us-east")
    initialize_run(store, cfg)
    model = build_model(cfg)
    rng = np.random.default_rng(0)
    sent = []
    for lid, reg in run_slots(store.read_spec()).items():
        if only_region in (None, reg):
            writer = RunStore(run, regions, reg, writer=lid)
            c = _contribution(model, 0, lid, 1, rng)
            writer.contributions.put_contribution(lid, 0, 1, c.payload, contribution_meta(c))
            sent.append(lid)
    return cfg, regions, model, sent


def test_a_syncer_looks_at_a_learners_sends_at_the_pace_they_come(tmp_path):
    """Each look LISTs a learner's fragment: with rounds a minute long, looking every poll
    would pay for hundreds of LISTs per send. A pair whose sends came 100 s apart is
    looked at every 5 s (PACE_MOST; 1/20 of the gap, at most); one whose sends come
    under 20 s apart at every poll, as before; once every learner is done, every pair at
    every look. Its clock is the syncer's own (here, the test's)."""
    from flows.pace import PACE_MOST

    _, regions, model, sent = _local_run(tmp_path, "pace", only_region="us-east")
    lid = sent[0]
    transport = SyncerRuntime("pace", regions, "us-east", 0, 1, {}).transport
    now = [0.0]
    transport.clock = lambda: now[0]
    writer, rng = RunStore("pace", regions, "us-east", writer=lid), np.random.default_rng(1)

    def send(seq: int) -> None:
        c = _contribution(model, 0, lid, seq, rng)
        writer.contributions.put_contribution(lid, 0, seq, c.payload, contribution_meta(c))

    def look(at: float, after: int) -> list[int]:
        now[0] = at
        return [c.seq for c in transport.contributions(lid, 0, after)]

    assert look(0.0, 0) == [1]  # the first send
    assert look(0.2, 1) == []  # no gap known yet: looked at, at every poll
    assert transport.pace.looks == 2
    send(2)
    assert look(100.0, 1) == [2]  # 100 s after the first: the pair's pace is 5 s
    send(3)
    assert look(100.2, 2) == [] and look(100.0 + PACE_MOST - 0.1, 2) == []
    assert transport.pace.looks == 3  # neither of those listed
    assert look(100.0 + PACE_MOST, 2) == [3]  # seen 5 s late at most
    # Sends a round of 10 s apart (under 20 s): every poll again.
    send(4)
    assert look(110.0 + PACE_MOST, 3) == [4]
    lists = transport.pace.looks
    assert look(110.2 + PACE_MOST, 4) == [] and transport.pace.looks == lists + 1
    # The pace of 5 s again, then the run's end: every look lists.
    send(5)
    assert look(400.0, 4) == [5]
    send(6)
    for other, region in run_slots(RunStore("pace", regions, "us-east").read_spec()).items():
        RunStore("pace", regions, region, writer=other).progress.write_metrics(
            other, {"state": "done", "budget_tokens": 10**12})  # fmt: skip
    assert transport.learners_finished() and look(400.2, 5) == [6]


def test_a_syncer_reads_only_the_newest_send_of_each_anchor(tmp_path, monkeypatch):
    """Sends from one anchor are cumulative: the syncer reads the newest one's data and
    passes over the older ones unread (superseded: under a faulty store, reading each
    cost it its pace); when the newest is damaged, it is rejected and the one before it
    is read and merged instead."""
    cfg, regions, model, sent = _local_run(tmp_path, "newest", only_region="us-east")
    lid, rng = sent[0], np.random.default_rng(2)
    writer = RunStore("newest", regions, "us-east", writer=lid)
    for seq in (2, 3, 4):
        c = _contribution(model, 0, lid, seq, rng)
        writer.contributions.put_contribution(lid, 0, seq, c.payload, contribution_meta(c))
    for seq in (2, 4):  # both damaged: 4 is read (and rejected), 2 never is
        marker = read_marker(writer.home, writer.layout.contribution_marker(lid, 0, seq))
        obj = max(marker.objects, key=lambda k: marker.objects[k]["size"])
        path = tmp_path / "us" / marker.data_prefix / obj
        path.write_bytes(path.read_bytes()[:-3])
    read, real = [], syncer_buckets.scan_payload

    def counting(payload, block):  # every contribution read is scanned first
        learner, seq = re.search(r"learners/([^/]+)/.*/s(\d+)\.json$",
                                 payload.reader.marker_key).groups()  # fmt: skip
        read.append((learner, int(seq)))
        return real(payload, block)

    monkeypatch.setattr(syncer_buckets, "scan_payload", counting)
    syncer = SyncerRuntime("newest", regions, "us-east", 0, 2, cfg.pipeline.model_dump())
    assert syncer.poll() == len(sent)  # one per learner
    assert {seq for who, seq in read if who == lid} == {4, 3}  # never 1 or 2
    assert syncer.merge_and_publish(0)["merged"] == len(sent)
    meta = RunStore("newest", regions, "us-east").versions.global_marker(0, 1).meta
    assert [lid, 3] in meta["consumed"] and [lid, 4] in [r[:2] for r in meta["rejected"]]
    assert sorted(x for x in meta["superseded"] if x[0] == lid) == [[lid, 1, 3], [lid, 2, 3]]
    # The audit: seq 4's damage was found and refused; seq 2's reached no model (it was
    # never read), so it is named but breaks nothing.
    report = audit_run("newest", regions)
    assert report.ok, dict(report.violations)
    assert len(report.unread_damage) == 1 and "s000000000002" in report.unread_damage[0]


def test_launcher_evaluation_outlives_a_corrupt_newest_version(tmp_path, caplog):
    """The launcher evaluates the newest version that reads; a corrupt one is named once."""
    cfg, regions, _, _ = _local_run(tmp_path, "bad")
    syncer = SyncerRuntime("bad", regions, "us-east", 0, 2, cfg.pipeline.model_dump())
    syncer.poll()
    assert syncer.merge_and_publish(0)["version"] == 1
    store = RunStore("bad", regions, "us-east")
    marker = store.versions.global_marker(0, 1)
    obj = max(marker.objects, key=lambda k: marker.objects[k]["size"])
    path = tmp_path / "us" / marker.data_prefix / obj
    path.write_bytes(path.read_bytes()[:-3])  # truncated by a faulty disk
    monitor = Monitor(
        Run(store.run, store.urls, store.client_region, store.read_spec(), cfg), store
    )
    with caplog.at_level("ERROR"):
        point = monitor.evaluate(monitor.statuses())
        monitor.evaluate(monitor.statuses())
    assert point["versions"] == {0: 0, 1: 0} and np.isfinite(point["loss"])
    assert sum("fragment 0 version 1 is unreadable" in r.message for r in caplog.records) == 1


def test_a_corrupt_newest_version_at_home_does_not_stop_its_syncer(tmp_path, caplog):
    """Defect: a damaged object in the newest version at home (only home holds the master
    copy) stopped that fragment's syncer from loading, so the fragment froze. It goes on
    from the newest version that reads, numbers the next one above the damaged one, merges
    again what that one had merged, and records it as lost, so the audit stays clean."""
    cfg, regions, _, sent = _local_run(tmp_path, "lost")
    pipeline = cfg.pipeline.model_dump()
    syncer = SyncerRuntime("lost", regions, "us-east", 0, 2, pipeline)
    syncer.poll()
    assert syncer.merge_and_publish(0)["version"] == 1
    store = RunStore("lost", regions, "us-east")
    marker = store.versions.global_marker(0, 1)
    path = tmp_path / "us" / marker.data_prefix / max(marker.objects, key=lambda k: marker.objects[k]["size"])  # fmt: skip
    path.write_bytes(b"\0" + path.read_bytes()[1:])  # a bad sector
    with caplog.at_level("ERROR"):
        restarted = SyncerRuntime("lost", regions, "us-east", 0, 2, pipeline)
    assert any("versions [1] cannot be read" in r.message for r in caplog.records)
    assert restarted.poll() == len(sent)  # v1's merges, read again
    assert restarted.merge_and_publish(0)["version"] == 2
    meta = store.versions.global_marker(0, 2).meta
    assert meta["lost_versions"] == [1] and sorted(map(tuple, meta["consumed"])) == sorted(
        (lid, 1) for lid in sent
    )
    report = audit_run("lost", regions)
    assert report.ok, dict(report.violations)
    assert report.outcomes["merged"] == len(sent) and report.versions == 2 + 2  # f0 v0-2, f1 v0


def test_a_failed_publish_whose_reload_fails_too_leaves_no_gap(tmp_path):
    """Defect (bench/chaos): a publish failed, and so did the reload after it (a read of
    an older version); the syncer kept its half-merged state and published the next
    version on top of it: a version number skipped, and its merges recorded nowhere. The
    fragment now merges nothing until it has been read back."""
    cfg, regions, _, sent = _local_run(tmp_path, "gap")
    syncer = SyncerRuntime("gap", regions, "us-east", 0, 2, cfg.pipeline.model_dump())
    syncer.poll()
    transport = syncer.loop.transport
    publish, load = transport.publish, transport.load_fragment
    transport.publish = lambda *a: (_ for _ in ()).throw(OSError("the answer was lost"))
    transport.load_fragment = lambda *a: (_ for _ in ()).throw(OSError("region blinked"))
    with pytest.raises(OSError, match="region blinked"):
        syncer.merge_and_publish(0)
    assert 0 not in syncer.due(finishing=True)  # nothing to publish on top of
    transport.publish, transport.load_fragment = publish, load
    assert syncer.poll() == len(sent)  # read back, and the contributions again
    assert syncer.merge_and_publish(0)["version"] == 1
    meta = RunStore("gap", regions, "us-east").versions.global_marker(0, 1).meta
    assert sorted(map(tuple, meta["consumed"])) == sorted((lid, 1) for lid in sent)
    assert audit_run("gap", regions).ok


def test_progress_and_the_curve_never_go_back_and_a_resume_keeps_the_first_loss(tmp_path):
    """Defect: after restarts the progress bar and the loss curve's token axis went
    backwards (both followed the learners' steps, which a restart sets back), and a
    resumed run's summary began at the loss of the resume point."""
    cfg, regions, _, _ = _local_run(tmp_path, "mono")
    store = RunStore("mono", regions, "us-east")
    spec = store.read_spec()
    monitor = Monitor(Run(store.run, store.urls, store.client_region, spec, cfg), store)
    start = monitor.evaluate(monitor.statuses())
    monitor.remember_start(start)
    assert start["tokens"] == 0 and monitor.initial_loss == start["loss"]
    syncer = SyncerRuntime("mono", regions, "us-east", 0, 2, cfg.pipeline.model_dump())
    syncer.poll()
    assert syncer.merge_and_publish(0)["version"] == 1
    set_back = {lid: {"step": 0} for lid in run_slots(spec)}  # every learner restarted
    point = monitor.evaluate(set_back)
    assert point["versions"][0] == 1 and point["tokens"] > start["tokens"]
    lid, total = next(iter(run_slots(spec))), monitor.total_steps
    before = monitor.progress({lid: {"step": total // 2}})
    assert before > 0 and monitor.progress({lid: {"step": total // 5}}) == before  # it holds
    assert monitor.progress({lid: {"step": total}}) > before
    resumed = Monitor(Run(store.run, store.urls, store.client_region, spec, cfg), store)
    again = resumed.evaluate(resumed.statuses())
    resumed.remember_start(again)
    assert resumed.initial_loss == start["loss"] != again["loss"]


def test_start_up_says_what_each_learner_is_doing(tmp_path):
    """Defect: `diloco train` logged "0.0% | tokens 0" for minutes while learners started
    and compiled. A learner now reports its start-up phases in its status object
    (keeping the progress an earlier process reported), and the launcher shows them."""
    from flows.learner_runtime import LearnerRuntime

    cfg, regions, _, _ = _local_run(tmp_path, "phases")
    store = RunStore("phases", regions, "us-east")
    lid, region = next(iter(run_slots(store.read_spec()).items()))
    writer = RunStore("phases", {region: regions[region]}, region, writer=lid)
    writer.progress.write_metrics(
        lid,
        {"state": "training", "step": 40, "tokens": 1234},
        totals={"train_seconds": 12.5, "startup_seconds": 3.0},
    )  # a predecessor
    seen = []
    announce = LearnerRuntime.announce

    def spy(self, state):
        announce(self, state)
        seen.append(dict(writer.progress.read_metrics(lid)))

    LearnerRuntime.announce = spy
    try:
        rt = LearnerRuntime("phases", regions[region], region, lid, cfg.pipeline.model_dump())
    finally:
        LearnerRuntime.announce = announce
    rt.close()
    assert [s["state"] for s in seen] == ["compiling", "resuming"]
    assert all(s["step"] == 40 and s["tokens"] == 1234 for s in seen)
    # The predecessors' time counters stay, should this process die while it starts
    # (a learner killed before its first round used to wipe them from the goodput).
    assert all(s["train_seconds"] == 12.5 and s["startup_seconds"] == 3.0 for s in seen)
    states = {
        "a": {},
        "b": {"state": "compiling"},
        "c": {"state": "resuming"},
        "d": {"state": "training"},
    }
    line = startup_line(states, {0: 0, 1: 0})
    assert line == ("starting up | learners: 1 starting, 1 compiling, 1 resuming, 1 training | "
                    "waiting for the first contribution")  # fmt: skip
    assert startup_line(states, {0: 1, 1: 0}).endswith("| first versions published")
    training = {k: {"state": "training"} for k in states}
    assert startup_line(training, {0: 0, 1: 0}).startswith("starting up | learners: 4 training")
    assert startup_line(training, {0: 1, 1: 0}) is None  # from here on: progress lines
    # Defect: a learner's status is written once a round, so a slow learner said
    # "resuming" through its whole first round, and the launcher logged "starting up"
    # instead of progress lines for most of a run. Its heartbeat, newer, says it trains.
    from flows.monitor import Monitor
    from storage_layout.heartbeat import Heartbeat

    def beat(state, when):
        return Heartbeat(learner="x", generation=1, beat=1, period=1.0, state=state, step=3,
                         sends=0, time=when)  # fmt: skip

    looked = {"a": {"state": "resuming", "time": 10.0}, "b": {"state": "resuming", "time": 10.0},
              "c": {"state": "killed", "time": 10.0}, "d": {"state": "resuming", "time": 10.0}}  # fmt: skip
    beats = {"a": beat("training", 12.0), "b": beat("training", 9.0), "c": beat("training", 12.0),
             "d": beat("compiling", 12.0)}  # fmt: skip
    now = Monitor.phases(SimpleNamespace(beats=beats), looked)
    assert {k: s["state"] for k, s in now.items()} == {
        "a": "training",
        "b": "resuming",
        "c": "killed",
        "d": "resuming",
    }  # an older beat, a death the launcher saw, and a beat in start-up change nothing
    assert looked["a"]["state"] == "resuming" and now["a"]["time"] == 10.0


def test_a_crash_looping_worker_is_given_up_by_name_and_not_waited_for(tmp_path, prefect_api):
    """A worker is restarted after every crash; one that fails its starts in a row without
    progress is given up with its last error, and syncers stop waiting for it."""
    from prefect import flow

    cfg, regions, _, _ = _local_run(tmp_path, "loop")
    argv = [sys.executable, "-c", "import sys; print('no GPU here'); sys.exit(3)"]
    status = ("learner-0", "us-east", [])

    @flow
    def launch() -> int:
        mode = Processes("loop", regions, 2, tmp_path)
        return mode.supervise("learner us-east/0", argv, str(tmp_path / "l0.log"), status)

    with pytest.raises(RuntimeError, match="2 starts in a row failed without progress") as err:
        launch()
    assert "exited with status 3" in str(err.value) and "no GPU here" in str(err.value)
    store = RunStore("loop", regions, "us-east")
    assert list(store.progress.read_metrics("launcher")["given_up"]) == ["learner-0"]
    syncer = SyncerRuntime("loop", regions, "us-east", 0, 2, cfg.pipeline.model_dump())
    assert not syncer.transport.learners_finished()  # the others have not finished
    for lid in ("learner-1", "learner-2", "learner-3"):
        give_up(store, lid, "test")
    syncer.transport._given_up_read = -math.inf  # (it reads the launcher's status every 5 s)
    assert syncer.transport.learners_finished()


def told_to_leave(argv: list[str], env: dict[str, str], log: Path, sent, tell,
                  status: int = 128 + signal.SIGTERM) -> tuple:  # fmt: skip
    """Run ``argv`` (a learner's worker, or `diloco join`) with its output in ``log``;
    once ``sent()`` finds its first send committed (the run's own progress), ``tell(proc)``
    it to leave. Returns what ``sent()`` found and the output, after checking it left with
    ``status`` (by default as a preempted learner does: 128 + SIGTERM)."""
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        found = _wait(sent, 300, "the learner's first send", proc)
        tell(proc)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code == status, text[-3000:]
    return found, text


def preempted_worker(
    store: RunStore, cfg, lid: str, log: Path, notice: LocalMetadata | None = None,
    processes: int = 1,
) -> str:  # fmt: skip
    """Run learner ``lid`` of ``store``'s run (one region) as a worker process (a group of
    ``processes``, ``flows.hosts``); once its first send commits (the run's own
    progress), SIGTERM it (a group: its last process alone, not the leader), or, given a
    metadata service (``notice``, which the worker is told to watch as AWS's), post its
    interruption notice. Returns its output (``told_to_leave``)."""
    ((region, bucket),) = store.urls.items()
    opts = cfg.pipeline.model_copy(update={"preempt_seconds": 60, "learner_processes": processes})
    cfg = cfg.model_copy(update={"pipeline": opts})
    argv = workers.learner(store.run, bucket, region, learner_index(lid), cfg).argv()
    env = child_env()
    if notice is not None:
        env[NOTICE_ENV] = f"aws={notice.url}"
    plan = range(cfg.topology.fragments)

    def sent() -> bool:
        return any(store.contributions.contribution_seqs(lid, p, region) for p in plan)

    def tell(proc: subprocess.Popen) -> None:
        if notice is not None:
            notice.announce("terminate")
        elif processes > 1:  # one host's notice: the group leaves as one
            os.kill(_wait(lambda: group_members(proc.pid).get(processes - 1), 60,
                          "the group's last process", proc), signal.SIGTERM)  # fmt: skip
        else:
            proc.send_signal(signal.SIGTERM)

    return told_to_leave(argv, env, log, sent, tell)[1]


@pytest.mark.parametrize("told_by", ["sigterm", "aws notice", "sigterm to process 1 of 2"])
def test_a_learner_worker_told_it_is_preempted_sends_checkpoints_and_leaves(
    tmp_path, prefect_api, told_by
):
    """SIGTERM to a learner's worker process (a spot VM shut down, a pod deleted), or the
    cloud's interruption notice where the machine names it (DILOCO_PREEMPTION_NOTICE;
    here AWS's IMDSv2 on loopback): it finishes its step, sends every fragment's unsent
    steps, checkpoints at that step, says "preempted" and exits with 128 + SIGTERM; a
    second process would resume there. The notice comes from the run's own progress:
    once the learner's first send commits. A learner of two processes (two hosts) whose
    process 1 alone is told (its host's notice) leaves as one: the leader sends, and the
    checkpoint it commits holds both processes' parts."""
    cfg = tiny(50_000_000)  # far more than the test trains: it never finishes
    regions = {"us-east": f"file://{tmp_path / 'us'}"}
    (tmp_path / "us").mkdir()
    store = RunStore("pre", regions, "us-east")
    spec = initialize_run(store, cfg)
    lid = next(iter(run_slots(spec)))
    with contextlib.ExitStack() as stack:
        notice = None
        if told_by == "aws notice":
            notice = LocalMetadata().start()
            stack.callback(notice.stop)
        processes = 2 if "of 2" in told_by else 1
        text = preempted_worker(store, cfg, lid, tmp_path / "learner.log", notice, processes)
    if notice is not None:
        assert f"watching for a preemption notice (aws at {notice.url})" in text, text[-3000:]
        assert f"preemption notice (aws at {notice.url}): terminate at" in text, text[-3000:]
    status = store.progress.read_metrics(lid)
    assert status["state"] == "preempted", status
    step = status["step"]
    assert store.checkpoints.checkpoint_steps(lid)[-1] == step, text[-3000:]
    assert f"checkpointed at step {step}" in text and "preempted: learner" in text
    marker = read_marker(store.home, store.layout.checkpoint_marker(lid, step))
    assert sorted(marker.meta.get("parts", {})) == [f"opt.p{i:04d}" for i in range(processes)
                                                    if processes > 1]  # fmt: skip
    # Every fragment's newest send was made at that step: nothing it trained is lost.
    view = StoreLearnerView(bucket_store("pre", regions, spec, cfg, lid, home="us-east"), lid)
    assert view.sent_so_far()[1] == step
    # The audit accounts for its work: all of it sent, none of it merged yet (no syncer
    # ran), every committed token pending.
    report = audit_run("pre", regions)
    assert report.ok, report.violations
    acc = report.learners[lid]
    assert acc["state"] == "preempted" and acc["trained"] == acc["sent"] == step, acc
    assert acc["unsent"] == 0, acc
    assert acc["tokens"]["pending"] == step * cfg.tokens_per_step > 0, acc
    assert acc["tokens"]["merged"] == 0, acc


@pytest.mark.parametrize("lost", ["as its flow run ends", "in a callback"])
def test_a_stop_whose_interrupt_is_lost_still_stops_a_learners_worker(
    tmp_path, prefect_api, monkeypatch, lost
):
    """Defect: the launcher's SIGINT (a Ctrl-C to `diloco train`) that came as one of a
    learner's flow runs ended was swallowed by Prefect's engine (an exception raised
    after the flow's own code returned: the flow run ends Completed), and the worker
    started its next flow run and trained on to the end of the budget (a stopped run then
    resumed to find itself complete, seen in CI); one raised inside a JAX garbage
    collector callback is ignored by Python ("Exception ignored in _xla_gc_callback"),
    and the flow run trained on. Now the worker keeps the stop (``WorkerProcess.stop``)
    and stops at the next round or between flow runs: it checkpoints at the step it
    reached and exits 130. Here the SIGINT is sent by the flow run's completion hook,
    after its code returned, where Prefect swallows it; or the stop is set as a lost
    interrupt leaves it (set, nothing raised) by the first round's completion hook."""
    import flows.learner
    from flows import worker

    per_flow_run = 1 if lost == "as its flow run ends" else 3
    cfg = load_config("tiny", overrides=["topology.learners=1", "pipeline.round_steps=20",
                                         f"pipeline.rounds_per_flow_run={per_flow_run}",
                                         "pipeline.checkpoint_every=20"])  # fmt: skip
    rounds = 3  # the budget: without the stop, three rounds
    cfg = cfg.model_copy(update={"budget": cfg.budget.model_copy(
        update={"tokens": rounds * 20 * cfg.tokens_per_step})})  # fmt: skip
    regions = {"us-east": f"file://{tmp_path / 'us'}"}
    (tmp_path / "us").mkdir()
    store = RunStore("late", regions, "us-east")
    lid = next(iter(run_slots(initialize_run(store, cfg))))
    argv = workers.learner("late", regions["us-east"], "us-east", 0, cfg).argv()
    ends = []

    def stop_as_it_ends(flow, flow_run, state):
        ends.append(state.name)
        os.kill(os.getpid(), signal.SIGINT)

    def stop_lost(task, task_run, state):
        this_process().stop.set()  # (the worker's: the flow run runs in its context)

    if lost == "as its flow run ends":
        hooked = flows.learner.learner_flow.with_options(on_completion=[stop_as_it_ends])
        monkeypatch.setattr(flows.learner, "learner_flow", hooked)
    else:
        hooked = flows.learner.train_round.with_options(on_completion=[stop_lost])
        monkeypatch.setattr(flows.learner, "train_round", hooked)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = worker.main(argv[argv.index("flows.worker") + 1 :])
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert code == 130, code  # stopped after one round (of the three in its budget)
    assert ends == (["Completed"] if lost == "as its flow run ends" else []), ends
    status = store.progress.read_metrics(lid)
    assert status["state"] != "done" and status["step"] == 20, status
    assert store.checkpoints.checkpoint_steps(lid)[-1] == 20


def test_a_worker_stopped_by_the_launcher_checkpoints_and_its_flow_run_ends_cancelled(
    tmp_path, prefect_api
):
    """SIGINT to a learner's worker (how the launcher stops a run: a Ctrl-C to `diloco
    train`), once its first send commits: it checkpoints at the step it reached, exits
    130 and its flow run ends Cancelled, saying so (it ended Crashed: "Crash detected!",
    an error in the log and in the Prefect UI, for a stop that was asked for)."""
    cfg = tiny(50_000_000)  # far more than the test trains: it never finishes
    opts = cfg.pipeline.model_copy(update={"rounds_per_flow_run": 10_000})  # one flow run
    cfg = cfg.model_copy(update={"pipeline": opts})
    regions = {"us-east": f"file://{tmp_path / 'us'}"}
    (tmp_path / "us").mkdir()
    store = RunStore("stop", regions, "us-east")
    lid = next(iter(run_slots(initialize_run(store, cfg))))
    argv = workers.learner("stop", regions["us-east"], "us-east", 0, cfg).argv()

    def sent() -> bool:
        return any(
            store.contributions.contribution_seqs(lid, p, "us-east")
            for p in range(cfg.topology.fragments)
        )

    _, text = told_to_leave(argv, child_env(), tmp_path / "learner.log", sent,
                            lambda proc: proc.send_signal(signal.SIGINT), status=130)  # fmt: skip
    step = store.checkpoints.checkpoint_steps(lid)[-1]
    assert f"Finished in state Cancelled('stopped by a signal: checkpointed at step {step}')" in (
        text), text[-3000:]  # fmt: skip
    assert "Traceback" not in text, text[-3000:]


def test_a_deployments_learner_flow_run_drains_its_io_before_its_process_ends(
    tmp_path, prefect_api
):
    """Defect: a learner flow run of a deployment (its process ends with it) returned with
    its last checkpoint and uploads still queued; the process then exited under them
    ("checkpoint ... failed for good: cannot schedule new futures after interpreter
    shutdown"), and the next flow run resumed from an older checkpoint. Now a flow run
    not continued in its process waits for them and closes its runtime: with every commit
    slowed, the checkpoint of the step it reached is written when it returns, and the
    next flow run resumes from it."""
    import flows.learner

    cfg = load_config("tiny", overrides=["topology.learners=1", "pipeline.round_steps=20",
                                         "pipeline.rounds_per_flow_run=1",
                                         "pipeline.checkpoint_every=1000"])  # fmt: skip
    cfg = cfg.model_copy(update={"budget": cfg.budget.model_copy(
        update={"tokens": 3 * 20 * cfg.tokens_per_step})})  # fmt: skip
    regions = {"us-east": f"file://{tmp_path / 'us'}"}
    (tmp_path / "us").mkdir()
    store = RunStore("drain", regions, "us-east")
    lid = next(iter(run_slots(initialize_run(store, cfg))))
    params = workers.learner("drain", regions["us-east"], "us-east", 0, cfg).params
    slow = {"seed": 1, "latency_rate": 1.0, "latency_seconds": 0.5, "ops": ["put_exclusive"]}
    with worker_process(WorkerProcess(faults=Injector(slow))) as process:
        first = flows.learner.learner_flow(**params)
    assert first["step"] == 20 and not first["done"], first
    assert store.checkpoints.checkpoint_steps(lid)[-1] == 20  # written before the flow run returned
    assert process.runtimes == {}, "a deployment's flow run kept its runtime"
    second = flows.learner.learner_flow(**params)  # the next flow run: a fresh runtime
    assert second["step"] == 40, second  # resumed from step 20, not trained again


def test_the_syncers_members_follow_the_learners_statuses(tmp_path, caplog, monkeypatch):
    """A syncer counts towards the quorum every learner but one whose status says it was
    preempted, one that writes no heartbeat and whose status has not changed for
    liveness.silent_max_seconds of the syncer's own clock (a done one excepted), and one
    given up; each comes back when
    it writes again, and each change is logged once. One that comes back by a join
    (``diloco join``) is logged with its join record, checked against its key."""
    _, regions, _, _ = _local_run(tmp_path, "members")
    secret = "s" * 32
    monkeypatch.setenv(RUN_SECRET_ENV, secret)
    syncer = SyncerRuntime("members", regions, "us-east", 0, 2, {})
    transport, now = syncer.transport, [0.0]
    transport.liveness = Liveness(LivenessConfig(silent_max_seconds=100), 20)
    transport.clock = lambda: now[0]
    spec = RunStore("members", regions, "us-east").read_spec()
    claims = claims_key(secret, "members")  # what each learner holds beside its own key
    writers = {
        lid: RunStore("members", regions, r, writer=lid, claims_key=claims)
        for lid, r in run_slots(spec).items()
    }

    def status(lid: str, state: str) -> None:
        writers[lid].progress.write_metrics(
            lid, {"state": state, "time": now[0], "step": int(now[0])}
        )

    def look(after: float) -> list[str]:
        now[0] += after
        return transport.members()

    everyone = sorted(run_slots(spec))
    for lid in everyone:
        status(lid, "training")
    assert sorted(look(0)) == everyone
    status("learner-1", "preempted")
    assert sorted(look(1)) == everyone  # read at most every 5 s
    assert "learner-1" not in look(5)
    status("learner-3", "done")
    for _ in range(3):  # learner-0 writes each round; learner-2 stops writing
        status("learner-0", "training")
        members = look(40)
    assert sorted(members) == ["learner-0", "learner-3"]  # done: counted, as before
    # Both come back by a join: learner-2's record signed with its key, learner-1's with
    # another learner's (a forger's).
    for lid, signer in (("learner-1", "learner-2"), ("learner-2", "learner-2")):
        record = {"learner": lid, "host": f"host-of-{lid}", "took": "preempted", "join": 1,
                  "time": time.time()}  # fmt: skip
        body = json.dumps(sign_record(record, learner_key(secret, "members", signer)))
        writers[lid].members.put_join(lid, lambda n, body=body: body.encode())
    status("learner-1", "training")
    status("learner-2", "training")
    assert sorted(look(5)) == everyone
    text = caplog.text
    assert "learner learner-2 joined from host host-of-learner-2 (join 1" in text
    assert "join record 1 of learner-1 does not verify with its key" in text
    assert "learner learner-1 joined" not in text
    assert "learner-1 is not counted towards the quorum: it was preempted" in text
    assert (
        "learner-2 is not counted towards the quorum: no heartbeat, and no new status for 1" in text
    )
    assert text.count("learner-2 is counted towards the quorum again") == 1


def test_watching_the_workers_arms_no_asynchronous_timeout(prefect_api, monkeypatch):
    """Defect: every run ended with "RuntimeError: release unlocked lock". The watch loop
    polled ``prefect.futures.wait(timeout=...)``, which arms an alarm (or a watcher
    thread) that raises into the launcher wherever it is, inside a lock included. The
    loop must wait on the workers without one, and still see when each ended."""
    import prefect.utilities.timeout
    from prefect import flow, task
    from prefect.task_runners import ThreadPoolTaskRunner

    def armed(*args: object, **kwargs: object) -> None:
        raise AssertionError("an asynchronous timeout was armed")

    monkeypatch.setattr(prefect.utilities.timeout, "cancel_sync_after", armed)

    quick_ended = threading.Event()

    @task
    def quick() -> None:
        time.sleep(0.2)
        quick_ended.set()

    @task
    def slow() -> None:  # ends 1.5 s after the quick one, however late either started
        quick_ended.wait()
        time.sleep(1.5)

    @flow(task_runner=ThreadPoolTaskRunner(max_workers=2))
    def launch() -> dict[str, float]:
        futures = [quick.submit(), slow.submit()]
        return watch(["quick", "slow"], futures, None, None, 1e9, None)

    start = time.time()
    ended = launch()
    assert set(ended) == {"quick", "slow"}
    assert start < ended["quick"] < ended["slow"] - 0.5


def test_a_spare_worker_becomes_the_worker_it_is_given_and_idle_ones_end(tmp_path):
    """A restart takes a spare that did its imports ahead of need: it runs the command it
    is handed, into that worker's log; the pool refills, and closing it ends the idle
    spares. A command that is not a worker's starts as it is."""
    pool = Spares(1, tmp_path / "spares.log", child_env())
    spare = pool.idle[0]
    proc, warm = pool.take([*WORKER_COMMAND, "bogus"], str(tmp_path / "w.log"), child_env())
    assert warm and proc is spare and proc.wait(timeout=60) == 2
    assert "invalid choice: 'bogus'" in (tmp_path / "w.log").read_text()
    assert len(pool.idle) == 1 and pool.idle[0] is not spare
    # Spares are forked from the zygote (which did the imports once); their ends, a kill
    # included, are told by it.
    idle = pool.idle[0]
    assert Path(f"/proc/{idle.pid}/stat").read_text().split(") ")[1].split()[1] == str(
        pool.zygote.proc.pid
    )
    idle.kill()
    assert idle.wait(timeout=60) == -signal.SIGKILL
    cold, warm = pool.take([*WORKER_COMMAND, "bogus"], str(tmp_path / "c.log"), child_env())
    assert not warm and cold is not idle and cold.wait(timeout=60) == 2  # a dead one is skipped
    other, warm = pool.take([sys.executable, "-c", "print('as is')"], str(tmp_path / "o.log"),
                            child_env())  # fmt: skip
    assert not warm and other.wait(timeout=60) == 0
    assert (tmp_path / "o.log").read_text() == "as is\n"
    idle = pool.idle[0]
    pool.close()
    assert idle.wait(timeout=60) == 0 and pool.idle == []
    assert pool.zygote.proc.wait(timeout=60) == 0
    assert (tmp_path / "spares.log").read_text() == ""  # quiet: no traceback, no warning


def test_a_spares_warm_up_ends_at_its_next_step_once_it_is_not_needed(monkeypatch, capsys):
    """A spare warms up for a learner in a thread beside its wait for a job; one that
    becomes a syncer stops it at the next step (no learner's step compiled in a syncer,
    seconds of a core at a run's start), quietly. A warm-up that fails says so."""
    import flows.learner_runtime
    from flows.worker import WarmUp

    steps: list[int] = []
    started = threading.Event()

    def warm_up(run, bucket, region, pipeline=None, go_on=lambda: None):
        started.set()
        for step in range(100_000):  # the model, the step's compilations, the data
            go_on()
            steps.append(step)
            time.sleep(0.001)

    monkeypatch.setattr(flows.learner_runtime, "warm_up", warm_up)
    warming = WarmUp({"run": "r", "bucket": "file:///nowhere", "region": "us"})
    assert started.wait(60)
    warming.not_needed()
    warming.thread.join(60)
    assert not warming.thread.is_alive() and len(steps) < 100_000
    assert capsys.readouterr().err == ""

    def broken(**_):
        raise OSError("no spec in file:///nowhere")

    monkeypatch.setattr(flows.learner_runtime, "warm_up", broken)
    WarmUp({"run": "r", "bucket": "file:///nowhere", "region": "us"}).thread.join(60)
    assert "warm-up failed, the worker will start cold" in capsys.readouterr().err


def test_learners_of_one_machine_compile_once_and_load_it_from_the_cache(tmp_path):
    """Learners started together compile their step, sends and applies once per machine:
    one waits while another compiles (here the test holds the lock) and then compiles
    itself, as the first, marking the programs kept; one that comes after loads every
    program from the cache and waits for no one."""
    import fcntl

    from flows.compile import COMPILE_LOCK

    cache = tmp_path / "jax"
    cache.mkdir()
    code = """if True:
        import jax
        from jax import monitoring
        from diloco.config import load_config
        from flows.learner_runtime import compile_step
        from flows.run import build_model
        seen = {"asked": 0, "hits": 0}
        def count(event, **kwargs):
            if event == "/jax/compilation_cache/compile_requests_use_cache":
                seen["asked"] += 1
            elif event == "/jax/compilation_cache/cache_hits":
                seen["hits"] += 1
        cfg = load_config("tiny")
        model = build_model(cfg, learner=True)
        monitoring.register_event_listener(count)  # (the step's, sends', applies')
        compile_step(model, cfg)
        print("compiled", seen["asked"] - seen["hits"], "of", seen["asked"], flush=True)
    """
    env = {**child_env(), "JAX_COMPILATION_CACHE_DIR": str(cache)}

    def start(log: str) -> subprocess.Popen:
        with (tmp_path / log).open("w") as out:
            return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=out,
                                    stderr=subprocess.STDOUT, text=True)  # fmt: skip

    with open(cache / COMPILE_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process compiles
        second = start("second.log")
        _wait(lambda: "another process of this machine compiles" in
              (tmp_path / "second.log").read_text(), 300, "its wait", second)  # fmt: skip
        assert second.poll() is None, (tmp_path / "second.log").read_text()  # it waits
    assert second.wait(timeout=300) == 0
    said = (tmp_path / "second.log").read_text()
    compiled, _, asked = said.split("compiled ")[-1].split()[:3]
    assert int(compiled) == int(asked) > 0, said  # the lock's holder marked nothing kept
    assert [p.name for p in cache.glob("diloco-compiled-*")], sorted(os.listdir(cache))
    third = start("third.log")
    assert third.wait(timeout=300) == 0
    said = (tmp_path / "third.log").read_text()
    assert "another process" not in said, said
    compiled, _, asked = said.split("compiled ")[-1].split()[:3]
    assert int(compiled) == 0 and int(asked) > 0, said


def test_spares_outlive_their_zygote(tmp_path):
    """A zygote that dies leaves no worker unwatched and no restart stuck: its forked
    spares' ends are still seen, and new spares start as processes of their own."""
    pool = Spares(1, tmp_path / "spares.log", child_env())
    orphan = pool.idle[0]
    assert orphan.pid > 0
    pool.zygote.proc.kill()
    assert orphan.wait(timeout=60) == 1  # its stdin closed with the zygote: it ended
    proc, _ = pool.take([*WORKER_COMMAND, "bogus"], str(tmp_path / "w.log"), child_env())
    assert proc.wait(timeout=60) == 2 and isinstance(proc, subprocess.Popen)
    pool.close()


def test_a_spare_holds_no_accelerator_and_its_zygote_no_thread():
    """A spare imports what a worker needs and nothing starts a JAX backend: on a GPU node
    an idle spare must not take the memory the learner it replaces needs. Nor does any
    import start a thread: the zygote forks spares after these imports, and a fork copies
    only the thread that calls it."""
    code = ("import threading, flows.learner, flows.syncer, jax._src.xla_bridge as xb; "
            "print(xb.backends_are_initialized(), threading.active_count())")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["False", "1"], out.stderr[-2000:]


def test_duplicate_syncer_is_fenced_off(tmp_path):
    cfg, regions, model, sent = _local_run(tmp_path, "fence")
    a = SyncerRuntime("fence", regions, "us-east", 0, 2, cfg.pipeline.model_dump())
    b = SyncerRuntime("fence", regions, "us-east", 0, 2, cfg.pipeline.model_dump())
    assert a.poll() == b.poll() == 4
    won = a.merge_and_publish(0)
    lost = b.merge_and_publish(0)
    assert won is not None and won["version"] == 1 and lost is None
    assert b.syncers[0].version == 1  # reloaded from the winner
    name = model.plan[0][0]
    assert np.array_equal(materialize(b.syncers[0].params)[name],
                          materialize(a.syncers[0].params)[name])  # fmt: skip
    assert b.syncers[0].cursor == a.syncers[0].cursor == {lid: 1 for lid in sent}
    # The learners' progress (what a shared budget ends on) is read back with it.
    assert b.syncers[0].progress == a.syncers[0].progress == {lid: 1 for lid in sent}
    assert b.poll() == 0  # nothing left to merge twice
    for url in regions.values():
        assert inspect_bucket(url, run="fence", verify=True)["runs"][0]["problems"] == []


def test_train_refuses_a_changed_spec_and_a_missing_bucket(tmp_path, capsys, s3_server):
    regions = [
        f"--region=us-east=file://{tmp_path / 'us'}",
        f"--region=eu-west=file://{tmp_path / 'eu'}",
    ]
    cfg = tiny(20_000)
    store_regions = {"us-east": f"file://{tmp_path / 'us'}", "eu-west": f"file://{tmp_path / 'eu'}"}
    for path in ("us", "eu"):
        (tmp_path / path).mkdir()
    initialize_run(RunStore("r", store_regions, "us-east"), cfg)
    code = cli_main(["train", "--dir", str(tmp_path), "--run", "r", "--tokens", "30000",
                     "--set", "topology.inner_steps=7", *regions])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert (
        "refusing to mix them" in err and "config.topology.inner_steps: stored 10, given 7" in err
    )
    # The larger budget asked for with it was not recorded: the rest did not match.
    store = RunStore("r", store_regions, "us-east")
    assert store.read_spec()["config"]["budget"]["tokens"] == 20_000
    code = cli_main(["train", "--dir", str(tmp_path), "--run", "r2", "--tokens", "20000",
                     "--region=us-east=s3://no-such-bucket-here"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "no-such-bucket-here" in err and "does not exist" in err


def test_an_extension_that_reached_one_region_only_is_completed_by_the_next_launch(tmp_path):
    """The budget is extended region by region (budget.json in each): a launch that
    wrote it in one region and died is completed by the next with the same budget, and
    never cut by a smaller one; the rest of the spec is checked before anything grows."""
    cfg = tiny(20_000)
    regions = {"us-east": f"file://{tmp_path / 'us'}", "eu-west": f"file://{tmp_path / 'eu'}"}
    for path in ("us", "eu"):
        (tmp_path / path).mkdir()
    store = RunStore("ext", regions, "us-east")
    initialize_run(store, cfg)
    RunStore("ext", {"us-east": regions["us-east"]}, "us-east").extend_budget(40_000, 20_000)
    with pytest.raises(
        ValueError, match=r"budget of 40,000 tokens; budget\.tokens 30,000 would cut"
    ):
        initialize_run(store, tiny(30_000))
    with pytest.raises(ValueError, match=r"topology\.inner_steps: stored 10, given 7"):
        initialize_run(store, tiny(40_000).model_copy(update={
            "topology": cfg.topology.model_copy(update={"inner_steps": 7})}))  # fmt: skip
    assert store.read_spec("eu-west")["config"]["budget"]["tokens"] == 20_000
    initialize_run(store, tiny(40_000))
    for region in regions:
        assert store.read_spec(region)["config"]["budget"]["tokens"] == 40_000


def test_train_checks_its_input_before_committing_anything(tmp_path, capsys):
    """A bad data source, run name or region URL fails naming what is wrong, and leaves no
    spec behind (so the corrected command is not refused as a spec change)."""
    us = tmp_path / "us"
    us.mkdir()
    base = ["train", "--dir", str(tmp_path / "runs"), "--tokens", "20000"]
    binary = tmp_path / "blob.txt"
    binary.write_bytes(bytes(range(256)) * 100)
    for source, reason in ((tmp_path / "nope", "does not exist"), (binary, "looks binary")):
        code = cli_main([*base, "--run", "r", f"--region=us-east=file://{us}",
                         "--set", f"data.source={source}"])  # fmt: skip
        err = capsys.readouterr().err
        assert code == 2 and reason in err, err
        assert not (us / "r" / "spec.json").exists()
    code = cli_main([*base, "--run", "../escape"])
    assert code == 2 and "run name '../escape'" in capsys.readouterr().err
    assert not (tmp_path / "escape").exists()
    code = cli_main([*base, "--run", "r", "--region=us-east=ftp://nowhere.invalid/x"])
    err = capsys.readouterr().err
    assert code == 2 and "region us-east: 'ftp://nowhere.invalid/x'" in err, err


def test_a_far_future_sequence_number_is_rejected_and_disables_nothing(tmp_path):
    """A marker whose seq no learner can reach (at most one send per inner step) is
    rejected by name; the learner's real contributions below it still merge."""
    cfg, regions, model, sent = _local_run(tmp_path, "future")
    spec_learners = run_slots(RunStore("future", regions, "us-east").read_spec())
    lid, region = "learner-0", spec_learners["learner-0"]
    writer = RunStore("future", regions, region, writer=lid)
    rng = np.random.default_rng(5)
    forged = _contribution(model, 0, lid, 10**9, rng)
    writer.contributions.put_contribution(lid, 0, 10**9, forged.payload, contribution_meta(forged))
    syncer = SyncerRuntime("future", regions, "us-east", 0, 1, cfg.pipeline.model_dump())
    assert syncer.poll() == len(sent) == 4  # the forged one is not among them
    assert [(r["learner"], r["seq"]) for r in syncer.rejected] == [(lid, 10**9)]
    assert "beyond the" in syncer.rejected[0]["reason"]
    real = _contribution(model, 0, lid, 2, rng)  # the learner's next real send
    writer.contributions.put_contribution(lid, 0, 2, real.payload, contribution_meta(real))
    assert syncer.poll() == 1 and len(syncer.rejected) == 1  # reported once
    row = syncer.merge_and_publish(0)
    assert row["version"] == 1
    cursor = RunStore("future", regions, "us-east").versions.global_marker(0, 1).meta["cursor"]
    assert cursor[lid] == 2


def test_a_learner_resumed_on_a_stale_listing_never_reuses_a_sequence_number(tmp_path, monkeypatch):
    """A restarted learner takes its seqs above every one an earlier process of it may
    have committed, even when every listing leaves the newest objects out (an eventually
    consistent store). A seq below one the syncers have listed already would never be
    read: bench/chaos lost a contribution so. Its data position is the newest send's, not
    the newest listed one's, and a forged marker far ahead moves neither. A stale
    duplicate cannot take a number the new process holds."""
    monkeypatch.setenv(RUN_SECRET_ENV, "s" * 64)  # contributions are signed
    cfg, regions, model, _ = _local_run(tmp_path, "stale", only_region="nowhere")
    spec = RunStore("stale", regions, "us-east").read_spec()
    lid = "learner-0"
    region, rng = run_slots(spec)[lid], np.random.default_rng(3)
    old = bucket_store("stale", regions, spec, cfg, lid, home=region)
    assert old.sent_so_far(lid) == (0, 0)
    for seq in range(1, 20):  # to fragments 1 and 0 in turn; step = seq
        old.put_contribution(_contribution(model, seq % 2, lid, seq, rng))
    stale = {"stale_list_rate": 1.0, "stale_list_drop": 3, "ops": ["list"], "seed": 1}
    injector = Injector(stale)
    new = bucket_store("stale", regions, spec, cfg, lid, home=region, faults=injector)
    seq, step = new.sent_so_far(lid)
    new.put_contribution(_contribution(model, 1, lid, seq + 1, rng))
    assert injector.counts()["stale_list"] >= 2  # both fragments' listings were stale
    assert seq >= 19 and step == 19, (seq, step)
    committed = RunStore("stale", regions, region).contributions.contribution_seqs(lid, 1, region)
    assert committed[-1] == seq + 1 and committed[-2] == 19
    # The old process, still running, holds no number above the new one's first.
    with pytest.raises(SeqNotReserved, match=f"{lid}.*another process"):
        old.put_contribution(_contribution(model, 0, lid, seq + 2, rng))
    # A forged (unsigned) marker far ahead is listed, but is not the learner's own.
    forged = _contribution(model, 0, lid, 10**6, rng)
    RunStore("stale", regions, region, writer="forger").contributions.put_contribution(
        lid, 0, 10**6, forged.payload, contribution_meta(forged)
    )
    third = bucket_store("stale", regions, spec, cfg, lid, home=region)
    assert third.sent_so_far(lid) == (seq + 2 * SEQ_BLOCK, seq + 1)


def test_a_syncers_cross_region_bytes_show_while_its_flow_run_goes_on(tmp_path):
    """Defect: the live `bytes/cross_region` stayed 0 until a syncer flow run ended (200
    publishes), since a shard wrote its status object, traffic included, only then. Each
    publish now writes it: the launcher's live figures move with every version."""
    cfg, regions, _, sent = _local_run(tmp_path, "live")
    store = RunStore("live", regions, "us-east")
    monitor = Monitor(
        Run(store.run, store.urls, store.client_region, store.read_spec(), cfg), store
    )
    assert cross_region_bytes(monitor.traffic()[0]) == 0
    syncer = SyncerRuntime("live", regions, "us-east", 0, 2, cfg.pipeline.model_dump())
    assert syncer.poll() == len(sent) == 4  # two of them from eu-west, read from us-east
    assert syncer.merge_and_publish(0)["version"] == 1  # published to both regions
    status = store.progress.read_metrics("syncer-0")
    assert status["state"] == "running" and status["versions"] == {"0": 1}
    assert cross_region_bytes(monitor.traffic()[0]) > 0


def test_syncer_runtime_survives_a_region_that_is_down(tmp_path):
    """A learner region that cannot be listed is skipped; the rest merges on."""
    cfg, regions, _, sent = _local_run(tmp_path, "down", only_region="us-east")
    store = RunStore("down", regions, "us-east")
    syncer = SyncerRuntime("down", regions, "us-east", 0, 1, cfg.pipeline.model_dump())
    os.rename(tmp_path / "eu", tmp_path / "eu-gone")  # the eu-west bucket disappears
    assert syncer.poll() == len(sent) == 2
    assert syncer.due(finishing=True) == [0]
    row = syncer.merge_and_publish(0)
    assert row["version"] == 1 and row["merged"] == 2
    assert syncer.lagging == {0}  # eu-west is behind ...
    os.rename(tmp_path / "eu-gone", tmp_path / "eu")
    syncer.catch_up_regions()  # ... and caught up once it is back
    assert syncer.lagging == set()
    assert store.versions.latest_global(0, "eu-west") == 1


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SADeprecationWarning")  # (MLflow's store)
def test_a_resume_keeps_the_runs_budget_and_a_larger_one_extends_it(prefect_api, tmp_path,
                                                                    capsys, monkeypatch):  # fmt: skip
    """Defect: resuming needed the exact original --tokens (the 1 M default was compared
    with the stored spec) and a budget could not be extended. Without --tokens a resume
    takes the stored spec, budget included; a larger --tokens extends the budget
    (recorded beside the spec, read by every learner and syncer: the learners done at the
    old budget train on to the new one); a smaller one is refused by name. The launches'
    live metrics go to MLflow too (``pipeline.sinks``), into one MLflow run."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    sets = [x for k, v in PIPELINE.items() for x in ("--set", f"pipeline.{k}={v}")]
    sets += [
        "--set",
        "topology.learners=2",
        "--set",
        "pipeline.syncer_shards=1",
    ]  # (fewer processes)
    sets += ["--set", 'pipeline.sinks=["mlflow"]']
    base = ["train", "--dir", str(tmp_path), "--run", "r", *sets]
    assert cli_main([*base, "--tokens", "20000"]) == 0
    capsys.readouterr()
    assert cli_main(base) == 0  # the stored budget: nothing left to do
    assert "run 'r' is complete (every learner is done, 20,000 tokens)" in capsys.readouterr().err
    assert cli_main([*base, "--tokens", "10000"]) == 2
    err = capsys.readouterr().err
    assert "budget of 20,000 tokens; budget.tokens 10,000 would cut it" in err, err
    regions = {r: f"file://{tmp_path / 'r' / 'buckets' / r}" for r in ("us-east", "eu-west")}
    store = RunStore("r", regions, "us-east")
    spec = store.read_spec()
    steps = {
        lid: store.progress.read_metrics(lid, reg)["step"] for lid, reg in run_slots(spec).items()
    }
    # Learners sharing a budget stop once the versions they hold say it is spent, so fast
    # ones overshoot it by what they train in a round trip: the extension is set above
    # what the first run did, however far that went on this machine.
    per_step = config_from_spec(spec).tokens_per_step
    tokens = (sum(steps.values()) + 40) * per_step
    assert cli_main([*base, "--tokens", str(tokens)]) == 0
    capsys.readouterr()
    for region in regions:  # the spec stays as written; the budget beside it grew
        assert store.read_spec(region)["config"]["budget"]["tokens"] == tokens
        raw = json.loads((tmp_path / "r" / "buckets" / region / "r" / "spec.json").read_text())
        assert raw["config"]["budget"]["tokens"] == 20_000
    cfg = config_from_spec(store.read_spec())
    after = {}
    for lid, reg in run_slots(spec).items():
        status = store.progress.read_metrics(lid, reg)
        assert status["state"] == "done" and status["budget_tokens"] == tokens, status
        after[lid] = status["step"]
    assert sum(after.values()) >= cfg.budget_steps > sum(steps.values())
    assert all(after[lid] >= steps[lid] for lid in steps)
    assert audit_run("r", regions).ok
    assert cli_main(base) == 0
    assert f"complete (every learner is done, {tokens:,} tokens)" in capsys.readouterr().err
    client = MlflowClient()
    (logged,) = client.search_runs([client.get_experiment_by_name("diloco").experiment_id])
    points = [
        m.step for m in client.get_metric_history(logged.info.run_id, "global/loss/validation")
    ]
    assert len(points) == len(set(points)) and max(points) > 20_000, points  # none twice
    assert client.get_metric_history(logged.info.run_id, "learner-0/loss/train")


def test_a_syncer_catches_a_full_region_up_with_backoff_and_says_so_once(
    tmp_path, monkeypatch, caplog
):
    """A region whose disk is full takes no new version: the syncer says so once, not per
    version; it asks the region again with backoff, not at every look (here an hour: no
    second try however often it looks); and it says when every region holds the newest
    version again."""
    monkeypatch.setattr("flows.syncer_transport.CATCH_UP_BACKOFF", (3600.0, 3600.0))
    cfg, regions, model, sent = _local_run(tmp_path, "full", only_region="us-east")
    rng = np.random.default_rng(2)
    store = RunStore("full", regions, "us-east")
    injector = Injector({"disk_full": {"region": "eu-west"}})
    with worker_process(WorkerProcess(faults=injector)):
        syncer = SyncerRuntime("full", regions, "us-east", 0, 1, cfg.pipeline.model_dump())
        injector.fill_disk("eu-west")
        with caplog.at_level(logging.WARNING):
            assert syncer.poll() == len(sent) == 2
            assert syncer.merge_and_publish(0)["version"] == 1
            syncer.loop.transport.tend()  # a try to catch eu-west up: refused (ENOSPC)
            for lid in sent:  # more work, another version, and the loop looks on and on
                c = replace(_contribution(model, 0, lid, 2, rng), base_version=1, anchor_seq=2,
                            base_id=syncer.loop.syncers[0].ids[1])  # fmt: skip
                RunStore("full", regions, "us-east", writer=lid).contributions.put_contribution(
                    lid, 0, 2, c.payload, contribution_meta(c)
                )
            assert syncer.poll() == 2 and syncer.merge_and_publish(0)["version"] == 2
            tried = injector.counts()["disk_full"]  # v2's publish was refused there too
            for _ in range(50):
                syncer.loop.transport.tend()
            assert syncer.lagging == {0} and store.versions.latest_global(0, "eu-west") == 0
            assert injector.counts()["disk_full"] == tried  # no write asked at every look
            injector.free_disk("eu-west")
            syncer.catch_up_regions()
        assert syncer.lagging == set() and store.versions.latest_global(0, "eu-west") == 2
    said = [r.getMessage() for r in caplog.records if r.name.startswith("diloco")]
    assert len([m for m in said if "not in {'eu-west'" in m]) == 1, said
    assert len([m for m in said if "every region holds v2 again" in m]) == 1, said


def test_train_names_an_unreachable_prefect_api(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # nothing listens there
    code = cli_main(["train", "--dir", str(tmp_path), "--run", "r", "--tokens", "20000"])
    err = capsys.readouterr().err
    assert code == 2
    assert "Prefect API at http://127.0.0.1:9/api (PREFECT_API_URL) is not reachable" in err


def test_syncers_collect_what_no_learner_needs_and_gc_does_it_by_hand(tmp_path, capsys):
    """Processed contributions go (a learner's newest stays: a rejoin reads its seq and
    step from it); the versions a syncer or learner can still need stay."""
    cfg, regions, model, _sent = _local_run(tmp_path, "gc")
    rng = np.random.default_rng(1)
    store = RunStore("gc", regions, "us-east")
    for lid, reg in run_slots(store.read_spec()).items():
        for seq in (2, 3):  # newer sends from the same anchor
            c = _contribution(model, 0, lid, seq, rng)
            RunStore("gc", regions, reg, writer=lid).contributions.put_contribution(
                lid, 0, seq, c.payload, contribution_meta(c)
            )
    # What writers killed mid-write (or failed by a full disk) left two hours ago, and a
    # temporary of a write in flight now.
    us = tmp_path / "us" / "gc" / "learners" / "learner-0"
    commits, seqs = us / "contributions" / "f0000" / "commits", us / "seqs"
    orphan = us / "contributions" / "f0000" / "data" / "s000000000009-00000000000000ab"
    orphan.mkdir(parents=True)
    seqs.mkdir(exist_ok=True)
    stale = [commits / ".tmp-0a", seqs / ".tmp-0b", orphan / "zarr.json", orphan]
    for path in stale[:3]:
        path.write_text("{}")
    for path in stale:
        os.utime(path, (time.time() - 7200, time.time() - 7200))
    young = commits / ".tmp-0c"
    young.touch()
    pipeline = {**cfg.pipeline.model_dump(), "keep_versions": 4, "retention_seconds": 0}
    syncer = SyncerRuntime("gc", regions, "us-east", 0, 2, pipeline)
    assert syncer.poll() == 4  # the newest of each learner is read, seqs 1 and 2 are not
    assert len(syncer.loop.syncers[0].superseded) == 8
    assert syncer.merge_and_publish(0)["merged"] == 4
    syncer.loop.transport.tend()  # what the loop does after every look
    for lid, reg in run_slots(store.read_spec()).items():
        assert store.contributions.contribution_seqs(lid, 0, reg) == [3], lid
    # Abandoned over an hour ago: collected as the syncer goes; in flight: kept.
    assert not [p for p in stale if p.exists()] and young.exists()
    assert store.versions.global_versions(0) == [0, 1]
    code = cli_main(["gc", regions["us-east"], "--run", "gc", "--keep", "1"])
    assert code == 0 and "deleted 0 contributions" in capsys.readouterr().out
    assert store.versions.global_versions(0) == [0, 1]  # max_staleness + 2 versions are always kept
    # by default gc keeps what the run keeps: its launch's keep_versions, or what it needs
    window = cfg.outer.max_staleness + 2
    for settings, kept in (({}, window), ({"keep_versions": window + 3}, window + 3)):
        store.put_pipeline(settings)
        assert cli_main(["gc", regions["us-east"], "--run", "gc"]) == 0
        assert f"kept {kept} versions per fragment" in capsys.readouterr().out, settings
    store.put_pipeline({"keep_versions": "many"})
    assert cli_main(["gc", regions["us-east"], "--run", "gc"]) != 0
    assert "pipeline settings of its newest launch" in capsys.readouterr().err


def test_a_cache_folder_that_cannot_be_written_leaves_a_learner_compiling_alone(
    tmp_path, monkeypatch, capsys
):
    """A JAX cache folder this machine cannot make (here: under a file) holds no lock for
    one compile per machine: the learner compiles on its own and says why, as JAX does."""
    from flows.compile import compile_turn

    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "a-file" / "jax"))
    ran = []
    with compile_turn(load_config("tiny"), "step"):
        ran.append(True)
    assert ran == [True]
    assert "no lock in the JAX cache folder" in capsys.readouterr().out
