"""A learner's runtime (``LearnerRuntime``): the core ``LearnerLoop`` on the wall clock over
its own region's bucket, its background I/O (``flows.learner_io``), its heartbeat, its
status and its data, kept by a worker process across its flow runs (``flows.learner``);
and the compilation of its step, once a machine, which a spare's warm-up does ahead."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from diloco import hosts, records
from diloco.learner import compile_apply
from diloco.learner_loop import LearnerLoop
from diloco.loops import Clock, WallClock, drive
from diloco.quantize_device import outer_gradient
from diloco.transport import StoreLearnerView
from diloco.units import UnitReader
from flows.compile import compile_turn
from flows.heartbeat import Heartbeat
from flows.learner_io import BackgroundIO, wait_for_space
from flows.ledger import BucketLedger, FollowedLedger, region_ledger, region_pools
from flows.observe import run_logger
from flows.process import this_process
from flows.run import Run, build_model
from flows.state_io import HostPart
from protocol.topology import learner_index
from storage_layout.chunks import process_folder
from storage_layout.spill import SpillFolder


class Fenced(RuntimeError):
    """This process may write as its learner no more: another process runs as it now
    (this one must stop), or, ``rejoin``, a syncer fenced it off as silent while it was
    alive (paused, cut off): it takes a new generation and goes on (``learner_flow``)."""

    def __init__(self, reason: str, rejoin: bool = False):
        super().__init__(reason)
        self.rejoin = rejoin


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
        zeros = {n: np.zeros(v.shape, v.dtype) for n, v in model.shapes.items()}
        params = trainer.place_params(zeros)
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
        self.opened = opened = Run.open(run, {region: bucket}, region, pipeline, learner=True,
                                        faults=self.process.faults)  # fmt: skip
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
            if isinstance(record, dict) and "fence" in record:  # flows.unit_offers.SilentReleases
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
