"""Nothing outside a run's own objects is ever touched, whatever a stored object says.

Someone who may write only under ``RUN/learners/learner-0/`` (a learner's scope) forges
commit markers that name other data: a folder outside the bucket, the run's global
versions. No reader fetches it and retention deletes none of it; keys that leave the
bucket are refused by the bucket itself; oversized markers are refused unread.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from protocol.quantize import quantize
from storage_layout.auth import Keys, learner_key
from storage_layout.bucket import Bucket, ForeignObject
from storage_layout.commit import MAX_MARKER_BYTES, CommitMarker, CorruptVersion, read_marker
from storage_layout.layout import LayoutError
from storage_layout.retention import collect_garbage
from storage_layout.store import RunStore

SECRET = "s" * 32
RUN = "run"


def _payload(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": quantize(rng.normal(size=(8, 4)).astype(np.float32), "int4")}


def _publish(store: RunStore, v: int, meta: dict) -> None:
    params = {"w": np.full((8, 4), float(v), np.float32)}
    store.versions.publish_global(0, v, params, [np.zeros((8, 4), np.float32)], meta)


def _forge(bucket: Bucket, seq: int, data_prefix: str) -> str:
    """An unsigned marker in learner-0's scope, below the cursor, naming ``data_prefix``."""
    key = f"{RUN}/learners/learner-0/contributions/f0000/commits/s{seq:012d}.json"
    marker = CommitMarker(
        "contribution", data_prefix, {"zarr.json": {"size": 2, "sha256": "0" * 64}},
        "learner-0", "0123456789abcdef",
        {"learner": "learner-0", "fragment": 0, "seq": seq, "base_version": 0, "tokens": 1},
    )  # fmt: skip
    bucket.put_exclusive(key, marker.to_json())
    return key


@pytest.mark.parametrize("with_secret", [True, False])
def test_retention_never_deletes_what_a_forged_marker_names(tmp_path, with_secret):
    root = tmp_path / "bucket"
    victim = tmp_path / "victim"
    root.mkdir()
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    url = f"file://{root}"
    store = RunStore(RUN, {"us": url}, "us", writer="syncer")
    key = learner_key(SECRET, RUN, "learner-0")
    for seq in (1, 2, 3):
        store.contributions.put_contribution("learner-0", 0, seq, _payload(seq), {"base_version": 0},
                               key=key)  # fmt: skip
    decided = [["learner-0", s] for s in (1, 2, 3, 4, 5)]
    for v in range(4):
        _publish(store, v, {"cursor": {"learner-0": 9}, "consumed": decided})
    globals_before = sorted(p.relative_to(root) for p in (root / RUN / "globals").rglob("*"))
    outside = _forge(store.home, 4, "../victim")  # tmp_path/victim
    inside = _forge(store.home, 5, f"{RUN}/globals/f0000")
    for forged in (outside, inside):
        with pytest.raises(CorruptVersion, match="forged or foreign"):
            read_marker(store.home, forged)
    keys = Keys(RUN, SECRET) if with_secret else None
    report = collect_garbage(store, 1, {"learner-0": "us"}, window=1, keys=keys)

    assert (victim / "precious").read_text() == "keep me"
    after = sorted(p.relative_to(root) for p in (root / RUN / "globals").rglob("*"))
    assert set(after) >= {p for p in globals_before if "/v000000000003" in str(p)}
    assert (
        store.versions.global_versions(0)[-1] == 3 and store.versions.get_global(0, 3).version == 3
    )
    # The forgeries stay (named), and the genuine processed contributions went.
    assert store.contributions.contribution_seqs("learner-0", 0, "us") == [3, 4, 5]
    assert report.contributions_deleted == 2
    named = " ".join(report.problems)
    assert "s000000000004" in named and "s000000000005" in named


def test_an_unsigned_marker_with_its_own_prefix_is_kept_when_the_run_is_signed(tmp_path):
    """A forgery that names only its own data: with the run secret, retention keeps it
    (it cannot be authenticated) and says so."""
    url = f"file://{tmp_path}"
    store = RunStore(RUN, {"us": url}, "us", writer="syncer")
    key = learner_key(SECRET, RUN, "learner-0")
    for seq in (1, 3):
        store.contributions.put_contribution("learner-0", 0, seq, _payload(seq), {"base_version": 0},
                               key=key)  # fmt: skip
    store.contributions.put_contribution(
        "learner-0", 0, 2, _payload(2), {"base_version": 0}
    )  # unsigned
    _publish(store, 0, {"cursor": {"learner-0": 3}})
    report = collect_garbage(store, 1, {"learner-0": "us"}, window=1, keys=Keys(RUN, SECRET))
    assert store.contributions.contribution_seqs("learner-0", 0, "us") == [2, 3]
    assert any("s000000000002" in p and "unsigned" in p for p in report.problems)


@pytest.mark.parametrize("key", ["../escape", "run/../../escape", "/abs", "run//x", "run/./x"])
def test_a_bucket_refuses_keys_that_leave_it(bucket_url, key):
    bucket = Bucket(bucket_url)
    with pytest.raises(LayoutError, match="not a plain relative key"):
        bucket.delete_prefix(key)
    with pytest.raises(LayoutError, match="not a plain relative key"):
        bucket.put(key, b"x")
    with pytest.raises(LayoutError, match="not a plain relative key"):
        bucket.get(key)
    with pytest.raises(LayoutError):
        bucket.delete_prefix("")  # never the whole bucket


