"""Many learners and the syncers in one process, on a simulated clock.

The simulator is a scheduler (``diloco.scheduler``): it drives the same ``LearnerLoop``
and ``SyncerLoop`` that the Prefect pipeline runs, over a ``SimulatedNetwork`` on a
virtual clock instead of the wall clock. Learners do real inner steps on real data (the
compute is real, the clock is not): learner ``m`` takes ``speeds[m] * step_seconds``
simulated seconds per inner step (``pipeline.speeds``, which a learner of the pipeline
emulates by sleeping: ``WallClock``), a transfer of ``n`` bytes takes
``latency + 8 n / bandwidth``. A failure stops a learner's loop where it stands (like
SIGKILL) and its rejoin starts a new one from the store, as a restarted process does.
Ties break by insertion order, so a seed fixes every number bit for bit.

Modes (ALGORITHM.md): ``dp`` (one model, global batch M x B, all-reduce every step; a
baseline with its own loop), ``diloco`` (K = M, no grace, learners wait for each
answer), ``decoupled`` (K, adaptive grace window, staleness weights, nobody waits).

Goodput = learner time whose work reached the global model / allocated learner time
(each learner from the start until its budget is done). Work is lost to failures (what
was neither checkpointed nor sent), to waiting, to rejection, and to steps never merged.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import astuple, dataclass, field
from typing import Any

import numpy as np

from diloco import records
from diloco.config import RunConfig, sim_events
from diloco.data import ShardReader
from diloco.fragments import FragmentPlan, fragment_sizes, plan_fragments
from diloco.inner import InnerTrainer
from diloco.learner_loop import LearnerLoop, resume_step
from diloco.loops import Request, Wait
from diloco.model import ParamCodec
from diloco.network import SimulatedNetwork, transfer_seconds
from diloco.outer import FlatParams
from diloco.run_data import RunData, settle_assign
from diloco.scheduler import Scheduler, VirtualClock
from diloco.syncer_loop import SyncerLoop
from diloco.tensors import materialize
from diloco.transport import MemoryStore, Store
from diloco.units import MemoryLedger, RegionalLedger, UnitLedger, UnitPlan, UnitReader
from protocol.quantize import payload_bytes
from protocol.topology import (
    learner_id,
    learner_ids,
    learner_index,
    shard_count,
    shard_fragments,
    shard_of,
    syncer_id,
)

Progress = Callable[[int, int, float | None], None]  # tokens done, token budget, last eval loss


# (config, fragment plan, initial parameters, learner ids) -> the store a run goes through
StoreFactory = Callable[[RunConfig, FragmentPlan, FlatParams, Sequence[str]], Store]


def dp_bytes_per_step(num_params: int, learners: int) -> int:
    """Ring all-reduce of fp32 gradients: about 2 |theta| x 4 bytes per replica per step."""
    return learners * 2 * num_params * 4


@dataclass
class SimResult:
    config: RunConfig
    metrics: list[dict[str, Any]]  # JSON lines: evals, versions, rejections, learner events
    summary: dict[str, Any]

    @property
    def evals(self) -> list[dict[str, Any]]:
        return [m for m in self.metrics if m["event"] == "eval"]


@dataclass
class _Run:
    """Shared bookkeeping of one simulation."""

    cfg: RunConfig
    trainer: InnerTrainer
    data: RunData  # the readers and the validation batches
    progress: Progress | None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    tokens: int = 0
    next_eval: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    goodput: float = 0.0
    finished: dict[str, float] = field(default_factory=dict)  # learner -> when it was done

    @property
    def budget(self) -> int:
        return self.cfg.budget.tokens

    def milestones(self) -> list[int]:
        n = self.cfg.sim.eval_points
        return [self.budget * i // n for i in range(n)]  # the final eval comes after the run

    def maybe_evaluate(self, now: float, params_fn: Callable[[], dict]) -> None:
        marks = self.milestones()
        while self.next_eval < len(marks) and self.tokens >= marks[self.next_eval]:
            self.evaluate(now, params_fn())
            self.next_eval += 1

    def evaluate(self, now: float, params: dict, final: bool = False) -> float:
        loss = self.trainer.evaluate(params, self.data.validation)
        self.metrics.append(records.evaluation(self.tokens, loss, now, final))
        if self.progress:
            self.progress(self.tokens, self.budget, loss)
        return loss


def simulate(
    cfg: RunConfig,
    progress: Progress | None = None,
    store: StoreFactory | None = None,
) -> SimResult:
    cfg = settle_assign(cfg, buckets=store is not None)
    m = cfg.topology.learners
    data = RunData(cfg)
    data.check()
    codec, state = ParamCodec.create(cfg.model, cfg.seed)
    init = codec.to_flat(state)
    trainer = InnerTrainer(codec, cfg.inner, cfg.steps_per_learner)
    units = data.units if cfg.data.assign == "units" else None
    run = _Run(cfg, trainer, data, progress)
    if cfg.mode == "dp":
        ledger = MemoryLedger(units) if units else None
        end = _simulate_dp(run, codec, init, [data.reader(i, ledger) for i in range(m)])
    else:
        # The readers are made once the store is there: with units, it keeps the ledger.
        end, ledger = _simulate_loops(run, codec, init, units, store)

    dp_bytes = dp_bytes_per_step(codec.num_params, m) * (run.tokens // (m * cfg.tokens_per_step))
    moved = run.bytes_up + run.bytes_down
    evals = [e for e in run.metrics if e["event"] == "eval"]
    summary = {
        "mode": cfg.mode,
        "params": codec.num_params,
        "learners": m,
        "quorum": cfg.quorum if cfg.mode != "dp" else m,
        "tokens": run.tokens,
        "final_loss": evals[-1]["loss"],
        "initial_loss": evals[0]["loss"],
        "sim_seconds": end,
        "goodput": run.goodput,
        "learner_seconds": run.finished,
        "bytes_up": run.bytes_up,
        "bytes_down": run.bytes_down,
        "bytes_total": moved,
        "dp_bytes": dp_bytes,
        "bandwidth_ratio_vs_dp": (dp_bytes / moved) if moved else 1.0,
        "versions": sum(1 for e in run.metrics if e["event"] == "version"),
        "rejected": sum(1 for e in run.metrics if e["event"] == "rejected"),
    }
    if ledger is not None:  # who holds which data (``diloco.units``), and what was given back
        learners = sorted({*learner_ids(m), *run.finished}, key=learner_index)  # with added
        summary["data_spans"] = {lid: [astuple(s) for s in ledger.spans(lid)] for lid in learners}
        summary["data_returned"] = [astuple(s) for s in ledger.given_back()]
    return SimResult(cfg, run.metrics, summary)


def _failure_windows(cfg: RunConfig, nominal: float) -> list[tuple[float, float, int]]:
    return sorted(
        (f.at * nominal, (f.at + f.duration) * nominal, f.learner) for f in cfg.sim.failures
    )


def _simulate_dp(run: _Run, codec: ParamCodec, init: dict, readers: list[ShardReader]) -> float:
    """Synchronous data parallel: every step waits for the slowest replica and an all-reduce.

    A failure of any replica stops all (non-elastic): the run stalls until the replica is
    back, then redoes the steps since the last checkpoint (same data, same result; only
    time is lost, so they are not recomputed here).
    """
    cfg, sim = run.cfg, run.cfg.sim
    m = cfg.topology.learners
    speeds = cfg.speeds
    step_time = max(speeds) * sim.step_seconds + transfer_seconds(2 * codec.num_params * 4, sim)
    steps = cfg.steps_per_learner
    failures = _failure_windows(cfg, steps * sim.step_seconds)
    params = run.trainer.place_params(init)
    opt_state = run.trainer.init_opt_state(params)
    now, last_ckpt, useful = 0.0, 0, 0.0
    run.maybe_evaluate(now, lambda: params)
    for step in range(1, steps + 1):
        batch = np.concatenate([r.next_batch() for r in readers])
        params, opt_state, _ = run.trainer.step(params, opt_state, batch, step - 1)
        now += step_time
        while failures and failures[0][0] <= now:
            start, end, learner = failures.pop(0)
            lost = step - last_ckpt
            run.metrics.append(records.failure(learner_id(learner), step, start))
            now = max(now, end) + lost * step_time
        if step % cfg.pipeline.checkpoint_every == 0:
            last_ckpt = step
        run.tokens += m * cfg.tokens_per_step
        run.bytes_up += dp_bytes_per_step(codec.num_params, m) // 2
        run.bytes_down += dp_bytes_per_step(codec.num_params, m) // 2
        useful += sum(speeds) * sim.step_seconds
        run.maybe_evaluate(now, lambda p=params: p)
    run.evaluate(now, params, final=True)
    run.goodput = useful / (m * now) if now > 0 else 0.0
    run.finished = dict.fromkeys(learner_ids(m), now)  # (a replica is named as a learner)
    return now


def _membership_schedule(cfg: RunConfig, clock: VirtualClock, fleet: _Fleet) -> Iterator[Request]:
    """Failures, leaves, rejoins and joins (``sim_events``) at their shares of the
    nominal run time."""
    nominal = cfg.steps_per_learner * cfg.sim.step_seconds
    act = {"fail": fleet.fail, "leave": fleet.leave, "back": fleet.rejoin, "join": fleet.join}
    for at, _, kind, learner, notice in sim_events(cfg.sim):
        if at * nominal > clock.now():
            yield Wait(at * nominal - clock.now())
        if kind in ("fail", "leave"):
            act[kind](learner, notice)
        else:
            act[kind](learner)


class _Fleet:
    """The simulated learners: started, failed, left, rejoined, joined and ended by the
    scheduler. A slot is held, down (failed, to come back) or vacant (never started,
    ``pipeline.learners_started``, or left); the syncers' members are the held slots."""

    def __init__(self, run: _Run, plan: FragmentPlan, readers: list[ShardReader],
                 sched: Scheduler, clock: VirtualClock):  # fmt: skip
        self.run, self.plan, self.readers = run, plan, readers
        self.sched, self.clock = sched, clock
        self.ids = learner_ids(run.cfg.topology.learners)
        self.net: SimulatedNetwork | None = None  # set once the network exists
        self.ledger: UnitLedger | None = None  # data.assign = "units": the store's
        self.loops: dict[str, LearnerLoop] = {}
        self.ended: dict[str, float] = {}  # learner -> when its loop ended
        self.down: dict[int, int] = {}  # learner index -> its step when it failed
        started = run.cfg.started_learners(self.ids)
        self.vacant: dict[int, float] = {  # learner index -> since when its slot is vacant
            i: 0.0 for i, lid in enumerate(self.ids) if lid not in started
        }
        self.vacant_seconds = dict.fromkeys(range(len(self.ids)), 0.0)
        self.syncers: list[str] = []  # told when a learner goes: their quorum follows

    def members(self) -> list[str]:
        """The learners that hold their slot (the syncers' quorum: ``member_quorum``)."""
        return [lid for i, lid in enumerate(self.ids) if i not in self.down | self.vacant.keys()]

    def finished(self, budget_spent: bool = False) -> bool:
        """Every slot's learner is done; once the budget is spent, a vacant slot holds
        the end no longer (``learners_finished``, as in the pipeline)."""
        return not self.down and all(
            lid in self.ended or (i in self.vacant and budget_spent)
            for i, lid in enumerate(self.ids)
        )

    def start(self, i: int) -> str:
        lid, run = self.ids[i], self.run
        loop, source = LearnerLoop.start(lid, run.trainer, self.plan, self.readers[i], run.cfg,
                                         self.net.learner_view(lid), self.clock,
                                         run.metrics.append)  # fmt: skip
        self.loops[lid] = loop
        self.ended.pop(lid, None)
        self.sched.start(lid, loop.run())
        return source

    def fail(self, i: int, notice: bool = False) -> None:
        """Learner ``i`` goes down where its loop stands; with ``notice`` (preempted), it
        first sends what it trained and checkpoints, as a pipeline learner does."""
        lid = self.ids[i]
        if lid in self.ended or not self.sched.stop(lid):
            return  # done already: nothing to lose
        loop = self.loops[lid]
        if notice:
            loop.send_pending()
            loop.checkpoint()
        self.down[i] = loop.learner.step
        self.run.metrics.append(records.failure(lid, self.down[i], self.clock.now(), notice))
        self._members_changed()

    def leave(self, i: int, notice: bool = False) -> None:
        """Learner ``i`` goes (``fail``) and its slot is vacant until a learner joins it.
        Taking data in units, it gives back its stream from where its slot resumes."""
        self.fail(i, notice)
        if self.down.pop(i, None) is not None:
            self.vacant[i] = self.clock.now()
            reader = self.readers[i]
            if isinstance(reader, UnitReader):
                view = self.net.learner_view(self.ids[i])
                ckpt = view.load_checkpoint()
                step = resume_step(ckpt.step if ckpt else 0, view.sent_so_far()[1])
                reader.ledger.release(self.ids[i], step * reader.batch_size)

    def rejoin(self, i: int) -> None:
        if i not in self.down:
            return
        before = self.down.pop(i)
        source = self.start(i)
        step = self.loops[self.ids[i]].learner.step
        record = records.rejoin(self.ids[i], step, before - step, source, self.clock.now())
        self.run.metrics.append(record)

    def add(self, i: int) -> None:
        """Slot ``i``, the next beyond the run's (taking data in units), added vacant
        since the start (as ``diloco join`` adds one when none is vacant): the store
        takes its learner (``Store.add_learner``: a bucket holds its member record)."""
        lid = learner_id(i)
        self.net.store.add_learner(lid)
        self.ids.append(lid)
        self.net.learners.append(lid)  # told of new versions
        self.readers.append(self.run.data.reader(i, self.ledger))
        self.vacant[i], self.vacant_seconds[i] = 0.0, 0.0

    def join(self, i: int) -> None:
        """A learner takes vacant slot ``i``: the slot's checkpoint and data position, the
        newest global versions (``LearnerLoop.start``, as ``diloco join``); ``i`` the next
        index beyond the slots: a slot added (``add``)."""
        if i == len(self.ids):
            self.add(i)
        since = self.vacant.pop(i, None)
        if since is None:
            return
        self.vacant_seconds[i] += self.clock.now() - since
        lid = self.ids[i]
        source = self.start(i)
        step = self.loops[lid].learner.step
        self.run.metrics.append(records.joined(lid, step, source, self.clock.now()))
        self._members_changed()

    def _members_changed(self) -> None:
        for s in self.syncers:  # a merge may be due now, or a wait end
            self.sched.notify(s, self.clock.now())

    def present_seconds(self, end: float) -> dict[str, float]:
        """Each slot's time held or down (the learner time goodput divides by) up to its
        learner's end: a vacant slot's time is no one's."""
        out = {}
        for i, lid in enumerate(self.ids):
            stop = self.ended.get(lid, end)
            vacant = self.vacant_seconds[i] + (stop - self.vacant[i] if i in self.vacant else 0.0)
            out[lid] = max(0.0, stop - vacant)
        return out

    def on_end(self, name: str, syncers: list[str]) -> None:
        if name in self.loops and name not in self.ended:
            self.ended[name] = self.clock.now()
            for s in syncers:  # a waiting syncer looks whether the run is over
                self.sched.notify(s, self.clock.now())


