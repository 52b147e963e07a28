"""The run's workers, described once: who they are, where they run, what they are given.

A worker is a learner slot or a syncer shard. Its description (``Worker``) holds its name
as the launcher shows it, its region, the status object it writes, the fragments a syncer
shard owns, the processes a learner spans, and its parameters: the keyword arguments of
its flow (``flows.learner.learner_flow``, ``flows.syncer.syncer_flow``), which are also
the flags of its process (``python -m flows.worker ROLE --KEY VALUE ...``) and the
parameters of its deployment (``learner/REGION``, ``syncer/REGION`` in prefect.yaml).
Every launch mode takes its commands or deployment calls from here (``run_workers``),
and a joiner takes its slot's (``learner``), so what a worker is told is written once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from diloco.config import RunConfig
from flows.spares import WORKER_COMMAND
from protocol.topology import (
    home_region,
    learner_id,
    learner_index,
    run_slots,
    shard_count,
    shard_fragments,
    syncer_id,
)

Status = tuple[str, str, list[int]]  # (status writer, its region, fragments a syncer owns)


@dataclass(frozen=True)
class Worker:
    role: str  # "learner" or "syncer"
    name: str  # as the launcher names it: "learner us-east/2", "syncer us-east/0"
    region: str  # where it runs (a syncer shard: its home)
    writer: str  # the status object it writes: "learner-2", "syncer-0"
    params: dict[str, Any]  # its flow's keyword arguments
    owned: list[int] = field(default_factory=list)  # a syncer shard's fragments
    processes: int = 1  # a learner over several processes (pipeline.learner_processes)
    port: int | None = None  # their coordinator's port (None: picked when started)

    @property
    def status(self) -> Status:
        return self.writer, self.region, self.owned

    @property
    def deployment(self) -> str:
        return f"{self.role}/{self.region}"

    def tags(self, run: str) -> list[str]:
        what = "syncer" if self.role == "syncer" else f"learner:{self.params['index']}"
        return [f"run:{run}", f"region:{self.region}", what]

    def argv(self) -> list[str]:
        """Its process's command line: the worker entry point with its parameters as
        flags (JSON for a mapping); over several processes, ``flows.hosts`` starting
        them together."""
        argv = [*WORKER_COMMAND, self.role]
        for key, value in self.params.items():
            argv += [f"--{key}", json.dumps(value) if isinstance(value, Mapping) else str(value)]
        if self.processes > 1:  # one learner, N processes, started and restarted together
            where = ["--port", str(self.port)] if self.port else []
            argv = [WORKER_COMMAND[0], "-m", "flows.hosts", "--processes", str(self.processes),
                    *where, "--", *argv]  # fmt: skip
        return argv


def learner(
    run: str, bucket: str, region: str, index: int, cfg: RunConfig,
    pipeline: Mapping[str, Any] | None = None,
) -> Worker:  # fmt: skip
    """Learner slot ``index`` of ``run`` in ``region`` (its bucket ``bucket``);
    ``pipeline``: the settings it is given (the run's, ``cfg.pipeline``, by default)."""
    opts = cfg.pipeline
    port = opts.learner_coordinator_port
    return Worker(
        "learner", f"learner {region}/{index}", region, learner_id(index),
        {"run": run, "bucket": bucket, "region": region, "index": index,
         "pipeline": dict(opts.model_dump() if pipeline is None else pipeline)},
        processes=opts.learner_processes, port=port + index if port else None,
    )  # fmt: skip


def syncer(run: str, regions: dict[str, str], shard: int, cfg: RunConfig) -> Worker:
    """Syncer shard ``shard`` of ``run``, homed in the first region."""
    home = home_region(regions)
    shards = shard_count(cfg.pipeline.syncer_shards, cfg.topology.fragments)
    return Worker(
        "syncer", f"syncer {home}/{shard}", home, syncer_id(shard),
        {"run": run, "regions": regions, "home": home, "shard": shard, "shards": shards,
         "pipeline": cfg.pipeline.model_dump()},
        owned=shard_fragments(shard, shards, cfg.topology.fragments),
    )  # fmt: skip


def run_workers(
    run: str, regions: dict[str, str], cfg: RunConfig, spec: Mapping[str, Any]
) -> list[Worker]:
    """The workers ``diloco train`` starts: every syncer shard, then the learner slots it
    starts itself (``pipeline.learners_started``; the others are left to joiners)."""
    shards = shard_count(cfg.pipeline.syncer_shards, cfg.topology.fragments)
    out = [syncer(run, regions, shard, cfg) for shard in range(shards)]
    slots = run_slots(spec)
    for lid in cfg.started_learners(list(slots)):
        region = slots[lid]
        out.append(learner(run, regions[region], region, learner_index(lid), cfg))
    return out
