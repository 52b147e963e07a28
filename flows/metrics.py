"""Live metrics of a `diloco train` run, from the buckets: TensorBoard event files and
Prefect tables the launcher updates as the run goes, and the loss curve at the end.

The history is in the buckets (``storage_layout.history``: each learner's round rows,
each global version's record), so nothing here is the only copy of anything: the event
files are a view, rebuilt incrementally. ``runs/NAME/tensorboard/`` holds one
TensorBoard run per source, so charts overlay them:

- ``global``: validation loss of the newest global model, merged tokens per second,
  goodput so far and bytes moved, against the tokens merged into the model;
- ``learner-N``: that learner's training loss, tokens per second, staleness and merge
  weight of the versions it applied, and bytes up and down per round, against its inner
  step;
- ``fragment-P``: per global version of fragment P, the contributions it merged, their
  staleness and largest merge weight, the rejected and superseded ones and the tokens
  it merged, against the version number.

The same series go to the sinks ``pipeline.sinks`` names (``flows.sinks``: Weights &
Biases, MLflow); one that fails is said once and dropped, and the run goes on.

``written.json`` beside them records what the event files hold (per learner its last
round, per fragment its last version, the last evaluation's tokens), so a relaunch of
the run adds only what is new.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flows.sinks import Sink
from protocol.topology import run_slots
from storage_layout.history import global_versions
from storage_layout.store import RunStore

log = logging.getLogger(__name__)

READ_TRIES = 3  # reads of a damaged history object before a watcher stops asking


class LiveMetrics:
    """Turns the run's history in the buckets into TensorBoard scalars and Prefect tables,
    a little more at each ``tick``."""

    def __init__(
        self,
        store: RunStore,
        spec: dict[str, Any],
        folder: Path | str,
        tables: bool = True,
        log: Any = log,
        sinks: dict[str, Sink] | None = None,
    ):
        self.store, self.spec, self.log, self.tables = store, spec, log, tables
        self.sinks = dict(sinks or {})
        self.learners: dict[str, str] = run_slots(spec)
        self.fragments = len(spec["fragments"])
        self.dir = Path(folder) / "tensorboard"
        self.state_path = self.dir / "written.json"
        self.written = self._load()
        # What was read from the buckets by this launch (the tables and the final plot
        # show it all; the event files get only what they lack).
        self.rounds: dict[str, dict[int, dict[str, Any]]] = {lid: {} for lid in self.learners}
        self.versions: dict[int, list[dict[str, Any]]] = {p: [] for p in range(self.fragments)}
        self.points: list[dict[str, Any]] = []
        self.tries: Counter[tuple[str, int]] = Counter()
        self._writers: dict[str, Any] = {}
        self._tables: dict[str, Any] = {}  # artifact key -> its LiveTable
        self._warned: set[str] = set()

    # state ----------------------------------------------------------------------------
    def _load(self) -> dict[str, Any]:
        try:
            state = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            state = {}
        return {
            "rounds": dict(state.get("rounds", {})),
            "versions": {str(k): v for k, v in state.get("versions", {}).items()},
            "tokens": state.get("tokens", -1),
        }

    def _save(self) -> None:
        """Record what the event files hold, after flushing them (a crash in between
        writes a few points twice on the next launch, never loses one)."""
        for writer in self._writers.values():
            writer.flush()
        self._to_sinks(lambda sink: sink.flush())
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.written, sort_keys=True))
        os.replace(tmp, self.state_path)

    def writer(self, name: str) -> Any:
        """The event file writer of TensorBoard run ``name`` (opened on first use)."""
        if name not in self._writers:
            from tensorboardX import SummaryWriter

            # A name of its own that sorts by time (TensorBoard reads a run's files in
            # name order): one named by the second only is overwritten by a launch that
            # opens one in the same second.
            suffix = f".{time.time_ns()}.{os.getpid()}"
            self._writers[name] = SummaryWriter(
                str(self.dir / name), flush_secs=3600, filename_suffix=suffix
            )
        return self._writers[name]

    def scalar(self, series: str, tag: str, value: float, step: int, at: float) -> None:
        """One point of ``series`` (a TensorBoard run) to its event file and every sink."""
        self.writer(series).add_scalar(tag, value, step, walltime=at)
        self._to_sinks(lambda sink: sink.scalar(series, tag, value, step, at))

    def _to_sinks(self, call: Callable[[Sink], None]) -> None:
        for name, sink in list(self.sinks.items()):
            try:
                call(sink)
            except Exception as exc:  # the metrics are for people; the run goes on
                self.log.warning("metrics to %s stopped (they stay in TensorBoard): %r", name, exc)
                del self.sinks[name]

    # reading ----------------------------------------------------------------------------
    def read_rounds(self) -> dict[str, list[dict[str, Any]]]:
        """Each learner's rounds not read yet (one LIST per learner, one read per new
        round); a damaged one is asked for again at the next ticks, a few times."""
        new: dict[str, list[dict[str, Any]]] = {}
        try:  # and the learners joiners added since (``diloco join``)
            for lid, region in self.store.members.run_learners(self.spec).regions.items():
                if lid not in self.learners:
                    self.learners[lid], self.rounds[lid] = region, {}
        except (OSError, ValueError) as exc:
            self._warn("added learners", f"cannot read the learners added to the run: {exc}")
        for lid, region in self.learners.items():
            held = self.rounds[lid]
            try:
                listed = self.store.progress.history_rounds(lid, region)
                want = [r for r in listed if r not in held and self.tries[(lid, r)] < READ_TRIES]
                rows, problems = self.store.progress.get_rounds(lid, want, region)
            except OSError as exc:
                self._warn(f"rounds of {lid}", f"cannot read the history of {lid}: {exc}")
                continue
            for r in want:
                self.tries[(lid, r)] += 1
            for problem in problems:
                self._warn(problem, f"history: skipped {problem}")
            for row in rows:
                held[int(row["round"])] = row
            new[lid] = sorted(rows, key=lambda row: row["round"])
        return new

    def read_versions(self) -> dict[int, list[dict[str, Any]]]:
        """Each fragment's version records not read yet."""
        after = {p: rows[-1]["version"] for p, rows in self.versions.items() if rows}
        found = global_versions(self.store, self.fragments, after=after)
        for p, rows in found.versions.items():
            self.versions[p] += rows
        return found.versions

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.log.warning(message)

    # one tick --------------------------------------------------------------------------
    def tick(
        self,
        point: dict[str, Any] | None = None,
        extra: dict[str, float] | None = None,
        statuses: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Read what is new in the buckets and add it: ``point`` is the launcher's newest
        evaluation (tokens, loss), ``extra`` more global scalars at its tokens (goodput,
        bytes), ``statuses`` the learners' status objects (for the tables)."""
        rounds, versions = self.read_rounds(), self.read_versions()
        for lid, rows in rounds.items():
            self._write_rounds(lid, rows)
        for p, rows in versions.items():
            self._write_versions(p, rows)
        if point is not None:
            self._write_point(point, extra or {})
        self._save()
        if self.tables:
            self.publish_tables(statuses or {})

    def _write_rounds(self, lid: str, rows: list[dict[str, Any]]) -> None:
        done = int(self.written["rounds"].get(lid, 0))
        for row in rows:
            if row["round"] <= done:
                continue
            step, at = int(row.get("step", row["round"])), float(row.get("time", time.time()))
            scalars = {
                "loss/train": row.get("loss"),
                "lr/inner": row.get("lr"),
                "throughput/tokens_per_s": row.get("tokens_per_s"),
                "staleness/applied_max": row.get("staleness"),
                "merge/weight_applied": row.get("merge_weight"),
                "bytes/up": row.get("bytes_up"),
                "bytes/down": row.get("bytes_down"),
                "time/round_seconds": row.get("seconds"),
            }
            for tag, value in scalars.items():
                if value is not None:
                    self.scalar(lid, tag, float(value), step, at)
            done = int(row["round"])
        self.written["rounds"][lid] = done

    def _write_versions(self, p: int, rows: list[dict[str, Any]]) -> None:
        done = int(self.written["versions"].get(str(p), 0))
        for meta in rows:
            v = int(meta.get("version", 0))
            if v <= done:
                continue
            at = float(meta.get("time", time.time()))
            staleness = list((meta.get("staleness") or {}).values())
            weights = list((meta.get("weights") or {}).values())
            scalars = {
                "versions/contributions": len(meta.get("consumed") or []),
                "merge/weight_max": max(weights) if weights else None,
                "versions/rejected": len(meta.get("rejected") or []),
                "versions/superseded": len(meta.get("superseded") or []),
                "versions/tokens_merged": meta.get("tokens", 0),
                "staleness/merged_mean": sum(staleness) / len(staleness) if staleness else None,
                "staleness/merged_max": max(staleness) if staleness else None,
            }
            for tag, value in scalars.items():
                if value is not None:
                    self.scalar(f"fragment-{p}", tag, float(value), v, at)
            done = v
        self.written["versions"][str(p)] = done

    def _write_point(self, point: dict[str, Any], extra: dict[str, float]) -> None:
        tokens = int(point["tokens"])
        last = self.points[-1] if self.points else None
        if last is None or tokens > last["tokens"]:
            self.points.append({**point, "time": time.time(), "dollars": extra.get("cost/dollars")})
        if tokens <= int(self.written["tokens"]):
            return
        at = time.time()
        self.scalar("global", "loss/validation", float(point["loss"]), tokens, at)
        if last is not None and tokens > last["tokens"]:
            rate = (tokens - last["tokens"]) / max(1e-9, at - last["time"])
            self.scalar("global", "throughput/tokens_merged_per_s", rate, tokens, at)
        for tag, value in extra.items():
            if value is not None:
                self.scalar("global", tag, float(value), tokens, at)
        self.written["tokens"] = tokens

    # Prefect tables ---------------------------------------------------------------------
    def table_rows(self, statuses: dict[str, dict[str, Any]]) -> dict[str, list[dict]]:
        """The live tables: one row per learner, one per fragment, one per evaluation."""
        learners = []
        for lid, region in self.learners.items():
            s, held = statuses.get(lid, {}), self.rounds[lid]
            last = held[max(held)] if held else {}
            learners.append({
                "learner": lid, "region": region, "state": s.get("state", "starting"),
                "step": s.get("step", 0), "tokens": s.get("tokens", 0), "rounds": len(held),
                "loss": last.get("loss"), "tokens_per_s": last.get("tokens_per_s"),
                "staleness": last.get("staleness"), "merge_weight": last.get("merge_weight"),
                "bytes_up": s.get("bytes_up", 0), "bytes_down": s.get("bytes_down", 0),
                "generation": last.get("generation"),
            })  # fmt: skip
        versions = []
        for p, rows in self.versions.items():
            if not rows:
                continue
            newest = rows[-1]
            staleness = list((newest.get("staleness") or {}).values())
            versions.append({
                "fragment": p, "version": newest.get("version"),
                "tokens_total": newest.get("tokens_total"),
                "consumed": len(newest.get("consumed") or []),
                "staleness": round(sum(staleness) / len(staleness), 2) if staleness else None,
                "rejected_so_far": sum(len(r.get("rejected") or []) for r in rows),
                "superseded_so_far": sum(len(r.get("superseded") or []) for r in rows),
            })  # fmt: skip
        curve = [
            {"tokens": c["tokens"], "loss": round(float(c["loss"]), 4), "seconds": c.get("seconds"),
             "versions": " ".join(f"f{p}:v{v}" for p, v in c.get("versions", {}).items())}
            for c in self.points
        ]  # fmt: skip
        return {"learners": learners, "versions": versions, "curve": curve}

    def publish_tables(self, statuses: dict[str, dict[str, Any]]) -> None:
        """Show each table artifact's rows, one artifact each updated in place
        (``LiveTable``); a failure is logged once and never stops the run."""
        from flows.observe import LiveTable, artifact_key

        run = self.store.run
        what = {
            "learners": "one row per learner: state, progress, its last round",
            "versions": "one row per fragment: its newest global version",
            "curve": "validation loss of the newest global model against tokens merged",
        }
        for name, rows in self.table_rows(statuses).items():
            if not rows:
                continue
            key = artifact_key(run, name)
            table = self._tables.setdefault(key, LiveTable(key, f"run {run}: {what[name]}"))
            try:
                table.show(rows)
            except Exception as exc:  # the tables are for people; the run goes on
                self._warn(f"artifact {key}", f"cannot update the table {key}: {exc!r}")

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()
        self._to_sinks(lambda sink: sink.close())
        self.sinks.clear()

    # the final curve --------------------------------------------------------------------
    def cost_curve(self) -> list[tuple[float, float]]:
        """What the run's traffic had cost (dollars) at the tokens of each point read."""
        return [(float(p["tokens"]), float(p["dollars"])) for p in self.points
                if p.get("dollars") is not None]  # fmt: skip

    def merged_staleness(self) -> list[int]:
        """The staleness of every contribution merged into a version read (versions behind
        the one it was merged into)."""
        return [int(s) for rows in self.versions.values() for row in rows
                for s in (row.get("staleness") or {}).values()]  # fmt: skip

    def training_curve(self) -> list[tuple[float, float]]:
        """The learners' training loss per round at the tokens all learners had processed
        by the end of that round (its time), from the history read."""
        rows = sorted(
            (row for held in self.rounds.values() for row in held.values()),
            key=lambda row: row.get("time", 0.0),
        )
        latest: dict[str, int] = {}
        out = []
        for row in rows:
            latest[row["learner"]] = int(row.get("tokens", 0))
            if row.get("loss") is not None:
                out.append((float(sum(latest.values())), float(row["loss"])))
        return out
