"""``diloco plan``: goodput and bandwidth at datacenter scale (``diloco.plan``) and a
learner's memory per device (``diloco.memory``), before any training."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from rich.table import Table

from diloco.config import PRESETS, ConfigError, CostConfig, load_config
from flows.cli_args import SET_HELP, count
from flows.observe import dollar, human_bytes
from flows.train import console, stdout_console


def _model_flag(parser: argparse.ArgumentParser, model: Any, name: str, kind: type,
                text: str, given_only: bool = False) -> None:  # fmt: skip
    """``--NAME`` for field ``name`` of a planner model, defaulting to the model's value
    (``given_only``: None unless given, so that a run config can fill it in)."""
    default = getattr(model, name)
    parser.add_argument("--" + name.replace("_", "-"), dest=name, type=kind,
                        default=None if given_only else default,
                        help=f"{text} (default {default:g})")  # fmt: skip


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    """``diloco plan goodput``, ``bandwidth`` and ``memory``: every constant of
    ``diloco.plan`` a flag, defaulting to the model's own default (numpy only: no JAX)."""
    plan = sub.add_parser("plan", help="goodput and bandwidth at datacenter scale (no training)")
    kinds = plan.add_subparsers(dest="plan", required=True)
    _add_plan_goodput(kinds)
    _add_plan_bandwidth(kinds)
    _add_plan_memory(kinds)


def _add_plan_goodput(kinds: argparse._SubParsersAction) -> None:
    from diloco.plan import CHIPS, LEARNERS, FailureModel

    fm = FailureModel()
    gp = kinds.add_parser("goodput", help="failure simulation of N chips: dp, elastic dp, "
                          "Decoupled DiLoCo with M learners")  # fmt: skip
    gp.add_argument("--chips", type=count, nargs="+", default=list(CHIPS), metavar="N")
    gp.add_argument("--learners", type=int, nargs="+", default=list(LEARNERS), metavar="M")
    gp.add_argument("--quorum", type=int, default=1, help="K (default 1; at most M)")
    for name, kind, text in (
        ("mtbi_hours", float, "mean time between interruptions per chip"),
        ("recovery_seconds", float, "a failed slice is back after this (fitted to 88 %%)"),
        ("restart_seconds", float, "dp: then the whole job restarts (fitted to 27 %%)"),
        ("checkpoint_seconds", float, "dp progress between checkpoints; 0: no rollback"),
        ("downscale_seconds", float, "elastic dp: all stop while the job shrinks (fitted: 40 %%)"),
        ("upscale_seconds", float, "elastic dp: all stop while slices are re-added (fitted)"),
        ("elastic_slice_chips", int, "elastic dp: chips dropped per failure"),
        ("step_seconds", float, "one inner step (decoupled sync period = H steps)"),
        ("inner_steps", int, "H: inner steps between two sends of one fragment"),
        ("fragments", int, "P"),
        ("duration_hours", float, "simulated time per cell"),
    ):
        _model_flag(gp, fm, name, kind, text)
    gp.add_argument("--seed", type=int, default=0)
    gp.add_argument("--json", action="store_true", help="a list of cells")
    gp.add_argument("--plot", metavar="FILE.png", help="goodput against chips")
    gp.set_defaults(func=cmd_plan_goodput)


