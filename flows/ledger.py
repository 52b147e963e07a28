"""The data ledger of ``data.assign = "units"`` (``diloco.units.UnitLedger``), a pool per
region in that region's bucket: who took which span of which unit, and what departed
learners gave back, as write-once records (docs/data.md "Units").

- ``units/fresh/s{N}.json``: the claim of the region pool's unit ``N - 1``
  (``diloco.units.pool_unit``: each region has its own pool of units, as a learner
  reads and writes its own region's bucket only), an exclusive create, so each unit is
  handed out once;
- ``learners/{id}/units/s{N}.json``: a learner's ledger, in order: ``{"take": [epoch,
  unit, start, end], "claim": ...}`` for a span it took, ``{"release": at, "returned":
  [[epoch, unit, start, end], ...]}`` for its stream from window ``at`` on, given back;
- ``units/returned/{id}-s{N}-{j}.json``: the claim of span ``j`` that record ``N`` of
  learner ``id`` gave back (the same span can come back more than once: the claim names
  the release, not the span).

Every record read is checked against the data set's units (a span inside its unit, a
release that gives back what its learner held from ``at`` on); a bad one is an error
naming its key. Records are immutable, so each learner's ledger is read once and then
only its newer records. A take is a claim and then the learner's record: a process that
dies between the two leaves a unit claimed that no one trains (``orphans`` names them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import astuple
from typing import Any

from diloco.data import DataError
from diloco.units import Span, UnitPlan, cut, pool_unit
from protocol.topology import run_deal, run_slots
from storage_layout.store import RunStore


def region_pools(spec: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """Each region's pool of units (``diloco.units.pool_unit``), in sorted order: every
    region the run deals learners to (``protocol.topology.run_deal``), so that a learner
    added in a region the run started none in has its pool there (until one does,
    ``UnitOffers`` moves that pool's spans to the regions that train); for a spec written
    before the deal was, the regions of its slots."""
    regions = sorted(run_deal(spec) or set(run_slots(spec).values()))
    return {r: (i, len(regions)) for i, r in enumerate(regions)}


def region_ledger(store: RunStore, plan: UnitPlan, learners: Mapping[str, str],
                  region: str, fenced: Callable[[], None] | None = None,
                  members: Callable[[], Mapping[str, str]] | None = None, *,
                  pools: Mapping[str, tuple[int, int]]) -> BucketLedger:  # fmt: skip
    """The ledger of ``region``'s pool, in ``store`` (a store of that region's bucket).
    ``members``: the run's learners now (with those joiners added), read before each
    take; ``pools``: the run's (``region_pools``)."""
    mine = [lid for lid, r in learners.items() if r == region]
    if region not in pools:
        raise ValueError(f"region {region!r} has no pool of data units in this run (its "
                         f"pools: {sorted(pools)})")  # fmt: skip
    return BucketLedger(store, plan, mine, pools[region], fenced, region, pools, members)


def offer_claim(region: str, claim: str) -> str:
    """The name under which a span claimed as ``claim`` in ``region``'s pool is offered
    to another region (``UnitOffers``), and claimed there by the learner that takes it."""
    return f"from-{region}-{claim}"


