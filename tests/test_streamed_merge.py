"""The syncer merges a piece at a time: the same bits whatever the piece size, the same
bits as the whole-tensor rules, and nothing left changed by a merge that fails half way."""

import dataclasses

import jax
import numpy as np
import optax
import pytest

import diloco.tensors as tensors_mod
from diloco.config import OuterConfig
from diloco.outer import Contribution, outer_optimizer
from diloco.syncer import FragmentSyncer
from diloco.tensors import MemorySink, materialize, pieces
from protocol.quantize import dequantize, quantize


class merging(FragmentSyncer):
    """A syncer for the merge's arithmetic: each contribution offered names the id of its
    base version as a learner that applied it would (the check has tests of its own)."""

    def offer(self, c: Contribution) -> None:
        super().offer(dataclasses.replace(c, base_id=self.ids.get(c.base_version)))


SHAPES = {"blocks.0.up.kernel": (40, 33), "blocks.0.norm.scale": (33,), "embed.embedding": (7, 64)}


def _init(seed=0):
    rng = np.random.default_rng(seed)
    return {n: rng.normal(size=s).astype(np.float32) for n, s in SHAPES.items()}


def _contribution(learner, seq, base, seed, kind="int4"):
    rng = np.random.default_rng(seed)
    payload = {n: quantize(rng.normal(scale=0.01, size=s), kind, 128) for n, s in SHAPES.items()}
    return Contribution(learner, 0, seq, base, tokens=1000 + seed, steps=10, seconds=1.0,
                        payload=payload)  # fmt: skip


def _run(cfg, piece=None, monkeypatch=None):
    if piece is not None:
        monkeypatch.setattr(tensors_mod, "PIECE", piece)
    s = merging(0, _init(), cfg, ["a", "b", "c"], lambda n: n.startswith("embed"))
    s.offer(_contribution("a", 1, 0, 1))
    s.offer(_contribution("b", 1, 0, 2))
    first = s.merge().version
    s.offer(_contribution("c", 1, 0, 3))  # stale by one: anchored on version 0
    s.offer(_contribution("a", 2, 1, 4))
    second = s.merge().version
    return [(materialize(v.params), [materialize(x) for x in v.slots]) for v in (first, second)]


def _bits_equal(x, y):
    for (p, slots), (q, other) in zip(x, y, strict=True):
        for n in SHAPES:
            assert p[n].tobytes() == q[n].tobytes(), n
        for a, b in zip(slots, other, strict=True):
            assert all(a[n].tobytes() == b[n].tobytes() for n in SHAPES)


@pytest.mark.parametrize("reference", ["anchored", "delta"])
def test_pieces_of_any_size_give_the_same_bits(reference, monkeypatch):
    cfg = OuterConfig(lr=0.7, momentum=0.9, reference=reference)
    whole = _run(cfg)
    assert max(len(list(pieces({n: s}))) for n, s in SHAPES.items()) == 1
    small = _run(cfg, piece=256, monkeypatch=monkeypatch)  # tensors cut in up to 6 pieces
    assert len(list(pieces(SHAPES))) > len(SHAPES)
    _bits_equal(whole, small)


def test_the_piecewise_merge_is_the_whole_tensor_rule_bit_for_bit():
    cfg = OuterConfig(lr=0.7, momentum=0.9)
    s = merging(0, _init(), cfg, ["a", "b"], lambda n: False)
    cs = [_contribution("a", 1, 0, 1), _contribution("b", 1, 0, 2)]
    for c in cs:
        s.offer(c)
    gv = s.merge().version
    # The rules whole, written out: the anchored outer gradients (current - base +
    # delta), their weighted mean (float64 products summed in order, then float32) and
    # optax's step over every tensor at once.
    tx = outer_optimizer(cfg)
    init = _init()
    deltas = [{n: init[n] - init[n] + g for n, g in c.outer_gradient().items()} for c in cs]
    w = np.asarray(list(gv.weights.values()), np.float64)
    w = w / w.sum()
    merged = {n: sum((wi * d[n].astype(np.float64) for wi, d in zip(w, deltas, strict=True)),
                     np.zeros(SHAPES[n])).astype(np.float32) for n in SHAPES}  # fmt: skip
    updates, state = tx.update(merged, tx.init(init), init)
    params = optax.apply_updates(init, updates)
    for n in SHAPES:
        assert np.asarray(params[n], np.float32).tobytes() == materialize(gv.params)[n].tobytes()
    leaves = [np.asarray(x, np.float32) for x in jax.tree_util.tree_leaves(state)]
    assert all(a.tobytes() == b.tobytes() for a, b in zip(leaves, s.opt_leaves, strict=True))


