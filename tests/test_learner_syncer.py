"""The learner and syncer state machines, driven by hand."""

import dataclasses
import itertools
import math

import numpy as np
import pytest

from diloco import records
from diloco.config import OuterConfig, load_config
from diloco.data import ShardReader, load_corpus
from diloco.fragments import plan_fragments
from diloco.inner import InnerTrainer
from diloco.learner import Learner
from diloco.loops import GlobalView
from diloco.model import ParamCodec, is_embedding
from diloco.outer import OUTER_OPTIMIZERS, Contribution
from diloco.syncer import (
    FragmentSyncer,
    budget_spent,
    estimate_step_seconds,
    grace_window,
    quorum_met,
)
from protocol.quantize import quantize


class merging(FragmentSyncer):
    """A syncer for the merge's arithmetic: each contribution offered names the id of its
    base version as a learner that applied it would (the check has tests of its own)."""

    def offer(self, c: Contribution) -> None:
        super().offer(dataclasses.replace(c, base_id=self.ids.get(c.base_version)))


@pytest.fixture(scope="module")
def setup():
    cfg = load_config("tiny", overrides=["topology.quantization=fp32", "topology.tau=2"])
    codec, state = ParamCodec.create(cfg.model, 0)
    init = codec.to_flat(state)
    trainer = InnerTrainer(codec, cfg.inner, 100)
    plan = plan_fragments(codec.sizes, cfg.topology.fragments)
    corpus = load_corpus(None, 2)
    return cfg, codec, init, trainer, plan, corpus


def make_learner(setup, name="l0", stream=0, **topology):
    cfg, _, init, trainer, plan, corpus = setup
    reader = ShardReader(corpus.train_shards[stream], 8, cfg.model.context, 0, stream)
    return Learner(name, trainer, plan, cfg.topology.model_copy(update=topology), init, reader)


def test_contribution_is_anchor_minus_params(setup):
    _, _, init, _, plan, _ = setup
    lrn = make_learner(setup)
    for _ in range(5):
        lrn.train_step(seconds=0.5)
    c = lrn.contribute(0)
    theta = lrn.fragment_values(0)
    for name in plan[0]:
        np.testing.assert_allclose(c.outer_gradient()[name], init[name] - theta[name], atol=1e-7)
    assert (c.seq, c.base_version, c.steps, c.tokens, c.seconds) == (1, 0, 5, 5 * 8 * 64, 2.5)


def test_a_learner_keeps_one_step_in_flight_and_no_more(setup):
    """Each step, once dispatched, waits for the one before it: the host prepares step
    k + 1 while the device runs step k, and never runs further ahead. Unbounded, a step
    returned in its dispatch time, and the seconds it carries (to the syncer's grace
    window, to the goodput) were a few percent of the time it trained."""
    lrn = make_learner(setup)
    waited, real = [], lrn.trainer

    class Loss:  # a step's loss that says when it is waited for
        def __init__(self, loss, k):
            self.loss, self.k = loss, k

        def block_until_ready(self):
            waited.append(self.k)
            return self.loss.block_until_ready()

    class Watched:
        def __getattr__(self, name):
            return getattr(real, name)

        def step(self, *args):
            params, opt_state, loss = real.step(*args)
            return params, opt_state, Loss(loss, lrn.step)

    lrn.trainer = Watched()
    for k in range(4):
        lrn.train_step()
        assert waited == list(range(k))  # the steps before this one, each once


def test_a_learner_loop_times_its_steps_to_the_end_of_their_device_time(setup):
    """A fake device runs each dispatched step for 1 s of the loop's clock, one after the
    other, and a step's loss is ready when its second has passed: the seconds the
    fragments carry are the device's time of every step of a call, the last ones
    included (timed at the next step's start, they came after every mark: two of a
    call's steps were not timed), and what comes after the call is not counted."""
    from diloco.learner_loop import LearnerLoop
    from diloco.transport import MemoryStore, StoreLearnerView

    cfg, _, init, trainer, plan, _ = setup
    lrn = make_learner(setup)
    now = [0.0]
    done_at = [0.0]  # when the device finishes what it was given

    class Clock:
        def now(self):
            return now[0]

        def stepped(self, started, result):
            pass

    class Loss:
        def __init__(self, loss):
            done_at[0] = max(done_at[0], now[0]) + 1.0
            self.loss, self.ready_at = loss, done_at[0]

        def block_until_ready(self):
            now[0] = max(now[0], self.ready_at)
            return self

        def __float__(self):
            return float(self.loss)

    class Device:
        def __getattr__(self, name):
            return getattr(trainer, name)

        def step(self, *args):
            params, opt_state, loss = trainer.step(*args)
            return params, opt_state, Loss(loss)

    lrn.trainer = Device()
    store = MemoryStore([{n: init[n] for n in names} for names in plan], "fp32", 4)
    loop = LearnerLoop(lrn, cfg, StoreLearnerView(store, lrn.id), Clock())
    for _ in loop.run(6):
        pass
    assert [f.seconds for f in lrn.fragments] == [6.0] * len(plan)
    now[0] += 100.0  # between two calls: no step runs
    loop.send_pending()
    assert [f.seconds for f in lrn.fragments] == [6.0] * len(plan)


