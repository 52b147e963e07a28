"""The syncer loop (``SyncerLoop``): when a syncer merges (quorum, adaptive grace window,
step-time estimate) and how a run ends. One program for the simulator, the tests and the
pipeline (``diloco.loops``: what it yields, its clock and transport). ``docs/algorithm.md``
says why each rule was chosen."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from diloco import records
from diloco.config import RunConfig
from diloco.loops import Clock, Emit, Superseded, SyncerTransport, Unreadable, Wait, nothing
from diloco.model import is_embedding
from diloco.outer import Contribution
from diloco.syncer import (
    FragmentSyncer,
    GlobalVersion,
    estimate_step_seconds,
    grace_window,
)
from diloco.syncer import budget_spent as _budget_spent
from diloco.syncer import quorum_met as _quorum_met
from diloco.tensors import as_tensors

log = logging.getLogger(__name__)


@dataclass
class _MergeClock:
    first_arrival: float | None = None
    merge_at: float | None = None


def _implausible(seq: int, cfg: RunConfig) -> str:
    """A sequence number no learner can reach: it sends at most once per inner step."""
    return (f"seq {seq} is beyond the {cfg.learner_step_cap} inner steps a learner can take "
            "(at most one send per step): a forged or corrupt marker")  # fmt: skip


class SyncerLoop:
    """The syncer of a set of fragments: collect contributions, merge each fragment when
    its quorum is met and its grace window is over, publish, and end when every learner
    is done (a last merge of everything pending, with no grace: nothing more comes)."""

    def __init__(
        self,
        cfg: RunConfig,
        fragments: Sequence[int],
        learners: Sequence[str],
        transport: SyncerTransport,
        clock: Clock,
        emit: Emit = nothing,
        logger: Any = log,
    ):
        self.cfg = cfg
        self.learners = list(learners)
        self.transport = transport
        self.clock = clock
        self.emit = emit
        self.log = logger
        self.gamma = 0.0 if cfg.mode == "diloco" else cfg.topology.grace
        self.syncers: dict[int, FragmentSyncer] = {}
        self.seen: dict[tuple[str, int], int] = {}  # (learner, fragment) -> newest seq read
        self.implausible: set[tuple[str, int, int]] = set()  # refused, reported once each
        self.clocks: dict[int, _MergeClock] = {}
        self.step_seconds: dict[int, float] = {}  # the last step-time estimate per fragment
        self.last: dict[int, Mapping[str, Any]] = {}  # the newest version's record
        self.lost: dict[int, list[int]] = {}  # unreadable versions the next one records
        # Fragments whose in-memory state holds an unpublished merge that a reload has
        # yet to replace: they merge nothing until it does (``_reload``).
        self.unloaded: set[int] = set()
        for p in fragments:
            self.load(p)

    def load(self, p: int) -> None:
        """(Re)build fragment ``p`` from its newest committed version."""
        outer = self.cfg.outer
        stored = self.transport.load_fragment(p, outer.max_staleness)
        syncer = FragmentSyncer(
            p, stored.params, outer, self.learners, is_embedding, version=stored.version,
            opt_leaves=stored.opt_leaves, cursor=stored.meta.get("cursor"),
            merged=stored.meta.get("merged"), progress=stored.meta.get("progress"),
            steps=stored.meta.get("outer_steps"), ids=records.ids_of(stored.meta),
            sink=getattr(self.transport, "version_sink", None),
            block_size=self.cfg.topology.block_size, warmup_steps=self.cfg.inner.warmup_steps,
        )  # fmt: skip
        syncer.history.update({v: as_tensors(h) for v, h in stored.history.items()})
        syncer.window_tokens.update(records.window_tokens_of(stored.meta))
        if stored.lost:
            syncer.version = max(stored.lost)  # numbering goes on above them
            self.lost[p] = sorted(stored.lost)
            self.log.error("fragment %d: versions %s cannot be read; going on from version %d "
                           "(their merges are redone)", p, self.lost[p], stored.version)  # fmt: skip
        self.syncers[p] = syncer
        # What was refused since that version is refused (and recorded) again when read.
        self.implausible = {k for k in self.implausible if k[1] != p}
        for learner in self.learners:
            self.seen[(learner, p)] = syncer.cursor.get(learner, 0)
        self.clocks[p] = _MergeClock()
        self.step_seconds.setdefault(p, 0.0)
        self.last[p] = stored.meta
        self.unloaded.discard(p)

    def _reload(self, p: int) -> None:
        """Forget fragment ``p``'s unpublished merge and read it back from its newest
        version. If the read fails too, ``p`` stays unloaded: it merges nothing, and the
        next ``collect`` tries again. (Publishing on top of the failed merge would skip a
        version number and merge its contributions into a version that records none.)"""
        self.unloaded.add(p)
        self.load(p)

    def _loaded(self, p: int) -> FragmentSyncer:
        """Fragment ``p``'s syncer, read back first if a failed publish left it unloaded."""
        if p in self.unloaded:
            self.load(p)
        return self.syncers[p]

    @property
    def versions(self) -> dict[int, int]:
        return {p: s.version for p, s in self.syncers.items()}

    def admit(self, learner: str) -> None:
        """Take ``learner``'s contributions from now on: a learner the transport counts as
        a member that the run's spec does not list (a slot a joiner added, ``diloco
        join``), merged from the next version on like any other."""
        self.learners.append(learner)
        for p, syncer in self.syncers.items():
            syncer.learners = syncer.learners | {learner}
            self.seen[(learner, p)] = syncer.cursor.get(learner, 0)
        self.log.warning("learner %s is admitted: its contributions are merged from the "
                         "next version on", learner)  # fmt: skip

    def collect(self) -> int:
        """Offer every new contribution; returns how many were read."""
        for learner in self.transport.members():
            if learner not in self.learners:
                self.admit(learner)
        for p in sorted(self.unloaded):
            try:
                self.load(p)
            except Exception as exc:  # a region down, a damaged read: the next look tries
                self.log.warning("fragment %d cannot be read back yet: %r", p, exc)
        found = 0
        for learner in self.learners:
            for p, syncer in self.syncers.items():
                if p in self.unloaded:
                    continue
                try:
                    items = self.transport.contributions(learner, p, self.seen[(learner, p)])
                except OSError as exc:
                    self.log.warning("cannot list %s's contributions: %s", learner, exc)
                    break  # its region is down: the other learners go on
                for item in self._newest_per_anchor(items):
                    if item.seq > self.cfg.learner_step_cap:
                        self._refuse(learner, p, item.seq, _implausible(item.seq, self.cfg))
                        continue  # and ``seen`` stays: the real ones below it still count
                    if isinstance(item, Unreadable) and item.forged:
                        self._refuse(learner, p, item.seq, item.reason)
                        continue  # the same: a forger must not hide the learner's real ones
                    self.seen[(learner, p)] = item.seq
                    if isinstance(item, Superseded):
                        syncer.supersede(learner, item.seq, item.by)
                        continue
                    if isinstance(item, Unreadable):
                        self.log.error("skipping an unreadable contribution: %s", item.reason)
                        syncer.reject(learner, item.seq, item.reason)
                        self.emit(
                            records.rejected(learner, p, item.seq, item.reason, self.clock.now())
                        )
                        continue
                    syncer.offer(item)
                    found += 1
        now = self.clock.now()
        for p, syncer in self.syncers.items():
            if syncer.pending and self.clocks[p].first_arrival is None:
                self.clocks[p].first_arrival = now
        return found

    def _newest_per_anchor(
        self, items: list[Contribution | Unreadable]
    ) -> list[Contribution | Unreadable | Superseded]:
        """``items`` (one learner's and fragment's, in seq order) with only the newest
        readable contribution of each anchor read in full: the older ones from that anchor
        are ``Superseded`` by it unread (under a slow or faulty store most sends are, and
        reading each cost the syncer its pace). Forged and implausible ones take no part.
        The list ends before the first one that is not settled yet (its data, or that of
        the newer one that would supersede it, cannot be read now): the next look
        takes it up from there."""
        settled: dict[int, Contribution | Unreadable | Superseded] = {}
        anchors: dict[tuple[str, int, int], list[Contribution]] = {}
        for item in items:
            if isinstance(item, Unreadable) or item.seq > self.cfg.learner_step_cap:
                settled[item.seq] = item
            else:
                anchors.setdefault(item.anchor, []).append(item)
        for sends in anchors.values():
            newest = None
            for c in sorted(sends, key=lambda c: c.seq, reverse=True):
                if newest is not None:
                    settled[c.seq] = Superseded(c.learner, c.fragment, c.seq, newest)
                    continue
                try:
                    full = self.transport.read(c)
                except OSError as exc:
                    self.log.warning("cannot read %s/%d of fragment %d yet: %s",
                                     c.learner, c.seq, c.fragment, exc)  # fmt: skip
                    break  # it and the older ones wait for the next look
                settled[c.seq] = full
                if isinstance(full, Contribution):
                    newest = c.seq
        out = []
        for item in items:
            if item.seq not in settled:
                break
            out.append(settled[item.seq])
        return out

    def _refuse(self, learner: str, p: int, seq: int, reason: str) -> None:
        """Reject, once, a contribution that must not move this syncer's listing position
        (a forged or implausible one): taking its seq would skip every real one below it."""
        if (learner, p, seq) in self.implausible:
            return
        self.implausible.add((learner, p, seq))
        self.log.error("rejecting %s/%d fragment %d: %s", learner, seq, p, reason)
        self.syncers[p].reject(learner, seq, reason)
        self.emit(records.rejected(learner, p, seq, reason, self.clock.now()))

    def due(self, finishing: bool = False) -> list[int]:
        """Fragments to merge now: quorum met and the grace window over. ``finishing`` (every
        learner is done): whatever is pending, at once: nothing more will come."""
        now, out = self.clock.now(), []
        quorum = self.cfg.quorum_over(len(self.transport.members()))
        for p, syncer in self.syncers.items():
            if p in self.unloaded:
                continue
            if finishing and syncer.pending:
                out.append(p)
                continue
            clock = self.clocks[p]
            if not _quorum_met(syncer.present, quorum):
                # A member that came back raises the quorum: its grace window starts
                # again once the quorum is met (a stale deadline would spin the loop).
                clock.merge_at = None
                continue
            if clock.merge_at is None:
                est = estimate_step_seconds(syncer.pending.values(), self.step_seconds[p])
                self.step_seconds[p] = est
                waited = now - (clock.first_arrival or now)
                grace = grace_window(
                    est, self.cfg.topology.tau, waited, self.transport.delivery_seconds(p),
                    self.gamma,
                )  # fmt: skip
                clock.merge_at = now + grace
            if finishing or now >= clock.merge_at:
                out.append(p)
        return out

    def merge(self, p: int) -> records.Record | None:
        """Merge fragment ``p``'s pending contributions and publish the version; returns
        its record, or None if nothing was merged or another syncer won the version."""
        syncer = self._loaded(p)
        self.clocks[p] = _MergeClock()
        try:
            outcome = syncer.merge()
        except Exception:
            self._reload(p)  # a half-done merge: forget it, read the fragment back
            raise
        now = self.clock.now()
        for r in outcome.rejected:
            c = r.contribution
            self.log.warning("%s", r)
            self.emit(records.rejected(c.learner, p, c.seq, r.reason, now))
        if outcome.version is None:
            return None
        return self._publish(p, outcome.version)

    def seal(self, p: int) -> records.Record | None:
        """At the run's end: publish the outcomes no merge will carry (see
        ``FragmentSyncer.seal``), so the versions account for every contribution."""
        try:
            gv = self._loaded(p).seal()
        except Exception:
            self._reload(p)
            raise
        return None if gv is None else self._publish(p, gv)

    def _publish(self, p: int, gv: GlobalVersion) -> records.Record | None:
        syncer, now = self.syncers[p], self.clock.now()
        members = self.transport.members()
        quorum = self.cfg.quorum_over(len(members))
        record = records.version(gv, now, self.last[p], members, quorum)
        if self.lost.get(p):
            record["lost_versions"] = self.lost[p]
        try:
            leaves = syncer.opt_leaves if syncer.in_memory else []  # streamed: written
            won = self.transport.publish(gv, leaves, record)
        except Exception:
            self._reload(p)  # nothing committed: forget the merge, read them again
            raise
        if not won:
            self.log.warning("fenced off at fragment %d v%d; reloading the winner's", p, gv.version)
            self._reload(p)
            return None
        self.last[p] = record
        self.lost.pop(p, None)
        self.emit(record)
        return record

    def budget_spent(self) -> bool:
        """Sharing the budget, whether the steps the versions of this syncer's fragments
        report merged (``FragmentSyncer.progress``, all learners) reach the run's budget."""
        return _budget_spent(self.cfg.shared_budget, self.cfg.budget_steps,
                             (s.progress for s in self.syncers.values()))  # fmt: skip

    def next_deadline(self) -> float:
        """Seconds until the earliest pending merge (inf when none is scheduled)."""
        now = self.clock.now()
        times = [c.merge_at for c in self.clocks.values() if c.merge_at is not None]
        return max(0.0, min(times) - now) if times else math.inf

    def run(self) -> Iterator[Wait]:
        """Until every learner is done and their every contribution is processed."""
        while True:
            # Before listing: nothing after.
            finishing = self.transport.learners_finished(self.budget_spent())
            self.collect()
            for p in self.due(finishing):
                try:
                    self.merge(p)
                except OSError as exc:
                    self.log.warning("publishing fragment %d failed, will retry: %s", p, exc)
            self.transport.tend()
            if finishing and not self.due(finishing=True):
                for p in self.syncers:
                    self.seal(p)
                return
            yield Wait(self.next_deadline())
