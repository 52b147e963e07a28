"""Bring your own: a Flax NNX model given by import path (``model.factory``), and text
data as JSON lines or Parquet records (``data.text_field``)."""

import gzip
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from diloco.config import ConfigError, load_config
from diloco.data import DOC_SEPARATOR, DataError, list_files, load_corpus, read_file
from diloco.model import ModelFactoryError, ParamCodec
from diloco.run_data import RunData
from diloco.simulate import simulate
from flows.model_io import read_text
from flows.run import build_model, simulation_store

# --- a model of one's own -----------------------------------------------------------------


class TinyLM(nnx.Module):
    """Causal by construction: each position sees its own byte and the one before."""

    def __init__(self, cfg, rngs: nnx.Rngs, hidden: int):
        self.embed = nnx.Embed(cfg.vocab_size, hidden, rngs=rngs)
        self.mix = nnx.Linear(2 * hidden, hidden, rngs=rngs)
        self.head = nnx.Linear(hidden, cfg.vocab_size, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        prev = jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :-1]
        return self.head(jax.nn.gelu(self.mix(jnp.concatenate([x, prev], axis=-1))))


def factory(cfg, rngs, hidden=16):
    return TinyLM(cfg, rngs, hidden)


# What the error cases point model.factory at.
not_callable = 42


def returns_a_dict(cfg, rngs):
    return {"embed": 1}


def raises(cfg, rngs):
    raise RuntimeError("boom")


class _Hidden(nnx.Module):
    def __init__(self, cfg, rngs):
        self.embed = nnx.Embed(cfg.vocab_size, 8, rngs=rngs)

    def __call__(self, tokens):
        return self.embed(tokens)  # [batch, length, 8]: not logits over the vocabulary


def wrong_shape(cfg, rngs):
    return _Hidden(cfg, rngs)


class _Dropout(TinyLM):
    def __init__(self, cfg, rngs):
        super().__init__(cfg, rngs, 8)
        self.drop = nnx.Dropout(0.1, rngs=rngs)


def with_dropout_rngs(cfg, rngs):
    return _Dropout(cfg, rngs)


# pytest imports this file under a name of its choosing; that name is importable.
HERE = __name__
FACTORY = f"{HERE}:factory"


def own_config(*overrides, **top):
    over = [f"model.factory={FACTORY}", 'model.factory_args={"hidden": 24}', *overrides]
    return load_config("tiny", overrides=over, **top)


def records(n=400, field="body"):
    return [
        {"id": i, field: f"record {i}: " + "lorem ipsum dolor " * (3 + i % 5)} for i in range(n)
    ]


def write_jsonl(path, rows, gz=False):
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return str(path)


def joined(rows, field="body"):
    return DOC_SEPARATOR.join(r[field].encode() for r in rows)


def test_factory_model_builds_and_trains(tmp_path):
    source = write_jsonl(tmp_path / "docs.jsonl", records())
    cfg = own_config(f"data.source={source}", "data.text_field=body")
    model = build_model(cfg)
    assert set(model.codec.names) == {
        "embed.embedding", "mix.kernel", "mix.bias", "head.kernel", "head.bias"
    }  # fmt: skip
    assert model.codec.shapes[model.codec.names.index("embed.embedding")] == (256, 24)
    assert sorted(n for f in model.plan for n in f) == sorted(model.codec.names)
    # Same seed, same parameters; the codec round-trips them.
    codec, state = ParamCodec.create(cfg.model, cfg.seed)
    flat = codec.to_flat(state)
    assert all(np.array_equal(flat[n], model.init[n]) for n in codec.names)
    logits = codec.model(codec.from_flat(flat))(jnp.zeros((3, 10), jnp.int32))
    assert logits.shape == (3, 10, 256)

    trainer = model.trainer
    params = trainer.place_params(model.init)
    opt = trainer.init_opt_state(params)
    shard = RunData(cfg).reader(0)
    losses = []
    for i in range(2):
        params, opt, loss = trainer.step(params, opt, shard.next_batch(), i)
        losses.append(float(loss))
    assert all(np.isfinite(losses)) and 4.0 < losses[0] < 7.0  # about ln 256 at the start


def test_factory_model_runs_the_whole_simulation_through_buckets(tmp_path):
    source = write_jsonl(tmp_path / "docs.jsonl", records())
    cfg = own_config(
        f"data.source={source}", "data.text_field=body", "topology.learners=2",
        "budget.tokens=20480", "sim.eval_points=2",
    )  # fmt: skip
    regions = {"us": str(tmp_path / "us"), "eu": str(tmp_path / "eu")}
    for region in regions:
        (tmp_path / region).mkdir()
    result = simulate(cfg, store=simulation_store("own", regions))
    s = result.summary
    assert np.isfinite(s["final_loss"]) and s["final_loss"] < s["initial_loss"]
    assert s["versions"] > 0 and s["rejected"] == 0


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("no_such_module_xyz:factory", r"cannot import module 'no_such_module_xyz'"),
        (f"{HERE}:nope", r"has no attribute 'nope'"),
        (f"{HERE}:not_callable", r"is a int, not callable"),
        (f"{HERE}:raises", r"failed when called as factory\(model_config, rngs\): RuntimeError"),
        (f"{HERE}:returns_a_dict", r"returned a dict, not a flax\.nnx\.Module"),
        (f"{HERE}:wrong_shape", r"to \[2, 64, 8\] float32; expected float logits \[2, 64, 256\]"),
        (f"{HERE}:with_dropout_rngs", r"variables other than nnx\.Param \(drop\.rngs"),
    ],
)
def test_a_bad_factory_is_named(target, message):
    cfg = load_config("tiny", overrides=[f"model.factory={target}"])
    with pytest.raises(ModelFactoryError, match=message) as err:
        ParamCodec.create(cfg.model, 0)
    assert f"model.factory {target!r}" in str(err.value)