def test_tau_delays_application_and_alpha_zero_overwrites(setup):
    _, _, init, _, plan, _ = setup
    lrn = make_learner(setup, keep_unsent=False)
    lrn.train_step()
    assert not lrn.may_apply(1)  # nothing sent: no global is taken (it would erase unsent work)
    lrn.contribute(1)
    assert not lrn.may_apply(1) and not lrn.may_apply(0)
    assert lrn.waiting_on() == []
    lrn.train_step()
    lrn.train_step()
    assert lrn.may_apply(1) and lrn.waiting_on() == [1]
    glob = {n: np.full_like(init[n], 0.25) for n in plan[1]}
    lrn.apply_global(1, 3, glob)
    for n in plan[1]:
        np.testing.assert_array_equal(np.asarray(lrn.params[n]), glob[n])
    frag = lrn.fragments[1]
    assert (frag.base_version, frag.steps, frag.tokens, frag.sent_at_step) == (3, 0, 0, None)
    lrn.apply_global(1, 2, {n: np.zeros_like(init[n]) for n in plan[1]})  # older: ignored
    assert lrn.fragments[1].base_version == 3


@pytest.mark.parametrize("keep_unsent", [False, True])
def test_a_global_held_as_bf16_in_a_local_file_is_applied_as_its_float32_values(
    setup, tmp_path, keep_unsent, monkeypatch
):
    """A version a learner holds in its spill file keeps a bf16 wire's codes; applied,
    each tensor goes to the devices as those codes (half the bytes) and is widened to
    float32 there: the same parameters, anchor and next contribution, bit for bit, as the
    float32 values applied from memory, on one device and sharded over two (FSDP)."""
    import jax
    import ml_dtypes

    from storage_layout.spill import SpilledParams

    cfg, codec, init, _, plan, _ = setup
    rng = np.random.default_rng(1)
    codes = {n: (init[n] + rng.normal(0, 0.01, init[n].shape)).astype(ml_dtypes.bfloat16)
             for n in plan[1]}  # fmt: skip
    widened = {n: c.astype(np.float32) for n, c in codes.items()}
    spilled = SpilledParams.write(str(tmp_path / "v.values"), codes.items())
    assert spilled.nbytes_kept == 2 * sum(c.size for c in codes.values())

    def recording(trainer, placed):  # InnerTrainer.place, noting each dtype it is given
        return lambda v: placed.append(v.dtype) or InnerTrainer.place(trainer, v)

    for fsdp in (1, 2):
        trainer = InnerTrainer(codec, cfg.inner, 100, devices=jax.devices()[:2], fsdp=fsdp)
        got = {}
        for held in ("memory", "file"):
            lrn = make_learner((*setup[:3], trainer, *setup[4:]), keep_unsent=keep_unsent)
            lrn.train_step()
            lrn.contribute(1)
            for _ in range(2):
                lrn.train_step()
            placed = []
            monkeypatch.setattr(trainer, "place", recording(trainer, placed))
            lrn.apply_global(1, 3, spilled if held == "file" else widened)
            monkeypatch.undo()
            assert set(placed[: len(plan[1])]) == {np.dtype(ml_dtypes.bfloat16 if held == "file"
                                                            else np.float32)}  # fmt: skip
            lrn.train_step()
            c = lrn.contribute(1)
            got[held] = {
                **{f"param/{n}": np.asarray(lrn.params[n]) for n in plan[1]},
                **{f"anchor/{n}": np.asarray(lrn.fragments[1].anchor[n]) for n in plan[1]},
                **{f"grad/{n}": v for n, v in c.outer_gradient().items()},
            }
            assert all(lrn.params[n].dtype == np.float32 for n in plan[1])
            if fsdp == 2:  # still split over the two devices
                big = max(plan[1], key=lambda n: init[n].size)
                shards = [s.data.shape for s in lrn.params[big].addressable_shards]
                assert len(shards) == 2 and np.prod(shards[0]) * 2 == init[big].size, shards
        for k, v in got["memory"].items():
            assert v.tobytes() == got["file"][k].tobytes(), (fsdp, k)
    spilled.close()


