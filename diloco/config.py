"""Typed run configuration: presets, files (TOML or JSON) and `key=value` overrides.

Every config is a frozen pydantic model that forbids unknown fields, so a typo or a
wrong value fails at load time with the dotted name of the field
(``config field 'outer.lr': Input should be greater than 0``).
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from protocol.topology import learner_index, member_quorum

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
Fraction = Annotated[float, Field(ge=0, le=1)]


ArchName = Literal["byte", "llama"]  # diloco.archs.ARCHS


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
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


class DataConfig(_Strict):
    """Where tokens come from. ``source=None`` is the Python standard library's .py files."""

    source: str | None = Field(
        None,
        description="text file, JSON lines or Parquet file, folder of them, or fsspec URL "
        "to train on (bytes), or a data set of `diloco data prepare` (tokens: set "
        "model.vocab_size to its vocabulary); null: the Python standard library's .py files",
    )
    batch_size: PositiveInt = Field(8, description="sequences per learner per inner step")
    val_percent: Annotated[int, Field(ge=1, le=50)] = Field(
        5,
        description="percent of the files held out for validation (a prepared data set "
        "holds its own split)",
    )
    eval_batches: PositiveInt = Field(8, description="validation batches per evaluation")
    text_field: str = Field(
        "text",
        min_length=1,
        description="the field of each JSON lines record (.jsonl, .jsonl.gz), or the column "
        "of a Parquet file (.parquet), that holds a document's text",
    )
    assign: Literal["auto", "slots", "units"] = Field(
        "auto",
        description="how the training data reaches learners: 'units', taken in "
        "units as learners need them, and given back by a learner that leaves, so none "
        "is trained twice or skipped in an epoch whoever comes and goes, and learners "
        "may join beyond the run's slots (diloco/units.py; docs/data.md; text is cut into "
        "chunks of 64 KiB for it); 'slots', dealt to the topology.learners slots once (a "
        "slot no one holds leaves its share untrained); 'auto': units for a run through "
        "buckets (diloco train's) and for a prepared data set, slots for text in the "
        "simulator's memory, and for a run already started what its spec records",
    )


class InnerConfig(_Strict):
    """AdamW with linear warm-up, cosine decay and global-norm clipping."""

    lr: PositiveFloat = Field(3e-3, description="peak learning rate (after the warm-up)")
    min_lr_ratio: Fraction = Field(
        0.1, description="learning rate at the end of the cosine decay, as a share of lr"
    )
    warmup_steps: Annotated[int, Field(ge=0)] = Field(50, description="linear warm-up steps")
    weight_decay: Annotated[float, Field(ge=0)] = Field(
        0.1, description="AdamW weight decay (matrices only, not norms or biases)"
    )
    b1: Fraction = Field(0.9, description="AdamW beta1 (first-moment decay)")
    b2: Fraction = Field(0.95, description="AdamW beta2 (second-moment decay)")
    clip_norm: PositiveFloat = Field(1.0, description="clip gradients to this global L2 norm")


StalenessName = Literal["constant", "polynomial", "exponential", "hinge"]
QuantName = Literal["fp32", "bf16", "int8", "int4"]
MergeName = Literal["mean", "rda"]  # diloco.merge.MERGE_RULES


