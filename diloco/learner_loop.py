"""The learner loop (``LearnerLoop``): when a learner sends, takes a global version and
checkpoints; how it starts or rejoins (``start``); the synchronous wait. One program for
the simulator, the tests and the pipeline (``diloco.loops``: what it yields, its clock
and transport). ``docs/algorithm.md`` says why each rule was chosen."""

from __future__ import annotations

import logging
import math
from collections import ChainMap
from collections.abc import Iterator
from typing import Any

from diloco import records
from diloco.config import RunConfig
from diloco.data import ShardReader
from diloco.fragments import FragmentPlan
from diloco.inner import InnerTrainer
from diloco.learner import Learner
from diloco.loops import STEP, Clock, Emit, GlobalView, LearnerTransport, Request, Wait, nothing
from diloco.tensors import full_bytes

log = logging.getLogger(__name__)


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
        emit: Emit = nothing,
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
        emit: Emit = nothing,
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
            learner.fragments[p].base_id = g.id
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
            lrn.apply_global(p, view.version, view.params, view.id)
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
