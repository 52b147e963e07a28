"""Garbage collection of a run's buckets.

Deleted:
- contributions that a committed global version has processed (seq at or below the
  newest version's cursor for that learner), except each learner's newest one of each
  fragment: a restarted learner reads its next sequence number and step from it;
- global versions older than ``window`` versions behind the newest, in every region,
  except the bases of contributions not yet processed (a syncer's anchored merge needs
  them). Learners need no old version: they rejoin from the newest ones;
- with ``orphan_age`` set (the syncers use ``ORPHAN_AGE``), data prefixes that no marker
  names (a writer died between data and marker, a full disk failed its marker, or it
  lost a race), and the temporaries of exclusive creates on a local disk (``.tmp-*``,
  left by a writer killed mid-write; listings hide them), that are older than that many
  seconds: in the folders of the fragments collected, and, with fragment 0 among them,
  the learners' own folders (checkpoints, sequence claims, leases, history, joins) and the
  run's top folder.

Before anything of a fragment is deleted, the deleted contributions' counters and the
deleted versions' outcome lists are written to the run's **ledger** in the home region
(``ledger/fP/sN.json``, never deleted), so ``diloco inspect --audit`` can still account
for every contribution after retention.

Nothing is deleted on a stored object's word: a marker names only the data prefix its own
key gives (``commit.read_marker`` refuses any other), and with the run's ``keys`` (the
syncers hold the secret) a contribution is deleted only if its signature verifies; one
that does not (a forgery, whether or not a syncer already rejected it) is kept and named
in the report's problems. The newest version of each fragment and of each learner's
contributions is never deleted.

A learner's checkpoints are pruned by the learner itself (``prune_checkpoints``, its
newest ``keep``). Never deleted: anything a marker still needs, uncommitted data younger
than ``orphan_age`` (it may be a write in flight), the spec. A marker is deleted
before its data, so no reader ever sees a marker whose data is gone on purpose.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from storage_layout import record
from storage_layout.auth import Keys, verify
from storage_layout.bucket import Bucket
from storage_layout.commit import REVOKED, CommitMarker, CorruptVersion, read_marker
from storage_layout.layout import RunLayout, claim_stem, parse_marker_name
from storage_layout.store import RunStore

log = logging.getLogger(__name__)
_DATA_NAME = re.compile(r"^([sv])(\d{12})-([0-9a-f]+)$")
# Uncommitted data and temporaries older than this are abandoned: no write in flight takes
# an hour (a contribution, a version or a checkpoint is written in seconds, and a retried
# write rewrites its objects, which makes them young again).
ORPHAN_AGE = 3600.0


@dataclass
class RetentionReport:
    contributions_deleted: int = 0
    globals_deleted: int = 0
    orphans_deleted: int = 0
    temporaries_deleted: int = 0
    checkpoints_deleted: int = 0
    bytes_freed: int = 0
    pinned: dict[int, list[int]] = field(
        default_factory=dict
    )  # fragment -> versions kept for learners
    problems: list[str] = field(default_factory=list)


def _drop(bucket: Bucket, marker_key: str, marker: CommitMarker, report: RetentionReport) -> None:
    bucket.delete([marker_key])  # marker first: the version disappears for readers at once
    bucket.delete_prefix(marker.data_prefix)
    report.bytes_freed += marker.size


def _drop_version(bucket: Bucket, marker_key: str, report: RetentionReport) -> bool:
    try:
        marker = read_marker(bucket, marker_key)
    except (CorruptVersion, FileNotFoundError) as exc:
        report.problems.append(f"kept {marker_key}: {exc}")
        return False
    try:
        _drop(bucket, marker_key, marker, report)
    except OSError as exc:  # the next pass tries again; data left alone is an orphan
        report.problems.append(f"could not delete {marker_key} or its data: {exc!r}")
        return False
    return True


def prune_checkpoints(store: RunStore, learner: str, keep: int = 2) -> int:
    """Delete all but ``learner``'s newest ``keep`` checkpoints in its home region (a
    rejoin reads only the newest readable one; the one before is the fallback should
    the newest be corrupt). Returns how many were deleted.

    Best effort: a failed request is logged and left for the next call (which sees every
    older checkpoint again). It never fails the checkpoint just written."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, not {keep}")
    report = RetentionReport()
    try:
        steps = store.checkpoints.checkpoint_steps(learner)
    except OSError as exc:
        log.warning("checkpoint retention: cannot list %s's checkpoints: %r", learner, exc)
        return 0
    for step in steps[:-keep]:
        report.checkpoints_deleted += _drop_version(
            store.home, store.layout.checkpoint_marker(learner, step), report
        )
    for problem in report.problems:
        log.warning("checkpoint retention: %s", problem)
    return report.checkpoints_deleted


