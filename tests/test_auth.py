"""Authenticated contributions (``storage_layout.auth``): learners sign their markers
with their own key, a syncer holding the run secret rejects what it cannot verify, and
the launcher hands each worker only the key material its role needs."""

from __future__ import annotations

import json
import logging
import os
import stat
from dataclasses import replace

import numpy as np
import pytest

from diloco.config import load_config
from diloco.outer import Contribution
from diloco.records import version_id
from flows.bucket_io import BucketStore
from flows.launcher import authenticate
from flows.learner_buckets import contribution_meta
from flows.run import build_model, initialize_run
from flows.supervision import child_env
from flows.syncer import SyncerRuntime
from protocol.quantize import quantize
from protocol.topology import run_slots
from storage_layout.auth import (
    ALGORITHM,
    CLAIMS_KEY_ENV,
    LEARNER_KEY_ENV,
    RUN_SECRET_ENV,
    Keys,
    SecretMismatch,
    Unauthenticated,
    claims_key,
    learner_key,
    new_run_secret,
    run_secret,
    secret_fingerprint,
    sign,
    verify,
)
from storage_layout.commit import CommitMarker, CorruptVersion, read_marker, sha256
from storage_layout.store import RunStore

SECRET = "0123456789abcdef-test-secret"


def _marker(**meta) -> CommitMarker:
    return CommitMarker(
        kind="contribution",
        data_prefix="r/learners/learner-1/contributions/f0000/data/s000000000001-ab",
        objects={
            "zarr.json": {"size": 3, "sha256": "a" * 64, "inline": "{ }"},
            "delta/data/c/0": {"size": 10, "sha256": "b" * 64},
        },
        writer="learner-1",
        write_id="ab",
        meta={"learner": "learner-1", "seq": 1, "tokens": 512, "seconds": 0.1, **meta},
    )


def _stored(marker: CommitMarker) -> CommitMarker:
    """The marker as a reader gets it from the bucket."""
    return CommitMarker.from_json(marker.to_json(), "k")


KEY_1 = learner_key(SECRET, "r", "learner-1")


# --- signing and verifying a marker -----------------------------------------------------


def test_a_signed_marker_verifies_after_the_round_trip_through_the_bucket():
    signed = sign(_marker(consumed=(("learner-1", 1),), ratio=1 / 3), KEY_1)
    assert signed.signature["alg"] == ALGORITHM and len(signed.signature["value"]) == 64
    stored = _stored(signed)
    assert stored.signature == signed.signature
    verify(stored, KEY_1, "learner-1", "k")  # tuples came back as lists: still verifies
    assert "signature" not in json.loads(_marker().to_json())  # unsigned markers as before


@pytest.mark.parametrize(
    "tamper",
    [
        lambda m: replace(m, meta={**m.meta, "tokens": 10**9}),
        lambda m: replace(
            m, objects={**m.objects, "delta/data/c/0": {"size": 10, "sha256": "c" * 64}}
        ),
        lambda m: replace(
            m, objects={**m.objects, "zarr.json": {**m.objects["zarr.json"], "inline": "{}"}}
        ),
        lambda m: replace(m, data_prefix=m.data_prefix + "x"),
        lambda m: replace(m, writer="learner-2"),
        lambda m: replace(m, kind="global"),
    ],
    ids=["meta", "object-sha", "inline-object", "data-prefix", "writer", "kind"],
)
def test_a_marker_changed_after_signing_does_not_verify(tamper):
    stored = _stored(tamper(sign(_marker(), KEY_1)))
    with pytest.raises(Unauthenticated, match=r"signature does not verify.*\(forged or tampered\)"):
        verify(stored, KEY_1, "learner-1", "k")


def test_another_learners_key_or_another_runs_key_does_not_verify():
    for key in (learner_key(SECRET, "r", "learner-2"), learner_key(SECRET, "r2", "learner-1"),
                learner_key(SECRET + "x", "r", "learner-1")):  # fmt: skip
        stored = _stored(sign(_marker(), key))
        with pytest.raises(Unauthenticated, match="not written by learner-1's key"):
            verify(stored, KEY_1, "learner-1", "k")


