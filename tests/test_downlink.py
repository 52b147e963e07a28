"""The compressed downlink (``topology.downlink``): learners that hold the previous version
read a quantized difference instead of the whole version, and get the same bits."""

import itertools
import json
import os
import tracemalloc

import numpy as np
import pytest

from diloco.config import load_config
from diloco.loops import GlobalView
from diloco.simulate import simulate
from diloco.syncer import GlobalVersion
from diloco.transport import (
    MemoryStore,
    StoreLearnerView,
    delta_bytes,
    downlink_piece,
    downlink_update,
    full_bytes,
    wire_view,
)
from flows.bucket_io import BucketStore
from flows.run import simulation_store
from protocol.quantize import dequantize, quantize
from storage_layout.spill import SpilledParams, SpillFolder
from storage_layout.store import RunStore

SHAPES = {"w": (64, 48), "b": (48,)}


def walk(steps, seed=0):
    """Master copies of a fragment along a random walk (outer steps of a few 1e-3)."""
    rng = np.random.default_rng(seed)
    params = {n: rng.normal(0, 0.05, s).astype(np.float32) for n, s in SHAPES.items()}
    out = [params]
    for _ in range(steps):
        params = {n: v + rng.normal(0, 2e-3, v.shape).astype(np.float32) for n, v in params.items()}
        out.append(params)
    return out


def version_of(version, params):
    return GlobalVersion(0, version, params, None, (), {}, {}, {}, 0, 0.0)


def test_the_learners_copy_tracks_the_master_copy_without_drifting():
    versions = walk(60)
    copy = wire_view(versions[0], "bf16")
    naive = dict(copy)  # the sum of quantized steps of the master copy: errors add up
    for before, params in itertools.pairwise(versions):
        copy, delta = downlink_update(params, copy, "bf16", "int4", 128)
        assert delta_bytes(delta) * 3 < full_bytes(params, "bf16")
        naive = {n: naive[n] + dequantize(quantize(params[n] - before[n], "int4")) for n in naive}
    err = max(float(np.abs(copy[n] - versions[-1][n]).max()) for n in copy)
    drift = max(float(np.abs(naive[n] - versions[-1][n]).max()) for n in naive)
    # The syncer carries the residual: the copy stays within about one int4 step of the
    # master copy, where the sum of quantized steps drifts away from it.
    assert err < 2e-3 < drift, (err, drift)


def test_the_downlink_rule_piece_by_piece_gives_the_bits_of_the_whole_tensors():
    """A streamed merge writes each version piece by piece (``downlink_piece`` on a flat
    range starting on a block); the in-memory path and learners (``downlink_update``,
    ``apply_delta``) take whole tensors: both give the same copy and update, bit for bit."""
    old, params = walk(1, seed=3)
    base = wire_view(old, "bf16")
    for downlink in ("int4", "int8", "full"):
        copy, delta = downlink_update(params, base, "bf16", downlink, 32)
        for name, values in params.items():
            flat, at = values.reshape(-1), base[name].reshape(-1)
            wires, deltas = [], []
            for a in range(0, flat.size, 96):  # three blocks of 32 a piece
                wire, d = downlink_piece(flat[a : a + 96], at[a : a + 96], "bf16", downlink, 32)
                wires.append(dequantize(wire))
                deltas.append(d)
            assert np.concatenate(wires).tobytes() == copy[name].tobytes(), (downlink, name)
            if downlink == "full":
                assert delta is None and deltas[0] is None
                continue
            assert np.concatenate([d.data for d in deltas]).tobytes() == delta[name].data.tobytes()
            assert np.concatenate([d.scales for d in deltas]).tobytes() == (
                delta[name].scales.tobytes()
            )