def _simulate_loops(run: _Run, codec: ParamCodec, init: FlatParams, units: UnitPlan | None,
                    make_store: StoreFactory | None) -> tuple[float, UnitLedger | None]:  # fmt: skip
    """Decoupled or synchronous DiLoCo: the pipeline's loops under the scheduler. Returns
    the end's time and, with ``units``, the store's data ledger."""
    cfg, sim, topo = run.cfg, run.cfg.sim, run.cfg.topology
    plan = plan_fragments(codec.sizes, topo.fragments, topo.fragment_strategy)
    sizes = fragment_sizes(plan, codec.sizes)
    # How long a new version takes to reach learners: its compact update where there is
    # one (a learner that holds the version before; one that does not reads the full copy,
    # which the network model does not delay longer).
    wire = topo.global_dtype if topo.downlink == "full" else topo.downlink
    ids = learner_ids(topo.learners)
    shards = shard_count(cfg.pipeline.syncer_shards, len(plan))
    store = (make_store or _memory_store)(cfg, plan, init, ids)
    ledger = store.ledger(units) if units else None
    readers = [run.data.reader(i, ledger) for i in range(topo.learners)]
    clock = VirtualClock()
    sched = Scheduler(clock, lambda name: cfg.speed(learner_index(name)) * sim.step_seconds)
    fleet = _Fleet(run, plan, readers, sched, clock)
    fleet.ledger = ledger
    fleet.net = net = SimulatedNetwork(
        store, clock, sim, [payload_bytes(s, wire, topo.block_size) for s in sizes], ids,
        owner=lambda p: syncer_id(shard_of(p, shards)),
        notify=sched.notify,
        finished=fleet.finished,
        # Through buckets, each region's data pool is tended at each look at the members
        # (a region with none: its pool offered to the others), as the syncers do.
        members=(lambda: ledger.tend(fleet.members())) if isinstance(ledger, RegionalLedger)
        else fleet.members,
    )  # fmt: skip
    syncers = {syncer_id(s): SyncerLoop(cfg, shard_fragments(s, shards, len(plan)), ids, net,
                                        clock, run.metrics.append) for s in range(shards)}  # fmt: skip
    fleet.syncers = list(syncers)

    def global_params() -> dict:
        flat = {n: v for s in syncers.values() for f in s.syncers.values()
                for n, v in materialize(f.params).items()}  # fmt: skip
        return run.trainer.place_params(flat)

    def on_step(name: str) -> None:
        run.tokens += cfg.tokens_per_step
        run.maybe_evaluate(clock.now(), global_params)

    for name, loop in syncers.items():
        sched.start(name, loop.run())
    for i in range(topo.learners):
        if i not in fleet.vacant:
            fleet.start(i)
    if sim.failures or sim.joins:
        sched.start("membership", _membership_schedule(cfg, clock, fleet), background=True)
    run.maybe_evaluate(0.0, global_params)
    sched.run(on_step, lambda name: fleet.on_end(name, list(syncers)))

    end = clock.now()
    loss = run.evaluate(end, global_params(), final=True)
    store.close({"tokens": run.tokens, "sim_seconds": end, "final_loss": loss})
    _account(run, fleet.present_seconds(end), [s / codec.num_params for s in sizes])
    return end, ledger


