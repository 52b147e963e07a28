"""A rough estimate of the memory one learner process needs, before it starts.

`diloco train` starts every learner of a run on one machine (processes mode): a preset
too large for it was OOM-killed over and over while the display said "compiling". The
estimate is what the launcher prints, and warns on, before anything starts, and what
`diloco plan memory --preset P --devices N ...` tabulates per device.

Parameters, gradients, AdamW's two moments and the anchors (the global versions the
learner's outer gradients are taken against) are float32, 4 bytes a value each. Over
``devices`` devices the learner shards all four (FSDP), so each device holds
``1 / devices`` of them; the batch is split over the devices too, and so are the
activations. A Llama computing in bf16 also keeps bf16 copies of its weights for the
backward pass (2 bytes a value, sharded likewise). The train step does not donate what it
is given (``InnerTrainer.step``), so while it updates, the new parameters and moments it
returns are beside the old ones: 12 bytes a value more (sharded likewise). The backward
pass's activations are gone by then, so the total counts the larger of the two, not both:
with a small batch (or remat) the update is the step's peak, with a large one the
backward pass.

Activations are those a step keeps for its backward pass, per token:

- byte model, per block: the block's input, the normalized inputs, q/k/v, the attention
  output and its projection, the residuals, the MLP's up and GELU outputs
  (``mlp_ratio * width`` each) and the down projection, about
  ``(10 + 2 * mlp_ratio) * width`` float32 values, plus the attention's logits, mask,
  probabilities and their gradient, ``4 * heads * context``;
- Llama, per block, in the compute dtype: the block's input, both norms' outputs, q, k
  and v before and after the rotation, the attention output, the residual
  (``8 * width + 4 * kv_width``, ``kv_width = kv_heads * head_dim``) and the SwiGLU's
  gate, up, ``silu(gate)`` and their product (``4 * hidden``); plus, with XLA's
  attention, the float32 logits and probabilities, ``2 * heads * context``, which
  cuDNN's fused attention (``model.attention``, the default on a GPU in bf16) does not
  keep: it keeps a float32 log-sum-exp per head, ``heads``. With
  ``remat`` a block keeps only its input, and one block's full set lives at a time
  while it is recomputed;
- both: the output logits, their softmax and its gradient, ``3 * vocab_size`` float32
  values.

Checked against the peak resident memory (VmHWM) of one compiled train step on CPU
(2026-11-28, JAX 0.10.2): ``base`` (25.6 M parameters) 3.06 GB at batch 4, where this
says 2.72 GB; ``llama-tiny`` (float32, 1.26 M parameters) 0.66 GB at batch 8 and 1.48 GB
at batch 64, where this says 0.66 and 1.44 GB; ``llama-150m`` at batch 1 x 256 (bf16
compute) 6.10 GB, where this says 5.95 GB (``bench/learner/donation.md`` in commit
77c7412; without the step's new state it said 4.35). And the device allocator's peak of
a learner on an H100 (``bench/learner/results-gpu.md``): ``llama-1b`` at batch 8 x 2048,
remat, 56.4 GB, where this says 55.7 GB (the backward pass is its peak; counting the
step's new state on top would say 70.5). The measurement, on one CPU device:
``python -m diloco.memory --measure llama-tiny 8``. A model of one's own
(``model.factory``) is estimated as if it were the built-in one of the same shape:
roughly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from diloco.archs import ARCHS, FLOAT
from diloco.config import ModelConfig, RunConfig

RUNTIME_BYTES = 500 * 2**20  # Python, JAX, Flax, Prefect, the corpus: measured ~0.3-0.5 GB


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one learner needs, by part; with ``devices`` > 1, per device (the runtime is
    per process)."""

    parameters: int  # the learner's parameters
    optimizer: int  # AdamW's two moments
    gradients: int  # one step's gradients
    copies: int  # the global versions it started from (its outer gradients' anchors)
    activations: int  # what one step keeps for its backward pass
    runtime: int  # the interpreter and libraries
    compute_copies: int = 0  # bf16 weights a bf16 model keeps for its backward pass
    # The new parameters and moments a step returns beside the old, once its activations
    # are freed: the total counts the larger of the two.
    step_state: int = 0

    @property
    def total(self) -> int:
        return (self.parameters + self.optimizer + self.gradients + self.copies
                + self.compute_copies + max(self.activations, self.step_state)
                + self.runtime)  # fmt: skip

    def parts(self) -> list[tuple[str, int]]:
        out = [
            ("parameters", self.parameters),
            ("AdamW state", self.optimizer),
            ("gradients", self.gradients),
            ("anchor copies", self.copies),
        ]
        if self.compute_copies:
            out.append(("bf16 weights", self.compute_copies))
        if self.step_state:
            out.append(("new state at the update", self.step_state))
        return [*out, ("activations", self.activations), ("runtime", self.runtime)]


