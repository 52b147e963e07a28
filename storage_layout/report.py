"""A run read back from its buckets for notebooks and reports (``notebooks/train_run.ipynb``).

Everything here comes from the objects a run leaves in its regions' buckets, through the
storage layer only (no JAX, optax or flax is imported, so a laptop with the bucket
credentials can read a run that trained on GPUs):

- ``versions``: the record in each global version's commit marker (the ``version``
  record of ``diloco/records.py``: time, tokens, consumed, weights, staleness, rejected,
  superseded), plus what the retention ledger kept of deleted versions;
- ``contributions``: each learner's contribution markers (step, tokens, steps, seconds,
  base version, bytes, commit time), plus what the ledger kept of deleted ones, each with
  its outcome (merged into a version with its weight and staleness, superseded, rejected
  with the reason, pending), as ``diloco inspect --audit`` decides it;
- ``writers``: the status objects under ``metrics/`` (learners' progress and time
  counters, syncers' rejections, the launcher's, the simulator's summary), whose
  ``traffic`` gives the bytes per region pair;
- ``summary``: the ``summary.json`` that ``diloco train`` writes next to a local run.

Results are plain dicts and lists (no pandas), so a notebook cell only plots them.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from storage_layout import record
from storage_layout.audit import decide_outcomes, sent_from_meta
from storage_layout.audit_report import OUTCOMES, AuditReport
from storage_layout.bucket import BucketError
from storage_layout.commit import REVOKED, CorruptVersion
from storage_layout.layout import parse_marker_name
from storage_layout.members import Generation
from storage_layout.retention import read_ledger
from storage_layout.run_view import Run, open_run, read_markers
from storage_layout.traffic import sum_traffic

UNIX = 1e9  # a record time above this is Unix time (the pipeline), below simulated seconds


# global versions -------------------------------------------------------------------
def versions(run: Run) -> list[dict[str, Any]]:
    """Every global version of every fragment, oldest first: its record from the commit
    marker (in the region holding the most versions of the fragment: the syncers' home),
    or, for a version retention deleted, what the ledger kept (``held`` False, no time).

    Each row: fragment, version, time, held, bytes, tokens, tokens_total, seconds,
    seconds_total, consumed ([learner, seq]), weights and staleness (per ``learner/seq``),
    rejected ([learner, seq, reason]), superseded, lost_versions, cursor, merged."""
    store, rows = run.store, []
    reachable = run.reachable
    for p in range(run.fragments if reachable else 0):
        listed = {r: store.versions.global_versions(p, r) for r in reachable}
        region = max(listed, key=lambda r: (len(listed[r]), r == store.client_region))
        keys = [store.layout.global_marker(p, v) for v in listed.get(region, [])]
        markers = read_markers(store.bucket(region), keys, run.problems)
        by_version: dict[int, dict[str, Any]] = {}
        for key, marker in markers.items():
            meta = dict(marker.meta)
            v = parse_marker_name(key, "v")
            by_version[v] = {**meta, "fragment": p, "version": v, "held": True,
                             "bytes": marker.size, "region": region}  # fmt: skip
        for entry in _ledger(run, p):
            for row in entry.get("versions", []):
                v = int(row["version"])
                by_version.setdefault(v, {**row, "fragment": p, "version": v, "held": False,
                                          "time": None, "region": None})  # fmt: skip
        rows.extend(_version_row(by_version[v]) for v in sorted(by_version))
    return rows


def _version_row(r: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "fragment": int(r["fragment"]), "version": int(r["version"]), "time": r.get("time"),
        "held": bool(r.get("held")), "region": r.get("region"), "bytes": r.get("bytes"),
        "tokens": int(r.get("tokens") or 0), "tokens_total": int(r.get("tokens_total") or 0),
        "seconds": float(r.get("seconds") or 0.0),
        "seconds_total": float(r.get("seconds_total") or 0.0),
        "consumed": [[str(lid), int(s)] for lid, s in r.get("consumed") or []],
        "weights": dict(r.get("weights") or {}), "staleness": dict(r.get("staleness") or {}),
        "rejected": [list(x) for x in r.get("rejected") or []],
        "superseded": [list(x) for x in r.get("superseded") or []],
        "lost_versions": [int(v) for v in r.get("lost_versions") or []],
        "cursor": dict(r.get("cursor") or {}), "merged": dict(r.get("merged") or {}),
    }  # fmt: skip


def _ledger(run: Run, p: int) -> list[dict[str, Any]]:
    out = []
    for region in run.reachable:
        try:
            out.extend(read_ledger(run.store.bucket(region), run.store.layout, p))
        except CorruptVersion as exc:
            run.problems.append(f"{region}: {exc}")
    return out


def clock(version_rows: Iterable[Mapping[str, Any]]) -> str:
    """``"unix"`` for a pipeline run (records carry Unix time), ``"simulated"`` for the
    simulator's (seconds on its virtual clock, which contribution markers do not use)."""
    times = [float(r["time"]) for r in version_rows if r.get("time") is not None]
    return "unix" if times and max(times) > UNIX else "simulated"


def start_time(run: Run, version_rows: Sequence[Mapping[str, Any]]) -> float:
    """The run's start on its clock: 0 for the simulator; for the pipeline, the earliest
    of the learners' first process starts (their generation leases) and the versions'
    times (version 0 carries time 0, not its Unix time)."""
    if clock(version_rows) != "unix":
        return 0.0
    times = [float(r["time"]) for r in version_rows if (r.get("time") or 0) > UNIX]
    store = run.store
    for learner, region in run.learners.items():
        if region not in run.reachable:
            continue
        try:
            bucket = store.bucket(region)
            first = bucket.list(store.layout.lease_commits(learner))[:1]
            for name in first:
                key = f"{store.layout.lease_commits(learner)}/{name}"
                times.extend(t for t in [record.read(bucket, key, Generation).time] if t)
        except (BucketError, OSError, CorruptVersion):
            continue  # a run from before leases, or one being written: the versions do
    return min(times, default=0.0)


# contributions ---------------------------------------------------------------------
def contributions(
    run: Run, version_rows: Sequence[Mapping[str, Any]], start: float | None = None
) -> list[dict[str, Any]]:
    """Every contribution the learners committed, with its outcome, from its marker if it
    is still held, else from what the retention ledger kept, else (a run collected before
    the ledger existed) from the version record that merged or refused it.

    Each row: learner, region, fragment, seq, base_version, step, tokens (since its
    anchor), new_tokens (less its predecessor's from the same anchor), steps,
    seconds, tokens_per_second, bytes, held, source (marker | ledger | version), outcome
    (merged | superseded | rejected | pending | lost, by ``diloco inspect --audit``'s
    rules), where (the version that merged it, what superseded it, the rejection's
    reason), weight and staleness (at its merge: what the syncer weighted it by),
    staleness_at_send (versions published between its base and its commit; pipeline runs
    only), and times in seconds since ``start``: sent_at (its commit; pipeline runs only:
    the simulator's markers carry wall time, its records virtual time), recorded_at (the
    version that recorded its outcome) and t (sent_at, else recorded_at)."""
    store, rows = run.store, []
    unix = clock(version_rows) == "unix"
    start = start_time(run, version_rows) if start is None else start
    by_fragment: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for r in version_rows:
        by_fragment[int(r["fragment"])].append(r)
    for p in range(run.fragments):
        held: dict[tuple[str, int], dict[str, Any]] = {}
        for learner, region in run.learners.items():
            if region not in run.reachable:
                continue
            bucket = store.bucket(region)
            keys = [store.layout.contribution_marker(learner, p, s)
                    for s in store.contributions.contribution_seqs(learner, p, region)]  # fmt: skip
            for marker in read_markers(bucket, keys, run.problems).values():
                if marker.kind == REVOKED:  # a key a syncer held: nothing was sent
                    continue
                m = dict(marker.meta)
                held[(learner, int(m["seq"]))] = {**m, "write_id": marker.write_id,
                                                   "source": "marker"}  # fmt: skip
        for entry in _ledger(run, p):
            for m in entry.get("contributions", []):
                key = (str(m["learner"]), int(m["seq"]))
                held.setdefault(key, {**m, "source": "ledger"})
        records = {int(r["version"]): r for r in by_fragment[p]}
        rows.extend(_with_outcomes(run, p, held, records, unix, start))
    return rows


def _with_outcomes(
    run: Run, p: int, held: dict[tuple[str, int], dict], records: Mapping[int, Mapping],
    unix: bool, start: float,
) -> list[dict[str, Any]]:  # fmt: skip
    """Rows of fragment ``p``'s contributions, each given its outcome by the audit's rules
    (``storage_layout.audit``: one definition of merged, superseded, rejected, pending)."""
    lost = {v for r in records.values() for v in r.get("lost_versions") or []}
    live = {v: r for v, r in sorted(records.items()) if v not in lost}
    weight, staleness, counters, recorded = {}, {}, {}, {}
    for v, r in live.items():
        weight.update(r.get("weights") or {})
        staleness.update(r.get("staleness") or {})
        for anchor, c in (r.get("merged") or {}).items():
            if isinstance(c, list) and len(c) >= 4:  # [seq, tokens, steps, seconds]
                lid, _, base = anchor.rpartition("/")
                counters[(lid, int(c[0]))] = {"base_version": int(base), "tokens": c[1],
                                              "steps": c[2], "seconds": c[3]}  # fmt: skip
        for lid, seq, *_ in [*r["consumed"], *r["rejected"], *r["superseded"]]:
            recorded.setdefault((str(lid), int(seq)), v)
    for key in recorded:  # known only from the versions (collected before the ledger)
        if key not in held:
            held[key] = {**counters.get(key, {}), "source": "version"}
    sent = {
        key: sent_from_meta(key[0], key[1], m, str(m.get("write_id"))) for key, m in held.items()
    }
    decide_outcomes(p, {v: dict(r) for v, r in live.items()}, sent,
              AuditReport(run.name, run.regions, []))  # fmt: skip
    published = [(float(r["time"]), v) for v, r in live.items() if (r.get("time") or 0) > UNIX]
    new_tokens, last = {}, {}  # a send from an anchor carries all its tokens so far
    for key, c in sorted(sent.items(), key=lambda kv: kv[1].seq):
        new_tokens[key] = c.tokens - last.get(c.anchor, 0)
        last[c.anchor] = c.tokens
    rows = []
    for key, m in sorted(held.items()):
        c, tag = sent[key], f"{key[0]}/{key[1]}"
        seconds = m.get("seconds", counters.get(key, {}).get("seconds"))
        tokens = int(m.get("tokens") or 0)
        written = m.get("written_at")
        sent_at = at_send = None
        if unix and written is not None:
            sent_at = float(written) - start
            current = max((v for t, v in published if t <= float(written)), default=0)
            at_send = max(0, current - c.base_version)
        v = recorded.get(key)
        when = live[v].get("time") if v is not None else None
        recorded_at = None if when is None or (unix and when < UNIX) else float(when) - start
        rows.append({
            "learner": key[0], "region": run.learners.get(key[0]), "fragment": p,
            "seq": key[1], "base_version": c.base_version if "base_version" in m else None,
            "step": m.get("step"), "tokens": tokens, "new_tokens": new_tokens[key],
            "steps": m.get("steps"),
            "seconds": seconds,
            "tokens_per_second": tokens / float(seconds) if seconds else None,
            "bytes": m.get("payload_bytes"), "held": m["source"] == "marker",
            "source": m["source"], "outcome": c.outcome, "where": c.where,
            "weight": weight.get(tag), "staleness": staleness.get(tag),
            "staleness_at_send": at_send, "sent_at": sent_at, "recorded_at": recorded_at,
            "t": sent_at if sent_at is not None else recorded_at,
        })  # fmt: skip
    return rows


def per_learner(
    contribution_rows: Sequence[Mapping[str, Any]], learners: Mapping[str, str], fragments: int
) -> list[dict[str, Any]]:
    """One row per learner: contributions sent and their outcomes, the tokens of its work
    that reached the global model (new tokens merged or superseded by a merged send, mean
    over fragments: each fragment's sends carry all of the learner's steps), the sum of
    its merge weights, its mean staleness at merge and at send, and its median
    throughput (tokens per learner second)."""
    rows = []
    for lid, region in learners.items():
        mine = [c for c in contribution_rows if c["learner"] == lid]
        got = [c for c in mine if c["outcome"] == "merged"]
        kept = [c for c in mine if c["outcome"] in ("merged", "superseded")]
        rate = sorted(c["tokens_per_second"] for c in mine if c["tokens_per_second"])
        at_send = [c["staleness_at_send"] for c in mine if c["staleness_at_send"] is not None]
        at_merge = [c["staleness"] for c in got if c["staleness"] is not None]
        row: dict[str, Any] = {"learner": lid, "region": region, "sent": len(mine)}
        row.update({o: sum(c["outcome"] == o for c in mine) for o in OUTCOMES})
        row.update({
            "tokens merged": sum(c["new_tokens"] for c in kept) // max(1, fragments),
            "weight (sum)": sum(c["weight"] or 0.0 for c in got),
            "staleness at merge": sum(at_merge) / len(at_merge) if at_merge else None,
            "staleness at send": sum(at_send) / len(at_send) if at_send else None,
            "tokens/s (median)": rate[len(rate) // 2] if rate else None,
        })  # fmt: skip
        rows.append(row)
    return rows


def rejections(
    version_rows: Iterable[Mapping[str, Any]], writer_rows: Mapping[str, Mapping] | None = None
) -> list[dict[str, Any]]:
    """Every rejected contribution with its reason: from the version records (the
    syncer records a rejection in the next version it publishes) and the syncers' status
    objects (rejections after the last version). Rows: fragment, version (None when no
    version recorded it yet), learner, seq, reason."""
    out: dict[tuple[int, str, int], dict[str, Any]] = {}
    for r in version_rows:
        for learner, seq, reason, *_ in r.get("rejected") or []:
            out.setdefault((int(r["fragment"]), str(learner), int(seq)), {
                "fragment": int(r["fragment"]), "version": int(r["version"]),
                "learner": str(learner), "seq": int(seq), "reason": str(reason)})  # fmt: skip
    for w in (writer_rows or {}).values():
        for x in w.get("record", {}).get("rejected") or []:
            if isinstance(x, Mapping) and "fragment" in x:
                key = (int(x["fragment"]), str(x.get("learner")), int(x.get("seq", -1)))
                out.setdefault(key, {"fragment": key[0], "version": None, "learner": key[1],
                                     "seq": key[2], "reason": str(x.get("reason"))})  # fmt: skip
    return sorted(out.values(), key=lambda r: (r["fragment"], r["learner"], r["seq"]))


def reasons(rejected: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Rejections counted by reason, the learner- and number-specific details cut off
    (``staleness 3 exceeds the maximum 2`` -> ``staleness exceeds the maximum``)."""
    counts: Counter[str] = Counter()
    for r in rejected:
        words = [w for w in str(r["reason"]).split() if not _numeric(w)]
        counts[" ".join(words).split(":")[0]] += 1
    return dict(counts.most_common())


def _numeric(word: str) -> bool:
    try:
        float(word.strip("(),x"))
    except ValueError:
        return False
    return True


# status objects and traffic ----------------------------------------------------------
def writers(run: Run) -> dict[str, dict[str, Any]]:
    """Every writer's status object under ``metrics/`` in every region: name -> {kind
    (learner | syncer | launcher | simulator | other), region, record}."""
    out: dict[str, dict[str, Any]] = {}
    for region in run.reachable:
        found, problems = run.store.progress.statuses(region)
        run.problems.extend(problems)
        for writer, status in found.items():
            kind = (
                "learner" if writer in run.learners
                else "syncer" if writer.startswith("syncer")
                else writer if writer in ("launcher", "simulator")
                else "other"
            )  # fmt: skip
            out[writer if writer not in out else f"{writer}@{region}"] = {
                "kind": kind, "region": region, "record": status}  # fmt: skip
    return dict(sorted(out.items()))


def learner_statuses(writer_rows: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per learner status object (what ``diloco train``'s learners report):
    state, step of total, tokens, start-up and training seconds, bytes up and down,
    checkpoint bytes, failed writes and the last round's row."""
    rows = []
    for name, w in writer_rows.items():
        if w["kind"] != "learner":
            continue
        s = w["record"]
        rows.append({
            "learner": name, "region": s.get("region", w["region"]), "state": s.get("state"),
            "step": s.get("step"), "total_steps": s.get("total_steps"),
            "tokens": s.get("tokens"), "startup_seconds": s.get("startup_seconds"),
            "train_seconds": s.get("train_seconds"), "bytes_up": s.get("bytes_up"),
            "bytes_down": s.get("bytes_down"), "checkpoint_bytes": s.get("checkpoint_bytes"),
            "failed_writes": s.get("failed_writes"), "last_round": s.get("last_round"),
        })  # fmt: skip
    return rows


def traffic(writer_rows: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """Bytes and requests per region pair (``source->destination``), summed over every
    writer's status object, as the launcher's summary and ``diloco inspect`` sum them."""
    return sum_traffic(w["record"] for w in writer_rows.values())


def find_summary(run: Run, path: str | Path | None = None) -> dict[str, Any] | None:
    """The run's summary: ``path`` if given; else the ``summary.json`` that ``diloco
    train`` writes next to a local run (``runs/RUN/summary.json`` for buckets in
    ``runs/RUN/buckets/REGION``); else the simulator's, from its status object."""
    candidates = [Path(path)] if path else []
    for url in run.regions.values():
        local = url.removeprefix("file://") if url.startswith("file://") else url
        if "://" not in local:
            candidates += [Path(local).parent.parent / "summary.json",
                           Path(local).parent / "summary.json"]  # fmt: skip
    for candidate in candidates:
        if candidate.is_file():
            summary = json.loads(candidate.read_text())
            if path or summary.get("run") == run.name:
                return {**summary, "source": str(candidate)}
    for region in run.reachable:
        record = run.store.progress.read_metrics("simulator", region)
        if record and "summary" in record:
            return {**record["summary"], "source": f"{run.regions[region]}/{run.name}/metrics"}
    return None


def rounds(run: Run) -> dict[str, list[dict[str, Any]]] | None:
    """Each learner's per-round rows (loss, tokens/s, staleness, merge weight, bytes,
    time; ``storage_layout.history``), in round order; None where this checkout's storage
    layer keeps no round history. A learner without rows has an empty list (the
    simulator writes none)."""
    try:
        from storage_layout.history import learner_rounds
    except ImportError:
        return None
    here = {lid: r for lid, r in run.learners.items() if r in run.reachable}
    history = learner_rounds(run.store, here)
    run.problems.extend(history.damaged)
    return {lid: list(history.rounds.get(lid, [])) for lid in run.learners}


def simulator_evals(path: str | Path | None) -> list[dict[str, Any]]:
    """The ``eval`` records (tokens, loss, time) of a simulation's ``metrics.jsonl``
    (``diloco simulate --out DIR`` writes it there), or [] without one."""
    if path is None:
        return []
    lines = Path(path).read_text().splitlines()
    return [r for r in (json.loads(x) for x in lines if x.strip()) if r.get("event") == "eval"]


# one call for a notebook -------------------------------------------------------------
def load(
    buckets: str | Sequence[str] | Mapping[str, str],
    run: str | None = None,
    summary_json: str | Path | None = None,
    metrics_jsonl: str | Path | None = None,
) -> dict[str, Any]:
    """Everything above for one run: run, regions, learners, fragments, config, clock,
    start, versions (each with t, seconds since the start), contributions, per_learner,
    rejections, rejection_reasons, writers, learner_statuses, traffic, summary, evals
    (a simulation's validation curve, from ``metrics_jsonl``), rounds and problems
    (objects that could not be read, regions that could not be reached)."""
    opened = open_run(buckets, run)
    vrows = versions(opened)
    start = start_time(opened, vrows)
    unix = clock(vrows) == "unix"
    for r in vrows:  # t: seconds since the start (version 0 is the start; the ledger has none)
        time = r.get("time")
        r["t"] = (
            0.0 if r["version"] == 0
            else None if time is None or (unix and time < UNIX)
            else float(time) - start
        )  # fmt: skip
    crows = contributions(opened, vrows, start)
    wrows = writers(opened)
    rejected = rejections(vrows, wrows)
    return {
        "run": opened.name, "regions": opened.regions, "learners": opened.learners,
        "fragments": opened.fragments, "config": opened.spec.get("config") or {},
        "clock": clock(vrows), "start": start, "versions": vrows,
        "contributions": crows,
        "per_learner": per_learner(crows, opened.learners, opened.fragments),
        "rejections": rejected,
        "rejection_reasons": reasons(rejected), "writers": wrows,
        "learner_statuses": learner_statuses(wrows), "traffic": traffic(wrows),
        "summary": find_summary(opened, summary_json),
        "evals": simulator_evals(metrics_jsonl), "rounds": rounds(opened),
        "problems": opened.problems,
    }  # fmt: skip


# small helpers for cells -------------------------------------------------------------
def series(rows: Iterable[Mapping[str, Any]], by: str, x: str, y: str) -> dict[Any, tuple]:
    """``rows`` grouped by ``by`` as (xs, ys) sorted by x, rows with x or y None left out:
    one line per learner or fragment in a plot."""
    out: dict[Any, list[tuple[Any, Any]]] = defaultdict(list)
    for r in rows:
        if r.get(x) is not None and r.get(y) is not None:
            out[r[by]].append((r[x], r[y]))
    return {k: tuple(zip(*sorted(v), strict=True)) for k, v in sorted(out.items())}


def table(rows: Iterable[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """``rows`` as a Markdown table (a notebook shows it with ``Markdown``)."""
    rows = list(rows)
    columns = list(columns or (rows[0].keys() if rows else []))
    if not columns:
        return "*(none)*"

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.4g}" if abs(v) < 1e6 else f"{v:,.0f}"
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}"
        return str("" if v is None else v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def checkout() -> Path:
    """The folder this package lives in (a source checkout's root: ``runs/`` is there)."""
    return Path(__file__).resolve().parent.parent
