"""Data taken in units (``data.assign = "units"``, ``diloco/units.py``): learners that
come and go train every window of an epoch once, none twice and none skipped."""

import json
import time
from collections import Counter
from dataclasses import astuple
from pathlib import Path

import numpy as np
import pytest

from diloco.config import LivenessConfig, load_config
from diloco.dataset import open_dataset
from diloco.prepare import prepare
from diloco.records import version_id
from diloco.units import MemoryLedger, Span, UnitPlan, UnitReader, cut, pool_unit
from protocol.topology import run_slots
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
    from flows.ledger import region_ledger, region_pools
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
        from flows.ledger_audit import audit_units
        from storage_layout.audit import audit_run

        spec = RunStore("u", regions, "us").read_spec()
        learners = run_slots(spec)
        assert set(learners.values()) == {"us", "eu"}
        for lid, spans in result.summary["data_spans"].items():
            r = learners[lid]
            again = region_ledger(RunStore("u", {r: regions[r]}, r), plan, learners, r,
                                  pools=region_pools(spec))  # fmt: skip
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
    accounted = _trained_once(result, cfg, plan, {"learner-2"})
    if through == "memory":  # one pool: every unit of the first epoch was handed out
        assert {k: n for k, n in accounted.items() if k[0] == 0} == _epoch(plan, 0)


def _trained_once(result, cfg, plan: UnitPlan, vacant: set[str]) -> Counter:
    """Checks that a simulated run on units trained no window twice and left none of a
    unit it handed out behind (``vacant``: the slots left empty at the end), past its
    first epoch; returns how often each window was merged or is still to train."""
    # Each learner's merged data is its stream up to its newest send (its final sends
    # carry every step it trained; one that left unannounced lost the steps after).
    sent: dict[str, int] = {}
    for e in result.metrics:
        if e["event"] == "sent":
            sent[e["learner"]] = max(sent.get(e["learner"], 0), e["step"])
    last = {e["learner"]: e["event"] for e in result.metrics
            if e["event"] in ("failure", "join", "rejoin")}  # fmt: skip
    assert {lid for lid, event in last.items() if event == "failure"} == vacant, last
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
    assert sum(merged.values()) >= cfg.budget_steps * cfg.data.batch_size
    return accounted


def _audit_clean_with_added(run: str, regions: dict, added: str):
    """The run's audit, with its data ledger's: clean, and ``added`` known as a learner a
    joiner added, its work merged. Returns the report."""
    from flows.ledger_audit import audit_units
    from storage_layout.audit import audit_run

    report = audit_run(run, regions)
    audit_units(report)
    assert report.ok, report.violations
    assert report.learners[added]["added"] and report.learners[added]["tokens"]["merged"] > 0
    return report


def _simulate_two_regions(prepared: str, tmp_path, run: str, *events: str):
    """`simulate --store` of ``tiny`` on units of ``prepared`` (a prepared data set, or
    text) over two file:// regions (us, eu) with the membership ``events`` (``sim.*``
    overrides): its config, unit plan, regions, result."""
    from diloco.run_data import RunData
    from diloco.simulate import simulate
    from flows.run import simulation_store

    over = [
        f"data.source={prepared}", "model.vocab_size=512", "data.assign=units",
        "budget.tokens=120000", "sim.eval_points=2", "topology.tau=1", *events,
    ]  # fmt: skip
    cfg = load_config("tiny", mode="decoupled", overrides=over)
    plan = RunData(cfg).units
    regions = {r: f"file://{tmp_path / r}" for r in ("us", "eu")}
    for r in regions:
        (tmp_path / r).mkdir()
    return cfg, plan, regions, simulate(cfg, store=simulation_store(run, regions))


