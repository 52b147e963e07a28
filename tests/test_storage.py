"""The bucket protocol against four real backends: local files, memory://, S3 (moto
server on loopback) and GCS (fake-gcs-server on loopback)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from diloco.outer import Contribution
from diloco.tensors import pieces as tensor_pieces
from flows.learner_buckets import contribution_meta
from flows.syncer_buckets import contribution_from
from protocol.quantize import quantize
from storage_layout.auth import Unauthenticated
from storage_layout.bucket import Bucket, BucketError
from storage_layout.codec import FormatError, decode, encode
from storage_layout.commit import (
    CommitConflict,
    CorruptVersion,
    content_write_id,
    content_write_id_of,
    entry,
    fetch_objects,
    read_marker,
)
from storage_layout.layout import LayoutError, RunLayout
from storage_layout.retention import ORPHAN_AGE, collect_garbage, prune_checkpoints
from storage_layout.store import RegionDown, RunStore, SpecMismatch, poll

rng = np.random.default_rng(3)


def contribution(learner="l0", fragment=0, seq=1, base=0, kind="int4"):
    payload = {
        "blocks.0.up.kernel": quantize(rng.normal(size=(33, 17)).astype(np.float32), kind),
        "norm.scale": quantize(rng.normal(size=(17,)).astype(np.float32), kind),
    }
    return Contribution(learner, fragment, seq, base, 4096, 8, 2.5, payload)


def put(store, c):
    """Commit ``c`` through the storage API (named tensors and JSON meta)."""
    return store.contributions.put_contribution(
        c.learner, c.fragment, c.seq, c.payload, contribution_meta(c)
    )


def get(store, learner, fragment, seq, region):
    return contribution_from(
        learner,
        fragment,
        seq,
        *store.contributions.get_contribution(learner, fragment, seq, region),
    )


def same_payload(a, b):
    for name, q in a.payload.items():
        r = b.payload[name]
        assert (q.kind, q.shape, q.block_size) == (r.kind, r.shape, r.block_size)
        assert q.data.dtype == r.data.dtype and np.array_equal(q.data, r.data)
        assert (q.scales is None and r.scales is None) or np.array_equal(q.scales, r.scales)


def publish(store, fragment, version, value=1.0, meta=None):
    params = {"w": np.full((4, 3), value, np.float32), "b": np.arange(3, dtype=np.float32)}
    return store.versions.publish_global(
        fragment, version, params, [np.full((4, 3), 0.5, np.float32)], meta or {}, "bf16"
    )


# --- codec --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8", "int4"])
def test_codec_round_trip_is_bit_exact(kind):
    c = contribution(kind=kind)
    objects = encode({"delta": c.payload, "empty": {}}, {"note": "x"})
    assert 3 <= len(objects) <= 8  # a handful of objects, whatever the tensor count
    groups, attrs = decode(objects)
    assert attrs["note"] == "x" and groups["empty"] == {}
    same_payload(c, Contribution(**{**c.__dict__, "payload": groups["delta"]}))
    sub = json.loads(objects["delta/zarr.json"])["attributes"]
    assert (
        sub["logical_dtype"]
        == {"fp32": "float32", "bf16": "bfloat16", "int8": "int8", "int4": "int4"}[kind]
    )


def test_codec_rejects_unknown_format_and_garbage():
    objects = encode({"delta": contribution().payload}, {})
    root = json.loads(objects["zarr.json"])
    root["attributes"]["format"] = 99
    with pytest.raises(FormatError, match="unknown format version 99"):
        decode({**objects, "zarr.json": json.dumps(root).encode()})
    with pytest.raises(FormatError, match="not a Zarr v3 group"):
        decode({"zarr.json": b"{not json"})


def test_layout_keys_sort_in_version_order_and_names_are_checked():
    layout = RunLayout("run-1")
    keys = [layout.global_marker(2, v) for v in (9, 10, 100, 11)]
    assert sorted(keys) == [layout.global_marker(2, v) for v in (9, 10, 11, 100)]
    assert layout.contribution_marker("us-east-2", 1, 7).endswith(
        "f0001/commits/s000000000007.json"
    )
    with pytest.raises(LayoutError, match="learner name 'us/2'"):
        layout.contribution_marker("us/2", 0, 1)


# --- commit protocol on every backend -------------------------------------------------------


def test_contribution_round_trip_and_discovery(bucket_url):
    store = RunStore("run", {"us": bucket_url}, "us", writer="l0")
    assert store.contributions.contribution_seqs("l0", 0, "us") == []
    sent = [contribution(seq=s) for s in (1, 2, 3)]
    for c in sent:
        put(store, c)
    assert store.contributions.contribution_seqs("l0", 0, "us") == [1, 2, 3]
    got = get(store, "l0", 0, 2, "us")
    assert (got.base_version, got.tokens, got.steps, got.seconds) == (0, 4096, 8, 2.5)
    same_payload(sent[1], got)
    marker = read_marker(store.home, store.layout.contribution_marker("l0", 0, 2))
    assert marker.writer == "l0" and len(marker.write_id) == 16
    assert all(len(o["sha256"]) == 64 for o in marker.objects.values())


def test_content_write_id_of_entries_is_content_write_id_of_objects():
    objects = encode({"delta": contribution().payload}, {"kind": "contribution"})
    key = "runs/r/contributions/l0/f0/commits/s1.json"
    entries = {rel: entry(blob) for rel, blob in objects.items()}
    assert content_write_id_of(key, entries) == content_write_id(key, objects)
    changed = {**objects, "delta/data/c/0": objects["delta/data/c/0"] + b"x"}
    assert content_write_id(key, changed) != content_write_id_of(key, entries)


def _streamed_payload(n=3_000_000, kind="int4"):
    """Tensors spanning several chunk objects, and ``pieces`` that quantize them a piece
    at a time (as a learner streams its outer gradient out)."""
    values = {"a.kernel": rng.normal(size=(1000, n // 1000)).astype(np.float32),
              "b.bias": rng.normal(size=(777,)).astype(np.float32)}  # fmt: skip
    calls = []

    def pieces():
        calls.append(1)
        for name, start, stop in tensor_pieces({n: v.shape for n, v in values.items()}):
            yield name, quantize(values[name].reshape(-1)[start:stop], kind)

    whole = {name: quantize(v, kind) for name, v in values.items()}
    return values, whole, pieces, calls


def test_a_streamed_contribution_is_the_same_objects_and_marker(bucket_url):
    values, whole, pieces, calls = _streamed_payload()
    store = RunStore("run", {"us": bucket_url}, "us", writer="l0")
    shapes = {n: v.shape for n, v in values.items()}
    meta = {"base_version": 0, "tokens": 1, "steps": 1, "seconds": 1.0}
    marker = store.contributions.put_contribution_stream(
        "l0", 0, 1, shapes, "int4", 128, pieces, meta
    )
    assert len(calls) == 2  # hashed, then uploaded: never held whole
    key = store.layout.contribution_marker("l0", 0, 1)
    objects = encode({"delta": whole}, {"kind": "contribution"})
    assert sum(1 for rel in objects if "/c/" in rel) > 2  # several chunks per array
    assert marker.write_id == content_write_id(key, objects)
    stored = fetch_objects(store.home, read_marker(store.home, key), key, use_inline=False)
    assert stored == objects  # byte-identical to the whole payload encoded
    m = marker.meta
    assert (m["learner"], m["fragment"], m["seq"]) == ("l0", 0, 1)
    assert m["payload_bytes"] == sum(q.nbytes for q in whole.values()) and "written_at" in m
    tensors, _ = store.contributions.get_contribution("l0", 0, 1, "us")
    same_payload(SimpleNamespace(payload=whole), SimpleNamespace(payload=tensors))
    # put_contribution of the whole tensors: the same objects, under the same write id.
    again = store.contributions.put_contribution("l0", 0, 2, whole, meta)
    assert again.objects == marker.objects
    assert again.write_id == content_write_id(store.layout.contribution_marker("l0", 0, 2), objects)


def test_a_streamed_contribution_is_signed_and_checked_by_its_reader(tmp_path):
    values, whole, pieces, _ = _streamed_payload(n=200_000)
    store = RunStore("run", {"us": f"file://{tmp_path}"}, "us", writer="l0")
    shapes = {n: v.shape for n, v in values.items()}
    store.contributions.put_contribution_stream(
        "l0", 0, 1, shapes, "int4", 128, pieces, {}, key=b"k" * 32
    )
    tensors, _ = store.contributions.get_contribution("l0", 0, 1, "us", key=b"k" * 32)
    same_payload(SimpleNamespace(payload=whole), SimpleNamespace(payload=tensors))
    with pytest.raises(Unauthenticated):
        store.contributions.get_contribution("l0", 0, 1, "us", key=b"x" * 32)


def test_pieces_that_change_between_their_two_calls_commit_nothing(tmp_path):
    values, _, pieces, calls = _streamed_payload(n=200_000)
    store = RunStore("run", {"us": f"file://{tmp_path}"}, "us", writer="l0")

    def drifting():
        for name, q in pieces():
            if len(calls) == 2 and name == "b.bias":
                q = quantize(np.zeros(q.size, np.float32), "int4")
            yield name, q

    shapes = {n: v.shape for n, v in values.items()}
    with pytest.raises(ValueError, match=r"other objects on its second call.*delta/data"):
        store.contributions.put_contribution_stream("l0", 0, 1, shapes, "int4", 128, drifting, {})
    assert store.contributions.contribution_seqs("l0", 0, "us") == []


def test_global_versions_full_and_learner_view(bucket_url):
    store = RunStore("run", {"us": bucket_url}, "us", writer="syncer")
    assert store.versions.latest_global(0) is None
    publish(store, 0, 1, 1.0, {"consumed": [["l0", 1]], "cursor": {"l0": 1}})
    publish(store, 0, 2, 1.0 + 2**-10)
    assert store.versions.global_versions(0) == [1, 2] and store.versions.latest_global(0) == 2
    full = store.versions.get_global(0, 2)
    assert full.params["w"][0, 0] == np.float32(1.0 + 2**-10) and len(full.opt_leaves) == 1
    view = store.versions.get_global(0, 2, learner_view=True)
    assert view.params["w"][0, 0] == 1.0 and view.opt_leaves == []  # bf16 on the wire
    assert store.versions.get_global(0, 1).meta["cursor"] == {"l0": 1}


def test_racing_syncers_exactly_one_wins(bucket_url):
    stores = [RunStore("run", {"us": bucket_url}, "us", writer=f"syncer-{i}") for i in range(2)]
    barrier, outcome = threading.Barrier(2), {}

    def race(i):
        barrier.wait()
        try:
            publish(stores[i], 0, 1, float(i))
            outcome[i] = "won"
        except CommitConflict as exc:
            outcome[i] = exc

    threads = [threading.Thread(target=race, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, o in outcome.items() if o == "won"]
    assert len(winners) == 1
    loser = 1 - winners[0]
    assert f"committed by syncer-{winners[0]}" in str(outcome[loser])
    # The winner's version is intact: the loser wrote under its own write id only.
    assert stores[loser].versions.get_global(0, 1).params["w"][0, 0] == float(winners[0])


def test_lost_response_is_resolved_by_reading_the_marker_back(bucket_url):
    store = RunStore("run", {"us": bucket_url}, "us", writer="syncer")
    bucket = store.home
    real = bucket.put_exclusive
    calls = []

    def lossy(key, data):
        real(key, data)  # the write lands...
        calls.append(key)
        raise OSError("connection reset")  # ...but the answer is lost

    bucket.put_exclusive = lossy
    publish(store, 0, 1)
    assert len(calls) == 1 and store.versions.latest_global(0) == 1  # no duplicate, no conflict


def test_a_failed_read_back_is_asked_again(bucket_url):
    """The marker's answer is lost and so is the first read-back's (an error, then a
    damaged body): the writer asks again instead of giving up on a write that landed."""
    store = RunStore("run", {"us": bucket_url}, "us", writer="syncer")
    bucket = store.home
    real_put, real_get = bucket.put_exclusive, bucket.get
    answers = [OSError("read timed out"), b"{not json"]

    def lossy(key, data):
        real_put(key, data)
        raise OSError("connection reset")

    def flaky(key, limit=None):
        if answers and key.endswith("v000000000001.json"):
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer
        return real_get(key, limit)

    bucket.put_exclusive, bucket.get = lossy, flaky
    publish(store, 0, 1)
    assert answers == [] and store.versions.latest_global(0) == 1


KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from storage_layout.store import RunStore
    store = RunStore("run", {"us": sys.argv[1]}, "us", writer="doomed")
    def hang(key, data):
        print("data written", flush=True)
        time.sleep(600)
    store.home.put_exclusive = hang
    store.versions.publish_global(0, 1, {"w": np.ones(3, np.float32)}, [], {}, "fp32")
    """
)


