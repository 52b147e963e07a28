"""The liveness rule (``diloco.liveness``): a slow learner is not a dead one, and being
alive is not taking part. Known answers on synthetic heartbeats and a fake clock, then
the heartbeat's own object (``storage_layout.heartbeat``) and thread
(``flows.heartbeat``) against a real bucket."""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass

import pytest

from diloco.config import ConfigError, LivenessConfig, load_config
from diloco.liveness import Liveness, glance, lag_after, silence_after
from flows.heartbeat import Heartbeat
from storage_layout.auth import learner_key
from storage_layout.store import RunStore

CFG = LivenessConfig(heartbeat_seconds=5, silent_min_seconds=30, silent_max_seconds=600)
H = 20  # topology.inner_steps


@dataclass(frozen=True)
class Beat:
    generation: int = 1
    beat: int = 1
    period: float = 5.0
    state: str = "training"
    step: int = 0
    sends: int = 0
    step_seconds: float | None = None
    time: float = 0.0

    @property
    def key(self) -> tuple[int, int]:
        return self.generation, self.beat


def test_a_learner_whose_round_is_an_hour_is_alive_while_it_beats():
    """Beats every 5 s, one step taking 3 minutes and a round an hour: counted for the
    hour (never silent), and lagging only once it has sent nothing for 3 of its rounds."""
    live, t, n = Liveness(CFG, H), 0.0, 0
    while t < 3600:
        n += 1
        verdict = live.look("l0", Beat(beat=n, step=int(t // 180), step_seconds=180.0), {}, t)
        assert verdict.counted and verdict.state == "training", (t, verdict)
        t += 5
    assert lag_after(CFG, H, 180.0) == 3 * H * 180.0  # 3 hours without a send: lagging
    verdict = live.look("l0", Beat(beat=n + 1, step_seconds=180.0), {}, 3 * H * 180.0 + 1)
    assert verdict.state == "lagging" and not verdict.counted
    assert "no send for 10801 s, over 3 of its rounds (3600 s each)" in verdict.why
    # it sends: counted again at once
    assert live.look("l0", Beat(beat=n + 2, sends=1, step_seconds=180.0), {}, 10802).counted


def test_silence_is_a_stopped_heartbeat_judged_by_its_measured_period():
    """Silent after 6 beats of the period measured on the observer's clock, within the
    floor and the ceiling: late beats (a loaded machine) stretch it, regular ones bring
    it back; a preempted or done learner is said so at once."""
    assert silence_after(CFG, 5.0) == 30.0  # the floor
    assert silence_after(CFG, 20.0) == 120.0
    assert silence_after(CFG, 500.0) == 600.0  # the ceiling
    live = Liveness(CFG, H)
    assert live.look("l0", Beat(beat=1), {}, 0.0).counted
    assert live.look("l0", Beat(beat=1), {}, 30.0).counted  # 30 s: not past the floor
    verdict = live.look("l0", Beat(beat=1), {}, 31.0)
    assert verdict.state == "silent" and verdict.why.startswith("no heartbeat for 31 s")
    # beats 50 s apart (a starved thread): silent only after 6 x 50 s
    assert live.look("l0", Beat(beat=2), {}, 50.0).counted
    assert live.look("l0", Beat(beat=3), {}, 100.0).counted
    assert live.look("l0", Beat(beat=3), {}, 390.0).counted
    assert live.look("l0", Beat(beat=3), {}, 401.0).state == "silent"
    # an older beat written again (replayed) moves nothing: still silent
    assert live.look("l0", Beat(beat=2), {}, 402.0).state == "silent"
    assert live.look("l0", Beat(generation=2, beat=1), {}, 403.0).counted  # a new process
    assert live.look("l0", Beat(beat=4, state="preempted"), {}, 404.0).state == "preempted"
    assert live.look("l0", Beat(beat=4), {"state": "done"}, 5000.0).state == "done"
    # no heartbeat at all (older code, or not started): its status, by the ceiling
    assert live.look("l1", None, {"state": "training", "time": 1}, 0.0).counted
    assert live.look("l1", None, {"state": "training", "time": 1}, 600.0).counted
    assert live.look("l1", None, {"state": "training", "time": 1}, 601.0).state == "silent"
    assert live.look("l1", None, {"state": "preempted"}, 602.0).state == "preempted"
    # a heartbeat that could not be read once, then again: judged by each in turn
    assert live.look("l0", None, {"state": "training", "time": 5}, 405.0).counted
    assert live.look("l0", Beat(generation=2, beat=2), {}, 406.0).counted


def test_a_status_rewritten_by_anyone_keeps_no_stopped_learner_counted():
    """A learner paused (SIGSTOP) while something rewrites its status every 3 s, or its
    heartbeat deleted besides: once its heartbeat was seen, only the heartbeat counts."""
    live = Liveness(CFG, H)
    assert live.look("l0", Beat(beat=1), {"state": "training", "time": 0}, 0.0).counted
    for t in range(3, 150, 3):  # the beats stop; a forger rewrites the status
        verdict = live.look("l0", Beat(beat=1), {"state": "training", "time": t}, float(t))
    assert verdict.state == "silent" and verdict.why.startswith("no heartbeat for 147 s")
    assert live.look("l1", Beat(beat=1), {}, 0.0).counted
    verdict = live.look("l1", None, {"state": "training", "time": 140}, 140.0)  # deleted
    assert verdict.state == "silent", verdict
    assert live.look("l1", Beat(beat=2), {}, 141.0).counted  # it beats again: counted


def test_a_joiners_glance_uses_the_beats_own_time_and_period():
    assert glance(CFG, Beat(time=100.0), {}, 129.0).counted
    assert glance(CFG, Beat(time=100.0), {}, 131.0).state == "silent"
    assert glance(CFG, Beat(time=100.0, period=60.0), {}, 400.0).counted  # 6 x 60 s
    assert glance(CFG, None, {"state": "training", "time": 100.0}, 650.0).counted
    assert glance(CFG, None, {"state": "training", "time": 100.0}, 701.0).state == "silent"
    assert glance(CFG, None, {"state": "done", "time": 0.0}, 10**9).state == "done"


def test_the_liveness_settings_are_checked_and_kept_in_the_spec(tmp_path):
    with pytest.raises(ConfigError, match="silent_min_seconds 100 exceeds"):
        load_config("tiny", overrides=["liveness.silent_min_seconds=100",
                                       "liveness.silent_max_seconds=50"])  # fmt: skip
    with pytest.raises(ConfigError, match="under two heartbeats"):
        load_config("tiny", overrides=["liveness.heartbeat_seconds=40"])
    from flows.run import initialize_run

    (tmp_path / "us").mkdir()
    cfg = load_config("tiny", overrides=["liveness.silent_min_seconds=45"])
    spec = initialize_run(RunStore("keep", {"us": f"file://{tmp_path / 'us'}"}, "us"), cfg)
    assert spec["config"]["liveness"]["silent_min_seconds"] == 45.0


def test_a_heartbeat_beats_from_its_thread_signed_and_stops_when_superseded(tmp_path):
    """The thread writes a signed beat at once and every period with the learner's step,
    sends and measured step time; a reader with the key takes it, one with another key
    or a damaged object takes nothing (named in the log, never raised); once a newer
    generation of the learner is claimed (a fence), it stops beating and says so."""
    (tmp_path / "us").mkdir()
    regions = {"us": f"file://{tmp_path / 'us'}"}
    store = RunStore("hb", regions, "us", writer="learner-0")
    key = learner_key("s" * 32, "hb", "learner-0")
    generation = store.members.claim_generation("learner-0")
    progress = {"step": 0, "sends": 0}
    moved = threading.Event()

    class Log:
        def warning(self, msg, *args):
            if "beats no more" in msg % args:
                moved.set()

    beat = Heartbeat(store.members, "learner-0", generation, 0.05, key,
                     lambda: (progress["step"], progress["sends"]), Log())  # fmt: skip
    try:
        first = None
        while first is None:
            first = store.members.read_heartbeat("learner-0", key=key)
        assert first.generation == generation and first.state == "starting"
        beat.state, progress["step"], progress["sends"] = "training", 7, 2
        seen = first
        while seen.step != 7:
            seen = store.members.read_heartbeat("learner-0", key=key)
        assert seen.state == "training" and seen.sends == 2 and seen.beat > first.beat
        assert store.members.read_heartbeat("learner-0", key=b"x" * 32) is None  # not its key
        store.members.fence("learner-0", generation, "a test")
        assert moved.wait(10)
        assert beat.superseded.is_set()
    finally:
        beat.close("stopped")
    last = store.members.read_heartbeat("learner-0", key=key)
    assert last.state != "stopped"  # superseded: it writes as that learner no more
    key_path = tmp_path / "us" / "hb" / "learners" / "learner-0" / "heartbeat.json"
    for bad in (b"[1, 2]", b"x" * 5000, json.dumps({"learner": "learner-0"}).encode()):
        key_path.write_bytes(bad)
        assert store.members.read_heartbeat("learner-0", key=key) is None


def test_a_heartbeats_step_time_is_measured_while_the_learner_trains_only():
    """A minute of compiling before the first step does not count as the first steps'
    time: the run's lagging and standing-still limits, which scale with it, would start
    hundreds of times too long."""
    now, beats = [0.0], []

    class Members:
        def superseded(self, learner, generation):
            return False

        def write_heartbeat(self, beat, key):
            beats.append(beat)

    progress = {"step": 0}
    hb = Heartbeat(Members(), "l0", 1, 3600.0, None, lambda: (progress["step"], 0),
                   logging.getLogger(), clock=lambda: now[0])  # fmt: skip
    try:
        while not beats:  # (its thread's first beat, "starting")
            time.sleep(0.01)
        hb.state = "compiling"
        hb.beat()
        now[0] = 60.0  # a minute of compiling, then steps of 0.1 s
        hb.state = "training"
        hb.beat()
        now[0], progress["step"] = 61.0, 10
        hb.beat()
        now[0], progress["step"] = 62.0, 20
        hb.beat()
        hb.state = "paused"  # between flow runs: it beats on, its step time as measured
        now[0] = 90.0
        hb.beat()
    finally:
        hb.close("done")
    assert [b["step_seconds"] for b in beats[:6]] == [None, None, None, 0.1, 0.1, 0.1]


def test_a_failing_heartbeat_is_logged_and_goes_on(tmp_path, caplog):
    """A beat that fails (the bucket gone) is logged by the thread, which beats on."""
    (tmp_path / "us").mkdir()
    store = RunStore("hb", {"us": f"file://{tmp_path / 'us'}"}, "us", writer="learner-0")
    generation = store.members.claim_generation("learner-0")
    calls = []

    class Failing:
        def superseded(self, learner, generation):
            calls.append(1)
            if len(calls) < 3:
                raise OSError("the bucket is away")
            return store.members.superseded(learner, generation)

        def write_heartbeat(self, beat, key):
            store.members.write_heartbeat(beat, key)

    log = logging.getLogger("test-heartbeat")
    with caplog.at_level(logging.WARNING, "test-heartbeat"):
        beat = Heartbeat(Failing(), "learner-0", generation, 0.02, None, lambda: (0, 0), log)
        try:
            while store.members.read_heartbeat("learner-0") is None:
                pass
        finally:
            beat.close()
    assert "heartbeat of learner-0 failed 1 time(s)" in caplog.text
    assert store.members.read_heartbeat("learner-0").beat >= 1