def test_resume_continues_at_a_step_after_the_sent_sequence_numbers(setup):
    lrn = make_learner(setup)
    lrn.train_step()
    ckpt = lrn.checkpoint()
    assert (ckpt.step, ckpt.seq) == (1, 0)
    again = make_learner(setup)
    again.resume(5, 3, ckpt.opt_state)  # seq 3 was sent at step 5, after the checkpoint
    assert again.step == 5 and again.reader.position == 5 and again.opt_state is ckpt.opt_state
    again.train_step()
    c = again.contribute(0)
    assert (c.seq, c.step) == (4, 6)


def contribution(learner, seq, base, value, shapes, tokens=100, steps=10, anchor_seq=0,
                 step=None):  # fmt: skip
    """``learner``'s send ``seq`` (at inner step ``step``, by default ``seq * steps``)."""
    payload = {n: quantize(np.full(s, value, np.float32), "fp32") for n, s in shapes.items()}
    return Contribution(learner, 0, seq, base, tokens, steps, 1.0, payload,
                        step=seq * steps if step is None else step, anchor_seq=anchor_seq)  # fmt: skip


def test_syncer_merges_weighted_and_steps_outer_optimizer():
    shapes = {"w": (3,)}
    cfg = OuterConfig(lr=1.0, momentum=0.0, nesterov=False, staleness="constant")
    syncer = merging(0, {"w": np.zeros(3, np.float32)}, cfg, ["a", "b"], is_embedding)
    syncer.offer(contribution("a", 1, 0, 1.0, shapes, tokens=300, steps=10))
    syncer.offer(contribution("b", 1, 0, 4.0, shapes, tokens=100, steps=10))
    out = syncer.merge()
    # weights 300*30 = 9000 and 100*10 = 1000 -> Delta = 0.9 * 1 + 0.1 * 4 = 1.3; Theta = -1.3
    np.testing.assert_allclose(out.version.params["w"], -1.3, rtol=1e-6)
    assert out.version.version == syncer.version == 1
    assert out.version.weights == pytest.approx({"a/1": 0.9, "b/1": 0.1})
    assert syncer.pending == {} and syncer.merge().version is None


def test_cgad_scales_each_outer_gradient_by_its_age_before_adam():
    """``outer.optimizer = "cgad"`` against CGAD's equations (arXiv 2605.09126), written
    here in NumPy: each outer gradient's share of the merge (token weights, normalized)
    times ``sigma(s) = (1 + cos(pi s / cutoff)) / 2 * exp(-alpha s)``, then Adam with its
    bias correction, over three outer steps of contributions 0 to 2 versions old."""
    shapes = {"w": (3,)}
    alpha, cutoff = 0.2, 4
    cfg = OuterConfig(optimizer="cgad", lr=0.01, cgad_alpha=alpha, cgad_cutoff=cutoff,
                      staleness="constant", reference="delta")  # fmt: skip
    syncer = merging(0, {"w": np.zeros(3, np.float32)}, cfg, ["a", "b"], is_embedding)
    b1, b2, eps = cfg.adam_b1, cfg.adam_b2, cfg.adam_eps
    theta, m, v = np.zeros(3), np.zeros(3), np.zeros(3)
    rounds = [  # (learner, seq, base version, value, tokens, anchor seq)
        [("a", 1, 0, 1.0, 300, 0), ("b", 1, 0, -2.0, 100, 0)],
        [("a", 2, 1, 0.5, 200, 1)],
        [("b", 2, 0, 3.0, 200, 1), ("a", 3, 2, 1.5, 100, 2)],
    ]
    for t, sends in enumerate(rounds, start=1):
        for learner, seq, base, value, tokens, anchor in sends:
            syncer.offer(contribution(learner, seq, base, value, shapes, tokens, 10, anchor))
        out = syncer.merge().version
        ages = [t - 1 - base for _, _, base, *_ in sends]
        token_w = np.array([tokens * tokens / 10 for *_, tokens, _ in sends], np.float64)
        share = token_w / token_w.sum()
        sigma = [0.5 * (1 + math.cos(math.pi * s / cutoff)) * math.exp(-alpha * s) for s in ages]
        delta = sum(
            w * g * value for w, g, (_, _, _, value, _, _) in zip(share, sigma, sends, strict=True)
        )
        m, v = b1 * m + (1 - b1) * delta, b2 * v + (1 - b2) * delta**2
        m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
        theta = theta - cfg.lr * m_hat / (np.sqrt(v_hat) + eps)
        np.testing.assert_allclose(out.params["w"], theta, rtol=1e-5, atol=1e-7)
        labels = [f"{learner}/{seq}" for learner, seq, *_ in sends]
        assert out.staleness == dict(zip(labels, ages, strict=True))
        assert out.weights == pytest.approx(dict(zip(labels, share * sigma, strict=True)))


