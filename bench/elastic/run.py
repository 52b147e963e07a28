"""Learners that come and go like spot capacity, through `diloco train` and `diloco join`.

Two runs of the `tiny` preset (`--preset`), decoupled, the same token budget (shared by whoever
trains), one file:// region, real processes and a real Prefect API:

- **fixed**: `topology.learners = --fixed` learners, all started by `diloco train`;
- **elastic**: `--slots` learner slots, of which `diloco train` starts `--permanent`
  (`pipeline.learners_started`); the others are spot capacity. A seeded schedule
  (`--seed`) drives them: every `--tick` seconds each vacant spot slot is joined
  (`diloco join --slot`, with a join token from `diloco join-token`) with probability
  `--join-rate * tick`, and each spot learner is preempted (SIGTERM: it sends what it
  trained, checkpoints and leaves) once it has lived a lifetime drawn from an
  exponential of mean `--lifetime` seconds (from its process's start, or with
  `--life-from-join` from its join); its slot can then be joined again.
- **elastic, grown** (``--grow``, data in units only): `topology.learners = --permanent`,
  all started by `diloco train`, and no slot reserved for spot capacity: up to
  ``--slots - --permanent`` spot joiners at a time run `diloco join` without a slot, so
  each adds one beyond the run's (its member record) or takes one an earlier spot
  learner left, on the same seeded schedule.

The table: wall time, final validation loss, goodput (learner seconds whose work was
merged over the learner seconds present: the permanent learners' whole run and each spot
learner's life, from its process's start), tokens merged (the audit), the mean number
of learners present, joins and preemptions, the time from a joiner's start to its join
record (its warm-up: ``diloco join`` builds the model and compiles its step before it
takes a slot), the time from each join to its first send written (the send's
``written_at``, from its marker or the retention ledger) and to the first version that
merged that joiner's work (seconds and in round lengths: the median interval between a
permanent learner's sends of one fragment), and whether the audit is clean.

    python bench/elastic/run.py [--tokens 2000000] [--fixed 4] [--slots 6] [--permanent 2]
        [--data PREPARED --vocab 512 --assign units]

With ``--data`` (a data set of ``diloco data prepare``) both runs train on it, its chunks
reaching learners as ``--assign`` says: ``units`` (``data.assign = "units"``: taken as
learners need them, given back by one that is preempted; the audit also checks that no
window was merged from two learners) or ``slots`` (dealt to the slots once).

Writes bench/elastic/results.md and results.json. A benchmark, on the wall clock: the
schedule is seeded, the machine's speed is not.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.machine import machine  # noqa: E402

REGION = "us-east"
# Every version kept: join-to-merge times are read from the versions after the run.
COMMON = [
    "topology.quorum=1",
    "pipeline.eval_seconds=20",
    "pipeline.syncer_shards=1",
    "pipeline.keep_versions=1000000",
]


def train_argv(name: str, root: Path, args: argparse.Namespace, sets: list[str]) -> list[str]:
    url = f"file://{root / name / 'bucket'}"
    sets = [f"budget.tokens={args.tokens}", f"seed={args.seed}", *COMMON, *args.set, *sets]
    if args.data:
        sets += [f"data.source={args.data}", f"model.vocab_size={args.vocab}"]
    if args.data or args.assign:  # (text, the default: on slots unless given)
        sets += [f"data.assign={args.assign or 'units'}"]
    return [sys.executable, "-m", "flows.cli", "train", "--run", name, "--dir", str(root),
            "--preset", args.preset, "--mode", "decoupled", "--create-buckets",
            "--region", f"{REGION}={url}",
            *[x for s in sets for x in ("--set", s)]]  # fmt: skip


class Spot:
    """The spot slots of the elastic run and their joiner processes."""

    def __init__(self, name: str, root: Path, args: argparse.Namespace, env: dict[str, str]):
        self.name, self.root, self.args, self.env = name, root, args, env
        self.rng = random.Random(args.seed)
        # the spot slots (--grow: places for joiners, each adding or taking a slot itself)
        self.slots = [f"learner-{i}" for i in range(args.permanent, args.slots)]
        self.procs: dict[str, tuple[subprocess.Popen, float, float]] = {}  # slot -> p, t0, life
        self.joins = self.preemptions = 0
        self.present = 0.0  # spot learner seconds present (process start to end)
        self.started: dict[int, float] = {}  # a joiner's pid -> when its process started
        self.logs = root / name / "joiners"
        self.logs.mkdir(parents=True, exist_ok=True)

    def tick(self) -> None:
        now, a = time.time(), self.args
        for slot in self.slots:
            held = self.procs.get(slot)
            if held is not None:
                proc, t0, life = held
                if a.life_from_join and not hasattr(proc, "joined"):
                    log = self.logs / f"{slot}-{proc.number}.log"  # type: ignore[attr-defined]
                    if "joining run " in log.read_text(errors="replace"):
                        proc.joined = now  # type: ignore[attr-defined]
                born = getattr(proc, "joined", None if a.life_from_join else t0)
                if proc.poll() is not None:
                    self.present += now - t0
                    del self.procs[slot]
                elif born is not None and now - born > life and not getattr(proc, "told", False):
                    proc.send_signal(signal.SIGTERM)  # a spot notice: send, checkpoint, leave
                    proc.told = True  # type: ignore[attr-defined]
                    self.preemptions += 1
                continue
            if self.rng.random() < a.join_rate * a.tick:
                url = f"file://{self.root / self.name / 'bucket'}"
                argv = [sys.executable, "-m", "flows.cli", "join", url, "--run", self.name,
                        "--region", REGION, *([] if a.grow else ["--slot", slot]),
                        "--pipeline", json.dumps({"eval_seconds": 20})]  # fmt: skip
                log = (self.logs / f"{slot}-{self.joins}.log").open("w")
                proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                        env=self.env)  # fmt: skip
                proc.number = self.joins  # type: ignore[attr-defined]
                self.procs[slot] = (proc, now, self.rng.expovariate(1.0 / a.lifetime))
                self.started[proc.pid] = now
                self.joins += 1

    def stop(self, end: float) -> None:
        """At the run's end (``end``): whatever joiner is left ends (its slot's budget is
        spent); its time present counts up to the run's end."""
        for proc, t0, _ in self.procs.values():
            try:
                proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                proc.kill()
            self.present += max(0.0, end - t0)


