"""Typed run configuration: presets, files (TOML or JSON) and `key=value` overrides.

Every config is a frozen pydantic model that forbids unknown fields, so a typo or a
wrong value fails at load time with the dotted name of the field
(``config field 'outer.lr': Input should be greater than 0``).
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
Fraction = Annotated[float, Field(ge=0, le=1)]


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    """Decoder-only transformer over bytes."""

    vocab_size: PositiveInt = 256
    width: PositiveInt = 64
    depth: PositiveInt = 2
    heads: PositiveInt = 4
    context: PositiveInt = 64
    mlp_ratio: PositiveInt = 4

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not divisible by heads {self.heads}")
        return self


class DataConfig(_Strict):
    """Where tokens come from. ``source=None`` is the Python standard library's .py files."""

    source: str | None = None
    batch_size: PositiveInt = 8  # sequences per learner per inner step
    val_percent: Annotated[int, Field(ge=1, le=50)] = 5  # share of files held out
    eval_batches: PositiveInt = 8  # validation batches per evaluation


class InnerConfig(_Strict):
    """AdamW with linear warm-up, cosine decay and global-norm clipping."""

    lr: PositiveFloat = 3e-3
    min_lr_ratio: Fraction = 0.1
    warmup_steps: Annotated[int, Field(ge=0)] = 50
    weight_decay: Annotated[float, Field(ge=0)] = 0.1
    b1: Fraction = 0.9
    b2: Fraction = 0.95
    clip_norm: PositiveFloat = 1.0


StalenessName = Literal["constant", "polynomial", "exponential", "hinge"]
QuantName = Literal["fp32", "bf16", "int8", "int4"]


class OuterConfig(_Strict):
    """Syncer side: staleness weighting, merge rule, outer Nesterov SGD."""

    # docs/algorithm.md: with tens of outer steps per fragment plain averaging beat every
    # momentum tried; the GPU presets (hundreds of outer steps) use Nesterov 0.9 / 0.5.
    lr: PositiveFloat = 1.0
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.0
    nesterov: bool = True
    merge: Literal["mean", "rda"] = "mean"
    reference: Literal["delta", "anchored"] = "anchored"  # docs/algorithm.md: best with stale work
    staleness: StalenessName = "polynomial"
    staleness_a: PositiveFloat = 0.5  # polynomial exponent, or hinge slope
    staleness_b: Annotated[float, Field(ge=0)] = 1.0  # hinge knee
    staleness_lambda: PositiveFloat = 0.5  # exponential rate
    max_staleness: Annotated[int, Field(ge=0)] = 8
    max_norm: PositiveFloat = 1e3  # reject outer gradients with a larger global L2 norm
    # Reject one whose norm per inner step is this many times the median of the fragment's
    # recent accepted ones (a learner gone wrong, or a forged update); 0 turns it off.
    max_norm_ratio: Annotated[float, Field(ge=0)] = 10.0


class TopologyConfig(_Strict):
    """Learners, fragments and the sync schedule (the knobs of ALGORITHM.md)."""

    learners: PositiveInt = 4  # M
    fragments: PositiveInt = 2  # P
    fragment_strategy: Literal["balanced", "strided", "sequential"] = "balanced"
    inner_steps: PositiveInt = 20  # H: inner steps between two syncs of one fragment
    tau: Annotated[int, Field(ge=0)] = 2  # apply a global no earlier than tau steps after sending
    alpha: Annotated[float, Field(ge=0, lt=1)] = 0.0  # blend: theta <- a*theta + (1-a)*global
    # Instead of the blend, re-apply on top of the new global the local steps taken since
    # the send it answers; they travel in the next contribution instead of being overwritten.
    keep_unsent: bool = True
    quorum: PositiveInt | None = None  # K; None = M for diloco, max(1, M // 2) for decoupled
    grace: Annotated[float, Field(ge=0, lt=1)] = 0.5  # gamma of the adaptive grace window
    quantization: QuantName = "int4"
    block_size: PositiveInt = 128
    error_feedback: bool = False
    global_dtype: Literal["fp32", "bf16"] = "bf16"  # how globals travel to learners


class Failure(_Strict):
    """Learner ``learner`` is down from ``at`` to ``at + duration`` (fractions of the run's tokens)."""

    learner: Annotated[int, Field(ge=0)]
    at: Fraction
    duration: Fraction


class BudgetConfig(_Strict):
    """How long a run trains: the simulator and the pipeline read the same budget."""

    tokens: PositiveInt = 400_000  # over all learners; each does tokens / M of it


class SimConfig(_Strict):
    """The simulated clock and network of `diloco simulate`."""

    step_seconds: PositiveFloat = 1.0  # simulated time of one inner step at speed 1
    # (``sim.speeds`` is the old name of ``pipeline.speeds``: still read, moved there.)
    failures: tuple[Failure, ...] = ()
    bandwidth_gbps: PositiveFloat = 1.0  # per learner, between its region and the syncer
    latency_seconds: Annotated[float, Field(ge=0)] = 0.05
    eval_points: PositiveInt = 10  # evaluations of the global model over the run


