"""Weights, staleness functions, merge rules, outer Nesterov and the blend, each checked
against a direct NumPy computation."""

import math

import jax
import numpy as np
import pytest

from diloco.config import InnerConfig, MergeName, OuterConfig
from diloco.inner import INNER_OPTIMIZERS, inner_optimizer, state_age
from diloco.merge import MERGE_RULES, merge_rule, normalized
from diloco.outer import (
    OUTER_OPTIMIZERS,
    Anchored,
    blend,
    constant_staleness,
    exponential_staleness,
    hinge_staleness,
    outer_optimizer,
    polynomial_staleness,
    staleness_fn,
    token_weight,
)
from diloco.tensors import ArrayTensors, pieces, step_piece

rng = np.random.default_rng(0)


def _deltas(n=3):
    return [
        {
            "embed.embedding": rng.normal(size=(4, 3)).astype(np.float32),
            "blocks.0.up.kernel": rng.normal(size=(3, 5)).astype(np.float32),
        }
        for _ in range(n)
    ]


def test_token_weight_is_tokens_times_tokens_per_step():
    assert token_weight(1000, 10) == 1000 * (1000 / 10)
    # A learner with half the batch (same steps) weighs a quarter.
    assert token_weight(500, 10) / token_weight(1000, 10) == pytest.approx(0.25)
    assert token_weight(100, 0) == 0.0


@pytest.mark.parametrize("s", [0, 1, 2, 5, 17])
def test_staleness_functions_match_formulas(s):
    assert constant_staleness()(s) == 1.0
    assert polynomial_staleness(0.5)(s) == pytest.approx((1 + s) ** -0.5)
    assert exponential_staleness(0.3)(s) == pytest.approx(math.exp(-0.3 * s))
    expected_hinge = 1.0 if s <= 2 else 1 / (0.5 * (s - 2) + 1)
    assert hinge_staleness(0.5, 2)(s) == pytest.approx(expected_hinge)


def test_staleness_fn_reads_config():
    g = staleness_fn(OuterConfig(staleness="exponential", staleness_lambda=0.7))
    assert g(3) == pytest.approx(math.exp(-2.1))


def _merge(rule, deltas, weights, is_embedding=lambda n: False, block_size=128,
           momentum=None, **cfg):  # fmt: skip
    """Rule ``rule`` of ``MERGE_RULES`` over whole fragments, a piece at a time as a syncer
    runs it (``momentum``: the outer optimizer's, which ``heloco`` reads)."""
    ds = [ArrayTensors(d) for d in deltas]
    shapes, w = ds[0].shapes, normalized(weights)
    merge = merge_rule(OuterConfig(merge=rule, momentum=0.9, **cfg))
    m = None if momentum is None else ArrayTensors(momentum)
    prepared = merge.prepare(ds, w, shapes, is_embedding, block_size, m)
    out = {n: np.zeros(s, np.float32).reshape(-1) for n, s in shapes.items()}
    for name, a, b in pieces(shapes, block_size):
        out[name][a:b] = merge.piece(name, [d.piece(name, a, b) for d in ds], w, prepared,
                                     None if m is None else m.piece(name, a, b))  # fmt: skip
    return {n: v.reshape(shapes[n]) for n, v in out.items()}


def weighted_mean(deltas, weights):
    return _merge("mean", deltas, weights)


def rda_merge(deltas, weights, is_embedding):
    return _merge("rda", deltas, weights, is_embedding)


def test_every_merge_rule_and_outer_optimizer_is_named_in_the_config():
    assert set(MERGE_RULES) == set(MergeName.__args__)
    for name in MERGE_RULES:
        assert OuterConfig(merge=name, momentum=0.9).merge == name
    names = OuterConfig.model_fields["optimizer"].annotation.__args__
    assert set(OUTER_OPTIMIZERS) == set(names)
    for name in OUTER_OPTIMIZERS:
        assert outer_optimizer(OuterConfig(optimizer=name)) is not None
    names = InnerConfig.model_fields["optimizer"].annotation.__args__
    assert set(INNER_OPTIMIZERS) == set(names)
    for name in INNER_OPTIMIZERS:
        assert inner_optimizer(InnerConfig(optimizer=name)) is not None


