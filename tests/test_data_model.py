import math

import jax
import numpy as np
import optax
import pytest

from diloco.config import InnerConfig, load_config
from diloco.data import DataError, ShardReader, list_files, load_corpus, validation_batches
from diloco.inner import InnerTrainer, inner_lr, lr_schedule
from diloco.model import ParamCodec
from flows.state_io import optimizer_leaves, optimizer_state


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(None, num_shards=3)


def test_default_corpus_is_stdlib_split_by_file(corpus):
    _, files = list_files(None)
    assert len(files) > 500 and all(rel.endswith(".py") for _, rel in files)
    assert not any("site-packages" in rel for _, rel in files)
    assert corpus.train_tokens > 10_000_000
    # Held-out files are whole files: no validation file's text appears in a training shard.
    probe = bytes(corpus.validation[1000:1200])
    assert all(probe not in bytes(s) for s in corpus.train_shards)


def test_shards_disjoint_and_deterministic(corpus):
    again = load_corpus(None, num_shards=3)
    for a, b in zip(corpus.train_shards, again.train_shards, strict=True):
        np.testing.assert_array_equal(a, b)
    heads = {bytes(s[:4096]) for s in corpus.train_shards}
    assert len(heads) == 3


def test_reader_resumes_from_position(corpus):
    reader = ShardReader(corpus.train_shards[0], 4, 32, seed=1, stream=0)
    batches = [reader.next_batch() for _ in range(5)]
    assert batches[0].shape == (4, 33) and batches[0].dtype == np.int32
    resumed = ShardReader(corpus.train_shards[0], 4, 32, seed=1, stream=0, position=3)
    np.testing.assert_array_equal(resumed.next_batch(), batches[3])
    other = ShardReader(corpus.train_shards[0], 4, 32, seed=1, stream=1)
    assert not np.array_equal(other.next_batch(), batches[0])


def test_local_folder_and_single_file_sources(tmp_path):
    for i in range(6):
        (tmp_path / f"doc{i}.txt").write_text(f"document {i} " * 2000)
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    corpus = load_corpus(str(tmp_path), num_shards=2)
    assert len(corpus.train_shards) == 2 and len(corpus.validation) > 0
    single = tmp_path / "one.txt"
    single.write_text("abc " * 20000)
    corpus = load_corpus(f"file://{single}", num_shards=2)
    assert sum(len(s) for s in corpus.train_shards) + len(corpus.validation) == 80000


def test_bad_sources_are_named(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_corpus(str(tmp_path / "nope"), 2)
    (tmp_path / "x.bin").write_bytes(b"0")
    with pytest.raises(DataError, match="holds no text files"):
        load_corpus(str(tmp_path), 2)
    (tmp_path / "small.txt").write_text("hi")
    with pytest.raises(DataError, match="need >= 4096 per learner"):
        load_corpus(str(tmp_path / "small.txt"), 2)
    (tmp_path / "blob.txt").write_bytes(bytes(range(256)) * 100)
    with pytest.raises(DataError, match=r"blob\.txt looks binary"):
        load_corpus(str(tmp_path / "blob.txt"), 2)


def test_tiny_model_size_and_names():
    codec, state = ParamCodec.create(load_config("tiny").model, 0)
    assert codec.num_params < 1_000_000
    assert "blocks.1.attn.qkv.kernel" in codec.names
    flat = codec.to_flat(state)
    back = codec.to_flat(codec.from_flat(flat))
    assert all(np.array_equal(flat[n], back[n]) for n in flat)


def test_inner_rate_warms_up_on_the_state_and_decays_on_the_position(corpus):
    cfg = InnerConfig(warmup_steps=10)
    optax_schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, 10, 100, cfg.lr * cfg.min_lr_ratio
    )
    schedule = lr_schedule(cfg, 100)
    for k in (0, 3, 9, 10, 11, 40, 99, 100, 130):  # in step: optax's schedule
        assert float(inner_lr(schedule, k, k)) == pytest.approx(float(optax_schedule(k)))
    assert float(inner_lr(schedule, 3, 99)) == pytest.approx(0.3 * float(optax_schedule(99)))
    assert float(inner_lr(schedule, 50, 0)) == pytest.approx(cfg.lr)
    # The step's update scales with the rate at the position it is given.
    tiny = load_config("tiny", overrides=["inner.warmup_steps=0"])
    codec, state = ParamCodec.create(tiny.model, 0)
    trainer = InnerTrainer(codec, tiny.inner, total_steps=100)
    params = trainer.place_params(codec.to_flat(state))
    batch = ShardReader(corpus.train_shards[0], 8, tiny.model.context, 0, 0).next_batch()
    moved = {}
    for position in (0.0, 100.0):
        new, opt, _ = trainer.step(params, trainer.init_opt_state(params), batch, position)
        moved[position] = sum(float(np.abs(new[n] - params[n]).sum()) for n in params)
        assert trainer.lr(opt, position) == pytest.approx(
            float(inner_lr(lr_schedule(tiny.inner, 100), 1, position))
        )
    assert moved[100.0] / moved[0.0] == pytest.approx(tiny.inner.min_lr_ratio, rel=1e-3)
    # One program for every budget and rate (the schedule is an argument of the step): a
    # run resumed with a larger budget loads its compiled step.
    other = InnerTrainer(codec, tiny.inner.model_copy(update={"lr": 0.01}), total_steps=7)
    args = (params, trainer.init_opt_state(params), trainer.place_batch(batch), np.float32(0))
    programs = {t._train_step.lower(*args, t.schedule).as_text() for t in (trainer, other)}
    assert len(programs) == 1


