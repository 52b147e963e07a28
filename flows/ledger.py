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

from collections.abc import Mapping, Sequence
from dataclasses import astuple
from typing import Any

from diloco.data import DataError
from diloco.units import Span, UnitPlan, cut
from storage_layout.store import RunStore


def region_pools(learners: Mapping[str, str]) -> dict[str, tuple[int, int]]:
    """Each region's pool of units (``diloco.units.pool_unit``): the regions that have
    learners, in sorted order."""
    regions = sorted(set(learners.values()))
    return {r: (i, len(regions)) for i, r in enumerate(regions)}


def region_ledger(store: RunStore, plan: UnitPlan, learners: Mapping[str, str],
                  region: str) -> BucketLedger:  # fmt: skip
    """The ledger of ``region``'s pool, in ``store`` (a store of that region's bucket)."""
    mine = [lid for lid, r in learners.items() if r == region]
    return BucketLedger(store, plan, mine, region_pools(learners)[region])


class BucketLedger:
    """The ledger of one pool (a region's) in ``store``'s home bucket (the region's own),
    for its ``learners``."""

    def __init__(self, store: RunStore, plan: UnitPlan, learners: Sequence[str],
                 pool: tuple[int, int] = (0, 1)):  # fmt: skip
        self.store, self.plan, self.learners = store, plan, list(learners)
        self.pool = pool
        # learner -> (newest record read, spans held, [(claim, span) given back])
        self._read: dict[str, tuple[int, list[Span], list[tuple[str, Span]]]] = {}
        self._fresh = 0  # the newest fresh claim number seen

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
        for span, claim in self._pool():  # given back first, oldest epoch first
            if self.store.claim_returned(claim, learner):
                return self._took(learner, span, claim)
        while True:
            self._fresh = self.store.claim_fresh_unit(learner, self._fresh or None)
            span = self.plan.fresh(self._fresh - 1, self.pool)
            if span.windows:  # a unit of chunks shorter than a window holds none
                return self._took(learner, span, f"fresh-{self._fresh}")

    def _took(self, learner: str, span: Span, claim: str) -> Span:
        self.store.put_unit_record(learner, {"take": list(astuple(span)), "claim": claim})
        return span

    def orphans(self) -> list[str]:
        """Claims no learner's ledger took: a take that died between its claim and its
        record (its span is trained by no one)."""
        taken = set()
        for lid in self.learners:
            prefix = self.store.layout.unit_records(lid)
            for n, record in self.store.unit_records(lid):
                if isinstance(record, dict) and "take" in record:
                    taken.add(record.get("claim"))
                elif not isinstance(record, dict):
                    raise DataError(f"{prefix}/s{n:012d}.json is not a record")
        fresh = [f"fresh-{n}" for n in self.store.fresh_claims()  # an empty unit: no take
                 if self.plan.fresh(n - 1, self.pool).windows]  # fmt: skip
        returned = sorted(self.store.returned_claims())
        return [c for c in fresh + returned if c not in taken]

    def release(self, learner: str, at: int) -> None:
        _, back = cut(self.spans(learner), at)
        if back:
            returned = [list(astuple(s)) for s in back]
            self.store.put_unit_record(learner, {"release": at, "returned": returned})
