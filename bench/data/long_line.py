"""Peak memory of `diloco data prepare` on a JSON lines file whose first record is one
very long document (default 64 MiB of words), beside two short ones, with a given
byte-level BPE of 512 tokens (so no tokenizer is trained): the tokenizer's output is many
times its text's size, so what bounds it is the pieces a long document is cut into
(``diloco.prepare._pieces``). Prints one row of ``results.md``.

    python bench/data/long_line.py [--mib 64] [--root /tmp/long-line]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.machine import machine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=64, help="the long document's size")
    parser.add_argument("--root", default="/tmp/long-line")
    args = parser.parse_args()
    root = Path(args.root)
    shutil.rmtree(root, ignore_errors=True)
    (root / "small").mkdir(parents=True)
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(5000)]  # fmt: skip
    text = " ".join(rng.choice(words) for _ in range(args.mib << 18))[: args.mib << 20]
    with (root / "long.jsonl").open("w") as out:
        for doc in (text, "a second short document", "a third short document"):
            out.write(json.dumps({"text": doc}) + "\n")
    for f in sorted((Path(json.__file__).parent).glob("*.py")):  # a tokenizer to give
        shutil.copy(f, root / "small" / f.name)
    cli = [sys.executable, "-m", "flows.cli", "data", "prepare", "--quiet"]
    subprocess.run([*cli, str(root / "small"), "--out", str(root / "tok"), "--vocab-size",
                    "512"], cwd=ROOT, check=True, capture_output=True)  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    began = time.time()
    subprocess.run([*cli, str(root / "long.jsonl"), "--out", str(root / "out"), "--tokenizer",
                    str(root / "tok" / "tokenizer.json")], cwd=ROOT, check=True)  # fmt: skip
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    tokens = json.loads((root / "out" / "manifest.json").read_text())["totals"]
    print(
        f"| {args.mib} MiB | {max(peak, before) / 2**20:.2f} GiB | {time.time() - began:.0f} s | "
        f"{sum(t['tokens'] for t in tokens.values()):,} | {machine()} |"
    )


if __name__ == "__main__":
    main()
