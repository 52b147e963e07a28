"""A pre-norm, decoder-only byte transformer in Flax NNX, and a flat view of its parameters.

Everything outside the model (fragments, outer gradients, the syncer, storage) works on
``FlatParams``: an ordered ``{name: array}`` dict such as ``"blocks.0.attn.qkv.kernel"``.
``ParamCodec`` converts between that and the NNX state the jitted step uses.

``model.factory`` swaps the transformer for a module of your own (``create_model``):
any Flax NNX module whose only variables are ``nnx.Param`` and that maps int32 bytes
``[batch, length]`` to logits ``[batch, length, vocab_size]`` goes through the same
codec, fragments, trainer and checkpoints.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from diloco.archs import ARCHS
from diloco.config import ConfigError, ModelConfig

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


class ModelFactoryError(ConfigError):
    """``model.factory`` cannot be imported or does not build a usable model; the message
    names the factory."""


def load_factory(factory: str) -> Any:
    """The callable ``"package.module:function"`` names (``function`` may be dotted:
    ``module:Class.create``)."""
    module_name, _, attr = factory.partition(":")
    where = f"model.factory {factory!r}"
    if not module_name or not attr:
        raise ModelFactoryError(f"{where} is not of the form 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or an error raised while importing it
        raise ModelFactoryError(
            f"{where}: cannot import module {module_name!r} ({type(exc).__name__}: {exc}); "
            "it must be importable on every node that runs the model (learners, syncers, "
            "the launcher)"
        ) from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ModelFactoryError(f"{where}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ModelFactoryError(f"{where} is a {type(obj).__name__}, not callable")
    return obj


def create_model(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    """The model ``cfg`` describes: the built-in one of ``arch`` (``diloco.archs``), or, with ``cfg.factory``,
    ``factory(cfg, rngs, **cfg.factory_args)``, checked once on a dummy batch (shapes
    only, ``jax.eval_shape``): it must be an ``nnx.Module`` holding ``nnx.Param``
    variables only, mapping int32 ``[2, context]`` to logits ``[2, context, vocab_size]``."""
    if cfg.factory is None:
        return load_factory(ARCHS[cfg.arch].model)(cfg, rngs)
    where = f"model.factory {cfg.factory!r}"
    factory = load_factory(cfg.factory)
    try:
        model = factory(cfg, rngs, **cfg.factory_args)
    except Exception as exc:
        raise ModelFactoryError(
            f"{where} failed when called as factory(model_config, rngs"
            + "".join(f", {k}=..." for k in cfg.factory_args)
            + f"): {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(model, nnx.Module):
        raise ModelFactoryError(f"{where} returned a {type(model).__name__}, not a flax.nnx.Module")
    others = jax.tree_util.tree_leaves_with_path(
        nnx.state(model, nnx.Not(nnx.Param)), is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    if others:
        found = ", ".join(f"{_path_name(p)} ({type(v).__name__})" for p, v in others[:5])
        raise ModelFactoryError(
            f"{where}: the module holds variables other than nnx.Param ({found}); only "
            "parameters travel between learners and syncers (no RNG streams such as "
            "dropout's rngs, no batch statistics)"
        )
    graphdef, params = nnx.split(model, nnx.Param)
    if not jax.tree_util.tree_leaves(params):
        raise ModelFactoryError(f"{where}: the module has no nnx.Param parameters")
    tokens = jax.ShapeDtypeStruct((2, cfg.context), jnp.int32)
    try:
        logits = jax.eval_shape(lambda p, t: nnx.merge(graphdef, p)(t), params, tokens)
    except Exception as exc:
        raise ModelFactoryError(
            f"{where}: calling the module on int32 tokens [2, {cfg.context}] failed: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    expected = (2, cfg.context, cfg.vocab_size)
    shape = getattr(logits, "shape", None)
    dtype = getattr(logits, "dtype", None)
    if shape != expected or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        got = f"{list(shape)} {dtype}" if shape is not None else type(logits).__name__
        raise ModelFactoryError(
            f"{where}: the module maps int32 tokens [2, {cfg.context}] to {got}; expected "
            f"float logits {list(expected)} ([batch, length, model.vocab_size])"
        )
    return model


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
    dtypes: tuple[np.dtype, ...]

    @classmethod
    def create(cls, cfg: ModelConfig, seed: int) -> tuple[ParamCodec, nnx.State]:
        """The codec and the initial parameters ``seed`` draws."""
        return cls._of(create_model(cfg, nnx.Rngs(seed)))

    @classmethod
    def abstract(cls, cfg: ModelConfig) -> ParamCodec:
        """The codec alone: the model's structure, names and shapes, traced without
        computing a parameter (``nnx.eval_shape``; a process that reads its parameters
        from a bucket draws none)."""
        return cls._of(nnx.eval_shape(lambda: create_model(cfg, nnx.Rngs(0))))[0]

    @classmethod
    def _of(cls, model: nnx.Module) -> tuple[ParamCodec, nnx.State]:
        graphdef, state = nnx.split(model, nnx.Param)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
        names = tuple(_path_name(p) for p, _ in leaves)
        shapes = tuple(tuple(v.shape) for _, v in leaves)
        dtypes = tuple(np.dtype(v.dtype) for _, v in leaves)
        return cls(graphdef, treedef, names, shapes, dtypes), state

    def to_flat(self, state: nnx.State) -> FlatParams:
        leaves = jax.tree_util.tree_leaves(state)
        return {n: np.asarray(v) for n, v in zip(self.names, leaves, strict=True)}

    def from_flat(self, flat: Mapping[str, np.ndarray]) -> nnx.State:
        leaves = [jnp.asarray(flat[n]) for n in self.names]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def model(self, state: nnx.State) -> nnx.Module:
        return nnx.merge(self.graphdef, state)

    @property
    def sizes(self) -> dict[str, int]:
        return {n: int(np.prod(s)) for n, s in zip(self.names, self.shapes, strict=True)}

    @property
    def num_params(self) -> int:
        return sum(self.sizes.values())


def is_embedding(name: str) -> bool:
    """Embedding tables are merged by weighted mean even under RDA (ALGORITHM.md): the
    token embedding (``embed.embedding``, the byte model's ``pos_embed`` too) and the
    Llama's untied output head (``lm_head.kernel``), a vocabulary-sized table as well."""
    top = name.split(".")[0]
    return "embed" in top or top == "lm_head"
