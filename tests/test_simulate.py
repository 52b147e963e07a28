"""The simulator end to end on the tiny preset (each run takes seconds)."""

import json
import re
import subprocess
import sys

import pytest

from diloco import records
from diloco.config import load_config
from diloco.simulate import simulate, time_to_loss
from protocol.topology import member_quorum

SHORT = ["budget.tokens=64000", "sim.eval_points=2"]


@pytest.fixture(scope="module")
def runs():
    return {
        mode: simulate(load_config("tiny", mode=mode, overrides=SHORT))
        for mode in ("dp", "diloco", "decoupled")
    }


@pytest.mark.parametrize("mode", ["dp", "diloco", "decoupled"])
def test_loss_falls_and_reports_the_same_way(runs, mode):
    s = runs[mode].summary
    assert s["final_loss"] < s["initial_loss"] - 1.0
    assert s["tokens"] >= 64000
    assert 0 < s["goodput"] <= 1
    evals = runs[mode].evals
    assert evals[0]["tokens"] == 0 and evals[-1]["final"]


def test_bandwidth_saving_against_dp(runs):
    assert runs["dp"].summary["bandwidth_ratio_vs_dp"] == pytest.approx(1.0)
    d = runs["diloco"].summary
    assert d["bytes_total"] * 5 < d["dp_bytes"]
    assert d["versions"] > 0 and d["rejected"] == 0


@pytest.mark.parametrize("mode", ["dp", "diloco", "decoupled"])
def test_same_seed_same_metrics_bit_for_bit(runs, mode):
    again = simulate(load_config("tiny", mode=mode, overrides=SHORT))
    assert json.dumps(again.metrics, sort_keys=True) == json.dumps(
        runs[mode].metrics, sort_keys=True
    )
    other = simulate(load_config("tiny", mode=mode, overrides=SHORT, seed=1))
    assert other.summary["final_loss"] != runs[mode].summary["final_loss"]


def test_slow_learners_stall_diloco_but_not_decoupled():
    over = [*SHORT, "sim.speeds=[1,1,2,3]"]
    sync = simulate(load_config("tiny", mode="diloco", overrides=over)).summary
    result = simulate(load_config("tiny", mode="decoupled", overrides=over))
    dec = result.summary
    # The slowest learner sends its last contributions alone, below the quorum (K = 2):
    # the end of the run merges them anyway, so none of its work is left behind.
    sent: dict[tuple[str, int], int] = {}
    for r in records.of(result.metrics, "sent"):
        sent[r["learner"], r["fragment"]] = r["seq"]
    final = {r["fragment"]: r for r in records.of(result.metrics, "version")}
    for (learner, p), seq in sent.items():
        assert final[p]["cursor"][learner] == seq, (learner, p)
    # Synchronous DiLoCo holds every learner to the pace of the slowest. Decoupled
    # learners never wait, and they share the budget: the fast ones train more of it than
    # the slow ones, none sits idle at the end, and the run ends far sooner.
    last: dict[str, int] = {}
    lr: dict[str, float] = {}
    for r in records.of(result.metrics, "sent"):
        last[r["learner"]] = max(last.get(r["learner"], 0), r["step"])
        lr[r["learner"]] = r["lr"]
    assert min(last["learner-0"], last["learner-1"]) > 2 * last["learner-3"]
    # Their inner rates follow the run's progress, not each one's own step: the slowest
    # ends the run as far down the decay as the fastest (on its own step it would still
    # be near the peak, and its last contributions would undo the others' annealing).
    peak = load_config("tiny").inner.lr
    assert lr["learner-3"] < 1.5 * lr["learner-0"] < 0.5 * peak
    cfg = load_config("tiny", mode="decoupled", overrides=over)
    assert 0.9 * cfg.budget_steps <= sum(last.values()) <= 1.1 * cfg.budget_steps
    assert max(dec["learner_seconds"].values()) * 1.5 < max(sync["learner_seconds"].values())
    assert dec["goodput"] > sync["goodput"]
    assert dec["final_loss"] < dec["initial_loss"] - 1.0


def test_failure_and_rejoin():
    over = [
        "budget.tokens=160000",
        "sim.eval_points=2",
        "topology.tau=1",
        'sim.failures=[{"learner": 1, "at": 0.25, "duration": 0.5}]',
        "pipeline.checkpoint_every=7",
    ]
    result = simulate(load_config("tiny", mode="decoupled", overrides=over))
    events = [m for m in result.metrics if m["event"] in ("failure", "rejoin")]
    assert [e["event"] for e in events] == ["failure", "rejoin"]
    # Only what was neither checkpointed nor sent is lost.
    assert 0 <= events[1]["lost_steps"] < 7
    # The learner came back and its work reached the model again after the rejoin.
    later = [m for m in result.metrics if m["event"] == "version" and m["time"] > events[1]["time"]]
    assert any("learner-1/" in key for m in later for key in m["weights"])
    assert result.summary["final_loss"] < result.summary["initial_loss"] - 1.0
    dp = simulate(load_config("tiny", mode="dp", overrides=over)).summary
    assert result.summary["goodput"] > dp["goodput"]  # one failure stops all of dp


