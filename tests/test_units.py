"""Data taken in units (``data.assign = "units"``, ``diloco/units.py``): learners that
come and go train every window of an epoch once, none twice and none skipped."""

import time
from collections import Counter
from dataclasses import astuple

import numpy as np
import pytest

from diloco.config import load_config
from diloco.dataset import open_dataset, prepare
from diloco.units import MemoryLedger, Span, UnitPlan, UnitReader, cut
from tests.test_dataset import STDLIB


def prepare_stdlib(root, chunk_tokens: int) -> str:
    """About 230 KB of real text (two standard library packages), tokenized in chunks of
    ``chunk_tokens`` (a unit is 4 chunks): the data set's path."""
    for name in ("json", "logging"):
        for f in sorted((STDLIB / name).glob("*.py")):
            (root / "text" / name).mkdir(parents=True, exist_ok=True)
            (root / "text" / name / f.name).write_text(f.read_text())
    out = str(root / "tokens")
    prepare(str(root / "text"), out, vocab_size=512, chunk_tokens=chunk_tokens, shard_chunks=8)
    return out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    """About 230 KB of real text (two standard library packages), tokenized."""
    return prepare_stdlib(tmp_path_factory.mktemp("units"), chunk_tokens=2048)


def _covered(spans) -> Counter:
    """How often each (epoch, unit, window) is in ``spans``."""
    rows = (astuple(s) if isinstance(s, Span) else tuple(s) for s in spans)
    return Counter((e, u, w) for e, u, a, b in rows for w in range(a, b))


def _epoch(plan: UnitPlan, epoch: int) -> Counter:
    return Counter((epoch, u, w) for u in range(plan.units) for w in range(plan.windows(epoch, u)))


def test_a_stream_cut_gives_back_the_rest_of_its_unit_and_the_units_after():
    spans = [Span(0, 3, 0, 10), Span(0, 5, 4, 12), Span(1, 0, 0, 6)]
    assert cut(spans, 0) == ([], spans)
    assert cut(spans, 10) == ([spans[0]], spans[1:])
    kept, back = cut(spans, 13)
    assert kept == [Span(0, 3, 0, 10), Span(0, 5, 4, 7)]
    assert back == [Span(0, 5, 7, 12), Span(1, 0, 0, 6)]
    assert cut(spans, 100) == (spans, [])


@pytest.mark.parametrize("background", [False, True])
def test_learners_that_leave_and_join_read_every_window_of_an_epoch_once(prepared, background):
    """Three readers share a ledger: one leaves mid-unit (its slot resumes later at the
    same point), one leaves for good with a unit taken beyond where it resumes; what they
    gave back is read by the others first, and the readers' windows are the units'
    windows, in the order every holder follows. ``background``: each reader takes its
    next span in its own thread (as a learner over a bucket does)."""
    ds = open_dataset(prepared)
    plan = UnitPlan(ds, context=64, seed=3, shuffle_chunks=2)
    ledger = MemoryLedger(plan)
    batch = 4
    a, b, c = (UnitReader(plan, lid, ledger, batch, background=background)
               for lid in ("a", "b", "c"))  # fmt: skip
    per_epoch = sum(_epoch(plan, 0).values())
    assert plan.units >= 8 and per_epoch > 40 * batch  # several units, many batches

    def read(reader, n):
        """``n`` batches of ``reader``, each window checked against its span's unit: the
        windows a learner reads are the units' own, in the order every holder follows."""
        for _ in range(n):
            first = reader.position * batch
            out = reader.next_batch()
            spans = ledger.spans(reader.learner)
            starts = np.cumsum([0] + [s.windows for s in spans])
            for i in range(batch):
                j = int(np.searchsorted(starts, first + i, side="right") - 1)
                span = spans[j]
                unit = plan.read(span.epoch, span.unit)
                k, s = unit.windows[span.start + first + i - starts[j]]
                np.testing.assert_array_equal(out[i], unit.arrays[k][s : s + 65])

    read(a, 7)
    read(b, 5)
    read(c, 9)
    # a is preempted at step 5 (its newest send); it trained 7: steps 5 and 6 never merged
    a.settle()  # its take under way is given back too
    ledger.release("a", 5 * batch)
    read(b, 12)  # takes what a gave back before any new unit
    assert ledger.spans("b")[-1].epoch == 0
    # c vanishes and its slot is never held again: it resumes (nowhere) at step 4
    c.settle()
    ledger.release("c", 4 * batch)
    a.position = 5  # a's slot is joined again: it goes on from its resume point
    read(a, 3)

    def in_epoch0(reader) -> bool:  # reading a span of epoch 0, or one still to come
        return any(s.epoch == 0 for s in cut(ledger.spans(reader.learner),
                                             reader.position * batch)[1])  # fmt: skip

    for _ in range(per_epoch):  # on into the next epoch, until both are out of epoch 0
        if ledger.spans("b")[-1].epoch == 1 and not in_epoch0(a) and not in_epoch0(b):
            break
        read(b, 10)
        read(a, 10)
    trained = {r.learner: cut(ledger.spans(r.learner), r.position * batch)[0] for r in (a, b, c)}
    trained["c"] = cut(ledger.spans("c"), 4 * batch)[0]
    covered = _covered(s for spans in trained.values() for s in spans)
    assert max(covered.values()) == 1  # no window twice
    epoch0 = {k: n for k, n in covered.items() if k[0] == 0}
    assert epoch0 == _epoch(plan, 0)  # none skipped: returns are taken before new units


