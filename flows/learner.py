"""The learner flow: one island of compute running the core ``LearnerLoop`` on the wall
clock over its own region's bucket.

A learner process keeps one ``LearnerRuntime`` for its whole life and runs bounded flow
runs over it (``pipeline.rounds_per_flow_run`` rounds each), so memory does not grow with
the run's length and a flow-run boundary costs nothing. A deployment's flow run is a
process of its own: it waits for its checkpoint and uploads before it returns, and the
next one resumes from that checkpoint. Each round is a Prefect task run
(``learner us-east/2 round 14``) of ``pipeline.round_steps`` inner steps; it is not
retried in the process (a half-finished round cannot be replayed): a failure ends the
process, and the launcher starts a new one, which rejoins from the bucket
(``LearnerLoop.start``).

Contributions and checkpoints are written by one background thread in order (so a
checkpoint lands after the contributions it covers, and a failed upload never blocks
it), and the newest global versions the learner waits on are fetched by another:
training never waits on the network in ``decoupled`` mode.
"""

from __future__ import annotations

import errno
import math
import shutil
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Any, TypeVar

import jax
import numpy as np
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from diloco import hosts, records
from diloco.learner import LearnerCheckpoint, compile_apply
from diloco.loops import Clock, GlobalView, LearnerLoop, WallClock, drive
from diloco.outer import Contribution
from diloco.quantize_device import outer_gradient
from diloco.transport import StoreLearnerView
from diloco.units import UnitReader
from flows.bucket_io import HostPart
from flows.compile import compile_turn, share_compilations, user_cache
from flows.heartbeat import Heartbeat
from flows.hosts import join as join_group
from flows.ledger import BucketLedger, FollowedLedger, region_ledger, region_pools
from flows.observe import (
    LiveTable,
    artifact_key,
    outlive_the_reader,
    run_logger,
    stopped,
    tag_flow_run,
    worker_tags,
)
from flows.pace import Pace
from flows.process import WorkerProcess, this_process
from flows.run import Run, build_model
from protocol.topology import learner_id, learner_index
from storage_layout.auth import LEARNER_KEY_ENV, RUN_SECRET_ENV
from storage_layout.bucket import PartialFailure
from storage_layout.commit import CommitConflict
from storage_layout.members import SeqNotReserved
from storage_layout.spill import SpillFolder
from storage_layout.stream import process_folder


class Fenced(RuntimeError):
    """This process may write as its learner no more: another process runs as it now
    (this one must stop), or, ``rejoin``, a syncer fenced it off as silent while it was
    alive (paused, cut off): it takes a new generation and goes on (``learner_flow``)."""

    def __init__(self, reason: str, rejoin: bool = False):
        super().__init__(reason)
        self.rejoin = rejoin


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


_COMPILING = threading.Lock()  # a spare's warm-up and the learner it becomes compile once


def compile_step(model: Any, cfg: Any, go_on: Callable[[], None] = lambda: None) -> None:
    """Run ``model``'s train step once on zeros, its send (the quantized outer gradient
    of each tensor shape) and its apply (``diloco.learner.compile_apply``): all are
    compiled (or loaded from the JAX cache) for this process; later calls of the same
    shapes reuse them. Otherwise a learner's first sends wait on their compilation,
    seconds in which the run's versions move on: a joiner's first contributions came out
    too stale to merge. One at a time: a second call waits for the first and then finds
    them compiled. ``go_on`` is called between compilations (it raises to stop there)."""
    trainer = model.trainer
    top = cfg.topology
    with _COMPILING, compile_turn(cfg, "step", go_on):
        params = trainer.place_params(model.init)
        batch = np.zeros((cfg.data.batch_size, cfg.model.context + 1), dtype=np.int32)
        trainer.step(params, trainer.init_opt_state(params), batch, 0)[2].block_until_ready()
        shapes = {}
        for value in params.values():
            shapes.setdefault((value.shape, value.sharding), value)
        for value in shapes.values():
            go_on()
            compile_apply(value)
            carries = (None, value) if top.error_feedback else (None,)
            for carry in carries:  # the first send has none, the later ones their residual
                got = outer_gradient(value, value, carry, top.quantization, top.block_size)
                got[0].block_until_ready()


