"""A series' recent rate, and how long it takes at that rate to reach a target: the
launcher's tokens per second and the time a run has left.

The rate is measured over the last ``WINDOW_SECONDS`` (a start-up, a restart or a
stalled syncer a while ago does not weigh on it for ever), from the first and the last
point of that window; a series that has not moved yet (the run starting up) counts
from its last look before it moved. While the rate is unknown (fewer than two points,
or none moved) the time left is too: ``duration_text`` says so rather than guessing. A
series that goes back (a run resumed by another launcher counts from what it reads)
starts over.
"""

from __future__ import annotations

from collections import deque

WINDOW_SECONDS = 300.0  # "the last minutes": the rate is measured over this long


class Rate:
    """The points ``(when, value)`` of a growing series within the last ``window``
    seconds (and the one before them, so that the window is covered whole)."""

    def __init__(self, window: float = WINDOW_SECONDS):
        self.window = window
        self.points: deque[tuple[float, float]] = deque()

    def add(self, when: float, value: float) -> None:
        if self.points and (value < self.points[-1][1] or when < self.points[-1][0]):
            self.points.clear()
        if self.points and value == self.points[0][1]:
            self.points.clear()  # not moved yet (a start-up): the rate counts from its end
        self.points.append((when, value))
        while len(self.points) > 2 and self.points[1][0] <= when - self.window:
            self.points.popleft()

    def per_second(self) -> float | None:
        """The value's growth per second over the window; None while unknown."""
        if len(self.points) < 2:
            return None
        (t0, v0), (t1, v1) = self.points[0], self.points[-1]
        if t1 <= t0 or v1 <= v0:
            return None
        return (v1 - v0) / (t1 - t0)

    def time_to(self, target: float) -> float | None:
        """Seconds until the value reaches ``target`` at the recent rate; None while the
        rate is unknown."""
        rate = self.per_second()
        if rate is None:
            return None
        return max(0.0, target - self.points[-1][1]) / rate


def duration_text(seconds: float | None) -> str:
    """``seconds`` as people read a time left: ``45 s``, ``12 min 05 s``, ``3 h 20 min``,
    or ``unknown``."""
    if seconds is None:
        return "unknown"
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def rate_text(per_second: float | None) -> str:
    """A rate as ``12,345/s`` (``?/s`` while unknown)."""
    return "?/s" if per_second is None else f"{per_second:,.0f}/s"
