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

With `--grow-into`, the other way round: the run starts one learner (`topology.learners
= 1`, learner-0 in us-east) and no slot in eu-west; once `--leave-at` of the budget is
merged a machine joins in eu-west with no `--slot` and adds a learner there (learner-1,
region 1 mod 2 of the deal). Until then us-east's learner trains eu-west's pool too
(moved by the syncers); the same tables, and the time from the join to its first merged
contribution. Writes DIR/grow-into.md and .json.
"""

from __future__ import annotations

import argparse
import json
import math
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
    "pipeline.eval_seconds=20", "pipeline.syncer_shards=1", "liveness.silent_max_seconds=30",
    "data.assign=units",
]  # fmt: skip


GROW_INTO = [  # (the last --set of a key wins; every version kept: their times are read)
    "topology.learners=1", "pipeline.learners_started=1", "pipeline.keep_versions=100000",
]  # fmt: skip


def urls(root: Path) -> dict[str, str]:
    return {r: f"file://{root / r}" for r in REGIONS}


def join(
    root: Path, run: str, slot: str | None, region: str, env: dict, logs: Path
) -> subprocess.Popen:
    """A ``diloco join`` of ``slot`` (None: the one it adds) in ``region``."""
    argv = [sys.executable, "-m", "flows.cli", "join", urls(root)[region], "--run", run,
            "--region", region, "--pipeline", json.dumps({"eval_seconds": 20}),
            *(["--slot", slot] if slot else [])]  # fmt: skip
    out = (logs / f"{slot or 'joiner-' + region}.log").open("w")
    return subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)


def grow_into(root: Path, name: str, train: subprocess.Popen, env: dict, logs: Path,
              started: float, args: argparse.Namespace) -> dict:  # fmt: skip
    """``--grow-into``: a joiner in eu-west, where the run has no slot, once ``leave_at``
    of the budget is merged."""
    joiner, joined_at = None, None
    while train.poll() is None:
        if joiner is None and merged_tokens(root, name) >= args.leave_at * args.tokens:
            joiner = join(root, name, None, "eu-west", env, logs)
            joined_at = time.time() - started
            print(f"a machine joins in eu-west at {joined_at:.0f} s", flush=True)
        time.sleep(1.0)
    out = finish(root, name, train, started, [joiner] if joiner else [])
    out["joined_at"] = joined_at
    if out["exit"] == 0:
        out["joiner"] = first_merge(root, name)
    return out


def finish(root: Path, name: str, train: subprocess.Popen, started: float,
           joiners: list[subprocess.Popen]) -> dict:  # fmt: skip
    """The run's end: its exit, wall time and (when it succeeded) its measures."""
    code = train.wait()
    wall = time.time() - started
    for proc in joiners:
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
    out = {"exit": code, "wall": wall}
    if code == 0:
        out["summary"] = json.loads((root / name / "summary.json").read_text())
        out.update(measure(root, name))
    return out


def first_merge(root: Path, name: str) -> dict:
    """The learners added (eu-west's joiner): each one's region, its join record's time,
    the first global version that merged a contribution of it (the versions' markers
    name what they consumed: the home bucket's), and the seconds between."""
    from protocol.topology import run_slots
    from storage_layout.store import RunStore

    store = RunStore(name, urls(root), REGIONS[0], writer="bench")
    spec = store.read_spec()
    added = {lid: r for lid, r in store.members.run_learners(spec, regions=REGIONS).regions.items()
             if lid not in run_slots(spec)}  # fmt: skip
    merged: dict[str, float] = {}  # learner -> when a version first merged its work
    for p in range(len(spec["fragments"])):
        for v in store.versions.global_versions(p, REGIONS[0]):
            meta = store.versions.global_marker(p, v).meta
            for who, _ in meta["consumed"]:
                merged[who] = min(float(meta["time"]), merged.get(who, math.inf))
    out = {}
    for lid, region in added.items():
        joins = store.members.joins(lid, region)
        at = float(joins[0]["time"]) if joins else None
        first = merged.get(lid)
        out[lid] = {"region": region, "joined": at, "first_merged": first,
                    "join_to_first_merge_s": first - at if first and at else None}  # fmt: skip
    return out


def merged_tokens(root: Path, run: str) -> int:
    """Tokens fragment 0's newest version reports merged so far (every fragment merges
    every send's tokens: one is the run's)."""
    from storage_layout.store import RunStore

    store = RunStore(run, urls(root), REGIONS[0], writer="bench")
    newest = store.versions.latest_global(0)
    if newest is None:
        return 0
    return int(store.versions.global_marker(0, newest).meta.get("tokens_total") or 0)


