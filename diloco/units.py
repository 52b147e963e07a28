"""Data in units taken as learners need them (``data.assign = "units"``), so that a run's
learners may come and go without a document trained twice in an epoch or one skipped.

With ``data.assign = "slots"`` a prepared data set's chunks are dealt to the run's
``topology.learners`` slots once and for all (``dataset.assignment``): a slot no one
holds leaves its share untrained. (Units are the default for a new run through
buckets, and for one in memory on a prepared data set; text in memory, and runs started
on slots, are dealt: ``run_data.settle_assign``. Text taken in units is cut into chunks
as a data set is: ``dataset.TextChunks``.)
Here the training chunks are instead cut, every epoch, into **units** of
``shuffle_chunks`` consecutive chunks of an order shuffled by ``(seed, epoch)`` (the
whole data set, not one learner's share), and each unit's windows are shuffled by
``(seed, epoch, unit)``: which windows a unit holds, and in what order, is the same for
everyone. A learner's stream of windows is the concatenation of the
**spans** it took from a **ledger**, in the order it took them: a span is a unit's
windows ``[start, end)``. Batch ``b`` is windows ``b * batch_size ...`` of that stream,
as with the dealt reader, so the learner's step is still its data position.

The ledger hands out spans one at a time, each to one learner: first what departed
learners gave back (oldest epoch first), then the next unit no one has had. A learner
that leaves gives back its stream from the window it would resume from (its checkpoint's
or its newest committed send's step, whichever is later): the rest of the unit it was in
and any unit it took beyond. What it trained past that point was never merged, so the
windows given back are trained once, by whoever takes them; its slot, if someone joins
it later, resumes at the same point and takes new spans from there. The simulator keeps
the ledger in memory (``MemoryLedger``), or, through buckets, in the run's home bucket
(``flows.ledger.BucketLedger``).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from diloco.dataset import (
    SHUFFLE_CHUNKS,
    DataError,
    Dataset,
    Group,
    WindowReader,
    chunk_windows,
    read_group,
)

UNIT_SEED = 0x756E6974  # "unit": the units' shuffles are not any dealt reader's


@dataclass(frozen=True, order=True)
class Span:
    """Windows ``[start, end)`` of unit ``unit`` of epoch ``epoch``."""

    epoch: int
    unit: int
    start: int
    end: int

    @property
    def windows(self) -> int:
        return self.end - self.start


def cut(spans: list[Span], at: int) -> tuple[list[Span], list[Span]]:
    """A stream of ``spans`` cut at window ``at``: the spans (or part of one) before it,
    and those from it on (what a learner that resumes at ``at`` gives back)."""
    kept, back, seen = [], [], 0
    for span in spans:
        if seen + span.windows <= at:
            kept.append(span)
        elif seen >= at:
            back.append(span)
        else:
            split = span.start + at - seen
            kept.append(Span(span.epoch, span.unit, span.start, split))
            back.append(Span(span.epoch, span.unit, split, span.end))
        seen += span.windows
    return kept, back


class UnitPlan:
    """The units of a prepared data set's training chunks: their chunks and windows per
    epoch, and a unit read (its chunks, and its windows in their shuffled order)."""

    def __init__(self, dataset: Dataset, context: int, seed: int,
                 shuffle_chunks: int = SHUFFLE_CHUNKS):  # fmt: skip
        self.dataset, self.context, self.seed = dataset, context, seed
        self.shuffle_chunks = shuffle_chunks
        self.chunks = dataset.chunks("train")
        self.per_chunk = chunk_windows(self.chunks, context)
        if not self.per_chunk.sum():
            raise DataError(f"{dataset.url} holds no training window of {context + 1} tokens")
        self.units = -(-len(self.chunks) // shuffle_chunks)
        self._order: tuple[int, np.ndarray | None] = (-1, None)
        self._lock = threading.Lock()

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's chunk order (the newest epoch's kept: it is linear in the chunks)."""
        with self._lock:
            if self._order[0] != epoch:
                rng = np.random.default_rng((self.seed, epoch, UNIT_SEED))
                self._order = (epoch, rng.permutation(len(self.chunks)))
            return self._order[1]

    def unit_chunks(self, epoch: int, unit: int) -> np.ndarray:
        s = self.shuffle_chunks
        return self.order(epoch)[unit * s : (unit + 1) * s]

    def windows(self, epoch: int, unit: int) -> int:
        return int(self.per_chunk[self.unit_chunks(epoch, unit)].sum())

    def fresh(self, k: int, pool: tuple[int, int]) -> Span:
        """The whole of pool ``pool``'s ``k``-th fresh unit (``pool_unit``); it holds no
        window when its chunks are all shorter than one (a ledger skips it)."""
        epoch, unit = pool_unit(k, pool, self.units)
        return Span(epoch, unit, 0, self.windows(epoch, unit))

    def read(self, epoch: int, unit: int) -> Group:
        """The unit's chunks and its windows in the order every holder of it follows."""
        return read_group(self.dataset, self.chunks, self.per_chunk,
                          self.unit_chunks(epoch, unit), self.context,
                          (self.seed, epoch, unit, UNIT_SEED))  # fmt: skip


class UnitLedger(Protocol):
    """Who holds which spans: ``spans(learner)`` in the order it took them; ``take``
    gives it the next span no one holds; ``release`` takes back its stream from window
    ``at`` on (``cut``); ``given_back`` lists what was given back and not taken yet.
    ``plan``: the units it hands out."""

    plan: UnitPlan

    def spans(self, learner: str) -> list[Span]: ...

    def take(self, learner: str) -> Span: ...

    def release(self, learner: str, at: int) -> None: ...

    def given_back(self) -> list[Span]: ...