@pytest.mark.parametrize("through", ["memory", "bucket"])
def test_a_simulated_run_whose_learners_come_and_go_trains_each_window_once(
    prepared, through, tmp_path
):
    """`data.assign = "units"` in the simulator: a slot starts vacant and is joined, a
    learner is preempted (with notice) and its slot joined again, another leaves with
    no notice for good; over more than an epoch no window is trained twice, and every
    unit handed out is trained whole or still held or given back. In memory (one pool)
    that is every window of the first epoch. Through buckets of two regions (``diloco
    simulate --store``), each region's pool in its own bucket: another process's ledgers
    read the same spans back, and no claim is left that no learner took."""
    from diloco.simulate import simulate
    from flows.ledger import region_ledger
    from flows.run import simulation_store
    from storage_layout.store import RunStore

    over = [
        f"data.source={prepared}", "model.vocab_size=512", "data.assign=units",
        "budget.tokens=120000", "sim.eval_points=2", "topology.tau=1",
        "pipeline.learners_started=3",
        'sim.joins=[{"learner": 3, "at": 0.2}, {"learner": 1, "at": 0.5}]',
        'sim.failures=[{"learner": 1, "at": 0.3, "notice": true}, {"learner": 2, "at": 0.6}]',
    ]  # fmt: skip
    cfg = load_config("tiny", mode="decoupled", overrides=over)
    plan = UnitPlan(open_dataset(prepared), cfg.model.context, cfg.seed)
    regions = {r: f"file://{tmp_path / r}" for r in ("us", "eu")}
    store = None
    if through == "bucket":
        for r in regions:
            (tmp_path / r).mkdir()
        store = simulation_store("u", regions)
    result = simulate(cfg, store=store)
    if through == "bucket":
        from flows.ledger import audit_units
        from storage_layout.audit import audit_run

        learners = RunStore("u", regions, "us").read_spec()["learners"]
        assert set(learners.values()) == {"us", "eu"}
        for lid, spans in result.summary["data_spans"].items():
            r = learners[lid]
            again = region_ledger(RunStore("u", {r: regions[r]}, r), plan, learners, r)
            assert [astuple(s) for s in again.spans(lid)] == [tuple(s) for s in spans], lid
            assert again.orphans() == []
        report = audit_run("u", regions)  # the ledger's records are the layout's own
        audit_units(report)  # no window merged from two learners
        assert report.ok, report.violations
        assert set(report.units) == {"us", "eu"}
        assert all(pool["orphan_claims"] == [] for pool in report.units.values())
        from storage_layout.inspect import inspect_bucket

        (shown,) = inspect_bucket(regions["us"], run="u")["runs"]  # each pool, by listings
        assert {r: p["handed_out"] for r, p in shown["units"].items()} == {
            r: p["units_handed_out"] for r, p in report.units.items()}  # fmt: skip
        # A take record rewritten to name another learner's first span: the audit names
        # the windows both merged.
        a, b = "learner-0", "learner-3"
        assert report.data[a][0][0] == report.data[b][0][0] == 0, report.data
        first = {lid: tmp_path / learners[lid] / "u" / "learners" / lid / "units" /
                 "s000000000001.json" for lid in (a, b)}  # fmt: skip
        first[b].write_bytes(first[a].read_bytes())
        forged = audit_run("u", regions)
        audit_units(forged)
        found = forged.violations["data-once"]
        assert any(f"merged from {a} and from {b}" in v or f"merged from {b} and from {a}" in v
                   for v in found), found  # fmt: skip
    # Each learner's merged data is its stream up to its newest send (its final sends
    # carry every step it trained; one that left unannounced lost the steps after).
    sent: dict[str, int] = {}
    for e in result.metrics:
        if e["event"] == "sent":
            sent[e["learner"]] = max(sent.get(e["learner"], 0), e["step"])
    last = {e["learner"]: e["event"] for e in result.metrics
            if e["event"] in ("failure", "join", "rejoin")}  # fmt: skip
    vacant = {lid for lid, event in last.items() if event == "failure"}
    assert vacant == {"learner-2"}, last
    merged, pending = Counter(), _covered(result.summary["data_returned"])
    for lid, held in result.summary["data_spans"].items():
        done, rest = cut([Span(*s) for s in held], sent.get(lid, 0) * cfg.data.batch_size)
        merged += _covered(done)
        if lid in vacant:  # nobody holds the slot: what it held past its sends is lost
            assert rest == [], f"{lid} left holding {rest}: given back to no one"
        else:  # the rest of the unit it was in when the budget ran out
            pending += _covered(rest)
    assert merged and max(merged.values()) == 1  # no window trained twice
    assert not set(pending) & set(merged) and max(pending.values(), default=1) == 1
    assert any(e == 1 for e, _, _ in merged), "the run did not pass its first epoch"
    # None skipped: a unit handed out is merged whole, or what is not is still to train.
    accounted = merged + pending
    for e, u in {(e, u) for e, u, _ in accounted}:
        assert {w for (e2, u2, w), n in accounted.items() if (e2, u2) == (e, u)} == set(
            range(plan.windows(e, u))), (e, u)  # fmt: skip
    if through == "memory":  # one pool: every unit of the first epoch was handed out
        assert {k: n for k, n in accounted.items() if k[0] == 0} == _epoch(plan, 0)
    assert sum(merged.values()) >= cfg.budget_steps * cfg.data.batch_size