def test_an_unsigned_or_oddly_signed_marker_fails_when_a_key_is_required():
    with pytest.raises(Unauthenticated, match="unsigned, but this syncer requires learner-1"):
        verify(_stored(_marker()), KEY_1, "learner-1", "k")
    other_alg = replace(sign(_marker(), KEY_1), signature={"alg": "none", "value": ""})
    with pytest.raises(Unauthenticated, match="signed with 'none'"):
        verify(_stored(other_alg), KEY_1, "learner-1", "k")
    garbage = replace(sign(_marker(), KEY_1), signature={"alg": ALGORITHM, "value": "é"})
    with pytest.raises(Unauthenticated, match="does not verify"):
        verify(_stored(garbage), KEY_1, "learner-1", "k")
    body = json.loads(_marker().to_json())
    body["signature"] = "not an object"
    with pytest.raises(CorruptVersion, match="lacks a field or has a wrong one"):
        CommitMarker.from_json(json.dumps(body).encode(), "k")


# --- keys from the environment ----------------------------------------------------------


def test_keys_from_the_environment():
    syncer = Keys.from_env("r", environ={RUN_SECRET_ENV: SECRET})
    assert syncer.verifying_key("learner-1") == KEY_1 == syncer.signing_key("learner-1")
    derived = Keys.from_env("r", "learner-1", environ={RUN_SECRET_ENV: SECRET})
    assert derived.signing_key("learner-1") == KEY_1
    claims = claims_key(SECRET, "r")
    own = Keys.from_env("r", "learner-1",
                        environ={LEARNER_KEY_ENV: KEY_1.hex(), CLAIMS_KEY_ENV: claims.hex()})  # fmt: skip
    assert own.signing_key("learner-1") == KEY_1
    assert own.claims_key == claims == syncer.claims_key == derived.claims_key  # one per run
    assert claims != claims_key(SECRET, "other") and claims != KEY_1
    assert own.signing_key("learner-2") is None  # it cannot sign for anyone else
    assert own.verifying_key("learner-1") is None and not own.verifies
    none = Keys.from_env("r", "learner-1", environ={})
    assert none.signing_key("learner-1") is None and not none.verifies
    with pytest.raises(ValueError, match="is not learner-2's key in run 'r'"):
        Keys.from_env("r", "learner-2",
                      environ={RUN_SECRET_ENV: SECRET, LEARNER_KEY_ENV: KEY_1.hex()})  # fmt: skip
    with pytest.raises(ValueError, match="is not a learner key"):
        Keys.from_env("r", "learner-1", environ={LEARNER_KEY_ENV: "abc"})
    with pytest.raises(ValueError, match="DILOCO_CLAIMS_KEY is not: a learner needs both"):
        Keys.from_env("r", "learner-1", environ={LEARNER_KEY_ENV: KEY_1.hex()})
    assert SECRET not in repr(syncer) and repr(KEY_1) not in repr(own)  # safe to log
    with pytest.raises(ValueError, match="at least 16"):
        Keys.from_env("r", environ={RUN_SECRET_ENV: "short"})


def test_the_run_secret_is_made_once_kept_private_and_the_environment_wins(tmp_path):
    path = tmp_path / "run-secret"
    secret, source = run_secret(path, environ={})
    assert source == str(path) and len(secret) == 64
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert run_secret(path, environ={}) == (secret, str(path))  # a resumed run: the same
    assert run_secret(path, environ={RUN_SECRET_ENV: SECRET}) == (SECRET, RUN_SECRET_ENV)
    assert new_run_secret() != new_run_secret()


# --- the launcher's worker environments -------------------------------------------------