def pool_unit(k: int, pool: tuple[int, int], units: int) -> tuple[int, int]:
    """The epoch and unit of the ``k``-th fresh unit (from 0) of pool ``(i, n)``: pool
    ``i`` of ``n`` has every ``n``-th unit of the run's sequence (epoch after epoch), so
    pools never share a unit. A pipeline run has a pool per region (a learner reads and
    writes its own region's bucket only), the simulator in memory one."""
    i, n = pool
    return divmod(k * n + i, units)


class MemoryLedger:
    """The simulator's ledger (one process holds every learner): one pool."""

    def __init__(self, plan: UnitPlan, pool: tuple[int, int] = (0, 1)):
        self.plan, self.pool = plan, pool
        self.fresh = 0  # units handed out so far, over all epochs
        self.returned: list[Span] = []  # given back, oldest epoch first
        self.held: dict[str, list[Span]] = {}
        self._lock = threading.Lock()  # readers may take in their own threads

    def spans(self, learner: str) -> list[Span]:
        with self._lock:
            return list(self.held.get(learner, []))

    def take(self, learner: str) -> Span:
        with self._lock:
            if self.returned:
                span = self.returned.pop(0)
            else:
                span = Span(0, 0, 0, 0)
                while not span.windows:  # a unit of chunks shorter than a window: none
                    span = self.plan.fresh(self.fresh, self.pool)
                    self.fresh += 1
            self.held.setdefault(learner, []).append(span)
            return span

    def release(self, learner: str, at: int) -> None:
        with self._lock:
            kept, back = cut(self.held.get(learner, []), at)
            self.held[learner] = kept
            self.returned = sorted(self.returned + back)

    def given_back(self) -> list[Span]:
        with self._lock:
            return list(self.returned)


class RegionalLedger:
    """One ledger per region's pool, each learner taking from its own region's.
    ``offers``: called with the members at each look the syncers take at them (``tend``):
    it moves the pool of a region no member is in to the others (``flows.unit_offers.UnitOffers``,
    as the pipeline's syncers do)."""

    def __init__(self, ledgers: Mapping[str, UnitLedger], region_of: Mapping[str, str],
                 offers: Callable[[Collection[str]], object] | None = None):  # fmt: skip
        # ``region_of`` as given, not a copy: the store adds the learners joiners add
        self.ledgers, self.region_of = dict(ledgers), region_of
        self.plan = next(iter(self.ledgers.values())).plan
        self.offers = offers

    def tend(self, members: Collection[str]) -> Collection[str]:
        """``members``, after the pools were tended for them (``offers``)."""
        if self.offers is not None:
            self.offers(members)
        return members

    def _of(self, learner: str) -> UnitLedger:
        return self.ledgers[self.region_of[learner]]

    def spans(self, learner: str) -> list[Span]:
        return self._of(learner).spans(learner)

    def take(self, learner: str) -> Span:
        return self._of(learner).take(learner)

    def release(self, learner: str, at: int) -> None:
        self._of(learner).release(learner, at)

    def given_back(self) -> list[Span]:
        return sorted(s for ledger in self.ledgers.values() for s in ledger.given_back())


class UnitReader(WindowReader):
    """A learner's reader over the spans it takes from ``ledger`` (the ``ShardReader``
    interface: ``position``, batches served, is its state, with the ledger's spans).

    Setting ``position`` (a resume) reads the learner's spans again: a release may have
    cut them. A span is taken when the stream reaches the one before it (one span
    ahead), so that its unit is read while the one before is served (``WindowReader``):
    no unit read stops training, whatever the storage's latency. ``background``: the
    take too is made in the reader's thread (a learner over a bucket, where a take is a
    few requests); the simulator takes in its own thread, in its own order, so that a
    run is the same whenever it is simulated. ``settle`` waits for a take under way
    (before the ledger is read or written from another thread: a release)."""

    def __init__(self, plan: UnitPlan, learner: str, ledger: UnitLedger, batch_size: int,
                 position: int = 0, background: bool = False):  # fmt: skip
        self.plan, self.learner, self.ledger = plan, learner, ledger
        self.batch_size, self.context = batch_size, plan.context
        self.background = background
        self._ahead: Future[Span] | None = None  # the take under way (background)
        super().__init__(plan.read, f"unit-reader-{learner}", position)

    def settle(self) -> None:
        """Wait for the take under way, if any: its span is then in the ledger (its
        error, if it failed, is raised here)."""
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            self._append(ahead.result())

    def _moved(self) -> None:
        self.settle()
        self._spans: list[Span] = self.ledger.spans(self.learner)
        self._starts = [0]
        for span in self._spans:
            self._starts.append(self._starts[-1] + span.windows)

    def _append(self, span: Span) -> None:
        self._spans.append(span)
        self._starts.append(self._starts[-1] + span.windows)

    def _take_ahead(self) -> Span:  # in the reader's thread: the take, then its unit
        span = self.ledger.take(self.learner)
        self.prefetch((span.epoch, span.unit))
        return span

    def window(self, w: int) -> np.ndarray:
        """Window ``w`` of this learner's stream: ``context + 1`` tokens."""
        while w >= self._starts[-1]:
            if self._ahead is not None:
                self.settle()
            else:
                self._append(self.ledger.take(self.learner))
        i = bisect.bisect_right(self._starts, w) - 1
        if i + 1 == len(self._spans) and self._ahead is None:  # the next span, ahead
            if self.background:
                self._ahead = self._pool.submit(self._take_ahead)
            else:
                self._append(self.ledger.take(self.learner))
        span = self._spans[i]
        unit = self.group((span.epoch, span.unit))
        if i + 1 < len(self._spans):
            self.prefetch((self._spans[i + 1].epoch, self._spans[i + 1].unit))
        return unit.window(span.start + w - self._starts[i], self.context)
