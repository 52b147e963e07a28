"""The syncer flow: one shard of fragments, run by the core ``SyncerLoop`` on the wall
clock, merged and published to every region.

Shard ``s`` of ``S`` owns the fragments ``p`` with ``p % S == s`` (``protocol.topology``).
A syncer process keeps one ``SyncerRuntime`` and runs bounded flow runs over it (at most
``pipeline.versions_per_flow_run`` publishes each); each publish is a Prefect task run
(``syncer us-east/0 f1 v12``). A new process starts from the newest committed version of
its fragments (parameters, outer momentum, the per-learner cursor and the merge counters
are all in it), so a restarted syncer neither loses nor double-counts a contribution. A
second syncer of the same shard is fenced off by the commit protocol: whoever commits
version ``v`` at home first wins; the other reloads from the winner's version.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from diloco import records
from diloco.loops import Clock, SyncerTransport, WallClock, drive
from diloco.syncer_loop import SyncerLoop
from flows.ledger import region_pools
from flows.observe import (
    artifact_key,
    outlive_the_reader,
    run_logger,
    stopped,
    tag_flow_run,
    worker_tags,
)
from flows.process import this_process
from flows.run import Run
from flows.syncer_transport import PipelineSyncerTransport
from flows.unit_offers import SilentReleases, UnitOffers
from protocol.topology import run_slots, shard_fragments, syncer_id
from storage_layout.auth import RUN_SECRET_ENV, UNAUTHENTICATED
from storage_layout.store import RunStore


class SyncerRuntime:
    """One syncer process: the core loop over the pipeline transport (``clock`` and
    ``transport`` default to the wall clock and ``PipelineSyncerTransport``; the
    equivalence test passes the simulator's instead)."""

    def __init__(self, run: str, regions: Mapping[str, str], home: str, shard: int,
                 shards: int, pipeline: dict | None = None, clock: Clock | None = None,
                 transport: SyncerTransport | None = None):  # fmt: skip
        self.log = run_logger("diloco.syncer")
        opened = Run.open(run, regions, home, pipeline, faults=this_process().faults)
        spec, self.cfg = opened.spec, opened.cfg
        self.run, self.home, self.shard = run, home, shard
        self.label = f"{home}/{shard}"
        self.fragments = shard_fragments(shard, shards, len(spec["fragments"]))
        store = opened.bucket_store(syncer_id(shard))
        self.transport = PipelineSyncerTransport(
            store, self.fragments, self.cfg.pipeline.keep_versions or self.cfg.kept_versions,
            self.cfg.outer.max_staleness, self.log, self.cfg.budget.tokens,
            self.cfg.pipeline.retention_seconds, liveness=self.cfg.liveness,
            inner_steps=self.cfg.topology.inner_steps,
        )  # fmt: skip
        self.transport.on_published = self.report
        self.transport.spec = spec  # to admit the learners joiners add
        if self.cfg.data.assign == "units":
            units = opened.data.units
            pools = region_pools(spec)
            self.transport.releases = SilentReleases(store, units, self.cfg.data.batch_size,
                                                     self.log, pools)  # fmt: skip
            if shard == 0:  # one tends the pools: each would keep its own spans waiting
                self.transport.offers = UnitOffers(store.region_store, store.learners, units,
                                                   self.log, pools)  # fmt: skip
        self.records: list[records.Record] = []
        self.loop = SyncerLoop(self.cfg, self.fragments, list(run_slots(spec)),
                               transport or self.transport, clock or WallClock(),
                               self.records.append, self.log)  # fmt: skip

    @property
    def store(self) -> RunStore:
        return self.transport.store.main

    @property
    def syncers(self) -> dict:
        return self.loop.syncers

    @property
    def lagging(self) -> set[int]:
        return self.transport.lagging

    @property
    def rejected(self) -> list[records.Record]:
        return records.of(self.records, "rejected")

    def poll(self) -> int:
        return self.loop.collect()

    def due(self, finishing: bool = False) -> list[int]:
        return self.loop.due(finishing)

    def merge_and_publish(self, p: int) -> dict[str, Any] | None:
        record = self.loop.merge(p)
        return None if record is None else version_row(record)

    def catch_up_regions(self) -> None:
        self.transport.catch_up()

    def status(self, state: str) -> dict[str, Any]:
        return {"state": state, "versions": self.loop.versions, "rejected": self.rejected}

    def report(self) -> None:
        """Write the shard's status object, with its traffic so far, after each publish:
        the launcher's live cross-region bytes (TensorBoard, the tables) come from it, and
        would otherwise wait for the end of a flow run (``versions_per_flow_run``
        publishes). News, not state: a failed write is logged and the shard goes on."""
        try:
            self.store.progress.write_metrics(syncer_id(self.shard), self.status("running"))
        except (OSError, ValueError) as exc:
            self.log.warning("cannot write the status of syncer %s: %s", self.label, exc)


def version_row(r: records.Record) -> dict[str, Any]:
    """A version record as a row of the syncer's table artifact."""
    return {
        "fragment": r["fragment"], "version": r["version"], "merged": len(r["consumed"]),
        "learners": ", ".join(sorted({k[0] for k in r["consumed"]})),
        "max_staleness": max(r["staleness"].values(), default=0),
        "weights": ", ".join(f"{k} {w:.2f}" for k, w in sorted(r["weights"].items())),
        "tokens": r["tokens"],
    }  # fmt: skip


@task(name="syncer-publish", task_run_name="{label}", cache_policy=NO_CACHE, persist_result=False)
def publish(call: Callable[[], bool], label: str) -> bool:
    return call()


@flow(name="syncer", flow_run_name="syncer {home}/{shard}", persist_result=False)
def syncer_flow(
    run: str,
    regions: dict[str, str],
    home: str,
    shard: int = 0,
    shards: int = 1,
    pipeline: dict | None = None,
) -> dict[str, Any] | State:
    """Merge and publish shard ``shard`` of ``shards`` from region ``home``; returns
    ``{"done": bool, "versions": {fragment: newest}, ...}``, or, stopped by a signal,
    ends its flow run Cancelled (``observe.stopped``; what it published is committed,
    a publish under way is not, and the next syncer makes it again)."""
    log = get_run_logger()
    outlive_the_reader()  # a deployment's: its worker may die first
    tag_flow_run(worker_tags(run, home, "syncer"))
    process = this_process()
    key = ("syncer", run, home, shard)
    if key not in process.runtimes:
        rt = SyncerRuntime(run, regions, home, shard, shards, pipeline)
        keys = rt.transport.store.keys
        if keys.verifies:  # a swapped secret is refused before anything is read with it
            rt.transport.store.main.check_secret(keys.secret, RUN_SECRET_ENV)
        process.runtimes[key] = rt
        log.info("syncer %s owns fragments %s, resumes at versions %s",
                 rt.label, rt.fragments, rt.loop.versions)  # fmt: skip
        if keys.verifies:
            log.info("contributions are authenticated: each must carry its learner's signature")
        else:
            log.warning(UNAUTHENTICATED)  # once per process: the runtime lives as long
    rt = process.runtimes[key]
    rt.loop.log = rt.transport.log = rt.log = log
    rt.transport.wrap = lambda gv, call: publish(
        call, f"syncer {rt.label} f{gv.fragment} v{gv.version}"
    )
    rt.records[:] = rt.rejected  # (the metrics object lists every rejection)
    first, opts = len(rt.records), rt.cfg.pipeline

    def enough() -> bool:  # a bounded flow run; the next one goes on from here
        if process.stop.is_set():  # its interrupt was lost on its way (flows.worker)
            raise KeyboardInterrupt
        return len(records.of(rt.records[first:], "version")) >= opts.versions_per_flow_run

    try:
        done = drive(rt.loop.run(), opts.poll_seconds, stop=enough)
    except KeyboardInterrupt:
        return stopped(f"stopped by a signal at versions {rt.loop.versions}")
    new = rt.records[first:]
    rt.store.progress.write_metrics(syncer_id(shard), rt.status("done" if done else "paused"))
    rows = [version_row(r) for r in records.of(new, "version")]
    if rows:
        create_table_artifact(
            rows,
            key=artifact_key(run, f"syncer-{shard}", "versions"),
            description=f"syncer {rt.label} of run {run}: one row per version",
        )
    if done:
        rt.transport.collect_garbage()  # the run is over: leave the buckets lean
        process.runtimes.pop(key, None)
    return {"done": done, "versions": rt.loop.versions, "published": len(rows),
            "rejected": len(records.of(new, "rejected"))}  # fmt: skip
