"""What the launcher knows of a run, read from the buckets alone: the workers' statuses,
the newest global versions and their evaluation, stalled syncers, traffic, goodput and the
summary (``Monitor``), and the summary's loss plot. No Prefect and no processes here: the
launcher (``flows/launcher.py``) drives it and reports what it finds."""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from diloco.liveness import Liveness, Verdict
from flows.observe import QUIET_SECONDS
from flows.pace import MEMBERS_EVERY
from flows.run import Run
from protocol.topology import learner_index, run_slots, shard_count, shard_fragments, syncer_id
from storage_layout.commit import CorruptVersion
from storage_layout.store import RunStore
from storage_layout.traffic import sum_traffic

# A learner's start-up phases, in order, as its status object names them (``starting``:
# no word from it yet: its process starts, imports, opens its flow run).
STARTUP = ("starting", "compiling", "resuming")

log = logging.getLogger(__name__)

STORAGE_PATIENCE = 600.0  # seconds the summary waits for the home bucket to answer


class StorageUnreachable(RuntimeError):
    """The run's home bucket did not answer in time for the summary."""


class RunStalled(RuntimeError):
    """The run cannot make progress by itself: no version for long, and every learner
    not done is silent (dead, or hung: its process alive, its heartbeat stopped) with
    nobody to take its slot. The same command resumes it once that is mended."""


STALL_ROUNDS = 3  # a run stands still when no version came for this many learner rounds


