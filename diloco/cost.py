"""What a run's traffic costs, in US dollars: bytes per region pair (``src->dst``, as the
writers' statuses count them) at the price of that pair, and requests at a price per
1,000 (``CostConfig``: the providers' list prices of ``docs/cost.md``, overridable).

Beside it, the counterfactual: what data-parallel training of the same tokens would have
moved between the run's regions. Its ring all-reduce of fp32 gradients sends about
``2 |theta| x 4`` bytes per replica per step (``dp_bytes``); with its ``M`` replicas in
the run's ``R`` regions and the ring ordered by region (the cheapest order), ``R`` of its
``M`` hops cross a region: that share of its bytes is priced at the run's mean
cross-region price. Pure arithmetic: no storage, no JAX."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from diloco.config import CostConfig

GB = 1e9  # prices are per GB of 10^9 bytes (GCP lists per GiB: docs/cost.md)


def pair_price(pair: str, prices: CostConfig) -> float:
    """Dollars per GB of ``pair`` ("SOURCE->DESTINATION"): its own price if the table
    names it, else free within a region and ``cross_region_per_gb`` across two."""
    if pair in prices.egress_per_gb:
        return prices.egress_per_gb[pair]
    src, _, dst = pair.partition("->")
    return 0.0 if src == dst else prices.cross_region_per_gb


@dataclass(frozen=True)
class Bill:
    """Dollars per region pair (its bytes and its requests), and in all."""

    pairs: dict[str, float]  # "src->dst" -> dollars, largest first
    egress: float  # bytes between regions (and any pair the table prices)
    requests: float  # every request, at requests_per_1000

    @property
    def total(self) -> float:
        return self.egress + self.requests

    def projected(self, done: float, budget: float) -> float | None:
        """The total at the budget's end at this cost per token, never less than what was
        spent (a run past its budget); None while nothing is done."""
        return max(self.total, self.total * budget / done) if done > 0 else None

    def as_dict(self) -> dict[str, Any]:
        return {"pairs": self.pairs, "egress": self.egress, "requests": self.requests,
                "total": self.total}  # fmt: skip


def bill(traffic: Mapping[str, Mapping[str, int]], prices: CostConfig) -> Bill:
    """What ``traffic`` (bytes and requests per ``src->dst`` pair) costs at ``prices``."""
    pairs, egress, requests = {}, 0.0, 0.0
    for pair, t in traffic.items():
        moved = int(t.get("bytes", 0)) / GB * pair_price(pair, prices)
        asked = int(t.get("requests", 0)) / 1000 * prices.requests_per_1000
        pairs[pair] = moved + asked
        egress, requests = egress + moved, requests + asked
    return Bill(dict(sorted(pairs.items(), key=lambda kv: -kv[1])), egress, requests)


def cross_region_price(regions: Sequence[str], prices: CostConfig) -> float:
    """The mean price of the run's ordered pairs of two different regions (0: one region)."""
    pairs = [f"{a}->{b}" for a in regions for b in regions if a != b]
    return sum(pair_price(p, prices) for p in pairs) / len(pairs) if pairs else 0.0


def dp_egress(dp_bytes: float, learners: int, regions: Sequence[str], prices: CostConfig
              ) -> tuple[float, float]:  # fmt: skip
    """(bytes, dollars) data-parallel training would have moved between regions, of its
    ``dp_bytes`` in all: the share of its ring's hops that cross a region (see above)."""
    if len(regions) < 2 or learners < 2:
        return 0.0, 0.0
    crossing = dp_bytes * min(len(regions), learners) / learners
    return crossing, crossing / GB * cross_region_price(regions, prices)
