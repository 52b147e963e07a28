"""A learner's reader over data units (``data.assign = "units"``) on an S3 bucket: how
long a learner waits for its data at each step, with the unit's take made in the
learner's thread or in the reader's (issue 30; docs/data.md "Units").

A data set of ``--mb`` MB of uint16 tokens (``loader.synthesize``, chunks of 1 Mi tokens,
units of 4 chunks) and the run's data ledger both in a bucket of moto's S3 server on
loopback. One learner's ``UnitReader`` serves ``--batches`` batches of 8 x 1,024 tokens,
each followed by ``--step-ms`` of emulated training (a sleep: the GPU's time); a unit is
4 Mi tokens, 512 batches. Per setting: the time spent inside ``next_batch`` (what the
learner waits for) in all and at its worst, and how many spans it took.

    .venv/bin/python bench/learner/units.py [--mb 100] [--batches 2000] [--step-ms 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.learner.loader import synthesize  # noqa: E402
from bench.learner.s3 import local_s3  # noqa: E402
from bench.machine import machine  # noqa: E402


def measure(url: str, run: str, background: bool, args: argparse.Namespace) -> dict:
    from diloco.dataset import open_dataset
    from diloco.units import UnitPlan, UnitReader
    from flows.ledger import BucketLedger
    from storage_layout.store import RunStore

    plan = UnitPlan(open_dataset(f"{url}/tokens"), context=1024, seed=0)
    ledger = BucketLedger(RunStore(run, {"us": url}, "us"), plan, ["learner-0"])
    reader = UnitReader(plan, "learner-0", ledger, 8, background=background)
    waits = []
    start = time.perf_counter()
    for _ in range(args.batches):
        t = time.perf_counter()
        reader.next_batch()
        waits.append(time.perf_counter() - t)
        time.sleep(args.step_ms / 1000)
    total = time.perf_counter() - start
    reader.settle()
    reader.close()
    return {
        "background": background, "seconds": total, "waiting": sum(waits),
        "first": waits[0], "worst_after_first": max(waits[1:]),
        "spans": len(ledger.spans("learner-0")),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--out", default=str(ROOT / "bench" / "learner"))
    args = parser.parse_args()
    with local_s3("units") as fs:
        with tempfile.TemporaryDirectory() as tmp:
            local = synthesize(Path(tmp) / "tokens", args.mb)
            fs.put(local, "units/tokens", recursive=True)
        rows = [measure("s3://units", f"r{int(bg)}", bg, args) for bg in (False, True)]
    out = Path(args.out)
    (out / "units.json").write_text(json.dumps({"args": vars(args), "machine": machine(),
                                                "rows": rows}, indent=1))  # fmt: skip
    lines = [
        "| take made in | spans taken | seconds | waiting for data (s) | first batch (s) "
        "| worst wait after it (s) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {'the reader thread' if r['background'] else 'the learner thread'} "
                     f"| {r['spans']} | {r['seconds']:.1f} | {r['waiting']:.2f} | "
                     f"{r['first']:.2f} | {r['worst_after_first']:.3f} |")  # fmt: skip
    command = "python bench/learner/units.py " + " ".join(sys.argv[1:])
    (out / "units.md").write_text(
        f"# A learner's data in units over S3 (moto, loopback)\n\n`{command}` on {machine()}"
        f"\n\n" + "\n".join(lines) + "\n"
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
