"""The run's config (``RunConfig``: its sections, their checks across sections) and its
loading: a preset, files (TOML or JSON) and `key=value` overrides."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from diloco.config.base import ConfigError, Fraction, PositiveFloat, PositiveInt, Strict
from diloco.config.cost import CostConfig
from diloco.config.model import ModelConfig
from diloco.config.pipeline import LivenessConfig, PipelineConfig
from diloco.config.presets import PRESETS
from diloco.config.sim import SimConfig, sim_events
from protocol.topology import learner_index, member_quorum


class DataConfig(Strict):
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


class InnerConfig(Strict):
    """The inner optimizer (AdamW, or Muon on the matrices) with linear warm-up, cosine
    decay and global-norm clipping."""

    optimizer: Literal["adamw", "muon"] = Field(
        "adamw",
        description="the inner optimizer (diloco.inner.INNER_OPTIMIZERS): adamw, or muon "
        "(MuLoCo, arXiv 2505.23725: Muon's orthogonalized momentum on the hidden matrices, "
        "AdamW on embeddings, the output head, norms and biases; its updates scaled to "
        "AdamW's RMS, so lr carries over)",
    )
    lr: PositiveFloat = Field(3e-3, description="peak learning rate (after the warm-up)")
    min_lr_ratio: Fraction = Field(
        0.1, description="learning rate at the end of the cosine decay, as a share of lr"
    )
    warmup_steps: Annotated[int, Field(ge=0)] = Field(50, description="linear warm-up steps")
    weight_decay: Annotated[float, Field(ge=0)] = Field(
        0.1, description="AdamW weight decay (matrices only, not norms or biases)"
    )
    b1: Fraction = Field(0.9, description="AdamW beta1 (first-moment decay); Muon's momentum")
    b2: Fraction = Field(0.95, description="AdamW beta2 (second-moment decay)")
    clip_norm: PositiveFloat = Field(1.0, description="clip gradients to this global L2 norm")


StalenessName = Literal["constant", "polynomial", "exponential", "hinge"]
QuantName = Literal["fp32", "bf16", "int8", "int4"]
MergeName = Literal["mean", "rda", "heloco"]  # diloco.merge.MERGE_RULES


class OuterConfig(Strict):
    """Syncer side: staleness weighting, merge rule, outer Nesterov SGD."""

    # docs/algorithm.md: with tens of outer steps per fragment plain averaging beat every
    # momentum tried; the GPU presets (hundreds of outer steps) use Nesterov 0.9 / 0.5.
    lr: PositiveFloat = Field(1.0, description="outer learning rate (1 with momentum 0: averaging)")
    momentum: Annotated[float, Field(ge=0, lt=1)] = Field(
        0.0, description="outer SGD momentum; 0: none"
    )
    nesterov: bool = Field(True, description="Nesterov momentum (when momentum > 0)")
    optimizer: Literal["sgd", "adam", "cgad"] = Field(
        "sgd",
        description="the outer optimizer (diloco.outer.OUTER_OPTIMIZERS): sgd (lr, momentum, "
        "nesterov), adam (lr, adam_b1, adam_b2, adam_eps; its step count is the fragment's), "
        "or cgad: adam on outer gradients scaled by their age (cgad_alpha, cgad_cutoff)",
    )
    cgad_alpha: Annotated[float, Field(ge=0)] = Field(
        0.1, description="cgad: exp(-alpha s), the decay of a contribution s versions old"
    )
    cgad_cutoff: PositiveInt | None = Field(
        None,
        description="cgad: the age at which the cosine gate reaches 0; default max_staleness + 1",
    )
    adam_b1: Annotated[float, Field(ge=0, lt=1)] = Field(0.9, description="outer Adam's beta1")
    adam_b2: Annotated[float, Field(ge=0, lt=1)] = Field(0.999, description="outer Adam's beta2")
    adam_eps: PositiveFloat = Field(1e-8, description="outer Adam's epsilon")
    merge: MergeName = Field(
        "mean",
        description="how outer gradients combine: weighted mean, rda (radial-directional "
        "average per tensor, mean for embeddings), or heloco (each set against the outer "
        "momentum per tensor before the mean: heloco_*; needs an optimizer with momentum)",
    )
    # HeLoCo (arXiv 2606.00271); its paper's values were not found: ours, docs/algorithm.md.
    heloco_c_ok: Annotated[float, Field(ge=0, le=1)] = Field(
        0.2, description="heloco: an outer gradient this aligned with the momentum is kept"
    )
    heloco_k_s: Annotated[float, Field(ge=0)] = Field(
        1.0, description="heloco: how hard an opposed one's part against the momentum shrinks"
    )
    heloco_beta_max: Annotated[float, Field(ge=0, le=1)] = Field(
        1.0, description="heloco: the most of that part shrunk (1: all of it)"
    )
    heloco_k_d: Annotated[float, Field(ge=0)] = Field(
        1.0, description="heloco: how far a weakly aligned one turns towards the momentum"
    )
    heloco_kappa: Annotated[float, Field(ge=0)] = Field(
        1.0, description="heloco: the momentum's norm in the confidence |D| / (|D| + kappa |m|)"
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

    @model_validator(mode="after")
    def _momentum_for_heloco(self) -> OuterConfig:
        if self.merge == "heloco" and self.optimizer == "sgd" and self.momentum == 0:
            raise ValueError("outer.merge heloco sets each outer gradient against the outer "
                             "momentum: set outer.momentum above 0, or outer.optimizer adam "
                             "or cgad")  # fmt: skip
        return self


class TopologyConfig(Strict):
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


class BudgetConfig(Strict):
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


class RunConfig(Strict):
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
    cost: CostConfig = CostConfig()

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
