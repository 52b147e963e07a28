"""The learner loop and the syncer loop are the one program that the simulator, the tests
and the Prefect pipeline run. Only the clock and the transport differ.

Each loop is a generator that yields what it waits for:

- ``STEP``: an inner step is about to be computed. The simulator's scheduler advances
  this learner's virtual clock by its step time first (``pipeline.speeds`` times
  ``sim.step_seconds``); the wall-clock driver does nothing (the computation itself
  takes the time, and a learner's ``WallClock`` stretches it by the same factor).
- ``Wait(seconds)``: nothing to do for at most ``seconds`` (``math.inf``: until news).
  The simulator wakes the loop when something arrives for it or the time is up; the
  wall-clock driver sleeps ``min(seconds, poll)`` and lets the loop look again.

This module holds what both loops share: what they yield, the clocks and ``drive`` (the
wall-clock driver), the transports they are given and what those return. The rules each
loop applies live once, in ``diloco.learner_loop`` (``LearnerLoop``: when a learner
sends, takes a global version and checkpoints; how it starts or rejoins; the synchronous
wait) and ``diloco.syncer_loop`` (``SyncerLoop``: when a syncer merges, by quorum,
adaptive grace window and step-time estimate, and how a run ends). ``docs/algorithm.md``
says why each was chosen.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from diloco import records
from diloco.learner import LearnerCheckpoint
from diloco.outer import Contribution, FlatParams
from diloco.syncer import (
    GlobalVersion,
)


@dataclass(frozen=True)
class Step:
    """An inner step is about to be computed."""


@dataclass(frozen=True)
class Wait:
    """Nothing to do for at most ``seconds`` (``math.inf``: until something arrives)."""

    seconds: float


STEP = Step()
Request = Step | Wait
Emit = Callable[[records.Record], None]


class Clock(Protocol):
    def now(self) -> float: ...

    def stepped(self, started: float, result: Any) -> None:
        """An inner step that began at ``started`` (this clock's time) was dispatched;
        ``result`` is what it returns. A clock that emulates slower hardware stretches
        the step here; the simulator's does nothing (its scheduler charged the learner's
        step time, speed included, on ``STEP``)."""


class WallClock:
    """Unix time: records carry comparable times across processes and machines.

    ``slowdown`` > 1 emulates a chip that many times slower (``RunConfig.slowdown``, from
    ``pipeline.speeds``): each inner step is waited for and followed by a sleep of
    ``slowdown - 1`` times what it took. The sleep is inside the step time the loop
    measures, so the learner's step-time estimates, tokens/s and training time (and with
    it goodput) all show the slowed rate, as they would on the slower chip."""

    def __init__(self, slowdown: float = 1.0):
        self.slowdown = slowdown

    def now(self) -> float:
        return time.time()

    def stepped(self, started: float, result: Any) -> None:
        if self.slowdown <= 1.0:
            return  # no more waits: the next step is dispatched while this one runs
        ready = getattr(result, "block_until_ready", None)
        if ready is not None:
            ready()  # the step's compute, not only its dispatch
        time.sleep((self.slowdown - 1.0) * max(0.0, time.time() - started))


def drive(
    loop: Iterator[Request], poll_seconds: float, stop: Callable[[], bool] | None = None
) -> bool:
    """Run a loop on the wall clock: a step needs nothing, a wait sleeps at most
    ``poll_seconds`` (nothing tells another process that something arrived). Returns
    True when the loop ended, False when ``stop()`` said so first."""
    for request in loop:
        if stop is not None and stop():
            return False
        if isinstance(request, Wait):
            time.sleep(max(0.0, min(request.seconds, poll_seconds)))
    return True


@dataclass(frozen=True)
class GlobalView:
    """A global version of one fragment as a learner reads it (the wire dtype)."""

    fragment: int
    version: int
    params: FlatParams
    meta: Mapping[str, Any] = field(default_factory=dict)
    nbytes: int | None = None  # what reading it moved; None: the whole version, wire dtype

    @property
    def id(self) -> str | None:
        """Its ``records.version_id``, as its record holds it (None: one stored before)."""
        return records.ids_of(self.meta).get(self.version)


@dataclass(frozen=True)
class StoredFragment:
    """What a syncer restarts from: the newest committed version of its fragment (fp32
    master copy, outer optimizer state, the version record) and, for the anchored merge,
    the master copies of the versions inside the staleness window."""

    version: int
    params: FlatParams
    opt_leaves: list[Any]
    meta: Mapping[str, Any]
    history: dict[int, FlatParams] = field(default_factory=dict)
    # Newer versions that are committed but cannot be read at home (a damaged object):
    # the syncer goes on from ``version``, numbers its next one above them, and that one
    # records them as lost (their merges are void: what they merged is merged again).
    lost: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Unreadable:
    """A committed contribution that cannot be read (corrupt, partial, forged marker).
    ``forged``: not written by its learner (its signature does not verify), so it must not
    move the syncer past that learner's real contributions."""

    learner: str
    fragment: int
    seq: int
    reason: str
    forged: bool = False


