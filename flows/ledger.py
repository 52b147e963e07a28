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
from diloco.loops import resume_step
from diloco.units import Span, UnitPlan, cut
from storage_layout.audit import AuditReport
from storage_layout.store import RunStore


def region_pools(learners: Mapping[str, str]) -> dict[str, tuple[int, int]]:
    """Each region's pool of units (``diloco.units.pool_unit``): the regions that have
    learners, in sorted order."""
    regions = sorted(set(learners.values()))
    return {r: (i, len(regions)) for i, r in enumerate(regions)}


def region_ledger(store: RunStore, plan: UnitPlan, learners: Mapping[str, str],
                  region: str, fenced: Callable[[], None] | None = None) -> BucketLedger:  # fmt: skip
    """The ledger of ``region``'s pool, in ``store`` (a store of that region's bucket)."""
    mine = [lid for lid, r in learners.items() if r == region]
    return BucketLedger(store, plan, mine, region_pools(learners)[region], fenced)


class BucketLedger:
    """The ledger of one pool (a region's) in ``store``'s home bucket (the region's own),
    for its ``learners``."""

    def __init__(self, store: RunStore, plan: UnitPlan, learners: Sequence[str],
                 pool: tuple[int, int] = (0, 1),
                 fenced: Callable[[], None] | None = None):  # fmt: skip
        self.store, self.plan, self.learners = store, plan, list(learners)
        self.pool = pool
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
        for n, record in self.store.unit_records(learner, after=last):
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

    def _pool(self) -> list[tuple[Span, str]]:
        claimed = self.store.returned_claims()
        return sorted((span, claim) for lid in self.learners
                      for claim, span in self._replay(lid)[1] if claim not in claimed)  # fmt: skip

    def given_back(self) -> list[Span]:
        return [span for span, _ in self._pool()]

    def take(self, learner: str) -> Span:
        if self.fenced is not None:
            self.fenced()
        if learner not in self._owed:  # once a process: its own claims with no record
            self._owed[learner] = self._orphans_of(learner)
        if self._owed[learner]:
            return self._took(learner, *self._owed[learner].pop(0))
        for span, claim in self._pool():  # given back first, oldest epoch first
            if self.store.claim_returned(claim, learner):
                return self._took(learner, span, claim)
        while True:
            self._fresh = self.store.claim_fresh_unit(learner, self._fresh or None)
            span = self.plan.fresh(self._fresh - 1, self.pool)
            if span.windows:  # a unit of chunks shorter than a window holds none
                return self._took(learner, span, f"fresh-{self._fresh}")

    def _took(self, learner: str, span: Span, claim: str) -> Span:
        newest = self._read.get(learner, (0,))[0]  # replayed by the take: no listing
        self.store.put_unit_record(learner, {"take": list(astuple(span)), "claim": claim},
                                   newest or None)  # fmt: skip
        return span

    def _orphans_of(self, learner: str) -> list[tuple[Span, str]]:
        """The spans ``learner`` claimed and recorded no take of (its process died
        between the two), with their claims: it takes them again before anything else, so
        no unit is left claimed and trained by no one. Only the claim's own learner may,
        as only one process of a learner trains (its generation): another learner's
        orphan might be a take still under way."""
        back = {claim: span for lid in self.learners for claim, span in self._replay(lid)[1]}
        out = []
        for claim in self.orphans():
            record = self.store.unit_claim(claim)
            if isinstance(record, dict) and record.get("learner") == learner:
                if claim.startswith("fresh-"):
                    out.append((self.plan.fresh(int(claim[6:]) - 1, self.pool), claim))
                elif claim in back:
                    out.append((back[claim], claim))
        return sorted(out)

    def orphans(self) -> list[str]:
        """Claims no learner's ledger took: a take that died between its claim and its
        record (its span is trained by no one, until its learner takes again:
        ``_orphans_of``)."""
        for lid in self.learners:  # each learner's new records (checked as they are read)
            self._replay(lid)
        taken = self._taken
        fresh = [f"fresh-{n}" for n in self.store.fresh_claims()  # an empty unit: no take
                 if self.plan.fresh(n - 1, self.pool).windows]  # fmt: skip
        returned = sorted(self.store.returned_claims())
        return [c for c in fresh + returned if c not in taken]

    def release(self, learner: str, at: int) -> None:
        _, back = cut(self.spans(learner), at)
        if back:
            returned = [list(astuple(s)) for s in back]
            self.store.put_unit_record(learner, {"release": at, "returned": returned})