@pytest.mark.parametrize("backend", ["file", "s3", "gcs"])
def test_writer_killed_between_data_and_marker(backend, make_bucket):
    url = make_bucket(backend)
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, url],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )
    assert proc.stdout.readline().strip() == "data written"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    reader = RunStore("run", {"us": url}, "us", writer="reader")
    data_dir = "run/globals/f0000/data"
    assert len(reader.home.list(data_dir)) == 1  # the orphan data is there...
    assert reader.versions.latest_global(0) is None  # ...but no reader sees the version
    publish(reader, 0, 1, 7.0)  # the retry completes it
    assert reader.versions.get_global(0, 1).params["w"][0, 0] == 7.0
    # Retention removes the orphan once it is old enough, never the committed version.
    assert collect_garbage(reader, 1, {}, window=4, orphan_age=None).orphans_deleted == 0
    report = collect_garbage(reader, 1, {}, window=4, orphan_age=0.0)
    assert report.orphans_deleted == 1 and len(reader.home.list(data_dir)) == 1
    assert reader.versions.get_global(0, 1).params["w"][0, 0] == 7.0


# --- bad input and faults -------------------------------------------------------------------


def _version_objects(store, fragment=0, version=1):
    marker = read_marker(store.home, store.layout.global_marker(fragment, version))
    return marker, {rel: f"{marker.data_prefix}/{rel}" for rel in marker.objects}