@dataclass(frozen=True)
class Superseded:
    """A committed contribution whose data is never read: a newer one from the same
    anchor, listed with it, carries all its steps (sends from one anchor are cumulative)."""

    learner: str
    fragment: int
    seq: int
    by: int


class LearnerTransport(Protocol):
    """How one learner's contributions leave and global versions arrive."""

    def send(self, c: Contribution) -> None: ...

    def want(self, fragment: int, above: int) -> None:
        """A hint: a version of ``fragment`` newer than ``above`` answers a send."""

    def backed_up(self) -> bool:
        """Whether more sends wait unwritten than the transport's bound allows (its
        region's disk is full, its uploads fail and back off): the learner takes no step
        until they drain (``LearnerLoop.run``, backpressure)."""

    def latest_global(self, fragment: int) -> GlobalView | None:
        """The newest version of ``fragment`` this learner can read now."""

    def save_checkpoint(self, ckpt: LearnerCheckpoint) -> None: ...

    def load_checkpoint(self) -> LearnerCheckpoint | None: ...

    def sent_so_far(self) -> tuple[int, int]:
        """(the seq this learner continues after, the step of its newest committed send).
        The seq is at least its newest committed one; a store whose listings can lag
        reserves the numbers above it here, for this process only."""


class SyncerTransport(Protocol):
    """How a syncer reads contributions and publishes versions."""

    def contributions(
        self, learner: str, fragment: int, after: int
    ) -> list[Contribution | Unreadable]:
        """Committed (and arrived) contributions with seq > ``after``, in seq order; they
        may be headers (``payload`` None) that ``read`` completes."""

    def read(self, c: Contribution) -> Contribution | Unreadable:
        """``c`` with its payload (itself if it has one), or ``Unreadable``; an
        ``OSError`` when it cannot be read yet."""

    def publish(self, gv: GlobalVersion, opt_leaves: list[Any], record: records.Record) -> bool:
        """Commit ``gv``; False if another syncer already holds that version."""

    def load_fragment(self, fragment: int, window: int) -> StoredFragment: ...

    def delivery_seconds(self, fragment: int) -> float:
        """Expected time for a published version to reach the learners."""

    def learners_finished(self, budget_spent: bool = False) -> bool:
        """Every learner is done and all its contributions are readable. ``budget_spent``:
        the run's shared budget is trained, so a learner slot no one holds (never
        started, or left) is finished too: no one will train in it."""

    def members(self) -> Collection[str]:
        """The learners counted towards the quorum now (``member_quorum``): the run's
        learners less those known to be gone."""

    def tend(self) -> None:
        """Housekeeping between two looks (catch up lagging regions, retention)."""


def nothing(record: records.Record) -> None:
    pass
