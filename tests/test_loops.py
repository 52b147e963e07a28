"""The one learner loop and the one syncer loop (``diloco.loops``), as the simulator and
the pipeline drive them: equivalence of the two, rejoin through a bucket, background
I/O that survives bad objects, and a storage layer that loads no training code."""

from __future__ import annotations

import contextvars
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from diloco.config import load_config
from diloco.fragments import fragment_sizes
from diloco.learner_loop import LearnerLoop
from diloco.loops import STEP, Wait, WallClock, drive
from diloco.network import SimulatedNetwork
from diloco.outer import Contribution
from diloco.records import version_id
from diloco.run_data import RunData
from diloco.scheduler import Scheduler, VirtualClock
from diloco.simulate import simulate
from diloco.transport import StoreLearnerView
from flows.learner import train_round
from flows.learner_buckets import SEQ_BLOCK
from flows.learner_io import BackgroundIO
from flows.learner_runtime import Fenced, LearnerRuntime
from flows.process import WorkerProcess, worker_process
from flows.run import bucket_store, build_model, initialize_run, simulation_store
from flows.syncer import SyncerRuntime
from protocol.quantize import quantize
from protocol.topology import home_region, learner_ids, run_slots, shard_count, shard_of
from storage_layout.faults import Injector
from storage_layout.store import RunStore

PIPELINE = {"round_steps": 7, "checkpoint_every": 9, "syncer_shards": 2}
OVER = ["budget.tokens=64000", "sim.eval_points=2", "sim.speeds=[1,1.5,1,2]"]
OVER += [f"pipeline.{k}={v}" for k, v in PIPELINE.items()]


def _until(predicate) -> bool:
    """Wait for a background thread to get to ``predicate``; the minute is a guard
    against a hang, not a measure (a busy machine takes longer, never fails)."""
    deadline = time.monotonic() + 60
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def regions_in(tmp_path: Path, tag: str) -> dict[str, str]:
    out = {}
    for r in ("us", "eu"):
        (tmp_path / tag / r).mkdir(parents=True)
        out[r] = f"file://{tmp_path / tag / r}"
    return out


def run_pipeline_runtimes(run: str, regions: dict[str, str], cfg) -> None:
    """The pipeline's own runtimes (built from the run spec in the bucket, as each worker
    process builds them) driven round by round on the simulator's clock and network."""
    initialize_run(RunStore(run, regions, home_region(regions)), cfg)
    spec = RunStore(run, regions, home_region(regions)).read_spec()
    model = build_model(cfg)
    ids, m = learner_ids(cfg.topology.learners), cfg.topology.learners
    shards = shard_count(cfg.pipeline.syncer_shards, len(model.plan))
    speeds = cfg.speeds
    clock, ended = VirtualClock(), set()
    sched = Scheduler(clock, lambda name: speeds[ids.index(name)] * cfg.sim.step_seconds)
    sizes = fragment_sizes(model.plan, model.codec.sizes)
    net = SimulatedNetwork(
        bucket_store(run, regions, spec, cfg, "syncer"), clock, cfg.sim,
        [2 * s for s in sizes], ids, owner=lambda p: f"syncer-{shard_of(p, shards)}",
        notify=sched.notify, finished=lambda budget_spent=False: len(ended) == m,
    )  # fmt: skip
    pipeline = cfg.pipeline.model_dump()
    syncers = [SyncerRuntime(run, regions, home_region(regions), s, shards, pipeline,
                             clock=clock, transport=net) for s in range(shards)]  # fmt: skip
    learners = [
        LearnerRuntime(run, regions[run_slots(spec)[lid]], run_slots(spec)[lid], lid,
                       pipeline, clock=clock, io=lambda view, lid=lid: net.learner_view(lid))
        for lid in ids
    ]  # fmt: skip

    def rounds(rt: LearnerRuntime):
        while not rt.finished:  # what train_round does, one Prefect task run at a time
            yield from rt.loop.run(cfg.pipeline.round_steps)

    def on_end(name: str) -> None:
        if name in ids:
            ended.add(name)
            for s in range(shards):
                sched.notify(f"syncer-{s}", clock.now())

    for s, rt in enumerate(syncers):
        sched.start(f"syncer-{s}", rt.loop.run())
    for lid, rt in zip(ids, learners, strict=True):
        sched.start(lid, rounds(rt))
    sched.run(lambda name: None, on_end)


