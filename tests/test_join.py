"""``diloco join``: a machine takes a vacant learner slot of a running run from its
region's bucket alone (flows/join.py), with a join token or the run secret."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diloco.config import load_config
from flows.cli import main as cli_main
from flows.join import slot_state
from flows.launcher import WORKER_COMMAND, child_env
from flows.run import initialize_run
from storage_layout.audit import audit_run
from storage_layout.auth import (
    JOIN_TOKEN_ENV,
    RUN_SECRET_ENV,
    join_token,
    learner_key,
    new_run_secret,
    record_verifies,
)
from storage_layout.store import RunStore

REGION = "us-east"


def _run(tmp_path: Path, name: str, tokens: int = 20_000):
    (tmp_path / "us").mkdir(exist_ok=True)
    url = f"file://{tmp_path / 'us'}"
    cfg = load_config("tiny", overrides=[f"budget.tokens={tokens}", "topology.learners=2",
                                         "topology.quorum=1", "pipeline.round_steps=20"])  # fmt: skip
    store = RunStore(name, {REGION: url}, REGION, writer="launcher")
    spec = initialize_run(store, cfg)
    secret = new_run_secret()
    store.check_secret(secret, "the test")
    return url, cfg, store, spec, secret


def _join(url: str, run: str, env: dict[str, str], *extra: str, timeout: float = 600):
    argv = [sys.executable, "-m", "flows.cli", "join", url, "--run", run, "--region", REGION,
            "--pipeline", json.dumps({"round_steps": 20, "poll_seconds": 0.1}), *extra]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


def test_a_joiner_without_a_token_for_a_vacant_slot_is_refused_by_name(tmp_path, monkeypatch):
    """A run that signs its contributions admits only joiners that hold a slot's key: no
    token, a token of another run, a token for another slot, a slot of another region,
    each refused with what is wrong; nothing is written for them."""
    url, _, store, spec, secret = _run(tmp_path, "closed")
    for name in (RUN_SECRET_ENV, JOIN_TOKEN_ENV):
        monkeypatch.delenv(name, raising=False)
    base = ["join", url, "--run", "closed", "--region", REGION]
    cases = [
        ({}, [], "needs a join token in DILOCO_JOIN_TOKEN"),
        ({JOIN_TOKEN_ENV: join_token(secret, "other", ["learner-1"])}, [],
         "is a join token of run 'other', not 'closed'"),
        ({JOIN_TOKEN_ENV: join_token(secret, "closed", ["learner-1"])}, ["--slot", "learner-0"],
         "learner-0: the join token does not cover it"),
        ({JOIN_TOKEN_ENV: "diloco-join-1:bm90IGpzb24"}, [], "DILOCO_JOIN_TOKEN is damaged"),
        ({JOIN_TOKEN_ENV: join_token(secret, "closed", ["learner-0"])}, ["--region", "mars"],
         "has no region 'mars'"),
    ]  # fmt: skip
    from flows.join import join

    for env, extra, expected in cases:
        slot = extra[1] if extra[:1] == ["--slot"] else None
        region = extra[1] if extra[:1] == ["--region"] else REGION
        with pytest.raises(ValueError, match=re.escape(expected)):
            join(url, "closed", region, slot, environ=env)
        with monkeypatch.context() as m:  # the command says so and exits 2
            for k, v in env.items():
                m.setenv(k, v)
            argv = base[:-2] + ["--region", region] + (["--slot", slot] if slot else [])
            assert cli_main(argv) == 2, (env, extra)
    for lid in spec["learners"]:
        assert store.joins(lid) == [] and store.newest_generation(lid) == 0


@pytest.mark.slow
def test_a_learner_joins_a_running_run_in_a_vacant_slot_and_its_work_is_merged(
    tmp_path, prefect_api
):
    """Two learner slots; the syncer and learner 0 start, slot 1 stays vacant (never
    started). `diloco join` with a join token for slot 1 takes it: it writes a signed join
    record, trains as learner-1 from the bucket alone, and the syncer merges its
    contributions (authenticated by the token's key). Once both are done, no slot is
    vacant and a further joiner is refused, naming each slot's state."""
    url, _, store, spec, secret = _run(tmp_path, "open", tokens=40_000)
    assert sorted(spec["learners"]) == ["learner-0", "learner-1"]
    assert slot_state(store, "learner-1", REGION, 600).why == "never started"
    pipeline = json.dumps({"round_steps": 20, "poll_seconds": 0.1, "syncer_shards": 1})
    logs = {name: (tmp_path / f"{name}.log").open("w") for name in ("syncer", "learner-0")}
    syncer_env = {**child_env("open", "syncer-0", secret), RUN_SECRET_ENV: secret}
    procs = {
        "syncer": subprocess.Popen(
            [*WORKER_COMMAND, "syncer", "--run", "open", "--regions", json.dumps({REGION: url}),
             "--home", REGION, "--pipeline", pipeline],
            stdout=logs["syncer"], stderr=subprocess.STDOUT, env=syncer_env),
        "learner-0": subprocess.Popen(
            [*WORKER_COMMAND, "learner", "--run", "open", "--bucket", url, "--region", REGION,
             "--index", "0", "--pipeline", pipeline],
            stdout=logs["learner-0"], stderr=subprocess.STDOUT,
            env=child_env("open", "learner-0", secret)),
    }  # fmt: skip
    try:
        env = {
            **child_env("open", "joiner"),
            JOIN_TOKEN_ENV: join_token(secret, "open", ["learner-1"]),
        }
        joined = _join(url, "open", env)
        assert joined.returncode == 0, joined.stdout[-3000:] + joined.stderr[-3000:]
        assert "joining run open as learner-1 in us-east" in joined.stdout, joined.stdout
        for name, proc in procs.items():
            assert proc.wait(timeout=600) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        for f in logs.values():
            f.close()
    (record,) = store.joins("learner-1")
    assert record["learner"] == "learner-1" and record["took"] == "never started"
    assert record_verifies(record, learner_key(secret, "open", "learner-1"))
    assert not record_verifies(record, learner_key(secret, "open", "learner-0"))
    assert "learner learner-1 joined from host" in (tmp_path / "syncer.log").read_text()
    report = audit_run("open", {REGION: url})
    assert report.ok, dict(report.violations)
    merged = {lid: acc["tokens"]["merged"] for lid, acc in report.learners.items()}
    assert merged["learner-1"] > 0 and merged["learner-0"] > 0, merged
    assert report.learners["learner-1"]["state"] == "done"
    # Nothing is vacant now: a second joiner is refused, each slot named with its state.
    again = _join(
        url,
        "open",
        {**env, JOIN_TOKEN_ENV: join_token(secret, "open", ["learner-0", "learner-1"])},
        timeout=120,
    )
    assert again.returncode == 2, again.stdout + again.stderr
    said = " ".join((again.stdout + again.stderr).split())
    assert "no vacant learner slot" in said and "learner-1: done" in said, said
    assert len(store.joins("learner-1")) == 1


def test_slot_states_follow_the_statuses(tmp_path):
    """A slot is vacant when never started, preempted, or silent past the timeout; not
    when done, training, or claimed by a start that has written no status yet."""
    url, _, store, _, _ = _run(tmp_path, "slots")
    now = time.time()
    lid = "learner-0"
    assert slot_state(store, lid, REGION, 600, now).vacant  # never started
    store.claim_generation(lid)
    assert not slot_state(store, lid, REGION, 600, now).vacant  # starting
    writer = RunStore("slots", {REGION: url}, REGION, writer=lid)
    for state, at, vacant in (("training", now - 10, False), ("training", now - 900, True),
                              ("preempted", now, True), ("done", now - 900, False)):  # fmt: skip
        writer.write_metrics(lid, {"state": state, "time": at, "step": 3})
        got = slot_state(store, lid, REGION, 600, now)
        assert got.vacant is vacant, (state, at, got)