def test_a_learner_reaches_a_version_through_updates_or_reads_it_whole():
    versions = walk(8)
    store = MemoryStore([versions[0]], "bf16", window=8, downlink="int4", block_size=128)
    for v, params in enumerate(versions[1:], start=1):
        gv = version_of(v, params)
        assert store.publish(gv, [], {"weights": {}})
    view = StoreLearnerView(store, "learner-0")
    held = view.read(0, 0)
    first = view.read(0, 2)  # two updates: cheaper than the whole version
    whole = store.read_global("learner-0", 0, 2)
    assert first.nbytes == 2 * delta_bytes(store.read_delta("learner-0", 0, 1).delta)
    assert all(np.array_equal(first.params[n], whole.params[n]) for n in SHAPES)
    far = view.read(0, 8)  # six updates would move more than the whole version
    assert far.nbytes is None and far.version == 8
    assert held.version == 0 and view.read(0, 8) is far
    # An update from another base (a version the learner does not hold) is not applied.
    other = StoreLearnerView(store, "learner-1")
    other.cache[0] = GlobalView(0, 5, store.read_global("learner-1", 0, 4).params)
    got = other.read(0, 6)
    assert got.nbytes is not None  # one update; its base is 5 and the cache says 5
    store.versions[0][7] = (*store.versions[0][7][:4], None)  # published whole only
    assert other.read(0, 8).nbytes is None


def test_the_bucket_store_publishes_the_same_bits_and_falls_back_to_whole(tmp_path):
    regions = {"us": f"file://{tmp_path}/us", "eu": f"file://{tmp_path}/eu"}
    for region in regions:
        (tmp_path / region).mkdir()
    versions = walk(3)
    main = RunStore("run", regions, "us", writer="syncer")
    main.ensure_spec({"learners": {"learner-0": "eu"}, "fragments": [list(SHAPES)]})
    main.versions.publish_global(0, 0, versions[0], [], {"weights": {}}, "bf16")
    syncer = BucketStore("run", regions, "us", {"learner-0": "eu"}, "bf16", "syncer",
                         downlink="int4", block_size=128)  # fmt: skip
    memory = MemoryStore([versions[0]], "bf16", window=8, downlink="int4", block_size=128)
    for v in (1, 2):
        gv = version_of(v, versions[v])
        assert syncer.publish(gv, [], {"weights": {}}) and memory.publish(gv, [], {"weights": {}})
    learner = BucketStore("run", regions, "us", {"learner-0": "eu"}, "bf16", "learner-0",
                          downlink="int4", block_size=128)  # fmt: skip
    view = StoreLearnerView(learner, "learner-0")
    view.read(0, 0)
    got = view.read(0, 2)  # through the two updates, read in the learner's region
    assert got.nbytes is not None
    # A learner that keeps the versions it holds in local files reads the same bits.
    (tmp_path / "spill").mkdir()
    spilled = StoreLearnerView(learner, "learner-0", SpillFolder(str(tmp_path / "spill")))
    first = spilled.read(0, 0)
    assert isinstance(first.params, SpilledParams)
    kept = spilled.read(0, 2)
    assert isinstance(kept.params, SpilledParams) and kept.nbytes == got.nbytes
    for n in SHAPES:
        assert np.array_equal(got.params[n], learner.read_global("learner-0", 0, 2).params[n])
        assert np.array_equal(got.params[n], memory.read_global("learner-0", 0, 2).params[n])
        assert kept.params[n].tobytes() == got.params[n].tobytes()
    # A version no one holds any more has no file left.
    del first
    assert [p.name for p in (tmp_path / "spill").iterdir()] == [os.path.basename(kept.params.path)]
    assert learner.read_delta("learner-0", 0, 0) is None  # version 0 is whole only
    assert learner.read_delta("learner-0", 0, 2).base == 1
    # A syncer that cannot read the version before (corrupt) publishes the next one whole.
    fresh = BucketStore("run", regions, "us", {"learner-0": "eu"}, "bf16", "syncer",
                        downlink="int4", block_size=128)  # fmt: skip
    marker = main.versions.global_marker(0, 2)
    wire = next(k for k in marker.objects if k.startswith("wire/") and "/c/" in k)
    path = tmp_path / "us" / marker.data_prefix / wire
    path.write_bytes(b"\0" + path.read_bytes()[1:])
    gv = version_of(3, versions[3])
    assert fresh.publish(gv, [], {"weights": {}})
    assert learner.read_delta("learner-0", 0, 3) is None
    assert view.read(0, 3).nbytes is None


