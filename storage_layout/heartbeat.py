"""A learner's heartbeat: one small JSON object it rewrites every few seconds from a
thread of its own (``flows.heartbeat.Heartbeat``), whatever its round's length, signed
with its key when the run signs. Who reads it (``diloco.liveness``) watches its counter
move on the reader's own clock; nothing here judges.

    {run}/learners/{learner}/heartbeat.json
    {"learner": "learner-2", "generation": 3, "beat": 41, "period": 5.0,
     "state": "training", "step": 820, "sends": 37, "step_seconds": 0.41,
     "time": 1733300000.0, "signature": {...}}

The reader takes nothing unchecked: an object over ``MAX_BYTES``, not JSON, of the wrong
shape, out of bounds, or (when the reader holds the learner's key) not signed by it is
named and taken as absent, never raised raw.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from storage_layout import record
from storage_layout.auth import sign_record
from storage_layout.bucket import Bucket
from storage_layout.layout import RunLayout
from storage_layout.record import Time

log = logging.getLogger(__name__)

MAX_BYTES = 4096  # a heartbeat is a few hundred bytes
# What a learner's process says it is doing (``flows.learner``): its start-up phases,
# training, between two flow runs, and how it ended.
STATES = ("starting", "compiling", "resuming", "training", "paused", "preempted", "done",
          "stopped")  # fmt: skip
Count = Annotated[int, Field(ge=0, lt=10**15)]
Seconds = Annotated[float, Field(ge=0, lt=10**7)]


class Heartbeat(BaseModel):
    """One beat, as stored (``read`` checks it against this)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    learner: str
    generation: Count
    beat: Count
    period: Annotated[float, Field(gt=0, lt=10**5)]
    state: Literal[STATES]  # type: ignore[valid-type]
    step: Count
    sends: Count
    step_seconds: Seconds | None = None
    time: Time

    @property
    def key(self) -> tuple[int, int]:
        """What moves with every beat."""
        return self.generation, self.beat


def write(bucket: Bucket, layout: RunLayout, beat: Mapping[str, Any], key: bytes | None) -> None:
    """Overwrite ``beat['learner']``'s heartbeat (signed with ``key`` if given)."""
    record = Heartbeat.model_validate(beat).model_dump()
    body = sign_record(record, key) if key is not None else record
    bucket.put(layout.heartbeat(record["learner"]), json.dumps(body, sort_keys=True).encode())


def read(
    bucket: Bucket, layout: RunLayout, learner: str, key: bytes | None = None
) -> Heartbeat | None:
    """``learner``'s newest heartbeat, or None: none written, or one that is not a
    heartbeat of this learner (``storage_layout.record``: too large, not JSON, out of
    bounds, or, given its ``key``, not signed with it), which is logged by name. An
    ``OSError`` that stays after asking again is raised (the reader goes on)."""
    beat = record.read_or_none(bucket, layout.heartbeat(learner), Heartbeat, MAX_BYTES, key)
    if beat is not None and beat.learner != learner:
        log.warning("ignored: %s/%s names learner %r", bucket.url, layout.heartbeat(learner),
                    beat.learner)  # fmt: skip
        return None
    return beat