class BucketLedger:
    """The ledger of one pool (a region's) in ``store``'s home bucket (the region's own),
    for its ``learners``. ``region`` and ``pools`` (every region's pool): to check the
    spans that syncers offer it from other regions' pools (``UnitOffers``). ``members``
    (learner -> region, the run's learners now): the learners joiners added to the
    region since, read before each take (their takes and what they gave back count)."""

    def __init__(self, store: RunStore, plan: UnitPlan, learners: Sequence[str],
                 pool: tuple[int, int] = (0, 1),
                 fenced: Callable[[], None] | None = None, region: str = "",
                 pools: Mapping[str, tuple[int, int]] | None = None,
                 members: Callable[[], Mapping[str, str]] | None = None):  # fmt: skip
        self.store, self.plan, self.learners = store, plan, list(learners)
        self.members = members
        self.pool, self.region, self.pools = pool, region, dict(pools or {})
        self._offers: dict[str, tuple[Span, str]] = {}  # offered here: claim -> (span, from)
        self._claims: dict[str, Any] = {}  # claim records read (written once)
        # Raises if this process may no longer write as its learner (a newer generation:
        # a restart, or a fence, ``SilentReleases``): checked before each take.
        self.fenced = fenced
        # learner -> (newest record read, spans held, [(claim, span) given back])
        self._read: dict[str, tuple[int, list[Span], list[tuple[str, Span]]]] = {}
        self._taken: set[str] = set()  # the claims of the takes read so far, all learners
        self._fresh = 0  # the newest fresh claim number seen
        # learner -> its own claims with no record (``_orphans_of``), looked for once
        self._owed: dict[str, list[tuple[Span, str]]] = {}

    def _span(self, value: Any, where: str) -> Span:
        ok = isinstance(value, list) and len(value) == 4
        ok = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        if ok:
            epoch, unit, start, end = value
            ok = epoch >= 0 and 0 <= unit < self.plan.units
            ok = ok and 0 <= start <= end <= self.plan.windows(epoch, unit)
        if not ok:
            raise DataError(f"{where}: {value!r} is not a span of a unit of this data set")
        return Span(*value)

    def _replay(self, learner: str) -> tuple[list[Span], list[tuple[str, Span]]]:
        last, held, back = self._read.get(learner, (0, [], []))
        held, back = list(held), list(back)
        prefix = self.store.layout.unit_records(learner)
        for n, record in self.store.units.unit_records(learner, after=last):
            where = f"{prefix}/s{n:012d}.json"
            if isinstance(record, dict) and "take" in record:
                held.append(self._span(record["take"], where))
                self._taken.add(str(record.get("claim")))
            elif isinstance(record, dict) and isinstance(record.get("release"), int):
                kept, gone = cut(held, record["release"])
                given = [self._span(v, where) for v in record.get("returned") or []]
                if given != gone:
                    raise DataError(f"{where} gives back {given}, not what {learner} held "
                                    f"from window {record['release']} on ({gone})")  # fmt: skip
                held = kept
                back += [(f"{learner}-s{n}-{j}", span) for j, span in enumerate(gone)]
            else:
                raise DataError(f"{where} is neither a span taken nor a stream given back")
            last = n
        self._read[learner] = (last, held, back)
        return held, back

    def spans(self, learner: str) -> list[Span]:
        return list(self._replay(learner)[0])

    def _offered(self) -> list[tuple[str, Span]]:
        """The spans syncers offered this pool from others (checked; one listing)."""
        for claim, record in self.store.units.unit_offers(self._offers).items():
            self._offers[claim] = self._offer(claim, record)
        return [(claim, span) for claim, (span, _) in self._offers.items()]

    def _offer(self, claim: str, record: Any) -> tuple[Span, str]:
        where = self.store.claim_key(self.store.layout.units_offered(claim))
        record = record if isinstance(record, dict) else {}
        src, given = record.get("from"), record.get("claim")
        if src not in self.pools or src == self.region or not isinstance(given, str) \
                or claim != offer_claim(src, given):  # fmt: skip
            raise DataError(f"{where}: {record!r} is not a span of another region's pool "
                            f"offered to {self.region}")  # fmt: skip
        span = self._span(record.get("span"), where)
        fresh = given.removeprefix("fresh-")
        if fresh != given and fresh.isdigit() and span != self.plan.fresh(int(fresh) - 1,
                                                                          self.pools[src]):  # fmt: skip
            raise DataError(f"{where} offers {span}, not unit {int(fresh) - 1} of the pool of "
                            f"{src}")  # fmt: skip
        return span, src

    def _returned_and_offered(self) -> dict[str, Span]:
        """Every span given back here or offered here, by its claim's name."""
        back = {claim: span for lid in self.learners for claim, span in self._replay(lid)[1]}
        back.update(self._offered())
        return back

    def _pool(self) -> list[tuple[Span, str]]:
        """What this pool's learners take before a fresh unit: the spans given back and
        those offered from other regions, not claimed yet, oldest epoch first."""
        claimed = self.store.units.returned_claims()
        back = [(span, claim) for lid in self.learners for claim, span in self._replay(lid)[1]]
        back += [(span, claim) for claim, span in self._offered()]
        return sorted((span, claim) for span, claim in back if claim not in claimed)

    def given_back(self) -> list[Span]:
        self._admit()
        return [span for span, _ in self._pool()]

    def _admit(self) -> None:
        """Add the learners joiners added to this region since the last look."""
        if self.members is not None:
            for lid, region in self.members().items():
                if region == self.region and lid not in self.learners:
                    self.learners.append(lid)

    def take(self, learner: str) -> Span:
        if self.fenced is not None:
            self.fenced()
        self._admit()
        if learner not in self._owed:  # once a process: its own claims with no record
            self._owed[learner] = self._orphans_of(learner)
        if self._owed[learner]:
            return self._took(learner, *self._owed[learner].pop(0))
        for span, claim in self._pool():  # given back first, oldest epoch first
            if self.store.units.claim_returned(claim, learner):
                return self._took(learner, span, claim)
        while True:
            self._fresh = self.store.units.claim_fresh_unit(learner, self._fresh or None)
            span = self.plan.fresh(self._fresh - 1, self.pool)
            if span.windows:  # a unit of chunks shorter than a window holds none
                return self._took(learner, span, f"fresh-{self._fresh}")

    def _took(self, learner: str, span: Span, claim: str) -> Span:
        newest = self._read.get(learner, (0,))[0]  # replayed by the take: no listing
        self.store.units.put_unit_record(learner, {"take": list(astuple(span)), "claim": claim},
                                   newest or None)  # fmt: skip
        return span

    def _orphans_of(self, learner: str) -> list[tuple[Span, str]]:
        """The spans ``learner`` claimed and recorded no take of (its process died
        between the two), with their claims: it takes them again before anything else, so
        no unit is left claimed and trained by no one. Only the claim's own learner may,
        as only one process of a learner trains (its generation): another learner's
        orphan might be a take still under way."""
        back = self._returned_and_offered()
        out = []
        for claim in self.orphans():
            record = self.store.units.unit_claim(claim)
            if isinstance(record, dict) and record.get("learner") == learner:
                if claim.startswith("fresh-"):
                    out.append((self.plan.fresh(int(claim[6:]) - 1, self.pool), claim))
                elif claim in back:
                    out.append((back[claim], claim))
        return sorted(out)

    def orphans(self) -> list[str]:
        """Claims no learner's ledger took, nor a syncer to offer elsewhere: a take that
        died between its claim and its record (its span is trained by no one, until its
        learner takes again: ``_orphans_of``)."""
        moved = self.moved()
        return [c for c in self._untaken() if c not in moved]

    def _untaken(self) -> list[str]:
        self._admit()
        for lid in self.learners:  # each learner's new records (checked as they are read)
            self._replay(lid)
        fresh = [f"fresh-{n}" for n in self.store.units.fresh_claims()  # an empty unit: no take
                 if self.plan.fresh(n - 1, self.pool).windows]  # fmt: skip
        returned = sorted(self.store.units.returned_claims())
        return [c for c in fresh + returned if c not in self._taken]

    def moved(self) -> dict[str, tuple[str, Span]]:
        """The claims of this pool that a syncer made to offer their spans to another
        region (``UnitOffers``): claim -> (that region, the span). Claim records are read
        once (the claims no learner here took)."""
        untaken = self._untaken()
        new = [c for c in untaken if c not in self._claims]
        self._claims.update(zip(new, self.store.units.unit_claims(new), strict=True))
        back = self._returned_and_offered()
        out = {}
        for claim in untaken:
            record = self._claims[claim]
            to = record.get("offer") if isinstance(record, dict) else None
            if to in self.pools and to != self.region:
                if claim.startswith("fresh-"):
                    out[claim] = (to, self.plan.fresh(int(claim[6:]) - 1, self.pool))
                elif claim in back:
                    out[claim] = (to, back[claim])
        return out

    def frontier(self) -> int:
        """The epoch of this pool's next fresh unit: one listing the first time, then a
        look for each claim after the newest seen (claims are numbered in turn, each the
        one after the newest its writer saw: ``RunStore.put_next``), so a look costs the
        claims made since the last, not the pool's whole history."""
        if not self._fresh:
            self._fresh = self.store.units.fresh_frontier()
        while self.store.units.has_fresh_claim(self._fresh + 1):
            self._fresh += 1
        return pool_unit(self._fresh, self.pool, self.plan.units)[0]

    def fresh_before(self, epoch: int) -> int:
        """How many of this pool's units of the epochs before ``epoch`` no one has had
        yet (as of the newest claim ``frontier`` saw)."""
        i, n = self.pool
        return max(0, -(-(epoch * self.plan.units - i) // n) - self._fresh)

    def give(self, to: str, who: str, epoch: int) -> tuple[Span, str] | None:
        """Claim, for region ``to``'s learners, the span of this pool its own learners
        would take next (given back or offered first, then a fresh unit), if its epoch is
        ``epoch`` or older; claimed by ``who`` (a syncer, ``UnitOffers``), naming ``to``.
        Returns the span and its claim here, or None."""
        for span, claim in self._pool():
            if span.epoch > epoch:
                break
            if len(offer_claim(self.region, claim)) <= 64 and \
                    self.store.units.claim_returned(claim, who, offer=to):  # fmt: skip
                self._claims[claim] = {"offer": to}
                return span, claim
        while True:
            after = self._fresh or self.store.units.fresh_frontier()
            if pool_unit(after, self.pool, self.plan.units)[0] > epoch:
                return None
            self._fresh = self.store.units.claim_fresh_unit(who, after, offer=to)
            self._claims[f"fresh-{self._fresh}"] = {"offer": to}
            span = self.plan.fresh(self._fresh - 1, self.pool)
            if span.windows:
                return span, f"fresh-{self._fresh}"

    def release(self, learner: str, at: int) -> None:
        """Give back ``learner``'s stream from window ``at`` on. The record is written as
        exactly the number after the newest this ledger read (another writer may add to
        the learner's ledger: a syncer giving back a silent learner's data, the learner's
        own take under way), and read again and cut again when that number is taken: a
        release always gives back what its learner held as of the record before it, and
        two releases never give the same span back twice."""
        while True:
            _, back = cut(self.spans(learner), at)
            if not back:
                return
            returned = [list(astuple(s)) for s in back]
            n = self._read[learner][0] + 1
            if self.store.units.put_unit_record_at(
                learner, n, {"release": at, "returned": returned}
            ):
                return


class FollowedLedger:
    """A learner's ledger as a follower process of it sees it (a learner of several
    processes, ``pipeline.learner_processes > 1``: every process reads the same batches).
    Process 0 takes and gives back; a follower reads process 0's records, so its stream
    is the same spans in the same order. A take waits until process 0 has recorded it:
    process 0 records a take before it reads the span, and the processes step together.
    A follower never writes to the ledger. A take that process 0 does not record within
    ``patience`` seconds (its own take failed), or once ``stop`` is set (the learner
    closes), raises: a follower's reader thread never waits for ever."""

    def __init__(self, ledger: BucketLedger, poll: float = 0.05, log: Any = None,
                 patience: float = 600.0):  # fmt: skip
        self.ledger, self.plan, self.poll, self.log = ledger, ledger.plan, poll, log
        self.patience = patience
        self.stop = threading.Event()
        self._next = 0  # the next span of the stream this process reads

    def spans(self, learner: str) -> list[Span]:
        held = self.ledger.spans(learner)
        self._next = len(held)
        return held

    def take(self, learner: str) -> Span:
        started = last = time.monotonic()
        while True:
            held = self.ledger.spans(learner)
            if len(held) > self._next:
                self._next += 1
                return held[self._next - 1]
            waited = time.monotonic() - started
            what = f"process 0 of {learner} recorded no take of span {self._next} of its data"
            if self.stop.is_set():
                raise DataError(f"{what}: the learner is closing")
            if waited > self.patience:
                raise DataError(f"{what} in {waited:.0f} s")
            if self.log is not None and time.monotonic() - last > 60:
                last = time.monotonic()
                self.log.warning("waiting %.0f s for process 0 of %s to take span %d of "
                                 "its data", waited, learner, self._next)  # fmt: skip
            self.stop.wait(self.poll)

    def release(self, learner: str, at: int) -> None:
        """Nothing: process 0 gives the learner's stream back."""

    def given_back(self) -> list[Span]:
        return self.ledger.given_back()
