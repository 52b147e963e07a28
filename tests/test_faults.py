"""The storage fault injector: each fault kind on the four backends, replay, the commit
protocol under lost responses and damaged reads, the outage window, and the plan from
``DILOCO_FAULTS``."""

from __future__ import annotations

import errno
import json
import os
import threading
import time

import numpy as np
import pytest

from protocol.quantize import quantize
from storage_layout import faults
from storage_layout.bucket import Bucket, PartialFailure
from storage_layout.commit import (
    CorruptVersion,
    fetch_objects,
    get_patiently,
    put_patiently,
    read_marker,
)
from storage_layout.fault_plan import FaultPlan, FaultPlanError
from storage_layout.faults import (
    FaultyBucket,
    InjectedDiskFull,
    InjectedFault,
    RegionOutage,
    open_bucket,
)
from storage_layout.store import RegionDown, RunStore

DATA = bytes(range(64))


@pytest.fixture(autouse=True)
def no_env_plan(monkeypatch):
    monkeypatch.delenv(faults.ENV_VAR, raising=False)


def faulty(url: str, region: str = "us", **fields) -> tuple[FaultyBucket, faults.Injector]:
    """A bucket of ``url`` under a plan of ``fields`` (seed 1), and its injector."""
    injector = faults.Injector(FaultPlan(seed=1, **fields))
    bucket = open_bucket(url, region=region, injector=injector)
    assert isinstance(bucket, FaultyBucket)
    return bucket, injector


def publish(store: RunStore, fragment: int = 0, version: int = 1) -> None:
    params = {"w": np.full((4, 3), 1.5, np.float32), "b": np.arange(3, dtype=np.float32)}
    store.versions.publish_global(
        fragment, version, params, [np.ones((4, 3), np.float32)], {}, "bf16"
    )


def put_contribution(store: RunStore, seq: int = 1):
    payload = {"w": quantize(np.linspace(-1, 1, 300, dtype=np.float32), "int8")}
    return store.contributions.put_contribution("l0", 0, seq, payload, {"base_version": 0})


# --- activation ------------------------------------------------------------------------------


def test_only_a_bucket_given_an_injector_meets_faults(bucket_url, monkeypatch):
    """A bucket is faulty only where its opener gives it an injector that injects: a plan
    in the environment reaches none by itself (a process reads it once, where it starts:
    ``Injector.from_env``, and hands it on)."""
    assert type(open_bucket(bucket_url, region="us")) is Bucket
    assert type(RunStore("run", {"us": bucket_url}, "us").home) is Bucket
    inert = faults.Injector({"seed": 4})  # a plan that injects nothing
    assert type(open_bucket(bucket_url, region="us", injector=inert)) is Bucket
    lossy = faults.Injector({"error_rate": 0.5})
    assert isinstance(RunStore("run", {"us": bucket_url}, "us", faults=lossy).home, FaultyBucket)
    monkeypatch.setenv(faults.ENV_VAR, '{"error_rate": 0.5}')
    assert type(RunStore("run", {"us": bucket_url}, "us").home) is Bucket
    assert type(open_bucket(bucket_url, region="us")) is Bucket