def test_simulator_and_pipeline_runtimes_publish_identical_versions(tmp_path):
    """(a) the simulator's scheduler over the bucket store and (b) the pipeline's learner
    and syncer runtimes over the same kind of store, on one virtual clock: the same
    global versions, bit for bit, merging the same contributions."""
    cfg = load_config("tiny", overrides=OVER)
    a, b = regions_in(tmp_path, "a"), regions_in(tmp_path, "b")
    simulate(cfg, store=simulation_store("eq", a))
    run_pipeline_runtimes("eq", b, cfg)
    sa, sb = RunStore("eq", a, "us"), RunStore("eq", b, "us")
    merged = 0
    for p in range(cfg.topology.fragments):
        versions = sa.versions.global_versions(p)
        assert sb.versions.global_versions(p) == versions and len(versions) > 3, p
        for v in versions:
            ga, gb = sa.versions.get_global(p, v), sb.versions.get_global(p, v)
            assert ga.meta["consumed"] == gb.meta["consumed"], (p, v)
            for name, value in ga.params.items():
                np.testing.assert_array_equal(value, gb.params[name])
            merged += len(ga.meta["consumed"])
    assert merged > 10


def test_storage_layer_and_inspect_load_no_training_code(tmp_path):
    code = (
        "import sys\n"
        "import storage_layout.store, storage_layout.inspect, storage_layout.retention\n"
        "from flows.cli import main\n"
        f"main(['inspect', {str(tmp_path)!r}])\n"
        "loaded = [m for m in ('jax', 'optax', 'flax') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "no runs in" in proc.stdout


@pytest.fixture
def tiny_run(tmp_path):
    """A run in one file:// region; returns (cfg, regions, spec, model)."""
    cfg = load_config("tiny", overrides=["budget.tokens=64000", "pipeline.checkpoint_every=1000"])
    regions = regions_in(tmp_path, "r")
    spec = initialize_run(RunStore("r", regions, "us"), cfg)
    return cfg, regions, spec, build_model(cfg)


def _learner(cfg, regions, spec, model, clock):
    store = bucket_store("r", regions, spec, cfg, "learner-0", home=run_slots(spec)["learner-0"])
    view = StoreLearnerView(store, "learner-0")
    loop, source = LearnerLoop.start("learner-0", model.trainer, model.plan, RunData(cfg).reader(0),
                                     cfg, view, clock)  # fmt: skip
    return loop, source, store


def test_a_learner_killed_before_its_first_checkpoint_rejoins_after_its_sends(tiny_run):
    """Its restart takes the step of its newest committed send from the bucket, and its
    seqs above the block of numbers its predecessor reserved: no seq is reused, no sent
    work is trained and merged again."""
    cfg, regions, spec, model = tiny_run
    clock = VirtualClock()
    loop, source, store = _learner(cfg, regions, spec, model, clock)
    assert source.startswith("global versions")
    for request in loop.run(23):  # no checkpoint (every 1000 steps), sends every 5 steps
        assert request is STEP
    assert (
        store.writer_for("learner-0", checkpoints=True).checkpoints.checkpoint_steps("learner-0")
        == []
    )
    sent_seq, sent_step = loop.learner.seq, 20
    # "SIGKILL": the loop is dropped; a new one starts from the bucket.
    again, source, _ = _learner(cfg, regions, spec, model, clock)
    assert (again.learner.step, again.learner.reader.position) == (sent_step, sent_step)
    resumed_seq = again.learner.seq
    assert sent_seq <= resumed_seq < sent_seq + SEQ_BLOCK
    assert "no checkpoint and sends up to step 20 " in source
    list(again.run(5))  # its next send commits (a reused seq would raise CommitConflict)
    store = RunStore("r", regions, "us")
    seqs = [
        s
        for p in range(len(model.plan))
        for s in store.contributions.contribution_seqs("learner-0", p, "us")
    ]
    assert max(seqs) == resumed_seq + 1 > sent_seq


def test_a_preempted_learner_sends_what_it_trained_and_rejoins_where_it_stopped(tiny_run):
    """``send_pending`` sends every fragment holding steps no send carried (cumulative
    from its anchor), once; the restart resumes at that step, reusing no seq and
    skipping no batch: nothing trained is lost, as it is after a kill."""
    cfg, regions, spec, model = tiny_run
    clock = VirtualClock()
    loop, _, _ = _learner(cfg, regions, spec, model, clock)
    for request in loop.run(23):  # sends every 5 steps, the last at step 20
        assert request is STEP
    unsent = [p for p, f in enumerate(loop.learner.fragments) if f.sent_at_step != 23]
    assert unsent == list(range(len(model.plan)))  # no global answered: all hold steps
    assert loop.send_pending() == unsent
    assert loop.send_pending() == []  # nothing left to send
    assert all(f.sent_at_step == 23 for f in loop.learner.fragments)
    seq = loop.learner.seq
    again, source, _ = _learner(cfg, regions, spec, model, clock)
    assert (again.learner.step, again.learner.reader.position) == (23, 23)
    assert "sends up to step 23 " in source and again.learner.seq >= seq
    reread = RunStore("r", regions, "us")
    for p in unsent:
        assert (
            seq - len(unsent)
            < max(reread.contributions.contribution_seqs("learner-0", p, "us"))
            <= seq
        )


def test_a_preempted_learner_runtime_stops_after_its_step_and_leaves_within_its_deadline(
    tiny_run,
):
    """Told it will be preempted (``WorkerProcess.preempted``, the worker's first SIGTERM)
    mid-round,
    the pipeline's learner stops after the step it is in, sends, checkpoints, says
    "preempted" in its status, and its next process resumes at that step."""
    from flows.process import worker_process

    _, regions, spec, model = tiny_run
    lid = "learner-0"
    region = run_slots(spec)[lid]
    pipeline = {"round_steps": 20, "preempt_seconds": 60}

    class NoticeAt(WallClock):  # the notice comes at the run's own step 7
        steps = 0

        def stepped(self, started, result):
            NoticeAt.steps += 1
            if NoticeAt.steps == 7:
                process.preempted.set()

    with worker_process() as process:
        rt = LearnerRuntime("r", regions[region], region, lid, pipeline, clock=NoticeAt())
        row = rt.train_round()
        assert row["steps"] == 7 and rt.preempting()
        left = rt.leave()
    assert left["step"] == 7 and left["written"] and left["sent"] == list(range(len(model.plan)))
    store = RunStore("r", regions, region)
    assert store.checkpoints.checkpoint_steps(lid) == [7]
    assert store.progress.read_metrics(lid)["state"] == "preempted"
    again = LearnerRuntime("r", regions[region], region, lid, pipeline)
    try:
        assert (
            again.step == 7 and "checkpoint at step 7 and sends up to step 7 " in again.resumed_from
        )
    finally:
        again.close()


def test_background_io_survives_a_corrupt_global_version(tiny_run, caplog):
    """A version that does not verify is reported once and skipped; the poller goes on
    and takes the next one (before, it ended the thread and the learner never took a new
    global again)."""
    cfg, regions, spec, model = tiny_run
    syncer = RunStore("r", regions, "us", writer="syncer")
    names = model.plan[0]

    def publish(version: int, value: float) -> None:
        params = {n: np.full_like(model.init[n], value) for n in names}
        syncer.versions.publish_global(0, version, params, [], {"weights": {}}, "bf16")

    store = bucket_store("r", regions, spec, cfg, "learner-0", home="us")
    io = BackgroundIO(StoreLearnerView(store, "learner-0"), len(model.plan), 0.02, 0,
                      logging.getLogger("test"))  # fmt: skip
    try:
        publish(1, 1.0)
        marker = syncer.versions.global_marker(0, 1)
        data = next(k for k in marker.objects if k.startswith("wire/") and "/c/" in k)
        path = Path(regions["us"].removeprefix("file://")) / marker.data_prefix / data
        good = path.read_bytes()
        path.write_bytes(b"\x00" + good[1:])  # a flipped byte
        with caplog.at_level(logging.WARNING, logger="test"):
            io.want(0, 0)  # the learner sent fragment 0 and waits for an answer
            _until(lambda: "cannot read version 1" in caplog.text)
        assert "cannot read version 1 of fragment 0" in caplog.text
        assert io.latest_global(0).version == 0 and io.poller.is_alive()
        path.write_bytes(good)  # the damage was in the read, not the object: taken later
        assert _until(lambda: io.latest_global(0).version == 1)
        path.write_bytes(b"\x00" + good[1:])  # damaged for good now
        io.want(0, 1)
        publish(2, 2.0)
        assert _until(lambda: io.latest_global(0).version == 2) and io.poller.is_alive()
        assert caplog.text.count("cannot read version 1") == 1  # reported once
    finally:
        io.close()


def test_a_learner_looks_for_global_versions_at_the_pace_they_come(tiny_run, caplog):
    """Each look LISTs a fragment's versions: versions that came 100 s apart are looked
    for every 5 s (``flows.pace``: 1/20 of the gap, at most 5 s), so one is taken at most
    5 s late; versions 10 s apart, at every poll. A look that fails (the region does not
    answer) is said and made again at the next poll; the poller goes on. The clock is
    the test's, the looks its own calls (the thread polls once an hour here)."""
    from flows.pace import PACE_MOST

    cfg, regions, spec, model = tiny_run
    syncer = RunStore("r", regions, "us", writer="syncer")

    def publish(version: int) -> None:
        params = {n: np.full_like(model.init[n], version) for n in model.plan[0]}
        syncer.versions.publish_global(0, version, params, [], {"weights": {}}, "bf16")

    store = bucket_store("r", regions, spec, cfg, "learner-0", home="us")
    io = BackgroundIO(StoreLearnerView(store, "learner-0"), len(model.plan), 3600, 0,
                      logging.getLogger("test"))  # fmt: skip
    now = [0.0]
    io.clock = lambda: now[0]

    def look(at: float) -> int:
        now[0] = at
        io.look()
        return io.latest_global(0).version

    try:
        io.want(0, 0)
        assert look(0.0) == 0 and look(0.2) == 0 and io.pace.looks == 2  # no gap known
        publish(1)
        assert look(0.4) == 1
        publish(2)
        assert look(100.4) == 2  # 100 s after the last: looked for every 5 s from here
        publish(3)
        looks = io.pace.looks
        assert look(100.6) == 2 and look(100.4 + PACE_MOST - 0.1) == 2
        assert io.pace.looks == looks  # neither of those listed
        assert look(100.4 + PACE_MOST) == 3  # taken 5 s late at most
        publish(4)
        assert look(110.4 + PACE_MOST) == 4  # 10 s apart: at every poll again
        looks = io.pace.looks
        assert look(110.6 + PACE_MOST) == 4 and io.pace.looks == looks + 1

        # A region that does not answer: said, and asked again at the next poll.
        def down(*args):
            raise OSError("the region does not answer")

        store.newest_version = down
        with caplog.at_level(logging.WARNING, logger="test"):
            assert look(110.8 + PACE_MOST) == 4 and look(111.0 + PACE_MOST) == 4
        assert caplog.text.count("cannot list the versions of fragment 0") == 1, caplog.text
        del store.newest_version  # it answers again
        publish(5)
        assert look(111.2 + PACE_MOST) == 5 and io.poller.is_alive()
    finally:
        io.close()


def test_a_transport_that_waits_on_no_fragment_runs_no_poller(tiny_run):
    """A follower of a learner over several processes writes its checkpoint parts only:
    its transport (no fragments) starts no thread that polls for versions."""
    import threading

    cfg, regions, spec, _ = tiny_run
    store = bucket_store("r", regions, spec, cfg, "learner-0", home="us")
    before = {t.name for t in threading.enumerate()}
    io = BackgroundIO(
        StoreLearnerView(store, "learner-0"), 0, 0.02, 0, logging.getLogger("t"), max_unsent=1
    )
    try:
        assert io.poller is None and io.latest_global(0) is None
        assert "globals" not in {t.name for t in threading.enumerate()} - before
    finally:
        io.close()


def test_a_queued_upload_a_newer_send_supersedes_is_skipped(tiny_run):
    """When uploads fall behind (a slow store), a queued send from an anchor that a newer
    queued send from the same anchor carries is never written: the queue drains instead of
    growing. Another anchor's send, or another fragment's, is written."""
    cfg, regions, spec, model = tiny_run
    store = bucket_store("r", regions, spec, cfg, "learner-0", home="us")
    io = BackgroundIO(StoreLearnerView(store, "learner-0"), len(model.plan), 0.02, 0,
                      logging.getLogger("test"))  # fmt: skip
    gate = threading.Event()
    try:
        io.jobs.submit(gate.wait)  # the store is slow: the queue fills behind this

        def send(seq: int, fragment: int, anchor_seq: int) -> None:
            payload = {n: quantize(np.full_like(model.init[n], 1e-3), "fp32")
                       for n in model.plan[fragment]}  # fmt: skip
            io.send(Contribution("learner-0", fragment, seq, 0, 64 * seq, seq, 0.1 * seq,
                                 payload, step=seq, anchor_seq=anchor_seq,
                                 base_id=version_id(fragment, 0, [])))  # fmt: skip

        for seq, fragment, anchor in ((1, 0, 0), (2, 1, 0), (3, 0, 0), (4, 0, 3), (5, 0, 3)):
            send(seq, fragment, anchor)
        gate.set()
        io.flush()
    finally:
        io.close()
    written = RunStore("r", regions, "us")
    assert written.contributions.contribution_seqs("learner-0", 0, "us") == [3, 5]  # 1 in 3, 4 in 5
    assert written.contributions.contribution_seqs("learner-0", 1, "us") == [2]
    assert io.skipped == 2 and io.failures == 0


def test_background_io_says_when_global_versions_stop_coming(tiny_run, caplog):
    """A learner whose syncer is down keeps training and says so, once per stall."""
    cfg, regions, spec, model = tiny_run
    syncer = RunStore("r", regions, "us", writer="syncer")
    store = bucket_store("r", regions, spec, cfg, "learner-0", home="us")
    io = BackgroundIO(StoreLearnerView(store, "learner-0"), len(model.plan), 0.02, 0,
                      logging.getLogger("test"), stall_seconds=0.2)  # fmt: skip
    try:
        with caplog.at_level(logging.WARNING, logger="test"):
            io.want(0, 0)  # sent; no syncer answers
            stalled = "no global version of fragment 0 newer than 0"
            assert _until(lambda: stalled in caplog.text)
            time.sleep(0.6)  # three stall periods more: still said once (a slower poller
            assert caplog.text.count(stalled) == 1  # looks fewer times, never more)
            params = {n: np.ones_like(model.init[n]) for n in model.plan[0]}
            syncer.versions.publish_global(0, 1, params, [], {"weights": {}}, "bf16")
            _until(lambda: "version 1 arrived after" in caplog.text)
        assert "fragment 0: version 1 arrived after" in caplog.text
        assert "fragment 1" not in caplog.text  # nothing awaited there
    finally:
        io.close()


def test_a_second_process_of_one_learner_fences_the_first_off(tiny_run):
    """Two processes with one learner id would race for its sequence numbers and mix its
    checkpoints: each start claims a new generation, and an older one stops."""
    cfg, regions, _, _ = tiny_run
    pipeline = {**cfg.pipeline.model_dump(), "round_steps": 5}
    old = LearnerRuntime("r", regions["us"], "us", "learner-0", pipeline)
    new = LearnerRuntime("r", regions["us"], "us", "learner-0", pipeline)
    try:
        assert (old.generation, new.generation) == (1, 2)
        with pytest.raises(Fenced, match=r"generation 2 \(this one is generation 1\)"):
            old.train_round()
        assert old.step == 0  # it stopped before training
    finally:
        old.close()
    try:
        assert new.train_round()["step"] == 5  # the newest goes on
    finally:
        new.close()


def test_a_learner_whose_upload_is_refused_stops_writing_at_once(tiny_run):
    """An upload refused because a newer process of the learner holds the next seqs tells
    the old process it is fenced off before its next generation check: nothing more of
    it is written (not its next upload, not a checkpoint), and its runtime stops."""
    cfg, regions, _, model = tiny_run
    pipeline = {**cfg.pipeline.model_dump(), "round_steps": 5}
    old = LearnerRuntime("r", regions["us"], "us", "learner-0", pipeline)
    new = bucket_store("r", regions, old.store.main.read_spec(), cfg, "learner-0", home="us")
    try:
        first = old.loop.learner.seq + 1
        new.sent_so_far("learner-0")  # a newer process reserves the block above old's
        payload = {n: quantize(np.full_like(model.init[n], 1e-3), "fp32") for n in model.plan[0]}
        for seq in (first + SEQ_BLOCK, first + SEQ_BLOCK + 1):  # each needs a new block
            old.io.send(Contribution("learner-0", 0, seq, 0, 64, 1, 0.1, payload, step=seq,
                                     base_id=version_id(0, 0, [])))  # fmt: skip
        old.io.save_checkpoint(old.loop.learner.checkpoint())
        old.io.flush()
        assert "reserved the numbers" in str(old.io.fenced)
        assert old.io.failures == 3  # refused, then neither the next send nor the checkpoint
        written = RunStore("r", regions, "us")
        assert written.contributions.contribution_seqs("learner-0", 0, "us") == []
        assert written.checkpoints.checkpoint_steps("learner-0") == []
        with pytest.raises(Fenced, match="another process runs as this learner"):
            old.train_round()
        assert old.step == 0
    finally:
        old.close()


def test_a_superseded_process_commits_nothing_even_inside_its_own_block(tiny_run):
    """A second process started by hand as a learner: the first one, still holding a
    block of seqs it reserved, commits nothing more from the moment the newer one has
    claimed its generation (checked at each commit, not each round): neither a seq of
    its own block nor a checkpoint."""
    cfg, regions, _, model = tiny_run
    pipeline = {**cfg.pipeline.model_dump(), "round_steps": 5}
    old = LearnerRuntime("r", regions["us"], "us", "learner-2", pipeline)
    try:
        first = old.loop.learner.seq + 1  # inside the block old reserved as it started
        new = bucket_store("r", regions, old.store.main.read_spec(), cfg, "learner-2", home="us")
        new.claim_generation("learner-2")  # the newer process starts: nothing sent yet
        payload = {n: quantize(np.full_like(model.init[n], 1e-3), "fp32") for n in model.plan[0]}
        old.io.send(Contribution("learner-2", 0, first, 0, 64, 1, 0.1, payload, step=first,
                                 base_id=version_id(0, 0, [])))  # fmt: skip
        old.io.save_checkpoint(old.loop.learner.checkpoint())
        old.io.flush()
        assert "holds generation 2, this one 1" in str(old.io.fenced)
        written = RunStore("r", regions, "us")
        assert written.contributions.contribution_seqs("learner-2", 0, "us") == []
        assert written.checkpoints.checkpoint_steps("learner-2") == []
        with pytest.raises(Fenced, match="another process took over as generation 2"):
            old.train_round()
    finally:
        old.close()


def _least_sleep(retries: int, first: float, longest: float) -> float:
    """The seconds an upload backing off from ``first`` (doubling, at most ``longest``)
    has slept at least before its ``retries``-th retry."""
    return sum(min(longest, first * 2**i) for i in range(retries))


def test_a_learner_pauses_under_a_full_disk_and_drops_nothing_once_it_recovers(tiny_run, caplog):
    """Its region's disk fills (ENOSPC on every write, reads fine): the upload in flight
    backs off, said once by name and not per retry; the learner trains until more than
    ``max_unsent`` sends wait, then takes no step (backpressure: no pile of work that
    would arrive too stale, no steps past a shared budget that no one else sees). Freed,
    every waiting send is written or carried by a newer one from its anchor, nothing is
    dropped for good, and the learner trains on to the budget. Driven by the run's own
    progress: the test fills and frees the disk."""
    cfg, regions, _, model = tiny_run
    pipeline = {**cfg.pipeline.model_dump(), "round_steps": 5}
    log = logging.getLogger("test.disk")
    first, longest = 0.05, 0.4
    every = cfg.topology.inner_steps // len(model.plan)  # steps between two sends
    injector = Injector({"disk_full": {"region": "us"}})  # the learner's buckets meet it
    with worker_process(WorkerProcess(faults=injector)):
        rt = LearnerRuntime(
            "r", regions["us"], "us", "learner-0", pipeline,
            io=lambda view: BackgroundIO(view, len(model.plan), 0.02, 0, log,
                                         backoff=(first, longest)),
        )  # fmt: skip
        io, store = rt.io, RunStore("r", regions, "us")

        def written() -> set[tuple[int, int]]:
            return {(p, s) for p in range(len(model.plan))
                    for s in store.contributions.contribution_seqs("learner-0", p, "us")}  # fmt: skip

        try:
            drive(rt.loop.run(5), 0.02)  # a round with space: its sends are written
            io.flush()
            before = written()
            assert before and io.max_unsent == 2 * len(model.plan)
            with caplog.at_level(logging.INFO, logger="test.disk"):
                injector.fill_disk("us")
                filled = time.monotonic()
                loop, steps = rt.loop.run(), 0  # on to the end of the budget
                for request in loop:
                    if isinstance(request, Wait):
                        break
                    steps += 1
                # Paused: the bound is reached, and it took at most that many sends.
                assert io.backed_up() and io.unsent == io.max_unsent + 1
                assert 0 < steps <= (io.max_unsent + 1) * every
                paused_at = rt.step
                while io.retried < 8:  # the upload in flight tries again, and again...
                    assert isinstance(next(loop), Wait)  # ...while the learner waits
                    time.sleep(0.02)
                # ...backing off: no tight loop (sleeping only ever takes longer).
                assert _least_sleep(io.retried, first, longest) <= time.monotonic() - filled
                assert rt.step == paused_at and written() == before and io.failures == 0
                assert injector.counts()["disk_full"] >= 8
                injector.free_disk("us")
                for request in loop:  # to the end of the (shared) budget
                    if isinstance(request, Wait):
                        time.sleep(0.02)
                io.flush()
        finally:
            rt.close()
    # The budget is met: alone, this learner trains all of it, and no more.
    assert rt.finished and rt.step == cfg.budget_steps
    sent = {(r["fragment"], r["seq"]) for r in rt.records if r["event"] == "sent"}
    assert io.failures == 0 and io.unsent == 0  # nothing dropped for good
    assert written() <= sent and len(written()) + io.skipped == len(sent)
    ours = [r.getMessage() for r in caplog.records if r.name == "test.disk"]
    full = [m for m in ours if "out of space" in m]
    assert len(full) == 1 and "region us" in full[0] and "ENOSPC" in full[0], ours
    assert len([m for m in ours if "has space again" in m]) == 1, ours
    assert not [m for m in ours if "retrying" in m or "failed" in m], ours


def test_a_learner_started_on_a_full_disk_waits_for_space_instead_of_crashing(
    tiny_run, monkeypatch, caplog
):
    """Its start needs writes (its generation, a block of seqs): on a full disk it waits
    for space, said once, instead of failing the process (a restart would meet the same
    disk, and each failed start counts towards giving the learner up)."""
    cfg, regions, _, _ = tiny_run
    monkeypatch.setattr("flows.learner_io.BACKOFF", (0.05, 0.2))
    pipeline = {**cfg.pipeline.model_dump(), "round_steps": 5}
    started: dict[str, LearnerRuntime] = {}
    injector = Injector({"disk_full": {"region": "us"}})
    with worker_process(WorkerProcess(faults=injector)):
        injector.fill_disk("us")
        with caplog.at_level(logging.WARNING):
            here = contextvars.copy_context()  # (a thread starts with none: this process's)
            start = threading.Thread(target=lambda: here.run(lambda: started.update(
                rt=LearnerRuntime("r", regions["us"], "us", "learner-0", pipeline))))  # fmt: skip
            start.start()
            while injector.counts().get("disk_full", 0) < 9 and start.is_alive():
                time.sleep(0.02)  # three tries of its claim (each asked three times)
            assert start.is_alive() and not started  # waiting, not crashed
            injector.free_disk("us")
            start.join(timeout=300)
        rt = started["rt"]
        try:
            assert rt.generation == 1 and rt.train_round()["step"] == 5
        finally:
            rt.close()
    said = [r.getMessage() for r in caplog.records if "learner-0 waits for space" in r.getMessage()]
    assert len(said) == 1 and "region us is out of space (ENOSPC" in said[0]
    assert "the start of learner-0 goes on after" in caplog.text


def test_a_round_is_not_retried_inside_the_process():
    """A round that fails half-way has changed the learner's state in memory; a retry
    would continue from there. The process ends instead and its restart rejoins from the
    bucket (the test above)."""
    assert train_round.retries == 0


def test_versions_are_published_after_what_they_merge_has_arrived():
    """The syncer loop sees a contribution only once the simulated network delivered it."""
    cfg = load_config("tiny", overrides=["budget.tokens=16000", "sim.eval_points=1"])
    result = simulate(cfg)
    versions = [r for r in result.metrics if r["event"] == "version"]
    sent = [r for r in result.metrics if r["event"] == "sent"]
    assert versions and sent
    # Every version is published no earlier than the contributions it merged arrived.
    arrival = {(r["learner"], r["seq"]): r["time"] for r in sent}
    for v in versions:
        assert all(v["time"] > arrival[tuple(k)] for k in v["consumed"])


class _FakeTime:
    """``time.time`` and ``time.sleep`` of a test: sleeping advances the time, instantly."""

    def __init__(self) -> None:
        self.t, self.slept = 1000.0, []

    def time(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 9))
        self.t += seconds


