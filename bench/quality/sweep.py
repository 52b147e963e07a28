"""Sweep simulator knobs: one run per variant, one JSON line each, appended to ``--out``.

    python bench/quality/sweep.py --preset small --mode diloco \\
        --common budget.tokens=2000000 --common data.batch_size=16 \\
        --variant "outer.lr=0.5 outer.momentum=0.8" --variant "outer.lr=1.0 outer.momentum=0.9"

Every run uses M = 4 learners, P = 4 fragments and int4 outer gradients, as
``bench/quality/run.py`` does, plus the ``--common`` overrides and the variant's own.
Lines already in ``--out`` for the same (mode, settings) are skipped, so an interrupted
sweep resumes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from machine import machine

from diloco.config import load_config
from diloco.simulate import simulate

BASE = ["topology.learners=4", "topology.fragments=4", "topology.quantization=int4"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--mode", action="append", required=True, help="dp, diloco, decoupled")
    parser.add_argument("--common", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--variant", action="append", metavar='"K=V K=V"', help="default: none")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "sweep.jsonl")
    args = parser.parse_args()

    done = set()
    if args.out.exists():
        for line in args.out.read_text().splitlines():
            row = json.loads(line)
            done.add((row["preset"], row["mode"], tuple(row["settings"])))
    for mode in args.mode:
        for variant in args.variant or [""]:
            settings = [*BASE, *args.common, *variant.split()]
            if (args.preset, mode, tuple(settings)) in done:
                continue
            done.add((args.preset, mode, tuple(settings)))
            cfg = load_config(args.preset, overrides=settings, mode=mode)
            started = time.perf_counter()
            res = simulate(cfg)
            s = res.summary
            row = {
                "preset": args.preset,
                "mode": mode,
                "settings": settings,
                "variant": variant,
                "final_loss": s["final_loss"],
                "sim_seconds": s["sim_seconds"],
                "goodput": s["goodput"],
                "saving": s["bandwidth_ratio_vs_dp"],
                "evals": [(e["tokens"], e["time"], e["loss"]) for e in res.evals],
                "wall": time.perf_counter() - started,
                "machine": machine(),
            }
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(
                f"{mode:9s} {variant:50s} loss {s['final_loss']:.4f} goodput {s['goodput']:.1%} "
                f"saving {s['bandwidth_ratio_vs_dp']:.0f}x wall {row['wall']:.0f} s",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