def test_plan_from_the_environment(monkeypatch, make_bucket):
    url = make_bucket("memory")
    plan = FaultPlan(seed=5, error_rate=1.0, ops=("put",), t0=1000.0)
    for name, value in plan.to_env().items():
        monkeypatch.setenv(name, value)
    assert faults.plan_from_env() == plan  # t0 travels with it
    store = RunStore("run", {"us": url}, "us", faults=faults.Injector.from_env())
    assert isinstance(store.home, FaultyBucket)
    with pytest.raises(InjectedFault, match="injected error fault: put k in region us"):
        store.home.put("k", DATA)
    monkeypatch.setenv(faults.ENV_VAR, "")
    assert faults.Injector.from_env() is None


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ('{"error_rate": 2}', "'error_rate': must be between 0.0 and 1.0"),
        ('{"latency_seconds": "long"}', "'latency_seconds': expected a number"),
        ('{"eror_rate": 0.1}', "'eror_rate': unknown field"),
        ('{"outage": {"region": "eu", "start": 0}}', "'outage.seconds': missing"),
        ('{"disk_full": {"region": "eu", "start": 0}}', "'disk_full.start': give both"),
        ('{"disk_full": {"start": 0, "seconds": 1}}', "'disk_full.region': missing"),
        ('{"disk_full": {"region": "eu"}}', "'disk_full.start': a plan for a run needs"),
        ('{"ops": ["put", "copy"]}', "'ops': unknown 'copy'"),
        ('{"seed": 1.5}', "'seed': expected an integer"),
        ("[1, 2]", "expected an object"),
        ("{error_rate: 1}", "DILOCO_FAULTS is not JSON"),
    ],
)
def test_a_malformed_plan_names_the_field(monkeypatch, value, named):
    monkeypatch.setenv(faults.ENV_VAR, value)
    with pytest.raises(FaultPlanError, match=named) as caught:
        faults.Injector.from_env()
    assert str(caught.value).startswith(faults.ENV_VAR)


# --- each kind, on every backend --------------------------------------------------------------


def test_errors_fail_before_the_request(bucket_url, caplog):
    bucket, injector = faulty(bucket_url, error_rate=1.0, ops=["put", "get", "list"])
    plain = Bucket(bucket_url, region="us")
    plain.put("a/old", DATA)
    with caplog.at_level("WARNING", logger="storage_layout.faults"):
        for call in (lambda: bucket.put("a/k", DATA), lambda: bucket.put_many({"a/m": DATA}),
                     lambda: bucket.get("a/old"), lambda: bucket.list("a")):  # fmt: skip
            with pytest.raises(InjectedFault) as caught:
                call()
            assert not isinstance(caught.value, FileNotFoundError | TimeoutError)
    assert "injected error fault: put a/k in region us" in caplog.text
    assert "injected error fault: get a/old in region us" in caplog.text
    assert plain.list("a") == ["old"]  # nothing written
    assert bucket.exists("a/old") and bucket.traffic.as_dict() == {"us->us": {"bytes": 0, "requests": 1}}  # fmt: skip
    assert injector.counts() == {"error": 4}


def test_an_unreachable_open_is_a_region_down(bucket_url):
    plan = {"error_rate": 1.0, "ops": ["open"]}
    with pytest.raises(RegionDown, match="injected error fault: open / in"):
        RunStore("run", {"us": bucket_url}, "us", faults=faults.Injector(plan)).bucket("us")


def test_timeouts_before_and_after_the_effect(bucket_url):
    plain = Bucket(bucket_url, region="us")
    before, _ = faulty(bucket_url, timeout_before_rate=1.0, ops=["put", "put_exclusive"])
    after, injector = faulty(bucket_url, timeout_after_rate=1.0, ops=["put", "put_exclusive"])
    for bucket in (before, after):
        with pytest.raises(TimeoutError, match="injected timeout_"):
            bucket.put("b/put", DATA)
        with pytest.raises(TimeoutError):
            bucket.put_many({"b/many1": DATA, "b/many2": DATA[:7]})
        with pytest.raises(TimeoutError):
            bucket.put_exclusive("b/excl", DATA)
        landed = plain.list("b")
        assert landed == ([] if bucket is before else ["excl", "many1", "many2", "put"])
    assert before.traffic.uploaded == 0  # no request went out
    assert after.traffic.uploaded == 3 * len(DATA) + 7  # each landed once
    assert plain.get("b/many2") == DATA[:7]
    with pytest.raises(FileExistsError):
        plain.put_exclusive("b/excl", b"again")  # the lost-response write is there
    assert injector.counts() == {"timeout_after": 4}  # one per key of the batch


