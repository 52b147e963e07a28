"""How a launch runs the pipeline (``pipeline.*``) and when a learner counts as silent or
lagging (``liveness.*``): settings of a launch, not of the run's math."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from diloco.config.base import PositiveFloat, PositiveInt, Strict


class LivenessConfig(Strict):
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


class PipelineConfig(Strict):
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
    sinks: tuple[Literal["wandb", "mlflow"], ...] = Field(
        (),
        description="where the launcher sends the live metrics besides TensorBoard "
        "(flows.sinks): wandb, mlflow (the extras of the same names); each set up by its own "
        "environment (WANDB_PROJECT, WANDB_MODE, MLFLOW_TRACKING_URI, ...)",
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
        description="worker processes kept warm ahead of need (model built, step compiled) "
        "for a restarted worker to take over; 0: none (every worker is forked from the "
        "launcher's zygote, imports done, and warms up as it starts)",
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
