"""The learner loop and the syncer loop: the one program that the simulator, the tests
and the Prefect pipeline run. Only the clock and the transport differ.

Each loop is a generator that yields what it waits for:

- ``STEP``: an inner step is about to be computed. The simulator's scheduler advances
  this learner's virtual clock by its step time first (``pipeline.speeds`` times
  ``sim.step_seconds``); the wall-clock driver does nothing (the computation itself
  takes the time, and a learner's ``WallClock`` stretches it by the same factor).
- ``Wait(seconds)``: nothing to do for at most ``seconds`` (``math.inf``: until news).
  The simulator wakes the loop when something arrives for it or the time is up; the
  wall-clock driver sleeps ``min(seconds, poll)`` and lets the loop look again.

The rules each loop applies live here once: when a learner sends, takes a global
version and checkpoints; how it starts or rejoins (``LearnerLoop.start``); the
synchronous wait; when a syncer merges (quorum, adaptive grace window, step-time
estimate) and how a run ends. ``docs/algorithm.md`` says why each was chosen.
"""

from __future__ import annotations

import logging
import math
import time
from collections import ChainMap
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from diloco import records
from diloco.config import RunConfig
from diloco.data import ShardReader
from diloco.fragments import FragmentPlan
from diloco.inner import InnerTrainer
from diloco.learner import Learner, LearnerCheckpoint
from diloco.model import is_embedding
from diloco.outer import Contribution, FlatParams
from diloco.syncer import (
    FragmentSyncer,
    GlobalVersion,
    estimate_step_seconds,
    grace_window,
)
from diloco.syncer import budget_spent as _budget_spent
from diloco.syncer import quorum_met as _quorum_met
from diloco.tensors import as_tensors, full_bytes

log = logging.getLogger(__name__)


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


def _nothing(record: records.Record) -> None:
    pass


def resume_step(checkpoint_step: int, sent_step: int) -> int:
    """Where a learner (re)starts: the later of its newest checkpoint's step (0: none)
    and its newest committed send's (``LearnerLoop.start``); its data position too."""
    return max(checkpoint_step, sent_step)


