"""The learner flow: one island of compute training its own copy of the model.

A flow run covers at most ``pipeline.rounds_per_flow_run`` rounds; each round is a
Prefect task run (``learner us-east/2 round 14``, retried with backoff) of
``pipeline.round_steps`` inner steps. The flow run starts from the learner's newest
checkpoint in its bucket (or from the newest global versions) and checkpoints every
``pipeline.checkpoint_rounds`` rounds and when it ends, so the next flow run, or a new
process after a crash, picks up there and memory does not grow with the run's length.

Only the learner's own region's bucket is touched. Contributions are uploaded by a
background thread and global versions are fetched by another, so transfers overlap the
inner steps; training never waits on the network in ``decoupled`` mode.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from diloco.config import RunConfig
from diloco.learner import Learner
from diloco.outer import Contribution
from flows.observe import artifact_key, run_logger, tag_flow_run
from flows.run import Model, build_model, config_from_spec, reader
from storage_layout.checkpoint import load_learner_checkpoint, save_learner_checkpoint
from storage_layout.commit import CommitConflict
from storage_layout.store import GlobalState, RunStore


class LearnerIO:
    """Background transfers of one learner: contributions up, global versions down.

    Uploads run in order on one thread, each retried with backoff while its region is
    unreachable. A poller lists the global versions of the fragments the learner is
    waiting on and prefetches the newest, so the learner finds it in ``inbox``.
    """

    def __init__(self, store: RunStore, poll_seconds: float, retries: int, log: Any):
        self.store = store
        self.poll_seconds = poll_seconds
        self.retries = retries
        self.log = log
        self.uploads = ThreadPoolExecutor(1, thread_name_prefix="upload")
        self.pending: list[Future] = []
        self.wanted: dict[int, int] = {}  # fragment -> fetch versions above this one
        self.inbox: dict[int, GlobalState] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.poller = threading.Thread(target=self._poll, name="globals", daemon=True)
        self.poller.start()

    def upload(self, c: Contribution) -> None:
        self.pending = [f for f in self.pending if not f.done() or f.exception()]
        self.pending.append(self.uploads.submit(self._put, c))

    def _put(self, c: Contribution) -> None:
        delay = 0.5
        for attempt in range(self.retries + 1):
            try:
                self.store.put_contribution(c)
                return
            except CommitConflict:
                raise  # this seq was committed by another writer: two processes, one learner id
            except OSError as exc:
                if attempt == self.retries:
                    raise
                self.log.warning(
                    "upload of fragment %d seq %d failed (%s); retrying in %.1f s",
                    c.fragment,
                    c.seq,
                    exc,
                    delay,
                )
                time.sleep(delay)
                delay = min(30.0, delay * 2)

    def flush(self) -> None:
        """Wait for every upload; raise the first failure."""
        pending, self.pending = self.pending, []
        for future in pending:
            future.result()

    def want(self, fragment: int, above: int) -> None:
        with self.lock:
            self.wanted[fragment] = above

    def take(self, fragment: int) -> GlobalState | None:
        with self.lock:
            state = self.inbox.pop(fragment, None)
            if state is not None:
                self.wanted.pop(fragment, None)
            return state

    def _poll(self) -> None:
        while not self.stop.wait(self.poll_seconds):
            with self.lock:
                wanted = dict(self.wanted)
            for p, above in wanted.items():
                try:
                    newest = self.store.latest_global(p)
                    have = self.inbox.get(p)
                    if newest is None or newest <= max(above, have.version if have else -1):
                        continue
                    state = self.store.get_global(p, newest, learner_view=True)
                except OSError as exc:
                    self.log.warning("cannot read global versions of fragment %d: %s", p, exc)
                    continue
                with self.lock:
                    if p in self.wanted:
                        self.inbox[p] = state

    def close(self) -> None:
        self.stop.set()
        self.uploads.shutdown(wait=True)
        self.poller.join(timeout=5)


class LearnerRuntime:
    """One learner process's state for one flow run: the core ``Learner`` plus its I/O."""

    def __init__(
        self, run: str, bucket: str, region: str, learner: str, pipeline: dict | None = None
    ):
        self.log = run_logger("diloco.learner")
        opened = time.time()
        self.store = RunStore(run, {region: bucket}, region, writer=learner)
        # Checkpoints get their own traffic counter: they are not synchronization traffic.
        self.ckpt_store = RunStore(run, {region: bucket}, region, writer=learner)
        spec = self.store.read_spec()
        if spec["learners"].get(learner) != region:
            raise ValueError(
                f"learner {learner!r} is not in region {region!r} in run {run!r}; "
                f"the run has {spec['learners']}"
            )
        self.cfg: RunConfig = config_from_spec(spec, pipeline)
        self.model: Model = build_model(self.cfg)
        self.index = int(learner.rsplit("-", 1)[1])
        self.label = f"{region}/{self.index}"
        self.run, self.region, self.id = run, region, learner
        self.total_steps = int(spec["train"]["steps_per_learner"])
        self._compile()
        self.learner = self._resume()
        opts = self.cfg.pipeline
        self.io = LearnerIO(self.store, opts.poll_seconds, opts.upload_retries, self.log)
        for p, frag in enumerate(self.learner.fragments):
            if frag.sent_at_step is not None:  # sent before the checkpoint, still unanswered
                self.io.want(p, frag.base_version)
        self.step_seconds = 0.0  # measured mean of the last round
        # Where this flow run's time went (the launcher's goodput breakdown; the status
        # sums them over flow runs): start-up is opening the run, compiling and resuming,
        # up to the first step; training is the rounds themselves.
        self.startup_seconds = self.train_seconds = 0.0
        self._opened: float | None = opened
        self._checkpoints = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._checkpointing: Future | None = None
        self.applied: list[dict[str, Any]] = []

    def _compile(self) -> None:
        """Compile the train step before reading the newest globals: compiling takes
        seconds, and a learner that starts from versions that old has its first
        contributions rejected as too stale."""
        trainer, cfg = self.model.trainer, self.cfg
        params = trainer.place_params(self.model.init)
        batch = np.zeros((cfg.data.batch_size, cfg.model.context + 1), dtype=np.int32)
        trainer.step(params, trainer.init_opt_state(params), batch)[2].block_until_ready()

    # resume ---------------------------------------------------------------------------
    def _newest_globals(self) -> dict[int, GlobalState]:
        out = {}
        for p in range(len(self.model.plan)):
            version = self.store.latest_global(p)
            if version is None:
                raise FileNotFoundError(
                    f"run {self.run!r} has no global version of fragment {p} in "
                    f"{self.store.urls[self.region]}; start it with `diloco train`"
                )
            out[p] = self.store.get_global(p, version, learner_view=True)
        return out

    def _resume(self) -> Learner:
        model, cfg = self.model, self.cfg
        newest = self._newest_globals()
        init = {n: v for g in newest.values() for n, v in g.params.items()}
        lrn = Learner(
            self.id, model.trainer, model.plan, cfg.topology, init, reader(cfg, self.index)
        )
        for p, g in newest.items():
            lrn.fragments[p].base_version = g.version
        steps = self.ckpt_store.checkpoint_steps(self.id)
        if not steps:
            self.resumed_from = f"global versions {[g.version for g in newest.values()]}"
            return lrn
        ckpt = load_learner_checkpoint(
            self.ckpt_store,
            self.id,
            steps[-1],
            model.plan,
            model.trainer.place_params,
            model.trainer.init_opt_state,
        )
        sent = [
            max(self.store.contribution_seqs(self.id, p, self.region), default=0)
            for p in range(len(model.plan))
        ]
        lrn.restore(ckpt, next_seq=max(sent) + 1, forget_sent=False)
        for p, g in newest.items():
            # Answers to sends before the checkpoint land by the usual rule (after tau);
            # a fragment too stale to contribute any more is re-anchored at once.
            if g.version - lrn.fragments[p].base_version > cfg.outer.max_staleness:
                lrn.apply_global(p, g.version, g.params)
        self.resumed_from = f"checkpoint at step {ckpt.step}"
        return lrn

    # training -------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.learner.step >= self.total_steps

    @property
    def round(self) -> int:
        """The number of the round about to run (1-based, stable across restarts)."""
        return self.learner.step // self.cfg.pipeline.round_steps + 1

    def _deliver(self) -> None:
        lrn = self.learner
        for p in range(len(self.model.plan)):
            if not lrn.may_apply(p):
                continue
            state = self.io.take(p)
            if state is None or state.version <= lrn.fragments[p].base_version:
                continue
            staleness = state.version - lrn.fragments[p].base_version
            weights = [
                w for k, w in state.meta.get("weights", {}).items() if k.startswith(f"{self.id}/")
            ]
            lrn.apply_global(p, state.version, state.params)
            self.applied.append(
                {
                    "fragment": p,
                    "version": state.version,
                    "staleness": staleness,
                    "weight": sum(weights),
                }
            )

    def _wait_for_answers(self) -> None:
        """Synchronous DiLoCo: block until every overdue fragment's answer is applied."""
        waited = time.monotonic()
        while self.learner.waiting_on():
            self._deliver()
            if not self.learner.waiting_on():
                break
            if time.monotonic() - waited > 60:
                self.log.info("still waiting for fragments %s", self.learner.waiting_on())
                waited = time.monotonic()
            time.sleep(self.cfg.pipeline.poll_seconds / 2)

    def train_round(self) -> dict[str, Any]:
        lrn = self.learner
        steps = min(self.cfg.pipeline.round_steps, self.total_steps - lrn.step)
        traffic = self.store.traffic
        up, down = traffic.uploaded, traffic.downloaded
        number, self.applied = self.round, []
        losses, sent = [], 0
        if self._opened is not None:
            self.startup_seconds += time.time() - self._opened
            self._opened = None
        start = last = time.perf_counter()
        for _ in range(steps):
            # Wall time per step; dispatch is asynchronous, but the device_get of each
            # contribution synchronizes every few steps, so the sum is the real time.
            now = time.perf_counter()
            losses.append(lrn.train_step(now - last if now > start else self.step_seconds))
            last = now
            self._deliver()
            p = lrn.due()
            if p is not None:
                c = lrn.contribute(p)
                self.io.upload(c)
                self.io.want(p, c.base_version)
                sent += 1
            if self.cfg.mode == "diloco":
                self._wait_for_answers()
        loss = float(np.mean(np.asarray([float(x) for x in losses])))  # waits for the device
        seconds = time.perf_counter() - start
        self.step_seconds = seconds / max(1, steps)
        self.train_seconds += seconds
        row = {
            "round": number,
            "steps": steps,
            "step": lrn.step,
            "tokens": lrn.step * lrn.tokens_per_step,
            "loss": round(loss, 4),
            "tokens_per_s": round(steps * lrn.tokens_per_step / seconds, 1),
            "sent": sent,
            "applied": len(self.applied),
            "staleness": max((a["staleness"] for a in self.applied), default=0),
            "merge_weight": round(sum(a["weight"] for a in self.applied), 4),
            "bytes_up": traffic.uploaded - up,
            "bytes_down": traffic.downloaded - down,
            "seconds": round(seconds, 3),
        }
        self.write_status("training", row)
        return row

    def checkpoint(self, wait: bool = False) -> None:
        """Snapshot the learner now and write the checkpoint in the background (JAX arrays
        are immutable, so the snapshot costs no copy of the parameters), after the
        contributions it covers are committed. ``wait`` blocks until it is written."""
        self.finish_checkpoint()  # one at a time, in order
        snapshot = self.learner.checkpoint()
        uploads = list(self.io.pending)

        def write() -> None:
            for future in uploads:
                future.result()
            if snapshot.step not in self.ckpt_store.checkpoint_steps(self.id):
                save_learner_checkpoint(self.ckpt_store, self.id, snapshot)

        self._checkpointing = self._checkpoints.submit(write)
        if wait:
            self.finish_checkpoint()

    def finish_checkpoint(self) -> None:
        """Wait for the checkpoint being written; raise if writing it failed."""
        future, self._checkpointing = self._checkpointing, None
        if future is not None:
            future.result()

    def write_status(self, state: str, row: dict[str, Any] | None = None) -> None:
        record = {
            "state": state,
            "region": self.region,
            "step": self.learner.step,
            "total_steps": self.total_steps,
            "tokens": self.learner.step * self.learner.tokens_per_step,
            "time": time.time(),
            "checkpoint_bytes": self.ckpt_store.traffic.uploaded
            + self.ckpt_store.traffic.downloaded,
            **({"last_round": row} if row else {}),
        }
        try:
            self.store.write_metrics(
                self.id,
                record,
                totals={
                    "startup_seconds": self.startup_seconds,
                    "train_seconds": self.train_seconds,
                },
            )
        except OSError as exc:
            self.log.warning("cannot write status: %s", exc)

    def close(self) -> None:
        try:
            self.finish_checkpoint()
        finally:
            self._checkpoints.shutdown(wait=True)
            self.io.close()