def run(name: str, root: Path, args: argparse.Namespace, sets: list[str], elastic: bool) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    (root / name).mkdir(parents=True, exist_ok=True)
    started = time.time()
    log = (root / name / "train.log").open("w")
    proc = subprocess.Popen(train_argv(name, root, args, sets), cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, env=env)  # fmt: skip
    spot = None
    if elastic:
        # Joiners report to the run's Prefect API (a deployment's workers have it set).
        api = None
        while (api is None or not (root / name / "run-secret").exists()) and proc.poll() is None:
            found = re.search(r"Prefect API (http\S+)", (root / name / "train.log").read_text())
            api = found.group(1) if found else None
            time.sleep(0.5)
        env["PREFECT_API_URL"] = api or ""
        token = subprocess.run(
            [sys.executable, "-m", "flows.cli", "join-token", f"file://{root / name / 'bucket'}",
             "--run", name, "--dir", str(root),
             "--learners", str(args.slots * (8 if args.grow else 1))], cwd=ROOT,
            capture_output=True, text=True, check=True
        ).stdout.strip()  # fmt: skip
        spot = Spot(name, root, args, {**env, "DILOCO_JOIN_TOKEN": token})
        while proc.poll() is None:
            spot.tick()
            time.sleep(args.tick)
    code = proc.wait()
    wall = time.time() - started  # the run's: a joiner still ending is not waited for
    if spot:
        spot.stop(started + wall)
    out = {"run": name, "sets": sets, "exit": code, "wall": wall}
    if code != 0:
        return out
    out["summary"] = json.loads((root / name / "summary.json").read_text())
    permanent = args.permanent if elastic else args.fixed
    present = permanent * wall + (spot.present if spot else 0.0)
    out.update(measure(name, root, present / wall if wall else 0.0, present, permanent,
                       spot.started if spot else {}))  # fmt: skip
    if spot:
        out.update(joins=spot.joins, preemptions=spot.preemptions)
    return out


