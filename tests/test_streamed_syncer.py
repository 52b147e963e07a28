"""A syncer over buckets merges a fragment chunk by chunk: bounded memory whatever the
fragment's size, the bits of the in-memory merge, damage named by its chunk, and a
syncer killed half way through a version leaves nothing committed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from diloco.config import OuterConfig
from diloco.loops import Unreadable
from diloco.records import ids_of
from diloco.syncer import FragmentSyncer
from diloco.tensors import materialize
from flows.bucket_io import BucketStore
from protocol.quantize import quantize
from protocol.topology import run_slots
from storage_layout.faults import Injector
from storage_layout.store import RunStore

OUTER = {"momentum": 0.9, "lr": 0.8}


def _shapes(n: int) -> dict[str, tuple[int, ...]]:
    """A fragment of about ``n`` values: two large matrices and a small vector."""
    side = int((n // 2) ** 0.5)
    return {"blocks.0.up.kernel": (side, side), "blocks.1.up.kernel": (side, side + 3),
            "blocks.1.norm.scale": (side,)}  # fmt: skip


def _values(shapes, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return {n: (rng.standard_normal(s, dtype=np.float32) * scale) for n, s in shapes.items()}


def _run(root: Path, shapes) -> dict[str, str]:
    """Two regions' buckets with version 0 of one fragment and a contribution from each
    of two learners; returns the regions."""
    regions = {"us": f"file://{root}/us", "eu": f"file://{root}/eu"}
    for region in regions:
        (root / region).mkdir(parents=True)
    spec = {"config": {"outer": OUTER, "topology": {"downlink": "int8"}}, "regions": regions,
            "home": "us", "learners": {"a": "us", "b": "eu"}, "fragments": [sorted(shapes)]}  # fmt: skip
    store = RunStore("r", regions, "us", writer="syncer")
    store.ensure_spec(spec)
    store.versions.publish_global(0, 0, _values(shapes, 0), [np.zeros(s, np.float32) for _, s in
                         sorted(shapes.items())], {"cursor": {}}, "bf16")  # fmt: skip
    for i, learner in enumerate(["a", "b"]):
        mine = RunStore("r", regions, run_slots(spec)[learner], writer=learner)
        payload = {n: quantize(v, "int4") for n, v in _values(shapes, 10 + i, 0.01).items()}
        meta = {"base_version": 0, "anchor_seq": 0, "step": 10, "tokens": 1000 + i,
                "steps": 10, "seconds": 1.0}  # fmt: skip
        mine.contributions.put_contribution(learner, 0, 1, payload, meta)
    return regions


def _store(regions, memory_mb: int = 512, faults: Injector | None = None) -> BucketStore:
    return BucketStore("r", regions, "us", {"a": "us", "b": "eu"}, "bf16", "syncer",
                       downlink="int8", syncer_memory_mb=memory_mb, faults=faults)  # fmt: skip


def _merge(store: BucketStore, streamed: bool = True) -> FragmentSyncer:
    """Load fragment 0, offer every contribution, merge and publish version 1."""
    stored = store.load_fragment(0, 8)
    sink = store.version_sink if streamed else None
    params = stored.params if streamed else materialize(stored.params)
    slots = stored.opt_leaves if streamed else [materialize(s) for s in stored.opt_leaves]
    syncer = FragmentSyncer(0, params, OuterConfig(**OUTER), ["a", "b"], lambda n: False,
                            version=stored.version, opt_leaves=slots, sink=sink,
                            ids=ids_of(stored.meta))  # fmt: skip
    for learner in ("a", "b"):
        for header in store.contributions(learner, 0, 0):
            c = store.read(header)
            if not streamed:  # the whole payload in memory: the path before streaming
                c = c.__class__(**{**c.__dict__, "payload": c.payload.reader.tensors("delta")})
            syncer.offer(c)
    gv = syncer.merge().version
    leaves = [] if streamed else syncer.opt_leaves
    assert store.publish(gv, leaves, {"cursor": dict(gv.cursor), "weights": gv.weights})
    return syncer


def _published(regions) -> dict:
    store = RunStore("r", regions, "us")
    state = store.versions.get_global(0, 1)
    wire = store.versions.get_global(0, 1, region="eu", learner_view=True).params
    _, reader, _ = store.versions.get_global_delta(0, 1, region="eu")
    delta = reader.tensors("delta")
    return {"params": state.params, "opt": state.opt_leaves, "wire": wire, "delta": delta}


def _same_bits(x: dict, y: dict) -> None:
    for n in x["params"]:
        assert x["params"][n].tobytes() == y["params"][n].tobytes(), n
        assert x["wire"][n].tobytes() == y["wire"][n].tobytes(), n
        assert x["delta"][n].data.tobytes() == y["delta"][n].data.tobytes(), n
    assert all(a.tobytes() == b.tobytes() for a, b in zip(x["opt"], y["opt"], strict=True))


def test_a_streamed_merge_publishes_the_bits_of_the_in_memory_one(tmp_path):
    shapes = _shapes(3_000_000)  # three chunks per large tensor
    streamed, whole = _run(tmp_path / "s", shapes), _run(tmp_path / "w", shapes)
    _merge(_store(streamed))
    _merge(_store(whole), streamed=False)
    _same_bits(_published(streamed), _published(whole))


def _peak(root: Path, values: int) -> tuple[int, int]:
    """(fragment bytes in fp32, the most bytes allocated at once merging it)."""
    shapes = _shapes(values)
    store = _store(_run(root, shapes), memory_mb=64)
    tracemalloc.start()
    try:
        _merge(store)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return 4 * sum(int(np.prod(s)) for s in shapes.values()), peak


def test_a_fragment_larger_than_the_memory_bound_merges_in_it(tmp_path):
    """A 100 MB fragment (fp32) is merged and published by a syncer given 64 MB
    (``pipeline.syncer_memory_mb``) with under 64 MB allocated at any moment (each input
    and output is held a chunk or so at a time), and a fragment four times smaller needs
    about as much: the bound is flat in the fragment's size."""
    size, peak = _peak(tmp_path / "large", 25_000_000)
    assert size > 100e6
    assert peak < 64e6, f"{peak / 1e6:.0f} MB allocated at once for a {size / 1e6:.0f} MB fragment"
    small, small_peak = _peak(tmp_path / "small", 6_000_000)
    assert peak - small_peak < 16e6, (
        f"{small / 1e6:.0f} MB took {small_peak / 1e6:.0f} MB, {size / 1e6:.0f} MB took "
        f"{peak / 1e6:.0f} MB"
    )


