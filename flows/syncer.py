"""The syncer flow: one shard of fragments, merged and published to every region.

Shard ``s`` of ``S`` owns the fragments ``p`` with ``p % S == s``. Each flow run starts
from the newest committed version of its fragments (parameters, outer momentum, the
per-learner cursor and the merge counters are all stored in it), so a restarted or
re-scheduled syncer neither loses nor double-counts a contribution. A second syncer of
the same shard is fenced off by the commit protocol: whoever commits version ``v`` at
home first wins; the other gets ``CommitConflict``, reloads from the winner's version and
goes on from there.

The loop: list every learner's new contribution markers (in the learner's region), read
and verify them, offer them to the core ``FragmentSyncer``; when the quorum K is met,
wait the adaptive grace window, then merge, step the outer optimizer and publish (a
Prefect task run, ``syncer us-east/0 f1 v12``). It ends when every learner has committed
its final checkpoint and nothing mergeable is left, or after
``pipeline.versions_per_flow_run`` publishes (the next flow run resumes).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from diloco.model import is_embedding
from diloco.syncer import FragmentSyncer, estimate_step_seconds, grace_window, quorum_met
from flows.observe import artifact_key, run_logger, tag_flow_run
from flows.run import build_model, config_from_spec
from flows.sim_transport import version_meta
from storage_layout.commit import CommitConflict, CorruptVersion
from storage_layout.store import RunStore


@dataclass
class FragmentClock:
    """Wall-clock bookkeeping of one fragment's merge decision."""

    first_arrival: float | None = None
    merge_at: float | None = None


class SyncerRuntime:
    def __init__(
        self,
        run: str,
        regions: Mapping[str, str],
        home: str,
        shard: int,
        shards: int,
        pipeline: dict | None = None,
    ):
        self.log = run_logger("diloco.syncer")
        self.store = RunStore(run, regions, home, writer=f"syncer-{shard}")
        self.spec = self.store.read_spec()
        self.cfg = config_from_spec(self.spec, pipeline)
        self.model = build_model(self.cfg)
        self.run, self.home, self.shard = run, home, shard
        self.label = f"{home}/{shard}"
        self.learners: dict[str, str] = dict(self.spec["learners"])
        self.total_steps = int(self.spec["train"]["steps_per_learner"])
        self.fragments = [p for p in range(len(self.model.plan)) if p % shards == shard]
        if not self.fragments:
            raise ValueError(f"syncer shard {shard} of {shards} owns no fragment")
        self.syncers: dict[int, FragmentSyncer] = {}
        self.seen: dict[tuple[str, int], int] = {}  # (learner, fragment) -> newest seq read
        self.clocks: dict[int, FragmentClock] = {}
        self.lagging: set[int] = set()
        self.sync_seconds = 0.05  # measured publish time (EMA)
        self.rejected: list[dict[str, Any]] = []
        self.done: set[str] = set()  # learners that committed their final checkpoint
        for p in self.fragments:
            self.load(p)

    def load(self, p: int) -> None:
        """(Re)build fragment ``p``'s syncer from its newest committed version."""
        store, outer = self.store, self.cfg.outer
        version = store.latest_global(p)
        if version is None:
            raise FileNotFoundError(f"run {self.run!r} has no version of fragment {p}")
        state = store.get_global(p, version)
        meta = state.meta
        syncer = FragmentSyncer(
            p,
            state.params,
            outer,
            self.learners,
            is_embedding,
            version=version,
            opt_leaves=state.opt_leaves,
            cursor=meta.get("cursor"),
            merged=meta.get("merged"),
        )
        if self.cfg.outer.reference == "anchored":  # the bases stale contributions refer to
            for v in store.global_versions(p):
                if version - outer.max_staleness <= v < version:
                    syncer.history[v] = store.get_global(p, v).params
        self.syncers[p] = syncer
        for learner in self.learners:
            self.seen[(learner, p)] = syncer.cursor.get(learner, 0)
        self.clocks[p] = FragmentClock()

    # collecting -----------------------------------------------------------------------
    def poll(self) -> int:
        """Read every new contribution of this shard's fragments; returns how many."""
        found = 0
        for learner, region in self.learners.items():
            for p in self.fragments:
                try:
                    seqs = self.store.contribution_seqs(learner, p, region)
                except OSError as exc:
                    self.log.warning("region %s unreachable, skipping %s: %s", region, learner, exc)
                    break
                for seq in (s for s in seqs if s > self.seen[(learner, p)]):
                    try:
                        c = self.store.get_contribution(learner, p, seq, region)
                    except CorruptVersion as exc:
                        self.log.error("skipping a corrupt contribution: %s", exc)
                        self.rejected.append(
                            {"learner": learner, "fragment": p, "seq": seq, "reason": str(exc)}
                        )
                        self.seen[(learner, p)] = seq
                        continue
                    except OSError as exc:
                        self.log.warning("cannot read %s seq %d yet: %s", learner, seq, exc)
                        break
                    self.syncers[p].offer(c)
                    self.seen[(learner, p)] = seq
                    found += 1
        now = time.monotonic()
        for p in self.fragments:
            if self.syncers[p].pending and self.clocks[p].first_arrival is None:
                self.clocks[p].first_arrival = now
        return found

    def due(self, finishing: bool = False) -> list[int]:
        """Fragments to merge now: quorum met and the grace window over (no grace once all
        learners are done: nothing more will come)."""
        now, out = time.monotonic(), []
        gamma = 0.0 if self.cfg.mode == "diloco" else self.cfg.topology.grace
        for p in self.fragments:
            syncer, clock = self.syncers[p], self.clocks[p]
            if not quorum_met(syncer.present, self.cfg.quorum):
                continue
            if clock.merge_at is None:
                pending = syncer.pending.values()
                step = estimate_step_seconds(pending, 0.1)
                waited = now - (clock.first_arrival or now)
                grace = grace_window(step, self.cfg.topology.tau, waited, self.sync_seconds, gamma)
                clock.merge_at = now + grace
            if finishing or now >= clock.merge_at:
                out.append(p)
        return out

    # merging --------------------------------------------------------------------------
    def merge_and_publish(self, p: int) -> dict[str, Any] | None:
        syncer = self.syncers[p]
        self.clocks[p] = FragmentClock()
        outcome = syncer.merge()
        for r in outcome.rejected:
            c = r.contribution
            self.log.warning("%s", r)
            self.rejected.append(
                {"learner": c.learner, "fragment": p, "seq": c.seq, "reason": r.reason}
            )
        gv = outcome.version
        if gv is None:
            return None
        meta = {**version_meta(gv), "published_at": time.time()}
        start = time.perf_counter()
        try:
            report = self.store.publish_global(
                p, gv.version, gv.params, syncer.opt_leaves, meta, self.cfg.topology.global_dtype
            )
        except CommitConflict as exc:
            self.log.warning("fenced off: %s; reloading fragment %d from the winner", exc, p)
            self.load(p)
            return None
        except Exception:
            self.load(p)  # nothing committed: forget the merge, re-read the contributions
            raise
        seconds = time.perf_counter() - start
        self.sync_seconds = 0.8 * self.sync_seconds + 0.2 * seconds
        if report.lagging:
            self.lagging.add(p)
            self.log.warning("fragment %d v%d not in %s yet", p, gv.version, report.lagging)
        return {
            "fragment": p,
            "version": gv.version,
            "merged": len(gv.consumed),
            "learners": ", ".join(sorted({k[0] for k in gv.consumed})),
            "max_staleness": max(gv.staleness.values(), default=0),
            "weights": ", ".join(f"{k} {w:.2f}" for k, w in sorted(gv.weights.items())),
            "tokens": gv.tokens,
            "publish_s": round(seconds, 3),
        }

    def catch_up_regions(self) -> None:
        for p in list(self.lagging):
            self.store.sync_regions(p)
            behind = [
                r
                for r in self.store.urls
                if (self.store.latest_global(p, r) or -1) < self.syncers[p].version
            ]
            if not behind:
                self.lagging.discard(p)

    # ending ---------------------------------------------------------------------------
    def learners_done(self) -> bool:
        """Every learner has committed its final checkpoint (so all its contributions).
        Checked every poll: a learner found done is not listed again."""
        for learner, region in self.learners.items():
            if learner in self.done:
                continue
            try:
                steps = self.store.checkpoint_steps(learner, region)
            except OSError:
                return False
            if not steps or steps[-1] < self.total_steps:
                return False
            self.done.add(learner)
        return True