@pytest.mark.parametrize("rule", ["rda", "heloco"])
def test_rules_over_whole_tensors_agree_in_pieces(rule, monkeypatch):
    """RDA's norms, HeLoCo's cosines with the momentum (its second merge has one)."""
    cfg = OuterConfig(merge=rule, reference="delta", momentum=0.9)
    whole = _run(cfg)
    small = _run(cfg, piece=256, monkeypatch=monkeypatch)
    if rule == "heloco":  # the second merge was corrected: not the mean's
        plain = _run(OuterConfig(reference="delta", momentum=0.9))
        name = "blocks.0.up.kernel"
        assert not np.allclose(plain[1][0][name], whole[1][0][name], rtol=1e-4)
    for (p, _), (q, _) in zip(whole, small, strict=True):
        for n in SHAPES:  # sums of squares add up in another order: equal to rounding
            np.testing.assert_allclose(p[n], q[n], rtol=1e-6, atol=1e-7)


class _FailingSink(MemorySink):
    """Fails after a number of pieces, as a bucket that goes away mid-version would."""

    def __init__(self, *args, after=2, log=None):
        super().__init__(*args)
        self.left, self.log = after, log

    def write(self, *args):
        if self.left == 0:
            raise OSError("the bucket went away")
        self.left -= 1
        super().write(*args)

    def abort(self):
        self.log.append("aborted")


def test_a_merge_that_fails_half_way_drops_what_it_wrote(monkeypatch):
    monkeypatch.setattr(tensors_mod, "PIECE", 256)
    log = []
    cfg = OuterConfig()
    s = merging(0, _init(), cfg, ["a", "b"], lambda n: False,
                       sink=lambda *a: _FailingSink(*a, log=log))  # fmt: skip
    before = {n: v.copy() for n, v in materialize(s.params).items()}
    s.offer(_contribution("a", 1, 0, 1))
    with pytest.raises(OSError, match="went away"):
        s.merge()
    assert log == ["aborted"]
    assert s.version == 0  # no version was made; the caller reloads the fragment
    assert all(np.array_equal(before[n], materialize(s.params)[n]) for n in SHAPES)


def test_a_contribution_is_read_a_piece_at_a_time(monkeypatch):
    """Validation and the merge ask a payload for pieces, never for a whole tensor."""
    monkeypatch.setattr(tensors_mod, "PIECE", 256)
    asked = []

    class Counting(tensors_mod.QuantizedPayload):
        def read(self, name, start, stop):
            asked.append(stop - start)
            return super().read(name, start, stop)

    c = _contribution("a", 1, 0, 1)
    s = merging(0, _init(), OuterConfig(reference="delta"), ["a"], lambda n: False)
    s.offer(Contribution(**{**c.__dict__, "payload": Counting(c.payload)}))
    gv = s.merge().version
    assert max(asked) <= 256 and sum(asked) == 2 * sum(np.prod(v) for v in SHAPES.values())
    expect = {n: _init()[n] - dequantize(q) for n, q in c.payload.items()}
    for n in SHAPES:
        assert materialize(gv.params)[n].tobytes() == expect[n].tobytes()


def test_the_current_version_is_read_once_a_piece_by_every_anchored_contribution(monkeypatch):
    """Anchored contributions (current - base + delta) and the outer step all want the
    current version's piece; it is read once, and a shared base version once too."""
    monkeypatch.setattr(tensors_mod, "PIECE", 256)
    reads = []

    class Counting(tensors_mod.ArrayTensors):
        def piece(self, name, start, stop):
            reads.append((name, start, stop))
            return super().piece(name, start, stop)

    s = merging(0, _init(), OuterConfig(lr=0.7, momentum=0.9), ["a", "b", "c"],
                       lambda n: False)  # fmt: skip
    s.offer(_contribution("a", 1, 0, 1))
    s.merge()
    s.params = s.history[1] = Counting(s.params)  # version 1, read through the counter
    s.history[0] = Counting(s.history[0])
    for learner, base, seed in [("a", 1, 2), ("b", 0, 3), ("c", 0, 4)]:
        s.offer(_contribution(learner, 2 if learner == "a" else 1, base, seed))
    assert s.merge().version is not None
    every = list(pieces(SHAPES))
    # version 1: one read a piece (the step, a's rebase, b's and c's current); version 0,
    # the base of two contributions: one read a piece
    assert sorted(reads) == sorted(every + every)