class PipelineConfig(_Strict):
    """How learners and syncers run (not part of the run spec: these may change between
    two launches of one run). The simulator reads ``checkpoint_every``,
    ``syncer_shards`` and ``speeds`` too; the rest is for `diloco train`'s Prefect flows."""

    # Per-learner slowdown factors, one per learner (2.0 = a chip twice as slow); empty:
    # all alike. The simulator's learner m takes speeds[m] * sim.step_seconds per step; a
    # learner of `diloco train` sleeps to emulate the slower chip (``RunConfig.slowdown``).
    # The hardware of a launch, not of the run: it may change between two launches.
    speeds: tuple[PositiveFloat, ...] = ()
    checkpoint_every: PositiveInt = 50  # inner steps between learner checkpoints
    round_steps: PositiveInt = 50  # inner steps per round (one Prefect task run)
    rounds_per_flow_run: PositiveInt = 20  # a learner flow run ends after this many rounds
    versions_per_flow_run: PositiveInt = 200  # a syncer flow run ends after this many publishes
    # Global versions kept per fragment (at least max_staleness + 2); older ones and the
    # contributions merged into them are deleted as the run goes.
    keep_versions: PositiveInt = 100
    syncer_shards: PositiveInt = 2  # syncer processes; shard s owns fragments p with p % S == s
    poll_seconds: PositiveFloat = 0.2  # how often learners and syncers list the buckets
    # A crashed worker is started again for as long as the run lasts; one that fails this
    # many starts in a row without progress (a crash loop) is given up, by name.
    max_failed_starts: PositiveInt = 5
    # Worker processes kept started ahead of need, their slow imports (JAX, Prefect) done:
    # a restarted worker takes one and skips seconds of start-up. 0: start each cold.
    spares: Annotated[int, Field(ge=0)] = 1
    eval_seconds: PositiveFloat = 10.0  # the launcher evaluates the newest globals this often
    upload_retries: Annotated[int, Field(ge=0)] = 5  # per contribution, with backoff
    stall_seconds: PositiveFloat = 120.0  # a learner says so when no awaited version came
    # Before a run starts, check that every bucket refuses a second exclusive create.
    probe_exclusive: bool = True
    # Failure on purpose (docs/chaos.md), for `diloco train`'s local workers: a storage
    # fault plan (the fields of storage_layout.faults.FaultPlan) and a process chaos plan
    # (infra.chaos.ChaosPlan). Empty: none. Checked before the run starts.
    faults: dict[str, Any] = {}
    chaos: dict[str, Any] = {}


class RunConfig(_Strict):
    seed: int = 0
    mode: Literal["dp", "diloco", "decoupled"] = "decoupled"
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    inner: InnerConfig = InnerConfig()
    outer: OuterConfig = OuterConfig()
    topology: TopologyConfig = TopologyConfig()
    budget: BudgetConfig = BudgetConfig()
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
        for f in self.sim.failures:
            if f.learner >= m:
                raise ValueError(f"sim.failures names learner {f.learner}, run has {m}")
        if self.topology.quorum is not None and self.topology.quorum > m:
            raise ValueError(f"topology.quorum {self.topology.quorum} exceeds learners {m}")
        return self

    @property
    def speeds(self) -> tuple[float, ...]:
        """Each learner's step-time factor (``pipeline.speeds``; 1.0 each when unset)."""
        return self.pipeline.speeds or (1.0,) * self.topology.learners

    def slowdown(self, learner: int) -> float:
        """How many times its own measured compute a step of ``learner`` takes on the wall
        clock: its factor relative to the fastest learner's (real hardware can be slowed,
        not sped up, so the fastest runs as it is and ``[0.5, 1]`` means ``[1, 2]``)."""
        return self.speeds[learner] / min(self.speeds)

    @property
    def quorum(self) -> int:
        """Effective K: all learners in synchronous DiLoCo, else the configured one."""
        m = self.topology.learners
        if self.mode == "diloco":
            return m
        return self.topology.quorum or max(1, m // 2)

    @property
    def tokens_per_step(self) -> int:
        """Tokens one learner consumes per inner step."""
        return self.data.batch_size * self.model.context

    @property
    def steps_per_learner(self) -> int:
        """Inner steps of each learner: the token budget dealt evenly (rounded up)."""
        return max(1, -(-self.budget.tokens // (self.tokens_per_step * self.topology.learners)))


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
    **top: Any,
) -> RunConfig:
    """Preset, then file, then ``key=value`` overrides, then keyword fields, later wins."""
    raw: dict[str, Any] = {}
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
