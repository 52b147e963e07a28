"""Self-describing buckets: named tensor records and an encoding note per Zarr group
(groups of the older, unlabelled format still read), the advisory ``latest.json``
pointer per global fragment, and optimizer leaves named by their path in the optax
state tree (positional names of older versions and checkpoints still read)."""

import json
import logging

import numpy as np
import pytest

from diloco.config import InnerConfig, OuterConfig
from diloco.inner import inner_optimizer
from diloco.syncer import FragmentSyncer, GlobalVersion
from diloco.tensors import slot_leaves
from flows.bucket_io import BucketStore
from flows.state_io import (
    leaf_names,
    named_outer_leaves,
    optimizer_leaves,
    optimizer_state,
    ordered_outer_leaves,
)
from protocol.quantize import quantize
from storage_layout.audit import audit_run
from storage_layout.bucket import Bucket
from storage_layout.codec import ENCODING, decode, encode
from storage_layout.commit import CorruptVersion, commit_version, new_write_id
from storage_layout.inspect import inspect_bucket
from storage_layout.retention import collect_garbage
from storage_layout.store import RunStore

rng = np.random.default_rng(5)
KINDS = ["fp32", "bf16", "int8", "int4"]


def tensors(kind: str) -> dict:
    return {
        "blocks.0.up.kernel": quantize(rng.normal(size=(33, 17)).astype(np.float32), kind),
        "norm.scale": quantize(rng.normal(size=(17,)).astype(np.float32), kind),
    }


def as_old_format(objects: dict[str, bytes], group: str) -> dict[str, bytes]:
    """``objects`` as the codec wrote them before tensor records had names: a list per
    tensor and no ``encoding`` note."""
    meta = json.loads(objects[f"{group}/zarr.json"])
    attrs = meta["attributes"]
    attrs.pop("encoding")
    attrs["tensors"] = [
        [t["name"], t["shape"], t["block_size"], *t["data"], *t["scales"]] for t in attrs["tensors"]
    ]
    return {**objects, f"{group}/zarr.json": json.dumps(meta).encode()}


def same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name, q in a.items():
        r = b[name]
        assert (q.kind, q.shape, q.block_size) == (r.kind, r.shape, r.block_size)
        assert q.data.dtype == r.data.dtype and np.array_equal(q.data, r.data)
        assert (q.scales is None and r.scales is None) or np.array_equal(q.scales, r.scales)


# --- tensor records -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_groups_name_their_fields_and_say_how_they_are_encoded(kind):
    t = tensors(kind)
    objects = encode({"delta": t}, {})
    attrs = json.loads(objects["delta/zarr.json"])["attributes"]
    assert attrs["kind"] == kind and attrs["encoding"] == ENCODING[kind]
    records = {r["name"]: r for r in attrs["tensors"]}
    assert set(records) == set(t)
    r = records["blocks.0.up.kernel"]
    assert set(r) == {"name", "shape", "kind", "dtype", "block_size", "data", "scales"}
    assert r["shape"] == [33, 17] and r["kind"] == kind
    assert r["dtype"] == {"fp32": "float32", "bf16": "bfloat16"}.get(kind, kind)
    d0, d1 = r["data"]
    assert d1 - d0 == t["blocks.0.up.kernel"].data.size
    if kind in ("int8", "int4"):
        assert r["block_size"] == 128 and r["scales"][1] - r["scales"][0] == 5  # 561 / 128
    same(t, decode(objects)[0]["delta"])


def test_encoding_notes_describe_the_bit_layouts():
    assert "uint16" in ENCODING["bf16"] and "<< 16" in ENCODING["bf16"]
    assert "low nibble first" in ENCODING["int4"] and "q + 8" in ENCODING["int4"]
    # The int4 note's rule, applied by hand, gives the codec's values.
    q = quantize(np.linspace(-1, 1, 7, dtype=np.float32), "int4", block_size=4)
    codes = np.empty(2 * q.data.size, np.int16)
    codes[0::2], codes[1::2] = q.data & 0x0F, q.data >> 4
    by_hand = (codes[:7] - 8) * np.repeat(q.scales, 4)[:7]
    from protocol.quantize import dequantize

    np.testing.assert_array_equal(by_hand.astype(np.float32), dequantize(q))


@pytest.mark.parametrize("kind", KINDS)
def test_groups_of_the_unlabelled_format_still_decode(kind):
    t = tensors(kind)
    old = as_old_format(encode({"delta": t, "empty": {}}, {"note": "x"}), "delta")
    assert isinstance(json.loads(old["delta/zarr.json"])["attributes"]["tensors"][0], list)
    groups, attrs = decode(old)
    assert attrs["note"] == "x" and groups["empty"] == {}
    same(t, groups["delta"])


