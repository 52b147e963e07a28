"""How much bandwidth data-parallel and Decoupled DiLoCo need (``diloco plan bandwidth``).

Closed forms per site (data center or region; one learner per site for Decoupled
DiLoCo). Data-parallel: a ring all-reduce of the gradient every step across D sites:
each site sends and receives ``2 (D - 1) / D * |theta|`` values of ``dp_bits``. Decoupled
DiLoCo: each learner sends every fragment (``|theta| / P`` values) up once per H steps at
``bits`` and takes the merged fragment down at ``down_bits``; one exchange starts every
``dh = max(1, round(H / P))`` steps and has ``min(tau, dh)`` steps to finish (with
``tau >= dh`` exchanges overlap and only the average rate matters). ``link="shared"``
counts what goes in and out of a site on one link (in + out); ``"duplex"`` gives each
direction the link's rate (the larger direction binds). Time per step at a link of
``wan_gbps``: communication overlaps compute, so a step takes the longer of the compute
step and the link time per step (for Decoupled DiLoCo the average rate: an exchange
that takes longer than tau steps arrives late, which is staleness, not waiting).

The ``BandwidthModel`` defaults reproduce the published 198 Gbps and 0.84 Gbps across 8
data centers. Only two things are pinned by the pair: ``|theta| / step_seconds`` (by
198) and the ratio 235.7 (by both). Assumed: bf16 gradients in dp's ring, int4 up and
bf16 down for Decoupled DiLoCo (this repository's wire format), in + out on one link,
the 5 B model of the paper's simulations. Fitted: ``step_seconds`` = 1.414 (198 Gbps),
then H = P = 84 (the ratio is 2 * 2 * 7/8 * 16 * H / (4 + 16) = 2.8 H = 235.2). With
the paper's own H = P = 24 the same assumptions give 2.95 Gbps (67x); no combination
of the reported defaults (H = P = 24, tau = 2, int4) with bf16 or fp32 ring all-reduce,
one- or two-way counting, hits 235.7x: they give 42x to 336x.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from diloco.config import RunConfig

Link = Literal["shared", "duplex"]


@dataclass(frozen=True)
class BandwidthModel:
    """Defaults reproduce the published 198 Gbps (dp) and 0.84 Gbps (Decoupled DiLoCo)
    across 8 data centers; ``docs/benchmarks.md`` says which values are fitted."""

    params: float = 5e9  # |theta|: the dense 5 B model of the paper's simulations
    step_seconds: float = 1.414  # compute time of one step (fitted: dp needs 198 Gbps)
    sites: int = 8  # D: data centers or regions, one learner each
    inner_steps: int = 84  # H (fitted: 0.84 Gbps; the paper's default is 24)
    fragments: int = 84  # P (= H as in the paper: one fragment goes every step)
    tau: int = 2  # steps an exchange may take before its answer is due
    bits: float = 4.0  # outer gradients up (int4)
    down_bits: float = 16.0  # merged fragments down (bf16, as this repository sends)
    dp_bits: float = 16.0  # gradients in the all-reduce (bf16)
    link: Link = "shared"  # in + out on one link, or each direction at the full rate


@dataclass(frozen=True)
class BandwidthPlan:
    """What ``bandwidth_plan`` reports (Gbit/s, seconds, bits)."""

    dp_bits_per_step: float  # through one site's link
    decoupled_bits_per_step: float  # average, one learner's link
    dp_required_gbps: float  # to hide the all-reduce behind one step
    decoupled_required_gbps: float  # to hide each exchange behind min(tau, dh) steps
    ratio: float  # dp / decoupled required bandwidth
    wan_gbps: float | None = None
    dp_step_seconds: float | None = None  # time per step at wan_gbps
    decoupled_step_seconds: float | None = None
    exchange_steps: float | None = None  # steps one fragment exchange takes at wan_gbps
    speedup: float | None = None  # dp_step_seconds / decoupled_step_seconds

    def as_dict(self) -> dict:
        return asdict(self)


def _on_link(up: float, down: float, link: Link) -> float:
    if link not in ("shared", "duplex"):
        raise ValueError(f"link must be 'shared' or 'duplex', got {link!r}")
    return up + down if link == "shared" else max(up, down)


def dp_link_bits(bm: BandwidthModel) -> float:
    """Bits through a site's link per step: a ring all-reduce sends and receives
    ``2 (D - 1) / D * |theta|`` values each."""
    each_way = 2 * (bm.sites - 1) / bm.sites * bm.params * bm.dp_bits
    return _on_link(each_way, each_way, bm.link)


def exchange_bits(bm: BandwidthModel) -> float:
    """Bits of one fragment's exchange on a learner's link (up, then merged down)."""
    frag = bm.params / bm.fragments
    return _on_link(frag * bm.bits, frag * bm.down_bits, bm.link)


def exchange_spacing(bm: BandwidthModel) -> int:
    """dh: steps between two exchanges (ALGORITHM.md: max(1, round(H / P)))."""
    return max(1, round(bm.inner_steps / bm.fragments))


def bandwidth_plan(bm: BandwidthModel, wan_gbps: float | None = None) -> BandwidthPlan:
    if bm.sites < 2:
        raise ValueError(f"sites must be at least 2 (nothing crosses a link), got {bm.sites}")
    if bm.tau < 1 and bm.fragments > 0:
        raise ValueError(f"tau must be at least 1 step, got {bm.tau}")
    dp_bits, xbits, dh = dp_link_bits(bm), exchange_bits(bm), exchange_spacing(bm)
    dp_req = dp_bits / bm.step_seconds / 1e9
    dec_req = xbits / (min(bm.tau, dh) * bm.step_seconds) / 1e9
    plan = BandwidthPlan(dp_bits, xbits / dh, dp_req, dec_req, dp_req / dec_req)
    if wan_gbps is None:
        return plan
    rate = wan_gbps * 1e9
    dp_step = max(bm.step_seconds, dp_bits / rate)
    dec_step = max(bm.step_seconds, xbits / dh / rate)
    return replace(
        plan,
        wan_gbps=wan_gbps,
        dp_step_seconds=dp_step,
        decoupled_step_seconds=dec_step,
        exchange_steps=xbits / rate / dec_step,
        speedup=dp_step / dec_step,
    )


# Bits per value on the wire, by the config's dtype names (a block's scale left out).
WIRE_BITS = {"fp32": 32.0, "bf16": 16.0, "int8": 8.0, "int4": 4.0}


def run_bandwidth_model(cfg: RunConfig, base: BandwidthModel | None = None) -> BandwidthModel:
    """``base`` (the defaults) with what a run config fixes: its model's parameters, its
    learners as the sites (one each), H, P, the outer gradients' dtype up and the
    globals' down (their quantized difference with ``topology.downlink``)."""
    from diloco.memory import param_count

    t = cfg.topology
    down = t.global_dtype if t.downlink == "full" else t.downlink
    return replace(base or BandwidthModel(), params=float(param_count(cfg.model)),
                   sites=t.learners, inner_steps=t.inner_steps, fragments=t.fragments,
                   bits=WIRE_BITS[t.quantization], down_bits=WIRE_BITS[down])  # fmt: skip