def measure(
    name: str,
    root: Path,
    mean_present: float,
    present: float,
    permanent: int,
    started: dict[int, float],
) -> dict:
    """From the buckets: tokens merged and the audit, useful learner seconds, each join's
    time to its first merged contribution, and each joiner's from its process's start to
    its join record (``started``: pid to start; ``diloco join`` warms up before it joins,
    in the process that then trains)."""
    from diloco import records
    from flows.ledger_audit import audit_units
    from flows.run import build_model
    from flows.spec import config_from_spec
    from protocol.topology import learner_index
    from storage_layout.audit import audit_run
    from storage_layout.retention import read_ledger
    from storage_layout.store import RunStore

    url = f"file://{root / name / 'bucket'}"
    store = RunStore(name, {REGION: url}, REGION)
    spec = store.read_spec()
    learners = store.members.run_learners(spec).regions  # with those joiners added (--grow)
    report = audit_run(name, {REGION: url})
    audit_units(report)  # with data.assign = "units": no window merged from two learners
    fragments = len(spec["fragments"])
    versions: list[tuple[float, int, set]] = []  # (time, fragment, consumed (learner, seq))
    merged_seconds = []
    for p in range(fragments):
        newest = 0.0
        for v in store.versions.global_versions(p, REGION):
            meta = store.versions.global_marker(p, v).meta
            versions.append((float(meta["time"]), p, {tuple(c) for c in meta["consumed"]}))
            newest = float(meta.get("seconds_total", newest))
        merged_seconds.append({"fragment": p, "seconds": newest})
    shares = build_model(config_from_spec(spec)).shares
    useful = records.useful_seconds(merged_seconds, shares)
    # When each contribution was first merged, from the versions alone: retention deletes
    # merged contributions (their markers and `written_at` with them), so a joiner's
    # first sends are gone from the bucket by the end of the run.
    merged: dict[tuple[str, int], float] = {}  # (learner, seq) -> first version's time
    for vt, _, consumed in versions:
        for who, seq in consumed:
            merged[(who, seq)] = min(vt, merged.get((who, seq), vt))
    # A round: the time between two sends of one fragment, `fragments` sends apart; read
    # from when a permanent learner's consecutive sends were merged (within a second of
    # their sending here: bench/elastic/results.md).
    sends = sorted(t for (lid, _), t in merged.items() if lid == "learner-0")
    round_length = statistics.median(b - a for a, b in pairwise(sends)) * fragments
    # When each contribution was written: its marker, or the ledger's row once deleted.
    written: dict[tuple[str, int], float] = {}
    for p in range(fragments):
        for entry in read_ledger(store.home, store.layout, p):
            for row in entry.get("contributions", []):
                if isinstance(row.get("written_at"), int | float):
                    written[(str(row["learner"]), int(row["seq"]))] = float(row["written_at"])
        for lid, region in learners.items():
            for seq in store.contributions.contribution_seqs(lid, p, region):
                meta = store.contributions.contribution_meta(lid, p, seq, region)
                if isinstance(meta.get("written_at"), int | float):
                    written[(lid, seq)] = float(meta["written_at"])
    waits, warm, sends = [], [], []
    for lid in [x for x in learners if learner_index(x) >= permanent]:  # spot slots
        for record in store.members.joins(lid):
            t = float(record["time"])
            if record.get("pid") in started:
                warm.append(t - started[record["pid"]])
            # this join's sends: seqs above any of the slot's merged before it joined
            before = max((s for (who, s), mt in merged.items() if who == lid and mt <= t),
                         default=-1)  # fmt: skip
            firsts = [mt for (who, s), mt in merged.items() if who == lid and s > before]
            if firsts:
                waits.append(min(firsts) - t)
            out = [w for (who, s), w in written.items() if who == lid and s > before and w > t]
            if out:
                sends.append(min(out) - t)
    return {
        "audit_ok": report.ok, "violations": {k: v[:3] for k, v in report.violations.items()},
        "tokens_merged": sum(a["tokens"]["merged"] + a["tokens"]["superseded"]
                             for a in report.learners.values()),
        "spot_tokens_merged": sum(
            a["tokens"]["merged"] + a["tokens"]["superseded"]
            for lid, a in report.learners.items() if learner_index(lid) >= permanent),
        "useful_seconds": useful, "present_seconds": present, "goodput": useful / present,
        "mean_present": mean_present, "round_seconds": round_length,
        "join_to_merge": sorted(waits), "start_to_join": sorted(warm),
        "join_to_send": sorted(sends),
    }  # fmt: skip


