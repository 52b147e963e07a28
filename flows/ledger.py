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
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import astuple
from typing import Any

from diloco.data import DataError
from diloco.loops import resume_step
from diloco.units import Span, UnitPlan, cut, pool_unit
from protocol.topology import run_deal, run_slots
from storage_layout.audit import AuditReport
from storage_layout.auth import Keys
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


def audit_units(report: AuditReport) -> None:
    """The audit's ``data-once`` across learners when the run takes its data in units
    (``storage_layout.audit`` checks each learner's own): the windows that each
    learner's merged batches (``report.data``, positions of its stream) read, through
    its region's ledger, are read by no other learner's; and each region's pool goes
    into ``report.units``. A ledger record that does not check (a forged span, a release
    that gives back what its learner did not hold) fails the invariant by its key."""
    from diloco.config import validate_config
    from diloco.run_data import RunData

    urls, run = report.regions, report.run
    # with DILOCO_RUN_SECRET set, only the run's own claims count (``storage_layout.auth``)
    key = Keys.from_env(run).claims_key
    first = RunStore(run, urls, next(iter(urls)), writer="audit", claims_key=key)
    spec = first.read_spec()
    cfg = validate_config({**spec["config"], "pipeline": {}})
    if cfg.data.assign != "units":
        return
    # the run's slots and the learners joiners added (a refused one is the audit's stranger)
    plan, learners, batch = (
        RunData(cfg).units,
        first.members.run_learners(spec).regions,
        cfg.data.batch_size,
    )
    merged: dict[tuple[int, int], list[tuple[int, int, str]]] = {}
    offers: dict[tuple[str, str], tuple[str, Span]] = {}  # (to, offer claim) -> (from, span)
    pools = region_pools(spec)
    for region in pools:
        store = RunStore(run, urls, region, writer="audit", claims_key=key)
        ledger = region_ledger(store, plan, learners, region, pools=pools)
        try:
            for lid in ledger.learners:
                stream = ledger.spans(lid)
                for lo, hi in report.data.get(lid, []):
                    read = cut(cut(stream, hi * batch)[0], lo * batch)[1]
                    if sum(s.windows for s in read) < (hi - lo) * batch:
                        report.fail("data-once", f"{lid} merged batches {lo}-{hi}, past the "
                                    f"{sum(s.windows for s in stream)} windows its data "
                                    f"ledger holds")  # fmt: skip
                    for s in read:
                        merged.setdefault((s.epoch, s.unit), []).append((s.start, s.end, lid))
            moved = ledger.moved()
            orphans = ledger.orphans()
            report.units[region] = {
                "units_handed_out": store.units.fresh_frontier(),
                "given_back_waiting": [list(astuple(s)) for s in ledger.given_back()],
                "orphan_claims": orphans,
                "moved_out": len(moved),  # offered to the learners of other regions
                "passed_over": sorted(store.passed_over),  # no claims of the run's
            }
            # A claim no learner took, made in the name of none of the run's learners: its
            # span is trained by no one (a forged claim, or one of another run's).
            for claim, record in zip(orphans, store.units.unit_claims(orphans), strict=True):
                who = record.get("learner") if isinstance(record, dict) else None
                if who not in learners:
                    report.fail("no-strangers", f"{region}: unit claim {claim} was made by "
                                f"{who!r}, no learner of the run: its data is trained by no "
                                "one")  # fmt: skip
            for claim, (to, span) in moved.items():
                offers[(to, offer_claim(region, claim))] = (region, span)
        except DataError as exc:
            report.fail("data-once", f"{region}: {exc}")
    for to in sorted({to for to, _ in offers}):  # a span moved out is offered where it went: one
        try:  # that is not is trained by no one (a syncer died between claim and offer)
            there = dict(region_ledger(RunStore(run, urls, to, writer="audit", claims_key=key),
                                       plan, learners, to, pools=pools)._offered())  # fmt: skip
        except DataError as exc:
            report.fail("data-once", f"{to}: {exc}")
            continue
        for (dest, claim), (region, span) in offers.items():
            if dest == to and there.get(claim) != span:
                report.units[region].setdefault("moved_not_offered", []).append(claim)
    for (epoch, unit), parts in sorted(merged.items()):
        end, by = -1, ""
        for start, stop, lid in sorted(parts):
            if start < end:
                report.fail("data-once", f"epoch {epoch} unit {unit}: windows {start}-"
                            f"{min(end, stop)} merged from {by} and from {lid}")  # fmt: skip
            if stop > end:
                end, by = stop, lid


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


