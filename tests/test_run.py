"""The run object: made once per process, from the config (``Run.start``) or from the
spec in a bucket (``Run.open``), and the same run either way."""

from __future__ import annotations

import pytest

from diloco.config import load_config
from flows import Run
from protocol.topology import run_slots


@pytest.fixture
def regions(tmp_path):
    out = {r: f"file://{tmp_path / r}" for r in ("us-east", "eu-west")}
    for r in out:
        (tmp_path / r).mkdir()
    return out


def test_a_started_run_is_the_run_every_process_opens(regions):
    """``Run.start`` writes the spec and version 0 and settles what the config left open
    (``data.assign = auto``); a learner opening the run from its own region's bucket, and
    a syncer from the home, read the same config, spec, model and data from it."""
    cfg = load_config("tiny", overrides=["topology.learners=2", "pipeline.round_steps=7"])
    assert cfg.data.assign == "auto"
    started = Run.start("r", regions, cfg)
    assert started.cfg.data.assign == "units"  # a run through buckets takes units
    assert started.spec["home"] == started.region == "us-east"
    assert started.cfg.pipeline.round_steps == 7  # this launch's settings kept
    store = started.store("test")
    assert all(store.versions.latest_global(p) == 0 for p in range(len(started.spec["fragments"])))

    pipeline = cfg.pipeline.model_dump(mode="json")
    lid, region = next((k, v) for k, v in run_slots(started.spec).items() if v == "eu-west")
    learner = Run.open("r", {region: regions[region]}, region, pipeline, learner=True)
    syncer = Run.open("r", regions, "us-east", pipeline)
    for opened in (learner, syncer):
        assert opened.cfg == started.cfg
        assert opened.spec["fragments"] == started.spec["fragments"]
        assert opened.model.plan == started.model.plan
        assert opened.data.fingerprint == started.data.fingerprint == started.spec["data"]["sha256"]
    assert learner.store(lid).client_region == "eu-west"


def test_a_run_started_again_is_resumed_as_it_was_whatever_its_regions_order(regions):
    """The same name started again (a resumed launcher, regions sorted by a Prefect
    automation) gets the run as stored: its home first, its spec and version 0 unchanged;
    a larger budget extends it, and a run that does not exist is named when opened."""
    cfg = load_config("tiny", overrides=["topology.learners=2"])
    first = Run.start("r", regions, cfg)
    again = Run.start("r", dict(reversed(regions.items())), cfg)
    assert list(again.regions) == list(first.regions) == ["us-east", "eu-west"]
    assert again.spec == first.spec
    more = cfg.model_copy(update={"budget": cfg.budget.model_copy(update={"tokens": 10**9})})
    extended = Run.start("r", regions, more)
    assert extended.cfg.budget.tokens == 10**9
    assert Run.open("r", regions).cfg.budget.tokens == 10**9
    with pytest.raises(FileNotFoundError, match="no run 'other'"):
        Run.open("other", regions)
