"""Using a run's model: `diloco export`, `diloco eval`, `diloco generate` (flows/model_io.py,
diloco/sample.py) on a tiny run in two file:// regions. No training is needed: a run's
version 0 is its initial model, and a hand-published version 1 of fragment 0 gives the
newest and a named version something to tell apart."""

import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest
import safetensors.numpy

from diloco import records
from diloco.config import load_config
from diloco.sample import Sampler, Scorer, text_windows
from diloco.syncer import FragmentSyncer
from flows.cli import main as cli_main
from flows.model_export import export_model, load_exported, open_exported, read_export_metadata
from flows.model_io import ModelFileError, evaluate, read_global_model
from flows.run import build_model, initialize_run
from flows.spec import run_spec
from protocol.quantize import dequantize, quantize
from storage_layout.store import RunStore

RUN = "use"


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    """About 40 KB of real text (enough for 4 training shards and a validation split)."""
    source = Path(json.__file__).parent
    body = b"".join(p.read_bytes() for p in sorted(source.glob("*.py")))
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes((body * (1 + 40_000 // len(body)))[:40_000])
    return path


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, text):
    """A tiny run (bf16 wire copies) with version 0 of both fragments and a version 1 of
    fragment 0. Returns (cfg, regions, model, version-1 params of fragment 0)."""
    root = tmp_path_factory.mktemp("buckets")
    cfg = load_config("tiny", overrides=[f"data.source={text}", "topology.global_dtype=bf16"])
    regions = {"us-east": f"file://{root / 'us'}", "eu-west": f"file://{root / 'eu'}"}
    for name in ("us", "eu"):
        (root / name).mkdir()
    store = RunStore(RUN, regions, "us-east")
    initialize_run(store, cfg)
    model = build_model(cfg)
    rng = np.random.default_rng(0)
    v1 = {n: model.init[n] + rng.normal(0, 0.01, model.init[n].shape).astype(np.float32)
          for n in model.plan[0]}  # fmt: skip
    opt = FragmentSyncer(0, v1, cfg.outer, [], lambda _: False).opt_leaves
    record = {**records.initial_version(0, 0.0), "version": 1}
    store.versions.publish_global(0, 1, v1, opt, record, cfg.topology.global_dtype)
    return cfg, regions, model, v1


@pytest.fixture(scope="module")
def forward():
    """One jitted forward pass per codec: logits [batch, time, vocab]."""
    return jax.jit(lambda codec, params, tokens: codec.model(codec.from_flat(params))(tokens),
                   static_argnums=0)  # fmt: skip


def _tokens(text: Path, n: int) -> np.ndarray:
    return np.frombuffer(text.read_bytes()[:n], dtype=np.uint8).astype(np.int32)


def test_export_then_load_gives_the_bucket_models_logits(tiny_run, text, tmp_path, forward):
    """From the home region the export holds the fp32 master copy as stored, so the loaded
    parameters and the logits are bit-identical to the model assembled from the bucket. A
    non-home region holds only the bf16 wire copy: its export equals the master copy
    rounded to bf16, and the logits agree within that rounding."""
    cfg, regions, model, v1 = tiny_run
    home = read_global_model(regions["us-east"], RUN)
    assert home.versions == {0: 1, 1: 0} and home.dtype == "fp32"
    expected = {**model.init, **v1}
    assert all(np.array_equal(home.params[n], expected[n]) for n in model.codec.names)
    out = tmp_path / "model.safetensors"
    export_model(home, str(out))
    config, params = load_exported(str(out))
    assert config == cfg.model and list(params) == list(model.codec.names)
    assert all(p.dtype == np.float32 for p in params.values())
    meta = read_export_metadata(str(out))
    assert meta["versions"] == {0: 1, 1: 0} and meta["run"] == RUN
    assert meta["params_dtype"] == "fp32" and meta["model_config"] == cfg.model
    tokens = _tokens(text, 2 * 64).reshape(2, 64)
    bucket_logits = np.asarray(forward(home.codec, home.params, tokens))
    loaded = open_exported(str(out))  # the file alone: its own codec, built from its config
    file_logits = np.asarray(forward(loaded.codec, loaded.params, tokens))
    assert np.array_equal(bucket_logits, file_logits)
    # The other region: the wire copy, bf16.
    wire = read_global_model(regions["eu-west"], RUN)
    assert wire.versions == {0: 1, 1: 0} and wire.dtype == "bf16"
    for n in model.codec.names:
        assert np.array_equal(wire.params[n], dequantize(quantize(expected[n], "bf16")))
    wire_file = str(tmp_path / "wire.safetensors")
    export_model(wire, wire_file)
    assert read_export_metadata(wire_file)["params_dtype"] == "bf16"
    wire_logits = np.asarray(forward(home.codec, load_exported(wire_file)[1], tokens))
    assert np.abs(wire_logits - bucket_logits).max() < 2e-2  # bf16: ~3 significant digits


def test_version_selection_and_its_errors(tiny_run):
    _, regions, model, _ = tiny_run
    url = regions["us-east"]
    first = read_global_model(url, RUN, "0")
    assert first.versions == {0: 0, 1: 0}
    assert all(np.array_equal(first.params[n], model.init[n]) for n in model.codec.names)
    assert read_global_model(url, RUN, "1,0").versions == {0: 1, 1: 0}
    with pytest.raises(FileNotFoundError, match=r"no version 1 of fragment 1 .* versions 0 to 0"):
        read_global_model(url, RUN, "1")
    with pytest.raises(ValueError, match="names 3 versions; the run has 2 fragments"):
        read_global_model(url, RUN, "1,0,0")
    with pytest.raises(ValueError, match="give a version number"):
        read_global_model(url, RUN, "newest")


def test_eval_reports_loss_and_bits_per_byte(tiny_run, text, tmp_path, capsys):
    _, regions, model, _ = tiny_run
    home = read_global_model(regions["us-east"], RUN, "0")
    score, what = evaluate(home, str(text), max_bytes=5_000)
    assert what == str(text) and score.bytes == 4_999
    assert math.isfinite(score.loss) and abs(score.loss - math.log(256)) < 0.1  # untrained
    assert score.bits_per_byte == pytest.approx(score.loss / math.log(2), rel=1e-12)
    # Same windows, same number as the training loss (full windows, no padding).
    tokens = _tokens(text, 8 * 64 + 1)
    windows, weights = text_windows(tokens, 64)
    assert windows.shape == (8, 65) and weights.all()
    scorer = Scorer(model.codec, 64, batch_size=8)
    loss = model.trainer.evaluate(model.trainer.place_params(home.params), [windows])
    assert scorer.score(home.params, tokens).loss == pytest.approx(loss, abs=1e-5)
    # No --data: the run's validation batches, the launcher's number.
    own, what = evaluate(home, None, max_bytes=0)
    assert "validation batches" in what and own.bytes == 4 * 8 * 64
    assert abs(own.loss - math.log(256)) < 0.1
    # The CLI, from the bucket and from an export: the same loss.
    out = tmp_path / "m.safetensors"
    assert cli_main(["export", regions["us-east"], "--run", RUN, "--version", "0",
                     "--out", str(out)]) == 0  # fmt: skip
    assert "exported run use" in capsys.readouterr().out
    runs = []
    for source in ([regions["eu-west"], "--run", RUN, "--version", "0"], ["--model", str(out)]):
        assert (
            cli_main(["eval", *source, "--data", str(text), "--max-bytes", "3000", "--json"]) == 0
        )
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0]["bytes"] == runs[1]["bytes"] == 2_999
    assert runs[0]["bits_per_byte"] == pytest.approx(runs[0]["loss"] / math.log(2))
    assert runs[0]["loss"] == pytest.approx(runs[1]["loss"], abs=2e-3)  # bf16 wire vs fp32
    assert cli_main(["eval", "--model", str(out)]) == 2
    assert "give --data" in capsys.readouterr().err


def test_generate_is_deterministic_and_compiles_once(tiny_run, text, forward):
    cfg, regions, _, _ = tiny_run
    home = read_global_model(regions["us-east"], RUN)
    sampler = Sampler(home.codec, cfg.model.context, chunk=16)
    prompt = text.read_bytes()[:60]
    a = sampler.generate(home.params, prompt, 40, temperature=1.0, top_k=20, seed=1)
    assert len(a) == 40
    assert sampler.generate(home.params, prompt, 40, temperature=1.0, top_k=20, seed=1) == a
    assert sampler.generate(home.params, prompt, 40, temperature=1.0, top_k=20, seed=2) != a
    # Each step's randomness depends on its position only: a shorter sample is a prefix.
    assert sampler.generate(home.params, prompt, 7, temperature=1.0, top_k=20, seed=1) == a[:7]
    greedy = sampler.generate(home.params, prompt, 30, temperature=0.0, seed=5)
    assert sampler.generate(home.params, prompt, 30, temperature=0.0, seed=9) == greedy
    assert sampler.generate(home.params, prompt, 30, temperature=2.0, top_k=1) == greedy
    assert (
        sampler.generate(home.params, b"", 5) != b""
        and sampler.generate(home.params, b"x", 0) == b""
    )
    assert sampler.traces == 1  # lengths 0 to 40, prompts of 0 to 60 bytes: one compilation
    # Greedy against the plain model on the last `context` (64) bytes: the first 4 bytes
    # follow windows shorter than 64 (read off one causal pass over the first 64 bytes),
    # the next ones follow full windows that slide by one byte per step.
    seq = np.frombuffer(prompt + greedy, np.uint8).astype(np.int32)
    head = np.asarray(forward(home.codec, home.params, seq[None, :64]))[0]
    for i in range(12):
        end = 60 + i
        window = seq[None, max(end - 64, 0) : end]
        logits = head[end - 1] if end <= 64 else forward(home.codec, home.params, window)[0, -1]
        assert int(np.argmax(logits)) == greedy[i], i
    with pytest.raises(ValueError, match="temperature must be"):
        sampler.generate(home.params, prompt, 4, temperature=-1.0)
    with pytest.raises(ValueError, match="top-k must be"):
        sampler.generate(home.params, prompt, 4, top_k=-3)


def test_generate_from_the_cli(tiny_run, tmp_path, capsysbinary):
    regions = tiny_run[1]
    args = ["--prompt", "import json\n", "--max-bytes", "24", "--temperature", "0"]
    assert cli_main(["generate", regions["us-east"], "--run", RUN, *args]) == 0
    from_bucket = capsysbinary.readouterr().out
    assert len(from_bucket) == 24
    out = tmp_path / "m.safetensors"
    export_model(read_global_model(regions["us-east"], RUN), str(out))
    assert cli_main(["generate", "--model", str(out), *args]) == 0
    assert capsysbinary.readouterr().out == from_bucket


def test_bad_inputs_fail_naming_what_is_wrong(tiny_run, tmp_path, capsys):
    cfg, regions, model, _ = tiny_run

    def fails(*argv: str) -> str:
        assert cli_main(list(argv)) == 2
        return capsys.readouterr().err

    out = str(tmp_path / "m.safetensors")
    assert "no run 'nope'" in fails("export", regions["us-east"], "--run", "nope", "--out", out)
    missing = f"file://{tmp_path / 'no-such-bucket'}"
    err = fails("export", missing, "--run", RUN, "--out", out)
    assert "no-such-bucket" in err and "does not exist" in err
    err = fails("export", regions["us-east"], "--run", RUN, "--version", "7", "--out", out)
    assert "no version 7 of fragment 0" in err
    err = fails("export", regions["us-east"], "--run", RUN, "--out", str(tmp_path))
    assert "is a folder" in err
    assert "--run NAME is needed" in fails("generate", regions["us-east"], "--prompt", "x")
    assert "or --model FILE" in fails("eval", "--data", "x")
    # A run whose spec is written but no version published yet.
    empty = tmp_path / "empty"
    empty.mkdir()
    store = RunStore("fresh", {"us-east": f"file://{empty}"}, "us-east")
    store.ensure_spec(run_spec(cfg, model.plan, store.urls))
    err = fails("eval", f"file://{empty}", "--run", "fresh")
    assert "no global version of fragment 0 yet" in err
    # Files: missing, not safetensors, truncated, someone else's, another shape.
    assert "no exported model at" in fails(
        "eval", "--model", str(tmp_path / "nothing"), "--data", out
    )
    export_model(read_global_model(regions["us-east"], RUN), out)
    data = Path(out).read_bytes()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a model at all")
    with pytest.raises(ModelFileError, match="not a safetensors file or is truncated"):
        load_exported(str(bad))
    bad.write_bytes(data[: len(data) - 100])
    with pytest.raises(ModelFileError, match="is corrupt"):
        load_exported(str(bad))
    bad.write_bytes(safetensors.numpy.save({"w": np.zeros(3, np.float32)}))
    with pytest.raises(ModelFileError, match="not a model exported by `diloco export`"):
        load_exported(str(bad))
    _, params = load_exported(out)
    meta = {k: str(v) for k, v in read_export_metadata(out).items()}
    meta["model_config"] = cfg.model.model_copy(update={"width": 128}).model_dump_json()
    meta["versions"] = "{}"
    bad.write_bytes(safetensors.numpy.save(params, metadata=meta))
    with pytest.raises(
        ModelFileError, match=r"another shape than its config says \(.*width 128.*blocks\.0"
    ):
        open_exported(str(bad))
    err = fails("generate", "--model", str(bad), "--prompt", "x")
    assert "another shape" in err


def test_an_export_of_a_run_on_a_prepared_data_set_carries_its_tokenizer(tmp_path, capsysbinary):
    """A model trained on a prepared data set's tokens, exported to one file, generated
    bytes from its token ids (`diloco generate --model FILE`: noise) and scored text
    encoded as bytes: the file did not say what its ids mean. It now carries the data
    set's tokenizer (checked by its sha256) and says ``tokens``; the file generates what
    the bucket's model does. An export of bytes, or one written before, reads as bytes."""
    import base64

    from diloco.dataset import open_dataset
    from tests.test_units import prepare_stdlib

    data = prepare_stdlib(tmp_path, chunk_tokens=1024)
    cfg = load_config("tiny", overrides=[f"data.source={data}", "model.vocab_size=512"])
    (tmp_path / "us").mkdir()
    regions = {"us-east": f"file://{tmp_path / 'us'}"}
    initialize_run(RunStore("tok", regions, "us-east"), cfg)
    out = str(tmp_path / "model.safetensors")
    assert cli_main(["export", regions["us-east"], "--run", "tok", "--out", out]) == 0
    meta = read_export_metadata(out)
    name, expected = open_dataset(data).tokenizer_file()
    assert (meta["tokens"], meta["tokenizer_file"]) == ("tokenizer", name)
    assert base64.b64decode(meta["tokenizer"]) == expected
    assert open_exported(out).tokenizer.encode("def main():") == (
        open_dataset(data).tokenizer().encode("def main():"))  # fmt: skip
    said = []
    for source_args in (["--model", out], [regions["us-east"], "--run", "tok"]):
        capsysbinary.readouterr()
        assert cli_main(["generate", *source_args, "--prompt", "def", "--max-tokens", "12",
                         "--temperature", "0"]) == 0  # fmt: skip
        said.append(capsysbinary.readouterr().out.decode())
    assert said[0] == said[1] and said[0].strip(), said
    # a damaged tokenizer is named; an export of bytes (and an older one) reads as bytes
    tensors = safetensors.numpy.load_file(out)
    damaged = str(tmp_path / "damaged.safetensors")
    safetensors.numpy.save_file(tensors, damaged, metadata={**meta, "model_config": meta[
        "model_config"].model_dump_json(), "versions": json.dumps(meta["versions"]),
        "tokenizer": base64.b64encode(expected[:-1] + b" ").decode()})  # fmt: skip
    with pytest.raises(ModelFileError, match=f"its tokenizer \\({name}\\) does not match"):
        open_exported(damaged)
    older = {k: v for k, v in read_export_metadata(damaged).items()
             if not k.startswith("tok")}  # fmt: skip
    safetensors.numpy.save_file(tensors, damaged, metadata={**older, "model_config": older[
        "model_config"].model_dump_json(), "versions": json.dumps(older["versions"])})  # fmt: skip
    assert open_exported(damaged).tokenizer is None