def _age_seconds(bucket: Bucket, key: str) -> float | None:
    try:
        info = bucket.info(key)
    except (FileNotFoundError, OSError):
        return None
    stamp = (
        info.get("mtime") or info.get("LastModified") or info.get("updated") or info.get("created")
    )
    if isinstance(stamp, (int, float)):
        return time.time() - float(stamp)
    if isinstance(stamp, str):
        stamp = dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    if isinstance(stamp, dt.datetime):
        if stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=dt.UTC)
        return (dt.datetime.now(dt.UTC) - stamp).total_seconds()
    return None


def _orphans(
    bucket: Bucket, data_dir: str, commits_dir: str, age: float, report: RetentionReport
) -> None:
    names = [(n, m.groups()) for n in bucket.list(data_dir) if (m := _DATA_NAME.match(n))]
    listed = set(bucket.list(commits_dir))
    counts = Counter(f"{letter}{number}" for _, (letter, number, _) in names)
    for name, (letter, number, write_id) in names:
        marker_name = f"{letter}{number}.json"
        if marker_name in listed and counts[f"{letter}{number}"] == 1:
            continue  # its marker's only data (a marker goes before its data): committed
        try:  # by key, not by listing: a listing may lag
            if read_marker(bucket, f"{commits_dir}/{marker_name}").write_id == write_id:
                continue  # committed: not an orphan
        except FileNotFoundError:
            pass
        except CorruptVersion as exc:
            report.problems.append(f"kept {data_dir}/{name}: marker unreadable ({exc})")
            continue
        # A write that failed before its zarr.json leaves none: the folder's time, then.
        seconds = _age_seconds(bucket, f"{data_dir}/{name}/zarr.json")
        if seconds is None:
            seconds = _age_seconds(bucket, f"{data_dir}/{name}")
        if seconds is not None and seconds >= age:
            bucket.delete_prefix(f"{data_dir}/{name}")
            report.orphans_deleted += 1


def _temporaries(bucket: Bucket, folder: str, age: float, report: RetentionReport) -> None:
    """Delete the temporaries under ``folder`` older than ``age`` seconds (a writer
    killed between writing one and linking it into place; listings hide them)."""
    for name in bucket.temporaries(folder):
        seconds = _age_seconds(bucket, f"{folder}/{name}")
        if seconds is not None and seconds >= age:
            bucket.delete([f"{folder}/{name}"])
            report.temporaries_deleted += 1


def _abandoned_by_learners(
    store: RunStore, learners: Mapping[str, str], age: float, report: RetentionReport
) -> None:
    """What no fragment owns: temporaries in the learners' own folders and the run's top
    folder, and checkpoint data no marker names (a learner killed mid-checkpoint)."""
    layout = store.layout
    for learner, region in learners.items():
        bucket = store.bucket(region)
        commits = layout.checkpoint_commits(learner)
        _orphans(bucket, f"{commits.rsplit('/', 1)[0]}/data", commits, age, report)
        for folder in (commits, layout.seq_claims(learner), layout.lease_commits(learner),
                       layout.history(learner), layout.join_commits(learner)):  # fmt: skip
            _temporaries(bucket, folder, age, report)
    for region in store.urls:
        _temporaries(store.bucket(region), layout.run, age, report)


@dataclass
class _Plan:
    """What one fragment's collection deletes, and the ledger entry that records it."""

    doomed: list[tuple[Bucket, str, CommitMarker]] = field(default_factory=list)
    contributions: list[dict] = field(default_factory=list)
    versions: dict[int, dict] = field(default_factory=dict)
    pins: set[int] = field(default_factory=set)


