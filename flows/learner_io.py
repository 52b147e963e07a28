"""A learner's writes off its training thread (``BackgroundIO``: contributions in order,
checkpoints, retried with backoff) and what a full disk means to them: a write that
finds no space waits until there is some (``wait_for_space``), never lost."""

from __future__ import annotations

import errno
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Any, TypeVar

from diloco.learner import LearnerCheckpoint
from diloco.loops import GlobalView
from diloco.outer import Contribution
from diloco.transport import StoreLearnerView
from flows.pace import Pace
from storage_layout.bucket import PartialFailure
from storage_layout.commit import CommitConflict
from storage_layout.members import SeqNotReserved

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


BACKOFF = (0.5, 10.0)  # seconds between two tries of a write: the first, the longest


T = TypeVar("T")


def out_of_space(exc: BaseException) -> bool:
    """Whether ``exc`` is a full disk or an exhausted quota: its errno, a failed key's
    of a ``PartialFailure``, or that of the error it was raised from."""
    seen: list[BaseException] = []
    todo = [exc]
    while todo and len(seen) < 16:
        e = todo.pop()
        seen.append(e)
        if isinstance(e, OSError) and e.errno in _NO_SPACE:
            return True
        if isinstance(e, PartialFailure):
            todo.extend(e.failed.values())
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None and x not in seen)
    return False


def wait_for_space(call: Callable[[], T], region: str, what: str, log: Any) -> T:
    """``call()`` (a write a learner cannot start without: its generation, its block of
    seqs), asked again with backoff while its region's disk is full, instead of failing
    the process: a restart would meet the same disk, and each failed start counts towards
    giving the learner up. Said once when the disk is full and once when it has space."""
    delay, longest = BACKOFF
    since = None
    while True:
        try:
            result = call()
        except OSError as exc:
            if not out_of_space(exc):
                raise
            if since is None:
                since = time.monotonic()
                log.warning("region %s is out of space (ENOSPC: %s): %s waits for space, "
                            "asking again up to %g s apart", region, exc.strerror or exc, what,
                            longest)  # fmt: skip
            time.sleep(delay)
            delay = min(longest, delay * 2)
            continue
        if since is not None:
            log.warning("region %s has space again: %s goes on after %.0f s", region, what,
                        time.monotonic() - since)  # fmt: skip
        return result