def test_a_learner_gets_its_own_key_and_never_the_run_secret(monkeypatch):
    monkeypatch.setenv(RUN_SECRET_ENV, SECRET)  # the launcher's own environment has it
    monkeypatch.setenv(LEARNER_KEY_ENV, "ff" * 32)  # and some stray key
    learner = child_env("r", "learner-1", SECRET)
    assert RUN_SECRET_ENV not in learner
    assert learner[LEARNER_KEY_ENV] == KEY_1.hex()
    assert learner[CLAIMS_KEY_ENV] == claims_key(SECRET, "r").hex()
    assert SECRET not in learner.values()
    syncer = child_env("r", "syncer-0", SECRET)
    assert syncer[RUN_SECRET_ENV] == SECRET and LEARNER_KEY_ENV not in syncer
    assert CLAIMS_KEY_ENV not in syncer  # (derived from the secret)
    other = child_env("r", "evaluator", SECRET)
    assert RUN_SECRET_ENV not in other and LEARNER_KEY_ENV not in other
    # What each worker process makes of its environment signs and verifies alike.
    signer = Keys.from_env("r", "learner-1", environ=learner)
    checker = Keys.from_env("r", environ=syncer)
    stored = _stored(sign(_marker(), signer.signing_key("learner-1")))
    verify(stored, checker.verifying_key("learner-1"), "learner-1", "k")
    assert signer.signing_key("learner-2") is None


def _bucket_store(tmp_path, run: str) -> RunStore:
    (tmp_path / "bucket").mkdir(exist_ok=True)
    return RunStore(run, {"us": f"file://{tmp_path / 'bucket'}"}, "us", writer="launcher")


def test_the_launcher_keeps_the_run_secret_out_of_its_log(tmp_path, caplog):
    store = _bucket_store(tmp_path, "auth-run")
    with caplog.at_level(logging.INFO):
        secret = authenticate("auth-run", tmp_path, True, logging.getLogger("t"), store)
    assert (tmp_path / "run-secret").read_text().strip() == secret
    assert "contributions are signed" in caplog.text and secret not in caplog.text
    stored = (tmp_path / "bucket" / "auth-run" / "secret-fingerprint.json").read_text()
    assert secret not in stored


def test_a_swapped_run_secret_is_refused_at_launch(tmp_path, monkeypatch):
    """The run keeps its secret's fingerprint: a relaunch with another secret (the
    run-secret file lost, DILOCO_RUN_SECRET changed) is refused by name, instead of
    every genuine contribution being rejected as forged later."""
    store = _bucket_store(tmp_path, "swap")
    first = authenticate("swap", tmp_path, True, logging.getLogger("t"), store)
    assert authenticate("swap", tmp_path, True, logging.getLogger("t"), store) == first
    monkeypatch.setenv(RUN_SECRET_ENV, SECRET)
    with pytest.raises(SecretMismatch, match=f"from {RUN_SECRET_ENV} is not the one run 'swap'"):
        authenticate("swap", tmp_path, True, logging.getLogger("t"), store)


def test_a_run_started_before_claims_were_tagged_is_refused_at_launch(tmp_path):
    """Its claims are untagged: a launcher holding the secret would pass over every one
    and hand the run's data out again, so it refuses the run by name instead."""
    store = _bucket_store(tmp_path, "old")
    old = {"alg": "hmac-sha256", "fingerprint": secret_fingerprint(SECRET, "old")}
    store.home.put(store.layout.secret_fingerprint, json.dumps(old).encode())
    with pytest.raises(SecretMismatch, match="started by an older diloco, which did not tag"):
        store.check_secret(SECRET, "the test")