def audit_units(report: AuditReport) -> None:
    """The audit's ``data-once`` across learners when the run takes its data in units
    (``storage_layout.audit`` checks each learner's own): the windows that each
    learner's merged batches (``report.data``, positions of its stream) read, through
    its region's ledger, are read by no other learner's; and each region's pool goes
    into ``report.units``. A ledger record that does not check (a forged span, a release
    that gives back what its learner did not hold) fails the invariant by its key."""
    from diloco.config import validate_config
    from diloco.simulate import unit_plan

    urls, run = report.regions, report.run
    spec = RunStore(run, urls, next(iter(urls)), writer="audit").read_spec()
    cfg = validate_config({**spec["config"], "pipeline": {}})
    if cfg.data.assign != "units":
        return
    plan, learners, batch = unit_plan(cfg), dict(spec["learners"]), cfg.data.batch_size
    merged: dict[tuple[int, int], list[tuple[int, int, str]]] = {}
    for region in region_pools(learners):
        store = RunStore(run, urls, region, writer="audit")
        ledger = region_ledger(store, plan, learners, region)
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
            report.units[region] = {
                "units_handed_out": len(store.fresh_claims()),
                "given_back_waiting": [list(astuple(s)) for s in ledger.given_back()],
                "orphan_claims": ledger.orphans(),
            }
        except DataError as exc:
            report.fail("data-once", f"{region}: {exc}")
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


class SilentReleases:
    """Gives back the data of a learner silent past ``pipeline.member_timeout`` while it
    trained (its newest status says "training": not one compiling or resuming, which may
    take long, nor one paused between flow runs, preempted or done) with ``data.assign =
    "units"``, which a syncer has dropped from the quorum: without it, its spans would
    wait for its slot's next learner (a restart or a joiner), and an epoch would go on
    without them. Run by the syncers (``PipelineSyncerTransport.members``),
    in two looks at least ``grace`` seconds apart:

    1. **fence**: claim the learner's next generation for no process
       (``RunStore.fence``, an exclusive create of exactly that number), so that its
       process, if it is only cut off, commits nothing more; one syncer wins, and none
       acts when the learner's newest generation is already a fence, or when the learner
       never wrote a status or holds no span;
    2. **release**, ``grace`` seconds later (a commit that passed the process's last
       check lands by then): its stream from where its slot resumes (``resume_step`` of
       its newest checkpoint and newest committed send, as a restart reads them) is
       given back, as a preempted learner gives it back itself.

    A learner heard from again is left alone; one silent again is fenced again."""

    def __init__(self, store: Any, plan: UnitPlan, batch: int, log: Any, grace: float = 10.0):
        self.store, self.plan, self.batch, self.log, self.grace = store, plan, batch, log, grace
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

    def _fence(self, learner: str, region: str) -> bool:
        own = self.store.writer_for(learner)
        newest = own.newest_generation(learner)
        if newest == 0:
            return False  # never started: it holds nothing (and its slot stays vacant)
        record = own.generation(learner, newest)
        if isinstance(record, dict) and "fence" in record:
            return False  # given back on its behalf already, nobody started since
        if not region_ledger(own, self.plan, self.store.learners, region).spans(learner):
            return False
        return own.fence(learner, newest, "silent past pipeline.member_timeout")

    def _release(self, learner: str, region: str) -> None:
        own = self.store.writer_for(learner)
        steps = own.checkpoint_steps(learner)
        step = resume_step(steps[-1] if steps else 0, self.store.sent_so_far(learner)[1])
        ledger = region_ledger(own, self.plan, self.store.learners, region)
        back = cut(ledger.spans(learner), step * self.batch)[1]
        ledger.release(learner, step * self.batch)
        self.log.warning("learner %s is silent: its data from step %d on (%d windows) is "
                         "given back to the learners of %s", learner, step,
                         sum(s.windows for s in back), region)  # fmt: skip