def egress_bytes_per_step(bm: BandwidthModel) -> tuple[float, float]:
    """Bytes that cross between sites per step, all sites together (what egress is billed
    on, ``docs/cost.md``), for (data-parallel, Decoupled DiLoCo). dp: each of the D sites
    sends ``2 (D - 1) / D * |theta|`` values of its ring. Decoupled DiLoCo: the syncer sits
    in one site, so each exchange crosses D - 1 times up (a remote learner's fragment) and
    D - 1 times down (the merged fragment to each remote site's bucket), once every dh
    steps."""
    dp = 2 * (bm.sites - 1) * bm.params * bm.dp_bits / 8
    frag = bm.params / bm.fragments
    decoupled = (bm.sites - 1) * frag * (bm.bits + bm.down_bits) / 8 / exchange_spacing(bm)
    return dp, decoupled


def breakeven_step_seconds(bm: BandwidthModel, wan_gbps: float, speedup: float) -> float:
    """The longest compute step at which Decoupled DiLoCo is still ``speedup`` times
    faster than data-parallel at this link (when neither is link-bound the two run at
    the compute step, speed-up 1)."""
    rate = wan_gbps * 1e9
    dp_comm, dec_comm = dp_link_bits(bm) / rate, exchange_bits(bm) / exchange_spacing(bm) / rate
    if dp_comm < speedup * dec_comm:
        return 0.0  # even link-bound on both sides the ratio stays below the target
    return dp_comm / speedup
