"""The workers' table (``flows.worker_table``) from known statuses, verdicts and
heartbeats: each learner's state, step and speed; each syncer shard's versions and age."""

from types import SimpleNamespace

from diloco.liveness import Verdict
from flows.worker_table import COLUMNS, worker_rows


class _Seen(SimpleNamespace):
    """What a launcher's ``Monitor`` has seen (the attributes ``worker_rows`` reads)."""

    def learners(self):
        return {"learner-0": "us", "learner-1": "eu", "learner-2": "us", "learner-3": "eu"}

    def syncers(self):
        return {"syncer us/0": [0, 1], "syncer us/1": [2]}

    def fenced(self, learner):
        return learner == "learner-3"


def test_each_learner_says_its_state_step_and_speed_and_each_syncer_its_versions_and_age():
    seen = _Seen(
        cfg=SimpleNamespace(tokens_per_step=512),
        beats={"learner-0": SimpleNamespace(step_seconds=0.25)},
        publishing={"syncer us/0": ((4, 4), 100.0, {}), "syncer us/1": ((7,), 160.0, {})},
        stalled={"syncer us/0"},
    )
    statuses = {"learner-0": {"state": "training", "step": 1200},
                "learner-1": {"state": "training", "step": 900},
                "learner-2": {"state": "compiling"},
                "learner-3": {"state": "training", "step": 40}}  # fmt: skip
    verdicts = {"learner-0": Verdict("training"),
                "learner-1": Verdict("lagging", "no send for 3 rounds", True),
                "learner-2": Verdict("compiling"),
                "learner-3": Verdict("silent", "no heartbeat for 70 s", True)}  # fmt: skip
    rows = worker_rows(seen, statuses, verdicts, now=175.0)
    assert all(tuple(row) == COLUMNS for row in rows)
    table = {row["worker"]: row for row in rows}
    assert list(table) == ["learner us/0", "learner eu/1", "learner us/2", "learner eu/3",
                           "syncer us/0", "syncer us/1"]  # fmt: skip
    assert table["learner us/0"] == {"worker": "learner us/0", "state": "training",
                                     "at": "step 1,200", "speed": "2,048 tokens/s", "age": ""}  # fmt: skip
    assert table["learner eu/1"]["state"] == "lagging"  # alive, not counted
    assert table["learner us/2"]["state"] == "compiling" and table["learner us/2"]["at"] == "step 0"
    assert table["learner eu/3"]["state"] == "fenced"  # silent, and its data given back
    assert table["syncer us/0"] == {"worker": "syncer us/0", "state": "stalled",
                                    "at": "f0:v4 f1:v4", "speed": "", "age": "1 min 15 s ago"}  # fmt: skip
    assert (
        table["syncer us/1"]["state"] == "publishing" and table["syncer us/1"]["age"] == "15 s ago"
    )