class OuterConfig(_Strict):
    """Syncer side: staleness weighting, merge rule, outer Nesterov SGD."""

    # docs/algorithm.md: with tens of outer steps per fragment plain averaging beat every
    # momentum tried; the GPU presets (hundreds of outer steps) use Nesterov 0.9 / 0.5.
    lr: PositiveFloat = Field(1.0, description="outer learning rate (1 with momentum 0: averaging)")
    momentum: Annotated[float, Field(ge=0, lt=1)] = Field(
        0.0, description="outer SGD momentum; 0: none"
    )
    nesterov: bool = Field(True, description="Nesterov momentum (when momentum > 0)")
    optimizer: Literal["sgd", "adam"] = Field(
        "sgd",
        description="the outer optimizer (diloco.outer.OUTER_OPTIMIZERS): sgd (lr, momentum, "
        "nesterov) or adam (lr, adam_b1, adam_b2, adam_eps; its step count is the fragment's)",
    )
    adam_b1: Annotated[float, Field(ge=0, lt=1)] = Field(0.9, description="outer Adam's beta1")
    adam_b2: Annotated[float, Field(ge=0, lt=1)] = Field(0.999, description="outer Adam's beta2")
    adam_eps: PositiveFloat = Field(1e-8, description="outer Adam's epsilon")
    merge: MergeName = Field(
        "mean",
        description="how outer gradients combine: weighted mean, or rda (radial-directional "
        "average per tensor, mean for embeddings)",
    )
    # docs/algorithm.md: "anchored" is best with stale work.
    reference: Literal["delta", "anchored"] = Field(
        "anchored",
        description="delta: merge outer gradients as sent; anchored: as the current global "
        "minus the learner's parameters (rebased from the version it started on)",
    )
    staleness: StalenessName = Field(
        "polynomial", description="staleness weight g(s) of a contribution s versions behind"
    )
    staleness_a: PositiveFloat = Field(0.5, description="polynomial exponent, or hinge slope")
    staleness_b: Annotated[float, Field(ge=0)] = Field(1.0, description="hinge knee")
    staleness_lambda: PositiveFloat = Field(0.5, description="exponential rate")
    max_staleness: Annotated[int, Field(ge=0)] = Field(
        8, description="reject contributions more than this many versions behind"
    )
    max_norm: PositiveFloat = Field(
        1e3, description="reject outer gradients with a larger global L2 norm"
    )
    max_norm_ratio: Annotated[float, Field(ge=0)] = Field(
        10.0,
        description="reject one whose norm per inner step is this many times the median of "
        "the fragment's recent accepted ones (a learner gone wrong, or a forged update); "
        "0 turns it off",
    )


class TopologyConfig(_Strict):
    """Learners, fragments and the sync schedule (the knobs of ALGORITHM.md)."""

    learners: PositiveInt = Field(4, description="M: learners, each training its own copy")
    fragments: PositiveInt = Field(2, description="P: parameter fragments, each synced apart")
    fragment_strategy: Literal["balanced", "strided", "sequential"] = Field(
        "balanced", description="how tensors are dealt to fragments"
    )
    inner_steps: PositiveInt = Field(
        20, description="H: inner steps between two syncs of one fragment"
    )
    tau: Annotated[int, Field(ge=0)] = Field(
        2, description="apply a global no earlier than tau steps after sending"
    )
    alpha: Annotated[float, Field(ge=0, lt=1)] = Field(
        0.0, description="blend on receipt: theta <- alpha*theta + (1-alpha)*global"
    )
    keep_unsent: bool = Field(
        True,
        description="instead of the blend, re-apply on top of the new global the local steps "
        "taken since the send it answers; they travel in the next contribution instead of "
        "being overwritten",
    )
    quorum: PositiveInt | None = Field(
        None, description="K: contributions a merge waits for; null: M for diloco, "
        "max(1, M // 2) for decoupled"
    )  # fmt: skip
    quorum_share: Annotated[float, Field(gt=0, le=1)] | None = Field(
        None,
        description="decoupled mode: a quorum that follows who is there, K = max(quorum_floor, "
        "floor(share x members now)) (members: learners holding their slot; joiners count at "
        "once, a learner preempted, left or silent (liveness.*) no longer); "
        "null: the fixed K (topology.quorum), capped by the members",
    )
    quorum_floor: PositiveInt = Field(
        1, description="the smallest quorum quorum_share gives (capped by the members)"
    )
    grace: Annotated[float, Field(ge=0, lt=1)] = Field(
        0.5, description="gamma: share of the slack left after the quorum that a merge waits"
    )
    quantization: QuantName = Field("int4", description="dtype of outer gradients learners send")
    block_size: PositiveInt = Field(128, description="values per scale of int8 and int4")
    error_feedback: bool = Field(
        False, description="add each send's rounding error to the learner's next one"
    )
    global_dtype: Literal["fp32", "bf16"] = Field(
        "bf16", description="dtype of the global versions learners download"
    )
    downlink: Literal["full", "int8", "int4"] = Field(
        "full",
        description="what a learner that holds the previous version downloads: full, the "
        "whole version in global_dtype; int4/int8, the quantized difference to the previous "
        "version (the syncer carries the rounding residual; a learner that missed versions "
        "fetches the full copy, which equals what the differences rebuild, bit for bit)",
    )