def run(root: Path, args: argparse.Namespace) -> dict:
    name = "regions"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    sets = [f"budget.tokens={args.tokens}", f"seed={args.seed}", f"data.source={args.data}",
            f"model.vocab_size={args.vocab}", *COMMON, *(GROW_INTO if args.grow_into else []),
            *args.set]  # fmt: skip
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
        [sys.executable, "-m", "flows.cli", "join-token", next(iter(urls(root).values())),
         "--run", name, "--dir", str(root),
         "--learners", "4"], cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    env["DILOCO_JOIN_TOKEN"] = token
    if args.grow_into:
        return grow_into(root, name, train, env, logs, started, args)
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
    return {**finish(root, name, train, started, list(joiners.values())), "left_at": left_at}


def measure(root: Path, name: str) -> dict:
    """Per epoch and pool, windows merged once, twice or never, from the audit."""
    from diloco.run_data import RunData
    from diloco.units import cut, pool_unit
    from flows.ledger import region_ledger, region_pools
    from flows.ledger_audit import audit_units
    from flows.spec import config_from_spec
    from storage_layout.audit import audit_run
    from storage_layout.store import RunStore

    regions = urls(root)
    report = audit_run(name, regions)
    audit_units(report)
    store = RunStore(name, regions, REGIONS[0], writer="bench")
    spec = store.read_spec()
    cfg = config_from_spec(spec)
    learners = store.members.run_learners(spec, regions=REGIONS).regions  # with those added
    plan, batch = RunData(cfg).units, cfg.data.batch_size
    pools = region_pools(spec)
    owner = {}  # (epoch, unit) -> the region whose pool holds it
    merged: Counter = Counter()  # (epoch, unit, window) -> times merged
    trained_by: Counter = Counter()  # (pool region, trainer's region) -> windows
    held: Counter = Counter()  # windows in a learner's stream, or waiting, not merged
    for region in pools:
        ledger = region_ledger(RunStore(name, regions, region, writer="bench"), plan,
                               learners, region, pools=pools)  # fmt: skip
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


def stem(args: argparse.Namespace) -> str:
    """The results' file name, without its suffix."""
    return args.name or ("grow-into" if args.grow_into else "regions")


def write(out: Path, args: argparse.Namespace, r: dict) -> None:
    (out / f"{stem(args)}.json").write_text(json.dumps(
        {"args": vars(args), "machine": machine(), "result": r}, indent=1, default=str))  # fmt: skip
    command = "python bench/elastic/regions.py " + " ".join(sys.argv[1:])
    title = ("A run grows into a region it started no learner in" if args.grow_into
             else "A region whose learners all leave" if args.leave_at < 1
             else "Two regions whose learners stay")  # fmt: skip
    lines = [f"# {title}\n\n`{command}` on {machine()}\n"]
    if r.get("exit") != 0:
        lines.append(f"The run failed (exit {r.get('exit')}).")
    else:
        s = r["summary"]
        if args.grow_into:
            when = f"a machine joined in eu-west at {r['joined_at']:.0f} s"
            for lid, j in r["joiner"].items():
                wait = j["join_to_first_merge_s"]
                when += (f" and added {lid} in {j['region']}, its work first merged "
                         + (f"{wait:.1f} s after its join record" if wait is not None
                            else "never"))  # fmt: skip
        else:
            when = (f"eu-west's learners told to leave at {r['left_at']:.0f} s"
                    if r["left_at"] is not None else "nobody left")  # fmt: skip
        lines.append(f"Wall {r['wall']:.0f} s; {when}; final loss {s['final_loss']:.4f}; audit "
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
    (out / f"{stem(args)}.md").write_text("\n".join(lines) + "\n")


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
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="more config for the run (diloco train --set), after the "
                        "bench's own; e.g. 'pipeline.speeds=[1,3,1,3]' with --leave-at 2 "
                        "(nobody leaves): eu-west's learners three times slower")  # fmt: skip
    parser.add_argument("--grow-into", action="store_true",
                        help="start one learner, in us-east, and let a machine join in eu-west "
                        "(no slot there) at --leave-at")  # fmt: skip
    parser.add_argument("--name", help="the results' file names (DIR/NAME.md, .json)")
    args = parser.parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="regions-"))
    print(f"run, buckets and logs in {root}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    r = run(root, args)
    write(out, args, r)
    print((out / f"{stem(args)}.md").read_text(), flush=True)


if __name__ == "__main__":
    main()
