"""A run's history, from the buckets alone: what each learner did round by round, and
what each global version merged.

- **Rounds**: every learner adds one write-once object per round to its own prefix in
  its own region (``learners/{learner}/history/s{ROUND}.json``, ``RunStore.progress.put_round``):
  its table row (loss, tokens, tokens/s, staleness, merge weight, bytes, seconds, time,
  generation). Round numbers follow the learner's inner step, so they are stable across
  restarts; a round redone after a restart keeps its first row.
- **Versions**: each global version's commit marker holds its ``version`` record
  (``diloco/records.py``: consumed contributions, weights, staleness, rejections,
  tokens and seconds merged, running totals). Retention deletes old versions (what it
  deleted is in the ledger); the newest ``RunConfig.kept_versions`` stay.

Both readers skip what they cannot read and say so; both can resume after what a caller
already holds (``after``), so a watcher reads only what is new.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from protocol.topology import run_slots
from storage_layout.commit import CorruptVersion, patiently
from storage_layout.store import RunStore

log = logging.getLogger(__name__)


@dataclass
class History:
    """Rows read from the buckets: per learner its rounds, per fragment its versions,
    each in order, and the objects skipped (``key: why``)."""

    rounds: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    versions: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    damaged: list[str] = field(default_factory=list)


def learner_rounds(
    store: RunStore,
    learners: Mapping[str, str] | None = None,
    after: Mapping[str, int] | None = None,
) -> History:
    """Every learner's round rows, in round order. ``learners`` maps learner id -> region
    (default: the run spec's); ``after`` maps a learner to the last round already held
    (only newer ones are read). A row that cannot be read is skipped, logged and named
    in ``damaged``; an unreachable region is named there too."""
    learners = learners if learners is not None else run_slots(store.read_spec())
    out = History()
    for learner, region in learners.items():
        try:
            rounds = [r for r in store.progress.history_rounds(learner, region)
                      if r > (after or {}).get(learner, 0)]  # fmt: skip
            rows, problems = store.progress.get_rounds(learner, rounds, region)
        except OSError as exc:
            rows, problems = [], [f"{learner} in {region}: {exc}"]
        out.rounds[learner] = rows
        out.damaged += problems
    for problem in out.damaged:
        log.warning("history: skipped %s", problem)
    return out


def global_versions(
    store: RunStore, fragments: int | None = None, after: Mapping[int, int] | None = None
) -> History:
    """Every fragment's version records (the meta of its commit markers, in the store's
    own region), in version order: those still held, newer than ``after[p]``."""
    if fragments is None:
        fragments = len(store.read_spec()["fragments"])
    out = History()
    for p in range(fragments):
        rows = []
        try:
            versions = [
                v for v in store.versions.global_versions(p) if v > (after or {}).get(p, -1)
            ]
        except OSError as exc:
            out.damaged.append(f"fragment {p}: {exc}")
            versions = []
        for v in versions:
            try:
                marker = patiently(
                    lambda p=p, v=v: store.versions.global_marker(p, v), f"f{p} v{v}"
                )
                rows.append(dict(marker.meta))
            except FileNotFoundError:
                continue  # deleted by retention since the listing
            except (OSError, CorruptVersion) as exc:
                out.damaged.append(f"{store.layout.global_marker(p, v)}: {exc}")
        out.versions[p] = rows
    for problem in out.damaged:
        log.warning("history: skipped %s", problem)
    return out


def read_history(store: RunStore) -> History:
    """The whole run's history: every learner's rounds and every fragment's versions."""
    spec = store.read_spec()
    rounds = learner_rounds(store, store.members.run_learners(spec).regions)  # with those added
    versions = global_versions(store, len(spec["fragments"]))
    return History(rounds.rounds, versions.versions, rounds.damaged + versions.damaged)