def row(label: str, r: dict) -> str:
    if r.get("exit") != 0:
        return f"| {label} | failed (exit {r.get('exit')}) |||||||||||"
    s, waits = r["summary"], r.get("join_to_merge") or []
    rl = r["round_seconds"]
    join = "–"
    if waits:
        med = statistics.median(waits)
        join = (
            f"{med:.1f} s ({med / rl:.1f} rounds); max {max(waits):.1f} s ({max(waits) / rl:.1f})"
        )
    warm = r.get("start_to_join") or []
    start = f"{statistics.median(warm):.1f} s; max {max(warm):.1f} s" if warm else "–"
    out = r.get("join_to_send") or []
    send = f"{statistics.median(out):.1f} s; max {max(out):.1f} s" if out else "–"
    return (f"| {label} | {r['wall']:.0f} | {s['final_loss']:.4f} | {r['goodput']:.1%} | "
            f"{r['tokens_merged']:,} ({r.get('spot_tokens_merged', 0):,}) | "
            f"{r['mean_present']:.2f} | {r.get('joins', 0)} / "
            f"{r.get('preemptions', 0)} | {start} | {send} | {join} | {rl:.1f} | "
            f"{'clean' if r['audit_ok'] else 'VIOLATIONS'} |")  # fmt: skip


def write(out: Path, args: argparse.Namespace, results: list[tuple[str, dict]]) -> None:
    (out / "results.json").write_text(json.dumps(
        {"args": vars(args), "machine": machine(), "results": dict(results)}, indent=1,
        default=str))  # fmt: skip
    command = "python bench/elastic/run.py " + " ".join(sys.argv[1:])
    header = ("| run | wall s | final loss | goodput | tokens merged (by spot learners) "
              "| learners present (mean) "
              "| joins / preemptions | start to join record (median; max) "
              "| join to first send written (median; max) "
              "| join to first merge (median; max) | round s | audit |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    body = "\n".join(row(label, r) for label, r in results)
    (out / "results.md").write_text(
        f"# Learners that come and go (`diloco join`, preemption)\n\n`{command}` on "
        f"{machine()}\n\n{header}\n{body}\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny", help="the runs' preset (small: the CPU "
                        "benchmarks' model, 2 M parameters, H = 40)")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=2_000_000)
    parser.add_argument("--fixed", type=int, default=4, help="learners of the fixed run")
    parser.add_argument("--slots", type=int, default=6, help="learner slots of the elastic run")
    parser.add_argument("--permanent", type=int, default=2, help="of them, started by train")
    parser.add_argument("--tick", type=float, default=2.0, help="seconds between decisions")
    parser.add_argument("--join-rate", type=float, default=0.1,
                        help="joins per vacant spot slot per second")  # fmt: skip
    parser.add_argument("--lifetime", type=float, default=40.0,
                        help="mean seconds a spot learner lives before its preemption")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--life-from-join", action="store_true",
                        help="a spot learner's lifetime counts from its join record, not "
                        "from its process's start (its warm-up is never preempted)")  # fmt: skip
    parser.add_argument("--data", help="a prepared data set (diloco data prepare) to train "
                        "on (default: the byte reader's text, the standard library)")  # fmt: skip
    parser.add_argument("--vocab", type=int, default=4096, help="its vocabulary")
    parser.add_argument("--assign", choices=("units", "slots"),
                        help="how the data reaches learners (data.assign; default: units "
                        "with --data, the run's default, slots, on text)")  # fmt: skip
    parser.add_argument("--grow", action="store_true",
                        help="no slot reserved for spot learners: each adds one beyond the "
                        "run's --permanent, or takes one a spot learner left (units only)")  # fmt: skip
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config field for both runs, as `diloco train --set`")  # fmt: skip
    parser.add_argument("--out", default=str(ROOT / "bench" / "elastic"))
    parser.add_argument("--root", help="where the runs' buckets and logs go (kept)")
    args = parser.parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="elastic-"))
    print(f"runs, buckets and logs in {root}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: list[tuple[str, dict]] = []
    plans = [
        (f"fixed, {args.fixed} learners", "fixed", [f"topology.learners={args.fixed}"], False),
        (f"elastic, {args.permanent} permanent + up to {args.slots - args.permanent} spot",
         "elastic", [f"topology.learners={args.slots}",
                     f"pipeline.learners_started={args.permanent}"], True),
    ]  # fmt: skip
    if args.grow:  # the spot learners add their slots themselves
        if (args.assign or ("units" if args.data else "slots")) != "units":
            parser.error("--grow needs --assign units (added slots own no data)")
        plans[1] = (f"elastic, {args.permanent} permanent + up to "
                    f"{args.slots - args.permanent} spot, slots added by joiners", "elastic",
                    [f"topology.learners={args.permanent}"], True)  # fmt: skip
    for label, name, sets, elastic in plans:
        r = run(name, root, args, sets, elastic)
        results.append((label, r))
        print(row(label, r), flush=True)
        write(out, args, results)


if __name__ == "__main__":
    main()