def test_a_batch_fails_key_by_key_and_only_the_failed_keys_are_asked_again(bucket_url):
    """A batch is one request per key: each meets its own faults, the others go through,
    ``PartialFailure`` names the failed ones, and the patient writers and readers ask
    again for those alone (a whole-batch retry of 9 objects at 7 % faults each fails
    half the time)."""
    plain = Bucket(bucket_url, region="us")
    objects = {f"p/k{n:02d}": bytes([n]) * 32 for n in range(40)}
    bucket, injector = faulty(bucket_url, error_rate=0.3, timeout_after_rate=0.2)
    with pytest.raises(PartialFailure) as caught:
        bucket.put_many(objects)
    failed = set(caught.value.failed)
    landed = {f"p/{n}" for n in plain.list("p")}
    assert 0 < len(failed) < len(objects)
    lost_responses = {k for k, e in caught.value.failed.items() if isinstance(e, TimeoutError)}
    assert landed == set(objects) - failed | lost_responses  # the rest went through
    with pytest.raises(PartialFailure) as caught:
        bucket.get_many(sorted(landed))
    assert set(caught.value.done) | set(caught.value.failed) == landed
    assert all(caught.value.done[k] == objects[k] for k in caught.value.done)

    patient, injector = faulty(bucket_url, error_rate=0.1, timeout_after_rate=0.05)
    put_patiently(patient, objects, "the batch")
    assert {f"p/{n}" for n in plain.list("p")} == set(objects)
    assert get_patiently(patient, sorted(objects), "the batch") == objects
    # A whole-batch retry would meet a fault in nearly every round (1 - 0.85**40).
    assert 0 < sum(injector.counts().values()) < 0.4 * 2 * len(objects)

    with pytest.raises(InjectedFault) as caught:  # every key failed: the error itself
        faulty(bucket_url, error_rate=1.0, ops=["put"])[0].put_many({"p/a": b"1", "p/b": b"2"})
    assert not isinstance(caught.value, PartialFailure)


def test_a_damaged_read_is_asked_again_alone(bucket_url, monkeypatch):
    """``fetch_objects`` keeps the objects that checked out and reads again only the one
    that came back truncated."""
    store = RunStore("run", {"us": bucket_url}, "us")
    publish(store)
    marker_key = store.layout.global_marker(0, 1)
    marker = read_marker(store.bucket("us"), marker_key)
    stored = [k for k, e in marker.objects.items() if "inline" not in e]
    assert len(stored) > 1
    reads, real = [], Bucket.get_many

    def truncating_once(self, keys):  # the first read of the first object comes back short
        reads.append(list(keys))
        out = real(self, keys)
        if len(reads) == 1:
            out[keys[0]] = out[keys[0]][:1]
        return out

    monkeypatch.setattr(Bucket, "get_many", truncating_once)
    got = fetch_objects(store.bucket("us"), marker, marker_key)
    assert got == fetch_objects(Bucket(bucket_url, region="us"), marker, marker_key)
    assert set(got) == set(marker.objects)
    assert reads[1] == reads[0][:1]  # the damaged one alone, asked again


def test_truncated_and_corrupted_reads(bucket_url):
    plain = Bucket(bucket_url, region="us")
    plain.put_many({"c/x": DATA, "c/y": DATA[::-1]})
    short, _ = faulty(bucket_url, truncate_rate=1.0)
    assert short.get("c/x") == DATA[:32]
    assert short.get_many(["c/x", "c/y"]) == {"c/x": DATA[:32], "c/y": DATA[::-1][:32]}
    bad, injector = faulty(bucket_url, corrupt_rate=1.0)
    for key, value in {**bad.get_many(["c/x", "c/y"]), "c/x": bad.get("c/x")}.items():
        original = plain.get(key)
        diffs = [i for i in range(len(original)) if value[i] != original[i]]
        assert len(value) == len(original) and len(diffs) == 1
        assert value[diffs[0]] == original[diffs[0]] ^ 0xFF
    assert injector.counts() == {"corrupt": 3}
    assert plain.get("c/x") == DATA  # the stored object is untouched


