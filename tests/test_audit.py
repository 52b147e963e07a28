"""`diloco inspect --audit`: a clean run passes, and each tampered copy of it fails with
the invariant it breaks, naming the objects."""

import json
import shutil
from pathlib import Path

import pytest

from diloco.config import load_config
from diloco.simulate import simulate
from flows.cli import main as cli_main
from flows.run import simulation_store
from protocol.topology import run_slots
from storage_layout.audit import audit_run
from storage_layout.commit import commit_version
from storage_layout.retention import collect_garbage
from storage_layout.store import RunStore

OVER = ["budget.tokens=48000", "sim.eval_points=2", "topology.quorum=2"]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """A simulated run through two file:// regions (the same loops as the pipeline)."""
    root = tmp_path_factory.mktemp("audit")
    regions = {"us": f"file://{root}/us", "eu": f"file://{root}/eu"}
    for url in regions.values():
        Path(url.removeprefix("file://")).mkdir()
    simulate(load_config("tiny", overrides=OVER), store=simulation_store("r", regions))
    return root


@pytest.fixture
def run(clean_run, tmp_path):
    """A fresh copy of the clean run to tamper with: region -> URL."""
    shutil.copytree(clean_run, tmp_path / "copy")
    return {r: f"file://{tmp_path}/copy/{r}" for r in ("us", "eu")}


def test_a_clean_run_passes_and_every_contribution_has_its_outcome(run):
    report = audit_run("r", run)
    assert report.ok, dict(report.violations)
    assert report.outcomes["lost"] == 0 and report.outcomes["merged"] > 10
    t = report.tokens
    assert t["committed"] == t["merged"] + t["superseded"] + t["rejected"] + t["pending"] > 0
    assert t["versions"] == t["merged"] + t["superseded"]
    assert report.objects > report.versions > 0
    named = list(report.outcome_of.values())  # each one's outcome, where asked
    assert len(named) == sum(report.outcomes.values())
    assert sum(n.startswith("merged v") for n in named) == report.outcomes["merged"]


def test_the_audit_still_accounts_for_what_retention_deleted(run):
    before = audit_run("r", run)
    spec = RunStore("r", run, "us").read_spec()
    store = RunStore("r", run, "us", writer="gc")
    report = collect_garbage(store, len(spec["fragments"]), run_slots(spec), window=1)
    assert report.contributions_deleted > 0 and report.globals_deleted > 0
    after = audit_run("r", run)
    assert after.ok, dict(after.violations)
    assert (after.outcomes, after.tokens, after.versions) == (
        before.outcomes,
        before.tokens,
        before.versions,
    )


def test_a_contribution_merged_twice_is_named(run):
    store = RunStore("r", run, "us", writer="rogue-syncer")
    newest = store.versions.latest_global(0)
    state = store.versions.get_global(0, newest)
    twice = state.meta["consumed"][0]
    meta = {**state.meta, "version": newest + 1, "consumed": [twice], "rejected": [],
            "superseded": [], "tokens": 0}  # fmt: skip
    store.versions.publish_global(0, newest + 1, state.params, state.opt_leaves, meta)
    report = audit_run("r", run)
    assert not report.ok
    (problem,) = report.violations["merged-once"]
    assert f"{twice[0]}/{twice[1]}" in problem and str(newest + 1) in problem


def test_a_corrupted_object_is_named_in_the_bucket_given(run, clean_run):
    us = Path(run["us"].removeprefix("file://"))
    chunk = next(p for p in sorted(us.rglob("c/*")) if p.is_file() and "/globals/" in str(p))
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 0xFF
    chunk.write_bytes(bytes(data))
    report = audit_run("r", run)
    assert any(chunk.name in p and "sha256" in p for p in report.violations["objects-verify"])
    # The spec names the original buckets; the copy given is what is audited.
    assert report.regions == run and report.from_spec == []
    assert audit_run("r", {"us": f"file://{clean_run}/us", "eu": run["eu"]}).ok


def test_a_contribution_nothing_accounts_for_is_lost(run):
    """A contribution committed below the cursor after the fact (a forger, or a syncer
    that skipped it) has no outcome: the audit names it."""
    store = RunStore("r", run, "us")
    spec = store.read_spec()
    learner = next(iter(run_slots(spec)))
    region = run_slots(spec)[learner]
    taken = set(store.contributions.contribution_seqs(learner, 0, region))
    cursor = store.versions.global_marker(0, store.versions.latest_global(0)).meta["cursor"][
        learner
    ]
    seq = next(s for s in range(1, cursor) if s not in taken)  # used for another fragment
    good = RunStore("r", run, region).contributions.get_contribution(learner, 0, max(taken), region)
    tensors, meta = good
    meta = {**meta, "anchor_seq": 10**6}  # no merged send carries its work either
    RunStore("r", run, region, writer=learner).contributions.put_contribution(
        learner, 0, seq, tensors, meta
    )
    report = audit_run("r", run)
    (problem,) = report.violations["one-outcome"]
    assert f"{learner}/{seq}" in problem and report.outcomes["lost"] == 1


