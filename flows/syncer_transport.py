"""A syncer's transport over the buckets (``PipelineSyncerTransport``, the pipeline's
``diloco.loops.SyncerTransport``): the members and their liveness, their contributions
listed and read, new versions published to every region, retention and the data units
the syncers tend."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from diloco import records
from diloco.config import LivenessConfig
from diloco.liveness import Liveness, Verdict
from diloco.loops import StoredFragment, Unreadable
from diloco.outer import Contribution
from diloco.syncer import GlobalVersion
from flows.bucket_io import BucketStore
from flows.pace import ADMIT_EVERY, MEMBERS_EVERY, Pace
from flows.unit_offers import SilentReleases, UnitOffers
from storage_layout.auth import record_verifies
from storage_layout.retention import ORPHAN_AGE, collect_garbage

# Seconds between two tries to catch a lagging region up (a region down, a full disk):
# the first, doubling up to the longest; a try that catches every fragment up resets it.
CATCH_UP_BACKOFF = (0.5, 10.0)


class PipelineSyncerTransport:
    """The syncer's transport in the pipeline: the bucket store, plus what only the real
    world has: measured publish times (the grace window's delivery estimate), the end of
    the run read from the learners' status objects, regions to catch up, retention."""

    def __init__(self, store: BucketStore, fragments: list[int], keep_versions: int,
                 window: int, log: Any, tokens: int | None = None,
                 retention_seconds: float = 60.0,
                 clock: Callable[[], float] = time.monotonic,
                 liveness: LivenessConfig | None = None, inner_steps: int = 1):  # fmt: skip
        self.store, self.fragments = store, fragments
        # Who is alive, who takes part (diloco.liveness), on this syncer's clock.
        self.liveness = Liveness(liveness or LivenessConfig(), inner_steps)
        self._beats: dict[str, Any] = {}  # learner -> what moved last (its beat, or status)
        self._members: list[str] = list(store.learners)
        self._members_read = self._admitted_read = -math.inf
        self._joined: dict[str, int] = {}  # the newest join record seen, per learner
        # Set by the runtime with data.assign = "units": gives back a silent one's data.
        self.releases: SilentReleases | None = None
        # And offers the data of a region no member is in to the others' learners.
        self.offers: UnitOffers | None = None
        # Retention's own cadence (``pipeline.retention_seconds``): a pass after a
        # publish once this long has gone by since the last (or the start), whatever
        # keep_versions is, so its LIST requests do not grow with the publish rate.
        self.retention_seconds, self.clock = retention_seconds, clock
        self._retained_at = clock()
        self.retention_passes = 0
        self.tokens = tokens  # the run's budget: a learner done at a smaller one is not done
        self.keep_versions, self.window, self.log = keep_versions, window, log
        self.sync_seconds = 0.05  # publish time, exponential moving average
        self.lagging: set[int] = set()
        self._lagging_since: dict[int, float] = {}
        self._catch_up_at, self._catch_up_delay = -math.inf, CATCH_UP_BACKOFF[0]
        # Set by the runtime: the run's spec, whose learners and those joiners added in
        # any region (``RunStore.members.run_learners``, checked at each look) are the run's.
        self.spec: Mapping[str, Any] | None = None
        self._refused: set[str] = set()  # added learners' records refused, said once each
        self.done: set[str] = set()  # learners whose status says they are done
        self.finishing = False  # every learner is done: every pair is listed at each look
        self.pace = Pace()  # when each (learner, fragment) is next listed (flows.pace)
        self.given_up: set[str] = set()  # learners the launcher gave up
        self._given_up_read = -math.inf
        self.published = 0
        # Set by the flow: runs each publish as a Prefect task run.
        self.wrap: Callable[[GlobalVersion, Callable[[], bool]], bool] | None = None
        # Set by the runtime: called after each publish (the traffic it caused goes out).
        self.on_published: Callable[[], None] | None = None

    def contributions(
        self, learner: str, fragment: int, after: int
    ) -> list[Contribution | Unreadable]:
        """``learner``'s new sends of ``fragment``, listed when the pair's pace says a look
        is due (``flows.pace``: a send is seen at most 1/20 of a round late), else none
        yet; once every learner is done, at every look (nothing is left unlisted)."""
        pair, now = (learner, fragment), self.clock()
        if not self.finishing and not self.pace.due(pair, now):
            return []
        found = self.store.contributions(learner, fragment, after)
        self.pace.looked(pair, now, bool(found))
        return found

    def read(self, c: Contribution) -> Contribution | Unreadable:
        return self.store.read(c)

    def load_fragment(self, fragment: int, window: int) -> StoredFragment:
        return self.store.load_fragment(fragment, window)

    def version_sink(self, fragment: int, version: int, shapes: Any, slots: int) -> Any:
        return self.store.version_sink(fragment, version, shapes, slots)

    def publish(self, gv: GlobalVersion, opt_leaves: list[Any], record: records.Record) -> bool:
        start = time.perf_counter()
        call = lambda: self.store.publish(gv, opt_leaves, record)  # noqa: E731
        won = self.wrap(gv, call) if self.wrap else call()
        self.sync_seconds = 0.8 * self.sync_seconds + 0.2 * (time.perf_counter() - start)
        report = self.store.last_report
        if won and report is not None and report.lagging and gv.fragment not in self.lagging:
            self.lagging.add(gv.fragment)  # said once; the next versions go the same way
            self._lagging_since[gv.fragment] = time.monotonic()
            self.log.warning(
                "fragment %d v%d not in %s yet (caught up later, with backoff)", gv.fragment,
                gv.version, report.lagging,
            )  # fmt: skip
        self.published += won
        if self.on_published is not None:
            self.on_published()
        return won

    def delivery_seconds(self, fragment: int) -> float:
        return self.sync_seconds

    def learners_finished(self, budget_spent: bool = False) -> bool:
        """Every learner is done: its status object says so (written once its final
        checkpoint, and every contribution before it, is committed; sharing the budget, a
        learner may end before its even share), or the launcher gave it up, or, once the
        shared budget is spent (``budget_spent``), its slot is vacant: never started
        (left to joiners, ``pipeline.learners_started``), preempted or silent
        (``diloco.liveness``; a lagging learner holds its slot)."""
        main = self.store.main
        for learner, region in self.store.learners.items():
            if learner in self.done:
                continue
            try:
                done = main.progress.done(learner, region, self.tokens)
                if not done and budget_spent:
                    done = self._vacant(learner, region)
            except OSError:
                return False
            if not done and not self._given_up(learner):
                return False
            self.done.add(learner)
        self.finishing = True  # (the loop's last looks list everything: nothing is left)
        return True

    def _vacant(self, learner: str, region: str) -> bool:
        """Whether no one holds ``learner``'s slot now (see ``learners_finished``)."""
        if main_status := self.store.main.progress.read_metrics(learner, region):
            verdict = self._look(learner, region, self.clock(), main_status)
            return verdict is not None and verdict.state in ("silent", "preempted")
        return self.store.writer_for(learner).members.newest_generation(learner) == 0

    def members(self) -> list[str]:
        """The learners counted towards the quorum (``member_quorum``), read at most every
        ``MEMBERS_EVERY`` (5 s): all of the run's but one preempted, silent or lagging
        (``diloco.liveness``: its heartbeat watched on this syncer's clock; a done learner
        stays counted, as before), and one the launcher gave up. A silent one's data is
        given back (``SilentReleases``); a lagging one is only left out until it sends.
        Objects that cannot be read leave their learner counted: a storage hiccup drops
        nobody. Between
        those reads, the learners joiners added are looked for every ``ADMIT_EVERY``
        (1 s): one that is found makes the read now."""
        now = self.clock()
        if now - self._members_read < MEMBERS_EVERY:
            if now - self._admitted_read < ADMIT_EVERY or not self._admit(now):
                return self._members
        else:
            self._admit(now)
        self._members_read = now
        members = []
        for learner, region in self.store.learners.items():
            verdict = self._look(learner, region, now)
            counted = verdict is None or verdict.counted
            if counted and not self._given_up(learner):
                members.append(learner)
            was = learner in self._members
            if not counted and was:
                self.log.warning("learner %s is not counted towards the quorum: %s", learner,
                                 verdict)  # fmt: skip
            elif counted and not was and learner not in self.given_up:
                self.log.warning("learner %s is counted towards the quorum again", learner)
            if counted:  # a join record since the last look: say who took the slot
                self._note_join(learner, region)
            if verdict is not None and verdict.state == "silent" and self.releases:
                self.releases.tend(learner, region, self._beats[learner], now)
        self._members = members
        if self.offers is not None:
            self.offers.tend(members)
        return members

    def _admit(self, now: float) -> bool:
        """Take the learner slots joiners added to the run (``RunStore.members.run_learners``:
        each region's bucket, each record checked, signed with its learner's key when the
        run signs); a refused record is said once. A region that cannot be read is
        looked at again at the next look. Whether any was taken."""
        self._admitted_read, added = now, False
        if self.spec is None:
            return added
        for region in self.store.regions:
            try:
                found = self.store.main.members.run_learners(self.spec, self.store.keys.verifying_key,
                                                     [region])  # fmt: skip
            except (OSError, ValueError) as exc:
                self.log.warning("cannot read the learners added in %s: %s", region, exc)
                continue
            for problem in sorted(set(found.refused) - self._refused):
                self.log.error("refusing a learner added to the run: %s", problem)
                self._refused.add(problem)
            for lid, record in found.added.items():
                if lid not in self.store.learners:
                    self.store.learners[lid] = region
                    added = True
                    # (the loop says that it is admitted; `diloco inspect` shows its host)
                    self.log.debug("learner %s was added to the run in %s (host %s)", lid,
                                   region, record.get("host"))  # fmt: skip
        return added

    def _note_join(self, learner: str, region: str) -> None:
        """Log who took ``learner``'s slot by ``diloco join`` (its newest join record),
        checked against the learner's key: news for whoever watches the run, never fatal
        (a joiner without the slot's key cannot sign its contributions either, and those
        are what a syncer rejects)."""
        seen = self._joined.get(learner, 0)
        try:  # a listing; the record is read only when it is new
            newest = self.store.main.members.newest_join(learner, region, after=seen)
        except (OSError, ValueError) as exc:
            self.log.warning("cannot read the join records of %s: %s", learner, exc)
            return
        if newest is None:
            return
        self._joined[learner], record = newest
        if record is None:
            return  # not a join record (named as it was read)
        key = self.store.keys.verifying_key(learner)
        if key is not None and not record_verifies(record, key):
            self.log.error("join record %s of %s does not verify with its key: written by "
                           "someone without a join token for it", record.get("join"), learner)  # fmt: skip
            return
        self.log.warning("learner %s joined from host %s (join %s; the slot: %s)", learner,
                         record.get("host"), record.get("join"), record.get("took"))  # fmt: skip

    def _look(
        self, learner: str, region: str, now: float, status: dict | None = None
    ) -> Verdict | None:
        """``learner`` now (``status``: as just read), by its heartbeat and status; None
        when they cannot be read (a storage hiccup drops nobody)."""
        main = self.store.main
        try:
            if status is None:
                status = main.progress.read_metrics(learner, region) or {}
            beat = main.members.read_heartbeat(
                learner, region, self.store.keys.verifying_key(learner)
            )
        except (OSError, ValueError):
            return None
        self._beats[learner] = beat.key if beat is not None else (
            status.get("state"), status.get("time"), status.get("step"))  # fmt: skip
        return self.liveness.look(learner, beat, status, now)

    def _given_up(self, learner: str) -> bool:
        """Whether the launcher gave ``learner`` up (read at most every 5 s)."""
        now = time.monotonic()
        if now - self._given_up_read >= 5.0:
            self._given_up_read = now
            try:
                status = self.store.main.progress.read_metrics("launcher") or {}
            except (OSError, ValueError) as exc:
                self.log.warning("cannot read the launcher's status: %s", exc)
                status = {}
            for name, reason in status.get("given_up", {}).items():
                if name not in self.given_up:
                    self.log.error("the launcher gave %s up (%s); not waiting for it",
                                   name, reason)  # fmt: skip
                    self.given_up.add(name)
        return learner in self.given_up

    def tend(self) -> None:
        if self.lagging and time.monotonic() >= self._catch_up_at:
            self.catch_up()
        now = self.clock()
        if self.published and now - self._retained_at >= self.retention_seconds:
            self.published, self._retained_at = 0, now
            self.collect_garbage()

    def catch_up(self) -> None:
        """Copy the newest version of each lagging fragment to the regions behind; while
        some stay behind (down, or their disk full), the next try waits, doubling
        (``CATCH_UP_BACKOFF``): no write is asked of them at every look."""
        main = self.store.main
        for p in list(self.lagging):
            main.versions.sync_regions(p)
            newest = main.versions.latest_global(p)
            if all((main.versions.latest_global(p, r) or -1) >= (newest or 0) for r in main.urls):
                self.lagging.discard(p)
                since = self._lagging_since.pop(p, time.monotonic())
                self.log.warning("fragment %d: every region holds v%s again, after %.0f s", p,
                                 newest, time.monotonic() - since)  # fmt: skip
        first, longest = CATCH_UP_BACKOFF
        if self.lagging:
            self._catch_up_at = time.monotonic() + self._catch_up_delay
            self._catch_up_delay = min(longest, self._catch_up_delay * 2)
        else:
            self._catch_up_at, self._catch_up_delay = -math.inf, first

    def collect_garbage(self) -> None:
        """Delete processed contributions and versions no learner can still need, and
        what writers left unfinished over an hour ago (``ORPHAN_AGE``): data no marker
        names, temporaries of a writer killed mid-write."""
        self.retention_passes += 1
        try:
            report = collect_garbage(
                self.store.main, self.fragments, self.store.learners,
                window=max(self.keep_versions, self.window + 2), orphan_age=ORPHAN_AGE,
                keys=self.store.keys,
            )  # fmt: skip
        except (OSError, ValueError) as exc:  # a failed request, or a stored object refused
            self.log.warning("retention skipped: %s", exc)
            return
        for problem in report.problems:
            self.log.warning("retention %s", problem)
        if report.contributions_deleted or report.globals_deleted:
            self.log.info("retention: deleted %d contributions, %d versions (%d bytes)",
                          report.contributions_deleted, report.globals_deleted,
                          report.bytes_freed)  # fmt: skip
        if report.orphans_deleted or report.temporaries_deleted:
            self.log.info("retention: deleted %d abandoned writes and %d temporaries older "
                          "than %.0f s", report.orphans_deleted, report.temporaries_deleted,
                          ORPHAN_AGE)  # fmt: skip