def test_a_preemption_with_notice_loses_no_step():
    """A learner preempted with notice (``"notice": true``) sends what it trained and
    checkpoints before it goes, through the loop the pipeline runs: its rejoin loses no
    step, and each fragment's last send before it went was made at the failure's step."""
    over = [
        "budget.tokens=160000",
        "sim.eval_points=2",
        "topology.tau=1",
        'sim.failures=[{"learner": 1, "at": 0.25, "duration": 0.5, "notice": true}]',
        "pipeline.checkpoint_every=1000",  # no checkpoint would save it otherwise
    ]
    result = simulate(load_config("tiny", mode="decoupled", overrides=over))
    failure, rejoin = (m for m in result.metrics if m["event"] in ("failure", "rejoin"))
    assert failure["notice"] and rejoin["lost_steps"] == 0
    before = [m for m in result.metrics if m["event"] == "sent" and m["learner"] == "learner-1"
              and m["time"] <= failure["time"]]  # fmt: skip
    last = {m["fragment"]: m["step"] for m in before}
    assert last and set(last.values()) == {failure["step"]}
    assert len(last) == load_config("tiny").topology.fragments


def test_the_quorum_follows_the_members_while_a_learner_is_down():
    """Synchronous DiLoCo (K = M): while learner 1 is down the other three are the
    members, so their versions go on without it (it used to hold every merge until it
    came back); once it rejoins, its contributions are merged again. (Decoupled mode:
    ``test_learners_join_vacant_slots_and_leave_and_the_quorum_follows``.)"""
    mode = "diloco"
    over = [
        "budget.tokens=160000",
        "sim.eval_points=2",
        "topology.tau=1",
        "topology.quorum=4",
        'sim.failures=[{"learner": 1, "at": 0.2, "duration": 0.5}]',
    ]
    result = simulate(load_config("tiny", mode=mode, overrides=over))
    failure, rejoin = (m for m in result.metrics if m["event"] in ("failure", "rejoin"))
    versions = [m for m in result.metrics if m["event"] == "version"]
    down = [v for v in versions if failure["time"] < v["time"] < rejoin["time"]]
    assert len(down) >= 2 * load_config("tiny").topology.fragments, len(down)
    assert not any(k.startswith("learner-1/") for v in down[1:] for k in v["weights"])
    # Each version records the members it merged under, and their quorum.
    assert {(tuple(v["members"]), v["quorum"]) for v in down[1:]} == {
        (("learner-0", "learner-2", "learner-3"), 3)
    }
    after = [v for v in versions if v["time"] > rejoin["time"]]
    assert any(k.startswith("learner-1/") for v in after for k in v["weights"])
    assert after[-1]["members"] == [f"learner-{i}" for i in range(4)] and after[-1]["quorum"] == 4