# What the ledger keeps of a deleted version's record: what the audit needs.
_VERSION_FIELDS = ("consumed", "cursor", "rejected", "superseded", "tokens", "tokens_total")


def _plan_contributions(
    store: RunStore, p: int, learners: Mapping[str, str], cursor: Mapping[str, int],
    plan: _Plan, report: RetentionReport, orphan_age: float | None, keys: Keys | None,
    decided: set[tuple[str, int]] | None,
) -> None:  # fmt: skip
    layout = store.layout
    for learner, region in learners.items():
        bucket = store.bucket(region)
        seqs = store.contributions.contribution_seqs(learner, p, region)
        signing = keys.verifying_key(learner) if keys is not None else None
        sound: list[tuple[int, str, CommitMarker, int]] = []
        for seq in seqs:
            key = layout.contribution_marker(learner, p, seq)
            try:
                marker = read_marker(bucket, key)
                if marker.kind == REVOKED:  # holds a key, no contribution: kept (a few bytes)
                    continue
                if signing is not None:
                    verify(marker, signing, learner, key)
                sound.append((seq, key, marker, int(marker.meta["base_version"])))
            except (CorruptVersion, KeyError, ValueError, TypeError, FileNotFoundError) as exc:
                report.problems.append(f"kept {key}: {exc}")
        # The newest sound one stays (a forgery listed above it is no learner's newest).
        newest = sound[-1][0] if sound else None
        for seq, key, marker, base in sound:
            # (without a key to authenticate it, only what a syncer decided goes)
            known = decided is None or (learner, seq) in decided
            if seq <= int(cursor.get(learner, 0)) and seq != newest and known:
                plan.doomed.append((bucket, key, marker))
                m = marker.meta
                plan.contributions.append(
                    {"learner": learner, "seq": seq, "base_version": base,
                     "anchor_seq": m.get("anchor_seq", 0), "tokens": m.get("tokens"),
                     "steps": m.get("steps"), "data": m.get("data"),
                     "written_at": m.get("written_at"),
                     "write_id": marker.write_id}
                )  # fmt: skip
            else:
                plan.pins.add(base)
        if orphan_age is not None:
            contrib = layout.contribution_commits(learner, p).rsplit("/", 1)[0]
            _orphans(bucket, f"{contrib}/data", f"{contrib}/commits", orphan_age, report)
            _temporaries(bucket, f"{contrib}/commits", orphan_age, report)


def _plan_versions(
    store: RunStore, p: int, oldest_kept: int, pins: set[int], plan: _Plan,
    report: RetentionReport, orphan_age: float | None,
) -> None:  # fmt: skip
    layout = store.layout
    for region in store.urls:
        bucket = store.bucket(region)
        for v in store.versions.global_versions(p, region):
            if v >= oldest_kept or v in pins:
                continue
            key = layout.global_marker(p, v)
            try:
                marker = read_marker(bucket, key)
            except (CorruptVersion, FileNotFoundError) as exc:
                report.problems.append(f"kept {key}: {exc}")
                continue
            plan.doomed.append((bucket, key, marker))
            row = plan.versions.setdefault(
                v, {"version": v, "write_ids": {},
                    **{k: marker.meta.get(k) for k in _VERSION_FIELDS}}
            )  # fmt: skip
            row["write_ids"][region] = marker.write_id
        if orphan_age is not None:
            base = layout.global_commits(p).rsplit("/", 1)[0]
            _orphans(bucket, f"{base}/data", f"{base}/commits", orphan_age, report)
            _temporaries(bucket, f"{base}/commits", orphan_age, report)
            _temporaries(bucket, layout.ledger_commits(p), orphan_age, report)


def _decided(store: RunStore, p: int, versions: Sequence[int]) -> set[tuple[str, int]]:
    """The contributions of fragment ``p`` that the home region's versions record as
    merged, rejected or superseded."""
    out: set[tuple[str, int]] = set()
    for v in versions:
        try:
            meta = store.versions.global_marker(p, v).meta
            for field_name in ("consumed", "rejected", "superseded"):
                out.update((str(row[0]), int(row[1])) for row in meta.get(field_name) or [])
        except (CorruptVersion, FileNotFoundError, TypeError, ValueError, IndexError):
            continue  # an unreadable record decides nothing
    return out