def test_a_run_on_text_takes_it_in_units_and_grows_beyond_its_slots(tmp_path, monkeypatch):
    """Text, not only a prepared data set, is taken in units (``data.assign = "units"``),
    so a run on text grows too (it was refused: 'takes a prepared data set'). Its training
    split, as the byte reader reads it into one shard, is cut into chunks that cover it
    in order; through buckets of two regions, learner 4 joins beyond the run's four slots
    and its work is merged, no window is trained twice and none of a unit handed out is
    skipped, the audit is clean; the held-out batches are those of a run on slots."""
    from diloco import dataset
    from diloco.run_data import RunData, cached_corpus

    monkeypatch.setattr(dataset, "TEXT_CHUNK_BYTES", 4096)  # 48 KB of text: a dozen chunks
    text = tmp_path / "text"
    text.mkdir()
    for f in sorted((STDLIB / "json").glob("*.py")):
        (text / f.name).write_text(f.read_text())
    cfg, plan, regions, result = _simulate_two_regions(
        str(text), tmp_path, "t", 'sim.joins=[{"learner": 4, "at": 0.2}]')  # fmt: skip
    whole = cached_corpus(str(text), 1, cfg.data.val_percent).train_shards[0]
    read = [plan.dataset.read_chunk(c) for c in plan.chunks]
    assert len(read) == -(-len(whole) // 4096) and np.array_equal(np.concatenate(read), whole)
    _trained_once(result, cfg, plan, set())
    _audit_clean_with_added("t", regions, "learner-4")
    slots = load_config("tiny", overrides=[f"data.source={text}", "data.assign=slots",
                                          "topology.learners=1"])  # fmt: skip
    assert all(map(np.array_equal, RunData(cfg).validation, RunData(slots).validation))


def test_a_simulated_region_whose_learners_all_leave_leaves_no_data_of_an_epoch_behind(
    prepared, tmp_path
):
    """Through buckets of two regions, both learners of ``eu`` leave early for good (no
    notice): the syncers offer eu's pool to the learners of ``us`` (``UnitOffers``, at
    their looks at the members, as in the pipeline), so every window of the first epoch
    is trained once, none twice, and the audit's data check is clean."""
    from flows.ledger_audit import audit_units
    from storage_layout.audit import audit_run
    from storage_layout.inspect import inspect_bucket

    cfg, plan, regions, result = _simulate_two_regions(
        prepared, tmp_path, "r",
        'sim.failures=[{"learner": 1, "at": 0.1}, {"learner": 3, "at": 0.15}]')  # fmt: skip
    accounted = _trained_once(result, cfg, plan, {"learner-1", "learner-3"})
    assert {k: n for k, n in accounted.items() if k[0] == 0} == _epoch(plan, 0)
    report = audit_run("r", regions)
    audit_units(report)
    assert report.ok, report.violations
    assert report.units["eu"]["moved_out"] > 0 and report.units["us"]["moved_out"] == 0
    assert all(pool["orphan_claims"] == [] for pool in report.units.values())
    assert all("moved_not_offered" not in pool for pool in report.units.values())
    (shown,) = inspect_bucket(regions["us"], run="r")["runs"]  # by listings
    assert shown["units"]["us"]["offered_here"] == report.units["eu"]["moved_out"]
    # A claim moved out whose offer is gone (a syncer died between the two, and no
    # other looked since) is named: its span is trained by no one.
    lost = next(iter((tmp_path / "us" / "r" / "units" / "offered").iterdir()))
    lost.unlink()
    report = audit_run("r", regions)
    audit_units(report)
    assert report.units["eu"]["moved_not_offered"] == [lost.name.removesuffix(".json")]
    # Claims in the name of no learner of the run (forged: the next number, one far
    # ahead): their data is trained by no one, and the audit fails naming each.
    fresh = tmp_path / "us" / "r" / "units" / "fresh"
    near = max(int(p.name[1:13]) for p in fresh.iterdir()) + 1
    for n in (near, 999_999_999_999):
        (fresh / f"s{n:012d}.json").write_text(json.dumps({"learner": "ghost"}))
    report = audit_run("r", regions)
    audit_units(report)
    strangers = report.violations["no-strangers"]
    assert len(strangers) == 2 and f"fresh-{near} was made by 'ghost'" in strangers[0], strangers
    assert report.units["us"]["units_handed_out"] == near  # the far one moves no frontier


def test_a_simulated_run_adds_learners_beyond_its_slots_and_merges_their_work(prepared, tmp_path):
    """Through buckets of two regions, learners 4 and 5 join a run of four slots
    (``sim.joins`` beyond them, as ``diloco join`` adds a slot when none is vacant), and
    learner 4 leaves for good later. Each is added in the region its index falls on (its
    member record there), the syncers admit it (``SyncerLoop.admit``, the pipeline's
    loop) and merge its work, the versions record it among their members while it is
    there, no window is trained twice, and the audit is clean and knows them as added."""
    from diloco import records
    from flows.ledger_audit import audit_units
    from storage_layout.audit import audit_run
    from storage_layout.inspect import inspect_bucket

    cfg, plan, regions, result = _simulate_two_regions(
        prepared, tmp_path, "g", 'sim.joins=[{"learner": 4, "at": 0.2}, {"learner": 5, "at": 0.3}]',
        'sim.failures=[{"learner": 4, "at": 0.6}]')  # fmt: skip
    _trained_once(result, cfg, plan, {"learner-4"})
    for lid, region in (("learner-4", "us"), ("learner-5", "eu")):  # index mod 4's region
        record = json.loads((tmp_path / region / "g" / "members" / f"{lid}.json").read_text())
        assert (record["learner"], record["region"]) == (lid, region)
    assert [e["learner"] for e in result.metrics if e["event"] == "join"] == [
        "learner-4", "learner-5"]  # fmt: skip
    versions = records.of(result.metrics, "version")
    assert any({"learner-4", "learner-5"} <= set(v["members"]) for v in versions)
    assert versions[-1]["members"] == ["learner-0", "learner-1", "learner-2", "learner-3",
                                       "learner-5"]  # fmt: skip
    report = audit_run("g", regions)
    audit_units(report)
    assert report.ok, report.violations
    for lid in ("learner-4", "learner-5"):
        assert report.learners[lid]["added"] and report.learners[lid]["tokens"]["merged"] > 0
    (shown,) = inspect_bucket(regions["eu"], run="g")["runs"]
    assert {row["learner"]: row["host"] for row in shown["learners"] if row.get("added")} == {
        "learner-4": "simulator", "learner-5": "simulator"}  # fmt: skip
    assert len(shown["learners"]) == 6


def test_a_run_grows_into_a_region_it_started_no_learner_in(prepared, tmp_path):
    """One learner over two regions: eu starts none. Its pool of units is the run's from
    the start (``region_pools`` over the spec's deal) and the syncers move its spans to
    us until a learner trains in eu; learner 1 joins beyond the one slot, is added in eu
    (learner-i lives in region i mod 2 of the deal), takes units from eu's pool and its
    work is merged; no window is trained twice and none of a unit handed out is skipped,
    the audit is clean."""
    from flows.ledger import region_pools
    from storage_layout.store import RunStore

    cfg, plan, regions, result = _simulate_two_regions(
        prepared, tmp_path, "e", "topology.learners=1", "topology.quorum=1",
        'sim.joins=[{"learner": 1, "at": 0.3}]')  # fmt: skip
    spec = RunStore("e", regions, "us").read_spec()
    assert run_slots(spec) == {"learner-0": "us"} and spec["deal"] == ["us", "eu"]
    assert region_pools(spec) == {"eu": (0, 2), "us": (1, 2)}
    record = json.loads((tmp_path / "eu" / "e" / "members" / "learner-1.json").read_text())
    assert (record["learner"], record["region"]) == ("learner-1", "eu")
    _trained_once(result, cfg, plan, set())
    report = _audit_clean_with_added("e", regions, "learner-1")
    assert report.units["eu"]["moved_out"] > 0  # trained in us while eu had no learner
    assert report.units["eu"]["units_handed_out"] > report.units["eu"]["moved_out"]


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
    fresh = dying.units.claim_fresh_unit("learner-0")  # ... and the process dies here
    back = "learner-1-s2-0"  # span 0 that learner-1's record 2 gave back
    assert dying.units.claim_returned(back, "learner-0")  # (another of its lives)
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


def test_a_forged_unit_claim_far_ahead_neither_skips_units_nor_stops_a_take(prepared, tmp_path):
    """Fresh claims are dense: a claim written far ahead by someone else (unit 50, or the
    last number a key can hold) is passed over, the units below it handed out in turn;
    one forged at the next number is skipped by the take (claimed: a stranger's, which
    the audit names)."""
    from flows.ledger import BucketLedger
    from storage_layout.store import RunStore

    regions = {"us": f"file://{tmp_path / 'us'}"}
    (tmp_path / "us").mkdir()
    plan = UnitPlan(open_dataset(prepared), context=64, seed=0)
    store = RunStore("f", regions, "us", writer="learner-0")
    ledger = BucketLedger(store, plan, ["learner-0"])
    first = ledger.take("learner-0")
    fresh = tmp_path / "us" / "f" / "units" / "fresh"
    for n in (50, 999_999_999_999, 3):
        (fresh / f"s{n:012d}.json").write_text(json.dumps({"learner": "ghost"}))
    again = BucketLedger(RunStore("f", regions, "us", writer="learner-0"), plan, ["learner-0"])
    took = [again.take("learner-0") for _ in range(3)]
    assert [first, *took] == [plan.fresh(u, (0, 1)) for u in (0, 1, 3, 4)]  # unit 2: ghost's
    assert store.units.fresh_frontier() == 5 and again.frontier() == plan.fresh(5, (0, 1)).epoch


def test_where_claims_are_tagged_a_forged_one_neither_skips_a_unit_nor_blocks_a_span(
    prepared, tmp_path, caplog
):
    """Issue 56: with the run's claims key (every process of a run with a secret holds
    it), a unit claim forged at the very next number, named plainly or with a made-up
    tag, is no claim: the take claims that number under its own tag, so no unit is
    skipped; a forged claim of a span given back does not keep it from being taken. Each
    is named as it is passed over."""
    from flows.ledger import BucketLedger
    from storage_layout.auth import claims_key
    from storage_layout.store import RunStore

    secret = "s" * 32
    regions = {"us": f"file://{tmp_path / 'us'}"}
    (tmp_path / "us").mkdir()
    plan = UnitPlan(open_dataset(prepared), context=64, seed=0)

    def ledger() -> BucketLedger:
        store = RunStore("t", regions, "us", writer="learner-0", claims_key=claims_key(secret, "t"))
        return BucketLedger(store, plan, ["learner-0", "learner-1"])

    first = ledger().take("learner-0")
    fresh = tmp_path / "us" / "t" / "units" / "fresh"
    (fresh / "s000000000002.json").write_text(json.dumps({"learner": "ghost"}))
    (fresh / "s000000000003.0123456789abcdef.json").write_text(json.dumps({"learner": "ghost"}))
    took = [ledger().take("learner-0") for _ in range(2)]
    assert [first, *took] == [plan.fresh(u, (0, 1)) for u in (0, 1, 2)]  # none skipped
    assert ledger().store.units.fresh_frontier() == 3
    # learner-0 gives its stream back; a forged claim of the first span given back
    ledger().release("learner-0", 0)
    back = ledger().given_back()
    returned = tmp_path / "us" / "t" / "units" / "returned"
    returned.mkdir(parents=True, exist_ok=True)
    (returned / "learner-0-s4-0.json").write_text(json.dumps({"learner": "ghost"}))
    assert ledger().given_back() == back and ledger().take("learner-1") == back[0]
    passed = [r.getMessage() for r in caplog.records if "passing over" in r.getMessage()]
    for name in (
        "s000000000002.json",
        "s000000000003.0123456789abcdef.json",
        "learner-0-s4-0.json",
    ):
        assert any(name in m for m in passed), (name, passed)


# A syncer's liveness rule that tells a learner silent after 5 s of its (fake) clock.
FAST_LIVENESS = LivenessConfig(heartbeat_seconds=1, silent_min_seconds=5, silent_max_seconds=5)


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
    return cfg, regions, store, spec, next(iter(run_slots(spec)))


@pytest.mark.parametrize("data", ["prepared", "text"])
def test_a_learner_worker_takes_units_from_its_regions_bucket_and_gives_back_as_it_leaves(
    prepared, data, tmp_path, prefect_api
):
    """A pipeline learner (a worker process) with `data.assign = "units"`, of a prepared
    data set or of text (the same files, as bytes): it takes spans through its region's
    bucket as it trains; told it is preempted (SIGTERM, once its first send commits) it
    sends, checkpoints and gives back its stream from that step: the rest of its unit is
    offered to the next learner of its region."""
    from diloco.run_data import RunData
    from flows.ledger import region_ledger, region_pools
    from tests.test_pipeline import preempted_worker

    source = prepared if data == "prepared" else str(Path(prepared).parent / "text")
    cfg, _regions, store, spec, lid = _worker_run(source, tmp_path, "pu")
    preempted_worker(store, cfg, lid, tmp_path / "learner.log")
    step = store.progress.read_metrics(lid)["step"]
    plan = RunData(cfg).units
    ledger = region_ledger(store, plan, run_slots(spec), "us-east", pools=region_pools(spec))
    held = ledger.spans(lid)
    assert held and sum(s.windows for s in held) == step * cfg.data.batch_size, (held, step)
    back = ledger.given_back()
    assert back, "the rest of its unit was not given back"
    assert _covered(back).keys().isdisjoint(_covered(held).keys())
    other = next(x for x in run_slots(spec) if x != lid)
    assert ledger.take(other) == back[0]  # the next learner of the region takes it first
    assert ledger.orphans() == []


def test_a_new_run_through_buckets_takes_its_data_in_units_and_a_started_one_keeps_its_way(
    prepared, tmp_path
):
    """``data.assign = "auto"``, the default: a new run through buckets takes its data in
    units, a prepared data set or text (its spec records "units", so joiners may add
    learners); the simulator in memory deals text to slots; a run started on slots, or
    before the spec recorded the key at all, resumes with the default config on slots (no
    spec mismatch, the same data order), and asking for units there is refused by name."""
    from diloco.run_data import settle_assign
    from flows.run import initialize_run
    from flows.spec import config_from_spec
    from storage_layout.store import RunStore, SpecMismatch

    (tmp_path / "us").mkdir()
    bucket = f"file://{tmp_path / 'us'}"
    on = [f"data.source={prepared}", "model.vocab_size=512"]
    default = load_config("tiny", overrides=on)
    assert default.data.assign == "auto"

    def started(run: str, cfg) -> str:
        spec = initialize_run(RunStore(run, {"us": bucket}, "us"), cfg)
        return spec["config"]["data"]["assign"]

    assert started("new", default) == "units" and started("new", default) == "units"
    assert started("text", load_config("tiny")) == "units"
    assert settle_assign(load_config("tiny")).data.assign == "slots"  # in memory
    assert settle_assign(default).data.assign == "units"
    assert started("text-old", load_config("tiny", overrides=["data.assign=slots"])) == "slots"
    assert started("text-old", load_config("tiny")) == "slots"
    assert started("old", load_config("tiny", overrides=[*on, "data.assign=slots"])) == "slots"
    assert started("old", default) == "slots"  # resumed as it began
    with pytest.raises(SpecMismatch, match=r"data.assign: stored 'slots', given 'units'"):
        started("old", load_config("tiny", overrides=[*on, "data.assign=units"]))
    # A spec written before data.assign existed: it took slots, and resumes so.
    path = tmp_path / "us" / RunStore("older", {"us": bucket}, "us").layout.spec
    started("older", load_config("tiny", overrides=[*on, "data.assign=slots"]))
    spec = json.loads(path.read_text())
    del spec["config"]["data"]["assign"]
    path.chmod(0o644)
    path.write_text(json.dumps(spec))
    assert started("older", default) == "slots"
    assert config_from_spec(RunStore("older", {"us": bucket}, "us").read_spec()).data.assign == (
        "slots"
    )


def test_units_take_a_prepared_data_set_and_a_bad_ledger_record_is_named(prepared, tmp_path):
    """Units of a text source too small to train on are refused by name before anything
    is written; a ledger record
    that names no span of the data set's units (damaged, forged) is an error naming its
    key, and so is a release that gives back what its learner did not hold."""
    from diloco.data import DataError
    from flows.ledger import BucketLedger
    from flows.run import initialize_run
    from storage_layout.store import RunStore

    (tmp_path / "us").mkdir()
    store = RunStore("u", {"us": f"file://{tmp_path / 'us'}"}, "us")
    small = tmp_path / "small.txt"
    small.write_text("too little text to train on\n" * 40)
    with pytest.raises(DataError, match=r"the training split of .*small.txt has 1064 bytes"):
        initialize_run(store, load_config("tiny", overrides=["data.assign=units",
                                                             f"data.source={small}"]))  # fmt: skip
    assert not list((tmp_path / "us").iterdir())  # nothing written
    plan = UnitPlan(open_dataset(prepared), context=64, seed=0)
    ledger = BucketLedger(store, plan, ["learner-0"])
    span = ledger.take("learner-0")
    store.units.put_unit_record("learner-0", {"take": [0, plan.units, 0, 5], "claim": "x"})
    with pytest.raises(DataError, match=r"learner-0/units/s000000000002.json: \[0, \d+, 0, 5\] "
                       "is not a span of a unit of this data set"):  # fmt: skip
        BucketLedger(store, plan, ["learner-0"]).spans("learner-0")
    other = RunStore("v", {"us": f"file://{tmp_path / 'us'}"}, "us")
    ledger = BucketLedger(other, plan, ["learner-0"])
    span = ledger.take("learner-0")
    other.units.put_unit_record("learner-0", {"release": 0, "returned": [[0, span.unit, 0, 1]]})
    with pytest.raises(DataError, match="not what learner-0 held from window 0 on"):
        BucketLedger(other, plan, ["learner-0"]).spans("learner-0")


def test_a_silent_learner_is_fenced_its_data_given_back_and_woken_it_rejoins(
    prepared, tmp_path, prefect_api
):
    """A learner worker on units stopped (SIGSTOP) as it trains, once its first send
    commits, at a point where it holds windows past where its slot resumes: its heartbeat
    silent on the syncer's clock, the syncer's transport fences it (claims its next
    generation) and, a grace later, gives back its stream from where a restart would
    resume. Woken (SIGCONT), the learner commits nothing more as the generation it was:
    it says so once, takes a new generation as a restart does, resumes from its newest
    checkpoint and sends again, from the data given to it."""
    import logging
    import signal
    import subprocess

    from diloco.learner_loop import resume_step
    from flows.ledger import region_ledger, region_pools
    from flows.run import bucket_store
    from flows.spares import WORKER_COMMAND
    from flows.supervision import child_env
    from flows.syncer_transport import PipelineSyncerTransport
    from flows.unit_offers import SilentReleases
    from protocol.topology import learner_index

    cfg, regions, store, spec, lid = _worker_run(prepared, tmp_path, "si")
    plan = UnitPlan(open_dataset(prepared), cfg.model.context, cfg.seed)
    ledger = region_ledger(store, plan, run_slots(spec), "us-east", pools=region_pools(spec))
    syncer_store = bucket_store("si", regions, spec, cfg, "syncer-0", home="us-east")
    batch = cfg.data.batch_size

    def resumes_at() -> int:  # where a restart of the learner would resume (windows)
        steps = store.checkpoints.checkpoint_steps(lid)
        # (as ``sent_so_far`` reads it, which also reserves seqs: the learner would stop)
        seqs = [
            (s, p)
            for p in range(2)
            for s in store.contributions.contribution_seqs(lid, p, "us-east")
        ]
        sent, step = max(seqs, default=None), 0
        if sent is not None:
            step = int(
                store.contributions.contribution_head(lid, sent[1], sent[0], "us-east").meta["step"]
            )
        return resume_step(steps[-1] if steps else 0, step) * batch

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
            training = (store.progress.read_metrics(lid) or {}).get("state") == "training"
            if training and any(
                store.contributions.contribution_seqs(lid, p, "us-east") for p in range(2)
            ):
                proc.send_signal(signal.SIGSTOP)
                at = resumes_at()
                held = ledger.spans(lid)
                if sum(s.windows for s in held) > at:
                    break
                proc.send_signal(signal.SIGCONT)
            time.sleep(0.1)
        now = [0.0]
        transport = PipelineSyncerTransport(syncer_store, [0, 1], 100, 4, logging.getLogger(),
                                            clock=lambda: now[0], liveness=FAST_LIVENESS)  # fmt: skip
        transport.releases = SilentReleases(syncer_store, plan, batch, logging.getLogger(),
                                            region_pools(spec))  # fmt: skip
        generation = store.members.newest_generation(lid)
        for t in (0.0, 6.0):  # heard, then silent past the timeout: fenced
            now[0] = t
            assert lid in transport.members() or t > 0
        assert lid not in transport.members()
        assert store.members.newest_generation(lid) == generation + 1
        assert "fence" in store.members.generation(lid, generation + 1)
        assert ledger.given_back() == []  # not yet: a commit under way lands first
        for t in (12.0, 18.0):
            now[0] = t
            transport.members()
        kept, back = cut(held, at)
        assert ledger.spans(lid) == kept and ledger.given_back() == back and back
        now[0] = 30.0
        transport.members()  # silent still: nothing more to do
        assert store.members.newest_generation(lid) == generation + 1
        other = next(x for x in run_slots(spec) if x != lid)
        assert store.members.newest_generation(other) == 0  # never started: not fenced, vacant
        sent = {p: store.contributions.contribution_seqs(lid, p, "us-east") for p in range(2)}
        newest_sent = max(max(s, default=0) for s in sent.values())
        proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 300  # a guard against a hang, not a measure
        while store.members.newest_generation(lid) < generation + 2 or not any(
            s > newest_sent
            for p in range(2)
            for s in store.contributions.contribution_seqs(lid, p, "us-east")
        ):  # back as a new generation, and sending again
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=300)  # a guard against a hang
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert text.count("was fenced off while alive") == 1, text[-6000:]
    assert "its data given back" in text and "takes a new generation" in text, text[-3000:]
    assert store.members.generation(lid, generation + 2).get("pid") == proc.pid  # the same process
    # What it sent as the fenced generation is what it had committed before the fence;
    # what it sends now starts after the resume point, from the spans it was given.
    after = {p: [s for s in store.contributions.contribution_seqs(lid, p, "us-east") if s not in sent[p]]
             for p in range(2)}  # fmt: skip
    heads = [
        store.contributions.contribution_head(lid, p, s, "us-east").meta
        for p in range(2)
        for s in after[p]
    ]
    assert heads and min(int(m["step"]) for m in heads) * batch > at
    took = ledger.spans(lid) + ledger.spans(other)
    assert back[0] in took or back[0] in ledger.given_back()  # given back: nobody lost it


