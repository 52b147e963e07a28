"""What a byte and a request cost (``diloco.cost`` prices a run's traffic with it): the
providers' list prices of ``docs/cost.md`` as defaults, overridable per region pair. Not
part of the run spec: a price may change between two launches of one run."""

from __future__ import annotations

from pydantic import Field, NonNegativeFloat, field_validator

from diloco.config.base import Strict


class CostConfig(Strict):
    cross_region_per_gb: NonNegativeFloat = Field(
        0.02,
        description="US dollars per GB (10^9 bytes) read or written across two regions, for "
        "a pair egress_per_gb does not name (AWS: most inter-region pairs; GCP: 0.01-0.02 "
        "within a continent; docs/cost.md)",
    )
    egress_per_gb: dict[str, NonNegativeFloat] = Field(
        default_factory=dict,
        description='US dollars per GB for a pair "SOURCE->DESTINATION" of the run\'s '
        'regions, e.g. {"us-east->eu-west": 0.02}; a pair within one region is free '
        "unless named here",
    )
    requests_per_1000: NonNegativeFloat = Field(
        0.005,
        description="US dollars per 1,000 bucket requests of any kind (priced as writes: "
        "S3 PUT and LIST, GCS class A)",
    )

    @field_validator("egress_per_gb")
    @classmethod
    def _pairs(cls, prices: dict[str, float]) -> dict[str, float]:
        for pair in prices:
            ends = pair.split("->")
            if len(ends) != 2 or not all(e.strip() for e in ends):
                raise ValueError(f'{pair!r} is not a region pair "SOURCE->DESTINATION"')
        return prices
