"""The model: its architecture, sizes and the Llama's options (``model.*``)."""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from diloco.config.base import ArchName, ConfigError, PositiveFloat, PositiveInt, Strict


class ModelConfig(Strict):
    """Decoder-only transformer: the byte-level GPT (``arch = "byte"``), a Llama-class
    decoder (``"llama"``: RMSNorm, rotary positions, SwiGLU, grouped-query attention;
    ``diloco/llama.py``), or a Flax NNX module of your own (``factory``)."""

    arch: ArchName = Field(
        "byte",
        description="byte: the byte-level GPT (learned positions, GELU MLP, tied head); "
        "llama: a Llama-class decoder (RMSNorm, rotary positions, SwiGLU, grouped-query "
        "attention), exported in the Hugging Face Llama layout",
    )
    vocab_size: PositiveInt = Field(256, description="tokens in the vocabulary (256: bytes)")
    width: PositiveInt = Field(64, description="model width (embedding size)")
    depth: PositiveInt = Field(2, description="transformer blocks")
    heads: PositiveInt = Field(4, description="attention heads (must divide width)")
    context: PositiveInt = Field(64, description="sequence length in tokens")
    mlp_ratio: PositiveInt = Field(4, description="MLP hidden size as a multiple of width")
    # The Llama's own fields (arch "llama"); the byte model refuses values other than
    # these defaults, so a stored spec of a byte run means what it always meant.
    kv_heads: PositiveInt | None = Field(
        None,
        description="llama: key/value heads of grouped-query attention (must divide heads); "
        "null: heads (multi-head attention)",
    )
    hidden: PositiveInt | None = Field(
        None,
        description="llama: the SwiGLU MLP's hidden size; null: 2/3 of mlp_ratio * width, "
        "rounded up to a multiple of 32 (the parameters of a GELU MLP of mlp_ratio)",
    )
    rope_theta: PositiveFloat = Field(10_000.0, description="llama: rotary embedding base")
    norm_eps: PositiveFloat = Field(1e-5, description="llama: RMSNorm epsilon")
    compute_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="llama: dtype of the matmuls and activations; parameters, optimizer "
        "state, logits and the loss stay float32",
    )
    remat: bool = Field(
        False,
        description="llama: recompute each block's activations in the backward pass "
        "(less memory, about a third more compute)",
    )
    tie_embeddings: bool = Field(
        True, description="llama: the output head is the token embedding (false: its own)"
    )
    attention: Literal["auto", "xla", "cudnn"] = Field(
        "auto",
        description="llama: the attention kernel; auto: cuDNN's fused (flash) attention on a "
        "GPU computing in bfloat16, XLA's elsewhere; xla: scores materialized by XLA, on any "
        "device; cudnn: the fused kernel, NVIDIA GPUs and bfloat16 only. The same function "
        "to rounding: learners on different chips may use different kernels",
    )
    # Bring your own model (diloco/model.py: create_model). Part of the run spec: every
    # learner, syncer and launcher imports it, so it must be importable on every node.
    factory: str | None = Field(
        None,
        description="'package.module:function' called as function(model_config, nnx.Rngs, "
        "**factory_args), returning a flax.nnx Module that maps int32 bytes [batch, length] "
        "to logits [batch, length, vocab_size]; null: the built-in model of model.arch",
    )
    factory_args: dict[str, Any] = Field(
        default_factory=dict,
        description="keyword arguments (JSON values) for model.factory",
    )

    @field_validator("factory")
    @classmethod
    def _import_path(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", value):
            raise ValueError(f"{value!r} is not an import path 'package.module:function'")
        return value

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not divisible by heads {self.heads}")
        if self.factory_args and self.factory is None:
            raise ValueError("model.factory_args is set but model.factory is not")
        if self.arch == "byte":
            fields = type(self).model_fields
            changed = [n for n in LLAMA_FIELDS if getattr(self, n) != fields[n].default]
            if changed:
                raise ValueError(
                    f"model.{changed[0]} is a field of model.arch 'llama'; this model is "
                    "arch 'byte' (set model.arch=llama, or leave it out)"
                )
            return self
        if self.factory is not None:
            raise ValueError("model.factory replaces the built-in model: leave model.arch 'byte'")
        if self.heads % self.num_kv_heads:
            raise ValueError(
                f"model.kv_heads {self.num_kv_heads} does not divide model.heads {self.heads} "
                "(each key/value head serves heads / kv_heads query heads)"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"model.width / model.heads = {self.head_dim} is odd; rotary positions need "
                "an even head dimension"
            )
        return self

    def attention_kernel(self, platform: str) -> str:
        """``attention`` on a device of ``platform`` (``jax.default_backend()``): "auto" is
        cuDNN's fused attention where it runs (a GPU, bf16 compute, a head dimension it
        takes), which keeps no ``[heads, time, time]`` scores and skips the masked half;
        XLA's elsewhere. A "cudnn" the device cannot run is refused by name."""
        fits = self.compute_dtype == "bfloat16" and self.head_dim % 8 == 0 and self.head_dim <= 128
        if self.attention == "cudnn" and not (platform == "gpu" and fits):
            raise ConfigError(
                "model.attention=cudnn needs an NVIDIA GPU, model.compute_dtype=bfloat16 and "
                f"a head dimension that is a multiple of 8 up to 128; this is {platform}, "
                f"{self.compute_dtype}, head dimension {self.head_dim} (use model.attention=auto)"
            )
        if self.attention == "auto":
            return "cudnn" if platform == "gpu" and fits else "xla"
        return self.attention

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def ffn_size(self) -> int:
        """The Llama's SwiGLU hidden size (``hidden``, or its default)."""
        if self.hidden is not None:
            return self.hidden
        return math.ceil(2 * self.mlp_ratio * self.width / 3 / 32) * 32


LLAMA_FIELDS = (
    "kv_heads",
    "hidden",
    "rope_theta",
    "norm_eps",
    "compute_dtype",
    "remat",
    "tie_embeddings",
    "attention",
)