def test_cgads_age_scale_is_one_when_fresh_and_gates_to_nothing_at_its_cutoff():
    """sigma falls with age, reaches 0 at the cutoff and stays there; its default cutoff
    is one past the oldest contribution a syncer admits (``outer.max_staleness``)."""
    sigma = OUTER_OPTIMIZERS["cgad"].age_scale(OuterConfig(optimizer="cgad", max_staleness=3))
    values = [sigma(s) for s in range(7)]
    assert values[0] == 1.0 and values[4:] == [0.0, 0.0, 0.0]
    assert all(a > b for a, b in itertools.pairwise(values[:5]))
    assert values[3] > 0
    same = OUTER_OPTIMIZERS["sgd"].age_scale(OuterConfig())
    assert [same(s) for s in range(7)] == [1.0] * 7  # the others leave shares as they are


def test_a_learner_that_applied_no_global_is_never_merged_nor_counted_towards_a_quorum(setup):
    """A learner's outer gradient is merged only if it was made on a version the syncer
    published: it names that version's id (``records.version_id``), which it read
    applying the version. A fresh or re-initialised learner that trained from its own
    initialisation has none to name, whatever version it claims: it never forms a
    quorum, alone or with others, nor moves the global (its gradient, measured from other
    parameters than the global's, would pull the global towards them). One that applied
    the version, as the learner loop does, is merged."""
    _, _, init, _, plan, _ = setup
    names = plan[0]
    syncer = FragmentSyncer(0, {n: init[n] for n in names}, OuterConfig(), ["a", "b", "c", "d"],
                            is_embedding)  # fmt: skip
    on_v0 = contribution("d", 1, 0, 1e-3, {n: init[n].shape for n in names})
    syncer.offer(dataclasses.replace(on_v0, base_id=records.version_id(0, 0, [])))
    v1 = syncer.merge().version
    record = records.version(v1, 0.0)
    fresh, claims, member = (make_learner(setup, lid) for lid in "abc")
    claims.fragments[0].base_version = 1  # claims version 1, trained from its own init
    member.apply_global(0, 1, v1.params, GlobalView(0, 1, v1.params, record).id)
    sends = []
    for learner in (fresh, claims, member):
        learner.train_step()
        sends.append(learner.contribute(0))
    assert [c.base_id for c in sends] == [None, None, v1.ids[1]]
    for c in sends[:2]:
        syncer.offer(c)
    assert syncer.present == set() and not quorum_met(syncer.present, 1)
    out = syncer.merge()
    assert out.version is None  # nothing merged, nothing published
    assert {r.contribution.learner for r in out.rejected} == {"a", "b"}
    assert all("applied no global version" in r.reason for r in out.rejected)
    syncer.offer(sends[2])
    assert syncer.present == {"c"}
    merged = syncer.merge()
    assert merged.version.consumed == (("c", 1),) and merged.rejected == []
    assert merged.version.ids == {**v1.ids, 2: records.version_id(0, 2, [("c", 1)])}
    # A version stored before ids existed has none: what was made on it is merged
    # unchecked. A record's ids are checked as they are read.
    legacy = FragmentSyncer(0, {n: init[n] for n in names}, OuterConfig(), ["a"], is_embedding,
                            ids=records.ids_of({"fragment": 0}))  # fmt: skip
    legacy.offer(sends[0])
    assert legacy.merge().version.consumed == (("a", 1),)
    with pytest.raises(ValueError, match="fragment 0: ids"):
        records.ids_of({"fragment": 0, "ids": {"one": 5}})