def test_learners_racing_for_units_through_a_bucket_each_get_their_own(prepared, tmp_path):
    """Four learners' ledgers, each over its own store (as separate processes are), take
    units at the same time: no unit is handed out twice, and a span one gives back is
    taken by exactly one of the others."""
    import threading

    from flows.ledger import BucketLedger
    from storage_layout.store import RunStore

    regions = {"us": f"file://{tmp_path / 'us'}"}
    (tmp_path / "us").mkdir()
    plan = UnitPlan(open_dataset(prepared), context=64, seed=0)
    ids = [f"learner-{i}" for i in range(4)]
    ledgers = {lid: BucketLedger(RunStore("race", regions, "us", writer=lid), plan, ids)
               for lid in ids}  # fmt: skip
    barrier = threading.Barrier(len(ids))

    def take(lid, n):
        barrier.wait()
        for _ in range(n):
            ledgers[lid].take(lid)

    threads = [threading.Thread(target=take, args=(lid, 6)) for lid in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    held = [astuple(s)[:2] for lid in ids for s in ledgers[lid].spans(lid)]
    assert len(held) == 24 and len(set(held)) == 24  # each (epoch, unit) once
    ledgers["learner-0"].release("learner-0", 0)  # gives back all six
    back = ledgers["learner-1"].given_back()
    assert len(back) == 6
    barrier = threading.Barrier(3)
    threads = [threading.Thread(target=take, args=(lid, 3)) for lid in ids[1:]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    taken = [s for lid in ids[1:] for s in ledgers[lid].spans(lid)[6:]]
    assert sorted(taken)[:6] == sorted(back) and len(set(taken)) == 9  # the returns first
    assert ledgers["learner-2"].given_back() == []
    assert ledgers["learner-3"].orphans() == []


def test_a_take_that_died_between_its_claim_and_its_record_is_taken_again_by_its_learner(
    prepared, tmp_path
):
    """A learner process killed after it claimed a span and before it recorded the take
    leaves a claim that no one trains (an orphan): the next process of that learner takes
    it first; another learner's ledger leaves it alone (it may be a take under way)."""
    from flows.ledger import BucketLedger
    from storage_layout.store import RunStore

    regions = {"us": f"file://{tmp_path / 'us'}"}
    (tmp_path / "us").mkdir()
    plan = UnitPlan(open_dataset(prepared), context=64, seed=0)
    ids = ["learner-0", "learner-1", "learner-2"]

    def ledger(lid):  # a new process's ledger
        return BucketLedger(RunStore("o", regions, "us", writer=lid), plan, ids)

    ledger("learner-1").take("learner-1")
    ledger("learner-1").release("learner-1", 5)  # gives back the rest of its unit
    dying = RunStore("o", regions, "us", writer="learner-0")
    fresh = dying.claim_fresh_unit("learner-0")  # ... and the process dies here
    back = "learner-1-s2-0"  # span 0 that learner-1's record 2 gave back
    assert dying.claim_returned(back, "learner-0")  # (another of its lives)
    assert sorted(ledger("learner-2").orphans()) == sorted([f"fresh-{fresh}", back])
    other = ledger("learner-2").take("learner-2")
    assert other == plan.fresh(fresh, (0, 1))  # the next unit: not an orphan of another
    again = ledger("learner-0")
    took = [again.take("learner-0"), again.take("learner-0"), again.take("learner-0")]
    first = plan.fresh(0, (0, 1))  # learner-1's unit, from window 5 on
    returned = Span(first.epoch, first.unit, 5, first.end)
    assert sorted(took[:2]) == sorted([plan.fresh(fresh - 1, (0, 1)), returned])
    assert took[2] == plan.fresh(fresh + 1, (0, 1))  # then on as before
    assert again.orphans() == []


def _worker_run(prepared, tmp_path, run):
    """A run of two learner slots in one region on units, its learners far from done:
    (config, regions, store, spec, the first learner's id)."""
    from flows.run import initialize_run
    from storage_layout.store import RunStore

    cfg = load_config("tiny", overrides=[
        f"data.source={prepared}", "model.vocab_size=512", "data.assign=units",
        "budget.tokens=50000000", "topology.learners=2", "pipeline.round_steps=20",
        "pipeline.checkpoint_every=20", "pipeline.poll_seconds=0.05",
    ])  # fmt: skip
    regions = {"us-east": f"file://{tmp_path / 'us'}"}
    (tmp_path / "us").mkdir()
    store = RunStore(run, regions, "us-east")
    spec = initialize_run(store, cfg)
    return cfg, regions, store, spec, next(iter(spec["learners"]))


def test_a_learner_worker_takes_units_from_its_regions_bucket_and_gives_back_as_it_leaves(
    prepared, tmp_path, prefect_api
):
    """A pipeline learner (a worker process) with `data.assign = "units"`: it takes
    spans through its region's bucket as it trains; told it is preempted (SIGTERM, once
    its first send commits) it sends, checkpoints and gives back its stream from that
    step: the rest of its unit is offered to the next learner of its region."""
    from flows.ledger import region_ledger
    from tests.test_pipeline import preempted_worker

    cfg, _regions, store, spec, lid = _worker_run(prepared, tmp_path, "pu")
    preempted_worker(store, cfg, lid, tmp_path / "learner.log")
    step = store.read_metrics(lid)["step"]
    plan = UnitPlan(open_dataset(prepared), cfg.model.context, cfg.seed)
    ledger = region_ledger(store, plan, spec["learners"], "us-east")
    held = ledger.spans(lid)
    assert held and sum(s.windows for s in held) == step * cfg.data.batch_size, (held, step)
    back = ledger.given_back()
    assert back, "the rest of its unit was not given back"
    assert _covered(back).keys().isdisjoint(_covered(held).keys())
    other = next(x for x in spec["learners"] if x != lid)
    assert ledger.take(other) == back[0]  # the next learner of the region takes it first
    assert ledger.orphans() == []


def test_units_take_a_prepared_data_set_and_a_bad_ledger_record_is_named(prepared, tmp_path):
    """Units of a text source are refused before anything is written; a ledger record
    that names no span of the data set's units (damaged, forged) is an error naming its
    key, and so is a release that gives back what its learner did not hold."""
    from diloco.data import DataError
    from flows.ledger import BucketLedger
    from flows.run import initialize_run
    from storage_layout.store import RunStore

    (tmp_path / "us").mkdir()
    store = RunStore("u", {"us": f"file://{tmp_path / 'us'}"}, "us")
    with pytest.raises(DataError, match=r"data.assign = 'units' takes a prepared data set"):
        initialize_run(store, load_config("tiny", overrides=["data.assign=units"]))
    assert not list((tmp_path / "us").iterdir())  # nothing written
    plan = UnitPlan(open_dataset(prepared), context=64, seed=0)
    ledger = BucketLedger(store, plan, ["learner-0"])
    span = ledger.take("learner-0")
    store.put_unit_record("learner-0", {"take": [0, plan.units, 0, 5], "claim": "x"})
    with pytest.raises(DataError, match=r"learner-0/units/s000000000002.json: \[0, \d+, 0, 5\] "
                       "is not a span of a unit of this data set"):  # fmt: skip
        BucketLedger(store, plan, ["learner-0"]).spans("learner-0")
    other = RunStore("v", {"us": f"file://{tmp_path / 'us'}"}, "us")
    ledger = BucketLedger(other, plan, ["learner-0"])
    span = ledger.take("learner-0")
    other.put_unit_record("learner-0", {"release": 0, "returned": [[0, span.unit, 0, 1]]})
    with pytest.raises(DataError, match="not what learner-0 held from window 0 on"):
        BucketLedger(other, plan, ["learner-0"]).spans("learner-0")


def test_a_silent_learner_is_fenced_and_its_data_given_back_by_the_syncers(
    prepared, tmp_path, prefect_api
):
    """A learner worker on units stopped (SIGSTOP) as it trains, once its first send
    commits, at a point where it holds windows past where its slot resumes: silent past
    `pipeline.member_timeout` on the syncer's clock, the syncer's transport fences it
    (claims its next generation) and, a grace later, gives back its stream from where a
    restart would resume. Woken (SIGCONT), the learner commits nothing more and stops."""
    import logging
    import signal
    import subprocess

    from diloco.loops import resume_step
    from diloco.topology import learner_index
    from flows.ledger import SilentReleases, region_ledger
    from flows.run import bucket_store
    from flows.spares import WORKER_COMMAND
    from flows.supervision import child_env
    from flows.syncer import PipelineSyncerTransport

    cfg, regions, store, spec, lid = _worker_run(prepared, tmp_path, "si")
    plan = UnitPlan(open_dataset(prepared), cfg.model.context, cfg.seed)
    ledger = region_ledger(store, plan, spec["learners"], "us-east")
    syncer_store = bucket_store("si", regions, spec, cfg, "syncer-0", home="us-east")
    batch = cfg.data.batch_size

    def resumes_at() -> int:  # where a restart of the learner would resume (windows)
        steps = store.checkpoint_steps(lid)
        return resume_step(steps[-1] if steps else 0, syncer_store.sent_so_far(lid)[1]) * batch

    argv = [*WORKER_COMMAND, "learner", "--run", "si", "--bucket", regions["us-east"],
            "--region", "us-east", "--index", str(learner_index(lid)),
            "--pipeline", cfg.pipeline.model_dump_json()]  # fmt: skip
    log = tmp_path / "learner.log"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=child_env())
    try:
        deadline = time.monotonic() + 300  # a guard against a hang, not a measure
        while True:  # stopped training, past its first send and holding windows past
            # where it resumes (a learner compiling or resuming may be slow, not gone)
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            training = (store.read_metrics(lid) or {}).get("state") == "training"
            if training and any(store.contribution_seqs(lid, p, "us-east") for p in range(2)):
                proc.send_signal(signal.SIGSTOP)
                at = resumes_at()
                held = ledger.spans(lid)
                if sum(s.windows for s in held) > at:
                    break
                proc.send_signal(signal.SIGCONT)
            time.sleep(0.1)
        now = [0.0]
        transport = PipelineSyncerTransport(syncer_store, [0, 1], 100, 4, logging.getLogger(),
                                            clock=lambda: now[0], member_timeout=5.0)  # fmt: skip
        transport.releases = SilentReleases(syncer_store, plan, batch, logging.getLogger())
        generation = store.newest_generation(lid)
        for t in (0.0, 6.0):  # heard, then silent past the timeout: fenced
            now[0] = t
            assert lid in transport.members() or t > 0
        assert lid not in transport.members()
        assert store.newest_generation(lid) == generation + 1
        assert "fence" in store.generation(lid, generation + 1)
        assert ledger.given_back() == []  # not yet: a commit under way lands first
        for t in (12.0, 18.0):
            now[0] = t
            transport.members()
        kept, back = cut(held, at)
        assert ledger.spans(lid) == kept and ledger.given_back() == back and back
        now[0] = 30.0
        transport.members()  # silent still: nothing more to do
        assert store.newest_generation(lid) == generation + 1
        other = next(x for x in spec["learners"] if x != lid)
        assert store.newest_generation(other) == 0  # never started: not fenced, vacant
        sent = {p: store.contribution_seqs(lid, p, "us-east") for p in range(2)}
        proc.send_signal(signal.SIGCONT)
        proc.wait(timeout=300)  # a guard against a hang
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "fenced off by" in text and "its data given back" in text, text[-3000:]
    assert {p: store.contribution_seqs(lid, p, "us-east") for p in range(2)} == sent
    assert ledger.take(other) == back[0]  # the region's next learner takes it first


def test_only_a_learner_silent_as_it_trained_is_fenced(prepared, tmp_path):
    """The syncers fence and give back the data of a learner whose newest status says it
    was training; one silent while compiling or resuming (slow, perhaps, not gone) keeps
    its slot and its spans. Statuses written by hand, the syncer's clock a fake one."""
    import logging

    from flows.ledger import SilentReleases, region_ledger
    from flows.run import bucket_store
    from flows.syncer import PipelineSyncerTransport

    cfg, regions, store, spec, lid = _worker_run(prepared, tmp_path, "gate")
    plan = UnitPlan(open_dataset(prepared), cfg.model.context, cfg.seed)
    store.claim_generation(lid)  # it started ...
    region_ledger(store, plan, spec["learners"], "us-east").take(lid)  # ... and took data
    syncer_store = bucket_store("gate", regions, spec, cfg, "syncer-0", home="us-east")
    now = [0.0]
    transport = PipelineSyncerTransport(syncer_store, [0, 1], 100, 4, logging.getLogger(),
                                        clock=lambda: now[0], member_timeout=5.0)  # fmt: skip
    transport.releases = SilentReleases(syncer_store, plan, cfg.data.batch_size,
                                        logging.getLogger(), grace=0.0)  # fmt: skip
    for t, state in enumerate(("compiling", "resuming", "training")):
        store.write_metrics(lid, {"state": state, "time": t, "step": 0})
        for dt in (0.0, 6.0, 12.0):  # heard, silent past the timeout, and a grace later
            now[0] = 100.0 * t + dt
            transport.members()
        fenced = store.newest_generation(lid) == 2
        assert fenced == (state == "training"), state
    assert region_ledger(store, plan, spec["learners"], "us-east").spans(lid) == []


def test_a_follower_reads_the_spans_process_0_took_and_never_waits_for_ever(prepared, tmp_path):
    """A learner's follower process (``FollowedLedger``) gets the spans its process 0
    recorded, in order, and writes nothing; a take process 0 never records ends in an
    error naming it after ``patience``, or at once when the learner closes."""
    from diloco.data import DataError
    from flows.ledger import BucketLedger, FollowedLedger
    from storage_layout.store import RunStore

    regions = {"us": f"file://{tmp_path / 'us'}"}
    (tmp_path / "us").mkdir()
    plan = UnitPlan(open_dataset(prepared), context=64, seed=0)
    leader = BucketLedger(RunStore("f", regions, "us"), plan, ["learner-0"])
    follower = FollowedLedger(BucketLedger(RunStore("f", regions, "us"), plan, ["learner-0"]),
                              poll=0.01, patience=0.3)  # fmt: skip
    took = [leader.take("learner-0"), leader.take("learner-0")]
    assert follower.spans("learner-0") == took  # a resume: what process 0 holds
    follower.release("learner-0", 0)  # nothing: process 0 gives back
    assert leader.spans("learner-0") == took
    with pytest.raises(DataError, match=r"process 0 of learner-0 recorded no take of span 2 "
                       r"of its data in \d+ s"):  # fmt: skip
        follower.take("learner-0")
    follower.patience = 3600.0
    follower.stop.set()
    with pytest.raises(DataError, match=r"recorded no take .*: the learner is closing"):
        follower.take("learner-0")
    took.append(leader.take("learner-0"))
    follower.stop.clear()
    assert follower.take("learner-0") == took[2]
