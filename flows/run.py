"""What learner, syncer and launcher processes share: the run spec and what it rebuilds.

The run spec (``spec.json``, written once to every region) is the only thing a process
needs besides its bucket URL: it holds the model, data, optimizer and topology config,
the fragment plan, the regions and which learner lives where. Operational knobs
(``RunConfig.pipeline``) are not in it; they are flow parameters and may differ
between two launches of one run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from diloco.config import RunConfig, validate_config
from diloco.data import Corpus, ShardReader, validation_batches
from diloco.fragments import FragmentPlan, plan_fragments
from diloco.inner import InnerTrainer
from diloco.model import ParamCodec
from diloco.simulate import cached_corpus
from flows.sim_transport import run_spec
from storage_layout.commit import CommitConflict
from storage_layout.store import RunStore


def learner_ids(count: int) -> list[str]:
    return [f"learner-{i}" for i in range(count)]


def deal_learners(count: int, regions: Mapping[str, str]) -> dict[str, str]:
    """Learner id -> region, round-robin over the regions in the order given."""
    names = list(regions)
    return {lid: names[i % len(names)] for i, lid in enumerate(learner_ids(count))}


def train_spec(cfg: RunConfig, regions: Mapping[str, str]) -> dict[str, Any]:
    if cfg.mode == "dp":
        raise ValueError("mode 'dp' is the simulator's baseline; train runs diloco or decoupled")
    codec, _ = ParamCodec.create(cfg.model, cfg.seed)
    topo = cfg.topology
    plan = plan_fragments(codec.sizes, topo.fragments, topo.fragment_strategy)
    spec = run_spec(cfg, plan, regions, deal_learners(topo.learners, regions))
    spec["train"] = {
        "seed": cfg.seed,
        "total_tokens": cfg.sim.total_tokens,
        "steps_per_learner": cfg.steps_per_learner,
    }
    return spec


def config_from_spec(
    spec: Mapping[str, Any], pipeline: Mapping[str, Any] | None = None
) -> RunConfig:
    train = spec.get("train")
    if not train:
        raise ValueError("this run was written by `diloco simulate`, not `diloco train`")
    raw = {
        **spec["config"],
        "seed": train["seed"],
        "sim": {"total_tokens": train["total_tokens"]},
        "pipeline": dict(pipeline or {}),
    }
    return validate_config(raw)


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
def _model(cfg_json: str) -> Model:
    cfg = RunConfig.model_validate_json(cfg_json)
    codec, state = ParamCodec.create(cfg.model, cfg.seed)
    topo = cfg.topology
    plan = plan_fragments(codec.sizes, topo.fragments, topo.fragment_strategy)
    trainer = InnerTrainer(codec, cfg.inner, cfg.steps_per_learner)
    return Model(codec, codec.to_flat(state), plan, trainer)


def build_model(cfg: RunConfig) -> Model:
    return _model(cfg.model_copy(update={"pipeline": type(cfg.pipeline)()}).model_dump_json())


def corpus(cfg: RunConfig) -> Corpus:
    return cached_corpus(cfg.data.source, cfg.topology.learners, cfg.data.val_percent)


def reader(cfg: RunConfig, index: int) -> ShardReader:
    data = corpus(cfg)
    return ShardReader(
        data.train_shards[index], cfg.data.batch_size, cfg.model.context, cfg.seed, index
    )


def validation(cfg: RunConfig) -> list[np.ndarray]:
    return validation_batches(
        corpus(cfg), cfg.data.batch_size, cfg.model.context, cfg.data.eval_batches, cfg.seed
    )


def initialize_run(store: RunStore, cfg: RunConfig) -> dict[str, Any]:
    """Write the spec (or check it against the stored one) and publish version 0 of every
    fragment (the initial parameters) if the run has none yet. Safe to repeat and to race."""
    spec = store.ensure_spec(train_spec(cfg, store.urls))
    model = build_model(cfg)
    for p, names in enumerate(model.plan):
        if store.latest_global(p) is not None:
            store.sync_regions(p)
            continue
        opt = _initial_opt_leaves(cfg, {n: model.init[n] for n in names})
        meta = {
            "consumed": [],
            "cursor": {},
            "weights": {},
            "staleness": {},
            "tokens": 0,
            "seconds": 0.0,
            "merged": {},
        }
        # Another launcher may have initialized it first: same spec, same seed, same values.
        with contextlib.suppress(CommitConflict):
            params = {n: model.init[n] for n in names}
            store.publish_global(p, 0, params, opt, meta, cfg.topology.global_dtype)
    return spec


def _initial_opt_leaves(cfg: RunConfig, params: dict[str, np.ndarray]) -> list[np.ndarray]:
    from diloco.syncer import FragmentSyncer

    return FragmentSyncer(0, params, cfg.outer, [], lambda _: False).opt_leaves