def test_stale_listings_leave_out_the_newest(bucket_url):
    plain = Bucket(bucket_url, region="us")
    names = [f"s{n:012d}.json" for n in (3, 10, 11, 200)]
    plain.put_many({f"d/commits/{n}": b"{}" for n in names})
    stale, injector = faulty(bucket_url, stale_list_rate=1.0, stale_list_drop=2)
    assert stale.list("d/commits") == names[:2]
    assert stale.list("d/nothing") == []  # an empty listing has nothing to leave out
    assert plain.list("d/commits") == names
    assert injector.counts() == {"stale_list": 1}


def test_latency_spikes(make_bucket):
    slow, injector = faulty(
        make_bucket("memory"), latency_rate=1.0, latency_seconds=0.05, ops=["put", "get"]
    )
    start = time.perf_counter()
    slow.put("e/k", DATA)
    assert slow.get("e/k") == DATA
    assert time.perf_counter() - start >= 0.1
    assert injector.counts() == {"latency": 2}


class _Clock:
    """The fault injector's clock, set by a test: an outage window opens and closes when
    the test says, however long each request (and its retries) takes on a busy machine."""

    def __init__(self, now: float):
        self.now = now

    def time(self) -> float:
        return self.now


def test_outage_window(make_bucket, monkeypatch):
    regions = {"us": make_bucket("file"), "eu": make_bucket("memory")}
    clock = _Clock(1_000.0)
    monkeypatch.setattr(faults, "time", clock)
    plan = {"outage": {"region": "eu", "start": 10.0, "seconds": 60.0}, "t0": clock.now}
    injector = faults.Injector(plan)
    syncer = RunStore("run", regions, "us", writer="syncer", faults=injector)
    eu = syncer.bucket("eu")  # opened before the window
    eu.put("run/k", DATA)
    clock.now += 10.0  # the window opens
    with pytest.raises(RegionOutage, match="injected outage fault: get run/k in region eu"):
        eu.get("run/k")
    with pytest.raises(RegionDown, match="outage"):
        RunStore("run", regions, "eu", faults=injector).bucket(
            "eu"
        )  # a bucket cannot even be opened
    assert syncer.home.list("run/globals") == []  # other regions are up
    report = syncer.versions.publish_global(0, 1, {"w": np.ones(3, np.float32)}, [], {}, "fp32")
    assert report.committed == ["us"] and "outage" in report.lagging["eu"]
    clock.now += 59.9
    with pytest.raises(RegionOutage):
        eu.get("run/k")  # still inside
    clock.now += 0.1  # the window is over
    assert eu.get("run/k") == DATA
    assert syncer.versions.sync_regions(0) == {"eu": 1}
    assert injector.counts()["outage"] >= 4