def _syncer_looks(run, regions, spec, cfg, plan, grace: float):
    """A syncer's look at the members of a one-region run (``PipelineSyncerTransport``,
    its silent learners' data given back after ``grace``, silent after 5 s), at a
    time of a fake clock: ``look(t)``."""
    import logging

    from flows.ledger import region_pools
    from flows.run import bucket_store
    from flows.syncer_transport import PipelineSyncerTransport
    from flows.unit_offers import SilentReleases

    store = bucket_store(run, regions, spec, cfg, "syncer-0", home="us-east")
    now = [0.0]
    transport = PipelineSyncerTransport(store, [0, 1], 100, 4, logging.getLogger(),
                                        clock=lambda: now[0], liveness=FAST_LIVENESS)  # fmt: skip
    transport.releases = SilentReleases(store, plan, cfg.data.batch_size, logging.getLogger(),
                                        region_pools(spec), grace=grace)  # fmt: skip

    def look(t: float) -> list[str]:
        now[0] = t
        transport._members_read = -float("inf")  # a look now, not 5 s after the last
        return transport.members()

    return look


def test_a_syncer_admits_an_added_learner_within_a_second_and_reads_statuses_every_five(
    prepared, tmp_path, monkeypatch
):
    """Between its looks at the members (each learner's status, every ``MEMBERS_EVERY``),
    a syncer lists ``members/`` alone every ``ADMIT_EVERY``: a learner a joiner added is
    admitted within a second (it waited up to 5 s, most of a join's wait for its first
    merge on short rounds), and finding one makes the whole look then. The syncer's own
    clock, a fake one."""
    import logging

    from flows.pace import ADMIT_EVERY, MEMBERS_EVERY
    from flows.run import bucket_store
    from flows.syncer_transport import PipelineSyncerTransport

    cfg, regions, store, spec, _ = _worker_run(prepared, tmp_path, "admit")
    syncer = bucket_store("admit", regions, spec, cfg, "syncer-0", home="us-east")
    now, lists, statuses = [0.0], [], []
    transport = PipelineSyncerTransport(syncer, [0, 1], 100, 4, logging.getLogger(),
                                        clock=lambda: now[0])  # fmt: skip
    transport.spec = spec
    for part, name, calls in ((syncer.main.members, "run_learners", lists),
                              (syncer.main.progress, "read_metrics", statuses)):  # fmt: skip
        real = getattr(part, name)
        monkeypatch.setattr(part, name,
                            lambda *a, real=real, calls=calls, **k: calls.append(now[0])
                            or real(*a, **k))  # fmt: skip

    def look(t: float) -> list[str]:
        now[0] = t
        return transport.members()

    assert look(0.0) == list(run_slots(spec)) and lists == [0.0] and statuses
    whole = len(statuses)  # the statuses one whole look reads
    added = "learner-2"
    assert store.members.put_member(added, {"learner": added, "region": "us-east"}, None)
    assert added not in look(ADMIT_EVERY / 2) and lists == [0.0]  # not looked for yet
    assert len(statuses) == whole
    assert added in look(ADMIT_EVERY) and lists == [0.0, ADMIT_EVERY]
    assert len(statuses) > whole  # found: the whole look now, its status read too
    read = len(statuses)
    later = 2 * ADMIT_EVERY
    assert added in look(later) and lists[-1] == later and len(statuses) == read  # LIST only
    assert added in look(ADMIT_EVERY + MEMBERS_EVERY) and len(statuses) > read