def test_a_stored_version_of_the_old_format_reads(tmp_path):
    """A global version committed the old way (unlabelled records, positional optimizer
    leaves) reads through the store."""
    store = RunStore("r", {"us": f"file://{tmp_path}"}, "us", writer="syncer")
    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    meta = {"fragment": 0, "version": 1}
    objects = store.versions.global_objects(params, [np.ones((2, 3), np.float32)], meta, "bf16")
    for group in ("params", "opt", "wire"):
        objects = as_old_format(objects, group)
    write_id = new_write_id()
    commit_version(store.home, store.layout.global_marker(0, 1),
                   store.layout.global_data(0, 1, write_id), objects, "global", meta,
                   "old-syncer", write_id)  # fmt: skip
    state = store.versions.get_global(0, 1)
    np.testing.assert_array_equal(state.params["w"], params["w"])
    assert state.opt_names == ["0000"] and state.opt_leaves[0].tolist() == [[1.0] * 3] * 2
    assert store.versions.get_global(0, 1, learner_view=True).params["w"][1, 2] == 5.0


# --- the latest pointer -------------------------------------------------------------------


def pointer(store: RunStore, region: str, fragment: int = 0) -> dict:
    return json.loads(store.bucket(region).get(store.layout.global_latest(fragment)))


def publish(store: RunStore, version: int) -> None:
    store.versions.publish_global(
        0, version, {"w": np.full(3, version, np.float32)}, [], {}, "bf16"
    )


def test_each_region_points_at_its_newest_version(make_bucket):
    regions = {"us": make_bucket("file"), "eu": make_bucket("memory")}
    store = RunStore("r", regions, "us", writer="syncer")
    for v in (0, 1):
        publish(store, v)
    for region in regions:
        p = pointer(store, region)
        assert (p["fragment"], p["version"]) == (0, 1)
        assert p["marker"] == store.layout.global_marker(0, 1)
        assert p["data_prefix"] == store.versions.global_marker(0, 1, region).data_prefix
    assert store.bucket("us").list("r/globals/f0000") == ["commits", "data", "latest.json"]


def test_a_region_brought_up_to_date_gets_its_pointer(make_bucket):
    regions = {"us": make_bucket("file"), "eu": make_bucket("file")}
    home = RunStore("r", {"us": regions["us"]}, "us", writer="syncer")
    publish(home, 0)  # eu does not know about it
    both = RunStore("r", regions, "us", writer="syncer")
    assert both.versions.sync_regions(0) == {"eu": 0}
    assert pointer(both, "eu")["version"] == 0


def test_a_failed_pointer_write_never_fails_the_commit(tmp_path, monkeypatch, caplog):
    store = RunStore("r", {"us": f"file://{tmp_path}"}, "us", writer="syncer")
    publish(store, 0)
    real_put = Bucket.put

    def put(self, key, data):
        if key.endswith("latest.json"):
            raise TimeoutError("the store did not answer")
        return real_put(self, key, data)

    monkeypatch.setattr(Bucket, "put", put)
    with caplog.at_level(logging.WARNING, logger="storage_layout.store"):
        report = store.versions.publish_global(0, 1, {"w": np.ones(3, np.float32)}, [], {}, "bf16")
    assert report.committed == ["us"] and store.versions.latest_global(0) == 1
    assert "latest.json" in caplog.text and "did not answer" in caplog.text
    assert pointer(store, "us")["version"] == 0  # stale: the markers are the truth


def test_audit_inspect_and_retention_ignore_the_pointer(tmp_path):
    url = f"file://{tmp_path}"
    store = RunStore("r", {"us": url}, "us", writer="syncer")
    store.ensure_spec({"regions": {"us": url}, "learners": {"l0": "us"}, "fragments": [["w"]]})
    for v in range(4):
        store.versions.publish_global(
            0, v, {"w": np.full(3, v, np.float32)}, [], {"cursor": {}}, "bf16"
        )
    report = inspect_bucket(url, verify=True)
    run = report["runs"][0]
    assert run["problems"] == [] and run["fragments"][0]["newest"] == 3
    assert run["verified_versions"] == 4
    audit = audit_run("r", {"us": url})
    assert audit.ok, audit.violations
    gc = collect_garbage(store, 1, {"l0": "us"}, window=1, orphan_age=0.0)
    assert gc.globals_deleted == 2 and gc.orphans_deleted == 0 and not gc.problems
    assert store.versions.global_versions(0) == [2, 3] and pointer(store, "us")["version"] == 3


# --- named optimizer leaves --------------------------------------------------------------


PARAMS = {"b.kernel": np.zeros((2, 3), np.float32), "a.scale": np.zeros(3, np.float32)}
MOMENTUM = OuterConfig(momentum=0.9)