def test_syncer_replaces_same_base_keeps_different_base_and_rejects_bad():
    shapes = {"w": (2,)}
    syncer = merging(0, {"w": np.zeros(2, np.float32)}, OuterConfig(), ["a", "b"], is_embedding)
    syncer.offer(contribution("a", 1, 0, 1.0, shapes))
    syncer.offer(contribution("a", 2, 0, 2.0, shapes))  # replaces seq 1 (same anchor)
    syncer.offer(contribution("a", 1, 0, 9.0, shapes))  # a late duplicate of an older seq: ignored
    assert [c.seq for c in syncer.pending.values()] == [2]
    syncer.offer(contribution("b", 5, 0, np.nan, shapes))
    out = syncer.merge()
    assert out.version.consumed == (("a", 2),)
    assert len(out.rejected) == 1 and "NaN" in out.rejected[0].reason
    # Same anchor as the merged seq 2, ten steps further: staleness 1, new work only.
    syncer.offer(contribution("a", 3, 0, 1.0, shapes, tokens=200, steps=20))
    syncer.offer(contribution("a", 4, 1, 1.0, shapes))  # re-anchored: separate work
    assert syncer.merge().version.staleness == {"a/3": 1, "a/4": 0}


@pytest.mark.parametrize("merged_first", [False, True])
def test_a_learner_that_rejoins_on_the_version_it_had_is_new_work(merged_first):
    """A learner sends seq 1 (40 steps from v0) and fails; it rejoins while v0 is still the
    newest, so its next send (seq 2, 20 fresh steps) is also based on v0 but does not
    contain seq 1's steps: a new anchor (anchor seq 1). Both must count, whether seq 1 is
    still pending or was merged before seq 2 came (it used to be superseded, or seq 2 was
    dropped as "nothing new")."""
    shapes = {"w": (2,)}
    cfg = OuterConfig(lr=1.0, momentum=0.0, nesterov=False, staleness="constant")
    syncer = merging(0, {"w": np.zeros(2, np.float32)}, cfg, ["a"], is_embedding)
    syncer.offer(contribution("a", 1, 0, 1.0, shapes, tokens=400, steps=40))
    tokens = syncer.merge().version.tokens if merged_first else 0
    syncer.offer(contribution("a", 2, 0, 1.0, shapes, tokens=200, steps=20, anchor_seq=1))
    v = syncer.merge().version
    assert tokens + v.tokens == 600
    assert v.superseded == ()
    assert v.consumed == ((("a", 2),) if merged_first else (("a", 1), ("a", 2)))


def test_rejoin_takes_new_anchors(setup):
    lrn = make_learner(setup)
    lrn.resume(5, 3, None)  # what LearnerLoop.start does after a failure
    for frag in lrn.fragments:
        frag.anchor_seq = lrn.seq
    lrn.train_step()
    c = lrn.contribute(0)
    assert (c.seq, c.base_version, c.anchor_seq, c.steps) == (4, 0, 3, 1)


def test_a_norm_far_above_the_recent_ones_is_rejected():
    """Per inner step, against the median of the fragment's recent accepted contributions:
    a learner gone wrong (or a forged update) is not merged; larger but ordinary ones are,
    and nothing is compared before there is a history."""
    shapes = {"w": (4,)}
    cfg = OuterConfig(staleness="constant", max_norm=1e9, max_norm_ratio=10.0)
    syncer = merging(0, {"w": np.zeros(4, np.float32)}, cfg, ["a", "b"], is_embedding)
    syncer.offer(contribution("a", 1, 0, 500.0, shapes, steps=10))  # no history: taken
    syncer.merge()
    for seq in range(2, 6):
        syncer.offer(contribution("a", seq, syncer.version, 1.0, shapes, steps=10))
        syncer.merge()
    assert syncer.typical_norm == pytest.approx(0.2)  # |(1,1,1,1)| / 10 steps
    syncer.offer(contribution("a", 6, syncer.version, 1.0 * 9, shapes, steps=10))  # 9x
    syncer.offer(contribution("b", 1, syncer.version, 1.0 * 40, shapes, steps=20))  # 20x
    out = syncer.merge()
    assert out.version.consumed == (("a", 6),)
    (bad,) = out.rejected
    assert bad.contribution.learner == "b" and "20x the median" in bad.reason
    assert out.version.rejected == (("b", 1, bad.reason),)