def _add_plan_bandwidth(kinds: argparse._SubParsersAction) -> None:
    from diloco.bandwidth import BandwidthModel

    bm = BandwidthModel()
    bw = kinds.add_parser("bandwidth", help="bandwidth dp and Decoupled DiLoCo need, and "
                          "time per step at a given link")  # fmt: skip
    for name, kind, text in (
        ("params", float, "|theta|, parameters"),
        ("step_seconds", float, "compute time of one step"),
        ("sites", int, "data centers or regions (one learner each)"),
        ("inner_steps", int, "H"),
        ("fragments", int, "P"),
        ("tau", int, "steps an exchange may take"),
        ("bits", float, "bits per value of outer gradients (up)"),
        ("down_bits", float, "bits per value of merged fragments (down)"),
        ("dp_bits", float, "bits per value of dp's gradients"),
    ):
        _model_flag(bw, bm, name, kind, text, given_only=True)
    bw.add_argument("--preset", choices=sorted(PRESETS),
                    help="take --params, --sites (its learners), --inner-steps, --fragments, "
                    "--bits and --down-bits from this run config (flags given win)")  # fmt: skip
    bw.add_argument("--config", help="the same from a TOML or JSON file of config fields")
    bw.add_argument("--set", action="append", metavar="KEY=VALUE", help=SET_HELP)
    bw.add_argument("--link", choices=["shared", "duplex"], default=bm.link,
                    help="shared: in + out on one link (default); duplex: each direction at "
                    "the full rate")  # fmt: skip
    bw.add_argument("--wan-gbps", type=float, nargs="+", default=[], metavar="GBPS",
                    help="links to time a step at")  # fmt: skip
    bw.add_argument("--target", type=float, default=20.0,
                    help="speed-up whose break-even compute step is reported (default 20)")  # fmt: skip
    bw.add_argument("--egress-per-gb", type=float, default=CostConfig().cross_region_per_gb,
                    help="US dollars per GB between two sites (default %(default)g: "
                    "docs/cost.md)")  # fmt: skip
    bw.add_argument("--steps", type=count, default=100_000,
                    help="steps the egress cost is given for (default %(default)d)")  # fmt: skip
    bw.add_argument("--json", action="store_true")
    bw.set_defaults(func=cmd_plan_bandwidth)


def _add_plan_memory(kinds: argparse._SubParsersAction) -> None:
    mem = kinds.add_parser("memory", help="memory per device of one learner of a preset, "
                           "sharded over N devices (diloco/memory.py)")  # fmt: skip
    mem.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    mem.add_argument("--config", help="a TOML or JSON file of config fields")
    mem.add_argument("--set", action="append", metavar="KEY=VALUE", help=SET_HELP)
    mem.add_argument("--devices", type=int, nargs="+", default=[1, 8], metavar="N",
                     help="devices a learner shards its model over (FSDP; default 1 8)")  # fmt: skip
    mem.add_argument("--json", action="store_true")
    mem.set_defaults(func=cmd_plan_memory)