class Failure(_Strict):
    """Learner ``learner`` is down from ``at`` to ``at + duration`` (fractions of the run's
    nominal time); with no ``duration``, it leaves: its slot stays vacant (a ``sim.joins``
    entry may fill it again)."""

    learner: Annotated[int, Field(ge=0)] = Field(description="the learner's index (0-based)")
    at: Fraction = Field(description="when it fails, as a share of the run's tokens")
    duration: Fraction | None = Field(
        None,
        description="how long it stays down, as a share of the tokens; none: it leaves the run "
        "for good (its slot vacant, as a pipeline learner preempted or silent (liveness.*); "
        "needs a shared budget)",
    )
    notice: bool = Field(
        False,
        description="a preemption with notice (a spot VM's SIGTERM): the learner sends what it "
        "trained and checkpoints before it goes, as a preempted pipeline learner does; "
        "false: a kill, losing the steps since its newest sends and checkpoint",
    )


class Join(_Strict):
    """A learner joins slot ``learner`` at ``at`` (a share of the run's nominal time), as
    ``diloco join`` does in the pipeline: from the newest global versions and the slot's
    data position. The slot must be vacant then: never started
    (``pipeline.learners_started``) or left (a ``sim.failures`` entry with no duration);
    or, taking the data in units, ``learner`` is the next index beyond the run's slots
    (``topology.learners``, then the next): a learner added, as ``diloco join`` adds one
    when no slot is vacant (at speed 1.0)."""

    learner: Annotated[int, Field(ge=0)] = Field(description="the slot's index (0-based)")
    at: Fraction = Field(description="when it joins, as a share of the run's tokens")


def sim_events(sim: SimConfig) -> list[tuple[float, int, str, int, bool]]:
    """The simulated membership changes in order: ``(at, order, kind, learner, notice)``,
    kind ``fail`` (down, to come back), ``leave`` (for good), ``back`` or ``join``, at a
    share of the run's nominal time; at one moment, goings before comings. The one
    reading of ``sim.failures`` and ``sim.joins``."""
    events = []
    for f in sim.failures:
        events.append((f.at, 0, "leave" if f.duration is None else "fail", f.learner, f.notice))
        if f.duration is not None:
            events.append((f.at + f.duration, 1, "back", f.learner, False))
    events += [(j.at, 1, "join", j.learner, False) for j in sim.joins]
    return sorted(events)


class BudgetConfig(_Strict):
    """How long a run trains: the simulator and the pipeline read the same budget."""

    tokens: PositiveInt = Field(
        400_000,
        description="tokens of the run, over all learners (M learners: tokens / M each on average)",
    )
    shared: bool = Field(
        True,
        description="decoupled mode: the learners share the budget. Each trains until the "
        "learners together have trained it (as the newest global versions report), so a faster "
        "learner, or one killed less often, trains more than tokens / M and none sits idle at "
        "the end; false: each trains exactly tokens / M. Synchronous DiLoCo always splits it "
        "evenly (its learners move in lock-step)",
    )


class SimConfig(_Strict):
    """The simulated clock and network of `diloco simulate`."""

    step_seconds: PositiveFloat = Field(
        1.0, description="simulated time of one inner step at speed 1"
    )
    # (``sim.speeds`` is the old name of ``pipeline.speeds``: still read, moved there.)
    failures: tuple[Failure, ...] = Field(
        (),
        description='learner outages: [{"learner": 3, "at": 0.3, "duration": 0.25}] (add "notice": true for a preemption with notice)',
    )
    joins: tuple[Join, ...] = Field(
        (),
        description='learners joining vacant slots: [{"learner": 3, "at": 0.2}] (a slot '
        "pipeline.learners_started leaves vacant, or one a failure with no duration left), or "
        "added beyond the run's slots (index topology.learners, then the next: data.assign = "
        "'units' only; speed 1.0)",
    )
    bandwidth_gbps: PositiveFloat = Field(
        1.0, description="per learner, between its region and the syncer"
    )
    latency_seconds: Annotated[float, Field(ge=0)] = Field(
        0.05, description="simulated latency of each transfer"
    )
    eval_points: PositiveInt = Field(10, description="evaluations of the global model over the run")