def test_train_step_sharded_over_two_devices_and_loss_falls(corpus):
    assert len(jax.devices()) == 2  # tests/conftest.py forces two host devices
    cfg = load_config("tiny")
    codec, state = ParamCodec.create(cfg.model, 0)
    trainer = InnerTrainer(codec, cfg.inner, total_steps=40)
    params = trainer.place_params(codec.to_flat(state))
    opt = trainer.init_opt_state(params)
    reader = ShardReader(corpus.train_shards[0], 8, cfg.model.context, 0, 0)
    val = validation_batches(corpus, 8, cfg.model.context, 2, 0)
    before = trainer.evaluate(params, val)
    for i in range(40):
        params, opt, _loss = trainer.step(params, opt, reader.next_batch(), i)
    # One compiled step for a fresh optimizer state, the state a step returns and one
    # restored from a checkpoint: a restarted learner's first round compiles nothing.
    restored = optimizer_state(optimizer_leaves(opt), trainer.init_opt_state(params),
                               trainer.place_params)  # fmt: skip
    trainer.step(params, restored, reader.next_batch(), 40.5)
    assert trainer._train_step._cache_size() == 1
    batch = trainer.place_batch(reader.next_batch())
    assert len(batch.sharding.device_set) == 2
    assert batch.addressable_shards[0].data.shape[0] == 4  # each device holds half the batch
    assert trainer.evaluate(params, val) < before - 1.0
    with pytest.raises(ValueError, match="does not split over 2 devices"):
        trainer.place_batch(np.zeros((3, 9), np.int32))


def test_placing_a_tensor_on_the_devices_makes_no_host_copy_of_it():
    """A restored checkpoint's leaf, a global version's tensor: each is placed from the
    host array it was read into, with no second host copy (an ``astype`` that copied
    even to the same dtype held one more largest-leaf on the host of every restore)."""
    import tracemalloc

    cfg = load_config("tiny")
    codec, _ = ParamCodec.create(cfg.model, 0)
    leaf = np.arange(4096 * 1024, dtype=np.float32).reshape(4096, 1024)  # 16 MiB
    for devices in (1, 2):
        trainer = InnerTrainer(codec, cfg.inner, 100, jax.devices()[:devices])
        trainer.place(leaf[:8])  # (what the first call sets up is not the leaf's)
        tracemalloc.start()
        try:
            placed = trainer.place(leaf)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < leaf.nbytes / 4, (devices, peak)
        np.testing.assert_array_equal(np.asarray(placed), leaf)


def test_a_restored_leaf_is_held_once_on_the_host_beside_the_chunks_in_flight(tmp_path):
    """A checkpoint's leaf is read, decoded and placed with one host copy of it and the
    chunks fetched at once (``PARALLEL``), not more: the chunks of a range were all held before the first was placed, the float32
    decode of an fp32 leaf copied it, and placing it copied it again."""
    import tracemalloc

    from flows.state_io import leaf_names, read_checkpoint
    from storage_layout.codec import CHUNK
    from storage_layout.store import RunStore
    from storage_layout.stream import PARALLEL

    cfg = load_config("tiny")
    codec, _ = ParamCodec.create(cfg.model, 0)
    trainer = InnerTrainer(codec, cfg.inner, 100, jax.devices()[:1])
    shape = (8192, 4096)  # 128 MiB: 32 chunks of 4 MiB, four times as many as fetched at once
    template = {"w": jax.numpy.zeros(shape, np.float32)}
    (name,) = leaf_names(template)
    leaf = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    store = RunStore("r", {"us": f"file://{tmp_path}"}, "us")
    store.checkpoints.put_checkpoint("l0", 1, {"opt": {name: leaf}}, {})
    tracemalloc.start()
    try:
        state, _ = read_checkpoint(store, "l0", 1, template, trainer.place_params)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Each chunk in flight may be held twice while it is read (the file's bytes, then the
    # object's), and the thread pool's timing decides how many overlap: at most the
    # leaf and 2 x PARALLEL chunks and a few, against twice the leaf before.
    assert leaf.size >= 4 * PARALLEL * CHUNK
    assert peak < leaf.nbytes + (2 * PARALLEL + 4) * CHUNK * 4, peak / leaf.nbytes
    np.testing.assert_array_equal(np.asarray(state["w"]), leaf)
