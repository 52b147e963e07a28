"""Who takes part in a run: a learner's liveness told apart from its progress.

A learner proves it is alive with a heartbeat (``storage_layout.heartbeat``: a small
signed object it rewrites every ``liveness.heartbeat_seconds`` from a thread of its own,
whatever its round's length, a second or an hour) and takes part by what it sends. An
observer (a syncer counting its quorum, the launcher saying why a run does not move)
watches the heartbeat's counter move on its own clock; no clock of another machine is
compared (a joiner, with one look, does: ``glance``). A learner is

- **silent** when its counter has not moved for ``silence_after`` seconds: ``SILENT_BEATS``
  of its heartbeat's measured period (the longest gap the observer saw lately, at least
  the period the learner states), within ``liveness.silent_min_seconds`` ..
  ``silent_max_seconds``: a loaded machine whose beats come late stretches it, a long
  round does not. Its slot is vacant: its data is given back and its process fenced.
- **lagging** when it is alive and training but has committed no new send for
  ``liveness.lag_rounds`` of its own rounds (``topology.inner_steps`` times its measured
  step time), at least ``silent_min_seconds``: counted out of the quorum until it sends
  again, never fenced while its heartbeat goes on.
- **preempted** or **done** as its heartbeat (or status) says; otherwise a member, in
  the phase its heartbeat names (starting, compiling, resuming, training, paused).

Only a beat counter that advances counts (an older signed beat written again keeps
nobody alive), and once an observer has seen a learner's heartbeat it judges the learner
by it alone: a status rewritten by anyone with write access to the bucket keeps no
stopped learner counted, and a heartbeat deleted is one that stopped. A learner whose
heartbeat was never seen (started by older code, or not started yet) is judged by its
status object: silent once it has not changed for ``silent_max_seconds``.

Pure: the observers read the objects and pass them in (``flows``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diloco.config import LivenessConfig

SILENT_BEATS = 6  # a learner is silent after this many of its heartbeat's periods
GAP_DECAY = 0.9  # how fast a stretched period estimate comes back once beats are regular


@dataclass(frozen=True)
class Verdict:
    """What an observer makes of one learner now: ``state`` is a live learner's phase, or
    "silent", "lagging" or "preempted" (counted out), or "done"; ``why`` says why it is not counted (None: it is);
    ``beating``: judged by a heartbeat (one that stopped: a process hung or dead), not by
    a status alone (a learner not started yet has neither)."""

    state: str
    why: str | None = None
    beating: bool = False

    @property
    def counted(self) -> bool:
        return self.why is None

    def __str__(self) -> str:
        return self.state if self.why is None else self.why


def silence_after(cfg: LivenessConfig, gap: float) -> float:
    """Seconds without a beat after which a learner whose beats come ``gap`` apart is
    silent."""
    return min(cfg.silent_max_seconds, max(cfg.silent_min_seconds, SILENT_BEATS * gap))


def lag_after(cfg: LivenessConfig, inner_steps: int, step_seconds: float | None) -> float | None:
    """Seconds without a send after which a training learner is lagging (None: its step
    time is not known yet, so neither is its round's)."""
    if not step_seconds:
        return None
    return max(cfg.silent_min_seconds, cfg.lag_rounds * inner_steps * step_seconds)


@dataclass
class _Seen:
    key: Any  # what moves with each beat (or, without one, each new status)
    at: float  # when the observer saw it move
    gap: float  # the beats' period as measured (stretched by late beats, decaying back)
    work: Any = None  # what moves with each send (and a change of phase)
    work_at: float = 0.0
    beat: Any = None  # the newest heartbeat seen


class Liveness:
    """One observer's view of the learners, on its own clock (``now``, in seconds)."""

    def __init__(self, cfg: LivenessConfig, inner_steps: int):
        self.cfg, self.inner_steps = cfg, inner_steps
        self._seen: dict[str, _Seen] = {}  # by heartbeat
        self._statuses: dict[str, _Seen] = {}  # by status, for learners without one

    def look(
        self, learner: str, beat: Any | None, status: Mapping[str, Any] | None, now: float
    ) -> Verdict:
        """``learner`` now, from its heartbeat ``beat`` (None: none readable) and its
        status object ``status`` (None: none)."""
        status = status or {}
        if status.get("state") == "done":  # (a status may end a learner, never keep one)
            return Verdict("done")
        seen = self._seen.get(learner)
        if beat is None and seen is None:
            return self._by_status(learner, status, now)
        # Once its heartbeat was seen, a learner is judged by it alone: a status (which
        # anyone with write access can rewrite) neither keeps it alive nor ends it, and a
        # heartbeat gone is one that stopped. Only a counter that advances moves (a new
        # generation starts again at 1): an older beat written again keeps nobody alive.
        if beat is None:
            beat = seen.beat
        elif seen is None or beat.key > seen.key:
            gap = beat.period
            if seen is not None:  # a decaying maximum of the gaps seen
                gap = max(gap, now - seen.at, GAP_DECAY * seen.gap)
            work = (beat.generation, beat.sends, beat.state)
            moved = seen is None or seen.work != work
            seen = self._seen[learner] = _Seen(
                beat.key, now, gap, work, now if moved else seen.work_at, beat
            )
        if beat.state == "done":
            return Verdict("done", beating=True)
        if beat.state == "preempted":
            return Verdict("preempted", "it was preempted (it counts again when it beats anew)",
                           beating=True)  # fmt: skip
        quiet, limit = now - seen.at, silence_after(self.cfg, seen.gap)
        if quiet > limit:
            return Verdict("silent", f"no heartbeat for {quiet:.0f} s (silent after {limit:.0f} "
                                     f"s: {SILENT_BEATS} beats of {seen.gap:.1f} s, within "
                                     "liveness.silent_min_seconds .. silent_max_seconds)",
                           beating=True)  # fmt: skip
        lag = lag_after(self.cfg, self.inner_steps, beat.step_seconds)
        idle = now - seen.work_at
        if beat.state == "training" and lag is not None and idle > lag:
            return Verdict("lagging", f"alive (a beat {quiet:.0f} s ago) but no send for "
                                      f"{idle:.0f} s, over {self.cfg.lag_rounds:g} of its rounds "
                                      f"({self.inner_steps * beat.step_seconds:.0f} s each)",
                           beating=True)  # fmt: skip
        return Verdict(beat.state, beating=True)

    def _by_status(self, learner: str, status: Mapping[str, Any], now: float) -> Verdict:
        key = (status.get("state"), status.get("time"), status.get("step"))
        seen = self._statuses.get(learner)
        if seen is None or seen.key != key:
            seen = self._statuses[learner] = _Seen(key, now, self.cfg.heartbeat_seconds)
        state = status.get("state")
        if state == "preempted":
            return Verdict("preempted", "it was preempted (it counts again when it writes anew)")
        quiet = now - seen.at
        if quiet > self.cfg.silent_max_seconds:
            return Verdict("silent", f"no heartbeat, and no new status for {quiet:.0f} s "
                                     f"(liveness.silent_max_seconds "
                                     f"{self.cfg.silent_max_seconds:.0f} s)")  # fmt: skip
        return Verdict(state if isinstance(state, str) else "starting")


def glance(
    cfg: LivenessConfig, beat: Any | None, status: Mapping[str, Any] | None, now: float
) -> Verdict:
    """One look by a machine that has not watched the learner (a joiner): its heartbeat's
    (or status's) own time against this machine's clock ``now``, by the same limits. A
    clock ahead of the learner's makes a live learner look silent: a joiner looks again
    before it believes that (``flows.join``)."""
    status = status or {}
    if status.get("state") == "done":
        return Verdict("done")
    if beat is None:
        state = status.get("state")
        if state == "preempted":
            return Verdict("preempted", "it was preempted")
        quiet = now - float(status.get("time") or 0.0)
        if quiet > cfg.silent_max_seconds:
            return Verdict("silent", f"no heartbeat, and no new status for {quiet:.0f} s")
        return Verdict(state if isinstance(state, str) else "starting")
    if beat.state == "preempted":
        return Verdict("preempted", "it was preempted")
    quiet, limit = now - beat.time, silence_after(cfg, beat.period)
    if quiet > limit:
        return Verdict("silent", f"no heartbeat for {quiet:.0f} s (silent after {limit:.0f} s)")
    return Verdict(beat.state)