def param_count(m: ModelConfig) -> int:
    """Parameters of the built-in model ``m`` describes, without building it."""
    return ARCHS[m.arch].param_count(m)


def model_flops_per_token(m: ModelConfig) -> int:
    """Model FLOPs a training step spends per token (``Arch.flops_per_token``)."""
    return ARCHS[m.arch].flops_per_token(m)


def activation_bytes_per_token(
    m: ModelConfig, remat: bool | None = None, platform: str = "gpu"
) -> int:
    """What a step keeps per token for its backward pass (the module docstring);
    ``remat`` overrides the config's; ``platform`` decides the attention kernel."""
    arch = ARCHS[m.arch]
    remat = bool(arch.remat(m)) if remat is None else remat
    return arch.block_bytes_per_token(m, remat, platform) + 3 * m.vocab_size * FLOAT


def learner_memory(
    cfg: RunConfig,
    num_params: int,
    devices: int = 1,
    remat: bool | None = None,
    platform: str = "gpu",
) -> MemoryEstimate:
    """The memory one learner of ``cfg`` needs per device, for a model of ``num_params``
    parameters sharded (with its optimizer state and batch) over ``devices`` devices of
    ``platform`` (``jax.default_backend()``: the attention kernel depends on it);
    ``remat`` overrides ``model.remat`` (the Llama's)."""
    m = cfg.model
    tokens = math.ceil(cfg.data.batch_size / devices) * m.context
    weights = math.ceil(num_params / devices) * FLOAT
    bf16 = ARCHS[m.arch].compute_copies(m)
    return MemoryEstimate(
        parameters=weights,
        optimizer=2 * weights,  # AdamW's two moments (Muon keeps one per matrix: less)
        gradients=weights,
        copies=weights,
        activations=tokens * activation_bytes_per_token(m, remat, platform),
        runtime=RUNTIME_BYTES,
        compute_copies=weights // 2 if bf16 else 0,
        step_state=3 * weights,
    )


def process_memory(num_params: int) -> int:
    """What a syncer shard or the launcher holds at most: the runtime, and the parameters
    with their outer momentum and a merge's worth of copies."""
    return RUNTIME_BYTES + 4 * num_params * FLOAT


def measure_step(preset: str, batch_size: int) -> dict[str, float]:
    """Peak resident memory of a process that builds ``preset``'s model and runs one
    compiled train step at ``batch_size`` on one CPU device, against the estimate: what
    the module docstring quotes (``python -m diloco.memory --measure PRESET BATCH``)."""
    import resource

    import jax
    import numpy as np

    from diloco.config import load_config
    from diloco.inner import InnerTrainer
    from diloco.model import ParamCodec

    cfg = load_config(preset, overrides=[f"data.batch_size={batch_size}"])
    codec, state = ParamCodec.create(cfg.model, 0)
    trainer = InnerTrainer(codec, cfg.inner, 100, jax.devices()[:1])
    params = trainer.place_params(codec.to_flat(state))
    opt = trainer.init_opt_state(params)
    anchors = codec.to_flat(state)  # the learner holds its anchors too
    batch = np.random.default_rng(0).integers(0, cfg.model.vocab_size,
                                              (batch_size, cfg.model.context + 1))  # fmt: skip
    for _ in range(2):
        params, opt, loss = trainer.step(params, opt, batch.astype(np.int32), 1.0)
    jax.block_until_ready(loss)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    est = learner_memory(cfg, codec.num_params, platform=jax.default_backend())
    del anchors
    return {"params": codec.num_params, "peak_gb": peak / 1e9, "estimate_gb": est.total / 1e9,
            "activations_gb": est.activations / 1e9}  # fmt: skip


if __name__ == "__main__":
    import json
    import sys

    if len(sys.argv) != 4 or sys.argv[1] != "--measure":
        sys.exit("usage: python -m diloco.memory --measure PRESET BATCH_SIZE")
    print(json.dumps(measure_step(sys.argv[2], int(sys.argv[3]))))
