"""The planner (``diloco.plan``, ``diloco plan``): closed forms, the published points the
defaults are calibrated on, the CLI's JSON, and agreement with ``diloco simulate``."""

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from diloco.plan import (
    BandwidthModel,
    FailureModel,
    bandwidth_plan,
    breakeven_step_seconds,
    calibrate,
    decoupled_cell,
    dp_goodput_closed_form,
    dp_uptime_closed_form,
    goodput_table,
    learner_goodput_closed_form,
    outages,
    reconfigurations,
    simulate_decoupled,
    simulate_dp,
    simulate_dp_elastic,
    unsent_loss,
)
from flows.cli import main

NO_FAILURES = FailureModel(mtbi_hours=math.inf, duration_hours=1.0)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_no_failures_is_full_goodput():
    for cell in (
        simulate_dp(1000, NO_FAILURES, rng()),
        simulate_dp_elastic(100_000, NO_FAILURES, rng()),
        simulate_decoupled(1000, 1, 1, NO_FAILURES, rng()),
        simulate_decoupled(1000, 8, 8, NO_FAILURES, rng()),
    ):
        assert cell.goodput == pytest.approx(1.0)
        assert cell.uptime == pytest.approx(1.0)


def test_dp_matches_renewal_closed_forms():
    """Exponential failures at N lambda, fixed restart R: uptime 1 / (1 + N lambda R);
    with checkpoints every C, goodput C q / (1 - q) / (1 / (N lambda) + R)."""
    fm = FailureModel(duration_hours=24 * 60)
    for chips in (300_000, 1_200_000, 2_400_000):
        cell = simulate_dp(chips, fm, rng(chips))
        assert cell.uptime == pytest.approx(dp_uptime_closed_form(chips, fm), abs=0.005)
        assert cell.goodput == pytest.approx(dp_goodput_closed_form(chips, fm), abs=0.005)
    no_rollback = replace(fm, checkpoint_seconds=0.0)
    cell = simulate_dp(1_200_000, no_rollback, rng())
    assert cell.goodput == pytest.approx(cell.uptime)
    assert cell.uptime == pytest.approx(1 / (1 + 1_200_000 / (8760 * 3600) * 15), abs=0.005)


def test_decoupled_with_quorum_one_beats_dp():
    fm = FailureModel(duration_hours=48)
    for chips in (150_000, 1_200_000, 2_400_000):
        dp = simulate_dp(chips, fm, rng(1))
        for m in (2, 4, 8):
            assert simulate_decoupled(chips, m, 1, fm, rng(2)).goodput > dp.goodput
    # A larger quorum can only stall more.
    k1 = simulate_decoupled(2_400_000, 4, 1, fm, rng(3))
    k4 = simulate_decoupled(2_400_000, 4, 4, fm, rng(3))
    assert k4.uptime < k1.uptime and k4.goodput < k1.goodput


def test_elastic_and_decoupled_match_their_closed_forms():
    """Elastic dp: reconfigurations form a single-server queue busy a share
    Lambda (D + U) of the time. Decoupled with K = 1 and no stalls: every learner is
    a renewal process, (E[U] - E[unsent]) / (E[U] + R)."""
    fm = FailureModel(duration_hours=24 * 30)
    for chips in (600_000, 2_400_000):
        busy = chips * fm.chip_rate * (fm.downscale_seconds + fm.upscale_seconds)
        assert simulate_dp_elastic(chips, fm, rng()).uptime == pytest.approx(1 - busy, abs=0.01)
        cell = simulate_decoupled(chips, 8, 1, fm, rng())
        assert cell.goodput == pytest.approx(learner_goodput_closed_form(chips / 8, fm), abs=0.005)


def test_published_points_with_the_defaults():
    cells = goodput_table(chips=(1_200_000,), learners=(8,))
    got = {c.mode: c.goodput for c in cells}
    assert got["dp"] == pytest.approx(0.27, abs=0.02)
    assert got["decoupled"] == pytest.approx(0.88, abs=0.02)
    assert got["dp"] < got["dp_elastic"] < got["decoupled"]


def test_calibration_gives_the_default_constants():
    recovery, checkpoint = calibrate()
    fm = FailureModel()
    assert recovery == pytest.approx(fm.recovery_seconds, abs=1.0)
    assert checkpoint == pytest.approx(fm.checkpoint_seconds, abs=1.0)
    fitted = replace(fm, recovery_seconds=recovery, checkpoint_seconds=checkpoint)
    assert dp_goodput_closed_form(1_200_000, fitted) == pytest.approx(0.27, abs=1e-6)


def test_unsent_loss_by_hand():
    # Sync every 10 s over 2 fragments: fragment 0 goes at 5, 15, ...; fragment 1 at 10, 20.
    got = unsent_loss(np.array([3.0, 7.0, 12.0]), 10.0, 2)
    np.testing.assert_allclose(got, [3.0, (2 + 7) / 2, (7 + 2) / 2])


def test_reconfigurations_run_one_at_a_time():
    start, end = reconfigurations(np.array([0.0, 1.0, 10.0]), np.array([5.0, 5.0, 2.0]))
    np.testing.assert_allclose(start, [0.0, 5.0, 10.0])
    np.testing.assert_allclose(end, [5.0, 10.0, 12.0])