def warm_up(
    run: str, bucket: str, region: str, pipeline: dict | None = None,
    go_on: Callable[[], None] = lambda: None,
) -> None:  # fmt: skip
    """What starting a learner of ``run`` costs whichever learner it is: the model
    (``build_model`` keeps one per process and config), its compiled train step and the
    corpus. A spare does it while it waits, so a learner that takes over from a killed one
    starts training seconds sooner; so does ``diloco join`` before it takes a slot (its
    ``go_on``, called between the steps, raises when it was told to stop)."""
    opened = Run.open(run, {region: bucket}, region, pipeline, learner=True)
    model = build_model(opened.cfg, learner=True, go_on=go_on)
    go_on()
    compile_step(model, opened.cfg, go_on)
    go_on()
    if opened.cfg.data.assign == "units":  # the data's chunks (a learner's units: its own)
        _ = opened.data.units
    else:
        opened.data.reader(0)  # the corpus, read and split once per process


class LearnerRuntime:
    """One learner process: the core loop, its background I/O and its accounting.

    ``clock`` and ``io`` (the transport over the learner's bucket view) default to the wall
    clock and ``BackgroundIO``; the equivalence test passes the simulator's instead. The
    wall clock slows this learner down by its factor in ``pipeline.speeds`` (emulated
    slower hardware: the sleep counts as its training time)."""

    def __init__(
        self,
        run: str,
        bucket: str,
        region: str,
        learner: str,
        pipeline: dict | None = None,
        clock: Clock | None = None,
        io: Callable[[StoreLearnerView], Any] | None = None,
    ):
        self.log = run_logger("diloco.learner")
        self.process = this_process()  # told it will be preempted: ``preempted``
        self.ledger: BucketLedger | FollowedLedger | None = None  # data.assign = "units"
        began = time.time()
        self.opened = opened = Run.open(run, {region: bucket}, region, pipeline, learner=True)
        spec = opened.spec
        # the spec's slots and those joiners added in this region (``diloco join``)
        learners = opened.store(learner).members.run_learners(spec).regions
        if learners.get(learner) != region:
            raise ValueError(
                f"learner {learner!r} is not in region {region!r} in run {run!r}; "
                f"the run has {learners}"
            )
        self.cfg, self.model = opened.cfg, opened.model
        self.run, self.region, self.id = run, region, learner
        self.index = learner_index(learner)
        self.label = f"{region}/{self.index}"
        self.store = opened.bucket_store(learner, learners)
        # Over several processes (diloco.hosts) process 0 leads: it alone writes to the
        # bucket, and the others take what it read.
        self.leader, self.processes = hosts.is_leader(), hosts.process_count()
        # Fence off any older process of this learner before reading what it left.
        self.generation = hosts.broadcast_object(
            wait_for_space(lambda: self.store.claim_generation(learner), region,
                           f"the start of {learner}", self.log) if self.leader else None
        )  # fmt: skip
        # Alive from now on, every liveness.heartbeat_seconds, however long a round is.
        self.heartbeat = Heartbeat(
            self.store.writer_for(learner).members, learner, self.generation,
            self.cfg.liveness.heartbeat_seconds, self.store.keys.signing_key(learner),
            self._beat_progress, self.log,
        ) if self.leader else None  # fmt: skip
        self._progress: dict[str, Any] | None = None  # what a predecessor reported
        try:
            self._open(spec, learner, clock, io, began)
        except BaseException:  # (a start that fails beats no more)
            if self.heartbeat is not None:
                self.heartbeat.close()
            raise

    def _open(self, spec: dict[str, Any], learner: str, clock: Clock | None,
              io: Callable[[StoreLearnerView], Any] | None, began: float) -> None:  # fmt: skip
        """The rest of the start, once the generation is held and the heartbeat goes:
        compile, read what the learner resumes from, and start its loop."""
        self.announce("compiling")
        self._compile()
        self.announce("resuming")
        # The versions it holds wait in a local folder, not in memory (each process of a
        # learner over several reads its own: ``hosts.ReplicatedTransport``).
        self.spill_dir = process_folder("global-views")
        opts = self.cfg.pipeline
        view = StoreLearnerView(self.store, learner, SpillFolder(self.spill_dir))

        def background(view: StoreLearnerView, fragments: int = len(self.model.plan)) -> Any:
            return BackgroundIO(view, fragments, opts.poll_seconds, opts.upload_retries,
                                self.log, opts.stall_seconds, max_unsent=max(1, 2 * fragments))  # fmt: skip

        # A follower's own transport writes its checkpoint parts only: it neither polls nor
        # reads the versions to start from (the leader names them; ``view.read`` reads).
        self.io = (io or background)(view) if self.leader else background(view, 0)
        if self.processes > 1:  # the leader decides, each process reads and writes its part
            self.io = hosts.ReplicatedTransport(
                self.io, view.read, lambda step: self.store.load_checkpoint(learner, step),
                lambda state, write_id: HostPart(state, write_id, jax.process_index(),
                                                 self.processes),
            )  # fmt: skip
        self.records: list[records.Record] = []
        self.loop, self.resumed_from = LearnerLoop.start(
            learner, self.model.trainer, self.model.plan, self._reader(spec),
            self.cfg, self.io, clock or WallClock(self.cfg.slowdown(self.index)),
            self.records.append, self.log,
        )  # fmt: skip
        # Where this process's time went (the launcher's goodput breakdown; the status
        # sums them over processes): start-up is opening the run, compiling and resuming,
        # up to the first step; training is the rounds themselves.
        self.startup_seconds = time.time() - began
        self.train_seconds = 0.0

    def _beat_progress(self) -> tuple[int, int]:
        """The step and the sends committed so far, for the heartbeat (0 before the loop)."""
        loop = getattr(self, "loop", None)
        return (loop.learner.step, getattr(self.io, "written", 0)) if loop else (0, 0)

    def _phase(self, state: str) -> None:
        if self.heartbeat is not None:
            self.heartbeat.state = state

    def _reader(self, spec: dict[str, Any]) -> Any:
        """The learner's data: its dealt share, or (``data.assign = "units"``) the spans
        it takes from its region's pool in its own bucket (``flows.ledger``); the run's
        own data, or a ``DataError`` naming the difference (``RunData.check_same``)."""
        data = self.opened.data
        data.check_same(spec, f"learner {self.label}")
        if self.cfg.data.assign != "units":
            return data.reader(self.index)
        units = data.units
        own = self.store.writer_for(self.id)
        ledger = region_ledger(own, units, self.store.learners, self.region, self._may_take,
                               lambda: own.members.run_learners(spec).regions,
                               pools=region_pools(spec))  # fmt: skip
        # Over several processes, process 0 takes; the others follow its records.
        self.ledger = ledger if self.leader else FollowedLedger(
            ledger, self.cfg.pipeline.poll_seconds, self.log,
            self.cfg.liveness.silent_max_seconds)  # fmt: skip
        return UnitReader(
            units, self.id, self.ledger, self.cfg.data.batch_size, background=True
        )  # a take is a few requests: not in a step

    def _compile(self) -> None:
        """Compile the train step before reading the newest globals: compiling takes
        seconds, and a learner that starts from versions that old has its first
        contributions rejected as too stale (a warmed-up spare has done it already)."""
        compile_step(self.model, self.cfg)

    @property
    def step(self) -> int:
        return self.loop.learner.step

    @property
    def finished(self) -> bool:
        return self.loop.finished

    @property
    def round(self) -> int:
        """The number of the round about to run (1-based, stable across restarts)."""
        return self.step // self.cfg.pipeline.round_steps + 1

    def check_fenced(self) -> None:
        """Stop if another process has started as this learner since (a duplicate, or this
        one was given up for dead while it was only cut off): two processes of one id
        would race for its sequence numbers and mix its checkpoints. Its uploads may have
        found out first (``BackgroundIO.fenced``)."""
        reason = self._fenced() if self.leader else None
        reason = hosts.broadcast_object(reason)  # the group stops as one
        if reason is not None:
            raise Fenced(*reason)

    def _may_take(self) -> None:
        """Before process 0 takes a span of data: ``Fenced`` if it may no longer write
        as its learner (a data take of a fenced process would hold a span no one trains)."""
        reason = self._fenced()
        if reason is not None:
            raise Fenced(*reason)

    def _fenced(self) -> tuple[str, bool] | None:
        """Why this process may write no more, and whether it may take a new generation
        (a fence by a syncer, newest: nobody took the slot since), or None."""
        own = self.store.writer_for(self.id)
        newest = own.members.newest_generation(self.id)
        if newest > self.generation:
            record = own.members.generation(self.id, newest)
            if isinstance(record, dict) and "fence" in record:  # flows.ledger.SilentReleases
                return (f"{self.id}: fenced off by {record.get('writer')} (generation "
                        f"{newest}: {record['fence']}), its data given back", True)  # fmt: skip
            return (f"{self.id}: another process took over as generation {newest} (this "
                    f"one is generation {self.generation}); this one stops", False)  # fmt: skip
        refused = getattr(self.io, "fenced", None)  # a newer block of seqs
        if refused is not None:
            return f"{self.id}: another process runs as this learner: {refused}", False
        return None

    def train_round(self) -> dict[str, Any]:
        """One round of the core loop on the wall clock; returns its table row."""
        self.check_fenced()
        number, first = self.round, len(self.records)
        traffic = self.store.traffic
        up, down, start_step = traffic.uploaded, traffic.downloaded, self.step
        start = time.perf_counter()
        # Told it will be preempted, a learner of one process stops after its step; one
        # of several processes stops at the round's end (the group decides as one).
        self._phase("training")
        stop = None
        if self.processes == 1:  # (and a round of a fenced process ends early)
            beat = self.heartbeat.superseded if self.heartbeat is not None else threading.Event()
            stop = lambda: self.process.preempted.is_set() or beat.is_set()  # noqa: E731
        drive(self.loop.run(self.cfg.pipeline.round_steps), self.cfg.pipeline.poll_seconds, stop)
        losses = [float(x) for x in self.loop.losses]  # waits for the device
        seconds = time.perf_counter() - start
        self.train_seconds += seconds
        new = self.records[first:]
        applied = records.of(new, "applied")
        steps = self.step - start_step
        tokens = self.loop.learner.tokens_per_step
        row = {
            "round": number, "steps": steps, "step": self.step, "tokens": self.step * tokens,
            "loss": round(float(np.mean(losses)), 4) if losses else None,
            "tokens_per_s": round(steps * tokens / seconds, 1) if seconds > 0 else 0.0,
            "lr": float(f"{self.loop.lr():.4g}"),
            "sent": len(records.of(new, "sent")), "applied": len(applied),
            "staleness": max((a["staleness"] for a in applied), default=0),
            "merge_weight": round(sum(a["weight"] for a in applied), 4),
            "bytes_up": traffic.uploaded - up, "bytes_down": traffic.downloaded - down,
            "seconds": round(seconds, 3),
        }  # fmt: skip
        del self.records[:first]  # rows keep what the UI shows; memory stays flat
        if not self.leader:
            return row
        try:  # the history (storage_layout.history) is news, not state: never fatal
            entry = {**row, "time": time.time(), "generation": self.generation,
                     "region": self.region}  # fmt: skip
            history = self.store.writer_for(self.id, checkpoints=True)  # not sync traffic
            if not history.progress.put_round(self.id, number, entry):
                self.log.info("round %d is in the history already (an earlier process ran it "
                              "before this one resumed); the first row stays", number)  # fmt: skip
        except Exception as exc:
            self.log.warning("cannot add round %d to the history: %r", number, exc)
        self.write_status("training", row)
        return row

    def checkpoint(self, wait: bool = False) -> None:
        """Queue a checkpoint (after the uploads before it); ``wait`` until it is written."""
        self.loop.checkpoint()
        if wait:
            self.io.flush()

    def preempting(self) -> bool:
        """Whether this learner was told it will be preempted (``WorkerProcess.preempted``:
        SIGTERM to a worker, or its machine's notice); over several processes, whether any of them was
        (each host has its own notice, and a spot VM that goes takes the group with it):
        the group leaves as one."""
        return hosts.any_process(self.process.preempted.is_set())

    def leave(self) -> dict[str, Any]:
        """Preempted: send every fragment's unsent steps (``LearnerLoop.send_pending``),
        checkpoint, and wait at most ``pipeline.preempt_seconds`` for both to be written,
        so that nothing trained is lost and the learner rejoins where it stopped. What is
        still unwritten at the deadline is abandoned, named in the log (a rejoining
        learner then starts after the newest send that did commit, as after a kill)."""
        started = time.monotonic()
        sent = self.loop.send_pending()
        self.loop.checkpoint()
        written = self.io.flush(self.cfg.pipeline.preempt_seconds)
        seconds = time.monotonic() - started
        if written:
            self.log.warning(
                "preempted: learner %s sent fragments %s and checkpointed at step %d in "
                "%.1f s; it rejoins from there", self.label, sent, self.step, seconds,
            )  # fmt: skip
        else:
            self.log.error(
                "preempted: learner %s could not write its sends of fragments %s and its "
                "checkpoint at step %d within pipeline.preempt_seconds (%.0f s); what is "
                "unwritten is abandoned and a restart resumes after its newest committed "
                "send", self.label, sent, self.step, self.cfg.pipeline.preempt_seconds,
            )  # fmt: skip
        if written and self.ledger is not None:  # its data from here on, to the others
            try:
                self.loop.learner.reader.settle()  # a take under way is given back too
                self.ledger.release(self.id, self.step * self.cfg.data.batch_size)
            except (OSError, ValueError, RuntimeError) as exc:  # its slot keeps them
                self.log.error("preempted: learner %s could not give its data back (%s); "
                               "its slot keeps it", self.label, exc)  # fmt: skip
        self.write_status("preempted")
        if self.heartbeat is not None:
            self.heartbeat.close("preempted")
        self.io.close(wait=written)
        return {"step": self.step, "sent": sent, "written": written, "seconds": seconds}

    def announce(self, state: str) -> None:
        """Say in the status object which start-up phase this process is in (the launcher
        shows it), keeping the progress an earlier process of this learner reported."""
        if not self.leader:
            return
        self._phase(state)
        writer = self.store.writer_for(self.id)
        try:
            if self._progress is None:  # read once: the phases after it keep the same
                old = writer.progress.read_metrics(self.id) or {}
                self._progress = {k: old[k] for k in ("step", "total_steps", "tokens") if k in old}
            # Totals of 0: this process has none yet, and the ones its predecessors left
            # (their training and start-up time) must stay, should it die before it has.
            writer.progress.write_metrics(self.id, {**self._progress, "state": state,
                                           "region": self.region, "time": time.time()},
                                 totals={"startup_seconds": 0.0, "train_seconds": 0.0})  # fmt: skip
        except (OSError, ValueError) as exc:  # a status is news, not state: never fatal
            self.log.warning("cannot write status %r: %s", state, exc)

    def write_status(self, state: str, row: dict[str, Any] | None = None,
                     final: bool = False) -> None:  # fmt: skip
        """The status object; ``final``: the "done" the syncers end on, which is state,
        not news: a write that fails for good raises (the process is started again)."""
        if not self.leader:
            return
        self._phase(state)
        record = {
            "state": state, "region": self.region, "step": self.step,
            "total_steps": self.loop.total_steps, "budget_tokens": self.cfg.budget.tokens,
            "tokens": self.step * self.loop.learner.tokens_per_step, "time": time.time(),
            "checkpoint_bytes": self.store.checkpoint_traffic.uploaded
            + self.store.checkpoint_traffic.downloaded,
            "failed_writes": self.io.failures,
            "skipped_uploads": getattr(self.io, "skipped", 0),
            "unsent_uploads": getattr(self.io, "unsent", 0),
            **({"last_round": row} if row else {}),
        }  # fmt: skip
        totals = {"startup_seconds": self.startup_seconds, "train_seconds": self.train_seconds}
        try:
            self.store.writer_for(self.id).progress.write_metrics(self.id, record, totals=totals)
        except OSError as exc:
            if final:
                raise
            self.log.warning("cannot write status: %s", exc)

    def close(self, state: str | None = None) -> None:
        """Close its I/O; ``state`` (done, stopped): the last heartbeat says it."""
        if isinstance(self.ledger, FollowedLedger):  # a take it waits for ends now
            self.ledger.stop.set()
        if self.heartbeat is not None:
            self.heartbeat.close(state)
        self.io.close()
        shutil.rmtree(self.spill_dir, ignore_errors=True)


