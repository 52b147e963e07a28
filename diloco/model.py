"""A pre-norm, decoder-only byte transformer in Flax NNX, and a flat view of its parameters.

Everything outside the model (fragments, outer gradients, the syncer, storage) works on
``FlatParams``: an ordered ``{name: array}`` dict such as ``"blocks.0.attn.qkv.kernel"``.
``ParamCodec`` converts between that and the NNX state the jitted step uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from diloco.config import ModelConfig

FlatParams = dict[str, np.ndarray]


class CausalSelfAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.heads = cfg.heads
        self.qkv = nnx.Linear(cfg.width, 3 * cfg.width, use_bias=False, rngs=rngs)
        # Scaled init of the residual projection keeps the residual stream's variance flat in depth.
        out_init = nnx.initializers.normal(0.02 / np.sqrt(2 * cfg.depth))
        self.out = nnx.Linear(cfg.width, cfg.width, use_bias=False, kernel_init=out_init, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
        shape = (b, t, self.heads, d // self.heads)
        y = jax.nn.dot_product_attention(
            q.reshape(shape), k.reshape(shape), v.reshape(shape), is_causal=True
        )
        return self.out(y.reshape(b, t, d))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        hidden = cfg.mlp_ratio * cfg.width
        out_init = nnx.initializers.normal(0.02 / np.sqrt(2 * cfg.depth))
        self.norm1 = nnx.RMSNorm(cfg.width, rngs=rngs)
        self.attn = CausalSelfAttention(cfg, rngs)
        self.norm2 = nnx.RMSNorm(cfg.width, rngs=rngs)
        self.up = nnx.Linear(cfg.width, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, cfg.width, kernel_init=out_init, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class Transformer(nnx.Module):
    """Byte-level GPT: token + learned position embeddings, tied output head."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(cfg.vocab_size, cfg.width, embedding_init=init, rngs=rngs)
        self.pos_embed = nnx.Embed(cfg.context, cfg.width, embedding_init=init, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.depth)])
        self.norm = nnx.RMSNorm(cfg.width, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens: int32 [batch, time] -> logits float32 [batch, time, vocab]."""
        x = self.embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.norm(x))


def _path_name(path: tuple) -> str:
    parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
    parts = [p for p in parts if p]
    if parts and parts[-1] == "value":  # the NNX Variable's payload, not part of the name
        parts.pop()
    return ".".join(parts)


@dataclass(frozen=True)
class ParamCodec:
    """Converts between the NNX parameter state and ``FlatParams`` (fixed name order)."""

    graphdef: nnx.GraphDef
    treedef: jax.tree_util.PyTreeDef
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def create(cls, cfg: ModelConfig, seed: int) -> tuple[ParamCodec, nnx.State]:
        model = Transformer(cfg, nnx.Rngs(seed))
        graphdef, state = nnx.split(model, nnx.Param)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
        names = tuple(_path_name(p) for p, _ in leaves)
        shapes = tuple(tuple(v.shape) for _, v in leaves)
        return cls(graphdef, treedef, names, shapes), state

    def to_flat(self, state: nnx.State) -> FlatParams:
        leaves = jax.tree_util.tree_leaves(state)
        return {n: np.asarray(v) for n, v in zip(self.names, leaves, strict=True)}

    def from_flat(self, flat: Mapping[str, np.ndarray]) -> nnx.State:
        leaves = [jnp.asarray(flat[n]) for n in self.names]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def model(self, state: nnx.State) -> Transformer:
        return nnx.merge(self.graphdef, state)

    @property
    def sizes(self) -> dict[str, int]:
        return {n: int(np.prod(s)) for n, s in zip(self.names, self.shapes, strict=True)}

    @property
    def num_params(self) -> int:
        return sum(self.sizes.values())


def is_embedding(name: str) -> bool:
    """Embedding tables are merged by weighted mean even under RDA (ALGORITHM.md)."""
    return "embed" in name.split(".")[0]