def test_contributions_under_a_learner_of_another_region_are_named(run):
    """The syncer reads a learner's contributions only in its own region; what lies under
    another region's learner, or an unknown one, was written by someone else."""
    store = RunStore("r", run, "us")
    spec = store.read_spec()
    learner = next(lid for lid, region in run_slots(spec).items() if region == "us")
    seq = store.contributions.contribution_seqs(learner, 0, "us")[-1]
    tensors, meta = store.contributions.get_contribution(learner, 0, seq, "us")
    eu = RunStore("r", run, "eu", writer="intruder")
    eu.contributions.put_contribution(learner, 0, seq + 1, tensors, meta)
    eu.contributions.put_contribution("learner-9", 0, 1, tensors, meta)
    found = audit_run("r", run).violations["no-strangers"]
    assert len(found) == 2
    assert any(f"learners/{learner} holds" in p and "learner of us" in p for p in found)
    assert any("learners/learner-9 holds" in p and "no learner of the run" in p for p in found)


def test_a_version_written_twice_is_named(run):
    """Another write of a version in a region (different write id) is an overwrite."""
    eu = RunStore("r", run, "eu", writer="rogue")
    marker = eu.versions.global_marker(0, 1)
    key = eu.layout.global_marker(0, 1)
    eu.home.delete([key])
    objects = {rel: e["inline"].encode() for rel, e in marker.objects.items() if "inline" in e}
    commit_version(eu.home, key, eu.layout.global_data(0, 1, "feedfacefeedface"), objects,
                   "global", marker.meta, "rogue", "feedfacefeedface")  # fmt: skip
    report = audit_run("r", run)
    assert any("version 1 was written twice" in p for p in report.violations["not-overwritten"])