@task(
    name="learner-round",
    task_run_name="{label}",
    retries=2,
    retry_delay_seconds=[1, 10],
    cache_policy=NO_CACHE,
    persist_result=False,
)
def train_round(rt: LearnerRuntime, label: str) -> dict[str, Any]:
    row = rt.train_round()
    get_run_logger().info(
        "step %d/%d loss %.4f, %.0f tokens/s, sent %d, applied %d (staleness <= %d)",
        row["step"],
        rt.total_steps,
        row["loss"],
        row["tokens_per_s"],
        row["sent"],
        row["applied"],
        row["staleness"],
    )
    return row


@task(
    name="learner-checkpoint",
    task_run_name="{label}",
    retries=3,
    retry_delay_seconds=[1, 5, 20],
    cache_policy=NO_CACHE,
    persist_result=False,
)
def save_checkpoint(rt: LearnerRuntime, label: str, wait: bool = False) -> int:
    rt.checkpoint(wait)
    return rt.learner.step


@flow(name="learner", flow_run_name="learner {region}/{index}", persist_result=False)
def learner_flow(
    run: str, bucket: str, region: str, index: int, pipeline: dict | None = None
) -> dict[str, Any]:
    """Train learner ``index`` of ``run`` in ``region`` (whose bucket is ``bucket``) for a
    bounded number of rounds; returns ``{"done": bool, "step": int, ...}``."""
    log = get_run_logger()
    tag_flow_run([f"run:{run}", f"region:{region}", f"learner:{index}"])
    rt = LearnerRuntime(run, bucket, region, f"learner-{index}", pipeline)
    opts = rt.cfg.pipeline
    log.info(
        "learner %s resumes from %s (step %d of %d)",
        rt.label,
        rt.resumed_from,
        rt.learner.step,
        rt.total_steps,
    )
    rows: list[dict[str, Any]] = []
    try:
        for _ in range(opts.rounds_per_flow_run):
            if rt.finished:
                break
            rows.append(train_round(rt, f"learner {rt.label} round {rt.round}"))
            if (rt.round - 1) % opts.checkpoint_rounds == 0:
                save_checkpoint(rt, f"learner {rt.label} checkpoint {rt.learner.step}")
        save_checkpoint(rt, f"learner {rt.label} checkpoint {rt.learner.step}", wait=True)
    except KeyboardInterrupt:
        log.warning("interrupted: checkpointing at step %d", rt.learner.step)
        rt.checkpoint(wait=True)
        raise
    finally:
        rt.close()
    rt.write_status("done" if rt.finished else "paused")
    if rows:
        create_table_artifact(
            rows,
            key=artifact_key(run, rt.id, "rounds"),
            description=f"learner {rt.label} of run {run}: one row per round",
        )
    return {"done": rt.finished, "step": rt.learner.step, "rounds": len(rows)}
