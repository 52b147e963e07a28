"""The planner (``diloco.plan``, ``diloco plan``): closed forms, the published points the
defaults are calibrated on, the CLI's JSON, and agreement with ``diloco simulate``."""

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from diloco.bandwidth import (
    BandwidthModel,
    bandwidth_plan,
    breakeven_step_seconds,
    egress_bytes_per_step,
)
from diloco.plan import (
    FailureModel,
    absorbing_stops,
    calibrate,
    decoupled_cell,
    dp_goodput_closed_form,
    dp_uptime_closed_form,
    elastic_uptime_closed_form,
    goodput_table,
    learner_goodput_closed_form,
    outages,
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
    """Exponential failures at N lambda, a fixed stop S = R + restart: uptime
    1 / (1 + N lambda S); with checkpoints every C, goodput C q / (1 - q) / (1 / (N
    lambda) + S)."""
    fm = FailureModel(duration_hours=24 * 60)
    for checkpoint in (0.0, 10.0):
        rolled = replace(fm, checkpoint_seconds=checkpoint)
        for chips in (300_000, 1_200_000, 2_400_000):
            cell = simulate_dp(chips, rolled, rng(chips))
            assert cell.uptime == pytest.approx(dp_uptime_closed_form(chips, rolled), abs=0.005)
            assert cell.goodput == pytest.approx(dp_goodput_closed_form(chips, rolled), abs=0.005)
    cell = simulate_dp(1_200_000, fm, rng())
    assert cell.goodput == pytest.approx(cell.uptime)  # the default rolls nothing back
    assert cell.uptime == pytest.approx(1 / (1 + 1_200_000 / (8760 * 3600) * 71), abs=0.005)


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
    """Elastic dp: stops that absorb what arrives during them, close to
    1 / (1 + N lambda (D + U)). Decoupled with K = 1 and no stalls: every learner is a
    renewal process, (E[U] - E[unsent]) / (E[U] + R)."""
    fm = FailureModel(duration_hours=24 * 30)
    for chips in (600_000, 2_400_000):
        cell = simulate_dp_elastic(chips, fm, rng())
        assert cell.uptime == pytest.approx(elastic_uptime_closed_form(chips, fm), abs=0.01)
        assert cell.goodput < cell.uptime  # the failed slices' chips idle until they are back
        cell = simulate_decoupled(chips, 8, 1, fm, rng())
        assert cell.goodput == pytest.approx(learner_goodput_closed_form(chips / 8, fm), abs=0.005)


# The paper's goodput figures: 27 % and 88 % at 1.2 M chips are the paper's own (its
# blog and figure); the 2.4 M points are what secondary sources of the paper report,
# in whole percent. Three of the six are fitted (``calibrate``), the other three
# predicted; docs/algorithm.md, "Goodput at datacenter scale", has the table.
PUBLISHED = {
    (1_200_000, "dp", 1): 0.27,
    (1_200_000, "decoupled", 8): 0.88,
    (2_400_000, "dp", 1): 0.18,
    (2_400_000, "dp_elastic", 1): 0.40,
    (2_400_000, "decoupled", 8): 0.80,
    (2_400_000, "decoupled", 16): 0.86,
}
# One point at the paper's own figures (the simulation's noise over 7 days is under
# a point); three points at the secondary sources' (whole percent, and dp's
# 18 % lies 2.4 points above the most that constant stops allow: the next tests).
TOLERANCE = {1_200_000: 0.01, 2_400_000: 0.03}


def test_the_defaults_follow_the_published_shape():
    """The planner's table, not the closed forms: every published point within its
    tolerance, and at 2.4 M chips the order dp < elastic dp < M = 8 < M = 16."""
    cells = goodput_table(chips=(1_200_000, 2_400_000), learners=(8, 16))
    got = {(c.chips, c.mode, c.learners): c.goodput for c in cells}
    for key, published in PUBLISHED.items():
        assert got[key] == pytest.approx(published, abs=TOLERANCE[key[0]]), key
    at = {(mode, m): g for (n, mode, m), g in got.items() if n == 2_400_000}
    assert at[("dp", 1)] < at[("dp_elastic", 1)] < at[("decoupled", 8)] < at[("decoupled", 16)]

    # From 1.2 M to 2.4 M dp's odds of losing, (1 - g) / g, double: each failure costs a
    # constant stop and twice the chips fail twice as often (the old rollback to a
    # checkpoint every 40 s made them grow 5.3x). The simulation's noise is a few percent.
    def odds(g: float) -> float:
        return (1 - g) / g

    ratio = odds(got[(2_400_000, "dp", 1)]) / odds(got[(1_200_000, "dp", 1)])
    assert ratio == pytest.approx(2.0, rel=0.1)


def test_a_checkpoint_rollback_only_steepens_dp():
    """With the restart refitted to 27 % at 1.2 M chips, every checkpoint interval
    leaves dp at 2.4 M below the no-rollback 15.6 % (the stops alone double its odds of
    losing), and the old fit (40 s, no restart) falls to 7 %: no rollback is what gives
    the paper's shape, and 18 % is out of reach of constant stops."""

    def refitted(fm: FailureModel) -> FailureModel:
        k = calibrate(fm=fm)
        return replace(fm, recovery_seconds=k.recovery_seconds, restart_seconds=k.restart_seconds)

    fm = FailureModel()
    no_rollback = dp_goodput_closed_form(2_400_000, refitted(fm))
    assert no_rollback == pytest.approx(1 / (1 + 2 * (1 / 0.27 - 1)))  # 15.6 %
    assert dp_goodput_closed_form(2_400_000, fm) == pytest.approx(no_rollback, abs=0.002)
    previous = no_rollback
    for checkpoint in (1.0, 5.0, 20.0, 39.0):
        fitted = refitted(replace(fm, checkpoint_seconds=checkpoint))
        assert dp_goodput_closed_form(1_200_000, fitted) == pytest.approx(0.27)
        at_24 = dp_goodput_closed_form(2_400_000, fitted)
        assert at_24 < previous
        previous = at_24
    old = replace(fm, restart_seconds=0.0, checkpoint_seconds=40.0)
    assert dp_goodput_closed_form(1_200_000, old) == pytest.approx(0.27, abs=0.01)
    assert dp_goodput_closed_form(2_400_000, old) < 0.08


def test_calibration_gives_the_default_constants():
    fitted = calibrate()
    fm = FailureModel()
    assert fitted.recovery_seconds == pytest.approx(fm.recovery_seconds, abs=1.0)
    assert fitted.restart_seconds == pytest.approx(fm.restart_seconds, abs=1.0)
    assert fitted.reconfigure_seconds == pytest.approx(fm.downscale_seconds, abs=0.5)
    assert fitted.reconfigure_seconds == pytest.approx(fm.upscale_seconds, abs=0.5)
    exact = replace(fm, recovery_seconds=fitted.recovery_seconds,
                    restart_seconds=fitted.restart_seconds)  # fmt: skip
    assert dp_goodput_closed_form(1_200_000, exact) == pytest.approx(0.27, abs=1e-9)
    assert learner_goodput_closed_form(150_000, exact) == pytest.approx(0.88, abs=1e-9)
    with pytest.raises(ValueError, match="no restart time gives 27%"):
        calibrate(fm=replace(fm, checkpoint_seconds=60.0))


def test_unsent_loss_by_hand():
    # Sync every 10 s over 2 fragments: fragment 0 goes at 5, 15, ...; fragment 1 at 10, 20.
    got = unsent_loss(np.array([3.0, 7.0, 12.0]), 10.0, 2)
    np.testing.assert_allclose(got, [3.0, (2 + 7) / 2, (7 + 2) / 2])


def test_stops_absorb_what_arrives_during_them():
    # 1 joins the stop begun at 0; 11.5 joins the one begun at 10; 20 starts its own.
    start, end = absorbing_stops(np.array([0.0, 1.0, 10.0, 11.5, 20.0]),
                                 np.array([5.0, 5.0, 2.0, 1.0, 3.0]))  # fmt: skip
    np.testing.assert_allclose(start, [0.0, 10.0, 20.0])
    np.testing.assert_allclose(end, [5.0, 12.0, 23.0])
    start, _ = absorbing_stops(np.array([0.0, 0.0, 1.0]), np.zeros(3))  # no stall on 0 s
    np.testing.assert_allclose(start, [0.0, 0.0, 1.0])


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
    # Egress, all sites: dp's 4 sites each send 2 x 3/4 x 1e9 values of 2 bytes; the
    # decoupled exchange crosses 3 times up (0.5 byte a value) and 3 times down (2 bytes)
    # for a fragment of 2e8 values, every 2 steps.
    dp, decoupled = egress_bytes_per_step(bm)
    assert dp == pytest.approx(12e9) and decoupled == pytest.approx(3 * 2e8 * 2.5 / 2)


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
    # What each moves between the sites over 100,000 steps, at $0.02/GB (the default).
    dp, decoupled = out["egress"]["dp"], out["egress"]["decoupled"]
    assert dp["bytes"] == pytest.approx(2 * 3 * 12e9 * 2 * 100_000)
    assert decoupled["bytes"] == pytest.approx(3 * 12e9 / 24 * 2.5 * 100_000)
    assert dp["dollars"] == pytest.approx(dp["bytes"] / 1e9 * 0.02)
    assert main(["plan", "bandwidth", "--json", "--egress-per-gb", "0.09", "--steps", "10"]) == 0
    priced = json.loads(capsys.readouterr().out)["egress"]["decoupled"]
    assert priced["dollars"] == pytest.approx(priced["bytes"] / 1e9 * 0.09)


def test_cli_bandwidth_of_a_run_config(capsys):
    """A run's own numbers: its model's parameters, its learners as the sites, H, P, the
    wire dtypes up and down; a flag given wins over the config."""
    from diloco.config import load_config
    from diloco.memory import param_count

    args = ["plan", "bandwidth", "--json", "--preset", "llama-tiny", "--set",
            "topology.learners=3", "--set", "topology.downlink=int8", "--fragments", "4"]  # fmt: skip
    assert main(args) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    params = param_count(load_config("llama-tiny").model)
    assert (model["params"], model["sites"], model["inner_steps"]) == (params, 3, 20)
    assert (model["fragments"], model["bits"], model["down_bits"]) == (4, 4.0, 8.0)
    assert main(["plan", "bandwidth", "--json"]) == 0  # no config: the paper's 5 B, 8 sites
    model = json.loads(capsys.readouterr().out)["model"]
    assert (model["params"], model["sites"], model["fragments"]) == (5e9, 8, 84)


def test_cli_caps_the_quorum_and_refuses_zero(capsys):
    assert main(["plan", "goodput", "--learners", "2", "--quorum", "3", "--chips", "1000",
                 "--duration-hours", "1"]) == 0  # fmt: skip
    # K is capped at M per column (the table's M = 2 column runs with K = 2).
    assert main(["plan", "goodput", "--quorum", "0", "--duration-hours", "1"]) == 2
    capsys.readouterr()
    assert main(["plan", "goodput", "--restart-seconds", "-5", "--duration-hours", "1"]) == 2
    assert "--restart-seconds: a time must not be negative" in capsys.readouterr().err


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