def test_factory_config_is_checked():
    with pytest.raises(
        ConfigError, match=r"config field 'model\.factory': .*'just_a_module' is not an import path"
    ):
        load_config("tiny", overrides=["model.factory=just_a_module"])
    with pytest.raises(ConfigError, match=r"model\.factory_args is set but model\.factory is not"):
        load_config("tiny", overrides=['model.factory_args={"hidden": 8}'])
    with pytest.raises(ModelFactoryError, match=r"unexpected keyword argument 'width2'"):
        ParamCodec.create(own_config('model.factory_args={"width2": 8}').model, 0)
    assert load_config("tiny").model.factory is None  # the byte transformer stays the default


# --- JSON lines and Parquet ---------------------------------------------------------------


def test_jsonl_records_are_the_corpus(tmp_path):
    rows = records()
    source = write_jsonl(tmp_path / "docs.jsonl", rows)
    fs, files = list_files(source)
    assert read_file(fs, files[0][0], "body") == joined(rows)
    # A single file is split by bytes: train shards then validation are the file's bytes.
    corpus = load_corpus(source, 2, 5, text_field="body")
    together = b"".join(bytes(s) for s in corpus.train_shards) + bytes(corpus.validation)
    assert together == joined(rows)
    # `diloco eval --data` reads records the same way.
    assert bytes(read_text(source, 100, "body")) == joined(rows)[:100]


def test_folder_of_jsonl_gz_and_text(tmp_path):
    rows = records(60)
    write_jsonl(tmp_path / "a.jsonl", rows[:30])
    write_jsonl(tmp_path / "b.jsonl.gz", rows[30:], gz=True)
    (tmp_path / "c.txt").write_text("plain text " * 500)
    fs, files = list_files(str(tmp_path))
    assert [rel for _, rel in files] == ["a.jsonl", "b.jsonl.gz", "c.txt"]
    assert read_file(fs, files[1][0], "body") == joined(rows[30:])
    corpus = load_corpus(str(tmp_path), 1, 5, text_field="body")
    everything = bytes(corpus.train_shards[0]) + bytes(corpus.validation)
    for part in (joined(rows[:30]), joined(rows[30:]), b"plain text " * 500):
        assert part + DOC_SEPARATOR in everything  # each file is one unit, as before
    assert len(everything) == sum(
        len(p) + len(DOC_SEPARATOR)
        for p in (joined(rows[:30]), joined(rows[30:]), b"plain text " * 500)
    )


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"body": "fine"', r"line 3 is not valid JSON"),
        ('["body", "x"]', r"line 3 is a JSON list, not an object with a 'body' field"),
        ('{"text": "x", "id": 2}', r"line 3: no field 'body' \(it has 'text', 'id'\)"),
        ('{"body": 7}', r"line 3: field 'body' is int, not a string"),
        ('{"body": null}', r"line 3: field 'body' is null, not a string"),
        ('{"body": "a\\u0000b"}', r"line 3: field 'body' holds a NUL character"),
    ],
)
def test_a_bad_jsonl_record_is_named(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"body": "one"}\n\n' + line + '\n{"body": "four"}\n')
    with pytest.raises(DataError, match=rf"bad\.jsonl {message}"):
        load_corpus(str(path), 1, text_field="body")


def test_empty_and_damaged_record_files_are_named(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"empty\.jsonl holds no records"):
        load_corpus(str(tmp_path / "empty.jsonl"), 1)
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match=r"bad\.jsonl\.gz is not a readable gzip file"):
        load_corpus(str(tmp_path / "bad.jsonl.gz"), 1)


def test_parquet_without_pyarrow_says_how_to_get_it(tmp_path, monkeypatch):
    (tmp_path / "docs.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"docs\.parquet is a Parquet file.*pip install pyarrow"):
        load_corpus(str(tmp_path / "docs.parquet"), 1)


def test_parquet_column_is_the_corpus(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = records(field="content")
    table = pa.table({"id": [r["id"] for r in rows], "content": [r["content"] for r in rows]})
    pq.write_table(table, tmp_path / "docs.parquet", row_group_size=50)
    source = str(tmp_path / "docs.parquet")
    corpus = load_corpus(source, 2, 5, text_field="content")
    together = b"".join(bytes(s) for s in corpus.train_shards) + bytes(corpus.validation)
    assert together == joined(rows, "content")

    with pytest.raises(
        DataError, match=r"docs\.parquet: no column 'text' \(it has 'id', 'content'\)"
    ):
        load_corpus(source, 2)
    pq.write_table(pa.table({"content": ["a", "b", None]}), tmp_path / "nulls.parquet")
    with pytest.raises(DataError, match=r"nulls\.parquet row 2: column 'content' is null"):
        load_corpus(str(tmp_path / "nulls.parquet"), 1, text_field="content")
    (tmp_path / "junk.parquet").write_bytes(b"this is not parquet")
    with pytest.raises(DataError, match=r"junk\.parquet is not a readable Parquet file"):
        load_corpus(str(tmp_path / "junk.parquet"), 1, text_field="content")
