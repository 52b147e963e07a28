"""A Llama-class decoder in Flax NNX: RMSNorm, rotary positions, SwiGLU, grouped-query
attention, no biases, a tied or untied output head.

It follows the Hugging Face ``LlamaForCausalLM`` definition closely enough that an
export is a renaming and a transpose of each kernel (``flows/model_export.py``): rotary
embeddings use the ``rotate_half`` convention (the two halves of a head, not
interleaved pairs), so q and k need no permutation, and the head dimension of
``q_proj``'s output is laid out ``[heads, head_dim]`` as there.

Parameters are float32 (``nnx.Param`` only, as the codec and fragments need); with
``compute_dtype = "bfloat16"`` the matmuls and activations run in bf16 while norms'
statistics, the rotary angles, the logits and hence the loss stay float32. With
``remat`` each block is recomputed in the backward pass (``nnx.remat``): a step keeps
only the blocks' inputs.

Parameter names: ``embed.embedding``, ``layers.{i}.attn_norm.scale``,
``layers.{i}.attn.{q,k,v,o}_proj.kernel``, ``layers.{i}.mlp_norm.scale``,
``layers.{i}.mlp.{gate,up,down}_proj.kernel``, ``norm.scale`` and, untied,
``lm_head.kernel``; kernels are ``[in, out]``.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from diloco.config import ModelConfig


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin ``[time, head_dim]`` (float32) of Hugging Face's rotary embedding:
    frequencies ``theta ** (-2i / head_dim)``, each used for both halves of a head."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``x * cos + rotate_half(x) * sin`` over ``x [batch, time, heads, head_dim]``."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, None, :] + rotated * sin[:, None, :]
    return out.astype(x.dtype)


def _linear(cfg: ModelConfig, n_in: int, n_out: int, rngs: nnx.Rngs, std: float = 0.02):
    return nnx.Linear(n_in, n_out, use_bias=False, dtype=_dtype(cfg), param_dtype=jnp.float32,
                      kernel_init=nnx.initializers.normal(std), rngs=rngs)  # fmt: skip


def _norm(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
    # Statistics in float32 whatever the compute dtype (flax's force_float32_reductions).
    return nnx.RMSNorm(cfg.width, epsilon=cfg.norm_eps, dtype=_dtype(cfg),
                       param_dtype=jnp.float32, rngs=rngs)  # fmt: skip


def _dtype(cfg: ModelConfig) -> jnp.dtype:
    return jnp.dtype(cfg.compute_dtype)


def _residual_std(cfg: ModelConfig) -> float:
    """Scaled init of the residual projections keeps the stream's variance flat in depth."""
    return 0.02 / float(np.sqrt(2 * cfg.depth))


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.num_kv_heads, cfg.head_dim
        self.impl = cfg.attention_kernel(jax.default_backend())
        self.q_proj = _linear(cfg, cfg.width, cfg.heads * cfg.head_dim, rngs)
        self.k_proj = _linear(cfg, cfg.width, self.kv_heads * cfg.head_dim, rngs)
        self.v_proj = _linear(cfg, cfg.width, self.kv_heads * cfg.head_dim, rngs)
        self.o_proj = _linear(cfg, cfg.heads * cfg.head_dim, cfg.width, rngs, _residual_std(cfg))

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # K kv heads serve N query heads (N % K == 0): grouped-query attention.
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.impl)
        return self.o_proj(y.reshape(b, t, self.heads * self.head_dim))


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.gate_proj = _linear(cfg, cfg.width, cfg.ffn_size, rngs)
        self.up_proj = _linear(cfg, cfg.width, cfg.ffn_size, rngs)
        self.down_proj = _linear(cfg, cfg.ffn_size, cfg.width, rngs, _residual_std(cfg))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = _norm(cfg, rngs)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = _norm(cfg, rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


@nnx.remat
def _remat_block(block: Block, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    return block(x, cos, sin)


class Llama(nnx.Module):
    """int32 tokens ``[batch, time]`` -> float32 logits ``[batch, time, vocab_size]``."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.head_dim, self.rope_theta, self.remat = cfg.head_dim, cfg.rope_theta, cfg.remat
        self.tied, self.compute_dtype = cfg.tie_embeddings, cfg.compute_dtype
        self.embed = nnx.Embed(cfg.vocab_size, cfg.width, dtype=_dtype(cfg),
                               param_dtype=jnp.float32,
                               embedding_init=nnx.initializers.normal(0.02), rngs=rngs)  # fmt: skip
        self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.depth)])
        self.norm = _norm(cfg, rngs)
        if not cfg.tie_embeddings:
            self.lm_head = _linear(cfg, cfg.width, cfg.vocab_size, rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        dtype = jnp.dtype(self.compute_dtype)
        cos, sin = rope_tables(jnp.arange(tokens.shape[1]), self.head_dim, self.rope_theta)
        x = self.embed(tokens)
        for block in self.layers:
            x = _remat_block(block, x, cos, sin) if self.remat else block(x, cos, sin)
        x = self.norm(x)
        if self.tied:
            return head_logits(x, self.embed.embedding[...].astype(dtype), True)
        return head_logits(x, self.lm_head.kernel[...].astype(dtype), False)


def head_logits(x: jax.Array, weight: jax.Array, tied: bool) -> jax.Array:
    """The output head: ``x [batch, time, width]`` times the head's weight (the token
    table ``[vocab, width]`` when ``tied``, else a kernel ``[width, vocab]``), accumulated
    and returned in float32, so the loss sees float32 logits.

    In bf16, its backward pass takes the logits' gradient in bf16 too, like every other
    matmul of the model: left to autodiff, the float32 gradient would meet the bf16
    operands in two float32 matmuls of ``vocab`` columns (a 1 B Llama's largest ones),
    at a fraction of the bf16 rate on a GPU."""
    if x.dtype == jnp.float32:
        return _head(x, weight, tied)
    return _head_bf16(x, weight, tied)


def _head(x: jax.Array, weight: jax.Array, tied: bool) -> jax.Array:
    spec = "btd,vd->btv" if tied else "btd,dv->btv"
    return jnp.einsum(spec, x, weight, preferred_element_type=jnp.float32)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _head_bf16(x: jax.Array, weight: jax.Array, tied: bool) -> jax.Array:
    return _head(x, weight, tied)


def _head_bf16_fwd(x, weight, tied):
    return _head(x, weight, tied), (x, weight)


def _head_bf16_bwd(tied, residuals, g):
    x, weight = residuals
    g = g.astype(x.dtype)
    f32 = jnp.float32
    if tied:
        dx = jnp.einsum("btv,vd->btd", g, weight, preferred_element_type=f32)
        dw = jnp.einsum("btv,btd->vd", g, x, preferred_element_type=f32)
    else:
        dx = jnp.einsum("btv,dv->btd", g, weight, preferred_element_type=f32)
        dw = jnp.einsum("btv,btd->dv", g, x, preferred_element_type=f32)
    return dx.astype(x.dtype), dw.astype(weight.dtype)


_head_bf16.defvjp(_head_bf16_fwd, _head_bf16_bwd)


# --- the Hugging Face Llama layout -------------------------------------------------------

# Our tensor (after ``layers.{i}.``) -> Hugging Face's, and whether the array is a kernel
# ([in, out] here, a torch Linear's weight [out, in] there).
_LAYER_NAMES = {
    "attn_norm.scale": ("input_layernorm.weight", False),
    "attn.q_proj.kernel": ("self_attn.q_proj.weight", True),
    "attn.k_proj.kernel": ("self_attn.k_proj.weight", True),
    "attn.v_proj.kernel": ("self_attn.v_proj.weight", True),
    "attn.o_proj.kernel": ("self_attn.o_proj.weight", True),
    "mlp_norm.scale": ("post_attention_layernorm.weight", False),
    "mlp.gate_proj.kernel": ("mlp.gate_proj.weight", True),
    "mlp.up_proj.kernel": ("mlp.up_proj.weight", True),
    "mlp.down_proj.kernel": ("mlp.down_proj.weight", True),
}
_TOP_NAMES = {
    "embed.embedding": ("model.embed_tokens.weight", False),
    "norm.scale": ("model.norm.weight", False),
    "lm_head.kernel": ("lm_head.weight", True),
}


def hf_names(cfg: ModelConfig) -> dict[str, tuple[str, bool]]:
    """Our name -> (Hugging Face name, transposed) for every tensor of ``cfg``'s Llama. A
    tied head has no tensor of its own (``tie_word_embeddings``: transformers ties
    ``lm_head.weight`` to the embedding when it loads)."""
    out = {k: v for k, v in _TOP_NAMES.items() if k != "lm_head.kernel" or not cfg.tie_embeddings}
    for i in range(cfg.depth):
        for ours, (theirs, kernel) in _LAYER_NAMES.items():
            out[f"layers.{i}.{ours}"] = (f"model.layers.{i}.{theirs}", kernel)
    return out


def to_hf(cfg: ModelConfig, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Our flat parameters as Hugging Face ``LlamaForCausalLM`` tensors (float32)."""
    out = {}
    for ours, (theirs, kernel) in hf_names(cfg).items():
        value = np.asarray(params[ours], dtype=np.float32)
        out[theirs] = np.ascontiguousarray(value.T if kernel else value)
    return out


def from_hf(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``to_hf``'s inverse; a missing tensor is named (KeyError)."""
    out = {}
    for ours, (theirs, kernel) in hf_names(cfg).items():
        if theirs not in tensors:
            raise KeyError(f"missing tensor {theirs}")
        value = np.asarray(tensors[theirs], dtype=np.float32)
        out[ours] = np.ascontiguousarray(value.T if kernel else value)
    return out


def hf_config(cfg: ModelConfig, bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """``config.json`` of a ``LlamaForCausalLM`` with ``cfg``'s shape (float32 weights)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.width,
        "intermediate_size": cfg.ffn_size,
        "num_hidden_layers": cfg.depth,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.context,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "use_cache": True,
    }