def test_a_simulated_run_trains_the_same_with_a_quarter_of_the_downlink(tmp_path):
    # (on slots, named: in memory text is dealt to them, through buckets taken in units)
    mode, over = "decoupled", ["budget.tokens=32000", "sim.eval_points=2", "data.assign=slots"]
    full = simulate(load_config("tiny", mode=mode, overrides=over)).summary
    cfg = load_config("tiny", mode=mode, overrides=[*over, "topology.downlink=int4"])
    small = simulate(cfg)
    s = small.summary
    assert s["bytes_down"] * 3 < full["bytes_down"] and s["bytes_up"] == full["bytes_up"]
    assert abs(s["final_loss"] - full["final_loss"]) < 0.01 * full["final_loss"]
    # The same numbers through buckets as in memory (the pipeline's store).
    regions = {"us": f"file://{tmp_path}/us", "eu": f"file://{tmp_path}/eu"}
    for region in regions:
        (tmp_path / region).mkdir()
    stored = simulate(cfg, store=simulation_store("run", regions))
    assert json.dumps(stored.metrics, sort_keys=True) == json.dumps(small.metrics, sort_keys=True)


def test_a_learner_holding_its_versions_in_local_files_never_holds_one_whole(tmp_path):
    """A version read into a spill folder goes through memory a few chunks and one tensor
    at a time: the process's peak allocations (tracemalloc, numpy's included) stay under
    half the fragment, where reading it into memory holds all of it."""
    (tmp_path / "us").mkdir()
    (tmp_path / "spill").mkdir()
    regions = {"us": f"file://{tmp_path}/us"}
    shapes = {f"t{i:02d}": (1024, 1024) for i in range(32)}  # 32 Mi values: 128 MB in fp32
    rng = np.random.default_rng(0)
    params = {n: rng.normal(size=s).astype(np.float32) for n, s in shapes.items()}
    main = RunStore("run", regions, "us", writer="syncer")
    main.ensure_spec({"learners": {"learner-0": "us"}, "fragments": [sorted(shapes)]})
    main.versions.publish_global(0, 0, params, [], {"weights": {}}, "bf16")
    expected = {n: dequantize(quantize(v, "bf16")) for n, v in params.items()}
    del params
    learner = BucketStore("run", regions, "us", {"learner-0": "us"}, "bf16", "learner-0")
    fragment = 4 * 32 * 2**20

    def peak(spill_dir):
        tracemalloc.start()
        try:
            keep = SpillFolder(spill_dir) if spill_dir else None
            view = StoreLearnerView(learner, "learner-0", keep).read(0, 0)
            return view, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    spilled, low = peak(str(tmp_path / "spill"))
    whole, high = peak(None)
    assert high >= fragment and low < fragment // 2, (low, high)
    for n in shapes:  # the same bits, read back a tensor at a time
        assert spilled.params[n].tobytes() == whole.params[n].tobytes() == expected[n].tobytes()
    # kept as the bf16 wire stores it: 2 bytes a value on the local disk, not float32's 4
    assert os.path.getsize(spilled.params.path) == spilled.params.nbytes_kept == fragment // 2


def test_spilled_params_read_back_what_was_written_and_name_a_damaged_file(tmp_path):
    values = {"b": np.arange(6, dtype=np.float32).reshape(2, 3), "a": np.ones(4, np.float16)}
    path = str(tmp_path / "v.f32")
    spilled = SpilledParams.write(path, values.items())
    assert list(spilled) == ["b", "a"] and spilled.shapes == {"b": (2, 3), "a": (4,)}
    assert spilled["b"].tobytes() == values["b"].tobytes()
    assert spilled["a"].dtype == np.float32 and np.array_equal(spilled["a"], values["a"])
    assert spilled.piece("b", 2, 5).tolist() == [2.0, 3.0, 4.0]
    with open(path, "r+b") as f:
        f.truncate(4 * 8)
    with pytest.raises(OSError, match=r"v\.f32 ends before a"):
        spilled["a"]
    spilled.close()
    assert not os.path.exists(path)