def test_corrupt_truncated_and_missing_objects_are_detected(bucket_url):
    store = RunStore("run", {"us": bucket_url}, "us", writer="syncer")
    for v in (1, 2, 3, 4):
        publish(store, 0, v)
    bucket = store.home
    _, keys = _version_objects(store, 0, 1)
    chunk = keys["params/data/c/0"]
    data = bytearray(bucket.get(chunk))
    data[5] ^= 0x01
    bucket.put(chunk, bytes(data))
    with pytest.raises(CorruptVersion, match="does not match its sha256"):
        store.versions.get_global(0, 1)
    _, keys = _version_objects(store, 0, 2)
    bucket.put(keys["params/data/c/0"], bucket.get(keys["params/data/c/0"])[:-3])
    with pytest.raises(CorruptVersion, match="the marker says"):
        store.versions.get_global(0, 2)
    _, keys = _version_objects(store, 0, 3)
    bucket.delete([keys["params/data/c/0"]])
    with pytest.raises(CorruptVersion, match="listed in the marker is missing"):
        store.versions.get_global(0, 3)
    marker, _ = _version_objects(store, 0, 4)
    bucket.delete_prefix(marker.data_prefix)  # a marker without its data
    with pytest.raises(CorruptVersion, match="missing"):
        store.versions.get_global(0, 4)