def test_a_learner_is_fenced_when_its_heartbeat_stops_not_when_a_phase_is_long(prepared, tmp_path):
    """The syncers fence and give back the data of a learner whose heartbeat has stopped,
    whatever it was doing; one whose heartbeat goes on keeps its slot and its spans
    however long it compiles, resumes or trains a round (its status unchanged for
    minutes). Heartbeats written by hand, the syncer's clock a fake one."""

    from flows.ledger import region_ledger, region_pools

    cfg, regions, store, spec, lid = _worker_run(prepared, tmp_path, "gate")
    plan = UnitPlan(open_dataset(prepared), cfg.model.context, cfg.seed)
    generation = store.members.claim_generation(lid)  # it started ...
    region_ledger(store, plan, run_slots(spec), "us-east", pools=region_pools(spec)).take(
        lid
    )  # ... and took data
    look = _syncer_looks("gate", regions, spec, cfg, plan, grace=0.0)
    store.progress.write_metrics(lid, {"state": "compiling", "time": 0, "step": 0})  # never again
    beats = iter(range(1, 1000))

    def beat(state: str) -> None:
        store.members.write_heartbeat({"learner": lid, "generation": generation, "beat": next(beats),
                               "period": 1.0, "state": state, "step": 0, "sends": 0,
                               "time": 0.0})  # fmt: skip

    for t, state in enumerate(("compiling", "resuming", "training")):
        for dt in range(0, 60, 4):  # a minute in each phase, silent after 5 s
            beat(state)
            assert lid in look(100.0 * t + dt), (state, dt)
        assert store.members.newest_generation(lid) == generation, state
    for dt in (0.0, 6.0, 12.0):  # its heartbeat stops: silent, and a grace later
        look(400.0 + dt)
    assert store.members.newest_generation(lid) == generation + 1
    assert (
        region_ledger(store, plan, run_slots(spec), "us-east", pools=region_pools(spec)).spans(lid)
        == []
    )


