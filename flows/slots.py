"""A run's learner slots as a joiner sees them (``flows.join``): each slot's state, vacant or
not and why (``slot_state``), and the slot a joiner in a region takes or adds
(``choose_slot``), or why none."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diloco.config import LivenessConfig
from diloco.liveness import glance
from protocol.topology import (
    LEARNER_PREFIX,
    SLOT_EVERYWHERE,
    added_learners,
    learner_index,
    learner_region,
    run_deal,
    run_slots,
    unslotted_regions,
)
from storage_layout.auth import JoinRefused
from storage_layout.store import RunStore

LEARNER_ID = re.compile(rf"{LEARNER_PREFIX}\d+")  # a token may name anything


@dataclass(frozen=True)
class Slot:
    learner: str
    vacant: bool
    why: str  # why it is vacant, or what it is doing
    added: bool = False  # a slot this joiner adds to the run (none was vacant)
    joins: int = 0  # the number of its newest join record, when it was chosen


def slot_state(
    store: RunStore,
    learner: str,
    region: str,
    liveness: LivenessConfig,
    now: float | None = None,
    key: bytes | None = None,
) -> Slot:
    """Whether ``learner``'s slot is vacant now, and why (see the module docstring), by
    one look at its heartbeat (checked with ``key`` if given) and status against this
    machine's clock (``diloco.liveness.glance``). A learner that looks silent is watched
    for two of its beats first: a clock ahead of its own must not take a live one's slot."""
    now = time.time() if now is None else now
    status = store.progress.read_metrics(learner, region)
    beat = store.members.read_heartbeat(learner, region, key)
    if status is None and beat is None:
        if store.members.newest_generation(learner) != 0:
            return Slot(learner, False, "starting (it has claimed the slot, no status yet)")
        why, since = "never started", -math.inf
    else:
        verdict = glance(liveness, beat, status, now)
        step = beat.step if beat is not None else (status or {}).get("step", 0)
        if verdict.state == "done":
            return Slot(learner, False, "done: it has trained its budget")
        if verdict.counted:
            return Slot(learner, False, f"{verdict.state} at step {step}")
        if verdict.state == "silent" and beat is not None:
            time.sleep(2 * liveness.heartbeat_seconds + 1)  # (the run's period, not the beat's)
            again = store.members.read_heartbeat(learner, region, key)
            if again is not None and again.key != beat.key:
                return Slot(learner, False, f"{again.state} at step {again.step} (its heartbeat "
                                            "moves: this machine's clock is ahead of its)")  # fmt: skip
        why = str(verdict.why)
        since = beat.time if beat is not None else float((status or {}).get("time") or 0.0)
    # Vacant by its status, unless a joiner is on its way to its start: a join record
    # younger than the timeout, and newer than the status (a preempted slot joined again).
    joined = store.members.newest_join(learner, region, key=key)
    at = joined[1].get("time") if joined and joined[1] else None
    if isinstance(at, (int, float)) and now - at < liveness.silent_max_seconds and at > since:
        return Slot(learner, False, f"joining (joined {now - at:.0f} s ago, not started)")
    return Slot(learner, True, why.split(" (")[0], joins=joined[0] if joined else 0)


def _joinable(run: str, spec: Mapping[str, Any], region: str, grow: bool) -> tuple[dict, Any]:
    """The spec's slots and deal, if a machine in ``region`` can join the run at all."""
    regions = list(spec.get("regions") or {})
    if region not in regions:
        raise JoinRefused(f"run {run!r} has no region {region!r}; its regions are "
                          f"{sorted(regions)}")  # fmt: skip
    try:
        dealt, deal = run_slots(spec), run_deal(spec)
    except ValueError as exc:  # a damaged or forged spec
        raise JoinRefused(f"run {run!r} cannot be joined: {exc}") from exc
    if unslotted_regions(dealt, [region]) and not (grow and deal):  # nor a pool of data
        old = ("it was started before runs recorded how they deal learners to regions, "
               "and adds learners only in regions with a slot; " if grow else "")  # fmt: skip
        raise JoinRefused(f"run {run!r} has no learner slot in region {region!r}, so "
                          f"no machine can join there: {old}{SLOT_EVERYWHERE}")  # fmt: skip
    return dealt, deal


def _new_slot(dealt: Any, deal: Any, region: str, learners: Mapping[str, str],
              keys: dict[str, bytes] | None) -> str | None:  # fmt: skip
    """The id of a learner ``region`` may add (the first one the join token covers, any
    key), or None."""
    if keys is None:
        return next(lid for lid in added_learners(dealt, region, deal) if lid not in learners)
    ids = [lid for lid in keys if LEARNER_ID.fullmatch(lid) and lid not in learners]
    return next((lid for lid in sorted(ids, key=learner_index)
                 if learner_region(lid, dealt, deal) == region), None)  # fmt: skip


def choose_slot(
    store: RunStore,
    spec: Mapping[str, Any],
    region: str,
    keys: dict[str, bytes] | None,
    liveness: LivenessConfig,
    wanted: str | None = None,
    grow: bool = False,
) -> Slot:
    """The slot a joiner in ``region`` takes (``wanted``, or the first vacant one it
    holds a key for, among the spec's and those joiners added in this region); with
    ``grow`` (the run takes its data in units, which no slot owns) and none vacant, a new
    one (``Slot.added``: ``added_learners``' first id it holds a key for and no one
    added). ``JoinRefused`` naming each slot and why it is not to be taken."""
    dealt, deal = _joinable(store.run, spec, region, grow)
    key_of = None if keys is None else keys.get
    learners = store.members.run_learners(spec, key_of).regions
    here = sorted((lid for lid, r in learners.items() if r == region), key=learner_index)
    if wanted is not None:
        if wanted not in learners:
            raise JoinRefused(f"run {store.run!r} has no learner {wanted!r}")
        if learners[wanted] != region:
            raise JoinRefused(f"{wanted} trains in region {learners[wanted]!r}, not {region!r}")
        here = [wanted]
    seen = []
    for lid in here:
        if keys is not None and lid not in keys:
            seen.append(f"{lid}: the join token does not cover it")
            continue
        slot = slot_state(store, lid, region, liveness, key=None if keys is None else keys[lid])
        if slot.vacant:
            return slot
        seen.append(f"{lid}: {slot.why}")
    if grow and wanted is None:
        new = _new_slot(dealt, deal, region, learners, keys)
        if new is not None:
            return Slot(new, True, "added to the run (no slot was vacant)", added=True)
        seen.append("no slot to add: the join token covers none this region may add")
    elif not grow and wanted is None:
        seen.append(
            "a run that deals its data to its slots (data.assign = 'slots') adds none "
            "(a run started on units, diloco train's default, grows)"
        )
    elsewhere = sorted({r for lid, r in learners.items() if r != region})
    if elsewhere and wanted is None:  # (their states are in their regions' buckets)
        seen.append(f"the run has slots in {', '.join(map(repr, elsewhere))} too: a machine "
                    "that reaches one of those buckets joins there (--region)")  # fmt: skip
    raise JoinRefused(f"no vacant learner slot in region {region!r} of run {store.run!r}: "
                      + "; ".join(seen))  # fmt: skip