def test_a_full_disk_refuses_writes_and_serves_reads(bucket_url, caplog):
    """While a region's disk is full, every write fails as the operating system fails it
    (ENOSPC) before it takes effect, and reads, listings and deletes work; once freed,
    writes go through again. The test fills and frees it (no clock)."""
    bucket, injector = faulty(bucket_url, disk_full={"region": "us"})
    plain = Bucket(bucket_url, region="us")
    plain.put("a/old", DATA)
    plain.put("a/gone", DATA)
    bucket.put("a/before", DATA)  # not full yet
    injector.fill_disk("us")
    writes = (lambda: bucket.put("a/k", DATA), lambda: bucket.put_many({"a/m": DATA, "a/n": DATA}),
              lambda: bucket.put_exclusive("a/commits/x.json", DATA), bucket.probe_exclusive)  # fmt: skip
    with caplog.at_level("WARNING", logger="storage_layout.faults"):
        for write in writes:
            with pytest.raises(OSError) as caught:
                write()
            assert isinstance(caught.value, InjectedDiskFull)
            assert caught.value.errno == errno.ENOSPC
            assert "No space left on device" in str(caught.value)
        assert bucket.get("a/old") == DATA and bucket.get_many(["a/old"]) == {"a/old": DATA}
        assert bucket.list("a") == ["before", "gone", "old"] and bucket.exists("a/old")
        bucket.delete(["a/gone"])  # deleting frees space: it works
    assert "injected disk_full fault: put a/k in region us" in caplog.text
    assert plain.list("a") == ["before", "old"]  # nothing written, not even a temporary
    if bucket_url.startswith("file://"):
        assert not [n for n in os.listdir(bucket_url.removeprefix("file://") + "/a")
                    if n.startswith(".tmp-")]  # fmt: skip
    assert injector.counts() == {"disk_full": 4}
    injector.free_disk("us")
    bucket.put_many({"a/m": DATA})
    bucket.put_exclusive("a/commits/x.json", DATA)
    assert plain.get("a/m") == plain.get("a/commits/x.json") == DATA


def test_a_full_disk_fails_a_commit_and_leaves_committed_versions_readable(make_bucket):
    """A contribution committed under a full disk fails with ENOSPC and leaves no marker
    (readers never see it); the version committed before stays readable; freed, the same
    commit goes through."""
    url = make_bucket("file")
    injector = faults.Injector({"disk_full": {"region": "us"}})
    store = RunStore("run", {"us": url}, "us", writer="l0", faults=injector)
    put_contribution(store, seq=1)
    injector.fill_disk("us")
    with pytest.raises(OSError) as caught:
        put_contribution(store, seq=2)
    assert caught.value.errno == errno.ENOSPC
    assert store.contributions.contribution_seqs("l0", 0, "us") == [1]
    assert store.contributions.get_contribution("l0", 0, 1, "us") is not None
    injector.free_disk("us")
    put_contribution(store, seq=2)
    assert store.contributions.contribution_seqs("l0", 0, "us") == [1, 2]


def test_a_disk_full_window_on_the_clock(make_bucket):
    """For a run (``pipeline.faults``), the window follows the clock like an outage: the
    decision is a function of the time alone, so it is tested at given times."""
    plan = FaultPlan(disk_full={"region": "eu", "start": 10, "seconds": 40}, t0=1000.0)
    assert FaultPlan.from_dict(json.loads(plan.to_json()), source="pipeline.faults") == plan
    injector = faults.Injector(plan)
    assert injector.disk_full("eu", now=1009.9) is None
    assert "full for 40 s from t0 + 10 s" in injector.disk_full("eu", now=1010.0)
    assert injector.disk_full("eu", now=1049.9) and injector.disk_full("eu", now=1050) is None
    assert injector.disk_full("us", now=1020.0) is None  # another region's disk is fine
    with pytest.raises(FaultPlanError, match="with no start and seconds"):
        injector.fill_disk("eu")  # this window follows the clock
    t0 = time.time()
    injector = faults.Injector(
        {"disk_full": {"region": "us", "start": 0, "seconds": 3600}, "t0": t0}
    )
    bucket = open_bucket(make_bucket("memory"), region="us", injector=injector)
    with pytest.raises(InjectedDiskFull):
        bucket.put("k", DATA)


# --- replay ----------------------------------------------------------------------------------