def test_muon_orthogonalizes_the_hidden_matrices_and_adamw_takes_the_rest():
    """``inner.optimizer = "muon"``: a hidden matrix's update is its momentum made
    orthogonal (its singular values all one, scaled to AdamW's RMS of 0.2 times the
    larger side's root); the embedding table, the output head, norms and biases get
    AdamW's update (optax's, with Nesterov momentum as Muon's: its first is the gradient's
    sign times ``1 + b1 / (1 + b1)``, whatever the gradient's size)."""
    import jax

    rng = np.random.default_rng(0)
    params = {"blocks.0.up.kernel": rng.normal(size=(8, 16)).astype(np.float32),
              "embed.embedding": rng.normal(size=(32, 8)).astype(np.float32),
              "lm_head.kernel": rng.normal(size=(8, 32)).astype(np.float32),
              "norm.scale": np.ones(8, np.float32)}  # fmt: skip
    grads = {n: rng.normal(size=v.shape).astype(np.float32) for n, v in params.items()}
    cfg = InnerConfig(optimizer="muon", weight_decay=0.0, clip_norm=1e9)
    tx = inner_optimizer(cfg)
    updates, state = tx.update(grads, tx.init(params), params)
    updates = {n: np.asarray(u) for n, u in jax.device_get(updates).items()}
    singular = np.linalg.svd(updates["blocks.0.up.kernel"], compute_uv=False)
    scale = 0.2 * np.sqrt(16)  # optax's consistent_rms: RMS 0.2 over the larger side
    np.testing.assert_allclose(singular / scale, 1.0, atol=0.35)  # 5 Newton-Schulz steps
    for name in ("embed.embedding", "lm_head.kernel", "norm.scale"):
        first = 1 + cfg.b1 / (1 + cfg.b1)
        np.testing.assert_allclose(np.abs(updates[name]), first, rtol=1e-3, err_msg=name)
    assert int(state_age(state)) == 1


def test_weighted_mean_matches_numpy():
    deltas, w = _deltas(), [3.0, 1.0, 0.5]
    merged = weighted_mean(deltas, w)
    for name in deltas[0]:
        expected = sum(wi * d[name] for wi, d in zip(w, deltas, strict=True)) / sum(w)
        np.testing.assert_allclose(merged[name], expected, rtol=1e-6)


def test_weighted_mean_rejects_zero_weights():
    with pytest.raises(ValueError, match="positive"):
        weighted_mean(_deltas(2), [0.0, 0.0])


def test_rda_matches_formula_and_keeps_embeddings_on_mean():
    deltas, w = _deltas(), [2.0, 1.0, 1.0]
    merged = rda_merge(deltas, w, lambda n: n.startswith("embed"))
    wn = np.array(w) / sum(w)
    name = "blocks.0.up.kernel"
    xs = [d[name].astype(np.float64) for d in deltas]
    radius = sum(wi * np.linalg.norm(x) for wi, x in zip(wn, xs, strict=True))
    direction = sum(wi * x / np.linalg.norm(x) for wi, x in zip(wn, xs, strict=True))
    expected = radius * direction / np.linalg.norm(direction)
    np.testing.assert_allclose(merged[name], expected, rtol=1e-5)
    np.testing.assert_allclose(
        merged["embed.embedding"], weighted_mean(deltas, w)["embed.embedding"], rtol=1e-6
    )


def test_rda_keeps_norm_that_averaging_shrinks():
    # Orthogonal outer gradients: the mean has norm 1/sqrt(M) of each, RDA keeps it.
    eye = np.eye(4, dtype=np.float32)
    deltas = [{"w": eye[i]} for i in range(4)]
    assert np.linalg.norm(weighted_mean(deltas, [1] * 4)["w"]) == pytest.approx(0.5)
    assert np.linalg.norm(rda_merge(deltas, [1] * 4, lambda n: False)["w"]) == pytest.approx(1.0)


def test_rda_of_zero_vectors_is_zero():
    deltas = [{"w": np.zeros(3, np.float32)}] * 2
    np.testing.assert_array_equal(rda_merge(deltas, [1, 1], lambda n: False)["w"], np.zeros(3))


def heloco_reference(delta, m, c_ok, k_s, beta_max, k_d, kappa, eps=1e-12):
    """HeLoCo's corrected outer gradient of one block, as its equations write it."""
    delta, m = delta.astype(np.float64).ravel(), m.astype(np.float64).ravel()
    u, v = delta / np.linalg.norm(delta), m / np.linalg.norm(m)
    c = float(u @ v)
    conf = np.linalg.norm(delta) / (np.linalg.norm(delta) + kappa * np.linalg.norm(m) + eps)
    if c >= c_ok:
        return delta, c
    if c < 0:
        beta = min(k_s * (-c) * conf, beta_max)
        return delta - beta * c * np.linalg.norm(delta) * v, c
    lam = min(k_d * (1 - c) * conf, 1.0)
    t = (1 - lam) * u + lam * v
    return np.linalg.norm(delta) * t / max(np.linalg.norm(t), eps), c


