"""Who is who in a run, each rule in one place: learner ids, which region each learner
lives in, the syncers' home region, which syncer shard owns which fragment, and the
quorum over the learners that are members now.

The simulator, the pipeline, the launcher and the tools all call these; none of them
spells an id or deals learners itself.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

LEARNER_PREFIX = "learner-"
# How a run that deals its data to its slots lets machines join in a region it starts no
# learner in: what the refusal of such a joiner and `diloco train`'s warning both say.
SLOT_EVERYWHERE = (
    "a run that deals its data to its slots (data.assign = 'slots') gives every region a "
    "learner slot when topology.learners is at least its number of regions (slots are "
    "dealt round-robin; pipeline.learners_started N starts the first N and leaves the "
    "others vacant for machines that join); a run on units (the default) adds one there"
)


def learner_id(index: int) -> str:
    return f"{LEARNER_PREFIX}{index}"


def learner_ids(count: int) -> list[str]:
    return [learner_id(i) for i in range(count)]


def syncer_id(shard: int) -> str:
    """Syncer shard ``shard``'s writer id (its status object, its metrics)."""
    return f"syncer-{shard}"


def learner_index(learner: str) -> int:
    """``"learner-3"`` -> 3; a clear error for anything else."""
    number = learner.removeprefix(LEARNER_PREFIX)
    if number == learner or not number.isdigit():
        raise ValueError(f"{learner!r} is not a learner id (expected {LEARNER_PREFIX}N)")
    return int(number)


def deal_learners(count: int, regions: Sequence[str] | Mapping[str, str]) -> dict[str, str]:
    """Learner id -> region, round-robin over the regions in the order given."""
    names = list(regions)
    if not names:
        raise ValueError("a run needs at least one region")
    return {lid: names[i % len(names)] for i, lid in enumerate(learner_ids(count))}


def run_deal(spec: Mapping[str, Any]) -> list[str] | None:
    """The regions a run deals its learners over, in order (``deal`` of the spec that
    ``flows.spec.run_spec`` writes): learner-i lives in region ``i mod len(deal)``, the
    spec's slots and the learners joiners add beyond them alike, so a joiner may add a
    learner in any region of the run, one that starts none included. None for a spec
    written before the key existed: its added learners live where slot ``i mod M`` does
    (``learner_region``). A ``deal`` that is not a list of the spec's regions, or that
    disagrees with the spec's slots, is an error naming it."""
    deal = spec.get("deal")
    if deal is None:
        return None
    regions = spec.get("regions") or {}
    if (not isinstance(deal, list) or not deal or len(set(deal)) != len(deal)
            or any(not isinstance(r, str) or r not in regions for r in deal)):  # fmt: skip
        raise ValueError(f"the run spec's deal {deal!r:.200} is not a list of its regions "
                         f"{sorted(regions)}, each once")  # fmt: skip
    dealt = spec.get("learners")  # listed by specs written before slots were counted
    if dealt is not None and dealt != deal_learners(len(dealt), deal):
        raise ValueError(f"the run spec's slots {dict(dealt)!r:.200} are not dealt "
                         f"round-robin over its deal {deal}")  # fmt: skip
    return deal


def run_slots(spec: Mapping[str, Any]) -> dict[str, str]:
    """The run's learner slots, id -> region: ``learner-0`` .. ``learner-{M-1}`` for the
    spec's ``topology.learners`` M, dealt round-robin over its ``deal`` (``run_deal``).
    The slots are where the run starts: who is a member is decided by records (join,
    member, leave, status), not by the spec. A spec written before slots were counted
    lists them (``learners``). A spec that names neither, or a count that is not a
    positive number, is an error naming it."""
    listed = spec.get("learners")
    if listed is not None:
        if not isinstance(listed, Mapping) or not listed:
            raise ValueError(f"the run spec's learners {listed!r:.200} are not a map of "
                             "learner ids to regions")  # fmt: skip
        return dict(listed)
    deal = run_deal(spec)
    count = ((spec.get("config") or {}).get("topology") or {}).get("learners")
    if deal is None or not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"the run spec's config.topology.learners {count!r:.40} and deal "
                         f"{deal!r:.200} give the run no learner slots")  # fmt: skip
    return deal_learners(count, deal)


def learner_region(
    learner: str, dealt: Mapping[str, str], deal: Sequence[str] | None = None
) -> str:
    """The region ``learner`` trains in, given the run's ``dealt`` learners (the spec's,
    ``learner-0`` .. ``learner-{M-1}``) and its ``deal`` (``run_deal``): its own, or, for
    one added beyond them (``diloco join`` when no slot is vacant), ``deal[index mod
    len(deal)]`` (the round-robin deal goes on); in a run with no ``deal``, that of the
    dealt learner its index falls on (index mod M). So two regions never add the same
    id."""
    if learner in dealt:
        return dealt[learner]
    if deal:
        return deal[learner_index(learner) % len(deal)]
    if not dealt:
        raise ValueError("a run needs at least one learner")
    return dealt[learner_id(learner_index(learner) % len(dealt))]


def added_learners(
    dealt: Mapping[str, str], region: str, deal: Sequence[str] | None = None
) -> Iterator[str]:
    """The ids a joiner in ``region`` may add beyond the run's ``dealt`` learners, in the
    order it tries them (``learner_region``)."""
    if region not in (deal or dealt.values()):
        raise ValueError(f"no learner of the run is dealt to region {region!r} ({SLOT_EVERYWHERE})")
    ids = map(learner_id, itertools.count(len(dealt)))
    return (lid for lid in ids if learner_region(lid, dealt, deal) == region)


def unslotted_regions(dealt: Mapping[str, str], regions: Iterable[str]) -> list[str]:
    """The ``regions`` no learner of ``dealt`` (the spec's slots) lives in: the syncers
    publish there, but no learner starts there; in a run that deals its data to its
    slots no machine can join there either (it takes a slot of its own region)."""
    slotted = set(dealt.values())
    return [r for r in regions if r not in slotted]


def home_region(regions: Sequence[str] | Mapping[str, str]) -> str:
    """The syncers' region, the arbiter of global versions: the first one given."""
    names = list(regions)
    if not names:
        raise ValueError("a run needs at least one region")
    return names[0]


def shard_count(requested: int, fragments: int) -> int:
    """Syncer shards actually run: never more than there are fragments."""
    return max(1, min(requested, fragments))


def shard_fragments(shard: int, shards: int, fragments: int) -> list[int]:
    """Shard ``s`` of ``S`` owns the fragments ``p`` with ``p % S == s``."""
    if not 0 <= shard < shards:
        raise ValueError(f"syncer shard {shard} is outside 0..{shards - 1}")
    owned = [p for p in range(fragments) if p % shards == shard]
    if not owned:
        raise ValueError(f"syncer shard {shard} of {shards} owns no fragment of {fragments}")
    return owned


def shard_of(fragment: int, shards: int) -> int:
    return fragment % shards


def member_quorum(quorum: int, members: int, share: float | None = None, floor: int = 1) -> int:
    """The quorum over the learners that are members now: the configured K, or, with a
    ``share``, ``max(floor, floor(share * members))``; either capped by how many members
    there are, at least 1. A learner gone (down, preempted, left, silent:
    ``diloco.liveness``; or lagging) holds no merge of the others; back, or a learner that
    joins, counts at once."""
    if share is not None:
        quorum = max(floor, math.floor(share * members + 1e-9))
    return max(1, min(quorum, members))
