"""The learner flow: one island of compute running the core ``LearnerLoop`` on the wall
clock over its own region's bucket.

A learner process keeps one ``LearnerRuntime`` (``flows.learner_runtime``) for its whole
life and runs bounded flow runs over it (``pipeline.rounds_per_flow_run`` rounds each), so
memory does not grow with the run's length and a flow-run boundary costs nothing. A
deployment's flow run is a process of its own: it waits for its checkpoint and uploads
before it returns, and the next one resumes from that checkpoint. Each round is a Prefect task run
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

import sys
from typing import Any

import jax
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from flows.compile import share_compilations, user_cache
from flows.hosts import join as join_group
from flows.learner_runtime import Fenced, LearnerRuntime
from flows.observe import (
    BestEffort,
    LiveTable,
    artifact_key,
    outlive_the_reader,
    stopped,
    tag_flow_run,
    worker_tags,
)
from flows.process import WorkerProcess, this_process
from protocol.topology import learner_id
from storage_layout.auth import LEARNER_KEY_ENV, RUN_SECRET_ENV

TABLE_SECONDS = 1.0  # a round's wait, at most, for its row in the flow run's table


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


def _train_rounds(rt: LearnerRuntime, process: WorkerProcess, rows: list[dict[str, Any]]) -> None:
    """This flow run's rounds (``pipeline.rounds_per_flow_run`` at most, fewer when the
    learner is done or preempted), each a row of ``rows`` and of the flow run's table as
    it happens (a crashed run shows the ones it trained). The table is for people: the
    learner waits at most ``TABLE_SECONDS`` a round for it, so an API that is away (its
    client retries for a minute) does not hold training up."""
    table = LiveTable(artifact_key(rt.run, rt.id, "rounds"),
                      f"learner {rt.label} of run {rt.run}: one row per round") if rt.leader else None  # fmt: skip
    report = BestEffort()
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
            report(table.show, list(rows), wait=TABLE_SECONDS, label=f"table {table.key}")
    report.drain()  # the last rows, before the flow run ends (a stop does not wait on them)


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
    try:
        _train_rounds(rt, process, rows)
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