def test_bad_markers_and_foreign_files(bucket_url, caplog):
    store = RunStore("run", {"us": bucket_url}, "us", writer="syncer")
    publish(store, 0, 1)
    bucket, layout = store.home, store.layout
    bucket.put(layout.global_marker(0, 2), b'{"format": "diloco-commit", "format_version": 7}')
    bucket.put(layout.global_marker(0, 3), b'{"format": "diloco-co')
    bucket.put(f"{layout.global_commits(0)}/notes.txt", b"hello")
    with caplog.at_level("WARNING"):
        assert store.versions.global_versions(0) == [1, 2, 3]
    assert "foreign object" in caplog.text
    with pytest.raises(CorruptVersion, match="format version 7"):
        store.versions.get_global(0, 2)
    with pytest.raises(CorruptVersion, match="not JSON"):
        store.versions.get_global(0, 3)
    assert store.versions.get_global(0, 1).version == 1  # the good version still reads


def test_nothing_committed_is_overwritten(bucket_url):
    store = RunStore("run", {"us": bucket_url}, "us", writer="l0")
    put(store, contribution(seq=1))
    before = get(store, "l0", 0, 1, "us")
    with pytest.raises(CommitConflict):
        put(store, contribution(seq=1))  # a learner that reuses a seq is refused
    same_payload(before, get(store, "l0", 0, 1, "us"))


