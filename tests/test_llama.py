"""The Llama-class model (diloco/llama.py): its export is a Hugging Face Llama that an
independent reading of that definition runs to the same logits; bf16 compute keeps fp32
parameters and trains; remat changes nothing but memory; config errors are named; a
llama-tiny run goes through the codec, fragments and trainer."""

import contextlib
import io
import json
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors.numpy
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from diloco.config import ConfigError, load_config
from diloco.fragments import plan_fragments
from diloco.inner import InnerTrainer
from diloco.model import ParamCodec, is_embedding
from diloco.sample import Sampler, Scorer
from diloco.tokenizer import HFTokenizer
from flows.model_export import export_model, open_exported
from flows.model_io import UsableModel

SMALL = ["model.arch=llama", "model.vocab_size=320", "model.width=32", "model.depth=2",
         "model.heads=4", "model.kv_heads=2", "model.hidden=48", "model.context=16",
         "model.rope_theta=500"]  # fmt: skip


def hf_llama_logits(folder: Path, tokens: np.ndarray) -> np.ndarray:
    """The Hugging Face ``LlamaForCausalLM`` forward pass in float64 numpy, read from
    ``config.json`` and ``model.safetensors`` alone (transformers' modeling_llama:
    RMSNorm ``w * x / sqrt(mean(x^2) + eps)``, rotary embeddings applied with
    ``rotate_half``, each key/value head repeated for ``heads / kv_heads`` query heads,
    ``down(silu(gate(x)) * up(x))``, Linear ``y = x @ W.T``, a tied head reusing
    ``embed_tokens``)."""
    c = json.loads((folder / "config.json").read_text())
    w = {k: v.astype(np.float64) for k, v in
         safetensors.numpy.load_file(str(folder / "model.safetensors")).items()}  # fmt: skip
    n, kv, d = c["num_attention_heads"], c["num_key_value_heads"], c["hidden_size"]
    hd = d // n
    eps = c["rms_norm_eps"]

    def rms(x, weight):
        return weight * x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps)

    def rotate_half(x):
        return np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], axis=-1)

    b, t = tokens.shape
    inv_freq = 1.0 / c["rope_theta"] ** (np.arange(0, hd, 2) / hd)
    freqs = np.outer(np.arange(t), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb)[None, None], np.sin(emb)[None, None]  # [1, 1, t, hd]
    mask = np.triu(np.full((t, t), -np.inf), k=1)
    h = w["model.embed_tokens.weight"][tokens]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"])
        q = (x @ w[p + "self_attn.q_proj.weight"].T).reshape(b, t, n, hd).transpose(0, 2, 1, 3)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).reshape(b, t, kv, hd).transpose(0, 2, 1, 3)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).reshape(b, t, kv, hd).transpose(0, 2, 1, 3)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, n // kv, axis=1), np.repeat(v, n // kv, axis=1)  # repeat_kv
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd) + mask
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        y = (probs @ v).transpose(0, 2, 1, 3).reshape(b, t, n * hd)
        h = h + y @ w[p + "self_attn.o_proj.weight"].T
        x = rms(h, w[p + "post_attention_layernorm.weight"])
        gate = x @ w[p + "mlp.gate_proj.weight"].T
        up = x @ w[p + "mlp.up_proj.weight"].T
        h = h + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    h = rms(h, w["model.norm.weight"])
    head = w["model.embed_tokens.weight"] if c["tie_word_embeddings"] else w["lm_head.weight"]
    return h @ head.T


def _random_params(codec: ParamCodec, seed: int) -> dict[str, np.ndarray]:
    """Parameters with every tensor (norm scales too) away from its init, so a tensor
    read in the wrong place or orientation shows in the logits."""
    rng = np.random.default_rng(seed)
    return {n: rng.normal(1.0 if n.endswith("scale") else 0.0, 0.2, s).astype(np.float32)
            for n, s in zip(codec.names, codec.shapes, strict=True)}  # fmt: skip