def test_a_release_never_gives_a_span_back_twice_nor_misses_a_take_under_way(prepared, tmp_path):
    """A stream is given back by the learner itself or, silent, by the syncers: two
    syncers releasing at once write one release; a take that lands between a syncer's
    read of the ledger and its release is given back too (the release is written as
    exactly the next record, and read again when that number is taken), so the ledger
    reads back whole. A fence whose syncer died before its release is released by another
    syncer."""

    from flows.ledger import region_ledger, region_pools
    from storage_layout.store import RunStore

    cfg, regions, store, spec, lid = _worker_run(prepared, tmp_path, "rel")
    plan = UnitPlan(open_dataset(prepared), cfg.model.context, cfg.seed)

    def ledger(writer):  # a new process's view
        return region_ledger(RunStore("rel", regions, "us-east", writer=writer), plan,
                             run_slots(spec), "us-east", pools=region_pools(spec))  # fmt: skip

    def first(view, act):  # ``act`` runs once, just before ``view`` writes a record
        put, todo = view.store.home.put_exclusive, [act]

        def put_after(key, data):
            if "/units/s" in key and todo:
                todo.pop()()
            return put(key, data)

        view.store.home.put_exclusive = put_after

    learner = ledger(lid)
    learner.take(lid)
    took = []
    a = ledger("syncer-0")
    first(a, lambda: took.append(learner.take(lid)))  # lands between a's read and write
    a.release(lid, 3)
    learner.take(lid)
    b, c = ledger("syncer-1"), ledger("syncer-2")
    first(b, lambda: c.release(lid, 3))  # another syncer releases between b's read and write
    b.release(lid, 3)
    again = ledger("audit")
    kept = again.spans(lid)  # reads back: no release gives back what was not held
    assert sum(s.windows for s in kept) == 3 and took[0] in again.given_back()
    assert len(store.units.unit_records(lid)) == 5  # three takes, two releases

    # A fence whose syncer died before releasing: another syncer releases it.
    other = next(x for x in run_slots(spec) if x != lid)
    store.members.claim_generation(other)
    learner.take(other)
    store.progress.write_metrics(other, {"state": "training", "time": 0, "step": 0})
    assert store.members.fence(other, 1, "silent past pipeline.member_timeout")  # ... and died
    look = _syncer_looks("rel", regions, spec, cfg, plan, grace=5.0)
    for t in (0.0, 6.0, 12.0):  # heard, silent past the timeout, and a grace later
        look(t)
    assert ledger("audit").spans(other) == [] and store.members.newest_generation(other) == 2