@pytest.mark.parametrize("block_size", [5, 128])
def test_heloco_corrects_each_outer_gradient_against_the_momentum_as_its_equations_say(
    block_size,
):
    """Three outer gradients of a tensor: one along the outer momentum (kept), one against
    it (its opposed part shrunk), one nearly orthogonal (turned towards it at its own
    length); then their weighted mean. Merged in pieces of 5 values or whole, to float
    tolerance of the equations; and with no momentum yet, the plain mean."""
    params = {"c_ok": 0.3, "k_s": 1.5, "beta_max": 0.8, "k_d": 0.7, "kappa": 0.5}
    cfg = {f"heloco_{k}": v for k, v in params.items()}
    m = rng.normal(size=(3, 5)).astype(np.float32)
    noise = [rng.normal(size=(3, 5)) for _ in range(3)]
    other = noise[2] - (noise[2].ravel() @ m.ravel()) / (m.ravel() @ m.ravel()) * m
    deltas = [{"w": (m + 0.3 * noise[0]).astype(np.float32)},
              {"w": (-0.5 * m + 0.4 * noise[1]).astype(np.float32)},
              {"w": (other + 0.1 * m).astype(np.float32)}]  # fmt: skip
    w = [3.0, 1.0, 2.0]
    corrected = [heloco_reference(d["w"], m, **params) for d in deltas]
    cosines = [c for _, c in corrected]
    assert cosines[0] >= 0.3 and cosines[1] < 0 and 0 <= cosines[2] < 0.3, cosines
    expected = sum(wi * x for wi, (x, _) in zip(normalized(w), corrected, strict=True))
    merged = _merge("heloco", deltas, w, block_size=block_size, momentum={"w": m}, **cfg)
    np.testing.assert_allclose(merged["w"].ravel(), expected, rtol=1e-5, atol=1e-6)
    # The correction changed something: the mean differs.
    assert np.abs(merged["w"] - weighted_mean(deltas, w)["w"]).max() > 1e-2
    zero = {"w": np.zeros((3, 5), np.float32)}
    np.testing.assert_array_equal(
        _merge("heloco", deltas, w, momentum=zero, **cfg)["w"], weighted_mean(deltas, w)["w"]
    )


def test_heloco_needs_an_outer_momentum():
    with pytest.raises(ValueError, match="merge heloco sets"):
        OuterConfig(merge="heloco", momentum=0.0)
    assert OuterConfig(merge="heloco", optimizer="adam").merge == "heloco"


def test_anchored_delta():
    cur, base, d = (ArrayTensors({"w": np.array([x], np.float32)}) for x in (5.0, 3.0, 0.5))
    # theta_m = base - d = 2.5; current - theta_m = 2.5
    assert Anchored(cur, base, d).piece("w", 0, 1)[0] == pytest.approx(2.5)


def outer_step(tx, params, state, merged):
    """One outer step of ``tx``, tensor by tensor as a syncer steps its pieces."""
    (name,) = params
    slots = [np.asarray(x) for x in jax.tree.leaves(state)]
    new, slots = step_piece(tx, name, params[name], slots, merged[name])
    structure = jax.tree.structure(state)
    return {name: new}, jax.tree.unflatten(structure, slots)


def test_outer_nesterov_matches_numpy_over_several_steps():
    lr, beta = 0.7, 0.9
    tx = outer_optimizer(OuterConfig(lr=lr, momentum=beta, nesterov=True))
    params = {"w": rng.normal(size=(6,)).astype(np.float32)}
    state = tx.init(params)
    theta, v = params["w"].astype(np.float64), np.zeros(6)
    for _ in range(4):
        delta = rng.normal(size=(6,)).astype(np.float32)
        params, state = outer_step(tx, params, state, {"w": delta})
        v = delta + beta * v
        theta = theta - lr * (delta + beta * v)
        np.testing.assert_allclose(params["w"], theta, rtol=1e-5, atol=1e-6)


def test_outer_plain_sgd_without_momentum():
    tx = outer_optimizer(OuterConfig(lr=0.5, momentum=0.0, nesterov=False))
    params = {"w": np.ones(3, np.float32)}
    params, _ = outer_step(tx, params, tx.init(params), {"w": np.full(3, 2.0, np.float32)})
    np.testing.assert_allclose(params["w"], np.zeros(3))


def test_blend():
    local, glob = {"w": np.array([1.0, 2.0])}, {"w": np.array([3.0, 6.0])}
    np.testing.assert_allclose(blend(local, glob, 0.25)["w"], 0.25 * local["w"] + 0.75 * glob["w"])
    out = blend(local, glob, 0.0)
    np.testing.assert_array_equal(out["w"], glob["w"])
    assert out["w"] is not glob["w"]  # the learner may not alias the syncer's array