def _account(run: _Run, present: dict[str, float], shares: list[float]) -> None:
    """The run's payload traffic, each learner's time present and the goodput, from its
    records."""
    run.bytes_up, run.bytes_down = records.payload_traffic(run.metrics)
    run.finished = present
    run.goodput = records.goodput(records.of(run.metrics, "version"), shares,
                                  sum(present.values()))  # fmt: skip


def _memory_store(cfg: RunConfig, plan: FragmentPlan, init: FlatParams,
                  ids: Sequence[str]) -> MemoryStore:  # fmt: skip
    """The simulator's own store (no buckets): the initial parameters as version 0."""
    topo = cfg.topology
    initial = [{n: init[n] for n in names} for names in plan]
    return MemoryStore(initial, topo.global_dtype, cfg.outer.max_staleness, topo.downlink,
                       topo.block_size)  # fmt: skip


def time_to_loss(evals: list[dict[str, Any]], target: float) -> float:
    """Simulated time at which the eval curve first reaches ``target`` (linear interpolation)."""
    for prev, cur in itertools.pairwise(evals):
        if cur["loss"] <= target:
            if prev["loss"] == cur["loss"]:
                return cur["time"]
            frac = (prev["loss"] - target) / (prev["loss"] - cur["loss"])
            return prev["time"] + max(0.0, min(1.0, frac)) * (cur["time"] - prev["time"])
    return math.inf