class _Loss:
    """A dispatched step's loss: waiting for it takes the step's compute, 0.5 s."""

    def __init__(self, clock: _FakeTime) -> None:
        self.clock, self.waited = clock, False

    def block_until_ready(self) -> _Loss:
        if not self.waited:
            self.clock.t += 0.5
            self.waited = True
        return self

    def __float__(self) -> float:
        return 1.0


class _StubLearner:
    """What ``LearnerLoop.run`` uses of a learner, without a model: reading the batch and
    dispatching take 0.1 s, the compute is in the loss (``_Loss``); once dispatched, a step
    waits for the one before it, as ``Learner.train_step`` does."""

    id, fragments, tokens_per_step = "learner-0", [], 1

    def __init__(self, clock: _FakeTime) -> None:
        self.clock, self.step, self.seconds, self.losses = clock, 0, [], []
        self.added: list[float] = []  # what the loop gave beyond the steps' own seconds

    def train_step(self, seconds: float, position: float | None = None) -> _Loss:
        self.clock.t += 0.1
        self.wait_in_flight()
        self.step += 1
        self.seconds.append(round(seconds, 9))
        self.losses.append(_Loss(self.clock))
        return self.losses[-1]

    def wait_in_flight(self) -> None:
        if self.losses:
            self.losses[-1].block_until_ready()

    def add_seconds(self, seconds: float) -> None:
        self.added.append(round(seconds, 9))

    def due(self) -> None:
        return None

    def waiting_on(self) -> list[int]:
        return []

    def checkpoint(self) -> None:
        return None