def test_learners_join_vacant_slots_and_leave_and_the_quorum_follows():
    """Slot 3 starts vacant (``pipeline.learners_started=3``) and a learner joins it at
    0.2; learner 1 is preempted for good at 0.3 and its slot joined again at 0.5;
    learner 2 leaves at 0.6 with no notice and no one takes its slot. Each version merges
    under the members of its moment and the quorum their count gives (three quarters of
    them, rounded down), a joiner goes on from its slot's data position (no step trained
    twice), and the run ends once the budget is spent with a slot vacant."""
    over = [
        "budget.tokens=160000",
        "sim.eval_points=2",
        "topology.tau=1",
        "topology.quorum_share=0.75",
        "pipeline.learners_started=3",
        'sim.joins=[{"learner": 3, "at": 0.2}, {"learner": 1, "at": 0.5}]',
        'sim.failures=[{"learner": 1, "at": 0.3, "notice": true}, {"learner": 2, "at": 0.6}]',
    ]
    result = simulate(load_config("tiny", mode="decoupled", overrides=over))
    changes = [m for m in result.metrics if m["event"] in ("failure", "join", "rejoin")]
    assert [(m["event"], m["learner"]) for m in changes] == [
        ("join", "learner-3"), ("failure", "learner-1"), ("join", "learner-1"),
        ("failure", "learner-2"),
    ]  # fmt: skip
    join3, leave1, join1, leave2 = changes
    versions = [m for m in result.metrics if m["event"] == "version"]

    def between(a, b):
        return [v for v in versions if a < v["time"] < b][1:]  # the first may straddle

    def merged(vs):
        return {k.split("/")[0] for v in vs for k in v["weights"]}

    members = {tuple(v["members"]) for v in between(0, join3["time"])}
    assert members == {("learner-0", "learner-1", "learner-2")}
    assert {v["quorum"] for v in between(0, join3["time"])} == {2}  # 3 x 0.75
    four = [v for v in versions if len(v["members"]) == 4]  # after a join, before a leave
    assert four and {v["quorum"] for v in four} == {3}
    assert "learner-3" not in merged(between(0, join3["time"]))
    gone = between(leave1["time"], join1["time"])
    assert {tuple(v["members"]) for v in gone} == {("learner-0", "learner-2", "learner-3")}
    assert {"learner-1", "learner-3"} <= merged(between(join1["time"], leave2["time"]))
    # Preempted, learner 1 sent what it had trained as it went (merged after it left);
    # the joiner of its slot goes on from there: nothing lost, no step trained twice.
    sends = [m for m in result.metrics if m["event"] == "sent" and m["learner"] == "learner-1"]
    assert max(m["step"] for m in sends if m["time"] <= leave1["time"]) == leave1["step"]
    assert not [m for m in sends if leave1["time"] < m["time"] < join1["time"]]
    assert join1["step"] == leave1["step"]
    assert min(m["step"] for m in sends if m["time"] > join1["time"]) > leave1["step"]
    # Learner 2's slot stayed vacant; the run ended with the budget spent all the same.
    assert versions[-1]["members"] == ["learner-0", "learner-1", "learner-3"]
    assert versions[-1]["quorum"] == 2
    assert result.summary["tokens"] >= 160000
    # A slot's vacant time is no one's learner time (goodput's denominator).
    seconds = result.summary["learner_seconds"]
    assert seconds["learner-3"] < seconds["learner-0"] - join3["time"] / 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (['sim.joins=[{"learner": 1, "at": 0.2}]'], "slot 1 is not vacant at 0.2 (held)"),
        (['sim.failures=[{"learner": 1, "at": 0.2, "duration": 0.5}]',
          'sim.joins=[{"learner": 1, "at": 0.3}]'], "not vacant at 0.3 (down, to come back)"),
        (['sim.failures=[{"learner": 1, "at": 0.2}]', "budget.shared=false"],
         "learner 1 leaves for good"),
        (['sim.failures=[{"learner": 1, "at": 0.2}, {"learner": 1, "at": 0.4}]'],
         "learner 1 is not there at 0.4"),
        (["topology.quorum_share=0.5", "topology.quorum=2"], "not both"),
        (['sim.joins=[{"learner": 4, "at": 0.2}]', "data.assign=slots"],
         "learner 4 is beyond the run's 4 slots: learners are added only to a run that takes "
         "its data in units"),
        (['sim.joins=[{"learner": 5, "at": 0.2}]', "data.assign=units"],
         "slot 5 is not vacant at 0.2 (beyond the slots; the next one added is 4)"),
        (['sim.joins=[{"learner": 4, "at": 0.2}]', "data.assign=units",
          'sim.failures=[{"learner": 4, "at": 0.1}]'], "learner 4 is not there at 0.1"),
    ],
)  # fmt: skip
def test_a_membership_schedule_that_cannot_happen_is_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config("tiny", mode="decoupled", overrides=overrides)


def test_a_join_beyond_the_slots_of_a_run_on_text_is_refused_when_its_data_is_settled():
    """``data.assign = "auto"`` (the default) is settled with the data: text is dealt to
    slots, so a learner added beyond them is refused by name before the simulation."""
    cfg = load_config("tiny", mode="decoupled", overrides=['sim.joins=[{"learner": 4, "at": 0.2}]'])
    assert cfg.data.assign == "auto"
    with pytest.raises(ValueError, match=re.escape("learner 4 is beyond the run's 4 slots")):
        simulate(cfg)


def test_a_quorum_share_follows_the_members_down_to_its_floor():
    assert [member_quorum(9, n, 0.5, 2) for n in range(6)] == [1, 1, 2, 2, 2, 2]
    assert [member_quorum(9, n, 0.75) for n in (1, 3, 4, 8)] == [1, 2, 3, 6]
    assert [member_quorum(2, n) for n in (1, 2, 5)] == [1, 2, 2]  # the fixed K, capped
    assert load_config("tiny", overrides=["topology.quorum_share=0.5"]).quorum_over(3) == 1


def test_time_to_loss_interpolates():
    evals = [{"time": 0.0, "loss": 5.0}, {"time": 10.0, "loss": 3.0}, {"time": 20.0, "loss": 2.0}]
    assert time_to_loss(evals, 4.0) == pytest.approx(5.0)
    assert time_to_loss(evals, 2.5) == pytest.approx(15.0)
    assert time_to_loss(evals, 1.0) == float("inf")


def test_cli_writes_metrics_and_summary(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "flows.cli", "simulate", "--preset", "tiny", "--quiet",
           "--tokens", "32000", "--set", "sim.eval_points=2", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "validation loss" in proc.stdout and "bandwidth saving vs dp" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "decoupled"
    assert json.loads((out / "config.json").read_text())["budget"]["tokens"] == 32000  # --tokens
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(x["event"] == "version" for x in lines)
    bad = subprocess.run(
        [*cmd[:-2], "--set", "outer.lr=0"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "config field 'outer.lr'" in bad.stderr