class BackgroundIO:
    """A learner's transport in the pipeline: ``view`` (a ``StoreLearnerView`` over the
    bucket) behind two threads that never die on an error, only log it.

    - ``jobs``: uploads and checkpoints, in order. An upload is retried with backoff
      while its region is unreachable; one that still fails is logged and dropped (its
      work is lost, nothing else waits on it). An upload whose turn comes while a newer
      send from the same anchor is queued is skipped: that one carries its steps.
      A full disk (ENOSPC, or a quota: ``out_of_space``) passes once space is freed, so
      an upload that meets one is retried until it goes through, backing off up to
      ``backoff[1]`` seconds apart, and never dropped; its region is named in one
      warning when the disk fills and in one when it has space again. Meanwhile the
      sends queue up: once more than ``max_unsent`` wait (default: two per fragment, two
      outer periods of work, which a healthy store a little behind rarely reaches),
      ``backed_up()`` says so and the learner pauses before its next step
      (``LearnerLoop.run``), so it neither trains work that would arrive too stale nor
      runs past a shared budget with steps no one else can see.
    - ``poller``: every ``poll_seconds``, the newest version of each fragment the learner
      waits on, fetched into ``inbox``. A version that cannot be read is logged once and
      skipped; a newer one is taken when it comes. None for no ``fragments`` (a follower
      of a learner over several processes, whose transport writes its checkpoint parts).

    An upload that finds another process running as this learner (its seq taken, or reserved
    by a newer process) sets ``fenced``: no later upload or checkpoint of this process is
    written, and the runtime stops at its next look (``LearnerRuntime.check_fenced``).
    """

    def __init__(self, view: StoreLearnerView, fragments: int, poll_seconds: float,
                 retries: int, log: Any, stall_seconds: float = 60.0,
                 max_unsent: int | None = None,
                 backoff: tuple[float, float] | None = None):  # fmt: skip
        self.view, self.poll_seconds, self.retries, self.log = view, poll_seconds, retries, log
        self.stall_seconds = stall_seconds
        self.max_unsent = 2 * fragments if max_unsent is None else max_unsent
        if self.max_unsent < 1:
            raise ValueError(f"max_unsent must be at least 1, not {self.max_unsent}")
        self.backoff = backoff or BACKOFF  # (first, longest) seconds between two tries
        self.unsent = 0  # sends handed over whose upload has not ended yet
        self.retried = 0  # upload attempts that failed and were tried again
        self.full_since: float | None = None  # when the region's disk was found full
        store = getattr(view, "store", None)
        try:
            self.region = store.region_of(view.learner) if store is not None else "its region"
        except (AttributeError, ValueError):
            self.region = "its region"
        self.waiting: dict[int, float] = {}  # fragment -> since when it waits for news
        self.stalled: dict[int, float] = {}  # fragment -> since when, once reported
        self.jobs = ThreadPoolExecutor(1, thread_name_prefix="uploads")
        self.failures = 0
        self.fenced: Exception | None = None  # another process runs as this learner
        self.skipped = 0  # queued uploads a newer one from the same anchor made needless
        self.written = 0  # sends committed (the heartbeat shows them: taking part)
        self.queued: dict[tuple[int, Any], int] = {}  # (fragment, anchor) -> newest seq
        self.lock = threading.Lock()
        self.wanted: dict[int, int] = {}
        self.pace, self.clock = Pace(), time.monotonic  # when each fragment is next listed
        self.listed: dict[int, int] = {}  # fragment -> the newest version its looks found
        self.reported: dict[tuple[int, int], float] = {}  # (fragment, version) -> failed at
        self.inbox: dict[int, GlobalView] = {}
        for p in range(fragments):  # the start reads the newest of every fragment
            first = self._first_version(p)
            if first is not None:
                self.inbox[p] = first
        self.stop = threading.Event()
        self.poller: threading.Thread | None = None
        if fragments:
            self.poller = threading.Thread(target=self._poll, name="globals", daemon=True)
            self.poller.start()

    def _first_version(self, p: int, patience: float = 60.0) -> GlobalView | None:
        """The newest readable version of fragment ``p`` to start from, asked again while
        none comes (a listing that left the newest out, a read that failed in passing)
        for up to ``patience`` seconds; None then (the start says so)."""
        deadline = time.monotonic() + patience
        while True:
            try:
                found = self.view.latest_global(p)
                if found is not None:
                    return found
                problem = "none listed"
            except (OSError, ValueError) as exc:  # ValueError: CorruptVersion
                problem = repr(exc)
            if time.monotonic() >= deadline:
                self.log.error("no readable version of fragment %d to start from: %s", p, problem)
                return None
            self.log.warning("fragment %d: no version to start from yet (%s); asking again",
                             p, problem)  # fmt: skip
            time.sleep(max(self.poll_seconds, 0.5))

    # the learner's transport -----------------------------------------------------------
    def send(self, c: Contribution) -> None:
        with self.lock:
            self.queued[(c.fragment, c.anchor)] = c.seq
            self.unsent += 1

        def sent() -> None:  # written, skipped, dropped or fenced: it waits no more
            with self.lock:
                self.unsent -= 1

        self._submit(f"upload of fragment {c.fragment} seq {c.seq}", lambda: self._upload(c), sent)

    def backed_up(self) -> bool:
        """More sends wait unwritten than ``max_unsent``: the learner pauses (backpressure)."""
        with self.lock:
            return self.unsent > self.max_unsent

    def save_checkpoint(self, ckpt: LearnerCheckpoint) -> None:
        self._submit(f"checkpoint at step {ckpt.step}", lambda: self._checkpoint(ckpt))

    def _checkpoint(self, ckpt: LearnerCheckpoint) -> None:
        self._write(lambda: self.view.save_checkpoint(ckpt), f"checkpoint at step {ckpt.step}", 0)

    def load_checkpoint(self) -> LearnerCheckpoint | None:
        return self.view.load_checkpoint()

    def sent_so_far(self) -> tuple[int, int]:
        return wait_for_space(self.view.sent_so_far, self.region, "the learner's start", self.log)

    def want(self, fragment: int, above: int) -> None:
        with self.lock:
            self.wanted[fragment] = above
            self.waiting.setdefault(fragment, time.monotonic())

    def latest_global(self, fragment: int) -> GlobalView | None:
        with self.lock:
            return self.inbox.get(fragment)

    # threads --------------------------------------------------------------------------
    def _submit(
        self, what: str, job: Callable[[], None], after: Callable[[], None] | None = None
    ) -> Future:
        def guarded() -> None:
            try:
                if self.fenced is not None:
                    self.failures += 1
                    self.log.warning("%s not written: %s", what, self.fenced)
                    return
                job()
            except Exception as exc:  # logged, counted, never silent
                self.failures += 1
                self.log.error("%s failed for good: %r", what, exc)
            finally:
                if after is not None:
                    after()

        return self.jobs.submit(guarded)

    def _upload(self, c: Contribution) -> None:
        with self.lock:
            newer = self.queued.get((c.fragment, c.anchor), c.seq)
            if newer == c.seq:
                self.queued.pop((c.fragment, c.anchor), None)
        if newer > c.seq:
            # A newer send from the same anchor waits in the queue behind this one and
            # carries all its steps (sends from one anchor are cumulative): writing this
            # one would only delay that one. When uploads fall behind (a slow or faulty
            # store), the queue drains instead of growing.
            self.skipped += 1
            return
        self._write(lambda: self.view.send(c), f"upload of fragment {c.fragment} seq {c.seq}",
                    self.retries)  # fmt: skip
        self.written += 1

    def _write(self, write: Callable[[], None], what: str, retries: int) -> None:
        """``write()``, asked again with backoff: after ``retries`` failures it fails for
        good, except on a full disk, which is waited out (said once; the learner pauses
        meanwhile) until the process closes."""
        delay, longest = self.backoff
        failed = 0  # failures other than a full disk
        while True:
            try:
                write()
                self._space_again()
                return
            except (CommitConflict, SeqNotReserved) as exc:
                # This seq is taken, or reserved by a newer process: another process runs
                # as this learner. This one writes nothing more and stops.
                self.fenced = exc
                raise
            except OSError as exc:
                if out_of_space(exc):
                    self._out_of_space(exc)  # said once; tried again until space comes
                elif failed == retries:
                    raise
                else:
                    failed += 1
                    self.log.warning("%s failed (%s); retrying in %.1f s", what, exc, delay)
                if self.stop.wait(delay):  # closing: what is left is dropped, by name
                    raise
                self.retried += 1
                delay = min(longest, delay * 2)

    def _out_of_space(self, exc: OSError) -> None:
        if self.full_since is not None:
            return
        self.full_since = time.monotonic()
        self.log.warning(
            "region %s is out of space (ENOSPC: %s): uploads and checkpoints are retried, "
            "backing off up to %g s apart, and training pauses while more than %d sends wait",
            self.region, exc.strerror or exc, self.backoff[1], self.max_unsent,
        )  # fmt: skip

    def _space_again(self) -> None:
        if self.full_since is None:
            return
        since, self.full_since = self.full_since, None
        self.log.warning("region %s has space again: uploads go on after %.0f s (%d waiting)",
                         self.region, time.monotonic() - since, self.unsent)  # fmt: skip

    def _poll(self) -> None:
        while not self.stop.wait(self.poll_seconds):
            self.look()

    def look(self) -> None:
        """Fetch the newest version of each fragment waited on whose pace says a look is
        due (``flows.pace``: versions come about a round apart, and each look LISTs the
        bucket; one is seen at most 1/20 of a round late) into ``inbox``."""
        with self.lock:
            wanted = dict(self.wanted)
        now = self.clock()
        for p, above in wanted.items():
            if not self.pace.due(p, now):
                continue
            newest = None
            try:
                newest = self.view.store.newest_version(self.view.learner, p)
                self.reported.pop((p, None), None)  # listed: the next failure is said again
                news = newest is not None and newest > self.listed.get(p, -1)
                self.pace.looked(p, now, news)
                if news:
                    self.listed[p] = newest
                held = self.inbox.get(p)
                if newest is None or newest <= max(above, held.version if held else -1):
                    continue
                if time.monotonic() - self.reported.get((p, newest), -math.inf) < 2.0:
                    continue  # it failed a moment ago: give it a little time
                got = self.view.read(p, newest)
            except Exception as exc:  # a corrupt version, a region down: skip, go on
                if (p, newest) not in self.reported:
                    what = ("list the versions" if newest is None
                            else f"read version {newest}")  # fmt: skip
                    self.log.warning("cannot %s of fragment %d (will try again): %r",
                                     what, p, exc)  # fmt: skip
                self.reported[(p, newest)] = time.monotonic()
                continue
            with self.lock:
                self.inbox[p] = got
        self._watch_stalls(wanted)

    def _watch_stalls(self, wanted: dict[int, int]) -> None:
        """Say so when the versions a learner waits on stop coming (its syncer is down, or
        its region is cut off): once per stall, and once more when they come again."""
        now = time.monotonic()
        for p, above in wanted.items():
            held = self.inbox.get(p)
            if held is not None and held.version > above:
                self.waiting.pop(p, None)
                since = self.stalled.pop(p, None)
                if since is not None:
                    self.log.warning("fragment %d: version %d arrived after %.0f s without one",
                                     p, held.version, now - since)  # fmt: skip
                continue
            since = self.waiting.setdefault(p, now)
            if now - since >= self.stall_seconds and p not in self.stalled:
                self.stalled[p] = since
                self.log.warning(
                    "no global version of fragment %d newer than %d for %.0f s: is its syncer "
                    "running? (training goes on with the versions held)",
                    p,
                    above,
                    now - since,
                )

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for every upload and checkpoint queued so far, at most ``timeout`` seconds;
        returns whether they were all written (or dropped, logged) by then."""
        try:
            self.jobs.submit(lambda: None).result(timeout=timeout)
        except FuturesTimeout:
            return False
        return True

    def close(self, wait: bool = True) -> None:
        """Stop both threads; without ``wait``, drop the jobs not yet started (a preempted
        learner past its deadline: what they would write is named in its log)."""
        self.stop.set()
        self.jobs.shutdown(wait=wait, cancel_futures=not wait)
        if self.poller is not None:
            self.poller.join(timeout=5)