def test_a_claim_rewritten_or_copied_by_someone_without_the_key_is_no_claim(tmp_path, caplog):
    """Issue 56: claims are sealed with the run's claims key. A generation rewritten as a
    fence, a block of seqs overwritten with the bytes of the block before it (a valid
    claim, of another key), a data unit's claim renamed to a stranger: each reads as no
    claim, named in the log, instead of being taken at its word."""
    (tmp_path / "us").mkdir()
    regions = {"us": f"file://{tmp_path / 'us'}"}
    store = RunStore("r", regions, "us", writer="learner-1", claims_key=claims_key(SECRET, "r"))
    assert store.members.claim_generation("learner-1") == 1
    first, second = (store.members.reserve_seqs("learner-1", 0, 8)[0] for _ in range(2))
    assert store.members.seq_blocks("learner-1") == [(0, 8), (8, 16)]
    n = store.units.claim_fresh_unit("learner-1")
    assert store.units.unit_claim(f"fresh-{n}")["learner"] == "learner-1"
    gen = store.numbered_claim(store.layout.lease_commits("learner-1"), 1)
    store.home.put(gen, json.dumps({"fence": "forged", "time": 1.0}).encode())
    seqs = store.layout.seq_claims("learner-1")
    copied = store.home.get(store.numbered_claim(seqs, first))
    store.home.put(store.numbered_claim(seqs, second), copied)
    unit = store.numbered_claim(store.layout.units_fresh(), n)
    body = {**json.loads(store.home.get(unit)), "learner": "ghost"}
    store.home.put(unit, json.dumps(body).encode())
    assert store.members.generation("learner-1", 1) is None
    assert store.members.seq_blocks("learner-1") == [(0, 8)]
    assert store.units.unit_claim(f"fresh-{n}") is None
    assert caplog.text.count("is not sealed with the run's claims key") >= 3
    # the same claims read without the key (a view for people): taken as they are
    view = RunStore("r", regions, "us")
    assert view.members.seq_blocks("learner-1") == [(0, 8), (0, 8)]


# --- through the stores and the syncer ----------------------------------------------------


@pytest.fixture
def auth_run(tmp_path):
    """A tiny run in one file:// region; returns (cfg, regions, spec, model)."""
    cfg = load_config("tiny", overrides=["budget.tokens=64000"])
    (tmp_path / "us").mkdir()
    regions = {"us": f"file://{tmp_path / 'us'}"}
    spec = initialize_run(RunStore("r", regions, "us"), cfg)
    return cfg, regions, spec, build_model(cfg)


def _contribution(model, p: int, learner: str, seq: int, seed: int) -> Contribution:
    rng = np.random.default_rng(seed)
    payload = {
        n: quantize(rng.normal(0, 1e-3, model.init[n].shape).astype(np.float32), "int4", 128)
        for n in model.plan[p]
    }
    return Contribution(learner, p, seq, 0, 512, 1, 0.1, payload, base_id=version_id(p, 0, []))


def test_a_forged_or_tampered_contribution_is_rejected_before_its_data_is_read(auth_run):
    _, regions, _, model = auth_run
    store = RunStore("r", regions, "us", writer="learner-1")
    c = _contribution(model, 0, "learner-1", 1, 0)
    marker = store.contributions.put_contribution(
        "learner-1", 0, 1, c.payload, contribution_meta(c), KEY_1
    )
    tensors, meta = store.contributions.get_contribution("learner-1", 0, 1, "us", KEY_1)
    assert meta["seq"] == 1 and set(tensors) == set(c.payload)
    # Someone swaps a data object and fixes its size and sha256 in the marker to match.
    rel = next(r for r in marker.objects if r.startswith("delta/data"))
    evil = b"\0" * marker.objects[rel]["size"]
    bucket, key = store.home, store.layout.contribution_marker("learner-1", 0, 1)
    bucket.put(f"{marker.data_prefix}/{rel}", evil)
    with pytest.raises(CorruptVersion, match="does not match its sha256"):
        store.contributions.get_contribution("learner-1", 0, 1, "us", KEY_1)
    fixed = {**marker.objects, rel: {"size": len(evil), "sha256": sha256(evil)}}
    bucket.put(key, replace(read_marker(bucket, key), objects=fixed).to_json())
    with pytest.raises(Unauthenticated, match="signature does not verify"):
        store.contributions.get_contribution("learner-1", 0, 1, "us", KEY_1)
    # Rejected on the marker alone: its data need not even exist.
    bucket.delete_prefix(marker.data_prefix)
    with pytest.raises(Unauthenticated):
        store.contributions.get_contribution("learner-1", 0, 1, "us", KEY_1)


