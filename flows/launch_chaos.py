"""What a launch does to its own run on purpose (``pipeline.faults``, ``pipeline.chaos``):
the storage fault plan its workers get, the process chaos driver over its worker
processes, and the report of both at the end (what a learner kill cost)."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

from diloco.config import RunConfig
from flows.monitor import Monitor
from flows.supervision import LaunchMode
from infra.chaos import Chaos, ChaosPlan, kill_to_rejoin, percentiles, read_actions
from storage_layout import faults
from storage_layout.store import RunStore


def worker_faults(cfg: RunConfig, folder: Path, log: Any) -> faults.FaultPlan | None:
    """The storage fault plan the run's workers get (``pipeline.faults``), checked before
    the run starts: one ``t0`` for all (a restarted worker keeps the outage window) and a
    shared fault log, ``folder/faults.jsonl``. The launcher itself stays fault-free."""
    if not cfg.pipeline.faults:
        return None
    data = {"log_path": str(folder / "faults.jsonl"), **cfg.pipeline.faults, "t0": time.time()}
    plan = faults.FaultPlan.from_dict(data, source="pipeline.faults")
    log.warning("the workers run with injected storage faults: %s", plan.to_json())
    return plan


def start_chaos(plan: ChaosPlan, folder: Path, mode: LaunchMode, log: Any,
                monitor: Monitor | None = None) -> Chaos | None:  # fmt: skip
    """The process chaos driver over the launch's live worker processes (``mode.live``),
    if ``plan`` acts; its actions at shares of the run follow the learners' status
    objects (``monitor``)."""
    if not plan.active:
        return None
    if not mode.local:
        log.warning("pipeline.chaos needs the workers as local processes; no chaos")
        return None

    def progress() -> tuple[float, set[str]]:
        assert monitor is not None
        statuses, cap = monitor.statuses(), monitor.cfg.learner_step_cap
        steps = sum(min(int(s.get("step", 0)), cap) for s in statuses.values())
        training = {lid for lid, s in statuses.items() if s.get("state") == "training"}
        return steps / monitor.cfg.budget_steps, training

    log.warning("chaos on: %s; its actions go to %s", plan.model_dump(), folder / "chaos.jsonl")
    return Chaos(plan, mode.live, folder / "chaos.jsonl", log,
                 progress if monitor else None).start()  # fmt: skip


def failure_report(store: RunStore, spec: dict, folder: Path,
                   missed: list[str] | None = None) -> dict[str, Any]:  # fmt: skip
    """What was done to the run on purpose (chaos actions and injected storage faults,
    by kind), the chaos actions at shares of the run that were ``missed`` (it ended
    first), and what a learner kill cost: the seconds to its next contribution."""
    actions = read_actions(folder / "chaos.jsonl")
    injected = read_actions(folder / "faults.jsonl")
    kills = [a for a in actions if a["action"] == "kill_learner"]
    for fault in injected:  # a learner's own death during an upload or checkpoint write
        parts = fault["key"].split("/")
        if fault["kind"] == "crash" and "learners" in parts:
            kills.append({"time": fault["time"], "worker": parts[parts.index("learners") + 1]})
    return {
        "actions": dict(Counter(a["action"] for a in actions)),
        "missed": list(missed or []),
        "faults": dict(Counter(f["kind"] for f in injected)),
        "kill_to_rejoin": percentiles(kill_to_rejoin(store, spec, kills)),
    }