def test_bandwidth_closed_forms_by_hand():
    bm = BandwidthModel(params=1e9, step_seconds=1.0, sites=4, inner_steps=10, fragments=5,
                        tau=1, bits=4, down_bits=16, dp_bits=16, link="shared")  # fmt: skip
    plan = bandwidth_plan(bm, wan_gbps=8.0)
    # dp: 2 (4 - 1) / 4 x 1e9 x 16 bits each way, in + out on one link.
    assert plan.dp_bits_per_step == pytest.approx(48e9)
    assert plan.dp_required_gbps == pytest.approx(48.0)
    # Decoupled: fragments of 2e8 values, 4 up + 16 down, one exchange every 2 steps,
    # each to finish within tau = 1 step.
    assert plan.decoupled_required_gbps == pytest.approx(4.0)
    assert plan.decoupled_bits_per_step == pytest.approx(2e9)
    assert plan.dp_step_seconds == pytest.approx(6.0)
    assert plan.decoupled_step_seconds == pytest.approx(1.0)
    assert plan.speedup == pytest.approx(6.0)
    assert breakeven_step_seconds(bm, 8.0, 20.0) == pytest.approx(0.3)
    duplex = bandwidth_plan(replace(bm, link="duplex"))
    assert duplex.dp_required_gbps == pytest.approx(24.0)
    assert duplex.decoupled_required_gbps == pytest.approx(3.2)  # the bf16 download binds


def test_bandwidth_defaults_reproduce_the_published_pair():
    plan = bandwidth_plan(BandwidthModel())
    assert round(plan.dp_required_gbps) == 198
    assert round(plan.decoupled_required_gbps, 2) == 0.84


def test_cli_goodput_json(capsys, tmp_path):
    png = tmp_path / "goodput.png"
    args = ["plan", "goodput", "--json", "--chips", "1e5", "2e5", "--learners", "2", "4",
            "--duration-hours", "2", "--seed", "3", "--plot", str(png)]  # fmt: skip
    assert main(args) == 0
    cells = json.loads(capsys.readouterr().out)
    assert len(cells) == 2 * (2 + 2)
    for cell in cells:
        assert set(cell) == {"mode", "learners", "chips", "goodput", "uptime"}
        assert cell["mode"] in ("dp", "dp_elastic", "decoupled")
        assert 0.0 <= cell["goodput"] <= cell["uptime"] + 1e-12 <= 1.0 + 1e-12
    assert {(c["mode"], c["learners"]) for c in cells} == {
        ("dp", 1), ("dp_elastic", 1), ("decoupled", 2), ("decoupled", 4)
    }  # fmt: skip
    assert {c["chips"] for c in cells} == {100_000, 200_000}
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(args) == 0  # the same seed, the same numbers
    assert json.loads(capsys.readouterr().out) == cells


def test_cli_bandwidth_json(capsys):
    assert main(["plan", "bandwidth", "--json", "--params", "12e9", "--sites", "4",
                 "--inner-steps", "24", "--fragments", "24", "--wan-gbps", "2", "5"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert [link["wan_gbps"] for link in out["links"]] == [2.0, 5.0]
    assert all(link["speedup"] > 20 for link in out["links"])


def test_cli_caps_the_quorum_and_refuses_zero(capsys):
    assert main(["plan", "goodput", "--learners", "2", "--quorum", "3", "--chips", "1000",
                 "--duration-hours", "1"]) == 0  # fmt: skip
    # K is capped at M per column (the table's M = 2 column runs with K = 2).
    assert main(["plan", "goodput", "--quorum", "0", "--duration-hours", "1"]) == 2


@pytest.mark.slow
def test_agrees_with_simulate_scaled_down():
    """The same outages (M = 4, ~3 simulated minutes, a failure per learner every 60 s,
    10 s down) through the planner and through ``diloco simulate``'s real loops."""
    from diloco.config import load_config, validate_config
    from diloco.simulate import simulate

    steps, recovery = 200, 10.0
    fm = FailureModel(mtbi_hours=60 / 3600, recovery_seconds=recovery, step_seconds=1.0,
                      inner_steps=10, fragments=2, duration_hours=steps / 3600)  # fmt: skip
    o = outages(rng(1), 4, fm.chip_rate, recovery, fm.duration)
    planned = decoupled_cell(o, 4, 1, fm)
    raw = load_config("tiny", overrides=[f"budget.tokens={4 * steps * 512}",
                                         "topology.quorum=1"], mode="decoupled").model_dump()  # fmt: skip
    raw["sim"]["failures"] = [
        {"learner": int(m), "at": float(t) / steps, "duration": recovery / steps}
        for t, m in zip(o.fail, o.slice, strict=True)
    ]
    cfg = validate_config(raw)
    assert cfg.tokens_per_step == 512 and cfg.steps_per_learner == steps
    simulated = simulate(cfg).summary["goodput"]
    assert len(o.fail) >= 5
    assert simulated == pytest.approx(planned.goodput, abs=0.04)
