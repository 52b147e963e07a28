"""What every worker is doing, in one table: the terminal display shows it under the
progress bar and the run's ``workers`` Prefect artifact holds it (updated in place).

One row per learner: its state (its own: starting, compiling, resuming, training,
preempted, done; or the launcher's verdict when it is not counted: lagging, silent, or
fenced, a silent one whose data a syncer gave back), its step and its speed (tokens/s
from its heartbeat's step time). One row per syncer shard: its fragments' newest
versions and how long ago the launcher saw them change ("stalled" once the launcher
named it so: ``Monitor.stalled_syncers``)."""

from __future__ import annotations

import time
from typing import Any

from diloco.liveness import Verdict
from diloco.rate import duration_text
from flows.monitor import Monitor
from protocol.topology import learner_index

COLUMNS = ("worker", "state", "at", "speed", "age")
NOT_COUNTED = ("lagging", "silent")


def worker_rows(monitor: Monitor, statuses: dict[str, dict[str, Any]],
                verdicts: dict[str, Verdict], now: float | None = None) -> list[dict[str, str]]:  # fmt: skip
    """The table's rows (``COLUMNS``, as text): learners in slot order, then the syncer
    shards. ``verdicts``: ``Monitor.verdicts`` of this look (its heartbeats kept)."""
    now = time.monotonic() if now is None else now
    rows = []
    learners = monitor.learners()
    for lid in sorted(learners, key=learner_index):
        status, verdict = statuses.get(lid) or {}, verdicts.get(lid)
        state = str(status.get("state") or "starting")
        if verdict is not None and verdict.state in NOT_COUNTED:
            state = "fenced" if verdict.state == "silent" and monitor.fenced(lid) else verdict.state
        beat = monitor.beats.get(lid)
        speed = ""
        if beat is not None and beat.step_seconds and state == "training":
            speed = f"{monitor.cfg.tokens_per_step / beat.step_seconds:,.0f} tokens/s"
        rows.append({"worker": f"learner {learners[lid]}/{learner_index(lid)}", "state": state,
                     "at": f"step {status.get('step', 0):,}", "speed": speed, "age": ""})  # fmt: skip
    for name, fragments in monitor.syncers().items():
        seen = monitor.publishing.get(name)
        held = seen[0] if seen else tuple(0 for _ in fragments)
        rows.append({
            "worker": name,
            "state": "stalled" if name in monitor.stalled else "publishing",
            "at": " ".join(f"f{p}:v{v}" for p, v in zip(fragments, held, strict=True)),
            "speed": "",
            "age": f"{duration_text(now - seen[1])} ago" if seen else "",
        })  # fmt: skip
    return rows
