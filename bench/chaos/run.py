"""Chaos benchmark: the real pipeline under failure, against the same run without it.

`diloco train` (the `tiny` preset, M = 4 learners in two file:// regions, real processes
and a real Prefect API) runs four times with the same seed and budget: decoupled and
synchronous DiLoCo, each without and with chaos. Chaos is the same plan for both modes:

- process chaos (`pipeline.chaos`): learner and syncer SIGKILLs and learner pauses at
  exponential intervals (`infra/chaos.py`);
- storage faults (`pipeline.faults`): errors, lost responses, truncated reads, stale
  listings, latency spikes, and learners dying between data and marker;
- forged input: a forger writes, every `--forge-every` seconds, an unsigned contribution,
  one signed but full of NaN, one signed with a norm 1000x too large, and one whose data
  is damaged after it was committed, into the learners' buckets.

Every bucket is then audited (`storage_layout.audit`), which also names what became of
each forgery: rejected (with its reason), superseded unread (the learner's next send from
the same anchor came first) or, had a check let it through, merged. The table: kills and
faults by kind, the forgeries and their outcomes, the audit, final validation loss and
goodput with and without chaos at equal tokens, and the time from a learner kill to its
next contribution.

    python bench/chaos/run.py [--tokens 2000000] [--kill-every 15] [--only decoupled]

Writes bench/chaos/results.md and results.json.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.machine import machine  # noqa: E402
from infra.chaos import read_actions  # noqa: E402
from protocol.quantize import quantize  # noqa: E402
from protocol.topology import run_slots  # noqa: E402
from storage_layout.audit import audit_run  # noqa: E402
from storage_layout.auth import learner_key  # noqa: E402
from storage_layout.store import RunStore  # noqa: E402

FORGERIES = ("unsigned", "nan", "norm", "corrupt")


def chaos_settings(args: argparse.Namespace) -> list[str]:
    chaos = {"seed": args.seed, "learner_kill_every": args.kill_every,
             "syncer_kill_every": args.syncer_kill_every, "pause_every": args.pause_every,
             "pause_seconds": 8.0, "start_after": 10.0}  # fmt: skip
    faults = {"seed": args.seed, "error_rate": 0.05, "timeout_after_rate": 0.02,
              "truncate_rate": 0.01, "stale_list_rate": 0.05, "latency_rate": 0.01,
              "latency_seconds": 1.0, "crash_rate": args.crash_rate}  # fmt: skip
    out = [f"pipeline.chaos.{k}={json.dumps(v)}" for k, v in chaos.items()]
    out += [f"pipeline.faults.{k}={json.dumps(v)}" for k, v in faults.items()]
    # Spares sized for the kill rate: a spare forked from the zygote is warm in a few
    # seconds on two busy cores (it was ~12 s when each spare did its own imports), and
    # at a kill every ~8 s (SIGKILLs and mid-write crashes) five never ran dry at 2425a4a
    # (bench/chaos/results.md); fewer may do.
    return [*out, "pipeline.max_failed_starts=20", f"pipeline.spares={args.spares}"]


class _Damaging:
    """A bucket that flips a byte of the first chunk it writes; the marker written after
    it lists the true hash, so the marker does not match its data."""

    def __init__(self, bucket: object):
        self.bucket = bucket

    def __getattr__(self, name: str) -> object:
        return getattr(self.bucket, name)

    def put_many(self, objects: dict[str, bytes]) -> None:
        objects = dict(objects)
        chunk = next(k for k in objects if "/c/" in k)
        objects[chunk] = bytes([objects[chunk][0] ^ 0xFF]) + objects[chunk][1:]
        self.bucket.put_many(objects)


class Forger(threading.Thread):
    """Writes bad contributions into the learners' buckets while the run goes on, at a
    sequence number the learner used for another fragment (so it never collides with a
    real send) and above what the syncer has read of this fragment."""

    def __init__(self, run: str, folder: Path, every: float, seed: int):
        super().__init__(daemon=True, name="forger")
        self.run_name, self.folder, self.every = run, folder, every
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.done: list[dict] = []

    def run(self) -> None:
        kinds = iter(FORGERIES * 1000)
        while not self.stop.wait(self.every):
            try:
                self.forge(next(kinds))
            except Exception as exc:  # the benchmark goes on; the table says how many landed
                print(f"forger: {exc!r}", flush=True)

    def forge(self, kind: str) -> None:
        regions = json.loads((self.folder / "regions.json").read_text())
        store = RunStore(self.run_name, regions, next(iter(regions)), writer="forger")
        spec = store.read_spec()
        slots = run_slots(spec)
        lid = self.rng.choice(sorted(slots))
        region = slots[lid]
        if store.progress.done(lid, region):
            return  # the syncers may have looked for the last time
        seqs = {
            p: store.contributions.contribution_seqs(lid, p, region)
            for p in range(len(spec["fragments"]))
        }
        newest = max(((s[-1], p) for p, s in seqs.items() if s), default=None)
        if newest is None:
            return  # nothing sent yet
        p = (newest[1] + 1) % len(seqs)
        if not seqs[p] or newest[0] in seqs[p]:
            return
        tensors, meta = store.contributions.get_contribution(lid, p, seqs[p][-1], region)
        secret = (self.folder / "run-secret").read_text().strip()
        key = None if kind == "unsigned" else learner_key(secret, self.run_name, lid)
        if kind in ("nan", "norm"):
            fill = np.nan if kind == "nan" else 1e3
            tensors = {n: quantize(np.full(q.shape, fill, np.float32), "fp32")
                       for n, q in tensors.items()}  # fmt: skip
        writer = RunStore(self.run_name, {region: regions[region]}, region, writer=lid)
        if kind == "corrupt":  # signed, but its marker does not match its data
            writer._buckets[region] = _Damaging(writer.home)
        writer.contributions.put_contribution(lid, p, newest[0], tensors, meta, key)
        self.done.append({"kind": kind, "learner": lid, "fragment": p, "seq": newest[0]})


def train(name: str, mode: str, args: argparse.Namespace, chaos: bool, root: Path) -> dict:
    """One `diloco train` run; its summary, audit and forgeries."""
    run = f"{name}-{mode}"
    folder = root / run
    regions = {"us-east": f"file://{root}/{run}-us", "eu-west": f"file://{root}/{run}-eu"}
    tokens = args.diloco_tokens if mode == "diloco" and args.diloco_tokens else args.tokens
    limit = args.diloco_max_seconds if mode == "diloco" and args.diloco_max_seconds else None
    sets = [f"budget.tokens={tokens}", f"seed={args.seed}", "pipeline.eval_seconds=20"]
    sets += chaos_settings(args) if chaos else []
    argv = [sys.executable, "-m", "flows.cli", "train", "--run", run, "--dir", str(root),
            "--mode", mode] + [x for s in sets for x in ("--set", s)]  # fmt: skip
    argv += [x for r, u in regions.items() for x in ("--region", f"{r}={u}")] + ["--create-buckets"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "regions.json").write_text(json.dumps(regions))
    forger = Forger(run, folder, args.forge_every, args.seed)
    if chaos:
        forger.start()
    started = time.time()
    with open(folder / "train.log", "w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=limit or args.max_seconds)
        except subprocess.TimeoutExpired:  # stopped as a user would: Ctrl-C, workers save
            proc.send_signal(signal.SIGINT)
            code = proc.wait()
    forger.stop.set()
    seconds = time.time() - started
    summary = json.loads((folder / "summary.json").read_text()) if code == 0 else {}
    if chaos and "chaos" not in summary:  # a stopped run: its counts from the logs
        summary["chaos"] = {
            "actions": dict(Counter(a["action"] for a in read_actions(folder / "chaos.jsonl"))),
            "faults": dict(Counter(f["kind"] for f in read_actions(folder / "faults.jsonl"))),
        }
    report = audit_run(run, regions)
    for f in forger.done:  # rejected, superseded unread, or merged (a check failed)
        f["outcome"] = report.outcome_of.get((f["fragment"], f["learner"], f["seq"]), "not found")
    return {"run": run, "mode": mode, "chaos": chaos, "exit": code, "seconds": seconds,
            "tokens": tokens, "summary": summary, "audit": report.as_dict(),
            "forged": forger.done,
            "merged_tokens": merged_tokens(run, regions)}  # fmt: skip


def merged_tokens(run: str, regions: dict[str, str]) -> int:
    """Tokens the newest versions have merged, over the fragments (how far a run got)."""
    store = RunStore(run, regions, next(iter(regions)))
    total = 0
    for p in range(len(store.read_spec()["fragments"])):
        newest = store.versions.latest_global(p)
        total += int(store.versions.global_marker(p, newest).meta.get("tokens_total", 0))
    return total


def row(r: dict) -> str:
    s, a = r["summary"] or {"wall_seconds": r["seconds"]}, r["audit"]
    chaos = s.get("chaos") or {}
    rejoin = chaos.get("kill_to_rejoin") or {}
    forged = ", ".join(f"{k} {sum(f['kind'] == k for f in r['forged'])}" for k in FORGERIES)
    fates = Counter(f.get("outcome", "?").split()[0] for f in r["forged"])
    forged += " (" + ", ".join(f"{k} {v}" for k, v in sorted(fates.items())) + ")" if fates else ""
    kills = " · ".join(f"{k} {v}" for k, v in chaos.get("actions", {}).items()) or "-"
    faults = " · ".join(f"{k} {v}" for k, v in chaos.get("faults", {}).items()) or "-"
    audit = "clean" if a["ok"] else "FAILED: " + "; ".join(a["violations"])
    done = "done" if r["exit"] == 0 else f"stopped at {r['seconds']:.0f} s"
    return (f"| {r['mode']} | {'chaos' if r['chaos'] else 'none'} | {done} | "
            f"{r['merged_tokens']:,} | "
            f"{s.get('final_loss', float('nan')):.4f} | {s.get('goodput', 0):.1%} | "
            f"{s.get('wall_seconds', 0):.0f} | {kills} | {faults} | "
            f"{forged if r['chaos'] else '-'} | {audit} (lost {a['outcomes']['lost']}, "
            f"rejections recorded {a['rejections']}) | "
            f"{rejoin.get('median', float('nan')):.1f} / {rejoin.get('p90', float('nan')):.1f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kill-every", type=float, default=15.0)
    parser.add_argument("--syncer-kill-every", type=float, default=60.0)
    parser.add_argument("--pause-every", type=float, default=30.0)
    parser.add_argument("--crash-rate", type=float, default=0.005,
                        help="share of commit markers whose writer dies before writing them")  # fmt: skip
    parser.add_argument("--forge-every", type=float, default=20.0)
    parser.add_argument("--only", action="append", choices=["decoupled", "diloco"])
    parser.add_argument("--max-seconds", type=float, default=900.0, help="per run")
    parser.add_argument("--diloco-tokens", type=int, help="budget of the diloco runs")
    parser.add_argument("--spares", type=int, default=3, help="pipeline.spares under chaos")
    parser.add_argument("--diloco-max-seconds", type=float, help="limit of the diloco runs")
    parser.add_argument("--out", default=str(ROOT / "bench" / "chaos"))
    parser.add_argument("--root", help="where the runs' buckets and logs go (kept)")
    parser.add_argument("--chaos", action="append", choices=["off", "on"],
                        help="only the runs without or with chaos (default: both)")  # fmt: skip
    args = parser.parse_args()
    results: list[dict] = []
    root = Path(args.root or tempfile.mkdtemp(prefix="chaos-"))
    print(f"runs, buckets and logs in {root}", flush=True)
    for mode in args.only or ["decoupled", "diloco"]:
        for chaos in [c == "on" for c in args.chaos or ("off", "on")]:
            r = train("chaos" if chaos else "calm", mode, args, chaos, root)
            print(row(r), flush=True)
            results.append(r)
            write(Path(args.out), args, results)  # after each run: nothing is lost


def write(out: Path, args: argparse.Namespace, results: list[dict]) -> None:
    (out / "results.json").write_text(json.dumps(
        {"args": vars(args), "machine": machine(), "results": results}, indent=1, default=str))  # fmt: skip
    header = ("| mode | chaos | run | tokens merged | final loss | goodput | wall s | "
              "chaos actions | storage faults | forged | audit | "
              "kill to next send, median / p90 s |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    command = "python bench/chaos/run.py " + " ".join(sys.argv[1:])
    (out / "results.md").write_text(
        f"# Chaos benchmark\n\n`{command}` on {machine()}\n\n{header}\n"
        + "\n".join(row(r) for r in results)
        + "\n\n"
        + "\n".join(targets(results))
        + "\n"
    )


def targets(results: list[dict]) -> list[str]:
    """Chaos against calm, per mode: final loss (same budget) and goodput ratios."""
    lines = ["| mode | loss chaos / calm | goodput chaos / calm | tokens merged chaos / calm |",
             "|---|---|---|---|"]  # fmt: skip
    for mode in ("decoupled", "diloco"):
        pair = {r["chaos"]: r for r in results if r["mode"] == mode}
        if len(pair) < 2:
            continue
        calm, chaos = pair[False], pair[True]
        loss = chaos["summary"].get("final_loss", float("nan")) / calm["summary"]["final_loss"]
        good = chaos["summary"].get("goodput", 0.0) / calm["summary"]["goodput"]
        merged = chaos["merged_tokens"] / calm["merged_tokens"]
        lines.append(f"| {mode} | {loss:.3f} | {good:.2f} | {merged:.2f} |")
    return lines


if __name__ == "__main__":
    main()