def test_spilled_bfloat16_values_are_kept_in_half_the_bytes_and_read_back_as_float32_exactly(
    tmp_path,
):
    """A tensor that comes as bfloat16 (a bf16 wire's codes, ``Pieces.exact_pieces``) is
    kept so, 2 bytes a value, and read back as the float32 values those codes are, every
    bit (the signs of zero, infinities, NaN, subnormals); a float32 tensor beside it is
    kept as float32. A tensor whose pieces turn from bfloat16 to float32 is refused: its
    later values would not fit."""
    import ml_dtypes

    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -3.5, 65504.0], np.float32)
    rng = np.random.default_rng(0)
    values = np.concatenate([special, rng.normal(size=1000).astype(np.float32)])
    codes = values.astype(ml_dtypes.bfloat16)
    exact = codes.astype(np.float32)

    class Halves:  # a tensor read in pieces, as ``store.TensorPieces``
        shape = (2, codes.size // 2)

        def exact_pieces(self):
            yield from (codes[:500], codes[500:])

    path = str(tmp_path / "v.values")
    spilled = SpilledParams.write(path, [("w", Halves()), ("f", values)])
    assert os.path.getsize(path) == spilled.nbytes_kept == 2 * codes.size + 4 * values.size
    assert spilled["w"].dtype == np.float32 and spilled["w"].shape == Halves.shape
    assert spilled["w"].tobytes() == exact.tobytes()
    assert spilled.piece("w", 3, 600).tobytes() == exact[3:600].tobytes()
    assert spilled["f"].tobytes() == values.tobytes()

    class Mixed(Halves):
        def exact_pieces(self):
            yield from (codes[:500], values[500:])

    with pytest.raises(ValueError, match="w: a float32 piece after bfloat16 ones"):
        SpilledParams.write(path, [("w", Mixed())])
    assert not os.path.exists(path)


def test_a_version_that_cannot_be_held_in_a_local_file_leaves_no_part_and_a_full_disk_is_named(
    tmp_path,
):
    """A write that fails half way (here the values stop coming; a full disk, as the
    kernel would say ENOSPC) removes its partial file; a full disk's error names the
    folder and what to do (free space or TMPDIR)."""
    import errno

    def values(failure: Exception):
        yield "a", np.ones(1024, np.float32)
        raise failure

    path = tmp_path / "v.f32"
    with pytest.raises(ValueError, match="the source broke"):
        SpilledParams.write(str(path), values(ValueError("the source broke")))
    assert not path.exists()
    with pytest.raises(
        OSError, match=r"no space left in .*\(4,096 bytes of it written\).* TMPDIR"
    ) as err:
        SpilledParams.write(str(path), values(OSError(errno.ENOSPC, "No space left on device")))
    assert err.value.errno == errno.ENOSPC and str(tmp_path) in str(err.value)
    assert not path.exists()


def test_a_learner_takes_a_version_into_its_file_a_piece_of_a_tensor_at_a_time(
    tmp_path, monkeypatch
):
    """A learner's download of a global version into its spill file holds a piece of a
    tensor at a time (``store.TensorPieces``: ``PIECE_VALUES`` values, kept as their bf16
    codes) and the chunks in flight, not the tensor: its whole bf16 read beside its whole
    float32 decode held 1.6 times its float32 size. The file holds the version bit for
    bit."""
    import ml_dtypes

    import protocol.quantize as quantize_module
    from storage_layout.codec import CHUNK
    from storage_layout.stream import PARALLEL

    monkeypatch.setattr(quantize_module, "PIECE_VALUES", CHUNK)  # 16 pieces of the tensor
    (tmp_path / "b").mkdir()
    w = np.arange(4096 * 4096, dtype=np.float32).reshape(4096, 4096) / 7  # 64 MiB
    store = RunStore("r", {"us": f"file://{tmp_path / 'b'}"}, "us")
    store.versions.publish_global(0, 1, {"w": w, "b": np.ones(5, np.float32)}, [], {}, "bf16")
    tracemalloc.start()
    try:
        state = store.versions.get_global(0, 1, learner_view=True,
                                 collect=SpillFolder(str(tmp_path))(0, 1))  # fmt: skip
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # a piece's bf16 codes (2 bytes a value; 6 with a float32 decode beside them), and
    # bf16 chunks read ahead and in flight, each held twice at most while it is read
    # (1.59x the tensor before pieces)
    assert peak < 2 * CHUNK + 2 * (2 * 2 * PARALLEL * CHUNK) + (4 << 20), peak / w.nbytes
    assert isinstance(state.params, SpilledParams)
    want = w.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(state.params["w"]), want)
    np.testing.assert_array_equal(np.asarray(state.params["b"]), np.ones(5, np.float32))