def test_a_send_under_way_in_a_fenced_learner_lands_nowhere_once_its_data_is_given_back(
    prepared, tmp_path
):
    """The one window no check closes: a learner process paused after the last check of
    a send and before its marker (a frozen VM) while the syncers fence it and give its
    data back. The releasing syncer first holds the keys of the seqs it has not committed
    (revoked markers), so the marker's write fails when it wakes, and the release counts
    exactly what was committed: nothing is trained twice. The syncers, a restart's
    ``sent_so_far``, retention and inspect read past the revoked key."""
    from diloco.learner_loop import resume_step
    from diloco.outer import Contribution
    from flows.ledger import region_ledger, region_pools
    from flows.run import bucket_store, build_model
    from protocol.quantize import quantize
    from storage_layout.commit import CommitConflict, Revoked
    from storage_layout.inspect import inspect_bucket
    from storage_layout.retention import collect_garbage
    from storage_layout.store import RunStore

    cfg, regions, store, spec, lid = _worker_run(prepared, tmp_path, "fly")
    plan = UnitPlan(open_dataset(prepared), cfg.model.context, cfg.seed)
    model = build_model(cfg)
    learner = bucket_store("fly", regions, spec, cfg, lid, home="us-east")  # its process
    learner.claim_generation(lid)
    learner.sent_so_far(lid)  # reserves its first block of seqs
    ledger = region_ledger(learner.writer_for(lid), plan, run_slots(spec), "us-east",
                           pools=region_pools(spec))  # fmt: skip
    held = [ledger.take(lid), ledger.take(lid)]
    store.progress.write_metrics(lid, {"state": "training", "time": 0, "step": 0})
    first = learner._seqs[lid][1]

    def send(seq: int, step: int) -> None:
        payload = {n: quantize(np.full(model.init[n].shape, 1e-3, np.float32), "int4", 128)
                   for n in model.plan[0]}  # fmt: skip
        learner.put_contribution(Contribution(lid, 0, seq, 0, 512, step, 0.1, payload, step=step,
                                             base_id=version_id(0, 0, [])))  # fmt: skip

    send(first, 2)
    look = _syncer_looks("fly", regions, spec, cfg, plan, grace=0.0)
    check, checks = learner.check_newest, []

    def paused_after_check(who: str) -> None:
        check(who)
        checks.append(who)
        if len(checks) == 2:  # past the last check before the marker: asleep while ...
            for t in (0.0, 6.0, 12.0):  # ... the syncers fence it and give its data back
                look(t)

    learner.check_newest = paused_after_check
    with pytest.raises(CommitConflict):  # woken, its marker's key is held
        send(first + 1, 4)
    with pytest.raises(Revoked, match="revoked by syncer-0"):
        store.contributions.contribution_head(lid, 0, first + 1, "us-east")
    batch = cfg.data.batch_size
    back = cut(held, resume_step(0, 2) * batch)[1]
    again = region_ledger(store, plan, run_slots(spec), "us-east", pools=region_pools(spec))
    assert again.given_back() == back  # from the step of what was committed, no later
    syncer = bucket_store("fly", regions, spec, cfg, "syncer-1", home="us-east")
    assert [c.seq for c in syncer.contributions(lid, 0, 0)] == [first]  # the held key skipped
    assert syncer.sent_so_far(lid)[1] == 2  # a restart resumes after the committed send
    report = collect_garbage(RunStore("fly", regions, "us-east", writer="gc"),
                             len(spec["fragments"]), run_slots(spec), window=4)  # fmt: skip
    assert not any("revoked" in p or f"s{first + 1:012d}" in p for p in report.problems)
    (shown,) = inspect_bucket(regions["us-east"], run="fly")["runs"]
    row = next(r for r in shown["learners"] if r["learner"] == lid)
    assert row["fragments"][0]["newest_seq"] == first