def test_a_syncers_reads_ahead_and_uploads_fit_its_memory_setting():
    """The merge's readers fetch chunks ahead only with memory to spare: what a merge
    holds (a chunk per array read, those read ahead, five being built, the uploads in
    flight) stays within ``syncer_memory_mb`` wherever it allows one upload per region,
    and the default (512 MB) reads ahead (the merge above ran that way)."""
    from flows.version_stream import CHUNK_BYTES, reads_ahead, uploads_in_flight

    for learners in (2, 4, 16):
        for regions in (1, 2, 4):
            arrays = 2 * learners + 3
            for memory_mb in (64, 128, 256, 512, 1024):
                ahead = reads_ahead(memory_mb, regions, learners)
                uploads = uploads_in_flight(memory_mb, regions, learners)
                held = ((1 + ahead) * arrays + 5 + uploads * regions) * CHUNK_BYTES
                if (arrays + 5 + regions) * CHUNK_BYTES <= memory_mb * 2**20:
                    assert held <= memory_mb * 2**20, (learners, regions, memory_mb)
            assert reads_ahead(64, regions, learners) == 0
    assert reads_ahead(512, 2, 4) > 0
    assert _store({"us": "memory://x/us", "eu": "memory://x/eu"}).ahead > 0
    assert _store({"us": "memory://x/us", "eu": "memory://x/eu"}, memory_mb=64).ahead == 0


def test_each_contribution_chunk_is_fetched_once_for_the_scan_and_the_merge(tmp_path):
    """The scan when a contribution is listed keeps the chunks it checked on disk
    (``pipeline.syncer_spool_mb``); the merge takes them there: every chunk object of
    every contribution is fetched from its bucket once, and the spool ends empty."""
    from storage_layout.commit import read_marker

    shapes = _shapes(3_000_000)
    regions = _run(tmp_path, shapes)
    store = _store(regions)
    _merge(store)
    main = RunStore("r", regions, "us")
    chunks = 0
    for learner, region in (("a", "us"), ("b", "eu")):
        key = main.layout.contribution_marker(learner, 0, 1)
        marker = read_marker(main.bucket(region), key)
        chunks += sum("/c/" in rel and "inline" not in o for rel, o in marker.objects.items())
    assert chunks > 4 and store._spool.taken == chunks
    assert store._spool.size == 0
    off = _store(_run(tmp_path / "off", shapes))
    off.syncer_spool_mb = 0
    _merge(off)
    assert off._spool is None


def test_damage_in_one_chunk_is_named_by_its_chunk(tmp_path):
    shapes = _shapes(3_000_000)
    regions = _run(tmp_path, shapes)
    store = _store(regions)
    marker = store.main.contributions.contribution_head("b", 0, 1, "eu")
    chunk = sorted(k for k in marker.objects if k.startswith("delta/data/c/"))[1]
    path = Path(regions["eu"][len("file://") :]) / marker.data_prefix / chunk
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    [header] = store.contributions("b", 0, 0)
    got = store.read(header)
    assert isinstance(got, Unreadable)
    assert chunk in got.reason and "sha256" in got.reason