def test_a_learner_applies_an_update_into_its_file_a_piece_of_a_tensor_at_a_time(
    tmp_path, monkeypatch
):
    """A learner that holds a version in its spill file and reads the next one as a compact
    update (``downlink`` int4) makes the new copy a piece at a time (``UpdatedTensor``:
    the held piece, the update's piece, their sum) with the update's chunks in flight,
    not the tensor: the update read whole and applied whole held three times the tensor's
    float32 size. The file holds the bits of the version read whole."""
    import protocol.quantize as quantize_module
    from storage_layout.codec import CHUNK
    from storage_layout.stream import PARALLEL

    monkeypatch.setattr(quantize_module, "PIECE_VALUES", CHUNK)  # 16 pieces of the tensor
    for folder in ("us", "spill"):
        (tmp_path / folder).mkdir()
    regions = {"us": f"file://{tmp_path / 'us'}"}
    rng = np.random.default_rng(0)
    before = {"w": rng.normal(0, 0.05, (4096, 4096)).astype(np.float32),  # 64 MiB
              "b": np.ones(5, np.float32)}  # fmt: skip
    after = {n: v + rng.normal(0, 2e-3, v.shape).astype(np.float32) for n, v in before.items()}
    main = RunStore("run", regions, "us", writer="syncer")
    main.ensure_spec({"learners": {"learner-0": "us"}, "fragments": [sorted(before)]})
    base, _ = downlink_update(before, None, "bf16", "full", 128)
    wire, delta = downlink_update(after, base, "bf16", "int4", 128)
    main.versions.publish_global(0, 0, before, [], {}, "bf16")
    main.versions.publish_global(0, 1, after, [], {}, "bf16", wire=wire, delta=delta, delta_base=0)
    del before, after, base, delta
    learner = BucketStore("run", regions, "us", {"learner-0": "us"}, "bf16", "learner-0",
                          downlink="int4", block_size=128)  # fmt: skip
    view = StoreLearnerView(learner, "learner-0", SpillFolder(str(tmp_path / "spill")))
    view.read(0, 0)
    tracemalloc.start()
    try:
        got = view.read(0, 1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got.nbytes is not None and isinstance(got.params, SpilledParams)  # the update
    # a piece's update, sum and rounding in float32 (a few times 4 bytes a value), and
    # the update's chunks read ahead and in flight, each held twice at most while read
    assert peak < 24 * CHUNK + 2 * (2 * PARALLEL * CHUNK) + (4 << 20), peak / (64 << 20)
    for n in wire:
        assert got.params[n].tobytes() == wire[n].tobytes()


def test_a_damaged_update_is_read_whole_instead_and_leaves_no_part_of_a_file(tmp_path, caplog):
    """An update whose chunk is damaged fails while it is being applied (its values are
    read as they are used): the learner reads the version whole instead, says why, and
    keeps no part of the file it was writing."""
    for folder in ("us", "spill"):
        (tmp_path / folder).mkdir()
    regions = {"us": f"file://{tmp_path / 'us'}"}
    versions = walk(1)
    main = RunStore("run", regions, "us", writer="syncer")
    main.ensure_spec({"learners": {"learner-0": "us"}, "fragments": [list(SHAPES)]})
    base, _ = downlink_update(versions[0], None, "bf16", "full", 128)
    wire, delta = downlink_update(versions[1], base, "bf16", "int4", 128)
    main.versions.publish_global(0, 0, versions[0], [], {}, "bf16")
    main.versions.publish_global(
        0, 1, versions[1], [], {}, "bf16", wire=wire, delta=delta, delta_base=0
    )
    marker = main.versions.global_marker(0, 1)
    damaged = next(k for k in marker.objects if k.startswith("delta/data/c/"))
    path = tmp_path / "us" / marker.data_prefix / damaged
    path.write_bytes(bytes([path.read_bytes()[0] ^ 1]) + path.read_bytes()[1:])
    learner = BucketStore("run", regions, "us", {"learner-0": "us"}, "bf16", "learner-0",
                          downlink="int4", block_size=128)  # fmt: skip
    view = StoreLearnerView(learner, "learner-0", SpillFolder(str(tmp_path / "spill")))
    held = view.read(0, 0)
    got = view.read(0, 1)
    assert got.nbytes is None and got.version == 1  # read whole
    assert "reading it whole" in caplog.text and damaged in caplog.text
    files = sorted(p.name for p in (tmp_path / "spill").iterdir())
    assert files == sorted(os.path.basename(v.params.path) for v in (held, got))
    for n in SHAPES:
        assert got.params[n].tobytes() == wire[n].tobytes()
