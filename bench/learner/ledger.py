"""The data ledger of ``data.assign = "units"`` (``flows.ledger.BucketLedger``) as a run
grows: what a take costs, and what a new learner process's first look costs (it reads
the records of every learner of its region once, then only new ones).

Four learners of one region take ``--takes`` spans in turn through one bucket (a prepared
data set's units: ``--data``); then a fresh ledger (a new process: nothing cached) reads
learner-0's spans (the replay of every learner's records, as a take needs them), looks
for orphan claims, and makes its first take. On moto's S3 server on loopback and on
``file://``.

    .venv/bin/python bench/learner/ledger.py --data PREPARED [--takes 600]
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

from bench.learner.s3 import local_s3  # noqa: E402
from bench.machine import machine  # noqa: E402


def measure(url: str, data: str, takes: int) -> dict:
    from diloco.dataset import open_dataset
    from diloco.units import UnitPlan
    from flows.ledger import BucketLedger
    from storage_layout.store import RunStore

    plan = UnitPlan(open_dataset(data), context=64, seed=0)
    ids = [f"learner-{i}" for i in range(4)]

    def ledger() -> BucketLedger:  # a new process's
        return BucketLedger(RunStore("r", {"us": url}, "us"), plan, ids)

    writer = ledger()
    t = time.perf_counter()
    for k in range(takes):
        writer.take(ids[k % 4])
    written = time.perf_counter() - t
    fresh = ledger()
    t = time.perf_counter()
    fresh.spans("learner-0")
    replay = time.perf_counter() - t
    t = time.perf_counter()
    orphans = fresh.orphans()
    looked = time.perf_counter() - t
    t = time.perf_counter()
    ledger().take("learner-1")
    first = time.perf_counter() - t
    return {"url": url.split(":")[0], "takes": takes, "take_seconds": written / takes,
            "replay_seconds": replay, "orphans_seconds": looked, "first_take_seconds": first,
            "orphans": orphans}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="a data set of diloco data prepare")
    parser.add_argument("--takes", type=int, default=600)
    parser.add_argument("--out", default=str(ROOT / "bench" / "learner"))
    args = parser.parse_args()
    with local_s3("ledger"):
        rows = [measure(u, args.data, args.takes)
                for u in ("s3://ledger", f"file://{tempfile.mkdtemp()}")]  # fmt: skip
    out = Path(args.out)
    (out / "ledger.json").write_text(json.dumps({"args": vars(args), "machine": machine(),
                                                 "rows": rows}, indent=1))  # fmt: skip
    lines = ["| bucket | takes (4 learners) | a take (ms) | a new process: replay (s) "
             "| orphans (s) | first take (s) |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['url']} | {r['takes']} | {1000 * r['take_seconds']:.0f} | "
                     f"{r['replay_seconds']:.2f} | {r['orphans_seconds']:.2f} | "
                     f"{r['first_take_seconds']:.2f} |")  # fmt: skip
    command = "python bench/learner/ledger.py " + " ".join(sys.argv[1:])
    (out / "ledger.md").write_text(f"# The data ledger as a run grows\n\n`{command}` on "
                                   f"{machine()}\n\n" + "\n".join(lines) + "\n")  # fmt: skip
    print("\n".join(lines))


if __name__ == "__main__":
    main()