def test_overlapped_work_runs_in_order_and_stops_at_the_first_failure():
    done = []
    tensors_mod.overlapped(iter(range(50)), done.append)
    assert done == list(range(50))

    def work(i):
        if i == 5:
            raise OSError("chunk 5 went away")
        done.append(i)

    done.clear()
    with pytest.raises(OSError, match="chunk 5"):
        tensors_mod.overlapped(iter(range(50)), work)
    assert done == [0, 1, 2, 3, 4]  # nothing after the failed one

    def items():
        yield from range(3)
        raise ValueError("a read failed")

    done.clear()
    with pytest.raises(ValueError, match="a read failed"):
        tensors_mod.overlapped(items(), done.append)
    assert done == list(range(len(done))) and len(done) <= 3  # in order; the rest dropped


def test_a_loop_of_a_few_pieces_runs_on_its_own_thread_and_a_long_one_beside_it(monkeypatch):
    """A thread pays for itself only over several pieces: a small fragment (the
    simulator's) is merged on the caller's thread, a large one on two."""
    import threading

    threads = []
    work = lambda _: threads.append(threading.get_ident())  # noqa: E731
    small = {"w": (100,)}
    monkeypatch.setattr(tensors_mod, "PIECE", 256)
    large = {"w": (256 * tensors_mod.OVERLAP_PIECES,)}
    for shapes in (small, large):
        threads.clear()
        beside = tensors_mod.loop_beside(shapes)
        tensors_mod.overlapped(pieces(shapes), work, beside=beside)
        assert len(threads) == len(list(pieces(shapes)))
        assert (set(threads) == {threading.get_ident()}) is (not beside)
    assert not tensors_mod.loop_beside(small) and tensors_mod.loop_beside(large)


def test_an_outer_adam_is_stepped_a_piece_at_a_time_as_optax_steps_it_whole(monkeypatch):
    """An optax transform whose state holds a step count (Adam's) is an outer optimizer
    like SGD: its arrays stepped a piece at a time, its count the fragment's outer steps
    (a version that merges nothing takes none), the same values as optax's whole step
    and the same bits whatever the piece size."""
    cfg = OuterConfig(optimizer="adam", lr=0.01, reference="delta")
    tx = outer_optimizer(cfg)
    s = merging(0, _init(), cfg, ["a", "b"], lambda n: False)
    params, state = _init(), tx.init(_init())
    for seq, seeds in ((1, (1, 2)), (2, (3, 4))):
        cs = [
            _contribution("a", seq, seq - 1, seeds[0]),
            _contribution("b", seq, seq - 1, seeds[1]),
        ]
        for c in cs:
            s.offer(c)
        gv = s.merge().version
        w = np.asarray(list(gv.weights.values()), np.float64)
        w = w / w.sum()
        merged = {n: sum((wi * c.outer_gradient()[n].astype(np.float64) for wi, c in
                          zip(w, cs, strict=True)), np.zeros(SHAPES[n])).astype(np.float32)
                  for n in SHAPES}  # fmt: skip
        updates, state = tx.update(merged, state, params)
        params = {
            n: np.asarray(v, np.float32) for n, v in optax.apply_updates(params, updates).items()
        }
        for n in SHAPES:
            np.testing.assert_allclose(materialize(gv.params)[n], params[n], rtol=1e-6, atol=1e-7)
        assert gv.steps == s.steps == seq and int(s.opt_state[0].count) == seq
    s.rejections.append(("a", 9, "a rejection to record"))
    assert s.seal().steps == 2  # (no step)
    assert _run(cfg) and len(_run(cfg)[0][1]) == 2  # mu and nu per parameter
    _bits_equal(_run(cfg), _run(cfg, piece=256, monkeypatch=monkeypatch))


def test_an_optimizer_state_that_cannot_be_stepped_by_pieces_is_refused_by_name():
    """A leaf neither of a parameter's shape nor a step count (here, a scalar that is not
    counted up) cannot be stepped a piece at a time: named, before anything merges."""
    from diloco.tensors import state_slots

    def init(params):
        return {"scale": np.float32(1.0)}

    def update(updates, state, params=None):
        return updates, state

    with pytest.raises(ValueError, match=r"'scale'.*neither elementwise per parameter nor a step"):
        state_slots(optax.GradientTransformation(init, update), SHAPES)
    assert state_slots(optax.adam(0.1), SHAPES) == 2 and state_slots(optax.sgd(0.1), SHAPES) == 0


def test_a_stored_step_count_that_is_not_a_count_is_named():
    """A version's ``outer_steps`` is read from its record: one that is not a count is an
    error naming it, not an optimizer stepped from garbage."""
    for bad in ("3", -1, 2.5):
        with pytest.raises(ValueError, match="fragment 0 v4: outer_steps"):
            merging(0, _init(), OuterConfig(optimizer="adam"), [], lambda n: False,
                           version=4, steps=bad)  # fmt: skip
    assert merging(0, _init(), OuterConfig(), [], lambda n: False, version=4).steps == 4
