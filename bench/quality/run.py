"""Quality benchmark: dp vs synchronous DiLoCo vs Decoupled DiLoCo at equal tokens.

    python bench/quality/run.py [--preset small] [--tokens 1200000] [--set KEY=VALUE ...]

Scenarios (M = 4 learners, P = 4 fragments, int4 outer gradients by default):
dp; diloco; decoupled; diloco and decoupled with two learners 2x and 3x slower;
decoupled with one learner down for a quarter of the run; diloco and decoupled with the
int4 downlink (`topology.downlink`). Writes ``results.md`` and
``results.json`` beside this file (or to ``--out``), with the command and the machine.

Targets (issue 2): decoupled loss <= 1.03 x dp; bytes >= 100x fewer than dp; with slow
learners, decoupled reaches dp's final loss in less simulated time than diloco.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from machine import machine

from diloco.config import load_config
from diloco.simulate import simulate, time_to_loss

SLOW = "sim.speeds=[1, 1, 2, 3]"
DOWN = "topology.downlink=int4"  # learners read int4 differences of the globals
FAIL = 'sim.failures=[{"learner": 3, "at": 0.375, "duration": 0.25}]'
SCENARIOS = [
    ("dp", "dp", []),
    ("diloco", "diloco", []),
    ("decoupled", "decoupled", []),
    ("diloco, slow learners", "diloco", [SLOW]),
    ("decoupled, slow learners", "decoupled", [SLOW]),
    ("decoupled, 1 learner down 25%", "decoupled", [FAIL]),
    ("dp, 1 learner down 25%", "dp", [FAIL]),
    ("diloco, int4 downlink", "diloco", [DOWN]),
    ("decoupled, int4 downlink", "decoupled", [DOWN]),
]


def main() -> int:
    here = Path(__file__).parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--tokens", type=int, default=1_200_000)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--only", action="append", help="run only the scenarios named (repeatable)")
    parser.add_argument("--out", type=Path, default=here)
    args = parser.parse_args()

    common = [
        "topology.learners=4",
        "topology.fragments=4",
        "topology.quantization=int4",
        f"budget.tokens={args.tokens}",
        *args.set,
    ]
    results = []
    for name, mode, extra in SCENARIOS:
        if args.only and name not in args.only:
            continue
        cfg = load_config(args.preset, overrides=[*common, *extra], mode=mode)
        started = time.perf_counter()
        res = simulate(cfg)
        wall = time.perf_counter() - started
        results.append({"name": name, "summary": res.summary, "evals": res.evals, "wall": wall})
        s = res.summary
        print(
            f"{name:32s} loss {s['final_loss']:.4f}  sim {s['sim_seconds']:8.0f} s  "
            f"goodput {s['goodput']:.1%}  bytes/dp 1/{s['bandwidth_ratio_vs_dp']:.0f}  "
            f"wall {wall:.0f} s",
            flush=True,
        )

    by_name = {r["name"]: r for r in results}
    dp = by_name.get("dp")
    lines = [
        "# bench/quality results",
        "",
        f"Command: `python bench/quality/run.py {shlex.join(sys.argv[1:])}`".rstrip(),
        f"Machine: {machine()}",
        f"Preset: `{args.preset}`; common settings: `{' '.join(common)}`",
        f"Config of the decoupled run: `{load_config(args.preset, overrides=common, mode='decoupled').model_dump_json()}`",
        "",
        "| scenario | final val loss | vs dp | sim time (s) | time to dp's final loss (s) | "
        "time to 1.03 x dp (s) | goodput | bytes up | bytes down | bytes moved | dp would move "
        "| saving |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s = r["summary"]
        vs = s["final_loss"] / dp["summary"]["final_loss"] if dp else float("nan")
        target = dp["summary"]["final_loss"] if dp else float("nan")
        t1 = time_to_loss(r["evals"], target)
        t103 = time_to_loss(r["evals"], 1.03 * target)
        lines.append(
            f"| {r['name']} | {s['final_loss']:.4f} | {vs:.3f} | {s['sim_seconds']:.0f} | "
            f"{t1:.0f} | {t103:.0f} | {s['goodput']:.1%} | {s['bytes_up'] / 1e6:.1f} MB | "
            f"{s['bytes_down'] / 1e6:.1f} MB | {s['bytes_total'] / 1e6:.1f} MB | "
            f"{s['dp_bytes'] / 1e6:.0f} MB | {s['bandwidth_ratio_vs_dp']:.0f}x |"
        )
    if dp and "decoupled" in by_name:
        dec = by_name["decoupled"]["summary"]
        lines += [
            "",
            "Targets:",
            f"- decoupled loss / dp loss = {dec['final_loss'] / dp['summary']['final_loss']:.4f} (target <= 1.03)",
            f"- decoupled bytes saving vs dp = {dec['bandwidth_ratio_vs_dp']:.0f}x (target >= 100x)",
        ]
        slow_d = by_name.get("decoupled, slow learners")
        slow_s = by_name.get("diloco, slow learners")
        if slow_d and slow_s:
            for factor in (1.0, 1.03):
                goal = factor * dp["summary"]["final_loss"]
                td, ts = time_to_loss(slow_d["evals"], goal), time_to_loss(slow_s["evals"], goal)
                lines.append(
                    f"- slow learners, time to {factor:.2f} x dp's final loss: decoupled {td:.0f} s "
                    f"vs diloco {ts:.0f} s (target: decoupled less)"
                )
    lines += ["", f"Wall time of the whole benchmark: {sum(r['wall'] for r in results):.0f} s", ""]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text("\n".join(lines))
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