class LearnerLoop:
    """One learner: inner steps, a contribution when a fragment is due, global versions
    taken in answer to its own sends (after tau steps), checkpoints every
    ``pipeline.checkpoint_every`` steps and when its budget is done."""

    def __init__(
        self,
        learner: Learner,
        cfg: RunConfig,
        transport: LearnerTransport,
        clock: Clock,
        emit: Emit = _nothing,
        logger: Any = log,
    ):
        self.learner = learner
        self.cfg = cfg
        self.transport = transport
        self.clock = clock
        self.emit = emit
        self.log = logger
        self.total_steps = cfg.steps_per_learner  # its even share of the budget
        self.cap = cfg.learner_step_cap  # the most it trains (sharing the budget: all of it)
        self.sync = cfg.mode == "diloco"
        self.losses: list[Any] = []  # device scalars of the current ``run`` call
        # When the step under way started (its time is measured from there); None when
        # no ``run`` call's steps are left untimed.
        self._mark: float | None = None

    @classmethod
    def start(
        cls,
        learner_id: str,
        trainer: InnerTrainer,
        plan: FragmentPlan,
        reader: ShardReader,
        cfg: RunConfig,
        transport: LearnerTransport,
        clock: Clock,
        emit: Emit = _nothing,
        logger: Any = log,
    ) -> tuple[LearnerLoop, str]:
        """Start or rejoin: the one policy for a fresh learner, a restarted process and a
        simulated failure. Returns the loop and where it resumed from.

        Parameters come from the newest global version of every fragment; the inner
        optimizer state from the newest checkpoint, if any. The step (and with it the data
        position) is the later of the checkpoint's and the newest committed send's, so
        work already sent is never trained and merged again, and sequence numbers are
        never reused. What was trained but not sent since then is lost (at most one
        checkpoint interval)."""
        newest: dict[int, GlobalView] = {}
        for p in range(len(plan)):
            view = transport.latest_global(p)
            if view is None:
                raise FileNotFoundError(f"no global version of fragment {p} to start from")
            newest[p] = view
        ckpt = transport.load_checkpoint()
        seq, sent_step = transport.sent_so_far()
        # Read as placed, a tensor at a time (a spilled version is never whole in memory).
        init = ChainMap(*[g.params for g in reversed(newest.values())])
        learner = Learner(learner_id, trainer, plan, cfg.topology, init, reader)
        step = resume_step(ckpt.step if ckpt else 0, sent_step)
        learner.resume(step, max(seq, ckpt.seq if ckpt else 0), ckpt.opt_state if ckpt else None)
        for p, g in newest.items():  # new anchors: nothing before the failure continues
            learner.fragments[p].base_version = g.version
            learner.fragments[p].anchor_seq = learner.seq
        versions = [g.version for g in newest.values()]
        if ckpt is None and step == 0:
            source = f"global versions {versions}"
        else:
            what = f"checkpoint at step {ckpt.step}" if ckpt else "no checkpoint"
            source = f"{what} and sends up to step {sent_step} (global versions {versions})"
        return cls(learner, cfg, transport, clock, emit, logger), source

    @property
    def finished(self) -> bool:
        """Its share trained, or, sharing the budget, the run's budget trained by all."""
        return self._finished(self.run_steps() if self.cfg.shared_budget else 0)

    def _finished(self, run_steps: int) -> bool:
        """``finished``, given ``run_steps()`` as just read."""
        if self.learner.step >= self.cap:
            return True
        return self.cfg.shared_budget and run_steps >= self.cfg.budget_steps

    def run_steps(self) -> int:
        """The inner steps the learners have taken together, as far as this one knows: its
        own, and each other's newest merged step that the global versions it holds report
        (``FragmentSyncer.progress``). Behind the truth by a round trip at most, never
        ahead of it, so a shared budget is never cut short."""
        steps: dict[str, int] = {}
        for p in range(len(self.learner.fragments)):
            view = self.transport.latest_global(p)
            for learner, step in (view.meta.get("progress", {}) if view else {}).items():
                steps[learner] = max(steps.get(learner, 0), min(int(step), self.cap))
        steps[self.learner.id] = self.learner.step
        return sum(steps.values())

    def position(self, run_steps: int | None = None) -> float:
        """Where this learner stands on the inner decay schedule: its own step, or, sharing
        the budget, the run's steps per learner (``run_steps()``, or the value given), so
        that learners of different speeds (or restarted, or killed more often) decay
        together and reach the end of the schedule as the budget ends, not each at the end
        of an even share."""
        if not self.cfg.shared_budget:
            return self.learner.step
        known = self.run_steps() if run_steps is None else run_steps
        return known / self.cfg.topology.learners

    def lr(self) -> float:
        """The inner learning rate of its next step."""
        return self.learner.trainer.lr(self.learner.opt_state, self.position())

    def run(self, steps: int | None = None) -> Iterator[Request]:
        """At most ``steps`` more inner steps (until it is finished by default)."""
        lrn = self.learner
        # The run's steps, read once a step (every fragment's newest version, a listing
        # each over a bucket store): the end of a step's look serves the next step's rate.
        look = self.run_steps if self.cfg.shared_budget else lambda: 0
        known = look()
        left = 0 if self._finished(known) else self.cap - lrn.step
        self.losses = []
        self._mark = self.clock.now()
        for _ in range(min(left, steps if steps is not None else left)):
            if self.transport.backed_up():
                yield from self._wait_for_room()
                known = look()
                if self._finished(known):  # the others trained the budget meanwhile
                    self.send_pending()
                    self.transport.save_checkpoint(lrn.checkpoint())
                    self._mark = None
                    return
            yield STEP
            now = self.clock.now()
            # Time since the previous step started, less any wait: the simulator's step
            # time exactly; on the wall clock, the device's time too, as each step waits
            # for the one before it (``Learner.train_step``: one step in flight).
            seconds, self._mark = now - self._mark, now
            loss = lrn.train_step(seconds, self.position(known))
            self.clock.stepped(now, loss)  # where a slowed learner's wall clock sleeps
            self.losses.append(loss)
            self.deliver()
            p = lrn.due()
            if p is not None:
                self.send(p, loss)
            known = look()
            done = self._finished(known)  # once: a shared budget's end may come at any moment
            if done:  # the steps no send has carried yet go too, not lost with the end
                self.send_pending()
            if lrn.step % self.cfg.pipeline.checkpoint_every == 0 or done:
                self.transport.save_checkpoint(lrn.checkpoint())
            if done:
                self._mark = None
                return
            if self.sync:
                yield from self._wait_for_answers()
        self._settle()
        self._mark = None  # what comes until the next call is not training

    def _settle(self) -> None:
        """Wait for the step still in flight and give the time since the last step's start
        to the fragments: each step is timed at the next one's start, so the device time
        of a call's last step came after every mark (the simulator's clock: nothing)."""
        self.learner.wait_in_flight()
        if self._mark is not None:
            now = self.clock.now()
            self.learner.add_seconds(now - self._mark)
            self._mark = now

    def send_pending(self) -> list[int]:
        """Before this learner leaves (preempted, or its budget done): send every
        fragment holding steps that no send has carried yet, so that nothing it trained
        is lost; a rejoining learner starts after them (``start``: the newest committed
        send's step). Returns the fragments sent. Sends from one anchor are cumulative:
        the syncer merges only what a fragment's earlier send from that anchor did not
        carry."""
        self._settle()  # the last steps' time goes with them
        lrn, sent = self.learner, []
        loss = self.losses[-1] if self.losses else float("nan")
        for p, frag in enumerate(lrn.fragments):
            if frag.steps > 0 and frag.sent_at_step != lrn.step:
                self.send(p, loss)
                sent.append(p)
        return sent

    def send(self, p: int, loss: Any) -> None:
        c = self.learner.contribute(p)
        self.transport.send(c)
        self.transport.want(p, c.base_version)
        self.emit(records.sent(c, self.clock.now(), float(loss), self.lr()))

    def deliver(self) -> int:
        """Apply every newer global that answers one of this learner's sends (tau steps
        after it); returns how many."""
        lrn, count = self.learner, 0
        for p, frag in enumerate(lrn.fragments):
            if not lrn.may_apply(p):
                continue
            view = self.transport.latest_global(p)
            if view is None or view.version <= frag.base_version:
                continue
            mine = [
                w for k, w in view.meta.get("weights", {}).items() if k.startswith(f"{lrn.id}/")
            ]
            nbytes = view.nbytes
            if nbytes is None:
                nbytes = full_bytes(view.params, self.cfg.topology.global_dtype)
            record = records.applied(
                lrn.id, p, view.version, view.version - frag.base_version, sum(mine), nbytes,
                self.clock.now(),
            )  # fmt: skip
            lrn.apply_global(p, view.version, view.params)
            self.emit(record)
            count += 1
        return count

    def _wait_for_answers(self) -> Iterator[Request]:
        """Synchronous DiLoCo: block until every overdue fragment's answer is applied."""
        started = noted = self.clock.now()
        while self.learner.waiting_on():
            self.deliver()
            if not self.learner.waiting_on():
                break
            yield Wait(math.inf)
            if self.clock.now() - noted > 60:
                noted = self.clock.now()
                self.log.info(
                    "learner %s still waiting for fragments %s (%.0f s)",
                    self.learner.id, self.learner.waiting_on(), noted - started,
                )  # fmt: skip
        self._mark += self.clock.now() - started  # waiting is not step time

    def _wait_for_room(self) -> Iterator[Request]:
        """Backpressure: while the transport holds more unwritten sends than its bound
        (a full disk), take no step. Work trained now would only wait behind them and
        arrive too stale, and steps that no other learner can see (none of their sends
        merged) overshoot a shared budget: the pause bounds both (``docs/algorithm.md``,
        "Backpressure"). Versions that arrive meanwhile are applied; the wait ends early
        when the others have trained the budget. Waiting is not step time."""
        started = self.clock.now()
        while self.transport.backed_up():
            self.deliver()
            if self.cfg.shared_budget and self._finished(self.run_steps()):
                break
            yield Wait(math.inf)
        self._mark += self.clock.now() - started

    def checkpoint(self) -> None:
        self.transport.save_checkpoint(self.learner.checkpoint())