SILENT = "silent: its heartbeat stopped (liveness.*)"  # why a syncer fences a learner


class SilentReleases:
    """Gives back the data of a silent learner (its heartbeat stopped, whatever it was
    doing: ``diloco.liveness``; a lagging one, alive, keeps its data) with ``data.assign =
    "units"``, which a syncer has dropped from the quorum: without it, its spans would
    wait for its slot's next learner (a restart or a joiner), and an epoch would go on
    without them. Run by the syncers (``PipelineSyncerTransport.members``),
    in two looks at least ``grace`` seconds apart:

    1. **fence**: claim the learner's next generation for no process
       (``RunStore.members.fence``, an exclusive create of exactly that number), so that its
       process, if it is only cut off, commits nothing more; one syncer wins; none acts
       when the learner never wrote a status or holds no span;
    2. **release**, ``grace`` seconds after this syncer first saw the fence (its own or
       another syncer's: one that died before its release leaves it to the others): the
       keys of the seqs it reserved and did not commit are held first (``BucketStore.
       revoke_unsent``), so a commit that passed the process's last check and is paused
       (a frozen machine) lands nowhere when it wakes; then its stream from where its
       slot resumes (``resume_step`` of its newest checkpoint and newest committed send,
       as a restart reads them) is given back, as a preempted learner gives it back
       itself. Two syncers releasing at once give nothing back twice: a release is
       written as exactly the ledger's next record (``BucketLedger.release``), and once
       one has landed there is nothing past that point left to give.

    A learner heard from again is left alone; one silent again is fenced again."""

    def __init__(self, store: Any, plan: UnitPlan, batch: int, log: Any,
                 pools: Mapping[str, tuple[int, int]], grace: float = 10.0):  # fmt: skip
        self.store, self.plan, self.batch, self.log, self.grace = store, plan, batch, log, grace
        self.pools = pools
        self._fenced: dict[str, tuple[Any, float]] = {}  # learner -> (its status, when)
        self._settled: dict[str, Any] = {}  # learner -> the status it was dealt with at

    def tend(self, learner: str, region: str, status: Any, now: float) -> None:
        """One look at ``learner``, silent with ``status`` (its state, time, step) at
        ``now`` (the syncer's clock); errors are logged, and the next look tries again."""
        if self._settled.get(learner) == status:
            return
        try:
            fenced = self._fenced.get(learner)
            if fenced is None or fenced[0] != status:
                if self._fence(learner, region):
                    self._fenced[learner] = (status, now)
                else:
                    self._settled[learner] = status
            elif now - fenced[1] >= self.grace:
                self._release(learner, region)
                self._settled[learner] = status
        except (OSError, ValueError) as exc:  # DataError is a ValueError
            self.log.error("cannot give back the data of %s, silent: %s", learner, exc)

    def _ledger(self, own: RunStore, region: str) -> BucketLedger:
        return region_ledger(own, self.plan, self.store.learners, region, pools=self.pools)

    def _fence(self, learner: str, region: str) -> bool:
        own = self.store.writer_for(learner)
        newest = own.members.newest_generation(learner)
        if newest == 0:
            return False  # never started: it holds nothing (and its slot stays vacant)
        if not self._ledger(own, region).spans(learner):
            return False
        record = own.members.generation(learner, newest)
        if isinstance(record, dict) and "fence" in record:
            return True  # fenced by a syncer, nobody started since: released, or to be
        return own.members.fence(learner, newest, SILENT)

    def _release(self, learner: str, region: str) -> None:
        own = self.store.writer_for(learner)
        # First hold the keys of the seqs it has not committed: a commit of it still
        # under way (its process paused past its last check) then lands nowhere, so the
        # resume point read next counts every contribution it will ever have sent.
        self.store.revoke_unsent(learner, f"its data given back: {SILENT}")
        steps = own.checkpoints.checkpoint_steps(learner)
        step = resume_step(steps[-1] if steps else 0, self.store.sent_so_far(learner)[1])
        ledger = self._ledger(own, region)
        back = cut(ledger.spans(learner), step * self.batch)[1]
        if not back:
            return  # given back already (by another syncer)
        ledger.release(learner, step * self.batch)
        self.log.warning("learner %s is silent: its data from step %d on (%d windows) is "
                         "given back to the learners of %s", learner, step,
                         sum(s.windows for s in back), region)  # fmt: skip