class _NoTransport:
    def save_checkpoint(self, ckpt) -> None:
        pass

    def backed_up(self) -> bool:
        return False


def _slowed_run(monkeypatch, speeds: str, index: int, steps: int = 4):
    fake = _FakeTime()
    monkeypatch.setattr(time, "time", fake.time)
    monkeypatch.setattr(time, "sleep", fake.sleep)
    cfg = load_config("tiny", overrides=[f"pipeline.speeds={speeds}"])
    lrn = _StubLearner(fake)
    clock = WallClock(cfg.slowdown(index))
    loop = LearnerLoop(lrn, cfg, _NoTransport(), clock)
    assert all(r is STEP for r in loop.run(steps))
    return fake, lrn


def test_a_slowed_learner_sleeps_twice_its_step_time_at_factor_3(monkeypatch):
    """pipeline.speeds on the wall clock: a learner 3x slower waits for each step's compute
    and sleeps twice what the step took; the sleep is step time (records, goodput)."""
    fake, lrn = _slowed_run(monkeypatch, "[1, 1, 3, 3]", index=2)
    assert fake.slept == [1.2] * 4  # 2 x (0.1 dispatch + 0.5 compute), once per step
    assert all(loss.waited for loss in lrn.losses)
    # The time the loop measures for a step (what contributions carry, what the syncer's
    # grace window and the goodput count) is the slowed one: 3 x 0.6 s.
    assert lrn.seconds[1:] == [1.8] * 3
    assert lrn.added == [1.8]  # the last step's, given at the end of the call


def test_a_learner_at_factor_1_never_sleeps_and_keeps_one_step_in_flight(monkeypatch):
    fake, lrn = _slowed_run(monkeypatch, "[1, 1, 3, 3]", index=0)
    assert fake.slept == []
    # Each step is waited for once the next is dispatched, the last at the call's end:
    # the time measured is 4 x (0.1 dispatch + 0.5 compute), none of it lost.
    assert all(loss.waited for loss in lrn.losses)
    assert lrn.seconds[1:] == [0.1, 0.6, 0.6] and lrn.added == [1.1]
    assert sum(lrn.seconds) + sum(lrn.added) == pytest.approx(4 * 0.6)


def test_slowdowns_are_relative_to_the_fastest_learner(monkeypatch):
    """Hardware can be slowed, not sped up: [0.5, 0.5, 1, 1] runs as [1, 1, 2, 2]."""
    fake, _ = _slowed_run(monkeypatch, "[0.5, 0.5, 1, 1]", index=3, steps=2)
    assert fake.slept == [0.6, 0.6]
    fake, _ = _slowed_run(monkeypatch, "[0.5, 0.5, 1, 1]", index=1, steps=2)
    assert fake.slept == []
