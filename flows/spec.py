"""The run spec (``spec.json``, written once to every region): what it holds, how a
config becomes one and back, and how a spec written by older code is read.

The spec holds the model, data, optimizer and topology config, the fragment plan, the
regions and which learner lives where. Operational knobs (``RunConfig.pipeline``) are
not in it; they are flow parameters and may differ between two launches of one run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from diloco.config import ConfigError, RunConfig, validate_config
from diloco.fragments import FragmentPlan
from diloco.run_data import settle_assign
from protocol.topology import home_region, run_slots
from storage_layout.bucket import BucketError
from storage_layout.store import RunStore, spec_home

# Config sections that are not part of a run: how one launch runs it, or how a
# simulation models the machines.
NOT_IN_SPEC = {"sim", "pipeline", "cost"}


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