def cmd_plan_goodput(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from diloco.plan import FailureModel, goodput_table

    fm = FailureModel(**{f.name: getattr(args, f.name) for f in fields(FailureModel)})
    if args.quorum < 1 or any(m < 1 for m in args.learners) or any(n < 1 for n in args.chips):
        raise ConfigError("--quorum, --learners and --chips must be at least 1")
    negative = [f.name for f in fields(FailureModel) if f.name.endswith("_seconds")
                and getattr(fm, f.name) < 0]  # fmt: skip
    if negative:
        flags = ", ".join("--" + name.replace("_", "-") for name in negative)
        raise ConfigError(f"{flags}: a time must not be negative")
    started = time.perf_counter()
    cells = goodput_table(tuple(args.chips), tuple(args.learners), args.quorum, fm, args.seed)
    wall = time.perf_counter() - started
    if args.plot:
        plot_goodput(cells, args.plot)
    if args.json:
        print(json.dumps([c.as_dict() for c in cells], indent=1))
        return 0
    columns = [("dp", 1, "dp"), ("dp_elastic", 1, "dp elastic")] + [
        ("decoupled", m, f"M = {m}") for m in args.learners
    ]
    table = Table(title=f"goodput (uptime), K = {args.quorum}, {fm.duration_hours:g} h "
                  f"simulated per cell, seed {args.seed} ({wall:.1f} s wall)")  # fmt: skip
    table.add_column("chips", justify="right", style="bold")
    for *_, label in columns:
        table.add_column(label, justify="right")
    by_key = {(c.mode, c.learners, c.chips): c for c in cells}
    for n in args.chips:
        row = [by_key[(mode, m, n)] for mode, m, _ in columns]
        table.add_row(f"{n:,}", *(f"{c.goodput:.1%} ({c.uptime:.0%})" for c in row))
    out = stdout_console()
    out.print(table)
    checkpoint = (f"a checkpoint every {fm.checkpoint_seconds:g} s" if fm.checkpoint_seconds > 0
                  else "no rollback")  # fmt: skip
    out.print(
        f"MTBI {fm.mtbi_hours:g} h per chip, recovery {fm.recovery_seconds:g} s, restart "
        f"{fm.restart_seconds:g} s and {checkpoint} (dp), downscale / upscale "
        f"{fm.downscale_seconds:g} / {fm.upscale_seconds:g} s on {fm.elastic_slice_chips:,}-chip "
        f"slices (elastic dp), sync every {fm.inner_steps} x {fm.step_seconds:g} s over "
        f"{fm.fragments} fragments (decoupled)"
    )
    if args.plot:
        out.print(f"plot: {args.plot}")
    return 0


def plot_goodput(cells: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list] = {}
    for c in cells:
        label = {"dp": "data-parallel", "dp_elastic": "elastic data-parallel"}.get(
            c.mode, f"Decoupled DiLoCo, M = {c.learners}"
        )
        series.setdefault(label, []).append(c)
    for label, row in series.items():
        style = "--" if "data-parallel" in label else "-"
        ax.plot([c.chips for c in row], [100 * c.goodput for c in row], style, marker="o",
                label=label)  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("chips")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _egress(bm: Any, steps: int, per_gb: float) -> dict[str, Any]:
    """What dp and Decoupled DiLoCo move between the sites over ``steps`` steps
    (``egress_bytes_per_step``), and its cost at ``per_gb`` dollars per GB."""
    from diloco.bandwidth import egress_bytes_per_step

    if per_gb < 0:
        raise ConfigError("--egress-per-gb must not be negative")
    egress: dict[str, Any] = {"steps": steps, "dollars_per_gb": per_gb}
    for name, per_step in zip(("dp", "decoupled"), egress_bytes_per_step(bm), strict=True):
        egress[name] = {"bytes": per_step * steps, "dollars": per_step * steps / 1e9 * per_gb}
    return egress


def _egress_table(egress: dict[str, Any]) -> Table:
    cost = Table(title=f"egress between sites over {egress['steps']:,} steps at "
                       f"${egress['dollars_per_gb']:g}/GB (docs/cost.md)")  # fmt: skip
    for col in ("", "bytes", "cost"):
        cost.add_column(col, justify="right")
    for name, label in (("dp", "data-parallel"), ("decoupled", "Decoupled DiLoCo")):
        cost.add_row(label, human_bytes(egress[name]["bytes"]), dollar(egress[name]["dollars"]))
    return cost


def cmd_plan_bandwidth(args: argparse.Namespace) -> int:
    from dataclasses import fields, replace

    from diloco.bandwidth import (
        BandwidthModel,
        bandwidth_plan,
        breakeven_step_seconds,
        run_bandwidth_model,
    )

    bm = BandwidthModel()
    if args.preset or args.config or args.set:  # a run's model, H, P and wire dtypes
        cfg = load_config(preset=args.preset, file=args.config, overrides=list(args.set or []))
        bm = run_bandwidth_model(cfg, bm)
    given = {f.name: getattr(args, f.name) for f in fields(BandwidthModel)}
    bm = replace(bm, **{k: v for k, v in given.items() if v is not None})
    if min(bm.params, bm.step_seconds, bm.fragments, bm.inner_steps) <= 0:
        raise ConfigError(
            "--params, --step-seconds, --fragments and --inner-steps must be positive"
        )
    base = bandwidth_plan(bm)
    timed = [bandwidth_plan(bm, g) for g in args.wan_gbps]
    breakeven = {g: breakeven_step_seconds(bm, g, args.target) for g in args.wan_gbps}
    egress = _egress(bm, args.steps, args.egress_per_gb)
    if args.json:
        print(json.dumps({"model": {f.name: getattr(bm, f.name) for f in fields(bm)},
                          "required": base.as_dict(), "egress": egress,
                          "links": [dict(p.as_dict(), breakeven_step_seconds=breakeven[p.wan_gbps])
                                    for p in timed]}, indent=1))  # fmt: skip
        return 0
    out = stdout_console()
    out.print(
        f"{bm.params / 1e9:g} B parameters, {bm.step_seconds:g} s per step, {bm.sites} sites; "
        f"dp: ring all-reduce at {bm.dp_bits:g} bits; decoupled: H = {bm.inner_steps}, "
        f"P = {bm.fragments}, tau = {bm.tau}, {bm.bits:g} bits up / {bm.down_bits:g} down; "
        f"link {bm.link}"
    )
    req = Table(title="bandwidth needed to hide communication behind compute")
    req.add_column("", style="bold")
    req.add_column("bits per step per site", justify="right")
    req.add_column("needed", justify="right")
    req.add_row(
        "data-parallel", f"{base.dp_bits_per_step:.3g}", f"{base.dp_required_gbps:.3g} Gbps"
    )
    req.add_row("Decoupled DiLoCo", f"{base.decoupled_bits_per_step:.3g}",
                f"{base.decoupled_required_gbps:.3g} Gbps")  # fmt: skip
    req.add_row("ratio", "", f"{base.ratio:.1f}x")
    out.print(req)
    out.print(_egress_table(egress))
    if timed:
        t = Table(title="time per step at a given link")
        bound = f"{args.target:g}x while the step is under"
        for col in ("link", "dp", "Decoupled DiLoCo", "exchange", "speed-up", bound):
            t.add_column(col, justify="right")
        for p in timed:
            t.add_row(f"{p.wan_gbps:g} Gbps", f"{p.dp_step_seconds:.3g} s",
                      f"{p.decoupled_step_seconds:.3g} s", f"{p.exchange_steps:.2g} steps",
                      f"{p.speedup:.1f}x", f"{breakeven[p.wan_gbps]:.3g} s")  # fmt: skip
        out.print(t)
    return 0


def cmd_plan_memory(args: argparse.Namespace) -> int:
    """Per device, what one learner of the preset needs at each device count, by part,
    with and without rematerialization (numpy only: the model is counted, not built)."""
    from diloco.archs import ARCHS
    from diloco.memory import learner_memory, param_count

    cfg = load_config(preset=args.preset, file=args.config, overrides=list(args.set or []))
    if any(n < 1 for n in args.devices):
        raise ConfigError("--devices: a device count is at least 1")
    params = param_count(cfg.model)
    m = cfg.model
    estimates = {n: learner_memory(cfg, params, n) for n in args.devices}
    remat = ARCHS[m.arch].remat(m)  # None: the architecture has no such choice
    other = None if remat is None else not remat
    flipped = (
        {n: learner_memory(cfg, params, n, other) for n in args.devices}
        if other is not None
        else {}
    )
    if args.json:
        print(json.dumps({"preset": args.preset, "params": params, "remat": m.remat,
                          "per_device": {n: dict(e.parts(), total=e.total)
                                         for n, e in estimates.items()},
                          "total_other_remat": {n: e.total for n, e in flipped.items()}},
                         indent=1))  # fmt: skip
        return 0
    tokens = cfg.data.batch_size * m.context
    table = Table(title=f"memory per device of one learner: preset {args.preset}, "
                  f"{params / 1e6:,.1f} M parameters, {cfg.data.batch_size} x {m.context} "
                  f"= {tokens:,} tokens a step"
                  + (f", {m.compute_dtype} compute, remat {'on' if m.remat else 'off'}"
                     if remat is not None else ""))  # fmt: skip
    table.add_column("", style="bold")
    for n in args.devices:
        table.add_column(f"{n} device{'s' if n > 1 else ''}", justify="right")
    for i, (part, _) in enumerate(estimates[args.devices[0]].parts()):
        table.add_row(part, *(human_bytes(e.parts()[i][1]) for e in estimates.values()))
    table.add_row("total", *(human_bytes(e.total) for e in estimates.values()), style="bold")
    if flipped:
        label = "total without remat" if m.remat else "total with remat"
        table.add_row(label, *(human_bytes(e.total) for e in flipped.values()))
    stdout_console().print(table)
    console.print("parameters, gradients, AdamW state and anchors sharded over the devices "
                  "(FSDP), the batch split over them; float32 but for bf16 compute's weight "
                  "copies and activations; the total counts the larger of the activations "
                  "and the new state at the update, which are not held together "
                  "(diloco/memory.py)")  # fmt: skip
    return 0