def test_spec_written_once_and_differences_listed(bucket_url):
    store = RunStore("run", {"us": bucket_url}, "us")
    spec = {
        "config": {"model": {"width": 64}},
        "fragments": [["a"], ["b"]],
        "regions": {"us": bucket_url},
    }
    store.ensure_spec(spec)
    store.ensure_spec(spec)  # same spec: fine, e.g. a resumed run
    changed = {**spec, "config": {"model": {"width": 128}}, "fragments": [["a", "b"]]}
    with pytest.raises(SpecMismatch) as info:
        store.ensure_spec(changed)
    assert "config.model.width: stored 64, given 128" in str(info.value)
    assert "fragments: stored" in str(info.value)
    assert store.read_spec()["config"]["model"]["width"] == 64
    # A key newer code added: no difference while it has its default (an older run
    # resumes under newer code), a difference once it does not.
    newer = {**spec, "config": {"model": {"width": 64, "factory": None}}}
    defaults = {"config": {"model": {"width": 32, "factory": None}}}
    store.ensure_spec(newer, defaults)
    with pytest.raises(SpecMismatch, match=r"config\.model\.factory: not in the stored spec"):
        store.ensure_spec({**spec, "config": {"model": {"width": 64, "factory": "m:f"}}}, defaults)
    with pytest.raises(SpecMismatch, match="factory"):
        store.ensure_spec(newer)  # without defaults every key counts


@pytest.mark.parametrize("backend", ["file", "s3", "gcs"])
def test_missing_bucket_is_named(backend, make_bucket):
    url = make_bucket(backend) + "-missing"
    with pytest.raises(BucketError, match="does not exist"):
        Bucket(url, region="eu")
    with pytest.raises(RegionDown, match="region eu"):
        RunStore("run", {"eu": url}, "eu").home  # noqa: B018


def test_missing_credentials_are_reported(s3_server, make_bucket, monkeypatch):
    url = make_bucket("s3")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    with pytest.raises(BucketError, match="credentials"):
        Bucket(url, region="us", storage_options={"skip_instance_cache": True})


def test_missing_gcs_credentials_are_reported(monkeypatch):
    for key in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NO_GCE_CHECK", "true")  # no metadata-server probe
    monkeypatch.setenv("CLOUDSDK_CONFIG", "/nonexistent")  # no gcloud user credentials
    with pytest.raises(BucketError, match="region eu: no GCS credentials found for gs://b"):
        Bucket("gs://b", region="eu", storage_options={"skip_instance_cache": True})


def test_the_exclusive_create_probe(bucket_url):
    """Each backend refuses a real conflicting create, and the probe leaves nothing."""
    bucket = Bucket(bucket_url, region="r")
    bucket.probe_exclusive()
    assert bucket.list(".diloco-probe") == []
    # A server that ignores If-None-Match lets the second create through: refused.
    bucket.put_exclusive = bucket.put
    with pytest.raises(BucketError, match=r"region r: bucket .* does not honour exclusive"):
        bucket.probe_exclusive()


def test_backend_without_exclusive_writes_is_refused():
    with pytest.raises(BucketError, match="cannot write objects exclusively"):
        Bucket("http://127.0.0.1:9/bucket", region="x")
    # Refused by its scheme, before any connection is tried, naming the region and URL.
    with pytest.raises(BucketError, match=r"region a: 'ftp://nowhere\.invalid/x': ftp://"):
        Bucket("ftp://nowhere.invalid/x", region="a")


# --- regions -------------------------------------------------------------------------------