def stop_between_flow_runs() -> None:
    """A worker stopped by a signal outside its learner's flow runs (between two, or as
    one ended: Prefect's engine swallows an interrupt raised after a flow's own code
    returned, and that flow run ends Completed): the learner the flow runs continue
    checkpoints where it is, waits for it (and every upload before it) to be written and
    closes, as a flow run stopped by a signal does. (A learner of several processes
    does not: a checkpoint is all of theirs; it resumes from its last one.)"""
    runtimes = this_process().runtimes
    for key in [k for k in runtimes if k[0] == "learner"]:
        rt = runtimes.pop(key)
        if rt.processes == 1:
            rt.checkpoint(wait=True)
            print(f"interrupted: checkpointed at step {rt.step}", file=sys.stderr, flush=True)
        rt.close("stopped")


@task(name="learner-round", task_run_name="{label}", retries=0, cache_policy=NO_CACHE,
      persist_result=False)  # fmt: skip
def train_round(rt: LearnerRuntime, label: str) -> dict[str, Any] | None:
    """One round; None when a signal stopped it (SIGINT: the run is stopped), which the
    flow takes as its interrupt: the task run ends, not Crashed ("Crash detected!")."""
    try:
        row = rt.train_round()
    except KeyboardInterrupt:
        get_run_logger().warning("stopped by a signal at step %d", rt.step)
        return None
    where = (f"step {row['step']} (run {100 * rt.loop.run_steps() / rt.cfg.budget_steps:.0f} %)"
             if rt.cfg.shared_budget else f"step {row['step']}/{rt.loop.total_steps}")  # fmt: skip
    get_run_logger().info(
        "%s loss %s, lr %.3g, %.0f tokens/s, sent %d, applied %d (staleness <= %d)", where,
        row["loss"], row["lr"], row["tokens_per_s"], row["sent"], row["applied"], row["staleness"],
    )  # fmt: skip
    return row