def test_sends_made_in_the_learners_warm_up_neither_set_the_norm_median_nor_face_it():
    """While the inner learning rate warms up, a learner's norm per step rises with it:
    the first sends (a tenth of the next ones, in tiny) are not compared with the ones
    after the warm-up, and do not make the median those are compared with."""
    shapes = {"w": (4,)}
    cfg = OuterConfig(staleness="constant", max_norm=1e9, max_norm_ratio=10.0)
    syncer = merging(0, {"w": np.zeros(4, np.float32)}, cfg, ["a", "b"], is_embedding,
                     warmup_steps=10)  # fmt: skip
    for seq in range(1, 6):  # sends of 2 steps each, all within the warm-up
        syncer.offer(contribution("a", seq, syncer.version, 0.1, shapes, steps=2, step=seq * 2))
        syncer.merge()
    assert syncer.typical_norm is None  # none of them counts
    for seq in range(1, 6):  # past it, 12x the warm-up's norm per step: all merged
        syncer.offer(contribution("b", seq, syncer.version, 6.0, shapes, step=10 + seq * 10))
        assert syncer.merge().rejected == []
    assert syncer.typical_norm == pytest.approx(1.2)  # |(6,6,6,6)| / 10 steps
    # A send that reaches back into the warm-up is not held to it either.
    syncer.offer(contribution("a", 6, syncer.version, 200.0, shapes, step=15))
    assert syncer.merge().rejected == []
    syncer.offer(contribution("b", 6, syncer.version, 200.0, shapes, step=70))
    assert "33x the median" in syncer.merge().rejected[0].reason


def test_outcomes_no_merge_carries_are_sealed_into_a_last_version():
    """The run's end: what was rejected or replaced since the last version is published
    in a version that merges nothing (the parameters stay), so none goes unrecorded."""
    shapes = {"w": (2,)}
    syncer = merging(0, {"w": np.ones(2, np.float32)}, OuterConfig(), ["a"], is_embedding)
    assert syncer.seal() is None  # nothing to record
    syncer.offer(contribution("a", 1, 0, 1.0, shapes))
    syncer.offer(contribution("a", 2, 0, np.nan, shapes))  # replaces seq 1, then rejected
    assert syncer.merge().version is None
    sealed = syncer.seal()
    assert sealed.version == 1 and sealed.consumed == () and sealed.tokens == 0
    assert sealed.superseded == (("a", 1, 2),)
    assert [r[:2] for r in sealed.rejected] == [("a", 2)] and sealed.cursor == {"a": 2}
    np.testing.assert_array_equal(sealed.params["w"], np.ones(2))
    assert syncer.seal() is None


def test_a_shared_budget_is_spent_when_one_fragments_merged_steps_reach_it():
    """The syncers' rule, which a joiner uses too: the furthest fragment's sum of each
    learner's newest merged step against the budget; never for a budget not shared."""
    progress = [{"l0": 40, "l1": 30}, {"l0": 50, "l1": 45}]
    assert budget_spent(True, 95, progress) and not budget_spent(True, 96, progress)
    assert not budget_spent(False, 1, progress) and not budget_spent(True, 1, [])


def test_quorum_and_grace_window():
    assert not quorum_met(["a", "a"], 2) and quorum_met(["a", "b"], 2)
    # slack = 2 * 1.0 - (0.3 + 0.2) = 1.5; gamma 0.5 -> 0.75
    assert grace_window(1.0, 2, 0.3, 0.2, 0.5) == pytest.approx(0.75)
    assert grace_window(1.0, 1, 3.0, 0.2, 0.5) == 0.0
    pending = [contribution(x, 1, 0, 1.0, {"w": (1,)}) for x in "ab"]
    assert estimate_step_seconds(pending, 9.0) == pytest.approx(0.1)
    assert estimate_step_seconds([], 9.0) == 9.0


@pytest.mark.parametrize("reference", ["delta", "anchored"])
def test_resent_contribution_from_a_merged_anchor_counts_only_new_work(reference):
    # A learner sends seq 1, it is merged into v1, and before receiving v1 it sends seq 2
    # from the same anchor (base 0): seq 2's outer gradient (3.0) contains seq 1's (1.0).
    shapes = {"w": (2,)}
    cfg = OuterConfig(
        lr=1.0, momentum=0.0, nesterov=False, staleness="constant", reference=reference
    )
    syncer = merging(0, {"w": np.zeros(2, np.float32)}, cfg, ["a"], is_embedding)
    syncer.offer(contribution("a", 1, 0, 1.0, shapes, tokens=100, steps=10))
    first = syncer.merge().version
    np.testing.assert_allclose(first.params["w"], -1.0)
    syncer.offer(contribution("a", 2, 0, 3.0, shapes, tokens=300, steps=30))
    second = syncer.merge().version
    # delta: merge the increment 3 - 1 = 2 -> Theta = -3 (merging it whole would give -4).
    # anchored: Theta_1 - (Theta_0 - 3) = -1 - (0 - 3) = 2 -> Theta = -3 as well.
    np.testing.assert_allclose(second.params["w"], -3.0)
    assert (second.tokens, second.seconds) == (200, 0.0)  # only the new work is counted
    syncer.offer(contribution("a", 3, 0, 3.0, shapes, tokens=300, steps=30))  # nothing new
    assert syncer.merge().version is None