def test_two_regions_publish_everywhere_and_a_down_region_catches_up(make_bucket):
    us, eu = make_bucket("file"), make_bucket("s3")
    eu_later = eu + "-late"  # a bucket that does not exist yet: the region is down
    regions = {"us": us, "eu": eu_later}
    learner = RunStore("run", {"us": us, "eu": eu}, "eu", writer="l1")
    put(learner, contribution(learner="l1"))
    assert Bucket(us).list("run/learners") == []  # a learner writes only in its own region
    syncer = RunStore("run", regions, "us", writer="syncer")
    report = publish(syncer, 0, 1)
    assert report.committed == ["us"] and "unreachable" in report.lagging["eu"]
    import fsspec

    fsspec.filesystem("s3").mkdir(eu_later.removeprefix("s3://"))  # the region comes back
    syncer = RunStore("run", regions, "us", writer="syncer", traffic=syncer.traffic)
    assert syncer.versions.sync_regions(0) == {"eu": 1}
    there = RunStore("run", regions, "eu", writer="l1").versions.get_global(0, 1, learner_view=True)
    assert there.params["w"][0, 0] == 1.0
    pairs = syncer.traffic.as_dict()
    assert pairs["us->eu"]["bytes"] > 0 and pairs["us->us"]["requests"] > 0
    assert syncer.traffic.cross_region_bytes == pairs["us->eu"]["bytes"] + pairs.get(
        "eu->us", {}
    ).get("bytes", 0)


def test_syncer_reads_learners_in_other_regions(make_bucket):
    regions = {"us": make_bucket("gcs"), "eu": make_bucket("s3")}
    sent = contribution(learner="l1", seq=4)
    put(RunStore("run", regions, "eu", writer="l1"), sent)
    syncer = RunStore("run", regions, "us", writer="syncer")
    assert syncer.contributions.contribution_seqs("l1", 0, "eu") == [4]
    same_payload(sent, get(syncer, "l1", 0, 4, "eu"))
    assert syncer.traffic.as_dict()["eu->us"]["bytes"] > 0


# --- retention and polling -------------------------------------------------------------------


def test_retention_keeps_what_learners_need(bucket_url):
    store = RunStore("run", {"us": bucket_url}, "us", writer="syncer")
    learners = {"a": "us", "b": "us"}
    for seq in (1, 2, 3):
        put(store, contribution(learner="a", seq=seq, base=seq - 1))
    put(store, contribution(learner="b", seq=1, base=1))  # unprocessed, anchored on v1
    for v in range(1, 8):  # (no run secret: only what a version decided may be deleted)
        decided = [["a", 1], ["a", 2]] if v == 2 else []
        publish(store, 0, v, meta={"cursor": {"a": 2}, "consumed": decided})
    report = collect_garbage(store, 1, learners, window=2)
    assert report.contributions_deleted == 2  # a/1 and a/2 processed; a/3 and b/1 are not
    assert store.contributions.contribution_seqs("a", 0, "us") == [
        3
    ] and store.contributions.contribution_seqs("b", 0, "us") == [1]
    # newest 7, window 2 -> keep 5, 6, 7; plus 1 and 2 that pending contributions anchor on
    assert store.versions.global_versions(0) == [1, 2, 5, 6, 7]
    assert report.pinned[0] == [1, 2] and report.bytes_freed > 0
    assert store.versions.get_global(0, 5).version == 5


def test_retention_never_deletes_the_newest_version_a_stale_listing_left_out(tmp_path):
    """Home's listing leaves the newest version out (listings lag): every version from
    ``newest - window`` up stays, in every region, listed at home or not."""
    from storage_layout.faults import Injector

    regions = {r: f"file://{tmp_path / r}" for r in ("us", "eu")}
    for r in regions:
        (tmp_path / r).mkdir()
    store = RunStore("run", regions, "us", writer="syncer")
    for v in range(5):
        publish(store, 0, v, meta={"cursor": {}})
    plan = {"seed": 1, "stale_list_rate": 1.0, "regions": ["us"], "ops": ["list"]}
    lagging = RunStore("run", regions, "us", writer="syncer", faults=Injector(plan))
    assert lagging.versions.global_versions(0) == [0, 1, 2, 3]  # v4 is left out at home
    collect_garbage(lagging, 1, {}, window=1)
    # (newest 3 as home listed it, window 1: versions 0 and 1 go, everywhere)
    assert store.versions.global_versions(0) == store.versions.global_versions(0, "eu") == [2, 3, 4]
    assert store.versions.get_global(0, 4).version == 4


