"""Process chaos for a run's local workers: failure as the normal case.

From a seed, ``Chaos`` SIGKILLs a random live learner and a random live syncer shard at
exponentially distributed intervals (a Poisson process of mean ``*_kill_every`` seconds
each), and SIGSTOPs a random learner for ``pause_seconds`` before it SIGCONTs it (a
machine that hangs, then comes back). Or, from the run's own progress, it does each once
at given shares of the run's inner steps (``*_at``): a test's chaos must happen however
fast the machine is, and a run on a fast machine can end before a wall-clock interval
does. The launcher restarts what was killed; nothing else is told. Every action is logged and appended, with its Unix time, to a JSON-lines
file (``runs/RUN/chaos.jsonl``). Kills in the middle of an upload or a checkpoint write
come from the storage fault injector's ``crash`` kind (``storage_layout.faults``): the
worker dies between its data and its commit marker, a window a signal from outside
would hit only by luck.

``kill_to_rejoin`` reads, from the buckets, how long each killed learner took to commit
its next contribution: the time a kill costs, restart and recompilation included.

Configured from the run config (``pipeline.chaos``, the fields of ``ChaosPlan``), e.g.
``--set pipeline.chaos.learner_kill_every=30``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat, field_validator

from protocol.topology import run_slots
from storage_layout.retention import read_ledger
from storage_layout.store import RunStore

log = logging.getLogger(__name__)

ACTIONS = ("kill_learner", "kill_syncer", "pause_learner")
LOOK_SECONDS = 0.5  # how often the run's progress is read while a ``*_at`` action waits


class ChaosPlan(BaseModel):
    """What the chaos driver does; intervals are means in seconds (0: never), ``*_at``
    shares of the run's inner steps done (each in [0, 1), one action each)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = 0
    learner_kill_every: NonNegativeFloat = 0.0
    syncer_kill_every: NonNegativeFloat = 0.0
    pause_every: NonNegativeFloat = 0.0
    pause_seconds: PositiveFloat = 10.0
    start_after: NonNegativeFloat = Field(0.0, description="seconds of peace at the start")
    learner_kill_at: tuple[float, ...] = ()
    syncer_kill_at: tuple[float, ...] = ()
    pause_at: tuple[float, ...] = ()

    @field_validator("learner_kill_at", "syncer_kill_at", "pause_at")
    @classmethod
    def _shares(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        bad = [x for x in value if not 0.0 <= x < 1.0]
        if bad:
            raise ValueError(f"shares of the run's inner steps are in [0, 1), not {bad}")
        return tuple(sorted(value))

    def every(self, action: str) -> float:
        return {"kill_learner": self.learner_kill_every, "kill_syncer": self.syncer_kill_every,
                "pause_learner": self.pause_every}[action]  # fmt: skip

    def at(self, action: str) -> tuple[float, ...]:
        return {"kill_learner": self.learner_kill_at, "kill_syncer": self.syncer_kill_at,
                "pause_learner": self.pause_at}[action]  # fmt: skip

    @property
    def active(self) -> bool:
        return any(self.every(a) or self.at(a) for a in ACTIONS)


Progress = Callable[[], tuple[float, set[str]]]


class Chaos:
    """Drives ``plan`` against the processes ``workers()`` returns (name -> pid of the
    live ones; names start with ``learner`` or ``syncer``) from a background thread.
    ``progress()`` (needed by ``*_at`` actions) returns the share of the run's inner
    steps done and the names of the learners training now: an ``*_at`` action waits, once
    its share is reached, until a live worker it may take is there (a learner, one that
    is training: a kill before its first round tests nothing of a rejoin)."""

    def __init__(self, plan: ChaosPlan, workers: Callable[[], Mapping[str, int]],
                 log_path: Path, logger: Any = log, progress: Progress | None = None):  # fmt: skip
        if progress is None and any(plan.at(a) for a in ACTIONS):
            raise ValueError("chaos actions at shares of the run need its progress")
        self.plan, self.workers, self.log_path, self.log = plan, workers, log_path, logger
        self.progress = progress
        self.rng = random.Random(plan.seed)
        self.paused: dict[str, tuple[int, float]] = {}  # name -> (pid, resume at)
        self.done: Counter[str] = Counter()
        # (share, action) not done yet, in order; what is left at the stop was missed
        self.pending = sorted((x, a) for a in ACTIONS for x in plan.at(a))
        self.reached = 0.0  # the furthest share of the run seen
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="chaos", daemon=True)

    def start(self) -> Chaos:
        self.thread.start()
        return self

    def stop(self) -> dict[str, int]:
        """Stop, resume every paused worker (a stopped one would never exit); returns the
        actions taken, by kind. An ``*_at`` action not taken is named (``missed``)."""
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout=10)
        for name, (pid, _) in list(self.paused.items()):
            self._signal("resume_learner", name, pid, signal.SIGCONT)
        self.paused.clear()
        for line in self.missed:
            self.log.warning("chaos: %s never happened (the run reached %.0f%%)", line,
                             100 * self.reached)  # fmt: skip
        return dict(self.done)

    @property
    def missed(self) -> list[str]:
        """The ``*_at`` actions not taken, e.g. "kill_learner at 40%"."""
        return [f"{action} at {100 * share:.0f}%" for share, action in self.pending]

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:  # never silently: the run goes on without chaos, and says so
            self.log.exception("the chaos driver failed; no more chaos in this run")

    def _loop(self) -> None:
        start = time.monotonic() + self.plan.start_after
        due = {a: start + self._interval(a) for a in ACTIONS if self.plan.every(a)}
        look = time.monotonic()
        while not self.stopping.wait(0.2):
            now = time.monotonic()
            for name, (pid, until) in list(self.paused.items()):
                if now >= until:
                    self._signal("resume_learner", name, pid, signal.SIGCONT)
                    self.paused.pop(name, None)
            for action, at in due.items():
                if now >= at:
                    self._act(action)
                    due[action] = now + self._interval(action)
            if self.pending and now >= look:
                look = now + LOOK_SECONDS
                self._act_on_progress()

    def _act_on_progress(self) -> None:
        """Take each ``*_at`` action whose share the run has reached, if it can now."""
        assert self.progress is not None
        try:
            share, training = self.progress()
        except Exception as exc:  # a storage blip: the next look reads it again
            self.log.warning("chaos: cannot read the run's progress: %r", exc)
            return
        self.reached = max(self.reached, share)
        for item in [p for p in self.pending if p[0] <= self.reached]:
            if self._act(item[1], among=training):
                self.pending.remove(item)

    def _interval(self, action: str) -> float:
        return self.rng.expovariate(1.0 / self.plan.every(action))

    def _act(self, action: str, among: set[str] | None = None) -> bool:
        """Do ``action`` to a random live worker (a learner among ``among`` if given);
        returns whether it was done."""
        kind = "syncer" if action == "kill_syncer" else "learner"
        live = {n: pid for n, pid in self.workers().items() if n.startswith(kind)}
        names = sorted(n for n in live if n not in self.paused
                       and (among is None or kind == "syncer" or n in among))  # fmt: skip
        if not names:
            if among is None:
                self.log.info("chaos: no live %s to %s", kind, action.split("_")[0])
            return False
        name = self.rng.choice(names)
        if action == "pause_learner":
            self.paused[name] = (live[name], time.monotonic() + self.plan.pause_seconds)
            return self._signal(action, name, live[name], signal.SIGSTOP)
        return self._signal(action, name, live[name], signal.SIGKILL)

    def _signal(self, action: str, name: str, pid: int, sig: signal.Signals) -> bool:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            self.paused.pop(name, None)
            return False  # it ended on its own a moment ago
        self.done[action] += 1
        record = {"time": time.time(), "action": action, "worker": name, "pid": pid}
        self.log.warning("chaos: %s %s (pid %d)", action.replace("_", " "), name, pid)
        with open(self.log_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return True


def read_actions(path: Path) -> list[dict[str, Any]]:
    """The chaos log's records (none if there is no log)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _send_times(store: RunStore, learner: str, region: str, fragments: int) -> list[float]:
    """When each of ``learner``'s contributions was committed (held or in the ledger)."""
    times = []
    for p in range(fragments):
        for seq in store.contributions.contribution_seqs(learner, p, region):
            meta = store.contributions.contribution_meta(learner, p, seq, region)
            times.append(float(meta.get("written_at", 0.0)))
        for entry in read_ledger(store.home, store.layout, p):
            times += [float(c.get("written_at", 0.0)) for c in entry.get("contributions", [])
                      if c.get("learner") == learner]  # fmt: skip
    return sorted(times)


def kill_to_rejoin(store: RunStore, spec: Mapping[str, Any], actions: list[dict]) -> list[float]:
    """Seconds from each learner kill (SIGKILL by the driver, or a ``crash`` fault given
    as ``{"time", "worker"}``) to that learner's next committed contribution; kills after
    its last contribution are left out (nothing was left to rejoin for)."""
    learners = run_slots(spec)
    fragments = len(spec["fragments"])
    sends = {lid: _send_times(store, lid, region, fragments) for lid, region in learners.items()}
    out = []
    for action in actions:
        lid = action["worker"]
        after = [t for t in sends.get(lid, []) if t > action["time"]]
        if after:
            out.append(after[0] - action["time"])
    return out


def percentiles(values: list[float]) -> dict[str, float]:
    """Median and 90th percentile (empty: nothing to say)."""
    if not values:
        return {}
    if len(values) == 1:
        return {"median": values[0], "p90": values[0], "n": 1}
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return {"median": statistics.median(values), "p90": deciles[-1], "n": len(values)}