def test_merge_counters_survive_a_syncer_restart():
    """The same re-sent contribution as above, but the syncer is rebuilt from the stored
    version in between (cursor, momentum and ``merged`` counters): still no double count."""
    shapes = {"w": (2,)}
    cfg = OuterConfig(lr=1.0, momentum=0.0, nesterov=False, staleness="constant")
    syncer = merging(0, {"w": np.zeros(2, np.float32)}, cfg, ["a"], is_embedding)
    syncer.offer(contribution("a", 1, 0, 1.0, shapes, tokens=100, steps=10))
    v1 = syncer.merge().version
    assert v1.merged == {"a/0/0": [1, 100, 10, 1.0]}
    restarted = merging(0, v1.params, cfg, ["a"], is_embedding, version=1,
                               opt_leaves=syncer.opt_leaves, cursor=v1.cursor, merged=v1.merged)  # fmt: skip
    restarted.history[0] = {"w": np.zeros(2, np.float32)}  # what the flow reloads
    restarted.offer(contribution("a", 1, 0, 1.0, shapes, tokens=100, steps=10))  # seen: ignored
    assert restarted.pending == {}
    restarted.offer(contribution("a", 2, 0, 3.0, shapes, tokens=300, steps=30))
    v2 = restarted.merge().version
    np.testing.assert_allclose(v2.params["w"], -3.0)
    assert v2.tokens == 200


def test_a_lone_stale_contribution_moves_the_fragment_by_its_share_of_the_work():
    """Defect: the merge weights summed to one, so a straggler's contribution merged alone
    (at a run's end, below the quorum) set the fragment to that learner's parameters, a
    few steps past an old version: the run's last validation loss went up (2.40 -> 2.77 in
    the launcher's paused-syncer test). Anchored, a merge now carries the globals back by
    no more tokens than it brings: work made on the newest version, or bringing at least
    what it carries back, keeps its whole share; the window's tokens survive a restart."""
    shapes = {"w": (2,)}
    cfg = OuterConfig(lr=1.0, momentum=0.0, nesterov=False, staleness="constant")
    assert cfg.reference == "anchored"
    syncer = merging(0, {"w": np.zeros(2, np.float32)}, cfg, list("abcd"), is_embedding)
    syncer.offer(contribution("a", 1, 0, 1.0, shapes, tokens=300))
    syncer.offer(contribution("b", 1, 0, 1.0, shapes, tokens=300))
    v1 = syncer.merge().version
    np.testing.assert_allclose(v1.params["w"], -1.0)  # fresh: the whole step
    assert v1.weights == {"a/1": 0.5, "b/1": 0.5} and v1.window_tokens == {1: 600}
    syncer.offer(contribution("c", 1, 0, 0.5, shapes, tokens=60))  # made on v0: -0.5
    v2 = syncer.merge().version
    # 60 tokens carry back 60 of v1's 600: a tenth of the way to -0.5 (it used to be all)
    np.testing.assert_allclose(v2.params["w"], 0.9 * -1.0 + 0.1 * -0.5, rtol=1e-6)
    assert v2.weights == {"c/1": pytest.approx(0.1)} and v2.staleness == {"c/1": 1}
    record = records.version(v2, time=0.0)
    assert records.window_tokens_of(record) == {1: 600, 2: 60}
    restarted = merging(0, v2.params, cfg, list("abcd"), is_embedding, version=2,
                        cursor=v2.cursor, merged=v2.merged)  # fmt: skip
    restarted.history.update({1: v1.params})  # what the flow reloads
    restarted.window_tokens.update(records.window_tokens_of(record))
    for s in (syncer, restarted):  # made on v1: the 60 tokens of v2 merged since
        s.offer(contribution("d", 1, 1, 0.25, shapes, tokens=30))
    again, there = restarted.merge().version, syncer.merge().version
    assert again.params["w"].tobytes() == there.params["w"].tobytes()
    assert again.weights == {"d/1": pytest.approx(0.5)}
    syncer.offer(contribution("a", 2, 1, 0.25, shapes, tokens=120))  # brings more: whole
    assert syncer.merge().version.weights == {"a/2": 1.0}
    for bad in ({"1": -5}, {"x": 1}, {"1": "10"}, [1]):
        with pytest.raises(ValueError, match="window_tokens"):
            records.window_tokens_of({"fragment": 0, "window_tokens": bad})


