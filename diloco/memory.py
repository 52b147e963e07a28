"""A rough estimate of the memory one learner process needs, before it starts.

`diloco train` starts every learner of a run on one machine (processes mode): a preset
too large for it was OOM-killed over and over while the display said "compiling". The
estimate is what the launcher prints, and warns on, before anything starts. Everything
is float32 (parameters, AdamW moments, gradients, activations), as the trainer keeps it.

Activations are those a step keeps for its backward pass, without rematerialization, per
token and block of the built-in transformer: the block's input, the normalized inputs,
q/k/v, the attention output and its projection, the residuals, the MLP's up and GELU
outputs (``mlp_ratio * width`` each) and the down projection, about
``(10 + 2 * mlp_ratio) * width`` values, plus the attention's logits, mask, probabilities
and their gradient, ``4 * heads * context``; and the output logits, their softmax and
its gradient, ``3 * vocab_size`` per token. Checked against the peak resident memory of
one compiled step of ``base`` on CPU: 2.75 GB at batch 4 and 8.0 GB at batch 16, where
this says 2.7 and 7.8 GB. A model of one's own (``model.factory``) is estimated as if
it were the built-in one of the same shape: roughly.
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco.config import RunConfig

FLOAT = 4  # bytes: the trainer keeps everything in float32
RUNTIME_BYTES = 500 * 2**20  # Python, JAX, Flax, Prefect, the corpus: measured ~0.3-0.5 GB


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one learner process needs, by part."""

    parameters: int  # the learner's parameters
    optimizer: int  # AdamW's two moments
    gradients: int  # one step's gradients
    copies: int  # the global versions it started from (its outer gradients' anchors)
    activations: int  # what one step keeps for its backward pass
    runtime: int  # the interpreter and libraries

    @property
    def total(self) -> int:
        return (self.parameters + self.optimizer + self.gradients + self.copies
                + self.activations + self.runtime)  # fmt: skip

    def parts(self) -> list[tuple[str, int]]:
        return [
            ("parameters", self.parameters),
            ("AdamW state", self.optimizer),
            ("gradients", self.gradients),
            ("anchor copies", self.copies),
            ("activations", self.activations),
            ("runtime", self.runtime),
        ]


def learner_memory(cfg: RunConfig, num_params: int) -> MemoryEstimate:
    """The memory one learner of ``cfg`` needs, for a model of ``num_params`` parameters."""
    m, tokens = cfg.model, cfg.data.batch_size * cfg.model.context
    per_token = m.depth * ((10 + 2 * m.mlp_ratio) * m.width + 4 * m.heads * m.context)
    per_token += 3 * m.vocab_size
    weights = num_params * FLOAT
    return MemoryEstimate(
        parameters=weights,
        optimizer=2 * weights,
        gradients=weights,
        copies=weights,
        activations=tokens * per_token * FLOAT,
        runtime=RUNTIME_BYTES,
    )


def process_memory(num_params: int) -> int:
    """What a syncer shard or the launcher holds at most: the runtime, and the parameters
    with their outer momentum and a merge's worth of copies."""
    return RUNTIME_BYTES + 4 * num_params * FLOAT
