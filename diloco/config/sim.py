"""The simulator's settings (``sim.*``): its clock, failures and joins."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from diloco.config.base import Fraction, PositiveFloat, PositiveInt, Strict


class Failure(Strict):
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


class Join(Strict):
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


class SimConfig(Strict):
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