def test_retention_collects_abandoned_temporaries_and_data_once_they_are_old(make_bucket):
    """A writer killed mid-write leaves a ``.tmp-*`` file that no listing shows, or data
    that no marker names (a full disk failed the marker); both go once older than the
    orphan age, in every folder a run writes to (a fragment's, with fragment 0 also the
    learners' own and the run's top folder), while younger ones (a write in flight) and
    everything committed stay."""
    url = make_bucket("file")
    root = Path(url.removeprefix("file://"))
    store = RunStore("run", {"us": url}, "us", writer="syncer")
    c = contribution(learner="a", seq=1)
    put(store, c)
    publish(store, 0, 1)
    store.checkpoints.put_checkpoint(
        "a", 10, {"opt": {"mu.w": np.zeros((2, 2), np.float32)}}, {"seq": 1}
    )
    layout = store.layout
    folders = [layout.contribution_commits("a", 0), layout.global_commits(0),
               layout.ledger_commits(0), layout.checkpoint_commits("a"), layout.seq_claims("a"),
               layout.lease_commits("a"), layout.history("a"), "run"]  # fmt: skip
    old = time.time() - ORPHAN_AGE - 60
    stale, young = [], []
    for i, folder in enumerate(folders):
        (root / folder).mkdir(parents=True, exist_ok=True)
        stale.append(root / folder / f".tmp-{i:02d}old")
        young.append(root / folder / f".tmp-{i:02d}new")
    datas = [layout.contribution_data("a", 0, 2, "ab" * 8), layout.global_data(0, 2, "cd" * 8),
             layout.checkpoint_data("a", 20, "ef" * 8)]  # fmt: skip
    orphans = [root / d for d in datas]
    for path in orphans:
        path.mkdir(parents=True)
        (path / "zarr.json").write_text("x")
    (orphans[0] / "zarr.json").rename(orphans[0] / "c0")  # its write failed before zarr.json
    fresh = root / datas[0].replace("ab" * 8, "12" * 8)  # a write in flight
    fresh.mkdir()
    (fresh / "zarr.json").write_text("x")
    for path in stale + young:
        path.write_text("x")
    for path in [*stale, *orphans, *(p / n for p in orphans for n in os.listdir(p))]:
        os.utime(path, (old, old))
    assert store.home.list(layout.contribution_commits("a", 0)) == ["s000000000001.json"]

    # Another shard's fragments: only their own folders (fragment 0 owns none of these).
    report = collect_garbage(store, [1], {"a": "us"}, window=4, orphan_age=ORPHAN_AGE)
    assert report.temporaries_deleted == report.orphans_deleted == 0
    assert collect_garbage(store, 1, {"a": "us"}, window=4).temporaries_deleted == 0  # no age
    report = collect_garbage(store, 1, {"a": "us"}, window=4, orphan_age=ORPHAN_AGE)
    assert report.temporaries_deleted == len(stale) and report.orphans_deleted == len(orphans)
    assert not [p for p in stale + orphans if p.exists()], "abandoned ones stay"
    assert all(p.exists() for p in young) and fresh.exists(), "a write in flight went"
    same_payload(get(store, "a", 0, 1, "us"), c)  # what is committed stays whole
    assert (
        store.versions.get_global(0, 1).version == 1
        and store.checkpoints.get_checkpoint("a", 10)[1]["seq"] == 1
    )
    assert not report.problems


def test_poll_backs_off_exponentially():
    delays, answers = [], iter([None, None, None, "found"])
    assert (
        poll(lambda: next(answers), timeout=10, first_delay=0.1, max_delay=0.3, sleep=delays.append)
        == "found"
    )
    assert delays == [0.1, 0.2, 0.3]


def test_poll_gives_up_without_sleeping_past_its_timeout(monkeypatch):
    """On a clock the test drives (sleeping advances it), so however busy the machine."""
    import storage_layout.store as store_module

    clock = SimpleNamespace(now=0.0, slept=[])

    def sleep(seconds: float) -> None:
        clock.slept.append(seconds)
        clock.now += seconds

    monkeypatch.setattr(store_module, "time", SimpleNamespace(monotonic=lambda: clock.now))
    assert poll(lambda: None, timeout=0.2, first_delay=0.05, sleep=sleep) is None
    assert clock.slept == [0.05, 0.1] and clock.now <= 0.2  # the next, 0.2, would pass it


