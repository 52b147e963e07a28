"""Data units of a run (``store.units``): learners' data ledgers, fresh units claimed, spans
given back and offered.

A part of a ``storage_layout.store.RunStore``, over its buckets and ``layout.py``."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

from storage_layout.commit import patiently
from storage_layout.part import Part, Written, read_jsons

log = logging.getLogger(__name__)


class Units(Part):
    def put_unit_record(self, learner: str, record: Mapping[str, Any],
                        after: int | None = None) -> int:  # fmt: skip
        """Add ``record`` (a span taken, or a stream given back) to ``learner``'s data
        ledger in this store's home (its region's bucket), written once; its number.
        ``after``: the newest record number the caller saw (no listing then)."""
        return self.store.put_next(self.layout.unit_records(learner), lambda n: self.store.stamped(record),
                             after)  # fmt: skip

    def put_unit_record_at(self, learner: str, n: int, record: Mapping[str, Any]) -> bool:
        """Write ``record`` as exactly record ``n`` of ``learner``'s data ledger (an
        exclusive create); False when another writer holds that number: a record whose
        meaning depends on the ones before it (a stream given back) is never written
        after one its writer did not read."""
        return self.store.claim(self.store.numbered_claim(self.layout.unit_records(learner), n),
                            self.store.stamped(record))  # fmt: skip

    def unit_records(self, learner: str, after: int = 0) -> list[tuple[int, Any]]:
        """``learner``'s data ledger records numbered above ``after``, oldest first, as
        stored (JSON: check them)."""
        prefix = self.layout.unit_records(learner)
        numbers = [n for n in self.store.claim_numbers(self.home, prefix) if n > after]
        keys = [self.store.numbered_claim(prefix, n) for n in numbers]
        return list(
            zip(numbers, read_jsons(self.home, keys, Written, self.store.seal_of), strict=True)
        )

    def claim_fresh_unit(self, learner: str, after: int | None = None,
                         offer: str | None = None) -> int:  # fmt: skip
        """Claim the next unit no one had (an exclusive create: each unit once); returns
        its claim's number N (the pool's unit N - 1, ``diloco.units.pool_unit``).
        ``after``: the newest claim number the caller saw, to try the next without a
        listing. ``offer``: claimed by a syncer to offer it to that region's learners
        (``offer_unit``), not by ``learner`` to train it."""
        fields = {"learner": learner, **({"offer": offer} if offer else {})}
        return self.store.put_next(self.layout.units_fresh(), lambda n: self.store.stamped(fields), after,
                             dense=True)  # fmt: skip

    def has_fresh_claim(self, n: int) -> bool:
        """Whether fresh claim ``n`` is written (one request)."""
        key = self.store.numbered_claim(self.layout.units_fresh(), n)
        return patiently(lambda: self.home.exists(key), key)

    def fresh_claims(self) -> list[int]:
        """The numbers of the fresh units' claims (one listing)."""
        return self.store.claim_numbers(self.home, self.layout.units_fresh())

    def fresh_frontier(self) -> int:
        """The number of fresh claims made in turn from the first (one listing): claims
        are dense (``claim_fresh_unit``), so one beyond a gap was made by no claimer of
        the run and moves no frontier."""
        n = 0
        for claim in self.fresh_claims():
            if claim != n + 1:
                break
            n = claim
        return n

    def unit_claim(self, claim: str) -> Any:
        """The record of a unit's claim as stored (JSON: check it): ``fresh-N`` (fresh
        claim N) or the name of a span given back (``units_returned``)."""
        key = self._claim_key(claim)
        return self.read_claim(self.home, key, Written)

    def _claim_key(self, claim: str) -> str:
        fresh = claim.removeprefix("fresh-")
        if fresh != claim and fresh.isdigit():
            return self.store.numbered_claim(self.layout.units_fresh(), int(fresh))
        return self.store.claim_key(self.layout.units_returned(claim))

    def claim_returned(self, claim: str, learner: str, offer: str | None = None) -> bool:
        """Claim span ``claim`` that someone gave back, or that a syncer offered here
        (an exclusive create); False when another learner claimed it first. ``offer``: as
        in ``claim_fresh_unit``."""
        fields = {"learner": learner, **({"offer": offer} if offer else {})}
        return self.store.claim(self.store.claim_key(self.layout.units_returned(claim)),
                            self.store.stamped(fields))  # fmt: skip

    def returned_claims(self) -> set[str]:
        """The claims of spans given back, taken so far (one listing)."""
        return set(self.store.claim_names(self.home, self.layout.units_returned_folder()))

    def unit_claims(self, claims: list[str]) -> list[Any]:
        """The records of ``claims`` (as ``unit_claim``), read 64 at a time."""
        return read_jsons(
            self.home, [self._claim_key(c) for c in claims], Written, self.store.seal_of
        )

    def offer_unit(self, claim: str, record: Mapping[str, Any]) -> bool:
        """Offer a span of another region's pool to this region's learners
        (``units_offered``, an exclusive create); False if it is offered already."""
        return self.store.claim(self.store.claim_key(self.layout.units_offered(claim)),
                            self.store.stamped(record))  # fmt: skip

    def unit_offers(self, known: Collection[str] = ()) -> dict[str, Any]:
        """The spans offered to this region (claim -> record as stored: check it), but
        those in ``known`` (records are written once: a caller keeps what it read)."""
        claims = sorted(self.offered_claims() - set(known))
        keys = [self.store.claim_key(self.layout.units_offered(c)) for c in claims]
        return dict(
            zip(claims, read_jsons(self.home, keys, Written, self.store.seal_of), strict=True)
        )

    def offered_claims(self) -> set[str]:
        """The names of the spans offered to this region (one listing)."""
        return set(self.store.claim_names(self.home, self.layout.units_offered_folder()))
