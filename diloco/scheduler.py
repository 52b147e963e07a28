"""The simulator's scheduler: the learner and syncer loops (generators, ``diloco.loops``)
run as processes on a virtual clock. A learner's ``STEP`` advances its own time by its step
time; a ``Wait`` sleeps until news (``notify``) or the time is up; the clock jumps to the
next event, so a simulated week takes as long as its computation."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from diloco.loops import STEP, Request, Wait


class VirtualClock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def stepped(self, started: float, result: Any) -> None:
        """Nothing: the scheduler advanced the clock by the learner's step time on STEP."""


@dataclass
class _Process:
    loop: Iterator[Request]
    token: int = 0
    wake: float = 0.0
    waiting: bool = False
    stepping: bool = False
    background: bool = False


class Scheduler:
    """Resumes each loop at its own wake time on the virtual clock: after its step time
    for a ``STEP``, at the end of a ``Wait`` or earlier when news arrives for it."""

    def __init__(self, clock: VirtualClock, step_seconds: Callable[[str], float]):
        self.clock = clock
        self.step_seconds = step_seconds
        self.procs: dict[str, _Process] = {}
        self.news: dict[str, list[float]] = {}
        self.queue: list[tuple[float, int, str, int]] = []
        self.order = itertools.count()

    def _push(self, name: str, proc: _Process, at: float) -> None:
        proc.token += 1
        proc.wake = at
        heapq.heappush(self.queue, (at, next(self.order), name, proc.token))

    def start(self, name: str, loop: Iterator[Request], background: bool = False) -> None:
        """Run ``loop`` from now; a ``background`` one (a schedule of events) does not
        keep the run going: the run ends when only such loops are left."""
        self.procs[name] = proc = _Process(loop, background=background)
        self._push(name, proc, self.clock.now())

    def stop(self, name: str) -> bool:
        """Stop a loop where it stands (its generator is closed); False if none runs."""
        proc = self.procs.pop(name, None)
        if proc is None:
            return False
        proc.loop.close()
        return True

    def notify(self, name: str, at: float) -> None:
        heapq.heappush(self.news.setdefault(name, []), at)
        proc = self.procs.get(name)
        if proc is not None and proc.waiting and at < proc.wake:
            self._push(name, proc, at)

    def _next_news(self, name: str, now: float) -> float:
        news = self.news.get(name, [])
        while news and news[0] <= now:
            heapq.heappop(news)  # arrived by now: the loop has just looked
        return news[0] if news else math.inf

    def run(self, on_step: Callable[[str], None], on_end: Callable[[str], None]) -> None:
        while self.queue and not all(p.background for p in self.procs.values()):
            at, _, name, token = heapq.heappop(self.queue)
            proc = self.procs.get(name)
            if proc is None or token != proc.token:
                continue  # stopped, or woken earlier
            self.clock.t = at
            try:
                request = next(proc.loop)
            except StopIteration:
                del self.procs[name]
                if proc.stepping:
                    on_step(name)
                on_end(name)
                continue
            if proc.stepping:
                on_step(name)
            now = self.clock.now()
            proc.stepping = request is STEP
            proc.waiting = isinstance(request, Wait)
            if isinstance(request, Wait):
                wake = min(now + request.seconds, self._next_news(name, now))
                if math.isfinite(wake):
                    self._push(name, proc, wake)
                else:
                    proc.token += 1
                    proc.wake = math.inf  # until news
            else:
                self._push(name, proc, now + self.step_seconds(name))
