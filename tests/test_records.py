"""Every record kind read from a bucket goes through ``storage_layout.record``: whatever
is stored there (random JSON, wrong types, huge numbers, huge objects, a future date),
the reader returns a checked record or a ``BadRecord`` naming its key, reading no more
than the kind's cap; nothing else escapes."""

from __future__ import annotations

import json
import random
import time

import pytest

from flows.join_tokens import TokenRecord
from flows.run_lock import LockClaim
from storage_layout import record
from storage_layout.bucket import Bucket
from storage_layout.heartbeat import MAX_BYTES, Heartbeat
from storage_layout.inspect import inspect_bucket
from storage_layout.members import Generation, Join, SeqBlock
from storage_layout.part import Written
from storage_layout.progress import STATUS_BYTES, Status
from storage_layout.retention import LEDGER_BYTES, LedgerEntry
from storage_layout.store import SPEC_BYTES, Budget, Pipeline, RunStore, Spec

KINDS = [(LockClaim, record.SMALL), (Heartbeat, MAX_BYTES), (Written, record.SMALL),
         (SeqBlock, record.SMALL), (Generation, record.SMALL), (Join, record.SMALL),
         (Budget, record.SMALL), (Status, STATUS_BYTES), (Spec, SPEC_BYTES),
         (Pipeline, record.SMALL), (LedgerEntry, LEDGER_BYTES),
         (TokenRecord, record.SMALL)]  # fmt: skip
GOOD = {
    LockClaim: {"claim": 3, "host": "h", "pid": 12, "time": 1.0e9, "nonce": "n"},
    Heartbeat: {"learner": "learner-0", "generation": 1, "beat": 2, "period": 5.0,
                "state": "training", "step": 3, "sends": 1, "time": 1.0e9},
    Written: {"writer": "w", "time": 1.0e9}, SeqBlock: {"first": 0, "end": 10},
    Generation: {"fence": "silent"}, Join: {"join": 1, "time": 1.0e9},
    Budget: {"tokens": 10**9},
    Status: {"step": 4, "time": 1.0e9, "traffic": {"us->eu": {"bytes": 9, "requests": 1}},
             "bytes_up": 5, "rejected": []},
    Spec: {"config": {}}, Pipeline: {"pipeline": {}},
    LedgerEntry: {"fragment": 0, "contributions": [], "versions": [
        {"version": 1, "write_ids": {"us": "9e33ea8d"}}]},
    TokenRecord: {"id": "9e33ea8d", "issued": 1.0e9, "expires": None, "checks": {"l0": "ab"},
                  "claims_check": "cd"},
}  # fmt: skip
WILD = [None, True, -1, 0, 10**30, 10**400, -(10**20), 1e308, float("inf"), "soon", "",
        "x" * 5000, [], [1, 2], {}, {"a": {"b": [None]}}, 1.5, "1e3", "9" * 50]  # fmt: skip


def _wild(rng: random.Random, depth: int = 0) -> object:
    pick = rng.random()
    if depth < 3 and pick < 0.15:
        return [_wild(rng, depth + 1) for _ in range(rng.randrange(4))]
    if depth < 3 and pick < 0.3:
        return {rng.choice(["time", "claim", "x", "tokens"]): _wild(rng, depth + 1)
                for _ in range(rng.randrange(4))}  # fmt: skip
    return rng.choice(WILD)


def _bodies(kind: type, rng: random.Random) -> list[bytes]:
    good = GOOD[kind]
    out = [json.dumps(good).encode(), b"", b"{", b"\xff\xfe", b"[" * 50_000, b"null"]
    out.append(json.dumps({**good, "time": time.time() + 30 * 365 * 86400}).encode())
    for name in good:  # each field wrong in each way
        for value in WILD:
            out.append(json.dumps({**good, name: value}, allow_nan=True).encode())
    for _ in range(40):  # random documents
        out.append(json.dumps(_wild(rng), allow_nan=True).encode())
    return out


@pytest.mark.parametrize(("kind", "limit"), KINDS, ids=[k.__name__ for k, _ in KINDS])
def test_every_record_kind_reads_as_itself_or_a_named_refusal(tmp_path, kind, limit):
    bucket = Bucket(f"file://{tmp_path}")
    rng = random.Random(kind.__name__)
    bodies = _bodies(kind, rng)
    bodies.append(b'{"pad": "' + b"x" * (limit + 10) + b'"}')  # larger than the kind's cap
    accepted = 0
    for i, body in enumerate(bodies):
        key = f"run/records/{kind.__name__}-{i}.json"
        bucket.put(key, body)
        before = bucket.traffic.downloaded
        try:
            got = record.read(bucket, key, kind, limit)
        except record.BadRecord as exc:
            assert key in str(exc), exc
        else:
            assert isinstance(got, kind)
            accepted += 1
            if "time" in kind.model_fields and got.time is not None:
                assert got.time <= time.time() + record.MAX_SKEW_SECONDS
        # (a torn read is asked again: at most three reads of at most the cap each)
        assert bucket.traffic.downloaded - before <= 3 * (limit + 1)
    assert accepted >= 1  # the good record reads


def test_a_record_signed_by_its_writer_verifies_and_no_other_does(tmp_path):
    from storage_layout.auth import sign_record

    bucket = Bucket(f"file://{tmp_path}")
    body = sign_record({"join": 1, "time": time.time()}, b"k" * 32)
    bucket.put("run/j.json", json.dumps(body).encode())
    assert record.read(bucket, "run/j.json", Join, signed_by=b"k" * 32).join == 1
    with pytest.raises(record.BadRecord, match="not signed with its writer's key"):
        record.read(bucket, "run/j.json", Join, signed_by=b"o" * 32)


def test_inspect_names_each_status_that_is_not_one_and_counts_the_rest(tmp_path):
    """A writer's status with traffic of the wrong type, a list, or one over its cap is a
    named problem of ``diloco inspect``, read no further; the good ones are summed."""
    url = f"file://{tmp_path}"
    store = RunStore("r", {"us": url}, "us", writer="syncer")
    store.ensure_spec({"regions": {"us": url}, "learners": {"l0": "us"}, "fragments": [["w"]]})
    good = {"time": time.time(), "traffic": {"us->eu": {"bytes": 10, "requests": 2}}}
    bodies = {"l0": json.dumps(good).encode(),
              "l1": json.dumps({"traffic": {"us->eu": {"bytes": "many"}}}).encode(),
              "l2": b"[1, 2]", "l3": b'{"pad": "' + b"x" * STATUS_BYTES + b'"}'}  # fmt: skip
    for name, body in bodies.items():
        store.home.put(store.layout.metrics(name), body)
    run = inspect_bucket(url)["runs"][0]
    assert run["traffic"] == {"us->eu": {"bytes": 10, "requests": 2}}
    named = [p for p in run["problems"] if "metrics" in p]
    assert len(named) == 3 and all(f"l{i}.json" in " ".join(named) for i in (1, 2, 3)), named
    assert "traffic.us->eu.bytes" in " ".join(named) and "refused unread" in " ".join(named)
