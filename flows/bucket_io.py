"""The one adapter between training types and the storage layer.

``storage_layout`` stores named tensors and JSON meta under its commit protocol and
knows nothing of training. This module turns contributions, learner checkpoints
(the inner optimizer state) and global versions (parameters, outer optimizer state,
the version record) into that form and back, and implements the core's ``Store``
(``diloco.transport``) over a run's buckets: the simulator's ``--store`` runs and
the pipeline's learner and syncer processes use this same class.

What it adds to the storage layer is the training-side reading of failures: an
unreadable contribution becomes ``Unreadable`` (the syncer rejects it and goes on), a
corrupt checkpoint falls back to the one before, a corrupt version inside the staleness
window is left out of the syncer's history. It also holds the process's keys
(``storage_layout.auth``): a learner signs its contributions, and a syncer holding the run
secret turns one its learner did not sign into ``Unreadable`` as well.

``BucketStore`` is the run's buckets as one process sees them; what a learner asks of
them is in ``flows.learner_buckets``, what a syncer asks in ``flows.syncer_buckets``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import optax

from diloco.config import OuterConfig
from diloco.units import RegionalLedger, UnitPlan
from flows.learner_buckets import LearnerBuckets
from flows.ledger import region_ledger, region_pools
from flows.syncer_buckets import SyncerBuckets
from flows.unit_offers import UnitOffers
from flows.version_stream import StreamedVersion, reads_ahead
from protocol.topology import learner_region, run_deal, run_slots
from storage_layout.auth import Keys
from storage_layout.chunks import ChunkSpool
from storage_layout.faults import Injector
from storage_layout.store import RunStore
from storage_layout.traffic import Traffic
from storage_layout.versions import PublishReport

log = logging.getLogger(__name__)


class BucketStore(LearnerBuckets, SyncerBuckets):
    """A run's ``Store`` in its regions' buckets (see the module docstring).

    ``learners`` maps learner id -> region; a learner's writes go to its own region
    through a store whose writer is the learner. ``home`` is the region this process
    reads globals from and the syncers publish to first. ``place`` (the trainer's) and
    ``opt_template`` (a freshly initialized inner optimizer state) rebuild checkpoints;
    they are needed only where checkpoints are read. ``keys`` default to the environment's
    (``Keys.from_env``; a learner's own key when ``writer`` is a learner).
    """

    def __init__(
        self,
        run: str,
        regions: Mapping[str, str],
        home: str,
        learners: Mapping[str, str],
        wire_dtype: str,
        writer: str,
        place: Callable[[dict], dict] | None = None,
        opt_template: Callable[[], optax.OptState] | None = None,
        traffic: Traffic | None = None,
        keys: Keys | None = None,
        downlink: str = "full",
        block_size: int = 128,
        syncer_memory_mb: int = 512,
        syncer_spool_mb: int = 2048,
        faults: Injector | None = None,
    ):
        self.run, self.regions, self.home = run, dict(regions), home
        self.faults = faults  # every bucket this store opens meets its faults
        self.syncer_memory_mb = syncer_memory_mb
        # chunks per array the syncer's readers fetch ahead of its merge
        self.ahead = reads_ahead(syncer_memory_mb, len(self.regions), len(learners))
        # contributions' chunks checked by the scan, kept on disk for the merge (made on
        # the first scan: learners never need one); 0 MB: none, the merge fetches again
        self.syncer_spool_mb = syncer_spool_mb
        self._spool: ChunkSpool | None = None
        self.downlink, self.block_size = downlink, block_size
        # fragment -> (version, learners' copy) this process published last: the base of
        # the next version's compact update (read back from home when it is not this one)
        self._published: dict[int, tuple[int, dict[str, np.ndarray]]] = {}
        # (fragment, version) -> the version a merge is streaming out, until published
        self._streams: dict[tuple[int, int], StreamedVersion] = {}
        # (fragment, version) whose learners' copy could not be read as a compact
        # update's base: the next version goes out whole
        self._bad_bases: set[tuple[int, int]] = set()
        # (learner, fragment) -> seq -> the marker of a listed contribution not read yet
        self._heads: dict[tuple[str, int], dict[int, Any]] = {}
        # learner -> (claim, first, end) of the block of seqs this process holds
        self._seqs: dict[str, tuple[int | None, int, int]] = {}
        # learner -> the generation this process claimed as it (``claim_generation``)
        self._generations: dict[str, int] = {}
        # (learner, fragment, seq) held by a revoked marker: no contribution there, ever
        self._revoked: set[tuple[str, int, int]] = set()
        self.learners = dict(learners)
        if keys is None:
            keys = Keys.from_env(run, writer if writer in self.learners else None)
        self.keys = keys
        self.wire_dtype = wire_dtype
        self.place, self.opt_template = place, opt_template
        self.traffic = traffic if traffic is not None else Traffic()
        self.checkpoint_traffic = Traffic()  # not synchronization traffic
        self.main = RunStore(run, regions, home, writer=writer, traffic=self.traffic,
                             claims_key=keys.claims_key, faults=faults)  # fmt: skip
        self._writers: dict[str, RunStore] = {}
        self._checkpoints: dict[str, RunStore] = {}
        self.last_report: PublishReport | None = None

    def writer_for(self, learner: str, checkpoints: bool = False) -> RunStore:
        """The store ``learner`` writes through: its own region, itself as the writer."""
        cache = self._checkpoints if checkpoints else self._writers
        if learner not in cache:
            region = self.region_of(learner)
            traffic = self.checkpoint_traffic if checkpoints else self.traffic
            cache[learner] = RunStore(
                self.run,
                {region: self.regions[region]},
                region,
                writer=learner,
                traffic=traffic,
                claims_key=self.keys.claims_key,
                faults=self.faults,
            )
        return cache[learner]

    def region_store(self, region: str) -> RunStore:
        """A store of ``region``'s bucket alone, this process its writer."""
        return RunStore(self.run, {region: self.regions[region]}, region, writer=self.main.writer,
                        traffic=self.traffic, claims_key=self.keys.claims_key,
                        faults=self.faults)  # fmt: skip

    def region_of(self, learner: str) -> str:
        if learner not in self.learners:
            raise ValueError(f"{learner!r} is not a learner of run {self.run!r}")
        return self.learners[learner]

    def _fragments(self) -> int:
        if not hasattr(self, "_fragment_count"):
            self._fragment_count = len(self.main.read_spec()["fragments"])
        return self._fragment_count

    def _outer(self) -> OuterConfig:
        """The run's outer optimizer config (its state's structure names the stored leaves)."""
        if not hasattr(self, "_outer_cfg"):
            self._outer_cfg = OuterConfig.model_validate(self.main.read_spec()["config"]["outer"])
        return self._outer_cfg

    def ledger(self, plan: UnitPlan) -> RegionalLedger:
        """The data ledger: each region's pool in its own bucket (``flows.ledger``); the
        pool of a region with no member is offered to the others as the syncers do."""
        pools = region_pools(self.main.read_spec())
        offers = UnitOffers(self.region_store, self.learners, plan,
                            logging.getLogger("diloco.syncer"), pools)  # fmt: skip
        return RegionalLedger(
            {r: region_ledger(self.region_store(r), plan, self.learners, r,
                              members=lambda: self.learners, pools=pools)
             for r in pools},
            self.learners, offers.tend,
        )  # fmt: skip

    def add_learner(self, learner: str) -> None:
        """Add ``learner`` beyond the run's slots in its region (``learner_region``), as
        ``diloco join`` does: its member record, signed with its key where this process
        holds one, then its contributions are the run's (``RunStore.members.run_learners``)."""
        spec = self.main.read_spec()
        region = learner_region(learner, run_slots(spec), run_deal(spec))
        self.learners[learner] = region
        record = {"learner": learner, "region": region, "host": "simulator", "time": time.time()}
        if not self.writer_for(learner).members.put_member(
            learner, record, self.keys.signing_key(learner)
        ):
            raise FileExistsError(f"{learner} is added to run {self.run!r} already")

    def close(self, summary: dict[str, Any]) -> None:
        """Record the simulation's summary and the traffic of every writer it drove."""
        self.main.progress.write_metrics("simulator", {"summary": summary})