class LivenessConfig(_Strict):
    """How a run tells a live learner from a dead one and one taking part from one that
    is not (``diloco.liveness``): part of the run spec, so that every syncer, launcher
    and joiner judges a slot by the same rule, whatever settings it was started with."""

    heartbeat_seconds: PositiveFloat = Field(
        5.0,
        description="a learner proves it is alive this often (a small signed object "
        "rewritten from a thread of its own), however long its rounds are",
    )
    silent_min_seconds: PositiveFloat = Field(
        60.0,
        description="a learner is silent (its slot vacant, its data given back) when its "
        "heartbeat has not moved for 6 of its measured periods, never sooner than this",
    )
    silent_max_seconds: PositiveFloat = Field(
        600.0,
        description="... and never later than this (a heartbeat slowed by a loaded machine "
        "stretches the period it is judged by up to here); also the silence of a learner "
        "that has written no heartbeat (one started by older code, or not started)",
    )
    lag_rounds: PositiveFloat = Field(
        3.0,
        description="a learner alive and training that has committed no send for this many "
        "of its own rounds (topology.inner_steps times its measured step time, at least "
        "silent_min_seconds) is lagging: counted out of the quorum until it sends, never "
        "fenced while its heartbeat goes on",
    )

    @model_validator(mode="after")
    def _bounds(self) -> LivenessConfig:
        if self.silent_min_seconds > self.silent_max_seconds:
            raise ValueError(
                f"liveness.silent_min_seconds {self.silent_min_seconds:g} exceeds "
                f"liveness.silent_max_seconds {self.silent_max_seconds:g}"
            )
        if self.silent_min_seconds < 2 * self.heartbeat_seconds:
            raise ValueError(
                f"liveness.silent_min_seconds {self.silent_min_seconds:g} is under two "
                f"heartbeats ({self.heartbeat_seconds:g} s each): a live learner would be "
                "taken for silent between two beats"
            )
        return self