def _runtime(process: WorkerProcess, key: tuple, bucket: str, pipeline: dict | None,
             log: Any) -> LearnerRuntime:  # fmt: skip
    """The learner ``key`` names, as the process's last flow run left it, or made now (its
    first flow run in this process) and said where it resumes from."""
    rt = process.runtimes.get(key)
    if rt is not None:
        rt.loop.log = rt.io.log = rt.log = log
        return rt
    _, run, region, lid = key
    share_compilations(user_cache() / "jax")
    rt = process.runtimes[key] = LearnerRuntime(run, bucket, region, lid, pipeline)
    rt.loop.log = rt.io.log = rt.log = log
    if rt.processes > 1:
        log.info("this is process %d of the %d of learner %s (%s)", jax.process_index(),
                 rt.processes, rt.label, "it writes" if rt.leader else "process 0 writes")  # fmt: skip
    log.info("learner %s resumes from %s (step %d of %d, generation %d)", rt.label,
             rt.resumed_from, rt.step, rt.loop.total_steps, rt.generation)  # fmt: skip
    if rt.cfg.slowdown(rt.index) > 1:
        log.info("learner %s emulates a chip %.3g times slower (pipeline.speeds): it "
                 "sleeps after each step", rt.label, rt.cfg.slowdown(rt.index))  # fmt: skip
    if rt.store.keys.signing_key(lid) is None:
        log.warning("contributions are unsigned (no %s or %s): a syncer holding the run "
                    "secret rejects them", LEARNER_KEY_ENV, RUN_SECRET_ENV)  # fmt: skip
    return rt


