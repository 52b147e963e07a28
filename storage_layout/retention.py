"""Garbage collection of a run's buckets.

Deleted:
- contributions that a committed global version has processed (seq at or below the
  newest version's cursor for that learner), except each learner's newest one of each
  fragment: a restarted learner reads its next sequence number and step from it;
- global versions older than ``window`` versions behind the newest, in every region,
  except the bases of contributions not yet processed (a syncer's anchored merge needs
  them). Learners need no old version: they rejoin from the newest ones;
- with ``orphan_age`` set, data prefixes that no marker names (a writer died between data
  and marker, or lost a race) and that are older than that many seconds.

A learner's checkpoints are pruned by the learner itself (``prune_checkpoints``, its
newest ``keep``). Never deleted: anything a marker still needs, uncommitted data younger
than ``orphan_age`` (it may be a write in flight), the spec. A marker is deleted
before its data, so no reader ever sees a marker whose data is gone on purpose.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from storage_layout.bucket import Bucket
from storage_layout.commit import CorruptVersion, read_marker
from storage_layout.store import RunStore

log = logging.getLogger(__name__)
_DATA_NAME = re.compile(r"^([sv])(\d{12})-([0-9a-f]+)$")


@dataclass
class RetentionReport:
    contributions_deleted: int = 0
    globals_deleted: int = 0
    orphans_deleted: int = 0
    checkpoints_deleted: int = 0
    bytes_freed: int = 0
    pinned: dict[int, list[int]] = field(
        default_factory=dict
    )  # fragment -> versions kept for learners
    problems: list[str] = field(default_factory=list)


def _drop_version(bucket: Bucket, marker_key: str, report: RetentionReport) -> bool:
    try:
        marker = read_marker(bucket, marker_key)
    except (CorruptVersion, FileNotFoundError) as exc:
        report.problems.append(f"kept {marker_key}: {exc}")
        return False
    bucket.delete([marker_key])  # marker first: the version disappears for readers at once
    bucket.delete_prefix(marker.data_prefix)
    report.bytes_freed += marker.size
    return True


def prune_checkpoints(store: RunStore, learner: str, keep: int = 2) -> int:
    """Delete all but ``learner``'s newest ``keep`` checkpoints in its home region (a
    rejoin reads only the newest readable one; the one before is the fallback should
    the newest be corrupt). Returns how many were deleted."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, not {keep}")
    report = RetentionReport()
    steps = store.checkpoint_steps(learner)
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
    for name in bucket.list(data_dir):
        match = _DATA_NAME.match(name)
        if not match:
            continue
        letter, number, write_id = match.groups()
        marker_key = f"{commits_dir}/{letter}{number}.json"
        try:
            if read_marker(bucket, marker_key).write_id == write_id:
                continue  # committed: not an orphan
        except FileNotFoundError:
            pass
        except CorruptVersion as exc:
            report.problems.append(f"kept {data_dir}/{name}: marker unreadable ({exc})")
            continue
        seconds = _age_seconds(bucket, f"{data_dir}/{name}/zarr.json")
        if seconds is not None and seconds >= age:
            bucket.delete_prefix(f"{data_dir}/{name}")
            report.orphans_deleted += 1


def collect_garbage(
    store: RunStore,
    fragments: int | Sequence[int],
    learners: Mapping[str, str],
    window: int,
    orphan_age: float | None = None,
) -> RetentionReport:
    """Apply the retention rules above to ``fragments`` (a count, or the fragments one
    syncer shard owns). ``learners`` maps learner id -> its region."""
    report = RetentionReport()
    layout = store.layout
    for p in range(fragments) if isinstance(fragments, int) else fragments:
        versions = store.global_versions(p)
        if not versions:
            continue
        newest = versions[-1]
        cursor = store.global_marker(p, newest).meta.get("cursor", {})
        pins: set[int] = set()
        for learner, region in learners.items():
            bucket = store.bucket(region)
            seqs = store.contribution_seqs(learner, p, region)
            for seq in seqs:
                key = layout.contribution_marker(learner, p, seq)
                if seq <= int(cursor.get(learner, 0)) and seq != seqs[-1]:
                    report.contributions_deleted += _drop_version(bucket, key, report)
                else:
                    try:
                        pins.add(int(read_marker(bucket, key).meta["base_version"]))
                    except (CorruptVersion, KeyError, FileNotFoundError) as exc:
                        report.problems.append(f"kept {key}: {exc}")
            if orphan_age is not None:
                contrib = layout.contribution_commits(learner, p).rsplit("/", 1)[0]
                _orphans(bucket, f"{contrib}/data", f"{contrib}/commits", orphan_age, report)
        report.pinned[p] = sorted(v for v in pins if v < newest - window)
        keep = {v for v in versions if v >= newest - window} | pins
        for region in store.urls:
            bucket = store.bucket(region)
            for v in store.global_versions(p, region):
                if v not in keep:
                    report.globals_deleted += _drop_version(
                        bucket, layout.global_marker(p, v), report
                    )
            if orphan_age is not None:
                base = layout.global_commits(p).rsplit("/", 1)[0]
                _orphans(bucket, f"{base}/data", f"{base}/commits", orphan_age, report)
    return report
