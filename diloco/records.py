"""The one record of what happened in a run.

Every record is a flat JSON object with an ``event`` and a ``time`` (seconds on the
run's clock: simulated seconds in the simulator, Unix time in the pipeline). The same
builders feed the simulator's ``metrics.jsonl``, the meta of each global version's
commit marker in the buckets (a ``version`` record), the flows' logs and artifacts, and
the launcher's summary; goodput and payload traffic are computed from them by one
function each.

    sent      learner, fragment, seq, base_version, anchor_seq, step, tokens, steps,
              seconds, bytes, loss
    applied   learner, fragment, version, staleness, weight, bytes
    version   fragment, version, ids {version: id} (this one's and those inside the
              staleness window: ``version_id``), consumed [[learner, seq]], cursor,
              weights, staleness, tokens, seconds, merged, tokens_total, seconds_total,
              rejected [[learner, seq, reason]], superseded [[learner, seq, by seq]],
              and lost_versions [v] when it replaces versions that cannot be read
    rejected  learner, fragment, seq, reason
    failure   learner, step
    rejoin    learner, step, lost_steps, resumed_from
    eval      tokens, loss, final
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

Record = dict[str, Any]

EVENTS = ("sent", "applied", "version", "rejected", "failure", "rejoin", "eval")


def sent(c: Any, time: float, loss: float | None = None, lr: float | None = None) -> Record:
    """A contribution left the learner (``c`` is a ``diloco.outer.Contribution``; ``lr``
    the inner rate it trains at now)."""
    return {
        "event": "sent", "time": time, "learner": c.learner, "fragment": c.fragment,
        "seq": c.seq, "base_version": c.base_version, "anchor_seq": c.anchor_seq,
        "step": c.step, "tokens": c.tokens,
        "steps": c.steps, "seconds": c.seconds, "bytes": c.nbytes, "loss": loss, "lr": lr,
    }  # fmt: skip


def applied(
    learner: str,
    fragment: int,
    version: int,
    staleness: int,
    weight: float,
    nbytes: int,
    time: float,
) -> Record:
    """A learner took global ``version`` of ``fragment`` (``weight``: its own share in it)."""
    return {
        "event": "applied", "time": time, "learner": learner, "fragment": fragment,
        "version": version, "staleness": staleness, "weight": weight, "bytes": nbytes,
    }  # fmt: skip


def version(
    gv: Any,
    time: float,
    before: Mapping[str, Any] | None = None,
    members: Collection[str] = (),
    quorum: int | None = None,
) -> Record:
    """A global version (``gv`` is a ``diloco.syncer.GlobalVersion``); ``before`` is the
    previous version's record, whose running totals this one carries on. Stored as the
    meta of the version's commit marker: a restarted syncer reads its cursor and merge
    counters back from it, and the newest version alone tells the work merged so far.
    ``members`` and ``quorum``: the learners the syncer counted as members when it
    published, and the quorum it merged under (``RunConfig.quorum_over``)."""
    before = before or {}
    return {
        "members": sorted(members),
        "quorum": quorum,
        "event": "version",
        "time": time,
        "fragment": gv.fragment,
        "version": gv.version,
        "ids": {str(v): i for v, i in gv.ids.items()},
        "window_tokens": {str(v): t for v, t in gv.window_tokens.items()},
        "consumed": [list(k) for k in gv.consumed],
        "cursor": dict(gv.cursor),
        "weights": dict(gv.weights),
        "staleness": dict(gv.staleness),
        "tokens": gv.tokens,
        "seconds": gv.seconds,
        "merged": dict(gv.merged),
        "progress": dict(gv.progress),
        "outer_steps": gv.steps,
        "tokens_total": int(before.get("tokens_total", 0)) + gv.tokens,
        "seconds_total": float(before.get("seconds_total", 0.0)) + gv.seconds,
        "rejected": [list(r) for r in gv.rejected],
        "superseded": [list(s) for s in gv.superseded],
    }


def version_id(fragment: int, version: int, consumed: Iterable[Sequence[Any]]) -> str:
    """The name of global ``version`` of ``fragment``, which merged ``consumed`` ((learner,
    seq) pairs). A learner learns it only by reading the version's record, as it applies
    the version, and sends it back with every contribution made on it
    (``Contribution.base_id``): the syncer merges no outer gradient measured from
    parameters that were never a global version (a fresh or re-initialised learner's own
    initialisation, a state restored from elsewhere)."""
    text = json.dumps([fragment, version, sorted([str(w), int(s)] for w, s in consumed)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def ids_of(record: Mapping[str, Any]) -> dict[int, str]:
    """A version record's ``ids``, checked ({} for a record stored before they existed:
    contributions made on those versions are merged unchecked)."""
    return _by_version(record, "ids", lambda i: isinstance(i, str))


def window_tokens_of(record: Mapping[str, Any]) -> dict[int, int]:
    """A version record's ``window_tokens`` (the tokens each version inside the staleness
    window merged), checked ({} for a record stored before they existed: the work merged
    after a contribution's base is then not known, and counts as none)."""
    return _by_version(record, "window_tokens", lambda t: type(t) is int and t >= 0)


def _by_version(record: Mapping[str, Any], key: str, valid: Callable[[Any], bool]) -> dict:
    """A version record's map ``key`` from version numbers to values ``valid`` accepts."""
    window = record.get(key) or {}
    if not isinstance(window, Mapping) or not all(
        str(v).isdigit() and valid(x) for v, x in window.items()
    ):
        raise ValueError(f"version record of fragment {record.get('fragment')}: {key} {window!r}")
    return {int(v): x for v, x in window.items()}


def initial_version(fragment: int, time: float) -> Record:
    """Version 0 of a fragment: the initial parameters, nothing merged."""
    return {
        "ids": {"0": version_id(fragment, 0, [])},
        "event": "version", "time": time, "fragment": fragment, "version": 0, "consumed": [],
        "cursor": {}, "weights": {}, "staleness": {}, "tokens": 0, "seconds": 0.0, "merged": {},
        "progress": {}, "outer_steps": 0, "tokens_total": 0, "seconds_total": 0.0, "rejected": [],
        "superseded": [],
    }  # fmt: skip


def rejected(learner: str, fragment: int, seq: int, reason: str, time: float) -> Record:
    return {
        "event": "rejected", "time": time, "learner": learner, "fragment": fragment,
        "seq": seq, "reason": reason,
    }  # fmt: skip


def failure(learner: str, step: int, time: float, notice: bool = False) -> Record:
    """A learner went down at ``step``; with ``notice`` (preempted) after sending what it
    had trained (``LearnerLoop.send_pending``) and checkpointing."""
    return {"event": "failure", "time": time, "learner": learner, "step": step, "notice": notice}


def rejoin(learner: str, step: int, lost_steps: int, resumed_from: str, time: float) -> Record:
    return {
        "event": "rejoin", "time": time, "learner": learner, "step": step,
        "lost_steps": lost_steps, "resumed_from": resumed_from,
    }  # fmt: skip


def joined(learner: str, step: int, resumed_from: str, time: float) -> Record:
    """A learner took vacant slot ``learner`` (``diloco join``; ``sim.joins``)."""
    return {
        "event": "join", "time": time, "learner": learner, "step": step,
        "resumed_from": resumed_from,
    }  # fmt: skip


def evaluation(tokens: int, loss: float, time: float, final: bool = False) -> Record:
    return {"event": "eval", "time": time, "tokens": tokens, "loss": loss, "final": final}


def of(records: Iterable[Record], event: str) -> list[Record]:
    return [r for r in records if r["event"] == event]


def useful_seconds(
    versions: Iterable[Mapping[str, Any]], shares: Sequence[float], since: float = float("-inf")
) -> float:
    """Learner time whose work reached the global model: each version's merged seconds
    (new work only), weighted by its fragment's share of the parameters (a fragment's
    contribution carries that share of the learner's compute)."""
    return sum(
        shares[int(v["fragment"])] * float(v.get("seconds", 0.0))
        for v in versions
        if v.get("event", "version") == "version" and float(v.get("time", 0.0)) >= since
    )


def goodput(
    versions: Iterable[Mapping[str, Any]],
    shares: Sequence[float],
    allocated_seconds: float,
    since: float = float("-inf"),
) -> float:
    """Useful learner time / allocated learner time (0 when nothing was allocated)."""
    if allocated_seconds <= 0:
        return 0.0
    return useful_seconds(versions, shares, since) / allocated_seconds


def payload_traffic(records: Iterable[Mapping[str, Any]]) -> tuple[int, int]:
    """(bytes up, bytes down) of the learners' payloads: contributions sent and global
    fragments applied."""
    up = down = 0
    for r in records:
        if r["event"] == "sent":
            up += int(r["bytes"])
        elif r["event"] == "applied":
            down += int(r["bytes"])
    return up, down
