"""A run, built once per process: ``Run``, made by ``Run.open`` (a run that exists, from
its spec) or ``Run.start`` (the launcher's: the spec written or checked, version 0
published), and handed to whatever the process runs, none of which rebuilds a part of it:
the settled config and spec, the regions in the run's order, the model (factory,
parameter codec, fragment plan), the data (``diloco.run_data``) and the run's buckets.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

import jax
import numpy as np

from diloco.config import RunConfig
from diloco.fragments import FragmentPlan, plan_fragments
from diloco.inner import InnerTrainer
from diloco.model import ParamCodec
from diloco.run_data import RunData
from diloco.simulate import StoreFactory
from flows.bucket_io import BucketStore
from flows.compile import compile_turn
from flows.spec import (
    config_from_spec,
    extend_budget,
    in_run_order,
    in_stored_form,
    run_spec,
    settled,
    spec_defaults,
)
from flows.state_io import outer_names
from flows.version_stream import publish_initial
from protocol.topology import home_region, run_slots
from storage_layout.commit import CommitConflict
from storage_layout.faults import Injector
from storage_layout.store import RunStore


@dataclass(frozen=True)
class Model:
    """The compiled model of a run, built once per process."""

    codec: ParamCodec
    plan: FragmentPlan
    trainer: InnerTrainer
    cfg: RunConfig

    @cached_property
    def init(self) -> dict[str, np.ndarray]:
        """The run's initial parameters (its seed's), drawn when first asked for: only
        the launcher's version 0 needs their values (every other process reads its
        parameters from the buckets)."""
        return self.codec.to_flat(ParamCodec.create(self.cfg.model, self.cfg.seed)[1])

    @property
    def shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Each parameter's shape and dtype, by name."""
        codec = self.codec
        return {n: jax.ShapeDtypeStruct(s, d)
                for n, s, d in zip(codec.names, codec.shapes, codec.dtypes, strict=True)}  # fmt: skip

    @property
    def shares(self) -> list[float]:
        """Each fragment's share of the parameters."""
        sizes = self.codec.sizes
        return [sum(sizes[n] for n in names) / self.codec.num_params for names in self.plan]


@lru_cache(maxsize=2)
def _model(cfg_json: str, fsdp: int) -> Model:
    cfg = RunConfig.model_validate_json(cfg_json)
    codec = ParamCodec.abstract(cfg.model)
    topo = cfg.topology
    plan = plan_fragments(codec.sizes, topo.fragments, topo.fragment_strategy)
    trainer = InnerTrainer(codec, cfg.inner, cfg.steps_per_learner, fsdp=fsdp)
    return Model(codec, plan, trainer, cfg)


_BUILDING = threading.Lock()


def build_model(
    cfg: RunConfig, learner: bool = False, go_on: Callable[[], None] = lambda: None
) -> Model:
    """The model of ``cfg``, built once per process (a spare's warm-up thread and the
    worker it becomes share it: the second caller waits for the first). A ``learner``'s
    trainer is sharded over its devices as ``pipeline.fsdp`` says, and its initialization
    compiled once per machine (``compile_turn``, which asks ``go_on`` while it waits);
    everyone else (the launcher, syncers, tools) keeps parameters whole, whatever devices
    it has."""
    with _BUILDING:
        # Neither the launch settings nor the simulated events change the model (and a
        # join into a slot vacant by pipeline.learners_started is valid only with it).
        run = cfg.model_copy(update={"pipeline": type(cfg.pipeline)(), "sim": type(cfg.sim)()})
        fsdp = cfg.pipeline.fsdp if learner else 1  # the mesh is operational
        with compile_turn(cfg, "model", go_on) if learner else contextlib.nullcontext():
            return _model(run.model_dump_json(), fsdp)


@dataclass(frozen=True, eq=False)
class Run:
    """One run as this process sees it. ``regions`` in the run's order (its home first);
    ``region``, the one this process reads and writes (the launcher's and the syncers':
    the home; a learner's: its own); ``spec`` as stored; ``cfg``, the spec's config with
    this launch's pipeline settings (``data.assign`` settled); ``learner``: the model is
    a learner's, sharded over its devices and compiled once per machine; ``faults``: the
    injector every bucket it opens is given (``storage_layout.faults``: the process's,
    read once where it starts)."""

    name: str
    regions: dict[str, str]
    region: str
    spec: dict[str, Any]
    cfg: RunConfig
    learner: bool = False
    faults: Injector | None = None  # the storage faults its buckets meet (tests, chaos)

    @classmethod
    def open(
        cls,
        name: str,
        regions: Mapping[str, str],
        region: str | None = None,
        pipeline: Mapping[str, Any] | None = None,
        learner: bool = False,
        faults: Injector | None = None,
    ) -> Run:
        """The run ``name`` as its spec in ``region`` (default: the first of ``regions``)
        records it, with ``pipeline`` (this launch's settings) over the defaults.
        ``FileNotFoundError`` if the bucket holds no such run."""
        region = region or home_region(regions)
        spec = RunStore(name, regions, region, faults=faults).read_spec()
        cfg = config_from_spec(spec, pipeline)
        return cls(name, dict(regions), region, spec, cfg, learner, faults)

    @classmethod
    def start(cls, name: str, regions: Mapping[str, str], cfg: RunConfig,
              faults: Injector | None = None) -> Run:  # fmt: skip
        """Start or resume ``name`` with ``cfg`` (``initialize_run``): a new run's spec
        and version 0 are written; a stored run's are checked against ``cfg`` (its budget
        extended if ``cfg``'s is larger). ``regions`` are put in the run's order; the
        config is the spec's with ``cfg``'s pipeline settings, as ``Run.open`` reads it, and
        its prices (``cost``)."""
        regions = in_run_order(name, regions)
        home = home_region(regions)
        spec = initialize_run(RunStore(name, regions, home, writer="launcher", faults=faults), cfg)
        launch = {"cost": cfg.cost}  # (priced by this launch's table: not in the spec)
        cfg = config_from_spec(spec, cfg.pipeline.model_dump(mode="json")).model_copy(update=launch)
        return cls(name, regions, home, spec, cfg, faults=faults)

    @cached_property
    def data(self) -> RunData:
        return RunData(self.cfg)

    @cached_property
    def model(self) -> Model:
        return build_model(self.cfg, self.learner)

    def store(self, writer: str, region: str | None = None, **options: Any) -> RunStore:
        """The run's buckets as ``writer`` reads and writes them from ``region`` (default:
        this process's); ``options``: ``RunStore``'s."""
        return RunStore(self.name, self.regions, region or self.region, writer=writer,
                        faults=self.faults, **options)  # fmt: skip

    def bucket_store(self, writer: str, learners: Mapping[str, str] | None = None) -> BucketStore:
        """The run as the loops' store, for ``writer`` in this process's region
        (``bucket_store``)."""
        return bucket_store(self.name, self.regions, self.spec, self.cfg, writer, self.region,
                            self.model, learners, self.faults)  # fmt: skip