def test_a_syncer_offers_the_pool_of_a_region_no_member_is_in(prepared, tmp_path):
    """The pipeline's syncer (``SyncerRuntime``, its first shard) tends the pools at its
    look at the members: the learners of ``eu`` never started (silent past
    `liveness.silent_max_seconds` on the syncer's clock), those of ``us`` train (statuses written by hand), so eu's units
    are offered in us's bucket and us's learners take them."""
    from flows.ledger import region_ledger, region_pools
    from flows.run import initialize_run
    from flows.syncer import SyncerRuntime
    from storage_layout.store import RunStore

    cfg = load_config("tiny", overrides=[
        f"data.source={prepared}", "model.vocab_size=512", "data.assign=units",
        "topology.learners=4", "liveness.heartbeat_seconds=1",
        "liveness.silent_min_seconds=5", "liveness.silent_max_seconds=5",
    ])  # fmt: skip
    regions = {r: f"file://{tmp_path / r}" for r in ("us", "eu")}
    for r in regions:
        (tmp_path / r).mkdir()
    spec = initialize_run(RunStore("off", regions, "us"), cfg)
    us = [lid for lid, r in run_slots(spec).items() if r == "us"]
    runtime = SyncerRuntime("off", regions, "us", 0, 1, cfg.pipeline.model_dump())
    now = [0.0]
    runtime.transport.clock = lambda: now[0]
    plan = UnitPlan(open_dataset(prepared), cfg.model.context, cfg.seed)
    store = RunStore("off", {"us": regions["us"]}, "us")
    ledger = region_ledger(store, plan, run_slots(spec), "us", pools=region_pools(spec))
    for t in (0.0, 6.0):  # first heard, then eu silent past the timeout
        now[0] = t
        for lid in us:
            store.progress.write_metrics(lid, {"state": "training", "time": t, "step": 0})
        runtime.transport._members_read = -float("inf")  # a look now, not 5 s later
        runtime.transport.members()
    offered = ledger.given_back()
    assert len(offered) == len(us) and store.units.offered_claims()
    assert all(s.epoch == 0 and s.start == 0 for s in offered)
    assert {ledger.take(lid) for lid in us} == set(offered)
    # One shard tends the pools (two would each keep spans waiting there): the first.
    assert (
        SyncerRuntime("off", regions, "us", 1, 2, cfg.pipeline.model_dump()).transport.offers
        is None
    )


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


