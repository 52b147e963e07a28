"""How often to LIST what changes about once a round: a learner's sends of a fragment
(the syncer looks for them), a fragment's global versions (a learner looks for them).

Both come a round apart (H inner steps: seconds on ``tiny``, a minute or more on a real
model), but a look at every ``pipeline.poll_seconds`` (0.2 s) LISTs the bucket 5 times a
second per thing watched, which the bucket's owner pays for, whatever the round length:
a syncer watching M = 8 learners' P = 4 fragments made about 576,000 LIST requests an
hour. So each thing is looked at ``LOOKS_PER_ROUND`` times per its last gap between two
news, at most ``PACE_MOST`` seconds apart, and at every poll while that would be under
``PACE_FROM`` (short rounds: as before). What it costs: news is seen at most
1/``LOOKS_PER_ROUND`` of a round (``PACE_MOST``) later. The clock is the caller's (a
syncer's may be a test's).
"""

from __future__ import annotations

import math
from collections.abc import Hashable

LOOKS_PER_ROUND = 20
PACE_FROM, PACE_MOST = 1.0, 5.0
# The run's members (``RunStore.members.run_learners``: a LIST of ``members/`` in every region)
# change when a learner is added by a joiner, rarely: a syncer and the launcher's monitor
# read them at most this often.
MEMBERS_EVERY = PACE_MOST
# Between those looks a syncer LISTs ``members/`` alone (no status is read) this often,
# so a learner a joiner adds waits at most this long to be admitted, not a whole
# ``MEMBERS_EVERY``: on short rounds (``tiny``: half a second) that wait was most of the
# time from a join to its first merged contribution (``bench/elastic``).
ADMIT_EVERY = PACE_FROM


class Pace:
    """When each watched thing (a key) is next due for a look, from when its news came."""

    def __init__(self) -> None:
        self._found_at: dict[Hashable, float] = {}  # a look last found news
        self._gap: dict[Hashable, float] = {}  # between the last two news found
        self._look_at: dict[Hashable, float] = {}  # the next look
        self.looks = 0  # looks made (what the pacing saves)

    def due(self, key: Hashable, now: float) -> bool:
        return now >= self._look_at.get(key, -math.inf)

    def looked(self, key: Hashable, now: float, news: bool) -> None:
        """A look at ``key`` was made at ``now``; ``news``: it found something new."""
        self.looks += 1
        if news:
            if key in self._found_at:
                self._gap[key] = now - self._found_at[key]
            self._found_at[key] = now
        wait = self._gap.get(key, 0.0) / LOOKS_PER_ROUND
        self._look_at[key] = now + (min(wait, PACE_MOST) if wait >= PACE_FROM else 0.0)