def test_the_syncer_rejects_what_a_learner_did_not_sign_and_merges_what_it_did(
    auth_run, monkeypatch
):
    """A learner signs with the key the launcher gives it; contributions written into
    another learner's prefix without that learner's key are rejected by name and never
    merged, and the syncer goes on."""
    cfg, regions, spec, model = auth_run
    secret = new_run_secret()
    learner0 = Keys.from_env("r", "learner-0", environ=child_env("r", "learner-0", secret))
    real = BucketStore("r", regions, "us", run_slots(spec), "bf16", "learner-0", keys=learner0)
    for seq in (1, 2):
        real.put_contribution(_contribution(model, 0, "learner-0", seq, seq))
    # learner-1's prefix: one with no key, one signed by learner-0 (with its own key).
    forger = RunStore("r", regions, run_slots(spec)["learner-1"], writer="learner-1")
    for seq, key in ((1, None), (2, learner0.signing_key("learner-0"))):
        f = _contribution(model, 0, "learner-1", seq, 10 + seq)
        forger.contributions.put_contribution(
            "learner-1", 0, seq, f.payload, contribution_meta(f), key
        )
    # learner-0's seq 2, its tokens inflated after it was signed.
    bucket, key = forger.home, forger.layout.contribution_marker("learner-0", 0, 2)
    tampered = read_marker(bucket, key)
    bucket.put(key, replace(tampered, meta={**tampered.meta, "tokens": 10**9}).to_json())

    monkeypatch.setenv(RUN_SECRET_ENV, secret)  # the syncer's environment
    syncer = SyncerRuntime("r", regions, "us", 0, 1, cfg.pipeline.model_dump())
    assert syncer.poll() == 1  # learner-0's seq 1 alone
    reasons = {(r["learner"], r["seq"]): r["reason"] for r in syncer.rejected}
    assert set(reasons) == {("learner-1", 1), ("learner-1", 2), ("learner-0", 2)}
    assert "not authentic" in reasons[("learner-1", 1)] and "unsigned" in reasons[("learner-1", 1)]
    for forged in (("learner-1", 2), ("learner-0", 2)):
        assert "signature does not verify: not written by" in reasons[forged]
        assert f"{forged[0]}'s key (forged or tampered)" in reasons[forged]
    row = syncer.merge_and_publish(0)
    assert row["version"] == 1
    meta = RunStore("r", regions, "us").versions.global_marker(0, 1).meta
    assert meta["consumed"] == [["learner-0", 1]]
    assert meta["tokens"] == 512  # not the inflated count
    assert {(lid, seq) for lid, seq, _ in meta["rejected"]} == set(reasons)  # for the audit
    # A forged marker ahead of the learner's real sends must not hide them.
    forger.contributions.put_contribution("learner-0", 0, 5, f.payload, contribution_meta(f), None)
    assert syncer.poll() == 0
    for seq in (3, 4):
        real.put_contribution(_contribution(model, 0, "learner-0", seq, seq))
    # seq 4 is read (before, the forged seq 5 moved the syncer past them); seq 3, from the
    # same anchor, is superseded by it unread.
    assert syncer.poll() == 1
    assert syncer.loop.syncers[0].superseded == [("learner-0", 3, 4)]
    # A reload (a failed publish does one) forgets the unpublished outcomes: the forged
    # seq 5 is refused and recorded again, so the next version still accounts for it.
    syncer.loop.load(0)
    syncer.poll()
    assert syncer.merge_and_publish(0) is None  # seqs 3 and 4 carry nothing new
    assert syncer.loop.seal(0)["version"] == 2  # the run's end: outcomes published
    meta = RunStore("r", regions, "us").versions.global_marker(0, 2).meta
    assert ["learner-0", 5] in [r[:2] for r in meta["rejected"]]


def test_without_the_run_secret_the_syncer_accepts_unsigned_contributions(auth_run):
    """No secret: as before (the syncer flow says once that nothing is authenticated)."""
    cfg, regions, spec, model = auth_run
    writer = RunStore("r", regions, run_slots(spec)["learner-1"], writer="learner-1")
    c = _contribution(model, 0, "learner-1", 1, 0)
    writer.contributions.put_contribution("learner-1", 0, 1, c.payload, contribution_meta(c))
    syncer = SyncerRuntime("r", regions, "us", 0, 1, cfg.pipeline.model_dump())
    assert not syncer.transport.store.keys.verifies
    assert syncer.poll() == 1 and syncer.rejected == []