def test_the_pool_of_a_region_its_learners_all_left_is_offered_to_the_others(
    prepared, tmp_path, caplog
):
    """Each region's pool is in its own bucket; when every learner of one has left, the
    syncers (``UnitOffers``) offer its spans to the learners of the others: what it gave
    back, then its next units, in epoch order. The run goes through every window of the
    first epoch once before any of the second; a learner back in the emptied region takes
    on from its pool where the moves left it; a claim whose offer was never written (the
    syncer died between the two) is offered by the next syncer; a forged offer is named."""
    from diloco.dataset import DataError
    from flows.ledger import offer_claim, region_ledger, region_pools
    from flows.unit_offers import UnitOffers
    from storage_layout.store import RunStore

    regions = {r: f"file://{tmp_path / r}" for r in ("us", "eu")}
    for r in regions:
        (tmp_path / r).mkdir()
    plan = UnitPlan(open_dataset(prepared), context=64, seed=0)
    learners = {"learner-0": "us", "learner-1": "eu", "learner-2": "us", "learner-3": "eu"}
    pools = region_pools({"learners": learners})

    def ledger(lid, region=None):  # a new process's ledger
        r = region or learners[lid]
        return region_ledger(RunStore("p", {r: regions[r]}, r, writer=lid), plan, learners, r,
                             pools=pools)  # fmt: skip

    def offers():  # a new syncer process's
        import logging

        return UnitOffers(
            lambda r: RunStore("p", {r: regions[r]}, r, writer="syncer-0"),
            learners,
            plan,
            logging.getLogger("t"),
            pools,
        )

    own = {lid: ledger(lid) for lid in learners}
    for lid in learners:
        own[lid].take(lid)
    syncer = offers()
    assert syncer.tend(list(learners)) == 0  # every region has members: nothing moves
    gone = cut(own["learner-1"].spans("learner-1"), 5)[1] + own["learner-3"].spans("learner-3")
    own["learner-1"].release("learner-1", 5)  # eu's learners leave: the rest of a unit
    own["learner-3"].release("learner-3", 0)  # and a whole one come back to eu's pool
    us = ["learner-0", "learner-2"]
    assert syncer.tend(us) == 2  # as many waiting as us has learners
    assert syncer.tend(us) == 0
    assert own["learner-0"].given_back() == sorted(gone)  # what eu gave back goes first
    took, k = [own[lid].take(lid) for lid in us], 0  # both taken before the next look:
    assert sorted(took) == sorted(gone)
    eu = own["learner-1"].pool
    left = sum(pool_unit(k, eu, plan.units)[0] == 0 for k in range(plan.units)) - 2
    assert left > 2  # eu's pool's units of the first epoch no one has had yet
    assert syncer.tend(us) == min(4, left) and syncer.waiting["us"] == 4  # twice as many
    while not took or took[-1].epoch == 0:
        syncer.tend(us)
        lid = us[k % 2]
        took.append(own[lid].take(lid))
        k += 1
    held = [s for lid in learners for s in own[lid].spans(lid)]
    first = [s for s in held if s.epoch == 0]
    assert _covered(first) == _epoch(plan, 0)  # the whole first epoch once, both pools
    assert len([s for s in held if s.epoch == 1]) == 1  # before any of the second
    pool = ledger("learner-1")  # eu's pool: what was moved is not an orphan
    assert pool.orphans() == [] and pool.given_back() == []
    assert {to for to, _ in pool.moved().values()} == {"us"}
    # Everything moved is with us's learners, taken or waiting, and nothing else of eu's.
    eus = {pool_unit(k, eu, plan.units) for k in range(2 * plan.units)}
    at_us = [s for lid in us for s in own[lid].spans(lid)] + own["learner-0"].given_back()
    assert sorted(span for _, span in pool.moved().values()) == sorted(
        s for s in at_us if (s.epoch, s.unit) in eus)  # fmt: skip
    moved = max(int(c.removeprefix("fresh-")) for c in pool.moved() if c.startswith("fresh-"))
    back = pool.take("learner-1")  # a learner back in eu: its pool from where the moves left it
    assert back == plan.fresh(moved, eu) and back.epoch >= 1
    everyone = [s for lid in learners for s in ledger(lid).spans(lid)]
    assert max(_covered(everyone).values()) == 1

    # A syncer that died between its claim and its offer: the next one offers it.
    dying = offers().ledger("eu")
    span, claim = dying.give("us", "syncer-1", epoch=5)
    assert offer_claim("eu", claim) not in dict(own["learner-0"]._offered())
    assert offers().tend(us) >= 1
    assert (span, offer_claim("eu", claim)) in [(s, c) for c, s in ledger("learner-0")._offered()]
    taken = {lid: ledger(lid).take(lid) for lid in us}
    assert span in taken.values() or span in ledger("learner-0").given_back()

    # A forged offer (a span of another unit than the claim it names) is named.
    forged = RunStore("p", {"us": regions["us"]}, "us", writer="mallory")
    fake = plan.fresh(40, eu)
    forged.units.offer_unit(offer_claim("eu", "fresh-999"), {"from": "eu", "claim": "fresh-999",
                                                        "span": list(astuple(fake))})  # fmt: skip
    with pytest.raises(DataError, match=r"from-eu-fresh-999\.json offers .* not unit 998"):
        ledger("learner-2").given_back()


def test_a_region_whose_pool_is_behind_has_its_spans_trained_by_a_region_ahead(prepared, tmp_path):
    """The pools are the same size, so a region of fewer or slower learners goes through
    its pool's epochs more slowly (and one emptied and then joined again is ahead). Once
    a region's pool has reached an epoch another's has not, the syncers offer it its
    share (by learners) of the units left of that other pool's older epochs, which its
    learners take before a fresh unit of their own; none of the epoch the region ahead
    is in, and nothing once level: the run trains every window of an epoch once before
    going on, whoever is faster."""
    from flows.ledger import region_ledger, region_pools
    from flows.unit_offers import UnitOffers
    from storage_layout.store import RunStore

    regions = {r: f"file://{tmp_path / r}" for r in ("us", "eu")}
    for r in regions:
        (tmp_path / r).mkdir()
    plan = UnitPlan(open_dataset(prepared), context=64, seed=0)
    learners = {"learner-0": "us", "learner-1": "eu", "learner-2": "us"}
    pools = region_pools({"learners": learners})

    def ledger(lid):
        r = learners[lid]
        return region_ledger(RunStore("b", {r: regions[r]}, r, writer=lid), plan, learners, r,
                             pools=pools)  # fmt: skip

    import logging

    syncer = UnitOffers(
        lambda r: RunStore("b", {r: regions[r]}, r, writer="syncer-0"),
        learners,
        plan,
        logging.getLogger("t"),
        pools,
    )
    own = {lid: ledger(lid) for lid in learners}
    us, took = ["learner-0", "learner-2"], []
    own["learner-1"].take("learner-1")  # eu's one (slow) learner: its first unit
    assert syncer.tend(list(learners)) == 0  # level: nothing moves
    while not took or took[-1].epoch == 0:  # us's two learners run through their pool
        took.append(own[us[len(took) % 2]].take(us[len(took) % 2]))
    assert own["learner-0"].frontier() == 1 and own["learner-1"].frontier() == 0
    left = own["learner-1"].fresh_before(1)  # eu's units of epoch 0 no one has had yet
    offered = syncer.tend(list(learners))
    assert offered == max(2, -(-left * 2 // 3)) < left  # us's share: 2 of the 3 learners
    waiting = own["learner-0"].given_back()
    assert {s.epoch for s in waiting} == {0}  # eu's, of the epoch us has left
    eus = {pool_unit(k, pools["eu"], plan.units) for k in range(plan.units)}
    assert all((s.epoch, s.unit) in eus for s in waiting)  # of eu's pool
    assert all(own[lid].take(lid) in waiting for lid in us)  # before their own
    while own["learner-1"].frontier() == 0:  # us's learners (and eu's) finish epoch 0
        syncer.tend(list(learners))
        for lid in learners:
            if own["learner-1"].frontier() == 0 or lid != "learner-1":
                took.append(own[lid].take(lid))
    held = [s for lid in learners for s in ledger(lid).spans(lid)]
    assert _covered([s for s in held if s.epoch == 0]) == _epoch(plan, 0)  # once, whole
    assert max(_covered(held).values()) == 1
    moved = ledger("learner-1").moved()
    assert {to for to, _ in moved.values()} == {"us"} and len(moved) > offered
    assert {span.epoch for _, span in moved.values()} == {0}  # none of the epoch us is in
    assert syncer.tend(list(learners)) == 0  # level again: nothing moves