class Monitor:
    """Reads the run's state from the buckets and evaluates the newest global model.
    ``deaths``: writer id -> (when, state) of its newest process's death by a signal, or
    of its being given up, kept by whoever supervises the processes (a learner is shown
    so until a process of it reports again).

    While the run goes, a read that fails (any error of a storage client, not only an
    ``OSError``: botocore's ``EndpointConnectionError`` is none) is logged by name, at
    most once every ``QUIET_SECONDS`` per kind, and the last state read stands in: the
    workers ride an outage out, so the launcher that supervises them must too."""

    def __init__(
        self,
        run: Run,
        store: RunStore,
        log: Any = log,
        deaths: Mapping[str, tuple[float, str]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        verifying_key: Callable[[str], bytes | None] = lambda learner: None,
    ):
        cfg, spec = run.cfg, run.spec
        self.store, self.cfg, self.spec, self.log = store, cfg, spec, log
        self.verifying_key = verifying_key  # a learner's key: its heartbeats must verify
        self.clock = clock  # paces the reads of the members
        self.deaths = {} if deaths is None else deaths
        self._learners: dict[str, str] = run_slots(spec)
        self.launched = set(cfg.started_learners(list(self._learners)))  # others: joiners'
        self._learners_read = -math.inf
        self.unreadable: set[tuple[int, int]] = set()  # reported once each
        self.errors = 0  # storage errors while watching, in all
        self.down_since: float | None = None  # monotonic time of the first error of an outage
        self._reported: dict[str, float] = {}  # kind -> when it was last logged
        self._unreported: Counter[str] = Counter()  # kind -> errors since then
        self._last_statuses: dict[str, dict[str, Any]] = {}
        self._last_versions: dict[int, int] = {}
        # Syncer shard -> (its fragments' versions, when they last changed, each learner's
        # step then); and the shards reported stalled.
        self.publishing: dict[str, tuple[tuple[int, ...], float, dict[str, int]]] = {}
        self.stalled: set[str] = set()
        self.beats: dict[str, Any] = {}  # learner -> its newest heartbeat read (verdicts)
        # Who is alive and who takes part (diloco.liveness), on this launcher's clock; the
        # learners' round (topology.inner_steps at their median measured step time); and
        # since when no version has been published (the run stands still).
        self.liveness = Liveness(cfg.liveness, cfg.topology.inner_steps)
        self.round_seconds = 0.0
        self._versions_moved: tuple[dict[int, int], float] | None = None
        self.model = run.model
        self.val = run.data.validation
        self.total_steps = cfg.steps_per_learner
        self.curve: list[dict[str, Any]] = []
        self.furthest: dict[str, int] = {}  # learner -> the furthest step it reached
        self.initial_loss: float | None = None  # the run's, not this launch's (remember_start)
        self.started = time.time()
        # Learners' time counters and the work merged before this launch (a resumed run
        # has some already).
        self.before = {k: learner_seconds(v) for k, v in self.statuses().items()}
        self.merged_before = self.merged_seconds()

    def merged_seconds(self) -> dict[int, float]:
        """Per fragment, the learner seconds merged so far (the newest version's total)."""
        out = {}
        for p in range(len(self.model.plan)):
            newest = self.readable(p, lambda v, p=p: self.store.versions.global_marker(p, v))
            out[p] = float(newest[1].meta.get("seconds_total", 0.0)) if newest else 0.0
        return out

    def storage_error(self, what: str, exc: BaseException) -> None:
        """Log a failed read by the error's name (once per ``QUIET_SECONDS`` per kind, with
        how many went unlogged since), and go on."""
        kind = type(exc).__name__
        now = time.monotonic()
        self.errors += 1
        if self.down_since is None:
            self.down_since = now
        if now - self._reported.get(kind, -math.inf) < QUIET_SECONDS:
            self._unreported[kind] += 1
            return
        more = self._unreported.pop(kind, 0)
        self._reported[kind] = now
        self.log.warning("%s failed (%s: %s); the watch goes on (the workers ride it "
                         "out)%s", what, kind, str(exc)[:300],
                         f" ({more} more {kind} since the last report)" if more else "")  # fmt: skip

    def storage_ok(self) -> None:
        """A look that read everything: an outage, if there was one, is over."""
        if self.down_since is not None:
            self.log.warning("the run's storage answers again, after %.0f s of errors",
                             time.monotonic() - self.down_since)  # fmt: skip
            self.down_since = None
            self._reported.clear()
            self._unreported.clear()

    def wait_for_storage(self, patience: float = STORAGE_PATIENCE, pause: float = 2.0) -> None:
        """Before the summary, which is read from the buckets: wait until the home bucket
        answers, for up to ``patience`` seconds, then fail naming it (never a summary of
        half-read numbers, never a hang)."""
        deadline = time.monotonic() + patience
        while True:
            try:
                self.store.versions.latest_global(0)
                self.storage_ok()
                return
            except Exception as exc:
                self.storage_error("reading the home bucket for the summary", exc)
                if time.monotonic() >= deadline:
                    raise StorageUnreachable(
                        f"run {self.store.run}: the home bucket {self.store.urls[self.store.client_region]} "
                        f"did not answer for {patience:.0f} s ({type(exc).__name__}: {exc}); the "
                        "workers have ended, so no summary: the same command resumes the run"
                    ) from exc
            time.sleep(pause)

    def readable(self, p: int, read: Callable[[int], Any]) -> tuple[int, Any] | None:
        """``read`` of fragment ``p``'s newest version that reads: a corrupt or vanished
        one is reported once and the one before it is tried (never a crash: the launcher
        must outlive a bad object to stop its workers)."""
        for v in reversed(self.store.versions.global_versions(p)):
            try:
                return v, read(v)
            except (CorruptVersion, OSError) as exc:
                if (p, v) not in self.unreadable:
                    self.unreadable.add((p, v))
                    self.log.error("fragment %d version %d is unreadable, evaluating an "
                                   "older one: %s", p, v, exc)  # fmt: skip
        return None

    def learners(self, fresh: bool = False) -> dict[str, str]:
        """The run's learners: the spec's, and those joiners added (``diloco join``), read
        at most every ``MEMBERS_EVERY`` seconds (``fresh``: now); the last ones read on a
        storage error."""
        now = self.clock()
        if not fresh and now - self._learners_read < MEMBERS_EVERY:
            return self._learners
        self._learners_read = now
        try:
            self._learners = self.store.members.run_learners(self.spec).regions
        except Exception as exc:
            self.storage_error("reading the learners added to the run", exc)
        return self._learners

    def statuses(self) -> dict[str, dict[str, Any]]:
        """Every learner's status object; on a storage error, the last one read (or
        ``unreachable``) for it and for the learners after it in this look. A learner
        whose process died by a signal since it last wrote is in state ``killed`` (or
        ``killed by the OOM killer``) until its next process reports, not in the phase
        the dead one had reached."""
        out, failed = {}, False
        for learner, region in self.learners().items():
            if not failed:
                try:
                    out[learner] = self.store.progress.read_metrics(learner, region) or {}
                except Exception as exc:
                    self.storage_error(f"reading {learner}'s status", exc)
                    failed = True
            if failed:
                out[learner] = self._last_statuses.get(learner, {"state": "unreachable"})
            died = self.deaths.get(learner)
            if died is not None and float(out[learner].get("time", 0.0)) < died[0]:
                out[learner] = {**out[learner], "state": died[1]}
            if not out[learner] and learner not in self.launched:
                out[learner] = {"state": "vacant"}  # left to joiners, none has joined yet
        if not failed:
            self._last_statuses = out
        return out

    def phases(self, statuses: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """``statuses`` with the phase of each learner whose heartbeat (``verdicts``'
        newest read) is newer and says it trains while its status says it starts: a status
        is written once a round, so a learner in a long first round still says "resuming"
        there (and the launcher took the run for starting up the whole time)."""
        out = dict(statuses)
        for learner, status in statuses.items():
            beat = self.beats.get(learner)
            if (beat is not None and beat.state == "training" and status.get("state") in STARTUP
                    and beat.time > float(status.get("time", 0.0))):  # fmt: skip
                out[learner] = {**status, "state": "training"}
        return out

    def syncers(self) -> dict[str, list[int]]:
        """Each syncer shard (as the launcher names it, ``syncer us-east/0``) and the
        fragments it owns."""
        shards = shard_count(self.cfg.pipeline.syncer_shards, self.cfg.topology.fragments)
        home = self.store.client_region
        return {f"syncer {home}/{s}": shard_fragments(s, shards, self.cfg.topology.fragments)
                for s in range(shards)}  # fmt: skip

    def stalled_syncers(
        self, statuses: dict[str, dict[str, Any]], versions: dict[int, int],
        verdicts: dict[str, Verdict],
    ) -> list[str]:  # fmt: skip
        """The syncer shards newly seen stalled: none of their fragments has had a new
        version for ``pipeline.stall_seconds`` (as this launcher saw them) while a quorum
        of the members (``verdicts``: counted, not done) trained on, their steps up (fewer,
        as while the others still compile, is a syncer waiting for its quorum): a syncer
        paused, hung or cut off from home. Each is warned about by name, once per stall,
        and once more when it publishes again."""
        now = time.monotonic()
        steps = {k: int(s.get("step", 0)) for k, s in statuses.items()}
        going = [k for k, v in verdicts.items() if v.counted and v.state != "done"]
        out = []
        for name, fragments in self.syncers().items():
            held = tuple(versions.get(p, 0) for p in fragments)
            seen = self.publishing.get(name)
            if seen is None or seen[0] != held:
                self.publishing[name] = (held, now, steps)
                if name in self.stalled:
                    self.stalled.discard(name)
                    self.log.warning("%s publishes again (versions %s)", name,
                                     " ".join(f"f{p}:v{v}" for p, v in zip(fragments, held, strict=True)))  # fmt: skip
                continue
            _, since, steps_then = seen
            trained = [k for k in going if steps.get(k, 0) > steps_then.get(k, 0)]
            stall = self.stall_after()
            if (name in self.stalled or now - since < stall or not going
                    or len(trained) < self.cfg.quorum_over(len(going))):  # fmt: skip
                continue
            self.stalled.add(name)
            self.log.warning(
                "%s has published no version of fragments %s for %.0f s (stall_seconds %.0f; "
                "newest %s) while the learners trained %d steps: it may be paused, hung or "
                "cut off from its home region",
                name, fragments, now - since, stall,
                " ".join(f"f{p}:v{v}" for p, v in zip(fragments, held, strict=True)),
                sum(steps.get(k, 0) - steps_then.get(k, 0) for k in trained),
            )  # fmt: skip
            out.append(name)
        return out

    def stall_after(self) -> float:
        """Seconds without a new version after which a syncer shard is stalled, or the
        run stands still: ``pipeline.stall_seconds``, or ``STALL_ROUNDS`` of the learners'
        rounds where those are longer (a round of an hour publishes once an hour)."""
        return max(self.cfg.pipeline.stall_seconds, STALL_ROUNDS * self.round_seconds)

    def verdicts(self, statuses: dict[str, dict[str, Any]]) -> dict[str, Verdict]:
        """Each learner now by its heartbeat and status (``diloco.liveness``, on this
        launcher's clock); one whose heartbeat cannot be read is judged by its status.
        Keeps the learners' round time (``round_seconds``) up to date."""
        now, out, rounds = self.clock(), {}, []
        for learner, region in self.learners().items():
            try:
                beat = self.store.members.read_heartbeat(
                    learner, region, self.verifying_key(learner)
                )
            except Exception as exc:
                self.storage_error(f"reading {learner}'s heartbeat", exc)
                beat = None
            self.beats[learner] = beat
            if beat is not None and beat.step_seconds and beat.state == "training":
                rounds.append(self.cfg.topology.inner_steps * beat.step_seconds)
            out[learner] = self.liveness.look(learner, beat, statuses.get(learner), now)
        if rounds:  # (the lower median: versions come at the pace of the faster ones)
            self.round_seconds = sorted(rounds)[(len(rounds) - 1) // 2]
        return out

    def standstill(
        self, versions: dict[int, int], verdicts: dict[str, Verdict]
    ) -> tuple[float, str] | None:
        """How long no version has been published and why, in one line, once that is
        longer than ``stall_after``; None while the run moves. Who is fenced (silent,
        its data given back), silent, lagging or starting, by name."""
        now = self.clock()
        if self._versions_moved is None or self._versions_moved[0] != versions:
            self._versions_moved = (dict(versions), now)
            return None
        quiet = now - self._versions_moved[1]
        if quiet < self.stall_after():
            return None
        why = []
        for learner, verdict in sorted(verdicts.items(), key=lambda kv: learner_index(kv[0])):
            state = verdict.state
            if state == "silent" and self.fenced(learner):  # (its data given back)
                state = "fenced"
            why.append(f"{learner} {state}" + (f" ({verdict.why})" if verdict.why else ""))
        shown = " ".join(f"f{p}:v{v}" for p, v in versions.items())
        if self.round_seconds:
            shown += f"; the learners' round is {self.round_seconds:.3g} s"
        return quiet, f"no new version for {quiet:.0f} s ({shown}): " + "; ".join(why)

    def hopeless(self, quiet: float, verdicts: dict[str, Verdict]) -> bool:
        """Whether the run cannot make progress by itself: it has stood still ``quiet``
        seconds, longer than a stall and a silence together, and every learner not done
        is silent by a heartbeat that stopped (a dead or hung process holds its slot, and
        no one beats for it; not a learner that has not started yet)."""
        live = [v for v in verdicts.values() if v.state != "done"]
        limit = self.stall_after() + self.cfg.liveness.silent_max_seconds
        stopped = all(v.state == "silent" and v.beating for v in live)
        return quiet > limit and bool(live) and stopped

    def fenced(self, learner: str) -> bool:
        """Whether ``learner``'s newest generation is a syncer's fence."""
        try:
            region = self.learners()[learner]
            own = RunStore(self.store.run, {region: self.store.urls[region]}, region,
                           writer="launcher")  # fmt: skip
            record = own.members.generation(learner, own.members.newest_generation(learner))
        except Exception:  # (news only)
            return False
        return isinstance(record, dict) and "fence" in record

    def tokens(self, statuses: dict[str, dict[str, Any]]) -> int:
        return sum(int(s.get("tokens", 0)) for s in statuses.values())

    def steps(self, statuses: dict[str, dict[str, Any]]) -> int:
        """The learners' inner steps, all together, as their statuses report them."""
        return sum(int(s.get("step", 0)) for s in statuses.values())

    def versions(self) -> dict[int, int]:
        """The newest version of each fragment (on a storage error, the last read)."""
        try:
            found = {
                p: self.store.versions.latest_global(p) or 0 for p in range(len(self.model.plan))
            }
        except Exception as exc:
            self.storage_error("listing the global versions", exc)
            return self._last_versions or dict.fromkeys(range(len(self.model.plan)), 0)
        self._last_versions = found
        return found

    def evaluate(self, statuses: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """The validation loss of the newest readable global model, at its position: the
        tokens merged into it (its fragments' ``tokens_total``, weighted by their share
        of the parameters), which never go backwards, unlike the learners' steps after
        a restart. The same versions as the last point give that point again (the curve
        holds each model once: no stack of points at version 0 while the run starts)."""
        last = self.curve[-1] if self.curve else None
        if last is not None and last["versions"] == self.versions():
            return last
        versions, params, merged, seconds = {}, {}, 0.0, 0.0
        for p in range(len(self.model.plan)):
            found = self.readable(p, lambda v, p=p: self.store.versions.get_global(p, v))
            if found is None:
                raise CorruptVersion(f"no readable version of fragment {p}")
            versions[p] = found[0]
            params.update(found[1].params)
            merged += self.model.shares[p] * int(found[1].meta.get("tokens_total", 0))
            seconds += self.model.shares[p] * float(found[1].meta.get("seconds_total", 0.0))
        trainer = self.model.trainer
        loss = trainer.evaluate(trainer.place_params(params), self.val)
        point = {
            "seconds": round(time.time() - self.started, 1),
            "tokens": round(merged),
            "loss": loss,
            "versions": versions,
            "learner_seconds_merged": round(seconds, 3),  # share-weighted (goodput)
        }
        self.curve.append(point)
        return point

    def goodput_so_far(
        self, point: dict[str, Any], statuses: Mapping[str, Mapping[str, Any]]
    ) -> float | None:
        """This launch's goodput up to ``point``: the learner seconds merged since the
        launch over the learners' time since (each learner this launcher started allocated
        from the launch on, each joiner's as ``joined`` counts it; ``statuses``: the
        learners' status objects now)."""
        elapsed = time.time() - self.started
        before = sum(self.model.shares[p] * s for p, s in self.merged_before.items())
        useful = float(point.get("learner_seconds_merged", before)) - before
        allocated = len(self.launched) * elapsed + sum(self.joined(statuses).values())
        return max(0.0, useful) / allocated if allocated > 0 else None

    def joined(self, statuses: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
        """The learners that took part in this launch without this launcher starting
        them (``diloco join``, in a vacant slot or one added), each with its time since the
        launch: the start-up and training seconds its status reports (its machine's time
        before it took the slot, warming up, is not the run's; its process's own start and
        the gaps between its flow runs are not reported, so they are not counted)."""
        out = {}
        for learner, status in statuses.items():
            if learner in self.launched:
                continue
            now, then = learner_seconds(dict(status)), self.before.get(learner, (0.0, 0.0))
            seconds = (now[0] - then[0]) + (now[1] - then[1])
            if seconds > 0:
                out[learner] = seconds
        return out

    def remember_start(self, point: dict[str, Any]) -> None:
        """The run's loss before any training, kept in the launcher's status object by the
        launch that evaluated version 0, so a resumed run's summary starts where the run
        began rather than where this launch did (None if no launch saw version 0)."""
        status = self.store.progress.read_metrics("launcher") or {}
        if "initial_loss" in status:
            self.initial_loss = status["initial_loss"]
        elif all(v == 0 for v in point["versions"].values()):
            self.initial_loss = float(point["loss"])
            self.store.progress.write_metrics(
                "launcher", {**status, "initial_loss": self.initial_loss}
            )

    def progress(self, statuses: dict[str, dict[str, Any]]) -> float:
        """The share of the run's inner steps done (all learners together). A learner
        restarted from an older checkpoint redoes steps: its progress holds at the furthest
        step it reached until it passes it again, so the bar stalls but never goes back."""
        for learner, s in statuses.items():
            step = min(int(s.get("step", 0)), self.cfg.learner_step_cap)
            self.furthest[learner] = max(self.furthest.get(learner, 0), step)
        return min(100.0, 100.0 * sum(self.furthest.values()) / self.cfg.budget_steps)

    def by_region(self, statuses: dict[str, dict[str, Any]]) -> str:
        """Who trains in each region, in one line (the progress artifact's description):
        ``us-east: 2 of 2 learners training · eu-west: 0 of 1 training``."""
        regions = self.learners()
        parts = []
        for region in dict.fromkeys(regions.values()):
            mine = [lid for lid, r in regions.items() if r == region]
            busy = sum(1 for lid in mine if statuses.get(lid, {}).get("state") == "training")
            parts.append(f"{region}: {busy} of {len(mine)} learners training")
        return " · ".join(parts)

    def traffic(self) -> tuple[dict[str, dict[str, int]], int, int]:
        """Bytes and requests per region pair summed over every writer's metrics, the
        learners' bytes up and down, and the rejected contributions."""
        store = self.store
        records: list[dict[str, Any]] = []
        learners = self.learners()
        writers = list(learners.items())
        shards = shard_count(self.cfg.pipeline.syncer_shards, self.cfg.topology.fragments)
        writers += [(syncer_id(s), store.client_region) for s in range(shards)]
        rejected, learner_bytes = 0, 0
        for name, region in writers:
            try:
                record = store.progress.read_metrics(name, region) or {}
            except Exception as exc:  # its traffic is counted at the next look
                self.storage_error(f"reading {name}'s metrics", exc)
                record = {}
            rejected += len(record.get("rejected", []))
            if name in learners:
                learner_bytes += record.get("bytes_up", 0) + record.get("bytes_down", 0)
            records.append(record)
        return sum_traffic(records), learner_bytes, rejected


def learner_seconds(status: dict[str, Any]) -> tuple[float, float]:
    """(start-up, training) seconds a learner's status reports, summed over its flow runs."""
    return float(status.get("startup_seconds", 0.0)), float(status.get("train_seconds", 0.0))


def cross_region_bytes(traffic: dict[str, dict[str, int]]) -> int:
    """Bytes between different regions, from traffic per ``src->dst`` pair."""
    return sum(t["bytes"] for pair, t in traffic.items() if len(set(pair.split("->"))) > 1)
