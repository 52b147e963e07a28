import json

import pytest

from diloco.config import PRESETS, ConfigError, RunConfig, load_config, parse_override


def test_presets_load_and_tiny_is_default():
    for name in PRESETS:
        load_config(name)
    assert load_config().model.width == PRESETS["tiny"]["model"]["width"]


def test_file_then_overrides_then_keywords(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('mode = "diloco"\n[outer]\nlr = 0.3\nmerge = "rda"\n')
    cfg = load_config(
        "tiny", file=path, overrides=["outer.lr=0.5", "sim.speeds=[1, 2, 1, 1]"], seed=7
    )
    assert (cfg.mode, cfg.outer.lr, cfg.outer.merge, cfg.seed) == ("diloco", 0.5, "rda", 7)
    assert cfg.pipeline.speeds == (1.0, 2.0, 1.0, 1.0)  # sim.speeds is its old name
    assert cfg.quorum == cfg.topology.learners  # synchronous DiLoCo waits for all


def test_json_file(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"topology": {"learners": 2, "quorum": 1}}))
    cfg = load_config("tiny", file=path)
    assert cfg.quorum == 1


@pytest.mark.parametrize(
    "override,message",
    [
        ("outer.lr=-1", "config field 'outer.lr': Input should be greater than 0"),
        ("topology.quantization=int3", "config field 'topology.quantization'"),
        ("outer.lrr=1", "config field 'outer.lrr': Extra inputs are not permitted"),
        ("model.heads=5", "width 64 is not divisible by heads 5"),
        ("topology.quorum=9", "topology.quorum 9 exceeds learners 4"),
        ("sim.speeds=[1,2]", "pipeline.speeds has 2 entries for 4 learners"),
        ("pipeline.speeds=[1,2,3]", "pipeline.speeds has 3 entries for 4 learners"),
        ("pipeline.speeds=[1,0,1,1]", "config field 'pipeline.speeds.1': Input should be greater"),
        ("pipeline.speeds=[1,1,-2,1]", "config field 'pipeline.speeds.2': Input should be greater"),
        (
            'sim.failures=[{"learner": 7, "at": 0.1, "duration": 0.1}]',
            "sim.failures: learner 7 is not there at 0.1",
        ),
        ("mode=fast", "config field 'mode'"),
        ("pipeline.learners_started=5", "pipeline.learners_started 5 exceeds the 4 learner slots"),
        ("pipeline.learners_started=0", "config field 'pipeline.learners_started'"),
    ],
)
def test_bad_values_name_the_field(override, message):
    with pytest.raises(ConfigError) as info:
        load_config("tiny", overrides=[override])
    assert message in str(info.value)


def test_malformed_file_and_bad_override(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("outer = [\n")
    with pytest.raises(ConfigError, match=r"bad\.toml is malformed"):
        load_config("tiny", file=path)
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config("tiny", file=tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="not of the form"):
        parse_override("outer.lr")
    with pytest.raises(ConfigError, match="unknown preset"):
        load_config("huge")


def test_speeds_drive_both_clocks_and_sim_speeds_is_their_old_name():
    """One field: the simulator's step times and the pipeline's emulated slow chips."""
    cfg = load_config("tiny", overrides=["pipeline.speeds=[1, 1, 3, 3]"])
    assert cfg.speeds == (1.0, 1.0, 3.0, 3.0)
    assert [cfg.slowdown(i) for i in range(4)] == [1.0, 1.0, 3.0, 3.0]
    assert load_config("tiny").speeds == (1.0,) * 4
    old = load_config("tiny", overrides=["sim.speeds=[1, 1, 3, 3]"])
    assert old == cfg
    # A dump with the old field still loads; both names with one value are fine.
    raw = cfg.model_dump(mode="json")
    raw["sim"]["speeds"] = [1, 1, 3, 3]
    assert RunConfig.model_validate(raw) == cfg
    with pytest.raises(ConfigError, match=r"sim\.speeds .* and pipeline\.speeds .* disagree"):
        load_config("tiny", overrides=["sim.speeds=[1,1,2,2]", "pipeline.speeds=[1,1,3,3]"])


def test_train_set_reaches_pipeline_speeds():
    from flows.cli import build_parser, config_from_args

    args = build_parser().parse_args(["train", "--set", "pipeline.speeds=[1,1,3,3]"])
    assert config_from_args(args).speeds == (1.0, 1.0, 3.0, 3.0)


def test_learners_started_leaves_the_last_slots_to_joiners_and_needs_a_shared_budget():
    ids = ["learner-3", "learner-0", "learner-10", "learner-2"]
    cfg = load_config("tiny", overrides=["pipeline.learners_started=2"])
    assert cfg.started_learners(ids) == ["learner-0", "learner-2"]
    assert load_config("tiny").started_learners(ids) == ids  # default: every slot
    with pytest.raises(ConfigError, match="needs a shared budget"):
        load_config("tiny", overrides=["pipeline.learners_started=2", "budget.shared=false"])
