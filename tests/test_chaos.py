"""The process chaos driver (``infra/chaos.py``) against real processes: actions at shares
of the run's progress wait for a worker they may take, and what the run ended before is
named. Driven look by look (no clock): what it does follows what the run reports."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from infra.chaos import Chaos, ChaosPlan, read_actions


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]


def _becomes(pid: int, stopped: bool) -> bool:
    """Whether ``pid`` becomes stopped (or running again): a signal lands a moment later."""
    deadline = time.monotonic() + 60  # a guard against a hang, not a measure
    while time.monotonic() < deadline:
        if (_state(pid) == "T") == stopped:
            return True
        time.sleep(0.01)
    return False


@pytest.fixture
def workers():
    procs = {name: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
             for name in ("learner-0", "learner-1", "syncer-0")}  # fmt: skip
    yield procs
    for proc in procs.values():
        proc.kill()
        proc.wait()


def test_actions_at_shares_of_the_run_wait_for_a_training_learner(workers, tmp_path):
    run = {"share": 0.0, "training": set()}
    plan = ChaosPlan(learner_kill_at=[0.2], syncer_kill_at=[0.5], pause_at=[0.3],
                     pause_seconds=600)  # fmt: skip
    live = {n: p.pid for n, p in workers.items()}
    chaos = Chaos(plan, lambda: {n: pid for n, pid in live.items() if workers[n].poll() is None},
                  tmp_path / "chaos.jsonl", progress=lambda: (run["share"], run["training"]))  # fmt: skip
    run["share"] = 0.25
    chaos._act_on_progress()  # the kill's share is reached, but no learner trains yet
    assert chaos.done == {} and chaos.missed == ["kill_learner at 20%", "pause_learner at 30%",
                                                 "kill_syncer at 50%"]  # fmt: skip
    run["training"] = {"learner-1"}
    chaos._act_on_progress()
    assert workers["learner-1"].wait(timeout=60) == -signal.SIGKILL
    assert workers["learner-0"].poll() is None and chaos.done == {"kill_learner": 1}
    run["share"] = 0.2  # a restarted learner set the steps back: what was reached stays
    chaos._act_on_progress()
    run["share"] = 0.6  # the pause waits for a live learner that trains; the syncer is killed
    chaos._act_on_progress()
    assert workers["syncer-0"].wait(timeout=60) == -signal.SIGKILL
    assert chaos.missed == ["pause_learner at 30%"]
    run["training"] = {"learner-0", "learner-1"}
    chaos._act_on_progress()
    assert _becomes(workers["learner-0"].pid, stopped=True) and chaos.missed == []
    assert chaos.stop() == {"kill_learner": 1, "kill_syncer": 1, "pause_learner": 1,
                            "resume_learner": 1}  # fmt: skip
    assert _becomes(workers["learner-0"].pid, stopped=False)  # or it would never exit
    logged = [(a["action"], a["worker"]) for a in read_actions(tmp_path / "chaos.jsonl")]
    assert logged == [("kill_learner", "learner-1"), ("kill_syncer", "syncer-0"),
                      ("pause_learner", "learner-0"), ("resume_learner", "learner-0")]  # fmt: skip


def test_an_action_the_run_ended_before_is_named(workers, tmp_path, caplog):
    plan = ChaosPlan(learner_kill_at=[0.9])
    chaos = Chaos(plan, lambda: {n: p.pid for n, p in workers.items()}, tmp_path / "c.jsonl",
                  progress=lambda: (0.5, {"learner-0"}))  # fmt: skip
    chaos._act_on_progress()
    with caplog.at_level("WARNING"):
        assert chaos.stop() == {}
    assert chaos.missed == ["kill_learner at 90%"]
    assert "kill_learner at 90% never happened (the run reached 50%)" in caplog.text
    assert all(p.poll() is None for p in workers.values())


def test_a_chaos_plan_names_what_is_wrong(tmp_path):
    with pytest.raises(ValidationError, match=r"(?s)learner_kill_at.*in \[0, 1\), not \[1.5\]"):
        ChaosPlan(learner_kill_at=[0.2, 1.5])
    with pytest.raises(ValidationError, match="pause_at"):
        ChaosPlan(pause_at=["soon"])
    with pytest.raises(ValueError, match="need its progress"):
        Chaos(ChaosPlan(syncer_kill_at=[0.5]), dict, tmp_path / "c.jsonl")
    assert (
        ChaosPlan(pause_at=[0.5, 0.1]).pause_at == (0.1, 0.5) and ChaosPlan(pause_at=[0.1]).active
    )