def test_outer_leaves_are_named_by_their_path_in_the_state_tree():
    syncer = FragmentSyncer(0, PARAMS, MOMENTUM, ["l0"], lambda _: False)
    leaves = [np.full(x.shape, i + 1, np.float32) for i, x in enumerate(syncer.opt_leaves)]
    named = named_outer_leaves(MOMENTUM, PARAMS, leaves)
    assert list(named) == ["0/trace/a.scale", "0/trace/b.kernel"]
    assert named_outer_leaves(OuterConfig(), PARAMS, []) == {}  # plain averaging: no state
    # Back in the tree's order, whatever order the names come in.
    names = list(reversed(named))
    back = ordered_outer_leaves(MOMENTUM, PARAMS, names, [named[n] for n in names])
    assert [float(x.flat[0]) for x in back] == [1.0, 2.0]
    # Positional names (versions written before names) are in order already.
    same_order = ordered_outer_leaves(MOMENTUM, PARAMS, ["0000", "0001"], leaves)
    assert all(a is b for a, b in zip(same_order, leaves, strict=True))
    with pytest.raises(CorruptVersion, match="missing"):
        ordered_outer_leaves(MOMENTUM, PARAMS, ["0/trace/x", "0/trace/y"], leaves)
    with pytest.raises(ValueError):
        named_outer_leaves(MOMENTUM, PARAMS, leaves[:1])


def bucket_store(tmp_path) -> BucketStore:
    url = f"file://{tmp_path}"
    spec = {"config": {"outer": {"momentum": 0.9}}, "regions": {"us": url},
            "learners": {"l0": "us"}, "fragments": [sorted(PARAMS)]}  # fmt: skip
    RunStore("r", {"us": url}, "us").ensure_spec(spec)
    return BucketStore("r", {"us": url}, "us", {"l0": "us"}, "bf16", "syncer")


def test_a_syncer_publishes_named_leaves_and_resumes_from_them(tmp_path):
    store = bucket_store(tmp_path)
    leaves = [np.full((3,), 1.0, np.float32), np.full((2, 3), 2.0, np.float32)]
    gv = GlobalVersion(0, 1, PARAMS, None, (), {}, {}, {}, 0, 0.0)
    assert store.publish(gv, leaves, {"cursor": {}})
    state = store.main.versions.get_global(0, 1)
    assert state.opt_names == ["0/trace/a.scale", "0/trace/b.kernel"]
    opt_zarr = json.loads(
        store.main.home.get(f"{store.main.versions.global_marker(0, 1).data_prefix}/opt/zarr.json")
    )
    assert [t["name"] for t in opt_zarr["attributes"]["tensors"]] == state.opt_names
    stored = store.load_fragment(0, window=4)  # the state is read a piece at a time
    assert [x.tolist() for x in slot_leaves(stored.opt_leaves, PARAMS)] == [
        x.tolist() for x in leaves
    ]
    # A version with positional leaves (written before names) resumes the same way.
    store.main.versions.publish_global(0, 2, PARAMS, leaves, {"cursor": {}}, "bf16")
    assert store.main.versions.get_global(0, 2).opt_names == ["0000", "0001"]
    stored = store.load_fragment(0, window=4)
    assert stored.version == 2
    assert [x.tolist() for x in slot_leaves(stored.opt_leaves, PARAMS)] == [
        x.tolist() for x in leaves
    ]
    resumed = FragmentSyncer(0, PARAMS, MOMENTUM, ["l0"], lambda _: False, 2, stored.opt_leaves)
    assert resumed.opt_state[0].trace["b.kernel"].tolist() == [[2.0] * 3] * 2


def test_checkpoint_leaves_are_named_and_positional_ones_still_restore():
    tx = inner_optimizer(InnerConfig())
    template = tx.init({"blocks.0.up.kernel": np.zeros((2, 3), np.float32),
                        "norm scale": np.zeros(3, np.float32)})  # fmt: skip
    leaves = optimizer_leaves(template)
    assert "1/0/mu/blocks.0.up.kernel" in leaves and "1/0/nu/norm_scale" in leaves  # sanitized
    assert list(leaves) == leaf_names(template)
    values = {n: np.full(v.shape, i, np.float32) for i, (n, v) in enumerate(leaves.items())}
    place = lambda host: host  # noqa: E731
    for stored in (values, {f"{i:04d}": v for i, v in enumerate(values.values())}):
        restored = optimizer_leaves(optimizer_state(stored, template, place))
        assert {n: v.tolist() for n, v in restored.items()} == {
            n: v.tolist() for n, v in values.items()
        }
    with pytest.raises(CorruptVersion):
        optimizer_state({"0000": values[next(iter(values))]}, template, place)