def test_an_oversized_marker_is_refused_before_it_is_parsed(bucket_url):
    bucket = Bucket(bucket_url)
    key = f"{RUN}/learners/learner-0/contributions/f0000/commits/s000000000001.json"
    body = json.dumps({"format": "diloco-commit", "pad": "x" * (MAX_MARKER_BYTES + 10)})
    bucket.put_exclusive(key, body.encode())
    before = bucket.traffic.as_dict().get("default->default", {}).get("bytes", 0)
    with pytest.raises(CorruptVersion, match="larger than"):
        read_marker(bucket, key)
    read = bucket.traffic.as_dict()["default->default"]["bytes"] - before
    assert read <= 3 * (MAX_MARKER_BYTES + 1)  # (asked patiently: at most 3 bounded reads)


@pytest.mark.parametrize(
    ("shape", "chunk", "named"),
    [([20_000 << 20], [1 << 20], "declares 20971520000 values"),
     ([16], [1], "chunks of 1 values")],
)  # fmt: skip
def test_a_metadata_bomb_is_refused_before_anything_is_allocated(shape, chunk, named):
    """A ``zarr.json`` that claims a huge array (or millions of tiny chunks) is refused
    by the bytes its chunks hold, before zarr reads (and allocates) anything."""
    from storage_layout.codec import FormatError, decode, encode

    objects = encode({"delta": _payload(0)}, {"kind": "contribution"})
    meta = json.loads(objects["delta/data/zarr.json"])
    meta["shape"] = shape
    meta["chunk_grid"]["configuration"]["chunk_shape"] = chunk
    objects["delta/data/zarr.json"] = json.dumps(meta).encode()
    with pytest.raises(FormatError, match=named):
        decode(objects)


def test_a_runs_store_asks_for_no_key_outside_the_run(bucket_url):
    """Every bucket a ``RunStore`` opens is scoped to the run's prefix: a key of another
    run, or of the bucket's root, is refused before any request."""
    store = RunStore(RUN, {"us": bucket_url}, "us", writer="syncer")
    for key in ("other/spec.json", "spec.json", "runner/x", ""):
        with pytest.raises(LayoutError, match="outside run 'run'"):
            store.home.get(key)
    with pytest.raises(LayoutError, match="outside run 'run'"):
        store.home.delete_prefix("other/globals")
    store.home.probe_exclusive()  # under the run's own prefix
    assert store.home.list(f"{RUN}/.diloco-probe") == []  # (it cleaned up after itself)


def _outside(tmp_path, name: str):
    """A folder outside the bucket, its file two hours old (older than any orphan age)."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "zarr.json").write_text("precious")
    old = time.time() - 7200
    os.utime(folder / "zarr.json", (old, old))
    return folder


def test_sweeps_follow_no_link_out_of_the_bucket(tmp_path, caplog):
    """A link planted under each kind of prefix the sweeps visit, named like an abandoned
    write or a temporary and pointing outside: ``collect_garbage`` (what ``diloco gc``
    and the syncers' retention run) deletes nothing through it and names it."""
    root = tmp_path / "bucket"
    root.mkdir()
    store = RunStore(RUN, {"us": f"file://{root}"}, "us", writer="syncer")
    store.contributions.put_contribution("learner-0", 0, 1, _payload(1), {"base_version": 0})
    _publish(store, 0, {"cursor": {"learner-0": 1}})
    layout = store.layout
    orphan = "s000000000077-00000000deadbeef"
    planted = {
        f"{layout.checkpoint_commits('learner-0').rsplit('/', 1)[0]}/data/{orphan}": "ckpt",
        f"{layout.contribution_commits('learner-0', 0).rsplit('/', 1)[0]}/data/{orphan}": "c",
        f"{layout.global_commits(0).rsplit('/', 1)[0]}/data/v000000000077-00000000deadbeef": "g",
        f"{layout.lease_commits('learner-0')}/.tmp-0123": "lease",
        f"{layout.global_commits(0)}/.tmp-0123": "gtmp",
        f"{RUN}/.tmp-0123": "top",
    }
    victims = {}
    for key, name in planted.items():
        victims[key] = _outside(tmp_path, name)
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        target = victims[key] if "/data/" in key else victims[key] / "zarr.json"
        (root / key).symlink_to(target)
    # A whole folder the sweep lists, itself a link out.
    hist = root / layout.history("learner-0")
    hist.parent.mkdir(parents=True, exist_ok=True)
    hist.symlink_to(_outside(tmp_path, "history"))

    collect_garbage(store, 1, {"learner-0": "us"}, window=1, orphan_age=60)
    for folder in [*victims.values(), tmp_path / "history"]:
        assert (folder / "zarr.json").read_text() == "precious", folder
    for key in planted:
        assert (root / key).is_symlink(), f"{key} was deleted, not left alone"
    assert caplog.text.count("not deleted") >= len(planted)
    assert store.versions.global_versions(0) == [0] and store.versions.get_global(0, 0).version == 0


@pytest.mark.parametrize("kind", ["fifo", "link-to-fifo", "device", "link-inside"])
def test_a_marker_that_is_not_a_regular_file_is_refused_at_once(tmp_path, kind):
    """A commit marker that is a FIFO (which a plain read waits on for ever), a link to
    one, a device or a link at all is refused by name, without waiting."""
    bucket = Bucket(f"file://{tmp_path}")
    key = f"{RUN}/learners/learner-0/contributions/f0000/commits/s000000000001.json"
    path = tmp_path / key
    path.parent.mkdir(parents=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link-to-fifo":
        os.mkfifo(tmp_path / "pipe")
        path.symlink_to(tmp_path / "pipe")
    elif kind == "device":
        path.symlink_to("/dev/zero")
    else:
        (tmp_path / "real.json").write_text("{}")
        path.symlink_to(tmp_path / "real.json")
    with pytest.raises(CorruptVersion, match=r"not followed|not a regular file|outside"):
        read_marker(bucket, key)
    with pytest.raises(ForeignObject):
        bucket.get_many([key])