def initialize_run(store: RunStore, cfg: RunConfig) -> dict[str, Any]:
    """Write the spec (or check it against the stored one) and publish version 0 of every
    fragment (the initial parameters) if the run has none yet. Safe to repeat and to race."""
    if cfg.mode == "dp":
        raise ValueError("mode 'dp' is the simulator's baseline; a run is diloco or decoupled")
    cfg = settled(store, cfg)  # the spec records units or slots
    data = RunData(cfg)
    data.check()  # a missing, empty or binary source, a bad data set: before any commit
    if cfg.pipeline.probe_exclusive:
        for region in store.urls:
            store.bucket(region).probe_exclusive()
    model = build_model(cfg)
    spec = run_spec(cfg, model.plan, store.urls)
    spec["data"] = {"sha256": data.fingerprint}  # held to by learners and joiners
    stored = None
    with contextlib.suppress(FileNotFoundError):  # a run started: on its own data only
        stored = store.read_spec()
        data.check_same(stored, f"run {store.run!r}")
    spec = in_stored_form(spec, stored)
    extend_budget(store, spec)
    spec = store.ensure_spec(spec, spec_defaults(store.urls, spec))
    for p, names in enumerate(model.plan):
        if store.versions.check_home(p) is not None:
            store.versions.sync_regions(p)
            continue
        params = {n: model.init[n] for n in names}
        # Another launcher may have initialized it first: same spec, same seed, same values.
        with contextlib.suppress(CommitConflict):
            shapes = {n: np.shape(v) for n, v in params.items()}
            publish_initial(store, p, params, outer_names(cfg.outer, shapes), cfg.topology)
    return spec


def bucket_store(
    run: str,
    regions: Mapping[str, str],
    spec: Mapping[str, Any],
    cfg: RunConfig,
    writer: str,
    home: str | None = None,
    model: Model | None = None,
    learners: Mapping[str, str] | None = None,
    faults: Injector | None = None,
) -> BucketStore:
    """The run's store as ``writer`` sees it from ``home`` (default: the syncers'); a
    learner passes its ``model``, whose trainer places what it reads on its mesh.
    ``learners``: the run's learners as read (``RunStore.members.run_learners``; the spec's by
    default)."""
    model = model or build_model(cfg)
    trainer = model.trainer
    learners = run_slots(spec) if learners is None else learners
    return BucketStore(
        run, regions, home or home_region(regions), learners, cfg.topology.global_dtype,
        writer, place=trainer.place_params,
        # The state's structure, shapes and dtypes only: no computation on the mesh (one
        # process of a learner over several reads a checkpoint alone) and no memory.
        opt_template=lambda: jax.eval_shape(trainer.tx.init, model.shapes),
        downlink=cfg.topology.downlink, block_size=cfg.topology.block_size,
        syncer_memory_mb=cfg.pipeline.syncer_memory_mb,
        syncer_spool_mb=cfg.pipeline.syncer_spool_mb, faults=faults,
    )  # fmt: skip


def simulation_store(run: str, regions: Mapping[str, str]) -> StoreFactory:
    """`diloco simulate --store`: the simulation goes through these buckets. A simulation
    always starts from step 0, so a run that holds versions already is refused (committed
    versions are never overwritten)."""

    def make(cfg: RunConfig, plan: FragmentPlan, init: Any, ids: Sequence[str]) -> BucketStore:
        store = RunStore(run, regions, home_region(regions), writer="syncer")
        spec = store.ensure_spec(run_spec(cfg, plan, regions), spec_defaults(regions))
        if any(store.versions.latest_global(p) is not None for p in range(len(plan))):
            raise FileExistsError(
                f"run {run!r} in {regions[home_region(regions)]} already holds global versions "
                "from an earlier simulation; pass another --run name or remove that run"
            )
        initialize_run(store, cfg)
        return bucket_store(run, regions, spec, cfg, writer="syncer")

    return make
