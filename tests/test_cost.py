"""What a run's traffic costs (``diloco.cost``), from a known traffic table and price
table, and how the summary says it."""

import pytest

from diloco.config import ConfigError, CostConfig, load_config
from diloco.cost import bill, cross_region_price, dp_egress, pair_price
from flows.observe import train_summary_rows

TRAFFIC = {  # bytes and requests per pair, as the writers' statuses sum them
    "us->us": {"bytes": 40_000_000_000, "requests": 200_000},
    "us->eu": {"bytes": 3_000_000_000, "requests": 1_000},
    "eu->us": {"bytes": 1_000_000_000, "requests": 1_000},
    "eu->eu": {"bytes": 5_000_000_000, "requests": 0},
}


def test_bytes_are_priced_by_their_pair_and_requests_by_the_thousand():
    prices = CostConfig(cross_region_per_gb=0.02, egress_per_gb={"eu->us": 0.05},
                        requests_per_1000=0.005)  # fmt: skip
    assert pair_price("us->us", prices) == 0.0  # within a region: free
    assert pair_price("us->eu", prices) == 0.02  # not named: the cross-region price
    assert pair_price("eu->us", prices) == 0.05  # named: its own
    spent = bill(TRAFFIC, prices)
    assert spent.egress == pytest.approx(3 * 0.02 + 1 * 0.05)
    assert spent.requests == pytest.approx(202 * 0.005)
    assert spent.total == pytest.approx(0.11 + 1.01)
    assert spent.pairs["us->us"] == pytest.approx(200 * 0.005)  # its requests only
    assert spent.pairs["us->eu"] == pytest.approx(0.06 + 0.005)
    assert next(iter(spent.pairs)) == "us->us"  # largest first
    # At this cost per token, a budget 4 times what was done costs 4 times as much.
    assert spent.projected(1_000, 4_000) == pytest.approx(4 * spent.total)
    assert spent.projected(0, 4_000) is None  # nothing done: unknown, said so
    assert spent.projected(5_000, 4_000) == spent.total  # past the budget: what was spent


def test_data_parallels_ring_crosses_a_region_at_each_of_its_regions_hops():
    prices = CostConfig(cross_region_per_gb=0.02, egress_per_gb={"eu->us": 0.04})
    assert cross_region_price(["us", "eu"], prices) == pytest.approx(0.03)
    assert cross_region_price(["us"], prices) == 0.0
    # 4 replicas in 2 regions, ordered by region: 2 of the ring's 4 hops cross.
    moved, dollars = dp_egress(8e9, 4, ["us", "eu"], prices)
    assert moved == pytest.approx(4e9) and dollars == pytest.approx(4 * 0.03)
    assert dp_egress(8e9, 4, ["us"], prices) == (0.0, 0.0)
    assert dp_egress(8e9, 2, ["us", "eu", "ap"], prices)[0] == pytest.approx(8e9)  # every hop


def test_prices_are_set_per_pair_in_the_config_and_a_bad_pair_is_named():
    cfg = load_config("tiny", overrides=['cost.egress_per_gb={"us->eu": 0.08}',
                                         "cost.cross_region_per_gb=0.01"])  # fmt: skip
    assert cfg.cost.egress_per_gb == {"us->eu": 0.08} and cfg.cost.cross_region_per_gb == 0.01
    with pytest.raises(ConfigError, match="us-eu"):
        load_config("tiny", overrides=['cost.egress_per_gb={"us-eu": 0.08}'])
    with pytest.raises(ConfigError, match=r"cost\.requests_per_1000"):
        load_config("tiny", overrides=["cost.requests_per_1000=-1"])


def test_the_summary_says_what_each_pair_cost_the_total_and_dps():
    spent = bill(TRAFFIC, CostConfig())
    summary = {"run": "r", "mode": "decoupled", "params": 10, "learners": 2, "quorum": 1,
               "tokens": 100, "final_loss": None, "wall_seconds": 1.0, "goodput": 0.5,
               "versions": {0: 3}, "rejected": 0, "traffic": TRAFFIC, "learner_bytes": 1,
               "cross_region_bytes": 4_000_000_000, "dp_bytes": 8e9,
               "bandwidth_ratio_vs_dp": None,
               "cost": {**spent.as_dict(), "projected": 2 * spent.total,
                        "dp_cross_region_bytes": 4e9, "dp_egress": 0.08}}  # fmt: skip
    rows = dict(train_summary_rows(summary))
    assert rows["bytes us->eu"].endswith(f"· ${spent.pairs['us->eu']:.4g}")
    assert rows["traffic cost"] == ("$1.09 (bytes between regions $0.08, requests $1.01); "
                                    "$2.18 at the budget's end")  # fmt: skip
    assert rows["data-parallel's egress"].startswith("$0.08 for ")
    old = {k: v for k, v in summary.items() if k != "cost"}  # a summary from before costs
    assert "traffic cost" not in dict(train_summary_rows(old))