def write_ledger(store: RunStore, fragment: int, entry: Mapping[str, Any]) -> int:
    """Record what is about to be deleted in the home region's ledger, so an audit can
    still account for every contribution and version (an exclusive create of the next
    entry: two collectors never overwrite each other's; the audit drops duplicates).
    Returns the entry's number."""
    body = json.dumps({**entry, "fragment": fragment, "writer": store.writer,
                       "time": time.time()}, sort_keys=True).encode()  # fmt: skip
    return store.put_next(store.layout.ledger_commits(fragment), body)


class LedgerVersion(record.Record):
    version: record.Counter
    write_ids: dict[record.Name, record.Name] = Field(default_factory=dict)


class LedgerEntry(record.Record):
    """What a collector recorded of fragment ``fragment`` before deleting it."""

    fragment: record.Counter
    contributions: list[Any] = Field(default_factory=list)
    versions: list[LedgerVersion] = Field(default_factory=list)


LEDGER_BYTES = 64 << 20  # an entry lists what one pass deleted: ~100 bytes a contribution


def read_ledger(bucket: Bucket, layout: RunLayout, fragment: int) -> list[dict[str, Any]]:
    """Every ledger entry of ``fragment`` in ``bucket``, oldest first; ``CorruptVersion``
    names one that is missing or not an entry of this fragment."""
    out = []
    prefix = layout.ledger_commits(fragment)
    for name in bucket.list(prefix):
        stem = claim_stem(name)  # an entry is a claim (``RunStore.put_next``): tagged
        if stem is None or parse_marker_name(f"{stem[0]}.json", "s") is None:
            continue
        key = f"{prefix}/{name}"
        try:
            body = record.read_body(bucket, key, LedgerEntry, LEDGER_BYTES)
        except FileNotFoundError as exc:
            raise CorruptVersion(f"ledger entry {key} is unreadable: {exc}") from exc
        if body["fragment"] != fragment:
            raise CorruptVersion(f"ledger entry {key} is of fragment {body['fragment']}")
        out.append(body)
    return out


def collect_garbage(
    store: RunStore,
    fragments: int | Sequence[int],
    learners: Mapping[str, str],
    window: int,
    orphan_age: float | None = None,
    keys: Keys | None = None,
) -> RetentionReport:
    """Apply the retention rules above to ``fragments`` (a count, or the fragments one
    syncer shard owns). ``learners`` maps learner id -> its region. With ``keys`` that
    verify (the run secret), only contributions whose signature verifies are deleted.
    What is deleted is first written to the ledger; if that fails, nothing of the
    fragment is deleted."""
    report = RetentionReport()
    fragments = range(fragments) if isinstance(fragments, int) else fragments
    if orphan_age is not None and 0 in fragments:  # one collector for what no fragment owns
        _abandoned_by_learners(store, learners, orphan_age, report)
    for p in fragments:
        versions = store.versions.global_versions(p)
        if not versions:
            continue
        newest = versions[-1]
        cursor = store.versions.global_marker(p, newest).meta.get("cursor", {})
        plan = _Plan()
        # Without the run secret nothing can be authenticated: only what a syncer decided
        # (merged, rejected or superseded, as a committed version records) is deleted.
        decided = None if keys is not None and keys.verifies else _decided(store, p, versions)
        _plan_contributions(store, p, learners, cursor, plan, report, orphan_age, keys, decided)
        report.pinned[p] = sorted(v for v in plan.pins if v < newest - window)
        # Kept: every version from ``newest - window`` up, listed or not (a listing that
        # left the newest out must not make it look old in the next listing), and the pins.
        _plan_versions(store, p, newest - window, plan.pins, plan, report, orphan_age)
        if not plan.doomed:
            continue
        write_ledger(store, p, {"contributions": plan.contributions,
                                "versions": sorted(plan.versions.values(),
                                                   key=lambda r: r["version"])})  # fmt: skip
        for bucket, key, marker in plan.doomed:
            _drop(bucket, key, marker, report)
        report.contributions_deleted += len(plan.contributions)
        report.globals_deleted += sum(len(v["write_ids"]) for v in plan.versions.values())
    return report