class PipelineConfig(_Strict):
    """How learners and syncers run (not part of the run spec: these may change between
    two launches of one run). The simulator reads ``checkpoint_every``,
    ``syncer_shards`` and ``speeds`` too; the rest is for `diloco train`'s Prefect flows."""

    # The hardware of a launch, not of the run: it may change between two launches.
    speeds: tuple[PositiveFloat, ...] = Field(
        (),
        description="slowdown factor per learner (2.0: a chip twice as slow); empty: all "
        "alike. The simulator's learner m takes speeds[m] * sim.step_seconds per step; a "
        "learner of diloco train sleeps to emulate the slower chip",
    )
    checkpoint_every: PositiveInt = Field(50, description="inner steps between learner checkpoints")
    learners_started: PositiveInt | None = Field(
        None,
        description="learner slots diloco train starts itself (learner-0 .. learner-N-1); "
        "the others wait for machines that join (diloco join). Null: every slot. With a "
        "shared budget, a slot vacant when the budget is spent does not hold the run's end",
    )
    preempt_seconds: PositiveFloat = Field(
        30.0,
        description="a learner told it will be preempted (SIGTERM) stops after its step, "
        "sends every fragment's unsent steps and checkpoints; what is not written within "
        "this many seconds is abandoned, named in its log (a spot notice gives 30 s to 2 min)",
    )
    learner_processes: PositiveInt = Field(
        1,
        description="processes per learner, joined by jax.distributed (diloco.hosts); "
        "diloco train starts each learner as this many local processes, one learner to the "
        "syncers, restarted as a whole when one of them dies",
    )
    learner_coordinator_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="with learner_processes > 1: the port of learner m's coordinator is "
        "this plus m; null: a free port, picked at each start",
    )
    round_steps: PositiveInt = Field(50, description="inner steps per round (one Prefect task run)")
    rounds_per_flow_run: PositiveInt = Field(
        20, description="a learner flow run ends after this many rounds"
    )
    versions_per_flow_run: PositiveInt = Field(
        200, description="a syncer flow run ends after this many publishes"
    )
    keep_versions: PositiveInt | None = Field(
        None,
        description="global versions kept per fragment; null: what the run needs, "
        "outer.max_staleness + 2 (the anchored merge's bases, and a version to go back to "
        "should the newest be damaged; a larger number keeps more, never fewer); older "
        "ones and the contributions merged into them are deleted as the run goes",
    )
    retention_seconds: Annotated[float, Field(ge=0)] = Field(
        60.0,
        description="a syncer shard runs retention (lists every learner's markers and the "
        "versions of its fragments, deletes what no learner can still need) at most this "
        "often, after a publish: a run keeps at most keep_versions plus what it publishes "
        "in this time, and the LIST requests stay a few a minute however fast it publishes; "
        "0: after every publish",
    )
    syncer_shards: PositiveInt = Field(
        2, description="syncer processes; shard s owns the fragments p with p % S == s"
    )
    poll_seconds: PositiveFloat = Field(
        0.2, description="how often learners and syncers list the buckets"
    )
    max_failed_starts: PositiveInt = Field(
        5,
        description="a crashed worker is started again for as long as the run lasts; one "
        "that fails this many starts in a row without progress is given up, by name",
    )
    spares: Annotated[int, Field(ge=0)] = Field(
        1,
        description="worker processes started ahead of need, imports done, for a restarted "
        "worker to take over; 0: start each cold",
    )
    fsdp: int = Field(
        1,
        description="devices per parameter shard group of a learner: its parameters and "
        "AdamW state are split over this many of its devices (FSDP), the batch over all; "
        "1: replicated on every device, -1: sharded over all of them. Must divide the "
        "learner's device count (docs/architecture.md, 'A sharded learner')",
    )
    eval_seconds: PositiveFloat = Field(
        10.0, description="the launcher evaluates the newest globals this often"
    )
    upload_retries: Annotated[int, Field(ge=0)] = Field(
        5, description="retries per contribution upload, with backoff"
    )
    stall_seconds: PositiveFloat = Field(
        120.0, description="a learner says so when no awaited version came for this long"
    )
    syncer_memory_mb: Annotated[int, Field(ge=64)] = Field(
        512,
        description="what a syncer shard's merge may hold in chunks (being read, built and "
        "uploaded; a chunk is at most 4 MiB), whatever the model's size: it sets how many "
        "chunk uploads are in flight per region; the process adds its interpreter and JAX",
    )
    syncer_spool_mb: Annotated[int, Field(ge=0)] = Field(
        2048,
        description="local disk a syncer shard keeps the contributions' chunks on between "
        "the check when they are listed and the merge, so each is fetched once (oldest "
        "dropped first when full); 0: none, the merge fetches them again",
    )
    probe_exclusive: bool = Field(
        True,
        description="before a run starts, check that every bucket refuses a second "
        "exclusive create",
    )
    # Checked before the run starts.
    faults: dict[str, Any] = Field(
        default_factory=dict,
        description="storage fault plan (fields of storage_layout.faults.FaultPlan, "
        "docs/chaos.md) for diloco train's local workers; empty: none",
    )
    chaos: dict[str, Any] = Field(
        default_factory=dict,
        description="process chaos plan (fields of infra.chaos.ChaosPlan, docs/chaos.md) for "
        "diloco train's local workers; empty: none",
    )

    @model_validator(mode="before")
    @classmethod
    def _member_timeout_gone(cls, data: Any) -> Any:
        if isinstance(data, dict) and "member_timeout" in data:
            raise ValueError(
                "pipeline.member_timeout is gone: a learner is silent when its heartbeat "
                "stops, not when its round is long; the run's liveness.* settings (its "
                "spec: liveness.silent_min_seconds, silent_max_seconds) bound when"
            )
        return data

    @field_validator("fsdp")
    @classmethod
    def _fsdp(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError(f"fsdp={value}: give a device count (>= 1), or -1 for all devices")
        return value


class RunConfig(_Strict):
    seed: int = Field(0, description="random seed (initial model, data order, chaos)")
    mode: Literal["dp", "diloco", "decoupled"] = Field(
        "decoupled",
        description="dp: data-parallel baseline (simulator only); diloco: synchronous, "
        "quorum = M; decoupled: quorum K, grace window, staleness weights",
    )
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    inner: InnerConfig = InnerConfig()
    outer: OuterConfig = OuterConfig()
    topology: TopologyConfig = TopologyConfig()
    budget: BudgetConfig = BudgetConfig()
    liveness: LivenessConfig = LivenessConfig()
    sim: SimConfig = SimConfig()
    pipeline: PipelineConfig = PipelineConfig()

    @model_validator(mode="before")
    @classmethod
    def _speeds_moved(cls, data: Any) -> Any:
        """``sim.speeds`` is the old name of ``pipeline.speeds``: configs, overrides and
        dumps that use it still load, with the value moved to where both clocks read it."""
        sim = data.get("sim") if isinstance(data, dict) else None
        if not isinstance(sim, dict) or "speeds" not in sim:
            return data
        sim = dict(sim)
        old = sim.pop("speeds")
        pipeline = data.get("pipeline") or {}
        if isinstance(pipeline, BaseModel):
            pipeline = pipeline.model_dump()
        pipeline = dict(pipeline)
        new = pipeline.get("speeds")
        if old and new and list(old) != list(new):
            raise ValueError(
                f"sim.speeds {list(old)} and pipeline.speeds {list(new)} disagree: sim.speeds "
                "is the old name of pipeline.speeds; set that one only"
            )
        if old or new is None:
            pipeline["speeds"] = old
        return {**data, "sim": sim, "pipeline": pipeline}

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        m = self.topology.learners
        speeds = self.pipeline.speeds
        if speeds and len(speeds) != m:
            raise ValueError(
                f"pipeline.speeds has {len(speeds)} entries for {m} learners (one factor each)"
            )
        leaves = [f.learner for f in self.sim.failures if f.duration is None]
        if leaves and not self.shared_budget:
            raise ValueError(
                f"sim.failures: learner {leaves[0]} leaves for good (no duration), which needs a "
                "shared budget (budget.shared, decoupled mode): its even share would never be "
                "trained"
            )
        self._check_slots()
        started = self.pipeline.learners_started
        if started is not None and started > m:
            raise ValueError(f"pipeline.learners_started {started} exceeds the {m} learner slots")
        if started is not None and started < m and not self.shared_budget:
            raise ValueError(
                f"pipeline.learners_started {started} < {m} slots needs a shared budget "
                "(budget.shared, decoupled mode): an even share per slot would wait forever "
                "for slots no machine joins"
            )
        if self.topology.quorum is not None and self.topology.quorum > m:
            raise ValueError(f"topology.quorum {self.topology.quorum} exceeds learners {m}")
        if self.topology.quorum_share is not None:
            if self.topology.quorum is not None:
                raise ValueError(
                    "set topology.quorum (a fixed K) or topology.quorum_share (K follows the "
                    "members), not both"
                )
            if self.mode != "decoupled":
                raise ValueError(
                    f"topology.quorum_share is for decoupled mode; {self.mode} merges "
                    + ("every learner's contribution (K = M)" if self.mode == "diloco" else
                       "nothing (data-parallel)")
                )  # fmt: skip
        return self

    def _check_slots(self) -> None:
        """Each ``sim.joins`` entry finds its slot vacant (never started, or left and not
        joined since), or adds the next learner beyond the run's slots (as ``diloco join``
        does when none is vacant: only a run that takes its data in units, which no slot
        owns); each failure finds its learner there."""
        m, n = self.topology.learners, self.pipeline.learners_started
        vacant = set(range(m)) - set(range(n or m))
        down: set[int] = set()
        added = m  # the index the next learner added takes
        for at, _, kind, i, _ in sim_events(self.sim):
            if kind == "join" and i == added:
                if self.data.assign == "slots":  # ('auto' is settled with the data)
                    raise ValueError(
                        f"sim.joins: learner {i} is beyond the run's {m} slots: learners are "
                        "added only to a run that takes its data in units (data.assign = "
                        "'units'); a slot's dealt share cannot grow"
                    )
                added += 1
            elif kind == "join":
                if i not in vacant:
                    why = ("down, to come back" if i in down else "held" if i < added
                           else f"beyond the slots; the next one added is {added}")  # fmt: skip
                    raise ValueError(f"sim.joins: slot {i} is not vacant at {at:g} ({why})")
                vacant.discard(i)
            elif kind == "back":
                down.discard(i)
            elif i in vacant or i in down or i >= added:
                raise ValueError(f"sim.failures: learner {i} is not there at {at:g}")
            else:
                (vacant if kind == "leave" else down).add(i)

    def started_learners(self, learners: list[str]) -> list[str]:
        """Of the run's learner slots (ids), those diloco train starts itself
        (``pipeline.learners_started``: the first N by index)."""
        n = self.pipeline.learners_started
        return list(learners) if n is None else sorted(learners, key=learner_index)[:n]

    @property
    def speeds(self) -> tuple[float, ...]:
        """Each learner's step-time factor (``pipeline.speeds``; 1.0 each when unset)."""
        return self.pipeline.speeds or (1.0,) * self.topology.learners

    def slowdown(self, learner: int) -> float:
        """How many times its own measured compute a step of ``learner`` takes on the wall
        clock: its factor relative to the fastest learner's (real hardware can be slowed,
        not sped up, so the fastest runs as it is and ``[0.5, 1]`` means ``[1, 2]``)."""
        return self.speed(learner) / min(self.speeds)

    def speed(self, learner: int) -> float:
        """Learner ``learner``'s step-time factor: ``speeds``, 1.0 for one added beyond
        the run's slots (``diloco join``, ``sim.joins``)."""
        return self.speeds[learner] if learner < len(self.speeds) else 1.0

    @property
    def kept_versions(self) -> int:
        """Global versions retention keeps per fragment: ``pipeline.keep_versions``, and
        never fewer than the run needs (``outer.max_staleness + 2``)."""
        return max(self.pipeline.keep_versions or 0, self.outer.max_staleness + 2)

    @property
    def quorum(self) -> int:
        """Effective K with every slot a member: all learners in synchronous DiLoCo, else
        the configured one (``member_quorum`` over the members of the moment)."""
        return self.quorum_over(self.topology.learners)

    def quorum_over(self, members: int) -> int:
        """K when ``members`` learners are members: the one rule the syncers merge by."""
        m, topo = self.topology.learners, self.topology
        if self.mode == "diloco":
            return member_quorum(m, members)
        return member_quorum(topo.quorum or max(1, m // 2), members, topo.quorum_share,
                             topo.quorum_floor)  # fmt: skip

    @property
    def tokens_per_step(self) -> int:
        """Tokens one learner consumes per inner step."""
        return self.data.batch_size * self.model.context

    @property
    def steps_per_learner(self) -> int:
        """Inner steps of each learner's even share of the budget (rounded up): what each
        trains when the budget is not shared, and the horizon of the inner learning-rate
        schedule either way."""
        return max(1, -(-self.budget.tokens // (self.tokens_per_step * self.topology.learners)))

    @property
    def shared_budget(self) -> bool:
        """Whether learners train until the run's budget is spent (``budget.shared``, in
        decoupled mode) rather than each its even share."""
        return self.budget.shared and self.mode == "decoupled"

    @property
    def budget_steps(self) -> int:
        """The run's inner steps over all learners."""
        return self.steps_per_learner * self.topology.learners

    @property
    def learner_step_cap(self) -> int:
        """The most inner steps one learner takes: its share, or, sharing the budget, the
        whole of it (one learner left alone trains it all)."""
        return self.budget_steps if self.shared_budget else self.steps_per_learner


# Presets: model size and a token budget that suits it. Everything else keeps its default.
PRESETS: dict[str, dict[str, Any]] = {
    # < 1 M parameters: tests, CI and the README's quick start (seconds on 2 CPU cores).
    "tiny": {
        "model": {"width": 64, "depth": 2, "heads": 4, "context": 64},
        "data": {"batch_size": 8, "eval_batches": 4},
        "inner": {"warmup_steps": 10},
        "topology": {"inner_steps": 10},
        "budget": {"tokens": 160_000},
        "sim": {"eval_points": 5},
    },
    # ~2 M parameters: the benchmark default on CPU.
    "small": {
        "model": {"width": 192, "depth": 4, "heads": 6, "context": 128},
        "data": {"batch_size": 8, "eval_batches": 16},
        "topology": {"inner_steps": 40, "fragments": 4},
        "budget": {"tokens": 1_200_000},
        "sim": {"eval_points": 12},
    },
    # GPU-sized presets, for long runs: hundreds of outer steps per fragment, where outer
    # Nesterov momentum beats the plain averaging that wins short runs
    # (bench/quality/results.md, "At a budget where dp flattens").
    "base": {
        "model": {"width": 512, "depth": 8, "heads": 8, "context": 512},
        "data": {"batch_size": 32},
        "outer": {"lr": 0.9, "momentum": 0.5},
        "topology": {"inner_steps": 100, "fragments": 4},
        "budget": {"tokens": 500_000_000},
    },
    "large": {
        "model": {"width": 1024, "depth": 16, "heads": 16, "context": 1024},
        "data": {"batch_size": 32},
        "outer": {"lr": 0.9, "momentum": 0.5},
        "topology": {"inner_steps": 250, "fragments": 8},
        "budget": {"tokens": 5_000_000_000},
    },
    # Llama-class decoders (diloco/llama.py) over subword tokens. llama-tiny trains in
    # minutes on 2 CPU cores; its vocabulary is `diloco data prepare`'s default (4096).
    "llama-tiny": {
        "model": {
            "arch": "llama",
            "vocab_size": 4096,
            "width": 128,
            "depth": 4,
            "heads": 4,
            "kv_heads": 2,
            "hidden": 352,
            "context": 128,
        },
        "data": {"batch_size": 8, "eval_batches": 8},
        "inner": {"warmup_steps": 20},
        "topology": {"inner_steps": 20, "fragments": 2},
        "budget": {"tokens": 2_000_000},
        "sim": {"eval_points": 8},
    },
    # GPU presets: bf16 compute, fp32 master weights; about 20 tokens per parameter.
    "llama-150m": {
        "model": {
            "arch": "llama",
            "vocab_size": 32768,
            "width": 1024,
            "depth": 12,
            "heads": 16,
            "kv_heads": 4,
            "hidden": 2560,
            "context": 2048,
            "compute_dtype": "bfloat16",
        },
        "data": {"batch_size": 16},
        "inner": {"lr": 1e-3, "warmup_steps": 500},
        "outer": {"lr": 0.9, "momentum": 0.5},
        "topology": {"inner_steps": 100, "fragments": 4},
        "budget": {"tokens": 3_000_000_000},
    },
    # Llama-3.2-1B's shapes (1.24 B parameters, tied head), trained at context 2048.
    "llama-1b": {
        "model": {
            "arch": "llama",
            "vocab_size": 128256,
            "width": 2048,
            "depth": 16,
            "heads": 32,
            "kv_heads": 8,
            "hidden": 8192,
            "context": 2048,
            "rope_theta": 500000.0,
            "compute_dtype": "bfloat16",
            "remat": True,
        },
        "data": {"batch_size": 8},
        "inner": {"lr": 4e-4, "warmup_steps": 1000},
        "outer": {"lr": 0.9, "momentum": 0.5},
        "topology": {"inner_steps": 250, "fragments": 8},
        "budget": {"tokens": 25_000_000_000},
    },
    # Llama-3-8B's shapes (8.0 B parameters, untied head): shard it over a learner's
    # devices (`diloco plan memory --preset llama-8b --devices 8`).
    "llama-8b": {
        "model": {
            "arch": "llama",
            "vocab_size": 128256,
            "width": 4096,
            "depth": 32,
            "heads": 32,
            "kv_heads": 8,
            "hidden": 14336,
            "context": 2048,
            "rope_theta": 500000.0,
            "compute_dtype": "bfloat16",
            "remat": True,
            "tie_embeddings": False,
        },
        "data": {"batch_size": 8},
        "inner": {"lr": 3e-4, "warmup_steps": 2000},
        "outer": {"lr": 0.9, "momentum": 0.5},
        "topology": {"inner_steps": 500, "fragments": 16},
        "budget": {"tokens": 160_000_000_000},
    },
}


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_override(text: str) -> dict[str, Any]:
    """``"outer.lr=0.5"`` -> ``{"outer": {"lr": 0.5}}``; values are JSON when they parse."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.path=value")
    path, raw = text.split("=", 1)
    try:
        value: Any = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    keys = [k for k in path.strip().split(".") if k]
    if not keys:
        raise ConfigError(f"override {text!r} has an empty key")
    for key in reversed(keys):
        value = {key: value}
    return value


def read_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    try:
        if path.suffix == ".json":
            return json.loads(text)
        return tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path} is malformed: {exc}") from exc


def load_config(
    preset: str | None = "tiny",
    file: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    base: dict[str, Any] | None = None,
    **top: Any,
) -> RunConfig:
    """``base`` (a stored run's config), then the preset, then the file, then ``key=value``
    overrides, then keyword fields, later wins."""
    raw: dict[str, Any] = dict(base or {})
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        raw = deep_merge(raw, PRESETS[preset])
    if file is not None:
        raw = deep_merge(raw, read_config_file(file))
    for text in overrides:
        raw = deep_merge(raw, parse_override(text))
    raw = deep_merge(raw, {k: v for k, v in top.items() if v is not None})
    return validate_config(raw)


def validate_config(raw: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "config"
            problems.append(f"config field '{where}': {err['msg']}")
        raise ConfigError("; ".join(problems)) from None