def test_checkpoints_round_trip_and_survive_retention(bucket_url):
    store = RunStore("run", {"us": bucket_url}, "us", writer="a")
    moments = {"mu.w": np.zeros((5, 3), np.float32), "nu.w": np.ones((5, 3), np.float32)}
    store.checkpoints.put_checkpoint("a", 120, {"opt": moments}, {"seq": 4})
    store.checkpoints.put_checkpoint("a", 240, {"opt": moments}, {"seq": 9})
    assert store.checkpoints.checkpoint_steps("a") == [120, 240]
    groups, meta = store.checkpoints.get_checkpoint("a", 240)
    assert np.all(groups["opt"]["nu.w"] == 1) and groups["opt"]["mu.w"].shape == (5, 3)
    assert meta["seq"] == 9 and meta["learner"] == "a" and meta["step"] == 240
    for v in range(1, 9):
        publish(store, 0, v)
    report = collect_garbage(store, 1, {"a": "us"}, window=1)
    # Learners rejoin from the newest versions: a checkpoint pins none.
    assert store.versions.global_versions(0) == [7, 8] and report.pinned[0] == []
    assert store.checkpoints.checkpoint_steps("a") == [120, 240]
    store.checkpoints.put_checkpoint("a", 360, {"opt": moments}, {"seq": 12})
    assert prune_checkpoints(store, "a", keep=2) == 1  # the learner prunes its own
    assert store.checkpoints.checkpoint_steps("a") == [240, 360]
    assert store.checkpoints.get_checkpoint("a", 240)[1]["seq"] == 9
    with pytest.raises(ValueError, match="keep must be at least 1"):
        prune_checkpoints(store, "a", keep=0)


def test_a_failed_prune_never_fails_the_checkpoint(bucket_url, monkeypatch, caplog):
    """Deleting an old checkpoint is best effort: a failed delete or listing is logged and
    retried by the next prune, and the checkpoint just written stands (it used to be
    reported as "checkpoint failed for good")."""
    store = RunStore("run", {"us": bucket_url}, "us", writer="a")
    moments = {"mu.w": np.zeros((2, 2), np.float32)}
    for step in (100, 200, 300):
        store.checkpoints.put_checkpoint("a", step, {"opt": moments}, {"seq": step})

    def refuse(*args):
        raise OSError("injected: delete refused")

    monkeypatch.setattr(store.home, "delete_prefix", refuse)
    assert prune_checkpoints(store, "a", keep=2) == 0
    assert "could not delete" in caplog.text and "delete refused" in caplog.text
    monkeypatch.undo()
    monkeypatch.setattr(store.checkpoints, "checkpoint_steps", refuse)
    assert prune_checkpoints(store, "a", keep=2) == 0
    assert "cannot list a's checkpoints" in caplog.text
    monkeypatch.undo()
    # The marker went first, so the half-deleted checkpoint is gone for readers; the
    # newest two stand and a later prune has nothing left to do.
    assert store.checkpoints.checkpoint_steps("a") == [200, 300]
    assert store.checkpoints.get_checkpoint("a", 300)[1]["seq"] == 300
    assert prune_checkpoints(store, "a", keep=2) == 0


def test_metrics_accumulate_traffic_over_processes(bucket_url):
    first = RunStore("run", {"r": bucket_url}, "r", writer="l0")
    put(first, contribution(learner="l0"))
    first.progress.write_metrics("l0", {"state": "training"}, totals={"seconds": 1.5})
    up = first.progress.read_metrics("l0")["bytes_up"]
    assert up > 0
    second = RunStore("run", {"r": bucket_url}, "r", writer="l0")  # a restarted process
    put(second, contribution(learner="l0", seq=2))
    second.progress.write_metrics("l0", {"state": "training"}, totals={"seconds": 1.0})
    second.progress.write_metrics("l0", {"state": "done"}, totals={"seconds": 2.0})  # running total
    record = second.progress.read_metrics("l0")
    assert record["state"] == "done" and record["bytes_up"] > up + up // 2
    assert record["seconds"] == pytest.approx(3.5)


def test_other_regions_hold_the_learner_view_only(make_bucket):
    regions = {"us": make_bucket("file"), "eu": make_bucket("memory")}
    syncer = RunStore("run", regions, "us", writer="syncer")
    publish(syncer, 0, 1)
    assert syncer.versions.get_global(0, 1).opt_leaves  # home: master copy and optimizer state
    with pytest.raises(CorruptVersion, match="learner view only"):
        syncer.versions.get_global(0, 1, region="eu")
    assert syncer.versions.get_global(0, 1, region="eu", learner_view=True).params["w"][0, 0] == 1.0
