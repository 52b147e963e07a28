"""A region whose learners all leave: is its data still trained, once, in epoch order?

One `diloco train` run of the `tiny` preset on a prepared data set with `data.assign =
"units"`, two file:// regions (us-east, eu-west; each its own bucket and its own pool of
units), four learner slots dealt to them in turn (0 and 2 in us-east, 1 and 3 in
eu-west). `diloco train` starts learner-0 (`pipeline.learners_started = 1`); learner-2
joins it (`diloco join`) and both stay. Learners 1 and 3 join in eu-west and are
preempted (SIGTERM: they send, checkpoint, give their data back and leave) once the run
has merged `--leave-at` of its budget; nobody comes back to eu-west.

From the buckets after the run, through the audit (each learner's merged batches read
through its region's ledger into spans of units): for each epoch, how many of its
windows were merged once, twice or not at all, split by the pool the unit belongs to;
the epoch each region's learners were in when the other's next began; the units moved
from eu-west's pool to us-east's learners; the final loss and whether the audit is
clean.

    python bench/elastic/regions.py --data PREPARED --vocab 512 [--tokens 400000]
        [--leave-at 0.15] [--out DIR] [--root DIR]

Writes DIR/regions.md and DIR/regions.json. A benchmark on the wall clock: which spans
each learner takes depends on the machine's speed; the counts of windows merged twice
and of windows skipped must be 0 whatever it is.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.machine import machine  # noqa: E402

REGIONS = ("us-east", "eu-west")
COMMON = [
    "topology.learners=4", "pipeline.learners_started=1", "topology.quorum=1",
    "pipeline.eval_seconds=20", "pipeline.syncer_shards=1", "pipeline.member_timeout=30",
    "data.assign=units",
]  # fmt: skip


def urls(root: Path) -> dict[str, str]:
    return {r: f"file://{root / r}" for r in REGIONS}


def join(root: Path, run: str, slot: str, region: str, env: dict, logs: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "flows.cli", "join", urls(root)[region], "--run", run,
            "--region", region, "--slot", slot, "--pipeline", json.dumps({"eval_seconds": 20})]  # fmt: skip
    out = (logs / f"{slot}.log").open("w")
    return subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)


def merged_tokens(root: Path, run: str) -> int:
    """Tokens fragment 0's newest version reports merged so far (every fragment merges
    every send's tokens: one is the run's)."""
    from storage_layout.store import RunStore

    store = RunStore(run, urls(root), REGIONS[0], writer="bench")
    newest = store.latest_global(0)
    if newest is None:
        return 0
    return int(store.global_marker(0, newest).meta.get("tokens_total") or 0)


def run(root: Path, args: argparse.Namespace) -> dict:
    name = "regions"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    sets = [f"budget.tokens={args.tokens}", f"seed={args.seed}", f"data.source={args.data}",
            f"model.vocab_size={args.vocab}", *COMMON]  # fmt: skip
    argv = [sys.executable, "-m", "flows.cli", "train", "--run", name, "--dir", str(root),
            "--mode", "decoupled", "--create-buckets",
            *[x for r, u in urls(root).items() for x in ("--region", f"{r}={u}")],
            *[x for s in sets for x in ("--set", s)]]  # fmt: skip
    started = time.time()
    train = subprocess.Popen(argv, cwd=ROOT, stdout=(logs / "train.log").open("w"),
                             stderr=subprocess.STDOUT, env=env)  # fmt: skip
    api = None
    while (api is None or not (root / name / "run-secret").exists()) and train.poll() is None:
        found = re.search(r"Prefect API (http\S+)", (logs / "train.log").read_text())
        api = found.group(1) if found else None
        time.sleep(0.5)
    env["PREFECT_API_URL"] = api or ""
    token = subprocess.run(
        [sys.executable, "-m", "flows.cli", "join-token", "--run", name, "--dir", str(root),
         "--learners", "4"], cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    env["DILOCO_JOIN_TOKEN"] = token
    joiners = {
        "learner-2": join(root, name, "learner-2", "us-east", env, logs),
        "learner-1": join(root, name, "learner-1", "eu-west", env, logs),
        "learner-3": join(root, name, "learner-3", "eu-west", env, logs),
    }
    left_at = None
    while train.poll() is None:
        if left_at is None and merged_tokens(root, name) >= args.leave_at * args.tokens:
            for slot in ("learner-1", "learner-3"):  # a spot notice for all of eu-west
                joiners[slot].send_signal(signal.SIGTERM)
            left_at = time.time() - started
            print(f"eu-west's learners told to leave at {left_at:.0f} s", flush=True)
        time.sleep(1.0)
    code = train.wait()
    wall = time.time() - started
    for proc in joiners.values():
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
    out = {"exit": code, "wall": wall, "left_at": left_at}
    if code == 0:
        out["summary"] = json.loads((root / name / "summary.json").read_text())
        out.update(measure(root, name))
    return out


def measure(root: Path, name: str) -> dict:
    """Per epoch and pool, windows merged once, twice or never, from the audit."""
    from diloco.simulate import unit_plan
    from diloco.units import cut, pool_unit
    from flows.ledger import audit_units, region_ledger, region_pools
    from flows.run import config_from_spec
    from storage_layout.audit import audit_run
    from storage_layout.store import RunStore

    regions = urls(root)
    report = audit_run(name, regions)
    audit_units(report)
    spec = RunStore(name, regions, REGIONS[0], writer="bench").read_spec()
    cfg = config_from_spec(spec)
    plan, learners, batch = unit_plan(cfg), dict(spec["learners"]), cfg.data.batch_size
    pools = region_pools(learners)
    owner = {}  # (epoch, unit) -> the region whose pool holds it
    merged: Counter = Counter()  # (epoch, unit, window) -> times merged
    trained_by: Counter = Counter()  # (pool region, trainer's region) -> windows
    held: Counter = Counter()  # windows in a learner's stream, or waiting, not merged
    for region in pools:
        ledger = region_ledger(RunStore(name, regions, region, writer="bench"), plan,
                               learners, region)  # fmt: skip
        for lid in ledger.learners:
            stream = ledger.spans(lid)
            held.update((s.epoch, s.unit, w) for s in stream for w in range(s.start, s.end))
            for lo, hi in report.data.get(lid, []):
                for s in cut(cut(stream, hi * batch)[0], lo * batch)[1]:
                    merged.update((s.epoch, s.unit, w) for w in range(s.start, s.end))
                    trained_by[(region, s.epoch, s.unit)] += s.windows
        held.update(
            (s.epoch, s.unit, w) for s in ledger.given_back() for w in range(s.start, s.end)
        )
    epochs = max((e for e, _, _ in merged), default=0)
    for region, pool in pools.items():
        k = 0
        while True:
            epoch, unit = pool_unit(k, pool, plan.units)
            if epoch > epochs:
                break
            owner[(epoch, unit)] = region
            k += 1
    rows = []
    for epoch in range(epochs + 1):
        for region in pools:
            units = [u for (e, u), r in owner.items() if e == epoch and r == region]
            windows = [(epoch, u, w) for u in units for w in range(plan.windows(epoch, u))]
            by = Counter()
            for (r, e, u), n in trained_by.items():
                if e == epoch and owner.get((e, u)) == region:
                    by[r] += n
            rows.append({
                "epoch": epoch, "pool": region, "windows": len(windows),
                "once": sum(merged[w] == 1 for w in windows),
                "twice": sum(merged[w] > 1 for w in windows),
                "held": sum(merged[w] == 0 and held[w] > 0 for w in windows),
                "never": sum(merged[w] == 0 and held[w] == 0 for w in windows),
                "trained_by": dict(by),
            })  # fmt: skip
    return {
        "audit_ok": report.ok, "violations": {k: v[:3] for k, v in report.violations.items()},
        "units": report.units, "epochs": rows, "last_epoch": epochs,
    }  # fmt: skip


def write(out: Path, args: argparse.Namespace, r: dict) -> None:
    (out / "regions.json").write_text(json.dumps(
        {"args": vars(args), "machine": machine(), "result": r}, indent=1, default=str))  # fmt: skip
    command = "python bench/elastic/regions.py " + " ".join(sys.argv[1:])
    lines = [f"# A region whose learners all leave\n\n`{command}` on {machine()}\n"]
    if r.get("exit") != 0:
        lines.append(f"The run failed (exit {r.get('exit')}).")
    else:
        s = r["summary"]
        lines.append(f"Wall {r['wall']:.0f} s; eu-west's learners told to leave at "
                     f"{r['left_at']:.0f} s; final loss {s['final_loss']:.4f}; audit "
                     f"{'clean' if r['audit_ok'] else 'VIOLATIONS ' + str(r['violations'])}; "
                     f"units moved from eu-west's pool to us-east: "
                     f"{r['units']['eu-west'].get('moved_out', 0)}.\n")  # fmt: skip
        lines.append("| epoch | pool | windows | merged once | merged twice | held or waiting, "
                     "not merged | never handed out | merged windows trained by the learners of "
                     "|\n|---|---|---|---|---|---|---|---|")  # fmt: skip
        for e in r["epochs"]:
            by = ", ".join(f"{k} {v}" for k, v in sorted(e["trained_by"].items())) or "-"
            lines.append(f"| {e['epoch']} | {e['pool']} | {e['windows']} | {e['once']} | "
                         f"{e['twice']} | {e['held']} | {e['never']} | {by} |")  # fmt: skip
        lines.append(f"\nHeld or waiting: in a learner's stream past what was merged when the "
                     f"budget ran out, or given back or offered and not taken yet. The run's "
                     f"last epoch ({r['last_epoch']}) is the one its budget ended in: its "
                     "windows never handed out were not reached.")  # fmt: skip
    (out / "regions.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="a prepared data set (diloco data prepare)")
    parser.add_argument("--vocab", type=int, default=512, help="its vocabulary")
    parser.add_argument("--tokens", type=int, default=400_000)
    parser.add_argument("--leave-at", type=float, default=0.15,
                        help="eu-west's learners leave once this share of the budget is merged")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "bench" / "elastic"))
    parser.add_argument("--root", help="where the run's buckets and logs go (kept)")
    args = parser.parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="regions-"))
    print(f"run, buckets and logs in {root}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    r = run(root, args)
    write(out, args, r)
    print((out / "regions.md").read_text(), flush=True)


if __name__ == "__main__":
    main()