MOST_WAITING = 256  # spans ``UnitOffers`` keeps waiting in a region at most


class UnitOffers:
    """Offers the data of a region no learner is in, or whose pool is behind, to the
    regions whose learners train (``data.assign = "units"``). Each region has its own
    pool of units in its own bucket, as a learner reads and writes its own region's
    bucket only; when every learner of a region has left (preempted, silent, given up,
    or never started), its pool would wait for
    them and an epoch would go on without it; and the pools are the same size, so a
    region with fewer or slower learners would go through its pool's epochs more slowly
    than the others (its data trained less often), and one whose pool was moved out
    while it was empty would be epochs ahead when a learner came back. Syncers write to
    every region, so one moves spans: it claims the span the region's own learners would
    take next (``BucketLedger.give``: given back first, then a fresh unit), the claim
    naming the region it goes to, and then offers it there (``RunStore.units.offer_unit``),
    where learners take it like a span given back, before a fresh unit of their own. A
    span is claimed once in its pool and offered once, so it is trained once.

    Run by the first syncer shard at each look at the members (``tend``; one, so that
    shards do not each keep their own spans waiting), it keeps spans waiting in
    each region with learners: as many as it has learners at first, twice as many each
    time a look finds that they took every span left waiting at the last (they train a
    unit faster than the syncers look), up to ``MOST_WAITING``; it offers an empty
    region's spans of the epoch that region's own pool is in or an older one, and a
    region's with learners only of an older one (its pool is behind): the run goes
    through an epoch's units, all pools together, before the next. A claim made here
    whose offer was not written (the syncer died between the two) is offered at the
    next look. The learners of the empty region, when they come back, take from their
    pool where the moves left it, the others' spans first while it is ahead; spans
    already offered stay with the region they were offered to."""

    def __init__(self, run: str, regions: Mapping[str, str], learners: Mapping[str, str],
                 plan: UnitPlan, who: str, log: Any, pools: Mapping[str, tuple[int, int]],
                 traffic: Any = None, claims_key: bytes | None = None):  # fmt: skip
        # ``learners`` as given, not a copy: the syncer's store adds those joiners add
        self.run, self.regions, self.learners = run, dict(regions), learners
        self.claims_key = claims_key  # the run's (``storage_layout.auth``), if it tags claims
        self.plan, self.who, self.log, self.traffic = plan, who, log, traffic
        self.pools = dict(pools)
        self._ledgers: dict[str, BucketLedger] = {}
        self._repair = True  # look for claims without their offer (at the start, after an error)
        self._turn = 0  # the empty region whose spans go first: they take turns
        self.waiting: dict[str, int] = {}  # region -> how many spans to keep waiting there
        self._left: dict[str, int] = {}  # region -> spans waiting there after the last look

    def ledger(self, region: str) -> BucketLedger:
        if region not in self._ledgers:
            store = RunStore(self.run, {region: self.regions[region]}, region,
                             writer=self.who, traffic=self.traffic,
                             claims_key=self.claims_key)  # fmt: skip
            self._ledgers[region] = region_ledger(store, self.plan, self.learners, region,
                                                  members=lambda: self.learners,
                                                  pools=self.pools)  # fmt: skip
        return self._ledgers[region]

    def tend(self, members: Collection[str]) -> int:
        """One look, with the learners counted as ``members`` now; returns the spans
        offered. Errors are logged; the next look tries again."""
        live = {r: sum(self.learners.get(m) == r for m in members) for r in self.pools}
        if len(live) < 2 or not any(live.values()):
            return 0
        offered, sources = 0, [r for r, n in live.items() if not n]
        try:
            if self._repair:
                offered += self._offer_moved(list(self.pools))
                self._repair = False
            front = {r: self.ledger(r).frontier() for r in self.pools}
            for to in (r for r, n in live.items() if n):
                # Before a fresh unit of their own, its learners train an empty region's
                # spans up to their epoch, and those of a region behind it (its learners
                # fewer or slower: the pools are the same size) of the epochs before theirs.
                limits = {r: front[to] - 1 if live[r] else front[to] for r in self.pools
                          if r != to and (not live[r] or front[r] < front[to])}  # fmt: skip
                if not limits:
                    continue
                sources += [r for r in limits if r not in sources]
                waiting = len(self.ledger(to).given_back())
                keep = max(live[to], self.waiting.get(to, 0))
                if not waiting and self._left.get(to):  # all taken: they outrun the looks
                    keep = min(2 * keep, MOST_WAITING)
                self.waiting[to] = keep
                # A pool behind: its units left of those epochs, shared by the learners of
                # both regions (its own go on taking them), so that both end them together.
                behind = sum(-(-self.ledger(r).fresh_before(limits[r] + 1) * live[to]
                               // (live[to] + live[r])) for r in limits if live[r])  # fmt: skip
                keep = min(max(keep, behind), MOST_WAITING)
                while keep > waiting and self._move(limits, to, live):
                    waiting, offered = waiting + 1, offered + 1
                self._left[to] = waiting
        except (OSError, ValueError) as exc:  # DataError, LayoutError are ValueErrors
            self._repair = True
            self.log.error("cannot offer the data of %s to the learners of other regions: "
                           "%s", ", ".join(sources), exc)  # fmt: skip
        return offered

    def _move(self, limits: Mapping[str, int], to: str, live: Mapping[str, int]) -> bool:
        """Move one span to ``to`` from one of the regions in ``limits`` (each up to the
        epoch given), taking turns."""
        order = sorted(limits)
        for k in range(len(order)):
            src = order[(self._turn + k) % len(order)]
            got = self.ledger(src).give(to, self.who, limits[src])
            if got is not None:
                self._turn = (self._turn + k + 1) % len(order)
                self._offer(src, to, *got, "no learner is in it" if not live[src] else
                            f"its pool is behind {to}'s")  # fmt: skip
                return True
        return False

    def _offer(self, src: str, to: str, span: Span, claim: str, why: str = "") -> None:
        record = {"from": src, "claim": claim, "span": list(astuple(span))}
        if self.ledger(to).store.units.offer_unit(offer_claim(src, claim), record):
            self.log.info("epoch %d unit %d (windows %d-%d) of %s's data offered to the "
                          "learners of %s%s", span.epoch, span.unit, span.start, span.end,
                          src, to, f" ({why})" if why else "")  # fmt: skip

    def _offer_moved(self, empty: list[str]) -> int:
        """Offer what a claim names but was not offered (a look cut short)."""
        count, offered = 0, {}
        for src in empty:
            for claim, (to, span) in self.ledger(src).moved().items():
                if to not in offered:  # read once a look
                    offered[to] = dict(self.ledger(to)._offered())
                if offer_claim(src, claim) not in offered[to]:
                    self._offer(src, to, span, claim)
                    count += 1
        return count
