"""The quick start's first run, commit against commit: `diloco train` with its defaults
(the `tiny` preset, 4 learners over two `file://` regions) under a fresh run name and
with an empty JAX cache (a new ``JAX_COMPILATION_CACHE_DIR`` each), as a new user's
first `./dev run` does. Per run: the whole command's seconds, the run's wall time, goodput and
the learners' share of time spent starting (`summary.json`'s `time_breakdown`).

    python bench/pipeline/startup.py --commits 5016ccc 022934a [--pairs 2]

Each commit is checked out into a worktree of this repository beside the others and run
with this checkout's `.venv` (the package is installed editable there, so the worktree
runs with `PYTHONPATH` set to itself); commits alternate, `--pairs` times. Writes
``bench/pipeline/startup.md`` and ``startup.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.machine import machine  # noqa: E402


def run_once(tree: Path, root: Path, name: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="startup-jax-")  # empty
    env["PYTHONPATH"] = str(tree)
    start = time.perf_counter()
    done = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "python"), "-m", "flows.cli", "train", "--run", name,
         "--dir", str(root)],
        cwd=tree, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: diloco train exited {done.returncode}: {done.stderr[-2000:]}")
    summary = json.loads((root / name / "summary.json").read_text())
    return {
        "command_s": round(seconds, 1),
        "wall_s": summary["wall_seconds"],
        "goodput": summary["goodput"],
        "start_up": summary["time_breakdown"]["start-up"],
        "final_loss": summary["final_loss"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--commits", nargs="+", required=True)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    trees = {}
    for commit in args.commits:
        trees[commit] = work / commit
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(trees[commit]), commit],
                       cwd=ROOT, check=True)  # fmt: skip
    rows: dict[str, list[dict]] = {c: [] for c in args.commits}
    try:
        for i in range(args.pairs):
            for commit in args.commits:
                got = run_once(trees[commit], work / "runs", f"q{commit}-{i}")
                rows[commit].append(got)
                print(commit, got, flush=True)
    finally:
        for tree in trees.values():
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)
    result = {"command": "python bench/pipeline/startup.py " + " ".join(sys.argv[1:]),
              "machine": machine(), "runs": rows}  # fmt: skip
    (args.out / "startup.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# The quick start's first run (an empty JAX cache), commit against commit",
        "",
        f"Command: `{result['command']}`",
        f"Machine: {result['machine']}",
        "",
        "`diloco train` with its defaults under a fresh run name (`tiny`, 4 learners, two "
        "`file://` regions); commits alternate. Medians of the runs, each run in brackets.",
        "",
        "| commit | command s | run wall s | goodput | learners' time starting | final loss |",
        "|---|---|---|---|---|---|",
    ]
    for commit, runs in rows.items():

        def col(key: str, fmt: str, runs: list[dict] = runs) -> str:
            values = [r[key] for r in runs]
            each = ", ".join(format(v, fmt) for v in values)
            return f"{format(statistics.median(values), fmt)} ({each})"

        lines.append(f"| {commit} | {col('command_s', '.0f')} | {col('wall_s', '.0f')} | "
                     f"{col('goodput', '.1%')} | {col('start_up', '.0%')} | "
                     f"{col('final_loss', '.4f')} |")  # fmt: skip
    (args.out / "startup.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
