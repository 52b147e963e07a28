"""A learner process's heartbeat (``storage_layout.heartbeat``; what readers make of it:
``diloco.liveness``): a thread of its own rewrites one small signed object every
``liveness.heartbeat_seconds`` from the moment the process holds its generation,
compiling and resuming included, however long a round is. Each beat also looks for the
learner's next generation (a read of its key: one request, never a stale listing): once
it has been claimed (a fence, or a process that
took over) this one stops beating and says so (``superseded``), so the learner's round
stops early and its runtime finds out why (``LearnerRuntime.check_fenced``).

The thread never dies silently: a beat that fails is logged (once a minute at most, with
how many failed since) and the next one is tried.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

from flows.observe import QUIET_SECONDS


class Heartbeat:
    """Beats for ``learner`` (generation ``generation``) into ``members`` (its own region's
    ``RunStore.members``) every ``period`` seconds, signed with ``key``. ``progress()`` gives the
    learner's step and its committed sends so far; ``state`` is its phase, set by the
    runtime."""

    def __init__(self, members: Any, learner: str, generation: int, period: float,
                 key: bytes | None, progress: Callable[[], tuple[int, int]], log: Any,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.members, self.learner, self.generation = members, learner, generation
        self.period, self.key, self.progress, self.log = period, key, progress, log
        self.clock = clock
        self.state = "starting"
        self.beats = 0
        self.superseded = threading.Event()  # a newer generation of the learner exists
        self._step: tuple[int, float] | None = None  # (step, when it was first seen)
        self.step_seconds: float | None = None  # measured: an average, stretched by a slow step
        self._failed, self._logged = 0, -math.inf
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat {learner}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self.beat()
            except Exception as exc:  # logged; the next beat tries again
                self._failed += 1
                if time.monotonic() - self._logged >= QUIET_SECONDS:
                    self._logged = time.monotonic()
                    self.log.warning("heartbeat of %s failed %d time(s) since the last report: %r",
                                     self.learner, self._failed, exc)  # fmt: skip
                    self._failed = 0
            if self.superseded.is_set() or self._stop.wait(self.period):
                return

    def _measure(self, step: int) -> float | None:
        """The learner's seconds per step: an average over the steps seen between beats
        while it trains (the time it spends starting, compiling or checkpointing is not
        a step's: counted, the run's limits that scale with it would start several times
        too long), and at least the time the current step has taken so far (a step of
        minutes shows at once, not when it ends)."""
        now = self.clock()
        if self.state != "training":
            self._step = None  # the next window starts once it trains again
        elif self._step is None or step < self._step[0]:
            self._step = (step, now)
        elif step > self._step[0]:
            per = (now - self._step[1]) / (step - self._step[0])
            avg = self.step_seconds
            self.step_seconds = per if avg is None else 0.7 * avg + 0.3 * per
            self._step = (step, now)
        if self.step_seconds is None or self._step is None:  # (not training: as measured)
            return self.step_seconds
        return max(self.step_seconds, now - self._step[1])

    def beat(self, state: str | None = None) -> None:
        """Write one beat (``state``: in place of the runtime's phase)."""
        if self.members.superseded(self.learner, self.generation):
            if not self.superseded.is_set():
                self.log.warning("%s: generation %d was claimed after this process's; it "
                                 "beats no more", self.learner, self.generation + 1)  # fmt: skip
            self.superseded.set()
            return
        step, sends = self.progress()
        self.beats += 1
        per_step = self._measure(step)
        self.members.write_heartbeat({
            "learner": self.learner, "generation": self.generation, "beat": self.beats,
            "period": self.period, "state": state or self.state, "step": step, "sends": sends,
            "step_seconds": None if per_step is None else round(per_step, 4),
            "time": time.time(),
        }, self.key)  # fmt: skip

    def close(self, state: str | None = None) -> None:
        """Stop beating; with ``state`` (done, preempted, stopped), one last beat says it."""
        self._stop.set()
        self._thread.join(timeout=2 * self.period + 5)
        if state is not None and not self.superseded.is_set():
            try:
                self.beat(state)
            except Exception as exc:  # its status says as much; silence follows anyway
                self.log.warning("last heartbeat of %s (%s) failed: %r", self.learner, state, exc)