@flow(name="learner", flow_run_name="learner {region}/{index}", persist_result=False)
def learner_flow(
    run: str, bucket: str, region: str, index: int, pipeline: dict | None = None,
    continued: bool = False,
) -> dict[str, Any] | State:  # fmt: skip
    """Train learner ``index`` of ``run`` in ``region`` (whose bucket is ``bucket``) for a
    bounded number of rounds; returns ``{"done": bool, "step": int, ...}``, or, stopped
    by a signal, checkpoints and ends its flow run Cancelled (``observe.stopped``).

    ``continued``: this process runs the learner's next flow run too (``flows.worker``),
    so its runtime and background I/O go on across the boundary. Otherwise (a
    deployment's flow run, whose process ends with it) the flow run checkpoints, waits
    until that checkpoint and every upload before it are written, and closes the runtime
    before it returns: nothing trained is lost at the boundary."""
    log = get_run_logger()
    outlive_the_reader()  # a deployment's: its worker may die first
    process = this_process()
    process.take_sigterm()  # in place of the flow engine's handler, for this run
    tag_flow_run(worker_tags(run, region, f"learner:{index}"))
    join_group()  # one of a learner's N processes (flows.hosts): join the others first
    key = ("learner", run, region, learner_id(index))
    rt = _runtime(process, key, bucket, pipeline, log)
    rows: list[dict[str, Any]] = []
    # this flow run's rounds as they happen (a crashed run shows the ones it trained)
    table = LiveTable(artifact_key(run, rt.id, "rounds"),
                      f"learner {rt.label} of run {run}: one row per round") if rt.leader else None  # fmt: skip
    try:
        for _ in range(rt.cfg.pipeline.rounds_per_flow_run):
            if process.stop.is_set():  # its interrupt was lost on its way (flows.worker)
                raise KeyboardInterrupt
            if rt.finished or rt.preempting():
                break
            row = train_round(rt, f"learner {rt.label} round {rt.round}")
            if row is None:  # (the round's task took the interrupt)
                raise KeyboardInterrupt
            rows.append(row)
            if table is not None:
                try:
                    table.show(list(rows))
                except Exception as exc:  # the table is for people; training goes on
                    log.warning("cannot update the table %s: %r", table.key, exc)
        if not rt.finished and rt.preempting():
            left = rt.leave()
            process.runtimes.pop(key, None)
            return {"done": False, "preempted": True, "rounds": len(rows), **left}
        # Once: a shared budget may end between two looks, and "done" must follow the
        # final checkpoint and every upload before it (the syncers end on it).
        finished = rt.finished
        rt.checkpoint(wait=finished or not continued)  # (the final one: waited for)
    except KeyboardInterrupt:
        log.warning("interrupted: checkpointing at step %d", rt.step)
        rt.checkpoint(wait=True)
        rt.close("stopped")
        process.runtimes.pop(key, None)
        return stopped(f"stopped by a signal: checkpointed at step {rt.step}")
    except Fenced as exc:
        if not exc.rejoin:
            raise
        # Taken for silent while alive (paused, cut off): the next flow run starts it as
        # a restart does, a new generation from its newest checkpoint and the data given.
        log.warning("learner %s was fenced off while alive (%s): it takes a new generation "
                    "and resumes from its newest checkpoint", rt.label, exc)  # fmt: skip
        rt.close()
        process.runtimes.pop(key, None)
        return {"done": False, "rejoins": True, "step": rt.step, "rounds": len(rows)}
    if finished:
        rt.write_status("done", final=True)
        if rt.cfg.shared_budget:
            log.info("learner %s is done at step %d: the learners have trained the run's "
                     "budget (%d of %d steps; its even share is %d)", rt.label, rt.step,
                     rt.loop.run_steps(), rt.cfg.budget_steps, rt.loop.total_steps)  # fmt: skip
    else:
        rt.write_status("paused")
    if finished or not continued:  # ("done": the look it was written on; the worker ends)
        rt.close("done" if finished else None)
        process.runtimes.pop(key, None)
    return {"done": finished, "step": rt.step, "rounds": len(rows)}