KILLED = """
import os, signal, sys
sys.path.insert(0, {root!r})
from tests.test_streamed_syncer import _merge, _store
from flows.version_stream import StreamedVersion

write = StreamedVersion.write
count = [0]
def dying(self, *args):
    count[0] += 1
    if count[0] == {after}:  # half way through the version: killed, no goodbye
        os.kill(os.getpid(), signal.SIGKILL)
    return write(self, *args)
StreamedVersion.write = dying
_merge(_store({regions!r}))
"""


def test_a_syncer_killed_half_way_through_a_version_commits_nothing(tmp_path):
    shapes = _shapes(3_000_000)
    regions, whole = _run(tmp_path / "s", shapes), _run(tmp_path / "w", shapes)
    script = KILLED.format(root=str(Path(__file__).parents[1]), after=4, regions=regions)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == -9, done.stderr[-2000:]
    store = RunStore("r", regions, "us")
    assert store.versions.global_versions(0) == [0] and store.versions.global_versions(0, "eu") == [
        0
    ]
    # Its uploads are data no marker names: the next syncer goes on from version 0.
    _merge(_store(regions))
    _merge(_store(whole), streamed=False)
    _same_bits(_published(regions), _published(whole))
    latest = json.loads(Path(regions["us"][7:], "r/globals/f0000/latest.json").read_text())
    assert latest["version"] == 1


@pytest.fixture(autouse=True)
def _quiet_jax(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")


def test_version_0_of_a_run_is_published_streamed_with_the_values_of_a_whole_publish(tmp_path):
    """``initialize_run`` writes version 0 through ``StreamedVersion`` (chunk by chunk, as
    a merge writes them): the objects and bits ``publish_global`` stores, at home and in
    the other region."""
    from diloco import records
    from diloco.config import load_config
    from flows.run import build_model, initialize_run
    from flows.state_io import named_outer_leaves

    cfg = load_config("tiny", overrides=["budget.tokens=64000"])
    model = build_model(cfg)
    runs = {}
    for how in ("streamed", "whole"):
        regions = {r: f"file://{tmp_path / how / r}" for r in ("us", "eu")}
        for region in regions:
            (tmp_path / how / region).mkdir(parents=True)
        runs[how] = regions
    initialize_run(RunStore("r", runs["streamed"], "us"), cfg)
    whole = RunStore("r", runs["whole"], "us")
    for p, names in enumerate(model.plan):
        params = {n: model.init[n] for n in names}
        leaves = FragmentSyncer(p, params, cfg.outer, [], lambda _: False).opt_leaves
        opt = named_outer_leaves(cfg.outer, params, leaves)
        whole.versions.publish_global(p, 0, params, opt, records.initial_version(p, 0.0),
                             cfg.topology.global_dtype)  # fmt: skip
    streamed = RunStore("r", runs["streamed"], "us")
    for p in range(len(model.plan)):
        # The same objects but the root's metadata (a whole publish copies the meta in)
        ours, theirs = (
            streamed.versions.global_marker(p, 0).objects,
            whole.versions.global_marker(p, 0).objects,
        )
        assert {r: o["sha256"] for r, o in ours.items() if r != "zarr.json"} == {
            r: o["sha256"] for r, o in theirs.items() if r != "zarr.json"
        }
        a, b = streamed.versions.get_global(p, 0), whole.versions.get_global(p, 0)
        assert a.opt_names == b.opt_names and a.meta == b.meta
        for n in b.params:
            assert a.params[n].tobytes() == b.params[n].tobytes(), n
        assert all(
            x.tobytes() == y.tobytes() for x, y in zip(a.opt_leaves, b.opt_leaves, strict=True)
        )
        wa = streamed.versions.get_global(p, 0, region="eu", learner_view=True).params
        wb = whole.versions.get_global(p, 0, region="eu", learner_view=True).params
        assert all(wa[n].tobytes() == wb[n].tobytes() for n in wb)


def test_a_syncer_that_meets_a_stale_listing_at_start_lists_again(tmp_path):
    """Defect: a syncer whose first listing of its fragment's versions left the newest
    (version 0, the only one) out crashed at start ("has no version of fragment 0") and
    was restarted. Version 0 is written before any syncer starts, so none listed is a
    stale listing: it lists again. (The plan's seed makes the first listing stale, the
    next one whole: the faults replay from the seed.)"""
    from storage_layout.fault_plan import uniform

    regions = _run(tmp_path, _shapes(2))
    key = "r/globals/f0000/commits"
    seed = next(s for s in range(1000) if uniform(s, "", "us", "list", key, 0, "stale_list") < 0.5
                and uniform(s, "", "us", "list", key, 1, "stale_list") >= 0.5)  # fmt: skip
    injector = Injector({"seed": seed, "stale_list_rate": 0.5, "ops": ["list"]})
    stored = _store(regions, faults=injector).load_fragment(0, 8)
    assert injector.counts().get("stale_list", 0) >= 1  # it met one, and went on
    assert stored.version == 0