@dataclass
class _MergeClock:
    first_arrival: float | None = None
    merge_at: float | None = None


def _implausible(seq: int, cfg: RunConfig) -> str:
    """A sequence number no learner can reach: it sends at most once per inner step."""
    return (f"seq {seq} is beyond the {cfg.learner_step_cap} inner steps a learner can take "
            "(at most one send per step): a forged or corrupt marker")  # fmt: skip


class SyncerLoop:
    """The syncer of a set of fragments: collect contributions, merge each fragment when
    its quorum is met and its grace window is over, publish, and end when every learner
    is done (a last merge of everything pending, with no grace: nothing more comes)."""

    def __init__(
        self,
        cfg: RunConfig,
        fragments: Sequence[int],
        learners: Sequence[str],
        transport: SyncerTransport,
        clock: Clock,
        emit: Emit = _nothing,
        logger: Any = log,
    ):
        self.cfg = cfg
        self.learners = list(learners)
        self.transport = transport
        self.clock = clock
        self.emit = emit
        self.log = logger
        self.gamma = 0.0 if cfg.mode == "diloco" else cfg.topology.grace
        self.syncers: dict[int, FragmentSyncer] = {}
        self.seen: dict[tuple[str, int], int] = {}  # (learner, fragment) -> newest seq read
        self.implausible: set[tuple[str, int, int]] = set()  # refused, reported once each
        self.clocks: dict[int, _MergeClock] = {}
        self.step_seconds: dict[int, float] = {}  # the last step-time estimate per fragment
        self.last: dict[int, Mapping[str, Any]] = {}  # the newest version's record
        self.lost: dict[int, list[int]] = {}  # unreadable versions the next one records
        # Fragments whose in-memory state holds an unpublished merge that a reload has
        # yet to replace: they merge nothing until it does (``_reload``).
        self.unloaded: set[int] = set()
        for p in fragments:
            self.load(p)

    def load(self, p: int) -> None:
        """(Re)build fragment ``p`` from its newest committed version."""
        outer = self.cfg.outer
        stored = self.transport.load_fragment(p, outer.max_staleness)
        syncer = FragmentSyncer(
            p, stored.params, outer, self.learners, is_embedding, version=stored.version,
            opt_leaves=stored.opt_leaves, cursor=stored.meta.get("cursor"),
            merged=stored.meta.get("merged"), progress=stored.meta.get("progress"),
            steps=stored.meta.get("outer_steps"),
            sink=getattr(self.transport, "version_sink", None),
            block_size=self.cfg.topology.block_size,
        )  # fmt: skip
        syncer.history.update({v: as_tensors(h) for v, h in stored.history.items()})
        if stored.lost:
            syncer.version = max(stored.lost)  # numbering goes on above them
            self.lost[p] = sorted(stored.lost)
            self.log.error("fragment %d: versions %s cannot be read; going on from version %d "
                           "(their merges are redone)", p, self.lost[p], stored.version)  # fmt: skip
        self.syncers[p] = syncer
        # What was refused since that version is refused (and recorded) again when read.
        self.implausible = {k for k in self.implausible if k[1] != p}
        for learner in self.learners:
            self.seen[(learner, p)] = syncer.cursor.get(learner, 0)
        self.clocks[p] = _MergeClock()
        self.step_seconds.setdefault(p, 0.0)
        self.last[p] = stored.meta
        self.unloaded.discard(p)

    def _reload(self, p: int) -> None:
        """Forget fragment ``p``'s unpublished merge and read it back from its newest
        version. If the read fails too, ``p`` stays unloaded: it merges nothing, and the
        next ``collect`` tries again. (Publishing on top of the failed merge would skip a
        version number and merge its contributions into a version that records none.)"""
        self.unloaded.add(p)
        self.load(p)

    def _loaded(self, p: int) -> FragmentSyncer:
        """Fragment ``p``'s syncer, read back first if a failed publish left it unloaded."""
        if p in self.unloaded:
            self.load(p)
        return self.syncers[p]

    @property
    def versions(self) -> dict[int, int]:
        return {p: s.version for p, s in self.syncers.items()}

    def admit(self, learner: str) -> None:
        """Take ``learner``'s contributions from now on: a learner the transport counts as
        a member that the run's spec does not list (a slot a joiner added, ``diloco
        join``), merged from the next version on like any other."""
        self.learners.append(learner)
        for p, syncer in self.syncers.items():
            syncer.learners = syncer.learners | {learner}
            self.seen[(learner, p)] = syncer.cursor.get(learner, 0)
        self.log.warning("learner %s is admitted: its contributions are merged from the "
                         "next version on", learner)  # fmt: skip

    def collect(self) -> int:
        """Offer every new contribution; returns how many were read."""
        for learner in self.transport.members():
            if learner not in self.learners:
                self.admit(learner)
        for p in sorted(self.unloaded):
            try:
                self.load(p)
            except Exception as exc:  # a region down, a damaged read: the next look tries
                self.log.warning("fragment %d cannot be read back yet: %r", p, exc)
        found = 0
        for learner in self.learners:
            for p, syncer in self.syncers.items():
                if p in self.unloaded:
                    continue
                try:
                    items = self.transport.contributions(learner, p, self.seen[(learner, p)])
                except OSError as exc:
                    self.log.warning("cannot list %s's contributions: %s", learner, exc)
                    break  # its region is down: the other learners go on
                for item in self._newest_per_anchor(items):
                    if item.seq > self.cfg.learner_step_cap:
                        self._refuse(learner, p, item.seq, _implausible(item.seq, self.cfg))
                        continue  # and ``seen`` stays: the real ones below it still count
                    if isinstance(item, Unreadable) and item.forged:
                        self._refuse(learner, p, item.seq, item.reason)
                        continue  # the same: a forger must not hide the learner's real ones
                    self.seen[(learner, p)] = item.seq
                    if isinstance(item, Superseded):
                        syncer.supersede(learner, item.seq, item.by)
                        continue
                    if isinstance(item, Unreadable):
                        self.log.error("skipping an unreadable contribution: %s", item.reason)
                        syncer.reject(learner, item.seq, item.reason)
                        self.emit(
                            records.rejected(learner, p, item.seq, item.reason, self.clock.now())
                        )
                        continue
                    syncer.offer(item)
                    found += 1
        now = self.clock.now()
        for p, syncer in self.syncers.items():
            if syncer.pending and self.clocks[p].first_arrival is None:
                self.clocks[p].first_arrival = now
        return found

    def _newest_per_anchor(
        self, items: list[Contribution | Unreadable]
    ) -> list[Contribution | Unreadable | Superseded]:
        """``items`` (one learner's and fragment's, in seq order) with only the newest
        readable contribution of each anchor read in full: the older ones from that anchor
        are ``Superseded`` by it unread (under a slow or faulty store most sends are, and
        reading each cost the syncer its pace). Forged and implausible ones take no part.
        The list ends before the first one that is not settled yet (its data, or that of
        the newer one that would supersede it, cannot be read now): the next look
        takes it up from there."""
        settled: dict[int, Contribution | Unreadable | Superseded] = {}
        anchors: dict[tuple[str, int, int], list[Contribution]] = {}
        for item in items:
            if isinstance(item, Unreadable) or item.seq > self.cfg.learner_step_cap:
                settled[item.seq] = item
            else:
                anchors.setdefault(item.anchor, []).append(item)
        for sends in anchors.values():
            newest = None
            for c in sorted(sends, key=lambda c: c.seq, reverse=True):
                if newest is not None:
                    settled[c.seq] = Superseded(c.learner, c.fragment, c.seq, newest)
                    continue
                try:
                    full = self.transport.read(c)
                except OSError as exc:
                    self.log.warning("cannot read %s/%d of fragment %d yet: %s",
                                     c.learner, c.seq, c.fragment, exc)  # fmt: skip
                    break  # it and the older ones wait for the next look
                settled[c.seq] = full
                if isinstance(full, Contribution):
                    newest = c.seq
        out = []
        for item in items:
            if item.seq not in settled:
                break
            out.append(settled[item.seq])
        return out

    def _refuse(self, learner: str, p: int, seq: int, reason: str) -> None:
        """Reject, once, a contribution that must not move this syncer's listing position
        (a forged or implausible one): taking its seq would skip every real one below it."""
        if (learner, p, seq) in self.implausible:
            return
        self.implausible.add((learner, p, seq))
        self.log.error("rejecting %s/%d fragment %d: %s", learner, seq, p, reason)
        self.syncers[p].reject(learner, seq, reason)
        self.emit(records.rejected(learner, p, seq, reason, self.clock.now()))

    def due(self, finishing: bool = False) -> list[int]:
        """Fragments to merge now: quorum met and the grace window over. ``finishing`` (every
        learner is done): whatever is pending, at once: nothing more will come."""
        now, out = self.clock.now(), []
        quorum = self.cfg.quorum_over(len(self.transport.members()))
        for p, syncer in self.syncers.items():
            if p in self.unloaded:
                continue
            if finishing and syncer.pending:
                out.append(p)
                continue
            clock = self.clocks[p]
            if not _quorum_met(syncer.present, quorum):
                # A member that came back raises the quorum: its grace window starts
                # again once the quorum is met (a stale deadline would spin the loop).
                clock.merge_at = None
                continue
            if clock.merge_at is None:
                est = estimate_step_seconds(syncer.pending.values(), self.step_seconds[p])
                self.step_seconds[p] = est
                waited = now - (clock.first_arrival or now)
                grace = grace_window(
                    est, self.cfg.topology.tau, waited, self.transport.delivery_seconds(p),
                    self.gamma,
                )  # fmt: skip
                clock.merge_at = now + grace
            if finishing or now >= clock.merge_at:
                out.append(p)
        return out

    def merge(self, p: int) -> records.Record | None:
        """Merge fragment ``p``'s pending contributions and publish the version; returns
        its record, or None if nothing was merged or another syncer won the version."""
        syncer = self._loaded(p)
        self.clocks[p] = _MergeClock()
        try:
            outcome = syncer.merge()
        except Exception:
            self._reload(p)  # a half-done merge: forget it, read the fragment back
            raise
        now = self.clock.now()
        for r in outcome.rejected:
            c = r.contribution
            self.log.warning("%s", r)
            self.emit(records.rejected(c.learner, p, c.seq, r.reason, now))
        if outcome.version is None:
            return None
        return self._publish(p, outcome.version)

    def seal(self, p: int) -> records.Record | None:
        """At the run's end: publish the outcomes no merge will carry (see
        ``FragmentSyncer.seal``), so the versions account for every contribution."""
        try:
            gv = self._loaded(p).seal()
        except Exception:
            self._reload(p)
            raise
        return None if gv is None else self._publish(p, gv)

    def _publish(self, p: int, gv: GlobalVersion) -> records.Record | None:
        syncer, now = self.syncers[p], self.clock.now()
        members = self.transport.members()
        quorum = self.cfg.quorum_over(len(members))
        record = records.version(gv, now, self.last[p], members, quorum)
        if self.lost.get(p):
            record["lost_versions"] = self.lost[p]
        try:
            leaves = syncer.opt_leaves if syncer.in_memory else []  # streamed: written
            won = self.transport.publish(gv, leaves, record)
        except Exception:
            self._reload(p)  # nothing committed: forget the merge, read them again
            raise
        if not won:
            self.log.warning("fenced off at fragment %d v%d; reloading the winner's", p, gv.version)
            self._reload(p)
            return None
        self.last[p] = record
        self.lost.pop(p, None)
        self.emit(record)
        return record

    def budget_spent(self) -> bool:
        """Sharing the budget, whether the steps the versions of this syncer's fragments
        report merged (``FragmentSyncer.progress``, all learners) reach the run's budget."""
        return _budget_spent(self.cfg.shared_budget, self.cfg.budget_steps,
                             (s.progress for s in self.syncers.values()))  # fmt: skip

    def next_deadline(self) -> float:
        """Seconds until the earliest pending merge (inf when none is scheduled)."""
        now = self.clock.now()
        times = [c.merge_at for c in self.clocks.values() if c.merge_at is not None]
        return max(0.0, min(times) - now) if times else math.inf

    def run(self) -> Iterator[Wait]:
        """Until every learner is done and their every contribution is processed."""
        while True:
            # Before listing: nothing after.
            finishing = self.transport.learners_finished(self.budget_spent())
            self.collect()
            for p in self.due(finishing):
                try:
                    self.merge(p)
                except OSError as exc:
                    self.log.warning("publishing fragment %d failed, will retry: %s", p, exc)
            self.transport.tend()
            if finishing and not self.due(finishing=True):
                for p in self.syncers:
                    self.seal(p)
                return
            yield Wait(self.next_deadline())
