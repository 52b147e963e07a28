"""What the syncers do with data units (docs/data.md "Units"): the spans a silent learner
held, released for others (``SilentReleases``); a region with no learner, or one behind,
has its pool offered to the learners of other regions (``UnitOffers``)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import astuple
from typing import Any

from diloco.learner_loop import resume_step
from diloco.units import Span, UnitPlan, cut
from flows.ledger import BucketLedger, offer_claim, region_ledger
from storage_layout.store import RunStore

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

    def __init__(self, store_of: Callable[[str], RunStore], learners: Mapping[str, str],
                 plan: UnitPlan, log: Any, pools: Mapping[str, tuple[int, int]]):  # fmt: skip
        # ``store_of(region)``: that region's bucket alone, this process its writer (its
        # claims tagged with the run's key where it holds one, its faults its own)
        self.store_of = store_of
        # ``learners`` as given, not a copy: the syncer's store adds those joiners add
        self.learners = learners
        self.plan, self.log = plan, log
        self.pools = dict(pools)
        self._ledgers: dict[str, BucketLedger] = {}
        self._repair = True  # look for claims without their offer (at the start, after an error)
        self._turn = 0  # the empty region whose spans go first: they take turns
        self.waiting: dict[str, int] = {}  # region -> how many spans to keep waiting there
        self._left: dict[str, int] = {}  # region -> spans waiting there after the last look

    def ledger(self, region: str) -> BucketLedger:
        if region not in self._ledgers:
            store = self.store_of(region)
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
            ledger = self.ledger(src)
            got = ledger.give(to, ledger.store.writer, limits[src])
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
