"""The built-in model architectures, by name (``model.arch``).

Each says how its model is built, how many parameters and FLOPs a config of it has, what
one of its blocks keeps per token for the backward pass (``diloco.memory``'s estimate,
whose docstring derives the counts), whether it computes in bf16 beside float32 weights,
and whether it is exported in the Hugging Face layout. The estimate, the export and the
command line ask the architecture, never its name: a new architecture is a class here
and an entry in ``ARCHS`` and the config's ``ArchName``. It imports nothing (the model's
module is imported when one is built), so ``diloco plan memory`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from diloco.config import ModelConfig

FLOAT = 4  # bytes: activations the float32 way


class Arch(Protocol):
    # The Hugging Face family it is exported as, a folder in that layout
    # (``flows.model_export.export_hf``); None: one safetensors file of the codec's names.
    hugging_face: str | None
    # The model's class, "module:name", called as ``Model(model_config, rngs)``
    # (``diloco.model.create_model``; imported only when a model is built).
    model: str

    def param_count(self, m: ModelConfig) -> int: ...

    def flops_per_token(self, m: ModelConfig) -> int:
        """Model FLOPs of a training step per token (what MFU counts)."""
        ...

    def block_bytes_per_token(self, m: ModelConfig, remat: bool, platform: str) -> int:
        """What the blocks keep per token for the backward pass (logits apart)."""
        ...

    def compute_copies(self, m: ModelConfig) -> bool:
        """Whether a step keeps half-precision copies of the weights beside them."""
        ...

    def remat(self, m: ModelConfig) -> bool | None:
        """Whether its blocks are rematerialized; None: it has no such choice."""
        ...


class Byte:
    """The byte-level GPT (``diloco.model.Transformer``)."""

    hugging_face: str | None = None
    model = "diloco.model:Transformer"

    def param_count(self, m: ModelConfig) -> int:
        h = m.mlp_ratio * m.width
        block = 2 * m.width + 4 * m.width**2 + 2 * m.width * h + h + m.width
        return (m.vocab_size + m.context) * m.width + m.depth * block + m.width

    def flops_per_token(self, m: ModelConfig) -> int:
        raise ValueError(f"model FLOPs are counted for model.arch 'llama', not {m.arch!r}")

    def block_bytes_per_token(self, m: ModelConfig, remat: bool, platform: str) -> int:
        return m.depth * ((10 + 2 * m.mlp_ratio) * m.width + 4 * m.heads * m.context) * FLOAT

    def compute_copies(self, m: ModelConfig) -> bool:
        return False

    def remat(self, m: ModelConfig) -> bool | None:
        return None


class Llama:
    """The Llama-class decoder (``diloco.llama.Llama``)."""

    hugging_face: str | None = "Llama"
    model = "diloco.llama:Llama"

    def param_count(self, m: ModelConfig) -> int:
        q, kv = m.heads * m.head_dim, m.num_kv_heads * m.head_dim
        block = 2 * m.width + 2 * m.width * q + 2 * m.width * kv + 3 * m.width * m.ffn_size
        head = 0 if m.tie_embeddings else m.vocab_size * m.width
        return m.vocab_size * m.width + head + m.depth * block + m.width

    def flops_per_token(self, m: ModelConfig) -> int:
        """``6 N + 12 L d T`` (PaLM, appendix B): N the parameters of the matmuls (every
        block's kernels and the output head: the token table itself when tied; not an
        untied embedding table, a lookup, nor the norms' scales), L layers, d width, T
        context. Remat's recomputation is not in it."""
        lookup = 0 if m.tie_embeddings else m.vocab_size * m.width
        norms = m.width * (2 * m.depth + 1)
        matmuls = self.param_count(m) - lookup - norms
        return 6 * matmuls + 12 * m.depth * m.width * m.context

    def block_bytes_per_token(self, m: ModelConfig, remat: bool, platform: str) -> int:
        size = 2 if m.compute_dtype == "bfloat16" else 4
        kv = m.num_kv_heads * m.head_dim
        scores = m.heads if m.attention_kernel(platform) == "cudnn" else 2 * m.heads * m.context
        block = (8 * m.width + 4 * kv + 4 * m.ffn_size) * size + scores * FLOAT
        return m.depth * m.width * size + block if remat else m.depth * block

    def compute_copies(self, m: ModelConfig) -> bool:
        return m.compute_dtype == "bfloat16"

    def remat(self, m: ModelConfig) -> bool | None:
        return m.remat


ARCHS: dict[str, Arch] = {"byte": Byte(), "llama": Llama()}