def _tokenizer(tmp_path: Path, vocab: int) -> HFTokenizer:
    """A byte-level BPE trained here on a little text (nothing downloaded)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = __import__("tokenizers").decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    text = Path(json.__file__).read_text()
    tok.train_from_iterator([text[i : i + 500] for i in range(0, len(text), 500)], trainer)
    return HFTokenizer(tok.to_str().encode())


@pytest.mark.parametrize("tied", [True, False])
def test_the_hugging_face_export_gives_our_logits_in_an_independent_llama(tmp_path, tied):
    """float32 compute, kv_heads 2 < heads 4: our logits and those of a float64 numpy
    Llama that reads only the exported config.json and model.safetensors agree to 1e-4
    (float32 rounding over two blocks, logits of order 10). The folder reads back to the
    same parameters, with its tokenizer."""
    cfg = load_config("tiny", overrides=[*SMALL, f"model.tie_embeddings={str(tied).lower()}"])
    codec, _ = ParamCodec.create(cfg.model, 0)
    params = _random_params(codec, 1)
    assert ("lm_head.kernel" in codec.names) is not tied
    tokenizer = _tokenizer(tmp_path, cfg.model.vocab_size)
    model = UsableModel(cfg.model, codec, params, {0: 3}, "test", "fp32", "r", cfg, tokenizer)
    folder = tmp_path / "export"
    tok_json = tokenizer.data
    export_model(model, str(folder), ("tokenizer.json", tok_json))
    assert {p.name for p in folder.iterdir()} == {"model.safetensors", "config.json",
                                                    "tokenizer.json"}  # fmt: skip
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    assert config["eos_token_id"] == tokenizer.eos_id and config["tie_word_embeddings"] is tied
    stored = safetensors.numpy.load_file(str(folder / "model.safetensors"))
    assert ("lm_head.weight" in stored) is not tied
    assert stored["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 8, 32)  # [out, in]
    tokens = np.random.default_rng(2).integers(0, cfg.model.vocab_size, (2, 16))
    ours = np.asarray(codec.model(codec.from_flat(params))(jnp.asarray(tokens, jnp.int32)))
    theirs = hf_llama_logits(folder, tokens)
    assert np.abs(theirs).max() > 1.0  # logits that say something
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)
    loaded = open_exported(str(folder))
    assert loaded.config == cfg.model and loaded.versions == {0: 3}
    assert all(np.array_equal(loaded.params[n], params[n]) for n in codec.names)
    assert loaded.tokenizer.encode("import json") == tokenizer.encode("import json")
    assert loaded.tokenizer.eos_id == tokenizer.eos_id


def test_text_in_text_out_with_a_tokenizer(tmp_path):
    """generate and eval of a model with a tokenizer: a prompt's text in, decoded text
    out, deterministic; the score counts tokens and converts to bits per byte."""
    cfg = load_config("tiny", overrides=SMALL)
    codec, state = ParamCodec.create(cfg.model, 0)
    params = codec.to_flat(state)
    tokenizer = _tokenizer(tmp_path, cfg.model.vocab_size)
    sampler = Sampler(codec, cfg.model.context, chunk=8)
    text = sampler.generate_text(params, tokenizer, "import json", 12, 0.8, 0, seed=3)
    assert isinstance(text, str) and text
    assert text == sampler.generate_text(params, tokenizer, "import json", 12, 0.8, 0, seed=3)
    assert len(sampler.generate_ids(params, tokenizer.encode(text), 5, 0.0)) == 5
    score = Scorer(codec, cfg.model.context, 4).score_text(params, tokenizer, "def f(x):\n" * 20)
    assert score.tokens is not None and score.tokens < score.bytes
    # An untrained model is near uniform over the 320 tokens: ln(320) nats per token.
    assert abs(score.loss - np.log(320)) < 0.5
    assert score.bits_per_byte == pytest.approx(score.loss * score.tokens / score.bytes / np.log(2))


def _loss_and_grads(cfg_overrides: list[str], batch: np.ndarray):
    """Loss, gradients, and how many arrays the backward pass keeps from the forward."""
    cfg = load_config("tiny", overrides=[*SMALL, *cfg_overrides])
    codec, state = ParamCodec.create(cfg.model, 0)
    params = {n: jnp.asarray(v) for n, v in codec.to_flat(state).items()}

    def loss(p):
        logits = codec.model(codec.from_flat(p))(batch[:, :-1])
        assert logits.dtype == jnp.float32
        labels = jax.nn.one_hot(batch[:, 1:], logits.shape[-1])
        return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), axis=-1))

    listing = io.StringIO()
    with contextlib.redirect_stdout(listing):
        print_saved_residuals(loss, params)
    kept = [line for line in listing.getvalue().splitlines() if "argument" not in line]
    return *jax.jit(jax.value_and_grad(loss))(params), len(kept)


def test_remat_gives_the_same_loss_and_gradients():
    """...and keeps a fraction of the forward pass's arrays (each block's input)."""
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 320, (2, 17)), jnp.int32)
    loss, grads, kept = _loss_and_grads([], batch)
    loss_r, grads_r, kept_r = _loss_and_grads(["model.remat=true"], batch)
    assert kept_r < kept / 2, (kept_r, kept)
    assert float(loss) == pytest.approx(float(loss_r), abs=1e-6)
    for n in grads:
        np.testing.assert_allclose(grads_r[n], grads[n], rtol=1e-5, atol=1e-7, err_msg=n)


def test_bf16_compute_keeps_fp32_parameters_and_trains():
    """Parameters, optimizer state and the loss are float32; the matmuls run in bf16
    (the logits differ from float32 compute by bf16 rounding, not by nothing); a few
    AdamW steps on one batch lower its loss by more than half a nat."""
    cfg = load_config("tiny", overrides=[*SMALL, "model.compute_dtype=bfloat16",
                                         "inner.warmup_steps=0", "inner.lr=0.01"])  # fmt: skip
    codec, state = ParamCodec.create(cfg.model, 0)
    flat = codec.to_flat(state)
    assert all(v.dtype == np.float32 for v in flat.values())
    batch = np.random.default_rng(0).integers(0, 320, (4, 17)).astype(np.int32)
    f32 = load_config("tiny", overrides=SMALL).model
    codec32, _ = ParamCodec.create(f32, 0)
    bf = np.asarray(codec.model(codec.from_flat(flat))(batch[:, :-1]))
    fp = np.asarray(codec32.model(codec32.from_flat(flat))(batch[:, :-1]))
    assert bf.dtype == np.float32 and 1e-4 < np.abs(bf - fp).max() < 0.1
    trainer = InnerTrainer(codec, cfg.inner, 100, jax.devices()[:1])
    params = trainer.place_params(flat)
    opt = trainer.init_opt_state(params)
    losses = []
    for _ in range(15):
        params, opt, loss = trainer.step(params, opt, batch, 0.0)
        losses.append(float(loss))
    assert all(v.dtype == jnp.float32 for v in params.values())
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(opt) if x.ndim)
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("tied", [True, False])
def test_the_bf16_heads_backward_runs_in_bf16_to_autodiffs_gradient(tied):
    """In bf16 the output head's backward matmuls take bf16 operands (autodiff would
    give them the float32 logits' gradient: float32 matmuls over the vocabulary); the
    gradient is autodiff's to bf16 rounding (relative 2e-2), the logits the same."""
    from diloco import llama

    x = jax.random.normal(jax.random.key(0), (2, 16, 64), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (512, 64) if tied else (64, 512), jnp.bfloat16)
    labels = jax.random.randint(jax.random.key(2), (2, 16), 0, 512)

    def loss(head, x, w):
        logits = head(x, w, tied)
        assert logits.dtype == jnp.float32
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    ours = jax.grad(partial(loss, llama.head_logits), argnums=(0, 1))
    plain = jax.grad(partial(loss, llama._head), argnums=(0, 1))
    for a, b in zip(ours(x, w), plain(x, w), strict=True):
        assert a.dtype == b.dtype == jnp.bfloat16
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2
    assert np.array_equal(llama.head_logits(x, w, tied), llama._head(x, w, tied))
    dots = [e for e in jax.make_jaxpr(ours)(x, w).jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 3  # the forward's and the backward's two
    assert all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
    autodiff = jax.make_jaxpr(plain)(x, w).jaxpr.eqns
    assert any(v.aval.dtype == jnp.float32 for e in autodiff if e.primitive.name == "dot_general"
               for v in e.invars)  # fmt: skip


def test_config_errors_name_the_field():
    def error(*overrides: str) -> str:
        with pytest.raises(ConfigError) as exc:
            load_config("tiny", overrides=list(overrides))
        return str(exc.value)

    assert "model.kv_heads 3 does not divide model.heads 4" in error(*SMALL, "model.kv_heads=3")
    assert "even head dimension" in error(*SMALL, "model.width=20", "model.heads=4")
    assert "model.kv_heads is a field of model.arch 'llama'" in error("model.kv_heads=2")
    assert "model.remat is a field" in error("model.remat=true")
    assert "model.attention is a field" in error("model.attention=xla")
    assert "model.compute_dtype" in error(*SMALL, "model.compute_dtype=float16")
    assert "model.arch" in error("model.arch=gpt")
    # Today's configs and stored specs (every field dumped, or none of the new ones) load
    # and mean the byte model.
    tiny = load_config("tiny")
    assert tiny.model.arch == "byte"
    again = load_config(None, base=tiny.model_dump(mode="json"))
    assert again == tiny
    old = tiny.model_dump(mode="json")
    for name in ("arch", "kv_heads", "hidden", "rope_theta", "remat", "tie_embeddings"):
        del old["model"][name]
    assert load_config(None, base=old) == tiny


def test_llama_names_for_fragments_and_rda():
    cfg = load_config("llama-tiny", overrides=["model.tie_embeddings=false"])
    codec, _ = ParamCodec.create(cfg.model, 0)
    assert "layers.3.attn.q_proj.kernel" in codec.names
    assert [n for n in codec.names if is_embedding(n)] == ["embed.embedding", "lm_head.kernel"]
    strided = plan_fragments(codec.sizes, 2, "strided")
    assert (
        "layers.0.mlp.up_proj.kernel" in strided[1] and "layers.1.mlp.up_proj.kernel" in strided[0]
    )
    sequential = plan_fragments(codec.sizes, 2, "sequential")
    assert "embed.embedding" in sequential[0] and "lm_head.kernel" in sequential[1]


def test_a_llama_tiny_simulation_learns():
    """A small llama-tiny run of two learners through the simulator: the codec,
    fragments, quantized outer gradients, syncer and trainer, on the byte corpus (token
    ids below 256 of the 4096). Validation loss falls from about ln(4096)."""
    from diloco.simulate import simulate

    cfg = load_config("llama-tiny", overrides=[
        "topology.learners=2", "budget.tokens=60000", "model.context=64", "model.depth=2",
        "sim.eval_points=2", "data.eval_batches=2"])  # fmt: skip
    summary = simulate(cfg).summary
    assert summary["versions"] > 0 and summary["rejected"] == 0
    assert summary["final_loss"] < summary["initial_loss"] - 2.0, summary


def test_export_eval_and_generate_from_the_cli(tmp_path, capsysbinary):
    """A llama-tiny run's version 0 in a file:// bucket: `diloco export` writes the
    Hugging Face folder (no tokenizer: the run trains on bytes); a folder with a
    tokenizer evaluates and generates text through it."""
    from flows.cli import main
    from flows.run import initialize_run
    from storage_layout.store import RunStore

    text = tmp_path / "text.txt"
    text.write_text(Path(json.__file__).read_text() * 12)
    cfg = load_config("llama-tiny", overrides=[f"data.source={text}", "model.depth=1",
                                               "model.context=32"])  # fmt: skip
    (tmp_path / "us").mkdir()
    regions = {"us-east": f"file://{tmp_path / 'us'}"}
    initialize_run(RunStore("l", regions, "us-east"), cfg)
    folder = tmp_path / "hf"
    file = str(tmp_path / "model.safetensors")
    assert main(["export", regions["us-east"], "--run", "l", "--out", file]) == 2
    assert "a Llama exports to a folder" in capsysbinary.readouterr().err.decode()
    assert main(["export", regions["us-east"], "--run", "l", "--out", str(folder)]) == 0
    assert "a Hugging Face Llama folder" in capsysbinary.readouterr().out.decode()
    assert {p.name for p in folder.iterdir()} == {"model.safetensors", "config.json"}
    assert json.loads((folder / "config.json").read_text())["eos_token_id"] is None
    assert main(["eval", "--model", str(folder), "--data", str(text), "--max-bytes", "3000",
                 "--json"]) == 0  # fmt: skip
    byte_score = json.loads(capsysbinary.readouterr().out.decode())
    assert byte_score["tokens"] == byte_score["bytes"] == 2999
    # The same model with a tokenizer of 320 tokens beside it.
    tokenizer = _tokenizer(tmp_path, 320)
    model = open_exported(str(folder))
    model = UsableModel(model.config, model.codec, model.params, model.versions, "t", "fp32",
                        tokenizer=tokenizer)  # fmt: skip
    export_model(model, str(folder), ("tokenizer.json", tokenizer.data))
    assert main(["eval", "--model", str(folder), "--data", str(text), "--max-bytes", "3000",
                 "--json"]) == 0  # fmt: skip
    score = json.loads(capsysbinary.readouterr().out.decode())
    assert score["tokens"] < score["bytes"] <= 3000
    args = ["generate", "--model", str(folder), "--prompt", "import", "--max-tokens", "6",
            "--temperature", "0"]  # fmt: skip
    assert main(args) == 0
    first = capsysbinary.readouterr().out.decode()
    assert main(args) == 0
    assert capsysbinary.readouterr().out.decode() == first and first
    # A tokenizer larger than the model's vocabulary is not its tokenizer.
    vocab = {"<eos>": 0, **{f"w{i}": i for i in range(1, 5000)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    (folder / "tokenizer.json").write_text(words.to_str())
    assert main(["generate", "--model", str(folder), "--prompt", "x"]) == 2
    err = capsysbinary.readouterr().err.decode()
    assert "more than the model's vocabulary (4096)" in err, err


def test_every_architecture_is_named_in_the_config_and_counts_what_it_builds():
    """``diloco.archs``: each entry of ``ARCHS`` is a ``model.arch`` the config takes, and
    its parameter count is that of the model it builds."""
    from diloco.archs import ARCHS
    from diloco.config import ArchName
    from diloco.memory import param_count

    assert set(ARCHS) == set(ArchName.__args__)
    for arch in ARCHS:
        m = load_config("llama-tiny" if arch == "llama" else "tiny").model
        assert m.arch == arch and param_count(m) == ParamCodec.create(m, 0)[0].num_params


def test_memory_estimate_of_the_llama_presets(capsys):
    """Counted parameters match the built model; sharding over N devices divides the
    sharded parts by N; remat keeps less; bf16 adds its weight copies; `diloco plan
    memory` shows each device count."""
    from diloco.memory import activation_bytes_per_token, learner_memory, param_count
    from flows.cli import main

    for tied in ("true", "false"):
        m = load_config("llama-tiny", overrides=[f"model.tie_embeddings={tied}"]).model
        assert param_count(m) == ParamCodec.create(m, 0)[0].num_params
    assert param_count(load_config("tiny").model) == 119_744
    assert 1.23e9 < param_count(load_config("llama-1b").model) < 1.24e9  # Llama-3.2-1B
    assert 8.0e9 < param_count(load_config("llama-8b").model) < 8.1e9  # Llama-3-8B
    cfg = load_config("llama-1b")
    n = param_count(cfg.model)
    one, eight = learner_memory(cfg, n, 1), learner_memory(cfg, n, 8)
    assert one.optimizer == 2 * one.parameters and one.compute_copies == one.parameters // 2
    assert eight.parameters == pytest.approx(one.parameters / 8, rel=1e-6)
    assert eight.activations == pytest.approx(one.activations / 8, rel=1e-6)
    xla = {remat: activation_bytes_per_token(cfg.model, remat, "cpu") for remat in (False, True)}
    assert xla[False] > 3 * xla[True]  # XLA's attention keeps [heads, time, time] scores
    assert activation_bytes_per_token(cfg.model, False) > activation_bytes_per_token(
        cfg.model, True
    )
    assert main(["plan", "memory", "--preset", "llama-8b", "--devices", "1", "8"]) == 0
    out = capsys.readouterr().out
    assert "8 devices" in out and "bf16 weights" in out and "total without remat" in out
    assert main(["config", "show", "--preset", "llama-1b"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "model: 1,235,814,400 parameters; one learner on one device needs about" in err


@pytest.mark.parametrize("tied", [True, False])
def test_model_flops_count_every_matmul_and_no_lookup(tied):
    """MFU's model FLOPs (``6 N + 12 L d T``) against the built model's own tensors: N is
    every kernel, plus the token table when it is the head (tied), never when it is only
    looked up (untied); the norms' scales are no matmul."""
    from diloco.memory import model_flops_per_token

    m = load_config("llama-tiny", overrides=[f"model.tie_embeddings={str(tied).lower()}"]).model
    sizes = ParamCodec.create(m, 0)[0].sizes
    matmuls = sum(n for name, n in sizes.items() if name.endswith(".kernel"))
    matmuls += sizes["embed.embedding"] if tied else 0
    assert model_flops_per_token(m) == 6 * matmuls + 12 * m.depth * m.width * m.context
    with pytest.raises(ValueError, match="arch 'llama'"):
        model_flops_per_token(load_config("tiny").model)


def test_the_attention_kernel_follows_the_device_and_dtype():
    """auto: cuDNN's fused attention on a GPU in bf16 (a head dimension it takes), XLA's
    on a CPU or in float32; a cudnn the device cannot run is refused by name; a model
    built here (CPU) runs XLA's; the fused kernel keeps no scores, so a GPU learner's
    estimate is smaller by exactly them."""
    from diloco.llama import Llama
    from diloco.memory import FLOAT, activation_bytes_per_token

    gpu = load_config("llama-150m").model
    assert gpu.attention == "auto"
    assert gpu.attention_kernel("gpu") == "cudnn" and gpu.attention_kernel("cpu") == "xla"
    assert gpu.model_copy(update={"attention": "xla"}).attention_kernel("gpu") == "xla"
    tiny = load_config("llama-tiny").model  # float32: XLA's everywhere
    assert tiny.attention_kernel("gpu") == "xla"
    wide = gpu.model_copy(update={"width": 4096, "heads": 16, "kv_heads": 4})  # head 256
    assert wide.attention_kernel("gpu") == "xla"
    for m, platform in ((gpu, "cpu"), (tiny, "gpu"), (wide, "gpu")):
        with pytest.raises(ConfigError, match=r"model\.attention=cudnn needs an NVIDIA GPU"):
            m.model_copy(update={"attention": "cudnn"}).attention_kernel(platform)
    assert Llama(tiny, nnx.Rngs(0)).layers[0].attn.impl == "xla"
    scores = activation_bytes_per_token(gpu, False, "cpu") - activation_bytes_per_token(
        gpu, False, "gpu"
    )
    assert scores == gpu.depth * (2 * gpu.heads * gpu.context - gpu.heads) * FLOAT
    assert activation_bytes_per_token(tiny, False, "cpu") == activation_bytes_per_token(
        tiny, False, "gpu"
    )


def test_a_run_on_a_prepared_data_set_exports_its_tokenizer(tmp_path, capsysbinary):
    """`diloco data prepare`'s data set (a BPE of 512 tokens) under a llama-tiny run:
    the run's model reads with the data set's tokenizer, `diloco export` puts its
    tokenizer.json beside the weights with its end-of-text id in config.json, and the
    folder generates text through it; eval without --data scores the run's validation
    tokens."""
    from diloco.dataset import open_dataset
    from diloco.prepare import prepare
    from flows.cli import main
    from flows.run import initialize_run
    from storage_layout.store import RunStore

    source = tmp_path / "text"
    source.mkdir()
    for f in sorted(Path(json.__file__).parent.glob("*.py")):
        (source / f.name).write_text(f.read_text() * 4)
    data = str(tmp_path / "tokens")
    prepare(str(source), data, vocab_size=512, chunk_tokens=1024, shard_chunks=4)
    cfg = load_config("llama-tiny", overrides=[f"data.source={data}", "model.vocab_size=512",
                                               "model.depth=1", "model.context=32",
                                               "topology.learners=2"])  # fmt: skip
    (tmp_path / "us").mkdir()
    regions = {"us-east": f"file://{tmp_path / 'us'}"}
    initialize_run(RunStore("tok", regions, "us-east"), cfg)
    folder = tmp_path / "hf"
    assert main(["export", regions["us-east"], "--run", "tok", "--out", str(folder)]) == 0
    ds = open_dataset(data)
    assert (folder / "tokenizer.json").read_bytes() == ds.tokenizer_file()[1]
    assert json.loads((folder / "config.json").read_text())["eos_token_id"] == ds.eos_id
    capsysbinary.readouterr()
    assert main(["generate", "--model", str(folder), "--prompt", "def", "--max-tokens", "5",
                 "--temperature", "0"]) == 0  # fmt: skip
    assert capsysbinary.readouterr().out.decode()
    assert main(["eval", regions["us-east"], "--run", "tok", "--json"]) == 0
    score = json.loads(capsysbinary.readouterr().out.decode())
    assert abs(score["loss"] - np.log(512)) < 0.5  # an untrained model: about uniform