def test_inspect_audit_cli(run, capsys):
    us = run["us"].removeprefix("file://")
    assert cli_main(["inspect", f"us={us}", "--run", "r", "--audit", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["violations"] == {} and out["from_spec"] == ["eu"]
    chunk = next(p for p in sorted(Path(us).rglob("c/*")) if "/contributions/" in str(p))
    chunk.write_bytes(chunk.read_bytes()[:-1])  # truncated
    assert cli_main(["inspect", f"us={us}", "--run", "r", "--audit"]) == 1
    text = capsys.readouterr().out
    assert "objects-verify" in text and "FAILED" in text


def test_inspect_verify_checks_the_copy_it_is_given(run, capsys):
    """A copy of a bucket, verified: its own objects are re-hashed (not those at the
    spec's URL, the untouched original), with REGION=URL as for --audit; a bare copy's
    URL is refused with how to name its region."""
    us = run["us"].removeprefix("file://")
    assert cli_main(["inspect", f"us={us}", "--run", "r", "--verify"]) == 0
    assert f"committed versions in us=file://{us}" in capsys.readouterr().out
    chunk = next(p for p in sorted(Path(us).rglob("c/*")) if "/globals/" in str(p))
    chunk.write_bytes(chunk.read_bytes()[:-1])  # the copy is damaged; the original is not
    assert cli_main(["inspect", f"us={us}", "--run", "r", "--verify"]) == 1
    assert "problem:" in capsys.readouterr().out
    assert cli_main(["inspect", us, "--run", "r", "--verify"]) == 2
    assert f"name the region it holds: REGION=file://{us}" in capsys.readouterr().err


def _damage_a_pending_contribution(run):
    """Commit a contribution above every cursor and damage its data; returns (store,
    learner, seq, the newest version of fragment 0)."""
    store = RunStore("r", run, "us", writer="syncer")
    spec = store.read_spec()
    learner = next(lid for lid, region in run_slots(spec).items() if region == "us")
    taken = store.contributions.contribution_seqs(learner, 0, "us")
    tensors, meta = store.contributions.get_contribution(learner, 0, taken[-1], "us")
    seq = spec["config"]["budget"]["tokens"]  # above every cursor; plausible enough here
    meta = {**meta, "anchor_seq": 10**6}
    marker = RunStore("r", run, "us", writer=learner).contributions.put_contribution(learner, 0, seq, tensors,
                                                                       meta)  # fmt: skip
    rel = next(r for r in marker.objects if "/c/" in r)
    store.home.put(f"{marker.data_prefix}/{rel}", b"\0" * marker.objects[rel]["size"])
    return store, learner, seq, store.versions.get_global(0, store.versions.latest_global(0))


def _pass_over(store, state, learner: str, seq: int, rejected: list) -> None:
    """Publish the version after ``state`` with ``learner``'s cursor at ``seq``."""
    v = state.meta["version"] + 1
    cursor = {**state.meta["cursor"], learner: seq}
    record = {**state.meta, "version": v, "consumed": [], "tokens": 0, "superseded": [],
              "rejected": rejected, "cursor": cursor}  # fmt: skip
    store.versions.publish_global(0, v, state.params, state.opt_leaves, record)


def test_damage_a_syncer_found_and_rejected_is_accounted_for(run):
    """A contribution whose data was damaged after its commit is named as damage no
    model has read while it is pending (no syncer has read it yet: a run stopped while a
    forger's damaged contribution waits), and as a rejection once a syncer has rejected
    it for that (its work is refused)."""
    store, learner, seq, state = _damage_a_pending_contribution(run)
    report = audit_run("r", run)
    assert report.ok, dict(report.violations)
    (damage,) = report.unread_damage
    assert f"s{seq:012d}" in damage and "pending" in damage
    reason = "unreadable: object does not match its sha256"
    _pass_over(store, state, learner, seq, [[learner, seq, reason]])
    report = audit_run("r", run)
    assert report.ok, dict(report.violations)
    assert report.outcomes["rejected"] == 1 and report.rejections == 1
    assert report.unread_damage == []


def test_damage_passed_below_the_cursor_with_no_word_is_a_violation(run):
    store, learner, seq, state = _damage_a_pending_contribution(run)
    _pass_over(store, state, learner, seq, [])
    report = audit_run("r", run)
    assert any(f"s{seq:012d}" in p for p in report.violations["objects-verify"])
    assert any(f"{learner}/{seq}" in p for p in report.violations["one-outcome"])


def test_a_chain_of_replacements_ends_where_the_last_one_went():
    """248 replaced by 250, 250 by 252, 252 rejected: 248's outcome is 252's (it used to
    look lost when only one step of the chain was followed)."""
    from storage_layout.audit import _last_of_chain

    chain = {("a", 248): ("a", 250), ("a", 250): ("a", 252)}
    assert _last_of_chain(("a", 248), chain) == ("a", 252)
    assert _last_of_chain(("a", 252), chain) is None
    assert _last_of_chain(("a", 1), {("a", 1): ("a", 2), ("a", 2): ("a", 1)}) == ("a", 1)


def test_home_master_copies_gone_fail_the_audit_and_a_relaunch(run):
    """Every home version of fragment 0 deleted (as a forged marker once made retention
    do): the audit names it, however sound the other region's copies are, and
    initializing the run again refuses to publish version 0 over it."""
    from flows.run import initialize_run
    from flows.spec import config_from_spec
    from storage_layout.versions import HomeCopiesLost

    home = Path(run["us"].removeprefix("file://")) / "r" / "globals" / "f0000"
    shutil.rmtree(home)
    report = audit_run("r", run)
    assert not report.ok
    (problem,) = report.violations["home-complete"]
    assert "fragment 0" in problem and "us does not hold" in problem
    for url in run.values():  # the copy's spec names the copy's buckets
        path = Path(url.removeprefix("file://")) / "r" / "spec.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "regions": run}))
    store = RunStore("r", run, "us", writer="launcher")
    cfg = config_from_spec(store.read_spec())
    with pytest.raises(HomeCopiesLost, match=r"fragment 0.*eu holds v"):
        initialize_run(store, cfg)
    assert store.versions.global_versions(0) == []  # nothing republished


def test_a_home_copy_without_its_master_copy_fails_the_audit(run):
    store = RunStore("r", run, "us", writer="rogue")
    newest = store.versions.latest_global(0)
    marker = store.versions.global_marker(0, newest)
    key = store.layout.global_marker(0, newest)
    path = Path(run["us"].removeprefix("file://")) / key
    body = json.loads(path.read_text())
    body["objects"] = {k: v for k, v in body["objects"].items() if not k.startswith("params/")}
    path.write_text(json.dumps(body))
    assert marker.write_id == body["write_id"]
    problems = audit_run("r", run).violations["home-complete"]
    assert any("lacks the master copy" in p for p in problems), problems
