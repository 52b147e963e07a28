"""The simulator's transport through buckets: every contribution and global version is
committed to, and read back (verified) from, object storage.

Learners are dealt to regions round-robin; each learner writes to its own region and
reads globals there; the syncer lives in the first region and publishes to all.
Because the Zarr round trip is bit-exact, a run gives the same numbers as in process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from diloco.config import RunConfig
from diloco.fragments import FragmentPlan
from diloco.outer import Contribution, FlatParams
from diloco.simulate import TransportFactory
from diloco.syncer import GlobalVersion
from storage_layout.bucket import Traffic
from storage_layout.store import RunStore


def run_spec(
    cfg: RunConfig, plan: FragmentPlan, regions: Mapping[str, str], learners: Mapping[str, str]
) -> dict:
    """What is fixed for a run's lifetime: model, fragments, hyperparameters, topology."""
    return {
        "config": cfg.model_dump(mode="json", exclude={"sim", "seed", "pipeline"}),
        "fragments": [list(f) for f in plan],
        "regions": dict(regions),
        "learners": dict(learners),
    }


def version_meta(gv: GlobalVersion) -> dict[str, Any]:
    """What a global version's marker records besides its tensors (docs/storage-layout.md)."""
    return {
        "consumed": [list(k) for k in gv.consumed],
        "cursor": gv.cursor,
        "weights": gv.weights,
        "staleness": gv.staleness,
        "tokens": gv.tokens,
        "seconds": gv.seconds,
        "merged": gv.merged,
    }


class StorageTransport:
    def __init__(
        self,
        run: str,
        regions: Mapping[str, str],
        cfg: RunConfig,
        plan: FragmentPlan,
        ids: Sequence[str],
    ):
        names = list(regions)
        self.region_of = {lid: names[i % len(names)] for i, lid in enumerate(ids)}
        self.traffic = Traffic()
        self.syncer = RunStore(run, regions, names[0], writer="syncer", traffic=self.traffic)
        self.learners = {
            lid: RunStore(run, regions, self.region_of[lid], writer=lid, traffic=self.traffic)
            for lid in ids
        }
        self.wire_dtype = cfg.topology.global_dtype
        self.syncer.ensure_spec(run_spec(cfg, plan, regions, self.region_of))
        if any(self.syncer.latest_global(p) is not None for p in range(len(plan))):
            # A simulation always starts from step 0; committed versions are never overwritten.
            raise FileExistsError(
                f"run {run!r} in {regions[names[0]]} already holds global versions from an "
                "earlier simulation; pass another --run name or remove that run"
            )

    def send(self, c: Contribution) -> None:
        self.learners[c.learner].put_contribution(c)

    def receive(self, c: Contribution) -> Contribution:
        return self.syncer.get_contribution(c.learner, c.fragment, c.seq, self.region_of[c.learner])

    def publish(self, gv: GlobalVersion, opt_leaves: list[np.ndarray]) -> None:
        meta = version_meta(gv)
        self.syncer.publish_global(
            gv.fragment, gv.version, gv.params, opt_leaves, meta, self.wire_dtype
        )

    def fetch(self, learner: str, fragment: int, version: int) -> FlatParams:
        return self.learners[learner].get_global(fragment, version, learner_view=True).params

    def close(self, summary: dict[str, Any]) -> None:
        self.syncer.write_metrics("simulator", {"summary": summary})


def storage_transport(run: str, regions: Mapping[str, str]) -> TransportFactory:
    return lambda cfg, plan, ids: StorageTransport(run, regions, cfg, plan, ids)