def outcomes(url: str, seed: int, keys: list[str]) -> dict[str, list[str]]:
    """Per key, what 6 puts and 6 gets met under a plan of several kinds."""
    plan = FaultPlan(seed=seed, error_rate=0.2, timeout_before_rate=0.2, truncate_rate=0.3,
                     ops=("put", "get"))  # fmt: skip
    injector = faults.Injector(plan)
    bucket = open_bucket(url, region="us", injector=injector)
    seen: dict[str, list[str]] = {}

    def run(key: str) -> None:
        seen[key] = []
        for _ in range(6):
            for call in (lambda: bucket.put(key, DATA), lambda: len(bucket.get(key))):
                try:
                    seen[key].append(str(call()))
                except OSError as exc:
                    seen[key].append(type(exc).__name__)

    threads = [threading.Thread(target=run, args=(k,)) for k in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return seen


def test_same_seed_same_faults_whatever_the_interleaving(make_bucket):
    keys = [f"r/k{i}" for i in range(8)]
    first = outcomes(make_bucket("memory"), 7, keys)  # each run on a fresh, empty bucket
    assert first == outcomes(make_bucket("memory"), 7, keys[::-1])  # threads in another order
    assert first != outcomes(make_bucket("memory"), 8, keys)
    kinds = {o for seq in first.values() for o in seq}
    assert {"None", "64", "32", "InjectedFault", "InjectedTimeout"} <= kinds


def test_nested_requests_draw_once_and_traffic_stays_true(make_bucket):
    url = make_bucket("file")  # put_many is a loop over put on a local filesystem
    bucket, injector = faulty(url, timeout_after_rate=1.0, ops=["put"])
    objects = {f"n/{i}": DATA[: 10 + i] for i in range(3)}
    with pytest.raises(TimeoutError):
        bucket.put_many(objects)
    assert Bucket(url).list("n") == ["0", "1", "2"]  # an inner put did not cut it short
    assert injector.counts() == {"timeout_after": 3}  # one per key; the inner puts draw none
    assert bucket.traffic.uploaded == sum(len(v) for v in objects.values())
    deleting, _ = faulty(url, error_rate=1.0, ops=["delete"])
    deleting.delete_prefix("n")  # its inner deletes are part of one delete_prefix request
    assert Bucket(url).list("n") == []


# --- the commit protocol under faults -----------------------------------------------------------


def test_lost_marker_response_commits_exactly_once(bucket_url):
    injector = faults.Injector({"timeout_after_rate": 1.0, "ops": ["put_exclusive"]})
    store = RunStore("run", {"us": bucket_url}, "us", writer="l0", faults=injector)
    marker = put_contribution(store)
    publish(store)
    assert injector.counts() == {"timeout_after": 2}
    plain = RunStore("run", {"us": bucket_url}, "us", writer="reader")
    key = plain.layout.contribution_marker("l0", 0, 1)
    assert read_marker(plain.home, key).write_id == marker.write_id  # ours: no conflict
    assert plain.home.list("run/learners/l0/contributions/f0000/data") == [
        f"s000000000001-{marker.write_id}"
    ]
    assert (
        plain.versions.global_versions(0) == [1]
        and plain.versions.get_global(0, 1).params["w"][0, 0] == 1.5
    )


def test_a_lost_answer_to_a_numbered_claim_is_still_ours(bucket_url):
    """A claim whose write landed but whose answer was lost is found there by the retry:
    it is this writer's, not another's, so blocks of seqs stay contiguous and no learner
    refuses its own numbers (bench/chaos: each lost answer cost a learner up to 8
    sends)."""
    injector = faults.Injector({"timeout_after_rate": 1.0, "ops": ["put_exclusive"]})
    store = RunStore("run", {"us": bucket_url}, "us", writer="l0", faults=injector)
    assert store.members.reserve_seqs("l0", 1, 8) == (1, 1, 9)
    assert store.members.reserve_seqs("l0", 9, 8, after=1) == (2, 9, 17)
    assert store.members.claim_generation("l0") == 1
    assert injector.counts() == {"timeout_after": 3}
    other = RunStore("run", {"us": bucket_url}, "us", writer="l0")  # a new process
    assert other.members.reserve_seqs("l0", 3, 8) == (3, 17, 25)  # above both blocks


def test_marker_write_that_timed_out_before_is_retried(bucket_url):
    key = "run/learners/l0/contributions/f0000/commits/s000000000001.json"

    def fails_once(seed: int) -> bool:
        draw = [faults.uniform(seed, "", "us", "put_exclusive", key, n, "timeout_before") for n in (0, 1)]  # fmt: skip
        return draw[0] < 0.5 <= draw[1]

    seed = next(s for s in range(200) if fails_once(s))  # the replay rule, used directly
    plan = {"seed": seed, "timeout_before_rate": 0.5, "ops": ["put_exclusive"]}
    injector = faults.Injector(plan)
    marker = put_contribution(
        RunStore("run", {"us": bucket_url}, "us", writer="l0", faults=injector)
    )
    assert injector.counts() == {"timeout_before": 1}
    plain = RunStore("run", {"us": bucket_url}, "us")
    assert read_marker(plain.home, key).write_id == marker.write_id


@pytest.mark.parametrize("kind", ["truncate", "corrupt"])
def test_damaged_reads_of_a_committed_version_raise_corrupt_version(bucket_url, kind):
    writer = RunStore("run", {"us": bucket_url}, "us", writer="syncer")
    publish(writer)
    put_contribution(writer)
    key = writer.layout.global_marker(0, 1)
    marker = read_marker(writer.home, key)
    injector = faults.Injector({f"{kind}_rate": 1.0})
    reader = RunStore("run", {"us": bucket_url}, "us", writer="reader", faults=injector)
    with pytest.raises(CorruptVersion):
        reader.versions.get_global(0, 1)  # the marker itself reads damaged
    with pytest.raises(CorruptVersion):
        reader.contributions.get_contribution("l0", 0, 1, "us")
    with pytest.raises(CorruptVersion, match=r"marker says|sha256"):
        fetch_objects(reader.home, marker, key, use_inline=False)  # the data objects
    assert injector.counts()[kind] >= 3


CRASHING_WRITER = """
import sys
import numpy as np
from protocol.quantize import quantize
from storage_layout.faults import Injector
from storage_layout.store import RunStore
store = RunStore("run", {"us": sys.argv[1]}, "us", writer="learner-0", faults=Injector.from_env())
store.contributions.put_contribution("learner-0", 0, 1, {"w": quantize(np.ones(4, np.float32), "fp32")},
                       {"base_version": 0})
print("survived")
"""


def test_a_crash_kills_the_writer_between_its_data_and_its_marker(tmp_path):
    """``crash``: a learner dies during an upload (data written, marker not), and says so
    in the shared fault log first."""
    import json
    import os
    import subprocess
    import sys

    log = tmp_path / "faults.jsonl"
    plan = {"seed": 1, "crash_rate": 1.0, "log_path": str(log)}
    env = {**os.environ, "DILOCO_FAULTS": json.dumps(plan)}
    (tmp_path / "b").mkdir()
    url = f"file://{tmp_path / 'b'}"
    proc = subprocess.run([sys.executable, "-c", CRASHING_WRITER, url], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == -9 and "survived" not in proc.stdout, proc.stderr
    assert "injected crash fault" in proc.stderr
    (line,) = [json.loads(x) for x in log.read_text().splitlines()]
    assert line["kind"] == "crash" and line["pid"] > 0 and "/contributions/" in line["key"]
    store = RunStore("run", {"us": url}, "us")
    assert store.contributions.contribution_seqs("learner-0", 0, "us") == []  # no marker: invisible
    data = tmp_path / "b" / "run" / "learners" / "learner-0" / "contributions" / "f0000" / "data"
    assert len(list(data.iterdir())) == 1  # what it wrote before it died
    # Other markers (a global version) are not crash points.
    injector = faults.Injector({**plan, "log_path": None})
    RunStore("run", {"us": url}, "us", faults=injector).versions.publish_global(
        0, 0, {"w": np.ones(2)}, [], {}
    )
