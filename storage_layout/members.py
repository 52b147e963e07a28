"""Learners' membership of a run (``store.members``): generations and fences, blocks of
seqs, member and join records, heartbeats.

A part of a ``storage_layout.store.RunStore``, over its buckets and ``layout.py``."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field

from protocol.topology import learner_index, learner_region, run_deal, run_slots
from storage_layout import heartbeat
from storage_layout.auth import record_verifies, sign_record
from storage_layout.commit import CorruptVersion, patiently
from storage_layout.layout import check_name
from storage_layout.part import Part, Written, read_json, read_or_none
from storage_layout.record import Counter, Record, Time

if TYPE_CHECKING:
    from storage_layout.store import RunStore

log = logging.getLogger(__name__)


class SeqBlock(Written):
    first: Counter
    end: Counter


class Generation(Written):
    """A process's claim of a learner's generation, or a syncer's fence (``fence``)."""

    fence: Annotated[str, Field(max_length=2000)] | None = None


class Join(Record):
    """A joiner's record of taking a slot (``flows.join``), signed where the run signs."""

    join: Counter
    time: Time


class SeqNotReserved(RuntimeError):
    """A learner process asked to commit a sequence number outside the blocks it holds:
    another process of that learner has reserved numbers above it since (``reserve_seqs``)."""


@dataclass(frozen=True)
class RunLearners:
    """``Members.run_learners``: learner id -> region (the spec's slots first, then the
    added ones by index), the added slots' records, and the records refused, each named."""

    regions: dict[str, str]
    added: dict[str, dict[str, Any]]
    refused: list[str]


def _member_problem(
    lid: str, name: str, region: str, record: Any, dealt: Mapping[str, str],
    deal: list[str] | None, key_of: Callable[[str], bytes | None] | None,
) -> str | None:  # fmt: skip
    """Why a member record (``Members.run_learners``) is not to be taken, or None."""
    try:
        learner_index(lid)
        check_name("learner", lid)
    except ValueError as exc:
        return f"{name} does not name a learner ({exc})"
    if not name.endswith(".json"):
        return f"{name} is not a member record (LEARNER.json)"
    if not isinstance(record, dict):
        return f"not a member record: {record!r:.120}"
    if record.get("learner") != lid or record.get("region") != region:
        return (f"it names learner {record.get('learner')!r} in region "
                f"{record.get('region')!r}, not {lid!r} in {region!r} where it lies")  # fmt: skip
    if lid in dealt:
        return f"{lid} is a slot of the run's spec (in region {dealt[lid]!r})"
    if dealt and learner_region(lid, dealt, deal) != region:
        return f"{lid} is a learner of region {learner_region(lid, dealt, deal)!r}, not {region!r}"
    key = key_of(lid) if key_of is not None else None
    if key is not None and not record_verifies(record, key):
        return f"it is not signed with {lid}'s key (forged, or the key of another run)"
    return None