@task(name="syncer-publish", task_run_name="{label}", cache_policy=NO_CACHE, persist_result=False)
def publish(rt: SyncerRuntime, p: int, label: str) -> dict[str, Any] | None:
    return rt.merge_and_publish(p)


@flow(name="syncer", flow_run_name="syncer {home}/{shard}", persist_result=False)
def syncer_flow(
    run: str,
    regions: dict[str, str],
    home: str,
    shard: int = 0,
    shards: int = 1,
    pipeline: dict | None = None,
) -> dict[str, Any]:
    """Merge and publish shard ``shard`` of ``shards`` from region ``home``; returns
    ``{"done": bool, "versions": {fragment: newest}, ...}``."""
    log = get_run_logger()
    tag_flow_run([f"run:{run}", f"region:{home}", "syncer"])
    rt = SyncerRuntime(run, regions, home, shard, shards, pipeline)
    opts = rt.cfg.pipeline
    log.info(
        "syncer %s owns fragments %s, resumes at versions %s",
        rt.label,
        rt.fragments,
        {p: s.version for p, s in rt.syncers.items()},
    )
    rows: list[dict[str, Any]] = []
    done = False
    while len(rows) < opts.versions_per_flow_run:
        finishing = rt.learners_done()  # checked before listing: nothing can come after
        rt.poll()
        for p in rt.due(finishing):
            label = f"syncer {rt.label} f{p} v{rt.syncers[p].version + 1}"
            try:
                row = publish(rt, p, label)
            except OSError as exc:
                log.warning("publishing fragment %d failed, will retry: %s", p, exc)
                continue
            if row:
                rows.append(row)
        if rt.lagging:
            rt.catch_up_regions()
        if finishing and not rt.due(finishing=True):
            done = True
            break
        time.sleep(opts.poll_seconds)
    left = {p: len(s.pending) for p, s in rt.syncers.items() if s.pending}
    if done and left:
        log.info("run over; contributions below the quorum left unmerged: %s", left)
    rt.store.write_metrics(
        f"syncer-{shard}",
        {
            "state": "done" if done else "paused",
            "versions": {p: s.version for p, s in rt.syncers.items()},
            "rejected": rt.rejected,
        },
    )
    if rows:
        create_table_artifact(
            rows,
            key=artifact_key(run, f"syncer-{shard}", "versions"),
            description=f"syncer {rt.label} of run {run}: one row per version",
        )
    return {
        "done": done,
        "versions": {p: s.version for p, s in rt.syncers.items()},
        "published": len(rows),
        "rejected": len(rt.rejected),
    }