def test_anchored_merge_rejects_a_base_it_no_longer_holds():
    shapes = {"w": (2,)}
    cfg = OuterConfig(staleness="constant", max_staleness=8)
    syncer = merging(0, {"w": np.zeros(2, np.float32)}, cfg, ["a"], is_embedding, version=5)
    syncer.offer(contribution("a", 1, 3, 1.0, shapes))  # base 3: within bounds, not loaded
    outcome = syncer.merge()
    assert outcome.version is None
    assert "base version 3 is no longer held" in outcome.rejected[0].reason


def test_no_contribution_of_a_fragment_with_no_new_steps(setup):
    _, _, init, _, plan, _ = setup
    lrn = make_learner(setup)
    p = None
    while p is None:
        lrn.train_step()
        p = lrn.due()
    assert lrn.fragments[p].steps == lrn.step
    lrn.apply_global(p, 1, {n: init[n] for n in plan[p]})  # a global lands at the due step
    assert lrn.fragments[p].steps == 0
    assert lrn.due() is None  # nothing to send: no step since the new anchor


def test_error_feedback_carries_a_residual_into_the_next_round_only(setup):
    """Sends of one round are all measured from one anchor: each adds the residual the
    round started with, never its superseded predecessor's. Re-anchoring makes the newest
    send's residual the next round's carry."""
    _, _, init, _, plan, _ = setup
    lrn = make_learner(setup, quantization="int4", error_feedback=True)
    names = plan[0]

    def sent(c):
        return c.outer_gradient()

    lrn.train_step()
    first = lrn.contribute(0)
    r1 = dict(lrn.fragments[0].residual)
    lrn.train_step()
    second = lrn.contribute(0)  # supersedes the first: same anchor, zero carry
    delta = {n: init[n] - lrn.fragment_values(0)[n] for n in names}
    for n in names:
        np.testing.assert_allclose(sent(second)[n] + lrn.fragments[0].residual[n], delta[n],
                                   atol=1e-6)  # fmt: skip
    assert any(not np.allclose(r1[n], lrn.fragments[0].residual[n]) for n in names)
    assert sent(first).keys() == sent(second).keys()
    r2 = dict(lrn.fragments[0].residual)
    lrn.train_step()
    lrn.train_step()
    lrn.apply_global(0, 1, {n: init[n] for n in names})
    frag = lrn.fragments[0]
    assert frag.residual == {} and all(np.array_equal(frag.carry[n], r2[n]) for n in names)
    lrn.train_step()
    third = lrn.contribute(0)
    delta = {n: init[n] - lrn.fragment_values(0)[n] for n in names}
    for n in names:
        np.testing.assert_allclose(sent(third)[n] + frag.residual[n], delta[n] + r2[n], atol=1e-6)
    # A fragment re-anchored with no send in between keeps the carry it had.
    lrn.apply_global(0, 2, {n: init[n] for n in names})
    lrn.apply_global(0, 3, {n: init[n] for n in names})
    assert all(np.array_equal(lrn.fragments[0].carry[n], frag.residual[n]) for n in names)


def test_keep_unsent_replays_the_steps_since_the_send_on_the_new_global(setup):
    _, _, init, _, plan, _ = setup
    lrn = make_learner(setup, keep_unsent=True)
    names = plan[1]
    for _ in range(3):
        lrn.train_step(seconds=1.0)
    lrn.contribute(1)
    at_send = lrn.fragment_values(1)
    lrn.train_step(seconds=1.0)
    lrn.train_step(seconds=1.0)
    before = lrn.fragment_values(1)
    glob = {n: np.full_like(init[n], 0.25) for n in names}
    lrn.apply_global(1, 4, glob)
    frag = lrn.fragments[1]
    for n in names:
        np.testing.assert_allclose(
            np.asarray(lrn.params[n]), glob[n] + before[n] - at_send[n], atol=1e-6
        )
        np.testing.assert_array_equal(frag.anchor[n], glob[n])
    # The two steps since the send are the next contribution's, with their counters.
    assert (frag.base_version, frag.steps, frag.tokens, frag.seconds) == (4, 2, 2 * 8 * 64, 2.0)
    assert frag.sent_at_step is None and frag.sent_values == {}
    nxt = lrn.contribute(1)
    for n in names:
        np.testing.assert_allclose(nxt.outer_gradient()[n], at_send[n] - before[n], atol=1e-6)
    assert (nxt.base_version, nxt.steps) == (4, 2)
