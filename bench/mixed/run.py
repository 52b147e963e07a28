"""Mixed hardware in the real pipeline: the paper's experiment in miniature.

`diloco train` (the `tiny` preset, M = 4 learners in two file:// regions, real processes
and a real Prefect API), decoupled, with half the learners emulating a chip `--factor`
times slower (`pipeline.speeds`: a slow learner sleeps after each step, and the sleep
counts as its training time), against the same run with all learners fast:

- all fast, quorum K = 1 with the grace window (the reference);
- half slow, K = M (every merge waits for every learner: synchronous in effect);
- half slow, K = 1 with no grace window (merge as soon as anyone sends);
- half slow, K = 1 with the grace window (`topology.grace`).

Every run has the same token budget (each learner trains its share of it). The table:
wall time, goodput, final validation loss, versions and merge sizes.

    python bench/mixed/run.py [--tokens 2000000] [--factor 3]

Writes bench/mixed/results.md and results.json. On a machine with fewer cores than
learners a sleeping learner frees its core for the others, so the fast learners of a
mixed run train faster than in the all-fast run: compare the mixed runs with each other
first.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.machine import machine  # noqa: E402


def scenarios(factor: float) -> list[tuple[str, list[str]]]:
    slow = f"pipeline.speeds=[1,1,{factor:g},{factor:g}]"
    return [
        ("all fast, K = 1, grace 0.5", ["topology.quorum=1", "topology.grace=0.5"]),
        (f"half {factor:g}x slower, K = M", [slow, "topology.quorum=4"]),
        (f"half {factor:g}x slower, K = 1, no grace", [slow, "topology.quorum=1", "topology.grace=0"]),
        (f"half {factor:g}x slower, K = 1, grace 0.5", [slow, "topology.quorum=1", "topology.grace=0.5"]),
    ]  # fmt: skip


def train(name: str, sets: list[str], args: argparse.Namespace, root: Path) -> dict:
    """One `diloco train` run; its summary (empty if it failed) and wall time."""
    regions = {"us-east": f"file://{root}/{name}-us", "eu-west": f"file://{root}/{name}-eu"}
    sets = [f"budget.tokens={args.tokens}", f"seed={args.seed}", "pipeline.eval_seconds=20", *sets]
    argv = [sys.executable, "-m", "flows.cli", "train", "--run", name, "--dir", str(root),
            "--mode", "decoupled"] + [x for s in sets for x in ("--set", s)]  # fmt: skip
    argv += [x for r, u in regions.items() for x in ("--region", f"{r}={u}")] + ["--create-buckets"]
    (root / name).mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(root / name / "train.log", "w") as out:
        code = subprocess.run(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    summary_file = root / name / "summary.json"
    summary = json.loads(summary_file.read_text()) if code == 0 else {}
    return {"run": name, "sets": sets, "exit": code, "seconds": time.time() - started,
            "summary": summary}  # fmt: skip


def row(label: str, r: dict) -> str:
    s = r["summary"]
    if not s:
        return f"| {label} | failed (exit {r['exit']}, see {r['run']}/train.log) |||||"
    versions = sum(v for v in s.get("versions", {}).values() if isinstance(v, int))
    return (f"| {label} | {s['wall_seconds']:.0f} | {s['goodput']:.1%} | {s['final_loss']:.4f} | "
            f"{s['tokens']:,} | {versions} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2_000_000)
    parser.add_argument("--factor", type=float, default=3.0, help="slowdown of the slow half")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "bench" / "mixed"))
    parser.add_argument("--root", help="where the runs' buckets and logs go (kept)")
    args = parser.parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="mixed-"))
    print(f"runs, buckets and logs in {root}", flush=True)
    out, results = Path(args.out), []
    out.mkdir(parents=True, exist_ok=True)
    for i, (label, sets) in enumerate(scenarios(args.factor)):
        r = train(f"mixed-{i}", sets, args, root)
        r["label"] = label
        results.append(r)
        print(row(label, r), flush=True)
        write(out, args, results)  # after each run: nothing is lost


def write(out: Path, args: argparse.Namespace, results: list[dict]) -> None:
    (out / "results.json").write_text(json.dumps(
        {"args": vars(args), "machine": machine(), "results": results}, indent=1, default=str))  # fmt: skip
    command = "python bench/mixed/run.py " + " ".join(sys.argv[1:])
    header = ("| run | wall s | goodput | final loss | tokens | versions |\n"
              "|---|---|---|---|---|---|")  # fmt: skip
    body = "\n".join(row(r["label"], r) for r in results)
    (out / "results.md").write_text(
        f"# Mixed hardware through `diloco train`\n\n`{command}` on {machine()}\n\n"
        f"{header}\n{body}\n"
    )


if __name__ == "__main__":
    main()