class Members(Part):
    def __init__(self, store: RunStore):
        super().__init__(store)
        self._members: dict[tuple[str, str], Any] = {}  # member records read (written once)

    def claim_generation(self, learner: str) -> int:
        """Claim the next generation of ``learner`` in its home region (an exclusive
        create, so two starters never share one). A process holding an older generation
        is fenced off: it must stop once it sees a newer one."""
        return self.store.put_next(self.layout.lease_commits(learner), self.store.stamped({}))

    def newest_generation(self, learner: str) -> int:
        taken = self.store.claim_numbers(self.home, self.layout.lease_commits(learner))
        return taken[-1] if taken else 0

    def superseded(self, learner: str, generation: int) -> bool:
        """Whether ``learner``'s generation after ``generation`` has been claimed (a fence,
        or a process that took over): a read of that claim's key, never a stale listing."""
        key = self.store.numbered_claim(self.layout.lease_commits(learner), generation + 1)
        return patiently(lambda: self.home.exists(key), key)

    def generation(self, learner: str, n: int) -> dict[str, Any] | None:
        """The record of ``learner``'s generation ``n`` as stored; None if there is none,
        or it is not one (named in the log)."""
        key = self.store.numbered_claim(self.layout.lease_commits(learner), n)
        return self.read_claim(self.home, key, Generation)

    def fence(self, learner: str, newest: int, why: str) -> bool:
        """Claim generation ``newest + 1`` of ``learner`` for no process (an exclusive
        create of exactly that number, ``{"fence": why}``): a process holding ``newest``
        (silent, perhaps only cut off) commits nothing more (``check_newest`` reads the
        next number before each commit). False when someone claimed it first: a process
        that started as the learner, or another fence."""
        key = self.store.numbered_claim(self.layout.lease_commits(learner), newest + 1)
        return self.store.claim(key, self.store.stamped({"fence": why}))

    def reserve_seqs(
        self, learner: str, at_least: int, count: int, after: int | None = None
    ) -> tuple[int, int, int]:
        """Reserve a block of ``count`` sequence numbers for ``learner``'s contributions,
        none below ``at_least`` and all above every block reserved before (by any process
        of it); returns (claim number, first, end). ``after``: the caller's own newest
        claim, to try the next number without a listing.

        A learner process commits only seqs inside blocks it holds. So a restarted one
        never takes a seq below one an earlier process may have committed, even when a
        listing leaves the newest contributions out: the claims are numbered and written
        with an exclusive create (``put_next``), and each block starts at the end of the
        claim before it, read by its key (a read of a known key is never stale)."""
        prefix = self.layout.seq_claims(learner)
        block: dict[str, int] = {}

        def claim(n: int) -> bytes:
            first = at_least
            if n > 1:
                key = self.store.numbered_claim(prefix, n - 1)
                before = read_json(self.home, key, SeqBlock, sealed_by=self.store.seal_of(key))
                first = max(first, before["end"])
            block.update(first=first, end=first + count)
            return self.store.stamped(block)

        n = self.store.put_next(prefix, claim, after)
        return n, block["first"], block["end"]

    def seq_blocks(self, learner: str, newest: int = 2) -> list[tuple[int, int]]:
        """The ``newest`` blocks of seqs reserved for ``learner`` (``reserve_seqs``), as
        ``(first, end)``, oldest first (a listing and one read each)."""
        prefix = self.layout.seq_claims(learner)
        claims = self.store.claim_numbers(self.home, prefix)[-newest:] if newest > 0 else []
        out = []
        for n in claims:
            key = self.store.numbered_claim(prefix, n)
            block = self.read_claim(self.home, key, SeqBlock)
            if block is not None:
                out.append((block["first"], block["end"]))
        return out

    def put_member(self, learner: str, record: Mapping[str, Any], key: bytes | None) -> bool:
        """Add learner slot ``learner`` to the run in this store's region (a joiner that
        found no vacant slot, ``flows.join``): ``record`` signed with ``key`` (if any),
        written once; False when another joiner's record holds that id."""
        body = sign_record(record, key) if key is not None else dict(record)
        return self.store.create(
            self.layout.member(learner), json.dumps(body, sort_keys=True).encode()
        )

    def run_learners(
        self, spec: Mapping[str, Any], key_of: Callable[[str], bytes | None] | None = None,
        regions: Iterable[str] | None = None,
    ) -> RunLearners:  # fmt: skip
        """The run's learners: the spec's slots, then the slots joiners added
        (``put_member``) in ``regions`` (this store's, by default), each record checked:
        named after its learner, a learner id (``learner-N``) the spec does not hold, in
        the bucket of the region it names, which is that id's (``learner_region``: no two
        regions add the same id), and, with ``key_of``
        (learner -> its key, None where nothing is signed), signed with its learner's
        key. A record that is not is refused (``RunLearners.refused`` names its key and
        why), never taken: its learner's contributions are then a stranger's."""
        dealt, deal = run_slots(spec), run_deal(spec)
        found: dict[str, tuple[str, dict[str, Any]]] = {}
        refused: list[str] = []
        folder = self.layout.members_folder()
        for region in self.store.urls if regions is None else regions:
            bucket = self.bucket(region)
            listed = patiently(partial(bucket.list, folder), f"listing {folder}")
            for name in sorted(listed):
                where = f"{bucket.url}/{folder}/{name}"
                record = self._members.get((region, name))  # written once: read once
                try:
                    record = record or read_json(bucket, f"{folder}/{name}")
                except FileNotFoundError:
                    continue
                except CorruptVersion as exc:
                    refused.append(f"{where}: {exc}")
                    continue
                self._members[(region, name)] = record
                lid = name.removesuffix(".json")
                why = _member_problem(lid, name, region, record, dealt, deal, key_of)
                if why is not None:
                    refused.append(f"{where}: {why}")
                    continue
                found[lid] = (region, record)
        added = {lid: found[lid] for lid in sorted(found, key=learner_index)}
        return RunLearners(
            {**dealt, **{lid: region for lid, (region, _) in added.items()}},
            {lid: record for lid, (_, record) in added.items()}, refused,
        )  # fmt: skip

    def put_join(
        self, learner: str, record: Callable[[int], bytes], after: int | None = None
    ) -> int | None:
        """Add a join record of ``learner`` (``record(N)``: its signed JSON as join N) in
        this store's region, the learner's own, written once; returns N. With ``after``
        (the newest join its joiner saw when it chose the slot: ``newest_join``) it is
        join ``after + 1`` or none: None when another joiner wrote that one first (the
        slot is theirs), so two joiners racing for one slot never both take it."""
        prefix = self.layout.join_commits(learner)
        if after is None:
            return self.store.put_next(prefix, record)
        taken = self.store.claim(self.store.numbered_claim(prefix, after + 1), record(after + 1))
        return after + 1 if taken else None

    def joins(self, learner: str, region: str | None = None) -> list[dict[str, Any]]:
        """``learner``'s join records in ``region`` (its own), oldest first, as stored:
        check their signatures (``auth.record_verifies``)."""
        prefix = self.layout.join_commits(learner)
        bucket = self.bucket(region or self.store.client_region)
        keys = [
            self.store.numbered_claim(prefix, n) for n in self.store.claim_numbers(bucket, prefix)
        ]
        found = (self.read_claim(bucket, key, Join) for key in keys)
        return [r for r in found if r is not None]

    def join_count(self, learner: str, region: str | None = None) -> int:
        """How many join records ``learner``'s slot holds in ``region`` (a listing, no
        record read)."""
        prefix = self.layout.join_commits(learner)
        return len(
            self.store.claim_numbers(self.bucket(region or self.store.client_region), prefix)
        )

    def newest_join(
        self, learner: str, region: str | None = None, after: int = 0,
        key: bytes | None = None,
    ) -> tuple[int, dict[str, Any] | None] | None:  # fmt: skip
        """``learner``'s newest join number and record, read only if that number is above
        ``after`` (one listing otherwise); None if there is none (newer). The record is
        None when it is not a join record (dated ahead, or, given ``key``, not signed with
        it: named in the log): the number is taken all the same."""
        prefix = self.layout.join_commits(learner)
        bucket = self.bucket(region or self.store.client_region)
        numbers = self.store.claim_numbers(bucket, prefix)
        if not numbers or numbers[-1] <= after:
            return None
        where = self.store.numbered_claim(prefix, numbers[-1])
        found = read_or_none(
            bucket, where, Join, signed_by=key, sealed_by=self.store.seal_of(where)
        )
        return numbers[-1], found

    def write_heartbeat(self, beat: Mapping[str, Any], key: bytes | None = None) -> None:
        """Rewrite a learner's heartbeat at home (``storage_layout.heartbeat``), signed
        with ``key`` if given."""
        heartbeat.write(self.home, self.layout, beat, key)

    def read_heartbeat(
        self, learner: str, region: str | None = None, key: bytes | None = None
    ) -> heartbeat.Heartbeat | None:
        """``learner``'s heartbeat in ``region``, checked (given ``key``, its signature
        too); None when there is none or it does not read."""
        bucket = self.bucket(region or self.store.client_region)
        return heartbeat.read(bucket, self.layout, learner, key)
