"""``diloco join``: a machine takes a vacant learner slot of a running run from its
region's bucket alone (flows/join.py), with a join token or the run secret."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from diloco.config import ConfigError, LivenessConfig, load_config
from flows.cli import main as cli_main
from flows.join import join, join_flow
from flows.join_tokens import issue_token, revoke_token
from flows.run import initialize_run
from flows.slots import choose_slot, slot_state
from flows.supervision import child_env
from protocol.topology import run_slots
from storage_layout.audit import audit_run
from storage_layout.auth import (
    JOIN_TOKEN_ENV,
    RUN_SECRET_ENV,
    JoinRefused,
    JoinToken,
    claims_key,
    join_token,
    learner_key,
    new_run_secret,
    parse_join_token,
    record_verifies,
    sign_record,
)
from storage_layout.faults import ENV_VAR as FAULTS_ENV
from storage_layout.inspect import inspect_bucket
from storage_layout.store import RunStore
from tests.iam import writes_outside_policy
from tests.test_pipeline import _wait, _workers, told_to_leave

REGION = "us-east"


def _run(tmp_path: Path, name: str, tokens: int = 20_000, *sets: str):
    (tmp_path / "us").mkdir(parents=True, exist_ok=True)
    url = f"file://{tmp_path / 'us'}"
    cfg = load_config("tiny", overrides=[f"budget.tokens={tokens}", "topology.learners=2",
                                         "topology.quorum=1", "pipeline.round_steps=20",
                                         *sets])  # fmt: skip
    store = RunStore(name, {REGION: url}, REGION, writer="launcher")
    spec = initialize_run(store, cfg)
    secret = new_run_secret()
    store.check_secret(secret, "the test")
    store.claims_key = claims_key(secret, name)  # the launcher's: it holds the secret
    return url, cfg, store, spec, secret


def _token(store: RunStore, secret: str, learners: list[str], **kw: float) -> str:
    """A join token for ``learners``, its record kept in the run's bucket (as
    ``diloco join-token`` does)."""
    token = join_token(secret, store.run, learners, **kw)
    issue_token(store, token)
    return token.text


def _join_flow(url: str, run: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    """The `join` flow (what a `join/REGION` deployment's flow run calls; `diloco join`
    runs the same function, ``join_and_train``) in a process of its own, running, its
    output into ``log`` (a pipe read only at its end could fill and stall it)."""
    call = (f"from flows.join import join_flow; join_flow(run={run!r}, region={REGION!r}, "
            f"bucket={url!r}, pipeline={{'round_steps': 20, 'poll_seconds': 0.05}})")  # fmt: skip
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, "-c", call], stdout=out,
                                stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip


def test_a_joiner_without_a_token_for_a_vacant_slot_is_refused_by_name(tmp_path, monkeypatch):
    """A run that signs its contributions admits only joiners that hold a slot's key: no
    token, a token of another run (relabelled or not), one altered, expired, revoked or of
    an older kind, a token for another slot, a slot of another region, each refused with
    what is wrong, before anything is taken; nothing is written for them."""
    url, _, store, spec, secret = _run(tmp_path, "closed")
    for name in (RUN_SECRET_ENV, JOIN_TOKEN_ENV):
        monkeypatch.delenv(name, raising=False)
    base = ["join", url, "--run", "closed", "--region", REGION]
    other = join_token(new_run_secret(), "other", ["learner-0"])  # another run's (its owner's)
    relabelled = JoinToken("closed", other.id, other.issued, None, other.keys, other.claims)
    mine = join_token(secret, "closed", ["learner-0"])
    issue_token(store, mine)
    altered = JoinToken("closed", mine.id, mine.issued, None, other.keys, other.claims)
    past = time.time() - 100
    revoked = _token(store, secret, ["learner-0"])
    revoke_token(store, parse_join_token(revoked, "closed").id)
    cases = [
        ({}, [], "needs a join token in DILOCO_JOIN_TOKEN"),
        ({JOIN_TOKEN_ENV: other.text}, [], "is a join token of run 'other', not 'closed'"),
        ({JOIN_TOKEN_ENV: relabelled.text}, [], f"join token {other.id} was not issued for run "
         "'closed'"),
        ({JOIN_TOKEN_ENV: altered.text}, [], "holds keys that are not run 'closed''s for "
         "learner-0"),
        ({JOIN_TOKEN_ENV: _token(store, secret, ["learner-0"], expires_in=10, now=past)}, [],
         "expired at"),
        ({JOIN_TOKEN_ENV: revoked}, [], "was revoked by the run's owner"),
        ({JOIN_TOKEN_ENV: _token(store, secret, ["learner-1"])}, ["--slot", "learner-0"],
         "learner-0: the join token does not cover it"),
        ({JOIN_TOKEN_ENV: "diloco-join-3:bm90IGpzb24"}, [], "DILOCO_JOIN_TOKEN is damaged"),
        ({JOIN_TOKEN_ENV: "diloco-join-2:e30="}, [], "was made by an older diloco"),
        ({JOIN_TOKEN_ENV: "diloco-join-1:e30="}, [], "was made by an older diloco"),
        ({JOIN_TOKEN_ENV: mine.text}, ["--region", "mars"], "has no region 'mars'"),
    ]  # fmt: skip
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
    # a speed hint that is no positive number, with the key that would let it in
    with pytest.raises(ValueError, match=re.escape("--speed nan is not a positive number")):
        join(url, "closed", REGION, environ={RUN_SECRET_ENV: secret}, speed=float("nan"))
    monkeypatch.setenv(RUN_SECRET_ENV, secret)
    assert cli_main([*base, "--speed", "-1"]) == 2
    for lid in run_slots(spec):
        assert store.members.joins(lid) == [] and store.members.newest_generation(lid) == 0


def test_a_joiner_trains_with_the_runs_pipeline_settings_under_its_own(tmp_path):
    """A joiner starts from the pipeline settings of the run's newest launch (which the
    spec leaves out) and lays its own ``--pipeline`` over them; settings that cannot be
    read are named, and nothing is written for that joiner."""
    from storage_layout.commit import CorruptVersion

    url, _, store, _, secret = _run(tmp_path, "settings")
    env = {RUN_SECRET_ENV: secret}
    store.put_pipeline({"round_steps": 7, "eval_seconds": 3.0, "checkpoint_every": 11})
    worker, _ = join(url, "settings", REGION, "learner-0", {"eval_seconds": 9.0}, environ=env)
    given = worker.params["pipeline"]
    assert (given["round_steps"], given["checkpoint_every"], given["eval_seconds"]) == (7, 11, 9.0)
    store.home.put(store.layout.pipeline, b'["not", "settings"]')
    with pytest.raises(CorruptVersion, match=re.escape("pipeline.json is not a Pipeline")):
        join(url, "settings", REGION, "learner-1", environ=env)
    assert (
        store.members.joins("learner-1") == [] and store.members.newest_generation("learner-1") == 0
    )
    store.home.put(store.layout.pipeline, json.dumps({"pipeline": {"round_steps": -1}}).encode())
    with pytest.raises(ValueError, match="round_steps"):
        join(url, "settings", REGION, "learner-1", environ=env)
    assert store.members.joins("learner-1") == []


def test_a_joiner_whose_run_trains_its_budget_while_it_warms_up_is_refused_and_takes_nothing(
    tmp_path,
):
    """The warm-up takes tens of seconds; a run that has trained its budget by its end
    is refused then, by name, with no join record, generation or member record written
    (it was refused after its warm-up with nothing to train, its Prefect API gone)."""
    url, cfg, store, spec, secret = _run(tmp_path, "ends", 20_000, "data.assign=slots")
    warmed = []

    def run_ends_meanwhile(settings: dict) -> None:
        warmed.append(settings)
        state = store.versions.get_global(0, 0)
        spent = {lid: cfg.budget_steps for lid in run_slots(spec)}
        store.versions.publish_global(0, 1, state.params, state.opt_leaves,
                             {**state.meta, "version": 1, "progress": spent})  # fmt: skip

    with pytest.raises(JoinRefused, match="trained its budget while this joiner warmed up"):
        join(url, "ends", REGION, environ={RUN_SECRET_ENV: secret}, warm=run_ends_meanwhile)
    assert len(warmed) == 1
    for lid in run_slots(spec):
        assert store.members.joins(lid) == [] and store.members.newest_generation(lid) == 0
    # and one that comes now is refused before it warms up
    with pytest.raises(JoinRefused, match=r"has trained its budget \("):
        join(url, "ends", REGION, environ={RUN_SECRET_ENV: secret}, warm=warmed.append)
    assert len(warmed) == 1


def test_two_joiners_that_choose_one_slot_at_the_same_moment_take_two(tmp_path):
    """Defect: two joiners that chose the same vacant slot at the same moment (spot
    machines that come up together) both wrote a join record for it and both started as
    its learner, where the newer generation stops the older: a machine lost. A join
    record is now the one after the newest its joiner saw when it chose, or none: the
    second joiner, finding it written, chooses again and takes the next vacant slot. Here
    the first joins learner-0 (preempted, joined once before) just before the second
    writes; the second takes learner-1 (never started)."""
    url, _, store, _, secret = _run(tmp_path, "race")
    env = {RUN_SECRET_ENV: secret}
    RunStore("race", {REGION: url}, REGION, writer="learner-0").progress.write_metrics(
        "learner-0", {"state": "preempted", "time": time.time(), "step": 40})  # fmt: skip
    store.members.put_join(
        "learner-0",
        lambda n: json.dumps({"join": n, "host": "before", "time": time.time() - 100}).encode(),
    )
    first: list[str] = []

    def the_first_joins_meanwhile() -> bool:  # (asked just before the second writes)
        if not first:
            first.append(join(url, "race", REGION, environ=env)[0].writer)
        return False

    second, _ = join(url, "race", REGION, environ=env, interrupted=the_first_joins_meanwhile)
    assert first == ["learner-0"] and second.writer == "learner-1"
    assert [r["join"] for r in store.members.joins("learner-0")] == [1, 2]
    assert [r["join"] for r in store.members.joins("learner-1")] == [1]


def test_a_joiner_whose_data_is_not_the_runs_is_refused_by_name(tmp_path):
    """Defect: a machine whose corpus at ``data.source`` differed (another Python's
    standard library, the default corpus; a folder edited since) joined and trained on
    it, silently: windows no other machine's share or ledger describes. A run's spec now
    records its data's sha256 (``data.sha256``); a joiner whose data differs is refused by
    name before it warms up, having written nothing, and so is a launch of the run on
    that data. A run started before the spec recorded it resumes and takes any."""
    from diloco.data import DataError
    from diloco.run_data import RunData, cached_corpus, settle_assign
    from tests.test_dataset import STDLIB

    text = tmp_path / "text"
    text.mkdir()
    for f in sorted((STDLIB / "json").glob("*.py")):
        (text / f.name).write_text(f.read_text())
    url, cfg, store, spec, secret = _run(tmp_path, "data", 20_000, f"data.source={text}")
    assert spec["data"]["sha256"] == RunData(settle_assign(cfg, buckets=True)).fingerprint
    (text / "decoder.py").write_text((text / "decoder.py").read_text() + "# edited since\n")
    cached_corpus.cache_clear()  # (this process read it before the edit)
    warmed = []
    with pytest.raises(JoinRefused, match=r"a joiner of run 'data': the data at .*text is "
                       r"not the data the run started on \(sha256 [0-9a-f]{12}\.\.\., the "
                       r"run's [0-9a-f]{12}\.\.\.\)"):  # fmt: skip
        join(url, "data", REGION, environ={RUN_SECRET_ENV: secret}, warm=warmed.append)
    assert warmed == [] and all(store.members.joins(lid) == [] for lid in run_slots(spec))
    with pytest.raises(DataError, match=r"run 'data': the data at .*text is not the data"):
        initialize_run(store, cfg)
    # a spec written before it recorded its data: resumed, and held to no data
    (tmp_path / "us" / "data" / "spec.json").write_text(
        json.dumps({k: v for k, v in store.read_spec().items() if k != "data"}))  # fmt: skip
    initialize_run(store, cfg)
    assert "data" not in store.read_spec()
    assert join(url, "data", REGION, environ={RUN_SECRET_ENV: secret})[0].writer == "learner-0"


def test_a_joiner_refused_in_its_region_is_told_where_else_the_run_has_slots(tmp_path):
    """A joiner that finds no slot in its region (here: the only one trains) is told
    which other regions have slots: their states are in those regions' buckets, which
    this machine may not reach, so they are named, not judged."""
    regions = {"us-east": f"file://{tmp_path / 'us'}", "eu-west": f"file://{tmp_path / 'eu'}"}
    for name in ("us", "eu"):
        (tmp_path / name).mkdir()
    cfg = load_config("tiny", overrides=["budget.tokens=20000", "topology.learners=2",
                                         "data.assign=slots"])  # fmt: skip
    spec = initialize_run(RunStore("two", regions, "us-east", writer="launcher"), cfg)
    assert run_slots(spec) == {"learner-0": "us-east", "learner-1": "eu-west"}
    eu = RunStore("two", {"eu-west": regions["eu-west"]}, "eu-west", writer="learner-1")
    eu.progress.write_metrics("learner-1", {"state": "training", "time": time.time(), "step": 3})
    with pytest.raises(JoinRefused) as refused:
        join(regions["eu-west"], "two", "eu-west")
    said = " ".join(str(refused.value).split())
    assert "learner-1: training at step 3" in said, said
    assert "the run has slots in 'us-east' too" in said and "--region" in said, said
    # A joiner naming us-east with eu-west's bucket would take us-east's learner-0 in the
    # wrong bucket (no fence between it and us-east's own): refused, told the right name.
    with pytest.raises(JoinRefused, match=r"is not region 'us-east'.*pass --region eu-west"):
        join(regions["eu-west"], "two", "us-east")
    with pytest.raises(JoinRefused, match="has no region 'ap-south'"):
        join(regions["eu-west"], "two", "ap-south")
    assert eu.members.newest_generation("learner-0") == 0 and eu.members.joins("learner-0") == []


def test_a_joiner_adds_a_learner_in_a_region_the_run_started_none_in(tmp_path):
    """Slots are dealt round-robin, so a run of fewer learners than regions starts none
    in some region. On units (the default) a joiner there adds a learner, under the id
    the deal gives that region (learner-i lives in region i mod R); a run that deals its
    data to its slots, or one whose spec was written before the deal was recorded,
    refuses it with how to start the run so that every region has a slot, writing
    nothing (and such a spec resumes as it was written)."""
    import json

    regions = {"us-east": f"file://{tmp_path / 'us'}", "eu-west": f"file://{tmp_path / 'eu'}"}
    for name in ("us", "eu"):
        (tmp_path / name).mkdir()
    env = {RUN_SECRET_ENV: new_run_secret()}

    def start(run, *sets):
        store = RunStore(run, regions, "us-east", writer="launcher")
        cfg = load_config("tiny", overrides=["budget.tokens=20000", "topology.learners=1", *sets])
        spec = initialize_run(store, cfg)
        store.check_secret(env[RUN_SECRET_ENV], "the test")
        assert run_slots(spec) == {"learner-0": "us-east"}
        return spec

    first = start("one", "data.assign=units")
    assert first["deal"] == ["us-east", "eu-west"] and "learners" not in first  # counted
    worker, _ = join(regions["eu-west"], "one", "eu-west", environ=env)
    assert worker.params["index"] == 1
    eu = RunStore("one", {"eu-west": regions["eu-west"]}, "eu-west")
    assert [r["learner"] for r in eu.members.joins("learner-1")] == ["learner-1"]
    assert eu.members.run_learners(eu.read_spec()).regions == {"learner-0": "us-east",
                                                       "learner-1": "eu-west"}  # fmt: skip
    start("slots", "data.assign=slots")
    spec_file = tmp_path / "us" / "old" / "spec.json"
    # Specs written by older code: one that listed its slots and recorded its deal, and one
    # from before the deal was recorded. `diloco train` resumes each as it was written.
    for run, drop in (("listed", ()), ("old", ("deal",))):
        written = {k: v for k, v in start(run, "data.assign=units").items() if k not in drop}
        written["learners"] = {"learner-0": "us-east"}
        for folder in ("us", "eu"):
            (tmp_path / folder / run / "spec.json").write_text(json.dumps(written))
        resumed = start(run, "data.assign=units")
        assert resumed["learners"] == written["learners"] and ("deal" in resumed) == (not drop)
        assert json.loads((tmp_path / "us" / run / "spec.json").read_text()) == written
    old = json.loads(spec_file.read_text())
    assert old.get("deal") is None
    for run in ("slots", "old"):
        with pytest.raises(JoinRefused) as refused:
            join(regions["eu-west"], run, "eu-west", environ=env)
        said = " ".join(str(refused.value).split())
        assert f"run {run!r} has no learner slot in region 'eu-west'" in said, said
        assert "topology.learners is at least its number of regions" in said, said
        assert "pipeline.learners_started" in said, said
        assert ("started before runs recorded how they deal" in said) == (run == "old"), said
        assert not (tmp_path / "eu" / run / "learners").exists()  # nothing written for it
        assert not (tmp_path / "eu" / run / "members").exists()
    for deal in (["eu-west", "us-east"], ["us-east", "mars"], "us-east"):  # forged or damaged
        bad = {**old, "deal": deal}
        (tmp_path / "eu" / "old" / "spec.json").write_text(json.dumps(bad))
        with pytest.raises(JoinRefused, match="run 'old' cannot be joined: the run spec's"):
            join(regions["eu-west"], "old", "eu-west", environ=env)
    counted = json.loads((tmp_path / "us" / "one" / "spec.json").read_text())
    assert run_slots(counted) == {"learner-0": "us-east"}
    for count in (0, "1", None, True):  # a spec that counts its slots, damaged: named
        counted["config"]["topology"]["learners"] = count
        with pytest.raises(ValueError, match=r"config.topology.learners .* give the run no"):
            run_slots(counted)


def test_a_ctrl_c_while_a_joiner_warms_up_is_not_lost_and_it_takes_no_slot(
    tmp_path, monkeypatch, capsys
):
    """A Ctrl-C during the warm-up raised its KeyboardInterrupt where it came: inside one
    of JAX's garbage collector callbacks Python swallowed it ("Exception ignored in
    _xla_gc_callback") and the joiner warmed on, took a slot and trained; inside a
    compilation, XLA crashed the process at its exit. A first Ctrl-C is now noted: the
    step of the warm-up under way ends, no other begins, and the joiner leaves having
    written nothing. A second
    raises at once; swallowed too (as that callback did), it is still not lost."""
    import flows.learner_runtime
    from flows.join import join_and_train

    url, _, store, spec, secret = _run(tmp_path, "ctrlc")
    before = signal.getsignal(signal.SIGINT)  # (ignored, where pytest runs in the background)
    monkeypatch.setenv(RUN_SECRET_ENV, secret)
    for presses in (1, 2):
        warmed = []

        def warm_up(run, url, region, settings, go_on, presses=presses, warmed=warmed):
            try:  # a step of the warm-up (a compilation) under way
                for _ in range(presses):
                    os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C
                    time.sleep(0.5)  # (the handler runs at the next bytecode)
            except KeyboardInterrupt:
                warmed.append("raised")  # ...where it is swallowed
            warmed.append("step")  # the step ends
            go_on()  # and the next does not begin
            warmed.append("next step")

        monkeypatch.setattr(flows.learner_runtime, "warm_up", warm_up)
        monkeypatch.setattr("flows.join.prefect_api_up", lambda w=warmed: w.append("api"))
        monkeypatch.setattr("flows.join.become", lambda *a, w=warmed, **k: w.append("trained"))
        assert join_and_train(url, "ctrlc", REGION) == ("", 130)
        assert warmed == ["raised", "step"] if presses == 2 else ["step"], presses
        said = capsys.readouterr().out
        assert "Ctrl-C: this joiner leaves before it takes a slot" in said
        assert "having written nothing" in said
        for lid in run_slots(spec):
            assert store.members.joins(lid) == [] and store.members.newest_generation(lid) == 0
        assert signal.getsignal(signal.SIGINT) == before  # put back
    # one noted before (`diloco join` notes them from its start, JAX's import included):
    # no warm-up at all
    noted = threading.Event()
    noted.set()
    warmed.clear()
    assert join_and_train(url, "ctrlc", REGION, stop=noted) == ("", 130) and warmed == []


def _train(tmp_path: Path, run: str, tokens: int, *sets: str) -> tuple[subprocess.Popen, str]:
    """`diloco train` of ``run`` on one file:// region, in the background (its log in
    tmp_path/RUN.log); returns the process and the region's URL."""
    url = f"file://{tmp_path / run / 'us'}"
    argv = [sys.executable, "-m", "flows.cli", "train", "--dir", str(tmp_path), "--run", run,
            "--tokens", str(tokens), "--create-buckets", f"--region={REGION}={url}"]  # fmt: skip
    argv += [f"--set={o}" for o in ("topology.learners=3", "topology.quorum=1",
             "pipeline.learners_started=1", "pipeline.syncer_shards=1",
             "pipeline.round_steps=20", "pipeline.poll_seconds=0.05",
             "pipeline.eval_seconds=5", *sets)]  # fmt: skip
    log = (tmp_path / f"{run}.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=child_env())
    log.close()
    return proc, url


def _finish(proc: subprocess.Popen, log: Path) -> str:
    try:
        code = proc.wait(timeout=900)  # a guard against a hang, not a measure
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text(errors="replace")
    assert code == 0, text[-4000:]
    return text


@pytest.mark.slow
def test_a_learner_joins_a_running_run_in_a_vacant_slot_and_its_work_is_merged(
    tmp_path, prefect_api, monkeypatch
):
    """`diloco train` with three learner slots, of which it starts one
    (pipeline.learners_started=1), on the default corpus (text), which a run through
    buckets takes in units (the default: no data.assign is set), so it grows. Once
    learner-0's first
    contribution is committed, a machine with a join token for learner-1 and learner-3
    (`diloco join-token`) runs the `join` flow (as `diloco join` does): it warms up
    first, then takes the vacant slot 1 (never started), writes a signed join record,
    trains as learner-1 in the flow run's process (its learner flow runs are subflows),
    from the bucket alone, and the syncer merges its contributions, authenticated by the
    token's key. A second machine with that token runs `diloco join`: slot 1 is held and
    the token does not cover slot 2, so it adds learner-3 beyond the run's slots (its
    signed member record), the syncer admits it and merges its work. Slot 2 stays
    vacant: once the shared budget is spent it does not hold the run's end. The run ends
    with the three learners done and a clean audit; then no slot the token covers is
    vacant, none is left to add, and a further joiner (the `join` flow of the
    `join/REGION` deployments) is refused, naming each slot's state."""
    run = "open"
    # The paused joiner keeps its slot however long the adder takes to start and warm up
    # on a loaded machine: a learner is silent (its slot vacant) only after 5 minutes.
    proc, url = _train(tmp_path, run, 90_000, "liveness.silent_min_seconds=300")
    store = RunStore(run, {REGION: url}, REGION)
    trace = tmp_path / "trace.jsonl"  # what the joiners and the token's issuer write

    def traced(salt: str) -> dict[str, str]:  # (a joiner's salt names the slot it takes)
        return {FAULTS_ENV: json.dumps({"trace_path": str(trace), "salt": salt})}

    paused: list[int] = []
    joiner = adder = None
    try:
        _wait(lambda: _sent(store, "learner-0"), 600, "learner-0's first contribution", proc)
        # Learner 0 waits (SIGSTOP) from here until the joiners have sent, so that they
        # find budget left however long their starts take on this machine.
        paused.append(_workers(tmp_path / f"{run}.log")["learner 0"])
        os.kill(paused[-1], signal.SIGSTOP)
        token = subprocess.run(
            [sys.executable, "-m", "flows.cli", "join-token", url, "--run", run, "--dir",
             str(tmp_path), "--learner", "learner-1", "--learner", "learner-3",
             "--expires", "2h"],
            capture_output=True, text=True, timeout=120, env={**child_env(), **traced("")})  # fmt: skip
        assert token.returncode == 0, token.stderr
        env = {**child_env(), JOIN_TOKEN_ENV: token.stdout.strip()}
        joiner = _join_flow(url, run, {**env, **traced("learner-1/join")}, tmp_path / "joiner.log")
        _wait(lambda: _sent(store, "learner-1"), 600, "the joiner's first contribution", proc)
        # Learner 1 waits too, from its first send (a warm joiner can train the budget's
        # rest within seconds), until the second joiner has sent; the learner-1 worker
        # runs in the flow's process
        paused.append(joiner.pid)
        os.kill(paused[-1], signal.SIGSTOP)
        # and the syncer counts it (it reads who is a member every 5 s)
        syncer_log = tmp_path / run / "logs" / f"syncer-{REGION}-0.log"
        _wait(lambda: "learner learner-1 joined from host" in syncer_log.read_text(), 600,
              "the syncer's note of the join", proc)  # fmt: skip
        # The second machine has no Prefect server: `diloco join` starts Prefect's
        # temporary one for its learner's flow runs, and does it while it warms up.
        alone = {k: v for k, v in env.items() if k != "PREFECT_API_URL"} | traced("learner-3/join")
        alone["PREFECT_HOME"] = str(tmp_path / "adder-prefect")
        with (tmp_path / "adder.log").open("w") as out:
            adder = subprocess.Popen(
                [sys.executable, "-m", "flows.cli", "join", url, "--run", run, "--region",
                 REGION, "--pipeline", '{"round_steps": 20, "poll_seconds": 0.05}',
                 "--speed", "2.5"], stdout=out, stderr=subprocess.STDOUT, env=alone)  # fmt: skip
        _wait(lambda: _sent(store, "learner-3"), 600, "the added learner's first send", proc)
        _wait(lambda: "learner learner-3 is admitted" in syncer_log.read_text(), 600,
              "the syncer's note of the learner added", proc)  # fmt: skip
        while paused:
            os.kill(paused.pop(), signal.SIGCONT)
        joiner.wait(timeout=900)
        adder.wait(timeout=900)
        said = (tmp_path / "joiner.log").read_text()
    finally:
        for pid in paused:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        for p in (joiner, adder):
            if p is not None and p.poll() is None:  # the test failed: leave nothing
                p.kill()
        text = _finish(proc, tmp_path / f"{run}.log")
    assert joiner.returncode == 0, said[-6000:]
    added = (tmp_path / "adder.log").read_text()
    assert adder.returncode == 0, added[-6000:]
    assert f"joining run {run} as learner-3 in {REGION}" in added, added[-3000:]
    assert -1 < added.find("Starting temporary server") < added.find("warm after") < added.find(
        "joining run"), added[-3000:]  # fmt: skip
    assert "telemetry" not in added, added[-3000:]
    (record,) = store.members.joins("learner-3")
    assert record["took"] == "added to the run (no slot was vacant)"
    member = json.loads((tmp_path / run / "us" / run / "members" / "learner-3.json").read_text())
    secret = (tmp_path / run / "run-secret").read_text().strip()
    assert record_verifies(member, learner_key(secret, run, "learner-3"))
    assert f"joining run {run} as learner-1 in {REGION}" in said, said
    # it warmed up (model, compiled step, corpus) before it took the slot, and trained
    # in the process that warmed up
    assert -1 < said.find("warming up to join") < said.find("warm after") < said.find(
        "joining run"), said  # fmt: skip
    (record,) = store.members.joins("learner-1")
    assert record["learner"] == "learner-1" and record["took"] == "never started"
    assert record["pid"] == joiner.pid
    _assert_subflows_of_the_join_flow(run, "learner us-east/1")
    settings = store.read_pipeline()  # the launch's, for joiners; less its fault injection
    assert settings["round_steps"] == 20 and "faults" not in settings, settings
    assert record_verifies(record, learner_key(secret, run, "learner-1"))
    assert not record_verifies(record, learner_key(secret, run, "learner-0"))
    assert "learner learner-1 joined from host" in syncer_log.read_text(), text[-3000:]
    # the run's summary counts the joiners (their time too, beside their merged work)
    summary = json.loads((tmp_path / run / "summary.json").read_text())
    assert (summary["started"], summary["joined"]) == (1, ["learner-1", "learner-3"]), summary
    assert "1 started + 2 joined (3 slots + 1 added)" in text, text[-3000:]
    report = audit_run(run, {REGION: url})
    assert report.ok, dict(report.violations)
    merged = {lid: acc["tokens"]["merged"] for lid, acc in report.learners.items()}
    assert merged["learner-1"] > 0 and merged["learner-0"] > 0 and merged["learner-3"] > 0, merged
    assert [report.learners[f"learner-{i}"]["state"] for i in range(4)] == [
        "done", "done", None, "done"]  # fmt: skip
    assert report.learners["learner-3"]["added"] and "added" not in report.learners["learner-1"]
    # `diloco inspect` says where an added learner came from: its host, devices, speed hint
    shown = subprocess.run([sys.executable, "-m", "flows.cli", "inspect", url, "--run", run,
                            "--json"], capture_output=True, text=True, timeout=120, env=child_env())  # fmt: skip
    rows = {r["learner"]: r for r in json.loads(shown.stdout)["runs"][0]["learners"]}
    assert (rows["learner-3"]["host"], rows["learner-3"]["speed"]) == (socket.gethostname(), 2.5)
    assert rows["learner-3"]["devices"] and "speed" not in rows["learner-1"], rows
    assert report.learners["learner-2"]["tokens"]["merged"] == 0  # never started
    # each of their writes is one its role's bucket policy grants (infra/terraform)
    outside, roles = writes_outside_policy(trace, run)
    assert roles == {"learner", "launcher"} and outside == [], (roles, outside)
    assert [j["took"] for j in report.learners["learner-1"]["joins"]] == ["never started"]
    assert report.learners["learner-0"]["joins"] == []  # started by diloco train
    # The budget is trained: a further joiner, here the `join` flow, fails its flow run
    # saying so, before it warms up or looks for a slot; and no slot the token covers is
    # vacant, each named with its state.
    monkeypatch.delenv(RUN_SECRET_ENV, raising=False)
    token = _token(store, secret, ["learner-0", "learner-1"])
    monkeypatch.setenv(JOIN_TOKEN_ENV, token)
    with pytest.raises(JoinRefused, match="has trained its budget"):
        join_flow(run=run, region=REGION, bucket=url)
    with pytest.raises(JoinRefused) as refused:
        choose_slot(store, store.read_spec(), REGION, parse_join_token(token, run).keys,
                    LIVENESS, grow=True)  # fmt: skip
    said = " ".join(str(refused.value).split())
    assert "no vacant learner slot" in said and "learner-1: done" in said, said
    assert "learner-2: the join token does not cover it" in said, said
    assert "the join token covers none this region may add" in said, said
    assert len(store.members.joins("learner-1")) == 1


def _assert_subflows_of_the_join_flow(run: str, name: str) -> None:
    """Each flow run ``name`` of ``run`` is a subflow of a `join` flow run (one)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    with get_client(sync_client=True) as client:
        tagged = FlowRunFilter(tags=FlowRunFilterTags(all_=[f"run:{run}"]))
        runs = [f for f in client.read_flow_runs(flow_run_filter=tagged, limit=200)
                if f.name == name]  # fmt: skip
        assert runs, f"no flow run {name!r} of run {run!r}"
        parents = set()
        for flow_run in runs:
            assert flow_run.parent_task_run_id is not None, flow_run.name
            parent = client.read_flow_run(
                client.read_task_run(flow_run.parent_task_run_id).flow_run_id
            )
            assert client.read_flow(parent.flow_id).name == "join", parent.name
            parents.add(parent.id)
        assert len(parents) == 1, parents


def _sent(store: RunStore, lid: str) -> bool:
    try:
        fragments = len(store.read_spec()["fragments"])
        return any(store.contributions.contribution_seqs(lid, p, REGION) for p in range(fragments))
    except (OSError, ValueError):
        return False


def test_a_joiner_that_finds_no_slot_vacant_adds_one_to_a_run_taking_its_data_in_units(
    tmp_path, monkeypatch
):
    from tests.test_units import prepare_stdlib

    """Both slots of a run that takes its data in units are training: a joiner adds
    learner-2 (its signed member record, then its join record) and is that learner's
    worker; a second, seeing learner-2 on its way (a join record, no start yet), adds
    learner-3. A join token adds only the ids it covers. A run whose data is dealt to its
    slots adds none, and says why. A member record that is forged, out of place or not a
    learner's is refused by name, never counted as a slot."""
    for name in (RUN_SECRET_ENV, JOIN_TOKEN_ENV):
        monkeypatch.delenv(name, raising=False)
    units = ("data.assign=units", f"data.source={prepare_stdlib(tmp_path / 'data', 2048)}",
             "model.vocab_size=512")  # fmt: skip
    url, _, store, spec, secret = _run(tmp_path, "grow", 20_000, *units)
    now = time.time()
    for lid in run_slots(spec):
        writer = RunStore("grow", {REGION: url}, REGION, writer=lid)
        writer.progress.write_metrics(lid, {"state": "training", "time": now, "step": 3})
    env = {RUN_SECRET_ENV: secret}
    worker, given = join(url, "grow", REGION, environ=env)
    assert worker.writer == "learner-2" and RUN_SECRET_ENV not in given
    members = tmp_path / "us" / "grow" / "members"
    record = json.loads((members / "learner-2.json").read_text())
    assert record["learner"] == "learner-2" and record["region"] == REGION
    assert record_verifies(record, learner_key(secret, "grow", "learner-2"))
    (joined,) = store.members.joins("learner-2")
    assert joined["took"] == "added to the run (no slot was vacant)"
    assert store.members.run_learners(spec).regions == {**run_slots(spec), "learner-2": REGION}
    assert "joining" in slot_state(store, "learner-2", REGION, LIVENESS).why
    worker, _ = join(url, "grow", REGION, environ=env)
    assert worker.writer == "learner-3"
    # a token covering learner-4 adds it; one covering only taken ids adds nothing
    token = {JOIN_TOKEN_ENV: _token(store, secret, ["learner-3", "learner-4"])}
    assert join(url, "grow", REGION, environ=token)[0].writer == "learner-4"
    with pytest.raises(JoinRefused, match="the join token covers none this region may add"):
        join(url, "grow", REGION, environ=token)
    assert sorted(p.name for p in members.iterdir()) == [f"learner-{i}.json" for i in (2, 3, 4)]
    # a run whose data is dealt to its slots cannot give an added one any
    url2, _, _, spec2, secret2 = _run(tmp_path / "dealt", "dealt", 20_000, "data.assign=slots")
    for lid in run_slots(spec2):
        RunStore("dealt", {REGION: url2}, REGION, writer=lid).progress.write_metrics(
            lid, {"state": "training", "time": now, "step": 3})  # fmt: skip
    with pytest.raises(JoinRefused, match=re.escape("(data.assign = 'slots') adds none")):
        join(url2, "dealt", REGION, environ={RUN_SECRET_ENV: secret2})
    assert not (tmp_path / "dealt" / "us" / "dealt" / "members").exists()
    # member records that are not to be taken: each named, none a slot
    bad = {
        "learner-7": {"learner": "learner-7", "region": REGION},  # not signed
        "learner-8": {"learner": "learner-9", "region": REGION},  # not its own name
        "learner-0": {"learner": "learner-0", "region": REGION},  # a slot of the spec
        "syncer-0": {"learner": "syncer-0", "region": REGION},  # not a learner id
    }
    for lid, body in bad.items():
        signed = sign_record(body, learner_key(secret, "grow", lid))
        (members / f"{lid}.json").write_text(json.dumps(body if lid == "learner-7" else signed))
    found = store.members.run_learners(spec, lambda lid: learner_key(secret, "grow", lid))
    assert sorted(found.added) == ["learner-2", "learner-3", "learner-4"]
    said = "\n".join(found.refused)
    for expected in ("learner-7.json: it is not signed with learner-7's key",
                     "learner-8.json: it names learner 'learner-9' in region 'us-east', not 'learner-8'",
                     "learner-0.json: learner-0 is a slot of the run's spec",
                     "syncer-0.json does not name a learner"):  # fmt: skip
        assert expected in said, said
    # the audit without the run secret refuses the three out of place; with it, the
    # unsigned one too
    report = audit_run("grow", {REGION: url})
    assert len(report.violations["no-strangers"]) == 3, report.violations
    assert all(report.learners[f"learner-{i}"]["added"] for i in (2, 3, 4, 7))
    monkeypatch.setenv(RUN_SECRET_ENV, secret)
    report = audit_run("grow", {REGION: url})
    assert len(report.violations["no-strangers"]) == 4, report.violations
    assert "learner-7" not in report.learners
    assert all(report.learners[f"learner-{i}"]["added"] for i in (2, 3, 4))


LIVENESS = LivenessConfig()  # (silent after 600 s without a heartbeat or a status)


def test_slot_states_follow_the_statuses(tmp_path):
    """A slot is vacant when never started, preempted, or silent past the timeout; not
    when done, training, claimed by a start that has written no status yet, or joined
    since its status (a joiner on its way: a preempted slot joined again was vacant)."""
    url, _, store, _, _ = _run(tmp_path, "slots")
    now = time.time()
    lid = "learner-0"
    assert slot_state(store, lid, REGION, LIVENESS, now).vacant  # never started
    store.members.claim_generation(lid)
    assert not slot_state(store, lid, REGION, LIVENESS, now).vacant  # starting
    writer = RunStore("slots", {REGION: url}, REGION, writer=lid)
    for state, at, vacant in (("training", now - 10, False), ("training", now - 900, True),
                              ("preempted", now, True), ("done", now - 900, False)):  # fmt: skip
        writer.progress.write_metrics(lid, {"state": state, "time": at, "step": 3})
        got = slot_state(store, lid, REGION, LIVENESS, now)
        assert got.vacant is vacant, (state, at, got)
    # Preempted, then joined again: its joiner is on its way (a join newer than the
    # status) until it starts, or its join is older than the timeout.
    writer.progress.write_metrics(lid, {"state": "preempted", "time": now - 20, "step": 3})
    store.members.put_join(lid, lambda n: json.dumps({"join": n, "time": now - 30}).encode())
    assert slot_state(store, lid, REGION, LIVENESS, now).vacant  # that join came before it
    store.members.put_join(lid, lambda n: json.dumps({"join": n, "time": now - 10}).encode())
    assert (
        slot_state(store, lid, REGION, LIVENESS, now).why
        == "joining (joined 10 s ago, not started)"
    )
    assert slot_state(store, lid, REGION, LIVENESS, now + 700).vacant


def test_a_slow_learner_holds_its_slot_by_its_heartbeat_whatever_the_joiner_passes(tmp_path):
    """A learner whose status is old (a round longer than any timeout) holds its slot
    while its heartbeat is fresh, by the run's own liveness settings (its spec): a joiner
    cannot pass its own (``pipeline.member_timeout`` is refused by name). A heartbeat
    older than the run's silence limit by this machine's clock makes the slot vacant only
    if it does not move while the joiner watches two beats (a clock ahead of the
    learner's); a forged heartbeat (not signed with the learner's key) counts for nothing."""
    url, _, store, _, secret = _run(tmp_path, "slow")
    lid, now = "learner-0", time.time()
    beats = LivenessConfig(heartbeat_seconds=0.2)  # (the run's rule, beats 0.2 s apart)
    writer = RunStore("slow", {REGION: url}, REGION, writer=lid)
    key = learner_key(secret, "slow", lid)
    writer.members.claim_generation(lid)
    writer.progress.write_metrics(lid, {"state": "training", "time": now - 3600, "step": 3})

    def beat(n: int, at: float, key: bytes | None = key) -> None:
        writer.members.write_heartbeat({"learner": lid, "generation": 1, "beat": n, "period": 0.2,
                                "state": "training", "step": 3, "sends": 0, "time": at}, key)  # fmt: skip

    beat(1, now - 0.5)
    got = slot_state(store, lid, REGION, beats, now, key=key)
    assert not got.vacant and got.why == "training at step 3", got
    (shown,) = inspect_bucket(url, run="slow")["runs"]  # diloco inspect shows it too
    row = next(r for r in shown["learners"] if r["learner"] == lid)
    assert row["beat"]["state"] == "training" and row["beat"]["generation"] == 1, row
    with pytest.raises(ConfigError, match=r"pipeline\.member_timeout is gone"):
        join(url, "slow", REGION, pipeline={"member_timeout": 0.5},
             environ={RUN_SECRET_ENV: secret})  # fmt: skip
    beat(2, now - 100)  # stale by this clock (silent after 60 s): watched, it stays still
    got = slot_state(store, lid, REGION, beats, now, key=key)
    assert got.vacant and got.why.startswith("no heartbeat for 100 s"), got
    mover = threading.Timer(0.3, beat, (3, now - 100))  # ... or it moves: alive
    mover.start()
    got = slot_state(store, lid, REGION, beats, now, key=key)
    mover.join()
    assert not got.vacant and "this machine's clock is ahead" in got.why, got
    beat(4, now, key=b"k" * 32)  # fresh, but forged: as if there were none
    assert slot_state(store, lid, REGION, beats, now, key=key).vacant


def test_a_joiner_stopped_with_ctrl_c_leaves_the_run_as_a_preempted_learner(tmp_path, prefect_api):
    """Ctrl-C to `diloco join` (SIGINT: whoever lent the machine takes it back) is a
    leave, not a silence: the learner sends what it trained, checkpoints at that step,
    says "preempted" and exits with 128 + SIGTERM, so the syncers stop counting it at once
    (not after pipeline.member_timeout). Sent once its first send commits (the run's own
    progress)."""
    url, _, store, spec, secret = _run(tmp_path, "lent", 50_000_000)  # never finishes
    argv = [sys.executable, "-m", "flows.cli", "join", url, "--run", "lent", "--region", REGION,
            "--pipeline", json.dumps({"poll_seconds": 0.05, "preempt_seconds": 60})]  # fmt: skip
    lid, text = told_to_leave(
        argv, {**child_env(), RUN_SECRET_ENV: secret}, tmp_path / "join.log",
        lambda: next((lid for lid in run_slots(spec) if _sent(store, lid)), None),
        lambda proc: proc.send_signal(signal.SIGINT),
    )  # fmt: skip
    assert "Ctrl-C: the learner sends what it trained, checkpoints and leaves" in text
    status = store.progress.read_metrics(lid)
    assert status["state"] == "preempted", status
    assert store.checkpoints.checkpoint_steps(lid)[-1] == status["step"] > 0, text[-3000:]
    assert f"checkpointed at step {status['step']}" in text


def test_a_joiner_whose_temporary_prefect_server_does_not_start_is_told_what_to_do(monkeypatch):
    """Defect: a joiner with no PREFECT_API_URL, on a machine busy training, died in a
    traceback when Prefect's temporary server did not answer within Prefect's 20 s. It now
    waits ``TEMPORARY_SERVER_SECONDS`` for it, and one that does not start is refused by
    name, saying what to do (before any slot is taken: this runs in the warm-up)."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.join import TEMPORARY_SERVER_SECONDS, prefect_api_up

    asked = []

    def start(self, timeout=None):
        asked.append(timeout)
        raise RuntimeError("Timed out while attempting to connect to ephemeral Prefect API server.")

    monkeypatch.setattr(SubprocessASGIServer, "start", start)
    refused = pytest.raises(JoinRefused, match=r"did not start within 180 s .*set PREFECT_API_URL")
    with temporary_settings(restore_defaults={PREFECT_API_URL}), refused:
        prefect_api_up()
    assert asked == [TEMPORARY_SERVER_SECONDS] == [180]


def test_a_joiner_keeps_the_programs_it_compiles_on_its_machine(tmp_path):
    """A machine that joins keeps the JAX programs its warm-up compiles (the train step,
    sends and applies: seconds of a start, minutes of a large model's on a GPU) in its
    user cache folder, however quick each compile, so back after a preemption it loads
    them; a cache folder set in the environment is kept. In a process of its own with
    no cache set (this session's has one), its warm-up replaced by one compilation."""
    code = """if True:
        import jax, flows.join as j
        def join(*args, **kwargs):  # the warm-up's compilations, then a Ctrl-C
            jax.jit(lambda x: x * 3 + 1)(2.0).block_until_ready()
            raise KeyboardInterrupt
        j.join = join
        import threading
        assert j.take_slot("file:///nowhere", "r", "us", None, None, None,
                           threading.Event()) is None
        print(jax.config.jax_compilation_cache_dir)
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT")}
    for cache, expected in ((None, tmp_path / "home" / "diloco" / "jax"),
                            (tmp_path / "mine", tmp_path / "mine")):  # fmt: skip
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        env.update({"XDG_CACHE_HOME": str(tmp_path / "home")} if cache is None
                   else {"JAX_COMPILATION_CACHE_DIR": str(cache)})  # fmt: skip
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip().splitlines()[-1] == str(expected), done.stdout
        assert any(expected.iterdir()), f"nothing kept in {expected}"  # (0.01 s to compile)
