"""Many learners and the syncer in one process, on a simulated clock.

Learners do real inner steps on real data (the compute is real, the clock is not):
learner ``m`` takes ``speeds[m] * step_seconds`` simulated seconds per inner step, a
transfer of ``n`` bytes takes ``latency + 8 n / bandwidth``. An event queue orders step
completions, contribution arrivals, merges, deliveries of global versions, failures and
rejoins; ties break by insertion order, so a seed fixes every number bit for bit.

Modes (ALGORITHM.md): ``dp`` (one model, global batch M x B, all-reduce every step),
``diloco`` (K = M, no grace, learners wait for each answer), ``decoupled`` (K, adaptive
grace window, staleness weights, learners never wait).

Goodput = learner time whose work reached the global model / allocated learner time
(M x run time). Work is lost to failures (since the last checkpoint), to waiting, to
rejection, and to steps never merged.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Protocol

import numpy as np

from diloco.config import RunConfig, SimConfig
from diloco.data import Corpus, ShardReader, load_corpus, validation_batches
from diloco.fragments import FragmentPlan, fragment_sizes, plan_fragments
from diloco.inner import InnerTrainer
from diloco.learner import Learner
from diloco.model import ParamCodec, is_embedding
from diloco.outer import Contribution, FlatParams
from diloco.quantize import dequantize, quantize
from diloco.syncer import (
    FragmentSyncer,
    GlobalVersion,
    estimate_step_seconds,
    grace_window,
    quorum_met,
)

Progress = Callable[[int, int, float | None], None]  # tokens done, token budget, last eval loss


class Transport(Protocol):
    """How contributions reach the syncer and global versions reach learners.

    The simulator's clock decides *when*; the transport decides *how*. In process by
    default; ``flows.sim_transport`` sends everything through buckets.
    """

    def send(self, c: Contribution) -> None: ...

    def receive(self, c: Contribution) -> Contribution: ...

    def publish(self, gv: GlobalVersion, opt_leaves: list[np.ndarray]) -> None: ...

    def fetch(self, learner: str, fragment: int, version: int) -> FlatParams: ...

    def close(self, summary: dict[str, Any]) -> None: ...


TransportFactory = Callable[[RunConfig, FragmentPlan, Sequence[str]], Transport]


class InProcessTransport:
    """Objects passed by reference; globals rounded to the wire dtype as a bucket would."""

    def __init__(self, wire_dtype: str):
        self.wire_dtype = wire_dtype
        self.globals: dict[tuple[int, int], FlatParams] = {}

    def send(self, c: Contribution) -> None:
        pass

    def receive(self, c: Contribution) -> Contribution:
        return c

    def publish(self, gv: GlobalVersion, opt_leaves: list[np.ndarray]) -> None:
        wire = {n: dequantize(quantize(v, self.wire_dtype)) for n, v in gv.params.items()}
        self.globals[(gv.fragment, gv.version)] = wire
        self.globals.pop((gv.fragment, gv.version - 2), None)  # nobody fetches that far back

    def fetch(self, learner: str, fragment: int, version: int) -> FlatParams:
        return self.globals[(fragment, version)]

    def close(self, summary: dict[str, Any]) -> None:
        pass


@lru_cache(maxsize=4)
def cached_corpus(source: str | None, shards: int, val_percent: int) -> Corpus:
    return load_corpus(source, shards, val_percent)


def transfer_seconds(nbytes: int, sim: SimConfig) -> float:
    return sim.latency_seconds + 8.0 * nbytes / (sim.bandwidth_gbps * 1e9)


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
    val: list[np.ndarray]
    progress: Progress | None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    tokens: int = 0
    next_eval: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    useful_seconds: float = 0.0

    @property
    def budget(self) -> int:
        return self.cfg.sim.total_tokens

    def milestones(self) -> list[int]:
        n = self.cfg.sim.eval_points
        return [self.budget * i // n for i in range(n)]  # the final eval comes after the run

    def maybe_evaluate(self, now: float, params_fn: Callable[[], dict]) -> None:
        marks = self.milestones()
        while self.next_eval < len(marks) and self.tokens >= marks[self.next_eval]:
            self.evaluate(now, params_fn())
            self.next_eval += 1

    def evaluate(self, now: float, params: dict, final: bool = False) -> float:
        loss = self.trainer.evaluate(params, self.val)
        self.metrics.append(
            {"event": "eval", "tokens": self.tokens, "time": now, "loss": loss, "final": final}
        )
        if self.progress:
            self.progress(self.tokens, self.budget, loss)
        return loss


def simulate(
    cfg: RunConfig,
    progress: Progress | None = None,
    transport: TransportFactory | None = None,
) -> SimResult:
    m = cfg.topology.learners
    corpus = cached_corpus(cfg.data.source, m, cfg.data.val_percent)
    codec, state = ParamCodec.create(cfg.model, cfg.seed)
    init = codec.to_flat(state)
    trainer = InnerTrainer(codec, cfg.inner, cfg.steps_per_learner)
    val = validation_batches(
        corpus, cfg.data.batch_size, cfg.model.context, cfg.data.eval_batches, cfg.seed
    )
    readers = [
        ShardReader(corpus.train_shards[i], cfg.data.batch_size, cfg.model.context, cfg.seed, i)
        for i in range(m)
    ]
    run = _Run(cfg, trainer, val, progress)
    if cfg.mode == "dp":
        end = _simulate_dp(run, codec, init, readers)
    else:
        end = _simulate_diloco(run, codec, init, readers, transport)

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
        "goodput": run.useful_seconds / (m * end) if end > 0 else 0.0,
        "bytes_up": run.bytes_up,
        "bytes_down": run.bytes_down,
        "bytes_total": moved,
        "dp_bytes": dp_bytes,
        "bandwidth_ratio_vs_dp": (dp_bytes / moved) if moved else 1.0,
        "versions": sum(1 for e in run.metrics if e["event"] == "version"),
        "rejected": sum(1 for e in run.metrics if e["event"] == "rejected"),
    }
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
    speeds = sim.speeds or (1.0,) * m
    step_time = max(speeds) * sim.step_seconds + transfer_seconds(2 * codec.num_params * 4, sim)
    steps = cfg.steps_per_learner
    failures = _failure_windows(cfg, steps * sim.step_seconds)
    params = run.trainer.place_params(init)
    opt_state = run.trainer.init_opt_state(params)
    now, last_ckpt = 0.0, 0
    run.maybe_evaluate(now, lambda: params)
    for step in range(1, steps + 1):
        batch = np.concatenate([r.next_batch() for r in readers])
        params, opt_state, loss = run.trainer.step(params, opt_state, batch)
        now += step_time
        while failures and failures[0][0] <= now:
            start, end, learner = failures.pop(0)
            lost = step - last_ckpt
            run.metrics.append(
                {"event": "failure", "learner": learner, "time": start, "lost_steps": lost}
            )
            now = max(now, end) + lost * step_time
        if step % sim.checkpoint_every == 0:
            last_ckpt = step
        run.tokens += m * cfg.tokens_per_step
        run.bytes_up += dp_bytes_per_step(codec.num_params, m) // 2
        run.bytes_down += dp_bytes_per_step(codec.num_params, m) // 2
        run.useful_seconds += sum(speeds) * sim.step_seconds
        if step % cfg.topology.inner_steps == 0:
            run.metrics.append(
                {"event": "train", "learner": "dp", "step": step, "loss": float(loss)}
            )
        run.maybe_evaluate(now, lambda p=params: p)
    run.evaluate(now, params, final=True)
    return now


def _simulate_diloco(
    run: _Run,
    codec: ParamCodec,
    init: dict,
    readers: list[ShardReader],
    make_transport: TransportFactory | None,
) -> float:
    cfg, sim, topo = run.cfg, run.cfg.sim, run.cfg.topology
    m, sync = topo.learners, cfg.mode == "diloco"
    speeds = sim.speeds or (1.0,) * m
    plan = plan_fragments(codec.sizes, topo.fragments, topo.fragment_strategy)
    sizes = fragment_sizes(plan, codec.sizes)
    share = [s / codec.num_params for s in sizes]
    global_bytes = [s * (4 if topo.global_dtype == "fp32" else 2) for s in sizes]
    ids = [f"learner-{i}" for i in range(m)]
    learners = [Learner(ids[i], run.trainer, plan, topo, init, readers[i]) for i in range(m)]
    syncers = [
        FragmentSyncer(p, {n: init[n] for n in names}, cfg.outer, ids, is_embedding)
        for p, names in enumerate(plan)
    ]
    quorum = cfg.quorum
    gamma = 0.0 if sync else topo.grace
    wire = (
        make_transport(cfg, plan, ids) if make_transport else InProcessTransport(topo.global_dtype)
    )

    queue: list[tuple[float, int, str, tuple]] = []
    order = itertools.count()

    def push(t: float, kind: str, *args: Any) -> None:
        heapq.heappush(queue, (t, next(order), kind, args))

    alive, blocked = [True] * m, [False] * m
    generation = [0] * m  # bumps on failure: drops the dead learner's scheduled steps
    inbox: list[list[tuple[float, int] | None]] = [[None] * len(plan) for _ in range(m)]
    checkpoints = [lrn.checkpoint() for lrn in learners]
    last_seq = [0] * m
    first_arrival: list[float | None] = [None] * len(plan)
    merge_due = [False] * len(plan)

    def step_time(i: int) -> float:
        return speeds[i] * sim.step_seconds

    def global_params() -> dict:
        return run.trainer.place_params({n: v for s in syncers for n, v in s.params.items()})

    def deliver(i: int, now: float, force: bool = False) -> None:
        lrn = learners[i]
        for p, item in enumerate(inbox[i]):
            if item is None:
                continue
            available, version = item
            newer = available <= now and version > lrn.fragments[p].base_version
            if newer and (force or lrn.may_apply(p)):
                lrn.apply_global(p, version, wire.fetch(lrn.id, p, version))
                run.bytes_down += global_bytes[p]

    def schedule_step(i: int, now: float) -> None:
        if sync and learners[i].waiting_on():
            blocked[i] = True
            return
        blocked[i] = False
        push(now + step_time(i), "step", i, generation[i])

    def merge(p: int, now: float) -> None:
        merge_due[p], first_arrival[p] = False, None
        outcome = syncers[p].merge()
        for r in outcome.rejected:
            c = r.contribution
            run.metrics.append(
                {
                    "event": "rejected",
                    "time": now,
                    "learner": c.learner,
                    "fragment": p,
                    "seq": c.seq,
                    "reason": r.reason,
                }
            )
        gv = outcome.version
        if gv is None:
            return
        run.useful_seconds += share[p] * gv.seconds
        run.metrics.append(
            {
                "event": "version",
                "time": now,
                "fragment": p,
                "version": gv.version,
                "consumed": len(gv.consumed),
                "tokens": gv.tokens,
                "staleness": gv.staleness,
                "weights": gv.weights,
            }
        )
        wire.publish(gv, syncers[p].opt_leaves)
        available = now + transfer_seconds(global_bytes[p], sim)
        for i in range(m):
            inbox[i][p] = (available, gv.version)
            push(available, "deliver", i)

    for i in range(m):
        push(step_time(i), "step", i, 0)
    for start, end, i in _failure_windows(cfg, cfg.steps_per_learner * sim.step_seconds):
        push(start, "fail", i)
        push(end, "rejoin", i)

    now = 0.0
    run.maybe_evaluate(now, global_params)
    while queue:
        now, _, kind, args = heapq.heappop(queue)
        if kind == "step":
            i, gen = args
            if gen != generation[i] or not alive[i] or run.tokens >= run.budget:
                continue
            lrn = learners[i]
            loss = lrn.train_step(step_time(i))
            run.tokens += lrn.tokens_per_step
            deliver(i, now)
            p = lrn.due()
            if p is not None:
                c = lrn.contribute(p)
                wire.send(c)
                last_seq[i] = c.seq
                run.bytes_up += c.nbytes
                push(now + transfer_seconds(c.nbytes, sim), "arrive", c)
                run.metrics.append(
                    {"event": "train", "learner": lrn.id, "step": lrn.step, "loss": float(loss)}
                )
            if lrn.step % sim.checkpoint_every == 0:
                checkpoints[i] = lrn.checkpoint()
            run.maybe_evaluate(now, global_params)
            schedule_step(i, now)
        elif kind == "arrive":
            c = wire.receive(args[0])
            p = c.fragment
            syncers[p].offer(c)
            if first_arrival[p] is None:
                first_arrival[p] = now
            if not merge_due[p] and quorum_met(syncers[p].present, quorum):
                pending = syncers[p].pending.values()
                est_step = estimate_step_seconds(pending, sim.step_seconds)
                sync_seconds = transfer_seconds(global_bytes[p], sim)
                grace = grace_window(
                    est_step, topo.tau, now - first_arrival[p], sync_seconds, gamma
                )
                merge_due[p] = True
                push(now + grace, "merge", p)
        elif kind == "merge":
            merge(args[0], now)
        elif kind == "deliver":
            (i,) = args
            if alive[i]:
                deliver(i, now)
                if blocked[i] and run.tokens < run.budget:
                    schedule_step(i, now)
        elif kind == "fail":
            (i,) = args
            alive[i], blocked[i] = False, False
            generation[i] += 1
            lost = learners[i].step - checkpoints[i].step
            run.metrics.append(
                {"event": "failure", "learner": ids[i], "time": now, "lost_steps": lost}
            )
        elif kind == "rejoin":
            (i,) = args
            alive[i] = True
            learners[i].restore(checkpoints[i], next_seq=last_seq[i] + 1)
            deliver(i, now, force=True)  # pull the newest globals before training on
            run.metrics.append({"event": "rejoin", "learner": ids[i], "time": now})
            if run.tokens < run.budget:
                schedule_step(i, now)

    # Contributions still pending at the end are not merged: a last partial merge would take
    # a full momentum step on whatever happened to be left. Goodput counts them as lost.
    loss = run.evaluate(now, global_params(), final=True)
    wire.close({"tokens": run.tokens, "sim_seconds": now, "final_loss": loss})
    return now


def time_to_loss(evals: list[dict[str, Any]], target: float) -> float:
    """Simulated time at which the eval curve first reaches ``target`` (linear interpolation)."""
    for prev, cur in itertools.pairwise(evals):
        if cur["loss"] <= target:
            if prev["loss"] == cur["loss"]:
                return cur["time"]
            frac = (prev["loss"] - target) / (prev["loss"] - cur["loss"])
            return prev["time"] + max(0.0, min(1.0, frac)) * (cur["time"] - prev["time"])
    return math.inf
