"""What learner, syncer and launcher processes share: the run spec and what it rebuilds.

The run spec (``spec.json``, written once to every region) is the only thing a process
needs besides its bucket URL: it holds the model, data, optimizer and topology config,
the fragment plan, the regions and which learner lives where. Operational knobs
(``RunConfig.pipeline``) are not in it; they are flow parameters and may differ
between two launches of one run.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import jax
import numpy as np

from diloco import records
from diloco.config import ConfigError, RunConfig, validate_config
from diloco.data import ShardReader
from diloco.dataset import TokenReader
from diloco.fragments import FragmentPlan, plan_fragments
from diloco.inner import InnerTrainer
from diloco.model import ParamCodec
from diloco.simulate import (
    StoreFactory,
    check_data,
    check_same_data,
    data_fingerprint,
    make_reader,
    make_validation,
    settle_assign,
)
from diloco.syncer import FragmentSyncer
from diloco.tensors import pieces
from flows.bucket_io import BucketStore, named_outer_leaves, outer_names
from flows.version_stream import StreamedVersion, slot_names
from protocol.topology import home_region, run_slots
from storage_layout.bucket import BucketError
from storage_layout.commit import CommitConflict
from storage_layout.store import RunStore, spec_home

# Config sections that are not part of a run: how one launch runs it, or how a
# simulation models the machines.
NOT_IN_SPEC = {"sim", "pipeline"}


def share_compilations(folder: str | os.PathLike[str]) -> None:
    """Keep the JAX programs this process and the processes it starts compile in
    ``folder`` (unless ``JAX_COMPILATION_CACHE_DIR`` names a folder already), every one
    however quick its compile (JAX keeps only those over a second by default): a learner
    started again (a restart, a spare that takes over, a joiner back after a preemption)
    loads its train step, sends and applies instead of compiling them, about 6 -> 1.4 s
    of `tiny`'s start on these CPUs and minutes of a large model's on a GPU. Through the
    environment, which child processes inherit, and JAX's settings in this one (JAX,
    imported already, read the environment then)."""
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(folder))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))  # fmt: skip


def user_cache() -> Path:
    """This user's cache folder for diloco (``$XDG_CACHE_HOME/diloco``, by default
    ``~/.cache/diloco``; with no home, the temporary folder's): what a machine keeps
    between runs it joins."""
    if base := os.environ.get("XDG_CACHE_HOME"):
        return Path(base) / "diloco"
    try:
        return Path.home() / ".cache" / "diloco"
    except RuntimeError:  # (no HOME, no entry in the password database)
        return Path(tempfile.gettempdir()) / f"diloco-{os.getuid()}"


COMPILE_LOCK = "diloco-compile.lock"  # in the JAX cache folder: one compiler at a time
COMPILE_WAIT_POLL = 0.1  # seconds between two tries of it (``go_on`` asked between)
COMPILE_WAIT_MAX = 900.0  # seconds waited for it at most (a holder frozen, not dead)


@contextlib.contextmanager
def compile_turn(
    cfg: RunConfig, what: str, go_on: Callable[[], None] = lambda: None
) -> Iterator[None]:
    """Compile a learner's programs (``what``: its model's initialization, its step,
    sends and applies) once per machine, not once per process: learners started
    together (a run's, a node's, a kill storm's spares) each compiled the same programs
    at once, on the same cores. With a JAX cache folder on this machine
    (``share_compilations``), the first to come compiles holding ``COMPILE_LOCK`` and
    then marks those programs of ``cfg`` kept; the others wait for it (``_wait_for``,
    asking ``go_on`` between tries), then load them from the cache side by side
    (measured, 4 processes of `tiny` on 2 cores, cache empty: each warm-up 13 to 16 s at
    once; with the lock around the step 8 to 12 s; around the model's initialization
    too, 4.4 to 7.7 s). A compiler that dies releases the lock (the system does),
    unmarked: the next compiles. The lock is a file's ``flock``: the cache folder must be
    on this machine's own disk."""
    folder = os.environ.get("JAX_COMPILATION_CACHE_DIR", "")
    # Not in a bucket (no lock across machines there), nor for a learner of several
    # processes: they run each program together, so one waiting for another would hang.
    if not folder or "://" in folder or jax.process_count() > 1:
        yield
        return
    of = [cfg.model_dump_json(include={"model", "inner", "data", "topology"}),
          str(cfg.pipeline.fsdp), jax.__version__, repr(jax.devices())]  # fmt: skip
    key = hashlib.sha256("\n".join([what, *of]).encode()).hexdigest()[:16]
    marker = Path(folder) / f"diloco-compiled-{key}"
    if marker.exists():
        yield
        return
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        lock = open(Path(folder) / COMPILE_LOCK, "a")  # noqa: SIM115 (closed by the with below)
    except OSError as exc:  # (JAX, unable to write there either, compiles on)
        print(f"no lock in the JAX cache folder ({exc}); compiling here", flush=True)
        yield
        return
    with lock:
        if not _wait_for(lock, what, go_on):  # (the holder is frozen: compile here)
            yield
            return
        if marker.exists():  # compiled while this one waited: load it beside the others
            fcntl.flock(lock, fcntl.LOCK_UN)
            yield
            return
        try:
            yield
            with contextlib.suppress(OSError):  # (unmarked: the next compiles again)
                marker.touch()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _wait_for(lock: Any, what: str, go_on: Callable[[], None]) -> bool:
    """Take ``compile_turn``'s ``lock`` (an open file), asking ``go_on`` between tries;
    False, not holding it, after ``COMPILE_WAIT_MAX`` seconds."""
    since, said = time.monotonic(), False
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            waited = time.monotonic() - since
            if waited > COMPILE_WAIT_MAX:
                print(f"waited {waited:.0f} s for another process's compile (it holds "
                      f"{lock.name}); compiling here", flush=True)  # fmt: skip
                return False
            if not said:
                print(f"another process of this machine compiles the learner's {what}; "
                      "waiting to load it from the cache", flush=True)  # fmt: skip
                said = True
            go_on()
            time.sleep(COMPILE_WAIT_POLL)


def in_run_order(run: str, regions: Mapping[str, str]) -> dict[str, str]:
    """``regions`` in the order run ``run`` recorded them, where one of them holds its spec:
    its home first, then its deal (a region the spec lacks last). The first region given
    is the home of a new run only: a JSON object's order is not every caller's to keep (a
    launcher run again by a Prefect automation gets its regions sorted by name), and a
    resume must not move the master copies, nor be refused for asking to."""
    for region in regions:
        try:
            spec = RunStore(run, regions, region).read_spec(region)
        except (OSError, BucketError):  # none there (a new run), or a region down
            continue  # (the spec is written to every region)
        order = [spec_home(spec), *spec.get("deal", []), *spec.get("regions", {}), *regions]
        return {r: regions[r] for r in dict.fromkeys(order) if r in regions}
    return dict(regions)


def run_spec(cfg: RunConfig, plan: FragmentPlan, regions: Mapping[str, str]) -> dict[str, Any]:
    """What is fixed for a run's lifetime: the whole config but ``sim`` and ``pipeline``
    (model, data, optimizers, topology, budget, seed), the fragment plan, the regions and
    the order learners are dealt over them, and the home region (the syncers', holding
    the master copies: the stored ``regions`` are a JSON object, whose order readers
    cannot trust)."""
    return {
        "config": cfg.model_dump(mode="json", exclude=NOT_IN_SPEC),
        "fragments": [list(f) for f in plan],
        "regions": dict(regions),
        "home": home_region(regions),
        # learner-i's region, the slots' (topology.run_slots) and the ones joiners add
        "deal": list(regions),
    }


def in_stored_form(spec: dict[str, Any], stored: Mapping[str, Any] | None) -> dict[str, Any]:
    """``spec`` (``run_spec``'s) in the form of the run's ``stored`` spec (None: a new
    run), so that a run started by older code resumes as it was: one that lists its
    slots keeps its list (``run_slots``), and one stored before runs recorded their deal
    keeps adding learners where its slots are (``run_deal``)."""
    if stored is None:
        return spec
    out = dict(spec)
    if "learners" in stored:
        out["learners"] = run_slots(spec)  # (as run_spec wrote them before)
    if "deal" not in stored:
        del out["deal"]
    return out


def spec_defaults(
    regions: Mapping[str, str] | None = None, spec: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """What a spec means by a key it does not name (one written before the key existed):
    the config key's default, as home the first region given (as the syncers always
    took it), and as its data (``data.sha256``) the given ``spec``'s (it was not
    recorded: nothing to hold it to), so such a run resumes under newer code."""
    out: dict[str, Any] = {"config": RunConfig().model_dump(mode="json", exclude=NOT_IN_SPEC)}
    out["config"]["data"]["assign"] = OLD_ASSIGN
    if regions:
        out["home"] = home_region(regions)
    if spec is not None and "data" in spec:
        out["data"] = spec["data"]
    return out


def worker_done(
    store: RunStore, writer: str, region: str | None = None, tokens: int | None = None
) -> bool:
    """Whether ``writer``'s status object says it is done: a learner writes that only
    once its final checkpoint and every contribution before it are committed, and the
    syncers, the launcher and a resumed `diloco train` end on it. Given the run's budget
    (``tokens``), done means done at that budget: a learner that finished before the
    budget was extended trains on."""
    status = store.progress.read_metrics(writer, region) or {}
    if status.get("state") != "done":
        return False
    return tokens is None or int(status.get("budget_tokens", 0)) >= tokens


# Pipeline settings older code recorded that are gone (``pipeline.member_timeout``: the
# run's liveness.* settings, in its spec, took its place).
GONE_PIPELINE_KEYS = ("member_timeout",)


def launched_pipeline(store: RunStore) -> dict[str, Any]:
    """The pipeline settings of the run's newest launch (``RunStore.read_pipeline``),
    without the ones older code recorded that are gone."""
    settings = store.read_pipeline()
    return {k: v for k, v in settings.items() if k not in GONE_PIPELINE_KEYS}


def config_from_spec(
    spec: Mapping[str, Any], pipeline: Mapping[str, Any] | None = None
) -> RunConfig:
    config = dict(spec["config"])
    config["data"] = {"assign": OLD_ASSIGN, **config.get("data", {})}
    return validate_config({**config, "pipeline": dict(pipeline or {})})


# What a spec that names no ``data.assign`` (one written before it existed) took: slots.
# A new spec always names "units" or "slots" (``settle_assign``), never "auto".
OLD_ASSIGN = "slots"


def settled(store: RunStore, cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``data.assign = "auto"`` settled for the run in ``store``
    (``settle_assign``): what its spec records if it has one (read only then)."""
    if cfg.data.assign != "auto":
        return cfg
    try:
        stored = config_from_spec(store.read_spec()).data.assign
    except FileNotFoundError:
        stored = None  # a new run
    return settle_assign(cfg, stored, buckets=True)


@dataclass(frozen=True)
class Model:
    """The compiled model of a run, built once per process."""

    codec: ParamCodec
    init: dict[str, np.ndarray]
    plan: FragmentPlan
    trainer: InnerTrainer

    @property
    def shares(self) -> list[float]:
        """Each fragment's share of the parameters."""
        sizes = self.codec.sizes
        return [sum(sizes[n] for n in names) / self.codec.num_params for names in self.plan]


@lru_cache(maxsize=2)
def _model(cfg_json: str, fsdp: int) -> Model:
    cfg = RunConfig.model_validate_json(cfg_json)
    codec, state = ParamCodec.create(cfg.model, cfg.seed)
    topo = cfg.topology
    plan = plan_fragments(codec.sizes, topo.fragments, topo.fragment_strategy)
    trainer = InnerTrainer(codec, cfg.inner, cfg.steps_per_learner, fsdp=fsdp)
    return Model(codec, codec.to_flat(state), plan, trainer)


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


def corpus(cfg: RunConfig) -> None:
    """Check the run's data (``check_data``): a bad source fails here, named."""
    check_data(cfg)


def reader(cfg: RunConfig, index: int) -> ShardReader | TokenReader:
    return make_reader(cfg, index)


def validation(cfg: RunConfig) -> list[np.ndarray]:
    return make_validation(cfg)


def initialize_run(store: RunStore, cfg: RunConfig) -> dict[str, Any]:
    """Write the spec (or check it against the stored one) and publish version 0 of every
    fragment (the initial parameters) if the run has none yet. Safe to repeat and to race."""
    if cfg.mode == "dp":
        raise ValueError("mode 'dp' is the simulator's baseline; a run is diloco or decoupled")
    cfg = settled(store, cfg)  # the spec records units or slots
    corpus(cfg)  # a missing, empty or binary source, a bad data set: before any commit
    if cfg.pipeline.probe_exclusive:
        for region in store.urls:
            store.bucket(region).probe_exclusive()
    model = build_model(cfg)
    spec = run_spec(cfg, model.plan, store.urls)
    spec["data"] = {"sha256": data_fingerprint(cfg)}  # held to by learners and joiners
    stored = None
    with contextlib.suppress(FileNotFoundError):  # a run started: on its own data only
        stored = store.read_spec()
        check_same_data(cfg, stored, f"run {store.run!r}", spec["data"]["sha256"])
    spec = in_stored_form(spec, stored)
    extend_budget(store, spec)
    spec = store.ensure_spec(spec, spec_defaults(store.urls, spec))
    for p, names in enumerate(model.plan):
        if store.versions.check_home(p) is not None:
            store.versions.sync_regions(p)
            continue
        params = {n: model.init[n] for n in names}
        opt = named_outer_leaves(
            cfg.outer, params, FragmentSyncer(p, params, cfg.outer, [], lambda _: False).opt_leaves
        )
        # Another launcher may have initialized it first: same spec, same seed, same values.
        with contextlib.suppress(CommitConflict):
            publish_initial(store, cfg, p, params, opt)
    return spec


def publish_initial(
    store: RunStore,
    cfg: RunConfig,
    fragment: int,
    params: Mapping[str, np.ndarray],
    opt: Mapping[str, np.ndarray],
) -> None:
    """Version 0 of ``fragment`` (``opt``: the outer optimizer's initial leaves by stored
    name), written a piece at a time through the syncer's ``StreamedVersion``: each chunk
    is encoded, hashed and uploaded as it is made, never the whole version's objects at
    once, the same objects a syncer's merge writes. An optimizer keeping more than one
    state array per parameter (which a streamed version does not store) is published
    whole (``RunStore.versions.publish_global``). ``CommitConflict`` if version 0 is there."""
    topo, record = cfg.topology, records.initial_version(fragment, 0.0)
    shapes = {n: tuple(np.shape(v)) for n, v in params.items()}
    slots = len(opt) // max(1, len(params))
    if slots > 1:
        store.versions.publish_global(fragment, 0, params, opt, record, topo.global_dtype)
        return
    names = slot_names(outer_names(cfg.outer, shapes), shapes, slots)
    sink = StreamedVersion(store, fragment, 0, shapes, names, topo.global_dtype, "full",
                           topo.block_size)  # fmt: skip
    try:
        for name, a, b in pieces(shapes, topo.block_size):
            values = np.asarray(params[name], np.float32).reshape(-1)[a:b]
            state = [np.asarray(opt[s[name]], np.float32).reshape(-1)[a:b] for s in names]
            sink.write(name, a, values, state)
        sink.finish()
    except BaseException:
        sink.abort()
        raise
    sink.commit(record)


def extend_budget(store: RunStore, spec: dict[str, Any]) -> None:
    """A stored run given a larger token budget than its own gets it (``extend_budget``),
    once the rest of ``spec`` is checked against the stored spec; a smaller one is
    refused: the learners may have trained more than it already."""
    budgets = []
    for region in store.urls:  # each region's: an extension may have reached only some
        with contextlib.suppress(FileNotFoundError):  # (a new run: written as given)
            budgets.append(int(store.read_spec(region)["config"]["budget"]["tokens"]))
    want = int(spec["config"]["budget"]["tokens"])
    if budgets and want < max(budgets):
        raise ConfigError(
            f"run {store.run!r} has a budget of {max(budgets):,} tokens; budget.tokens "
            f"{want:,} would cut it (a budget can be extended, never cut: give --tokens "
            f"{max(budgets)} or more, or leave --tokens out to resume with the run's own)"
        )
    if budgets and want > min(budgets):
        store.ensure_spec(spec, spec_defaults(spec=spec), any_budget=True)  # the rest first
        store.extend_budget(want, min(budgets))


def bucket_store(
    run: str,
    regions: Mapping[str, str],
    spec: Mapping[str, Any],
    cfg: RunConfig,
    writer: str,
    home: str | None = None,
    model: Model | None = None,
    learners: Mapping[str, str] | None = None,
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
        opt_template=lambda: jax.eval_shape(trainer.tx.init, model.init),
        downlink=cfg.topology.downlink, block_size=cfg.topology.block_size,
        syncer_memory_mb=cfg.pipeline.syncer_memory_mb,
        syncer_spool_mb=cfg.pipeline.syncer_spool_mb,
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
