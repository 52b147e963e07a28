"""Overload benchmark: a run on a machine made busy on purpose, against the same run calm.

`diloco train` (the `tiny` preset, M = 4 learners in two file:// regions, real processes
and a real Prefect API, the default `data.assign`) runs with the same seed, budget and
rounds (``pipeline.round_steps``, ``--round-steps``: the inner steps after which a
learner writes its status) three ways:

- **calm**: as it is;
- **slow**: its learners' steps slowed (``pipeline.speeds``, ``--speed``) and small
  liveness limits (``liveness.heartbeat_seconds`` ``--heartbeat``, ``silent_min_seconds``
  ``--silent-min``, ``silent_max_seconds`` ``--silent-max``), on a calm machine: the
  control for the overload run's loss, as uneven speeds change who trains what (the
  fastest learner trains most of a shared budget);
- **overload**: the slow run with ``--busy`` processes spinning beside it (each a tight
  Python loop, killed at the end), so that every learner's round takes longer than the
  silence limit. Under the old rule (a learner silent once its status, written once a
  round, had not changed for a fixed timeout) every learner would have been taken for
  silent, fenced and its data given back, and the run would have stalled; now a
  learner's heartbeat, beating from a thread of its own, says it is alive.

``pipeline.speeds`` is relative: a learner's step is stretched by its factor over the
fastest learner's (``RunConfig.slowdown``), so ``4,4,4,4`` slows nobody. The default
``1,4,4,4`` leaves learner-0 at the machine's pace (loaded, in the overload run) and
slows the others four times; learner-0's round is longer than the limit through the
load and the round's steps alone (the table shows each learner's).

After each run every region is audited (``storage_layout.audit.audit_run``, and the data
units), and the buckets and logs are read for: each learner's round seconds (its history
rows), the fence records syncers wrote (generation objects with a ``"fence"`` key), the
stand-by syncers the launcher started, the syncers' warnings that a learner was not
counted towards the quorum (silent or lagging), and the final validation loss and tokens
(the launcher's ``summary.json``). The targets: the overload run finishes, its audit is
clean, no live learner is fenced (0 fences), and its loss is within the noise of the
calm run's (and the slow run's) at the same tokens.

    python bench/overload/run.py [--tokens 3000000] [--busy 8] [--speed 1,4,4,4]
        [--round-steps 400] [--only calm] [--only slow] [--only overload] [--root DIR]
        [--out bench/overload]

Writes bench/overload/results.md and results.json (after each run; with ``--only``, the
other runs' results of an earlier invocation stay).
"""

from __future__ import annotations

import argparse
import json
import os
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
from flows.ledger_audit import audit_units  # noqa: E402
from flows.supervision import STAND_BY  # noqa: E402
from storage_layout.audit import audit_run  # noqa: E402
from storage_layout.store import RunStore  # noqa: E402

LEARNERS = 4
RUNS = ("calm", "slow", "overload")  # in the order they run
# What the logs say when a stand-by starts, a learner is counted out, or one is fenced.
STAND_BY_LINE = re.compile(r"starting a stand-by for fragments")
COUNTED_OUT = re.compile(r"learner (\S+) is not counted towards the quorum: (.*)")
GIVEN_BACK = re.compile(r"learner (\S+) is silent: its data from step")


def busy(n: int) -> list[subprocess.Popen]:
    """``n`` processes that each keep a core busy until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def settings(name: str, args: argparse.Namespace) -> list[str]:
    """The run's overrides: the same seed, budget and rounds for all; the slowed steps
    and small liveness limits of the slow and overload runs."""
    sets = [f"budget.tokens={args.tokens}", f"seed={args.seed}", "pipeline.eval_seconds=20",
            f"topology.learners={LEARNERS}", f"pipeline.round_steps={args.round_steps}",
            *args.set]  # fmt: skip
    if name in ("slow", "overload"):
        sets += [
            f"pipeline.speeds={json.dumps(args.speed)}",
            f"liveness.heartbeat_seconds={args.heartbeat}",
            f"liveness.silent_min_seconds={args.silent_min}",
            f"liveness.silent_max_seconds={args.silent_max}",
        ]
    return sets


def code_version() -> dict:
    """The commit the code runs at and the files changed since (this benchmark's own
    aside): another session may commit or edit while a run goes on."""

    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True).stdout

    changed = [line[3:] for line in git("status", "--porcelain").splitlines()
               if not line[3:].startswith("bench/overload/")]  # fmt: skip
    return {"commit": git("rev-parse", "--short", "HEAD").strip(), "changed": changed}


def train(name: str, args: argparse.Namespace, root: Path) -> dict:
    """One `diloco train` run (with ``args.busy`` spinners beside it when overloaded);
    what it left in its buckets and logs."""
    run = f"overload-{name}"
    folder = root / run
    regions = {"us-east": f"file://{root}/{run}-us", "eu-west": f"file://{root}/{run}-eu"}
    sets = settings(name, args)
    argv = [sys.executable, "-m", "flows.cli", "train", "--run", run, "--dir", str(root),
            "--preset", "tiny", "--mode", "decoupled",
            *[x for s in sets for x in ("--set", s)],
            *[x for r, u in regions.items() for x in ("--region", f"{r}={u}")],
            "--create-buckets"]  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    code_at = code_version()
    spinners = busy(args.busy) if name == "overload" else []
    started = time.time()
    stopped = False
    try:
        with open(folder / "train.log", "w") as out:
            proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
            try:
                code = proc.wait(timeout=args.max_seconds)
            except subprocess.TimeoutExpired:  # a stall: stopped as a user would (Ctrl-C)
                stopped = True
                proc.send_signal(signal.SIGINT)
                try:
                    code = proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    code = proc.wait()
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.wait()
    seconds = time.time() - started
    summary_file = folder / "summary.json"
    summary = json.loads(summary_file.read_text()) if code == 0 and summary_file.exists() else {}
    out = {"run": run, "name": name, "argv": argv[1:], "sets": sets, "busy": len(spinners),
           "speeds": [1.0] * LEARNERS if name == "calm" else args.speed,  # (not in the spec)
           "code": code_at, "code_after": code_version(), "exit": code, "stopped": stopped,
           "seconds": seconds, "summary": summary}  # fmt: skip
    out.update(inspect(run, regions, folder, args.round_steps))
    return out


def inspect(run: str, regions: dict[str, str], folder: Path, round_steps: int) -> dict:
    """From the buckets and logs: the audit, round seconds, fences, stand-bys and the
    learners counted out of the quorum."""
    report = audit_run(run, regions)
    audit_units(report)  # data.assign = "units": no window merged from two learners
    store = RunStore(run, regions, next(iter(regions)), writer="bench")
    spec = store.read_spec()
    learners = store.members.run_learners(spec).regions
    liveness = spec["config"].get("liveness") or {}  # what its syncers judged by
    rounds: dict[str, list[float]] = {}
    per_step: dict[str, float | None] = {}  # seconds per inner step over all its rounds
    beats: dict[str, dict | None] = {}  # its last heartbeat
    fences: dict[str, list[str]] = {}
    generations: dict[str, int] = {}
    for lid, region in sorted(learners.items()):
        numbers = store.progress.history_rounds(lid, region)
        rows, _ = store.progress.get_rounds(lid, numbers, region)
        # Full rounds only (``pipeline.round_steps`` steps): a learner's last is cut short.
        rounds[lid] = [float(r["seconds"]) for r in rows if r.get("steps") == round_steps]
        steps = sum(int(r.get("steps", 0)) for r in rows)
        per_step[lid] = sum(float(r.get("seconds", 0)) for r in rows) / steps if steps else None
        beat = store.members.read_heartbeat(lid, region)
        beats[lid] = None if beat is None else beat.model_dump()
        own = RunStore(run, {region: regions[region]}, region, writer="bench")  # its home
        generations[lid] = newest = own.members.newest_generation(lid)
        fences[lid] = []
        for n in range(1, newest + 1):
            try:
                record = own.members.generation(lid, n)
            except FileNotFoundError:
                continue
            if isinstance(record, dict) and "fence" in record:
                fences[lid].append(f"s{n}: {record['fence']}")
    logs = [folder / "train.log", *sorted((folder / "logs").rglob("*.log"))]
    text = "\n".join(p.read_text(errors="replace") for p in logs if p.is_file())
    counted_out = sorted({f"{m.group(1)}: {m.group(2)}" for m in COUNTED_OUT.finditer(text)})
    every = [s for r in rounds.values() for s in r]
    return {
        "liveness": liveness, "silent_max_seconds": liveness.get("silent_max_seconds"),
        "audit": report.as_dict() | {"data": None},  # (the data ranges: long, not read)
        "audit_ok": report.ok,
        "tokens_merged": sum(a["tokens"]["merged"] + a["tokens"]["superseded"]
                             for a in report.learners.values()),
        "round_seconds": rounds,
        "round_median": statistics.median(every) if every else None,
        "round_max": max(every) if every else None,
        "fastest_round_median": min((statistics.median(r) for r in rounds.values() if r),
                                default=None),
        "step_seconds": per_step, "heartbeats": beats,
        "fences": fences, "fence_count": sum(len(f) for f in fences.values()),
        "generations": generations,
        "stand_bys": len(STAND_BY_LINE.findall(text)),
        "stand_by_workers": sorted(set(re.findall(rf"syncer\S* {STAND_BY}", text))),
        "counted_out": counted_out, "counted_out_lines": len(COUNTED_OUT.findall(text)),
        "given_back": len(GIVEN_BACK.findall(text)),
        "logs": [str(p) for p in logs],
    }  # fmt: skip


def row(r: dict) -> str:
    s = r["summary"]
    done = (
        "done" if r["exit"] == 0 else f"exit {r['exit']}" + (" (stopped)" if r["stopped"] else "")
    )
    speeds = ",".join(f"{x:g}" for x in r["speeds"])
    med, top = r["round_median"], r["round_max"]
    rounds = f"{med:.1f} / {top:.1f}" if med is not None else "-"
    slowest_min = r["fastest_round_median"]
    fast = f"{slowest_min:.1f}" if slowest_min is not None else "-"
    audit = (
        "clean"
        if r["audit_ok"]
        else "FAILED: " + "; ".join(f"{k}: {v[0]}" for k, v in r["audit"]["violations"].items())
    )
    loss = s.get("final_loss")
    return (f"| {r['name']} | {done} | {r['busy']} | {speeds} | {rounds} | {fast} | "
            f"{r['silent_max_seconds']:g} | {r['fence_count']} | {r['stand_bys']} | "
            f"{r['counted_out_lines']} | {audit} | {r['tokens_merged']:,} | "
            f"{'-' if loss is None else f'{loss:.4f}'} | "
            f"{s.get('wall_seconds', r['seconds']):.0f} |")  # fmt: skip


def loss_at(summary: dict, tokens: float) -> float | None:
    """The validation loss of ``summary``'s curve at ``tokens`` (linear between points)."""
    curve = [(float(p["tokens"]), float(p["loss"])) for p in summary.get("curve", [])]
    for (t0, l0), (t1, l1) in pairwise(curve):
        if t0 <= tokens <= t1:
            return l0 if t1 == t0 else l0 + (l1 - l0) * (tokens - t0) / (t1 - t0)
    return None


def compare(a: dict, b: dict) -> str | None:
    """The validation losses of runs ``a`` and ``b`` at the tokens both reached."""
    if not a["summary"] or not b["summary"]:
        return None
    tokens = min(a["summary"]["curve"][-1]["tokens"], b["summary"]["curve"][-1]["tokens"])
    la, lb = loss_at(a["summary"], tokens), loss_at(b["summary"], tokens)
    if la is None or lb is None:
        return None
    return (f"at {tokens:,.0f} tokens, {a['name']} {la:.4f}, {b['name']} {lb:.4f} "
            f"({b['name']} / {a['name']} {lb / la:.3f})")  # fmt: skip


def targets(results: list[dict]) -> list[str]:
    """The overload run against its targets, and its loss against the calm and slow runs
    at equal tokens."""
    by = {r["name"]: r for r in results}
    over = by.get("overload")
    if over is None:
        return []
    fastest = over["fastest_round_median"] or 0.0
    limit = over["silent_max_seconds"]

    def mark(ok: bool) -> str:
        return "met" if ok else "**NOT met**"

    lines = [
        "Targets of the overload run:",
        "",
        f"- every learner's round longer than the silence limit (the old rule, a status "
        f"once a round and a fixed timeout, would have taken them all for silent): the "
        f"fastest learner's median round {fastest:.1f} s against "
        f"liveness.silent_max_seconds {limit:g} s: {mark(fastest > limit)}",
        f"- it finishes: {mark(over['exit'] == 0)}",
        f"- its audit is clean: {mark(over['audit_ok'])}",
        f"- no live learner fenced (fence records {over['fence_count']}): "
        f"{mark(over['fence_count'] == 0)}",
    ]
    for other in ("calm", "slow"):
        if other in by and (text := compare(by[other], over)):
            lines.append(f"- validation loss against the {other} run's: {text}")
    return lines


NOTE = """\
A round is `pipeline.round_steps` inner steps: a learner writes its status once a round,
which is all the old rule (silent once the status had not changed for
`pipeline.member_timeout`) had to go by; its seconds are the learners' history rows (full
rounds only). Fences are generation objects with a `"fence"` key; stand-bys and learners
counted out of the quorum (silent or lagging) are the launcher's and syncers' log lines.
The slow run is the overload run without the busy processes: uneven `pipeline.speeds`
give the fastest learner most of the shared budget, which changes the loss at equal
tokens on its own, so the overload run's loss is compared with both."""


def write(out: Path, args: argparse.Namespace, results: list[dict]) -> None:
    results = sorted(results, key=lambda r: RUNS.index(r["name"]))
    (out / "results.json").write_text(json.dumps(
        {"args": vars(args), "machine": machine(), "results": results}, indent=1,
        default=str))  # fmt: skip
    lines = []
    for r in results:  # the code each ran: another session may commit or edit meanwhile
        at = r["code"]["commit"]
        if r["code"]["changed"]:
            at += " with uncommitted changes (" + ", ".join(r["code"]["changed"]) + ")"
        if r["code_after"] != r["code"]:
            at += f"; at its end {r['code_after']['commit']} ({len(r['code_after']['changed'])} "
            at += "files changed)"
        lines.append(f"    {r['name']}: {r.get('command', '?')}\n        at commit {at}")
    header = ("| run | ended | busy processes | pipeline.speeds | round s (median / max) | "
              "fastest learner's median round s | silent_max_seconds | fences | stand-bys | "
              "counted out (log lines) | audit | tokens merged | final validation loss | "
              "wall s |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    details = []
    for r in results:
        per = ", ".join(
            f"{lid} {statistics.median(s):.1f} ({len(s)} full rounds; "
            f"{r['step_seconds'][lid]:.3f} s a step)"
            for lid, s in r["round_seconds"].items() if s
        )  # fmt: skip
        last = ", ".join(f"{lid} {b['state']} at step {b['step']}, beat {b['beat']}"
                         for lid, b in r["heartbeats"].items() if b)  # fmt: skip
        details.append(f"- {r['name']}: median round s per learner: {per or '-'}; "
                       f"generations {r['generations']}; stand-by workers "
                       f"{r['stand_by_workers'] or '-'}; data given back by syncers "
                       f"{r['given_back']} time(s); last heartbeats: {last or '-'}")  # fmt: skip
        details += [f"  - counted out: {c}" for c in r["counted_out"][:10]]
        details += [f"  - fence: {lid} {f}" for lid, fs in r["fences"].items() for f in fs]
    (out / "results.md").write_text(
        f"# Overload benchmark\n\nOn {machine()}:\n\n" + "\n".join(lines) + "\n\n"
        f"{NOTE}\n\n{header}\n"
        + "\n".join(row(r) for r in results)
        + "\n\n"
        + "\n".join(details)
        + "\n\n"
        + "\n".join(targets(results))
        + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=3_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--busy", type=int, default=8, help="busy processes beside the overload run"
    )
    parser.add_argument("--speed", type=lambda s: [float(x) for x in s.split(",")],
                        default=[1.0, 4.0, 4.0, 4.0],
                        help="pipeline.speeds of the slow and overload runs, one factor per learner "
                        "(relative to the fastest: 4,4,4,4 slows nobody)")  # fmt: skip
    parser.add_argument("--round-steps", type=int, default=400,
                        help="pipeline.round_steps of both runs: the inner steps of a "
                        "learner's round, after which it writes its status")  # fmt: skip
    parser.add_argument("--heartbeat", type=float, default=1.0, help="liveness.heartbeat_seconds")
    parser.add_argument("--silent-min", type=float, default=5.0, help="liveness.silent_min_seconds")
    parser.add_argument(
        "--silent-max", type=float, default=10.0, help="liveness.silent_max_seconds"
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config field for both runs, as `diloco train --set`")  # fmt: skip
    parser.add_argument("--max-seconds", type=float, default=900.0,
                        help="per run: a run still going then is stopped (Ctrl-C)")  # fmt: skip
    parser.add_argument("--only", action="append", choices=RUNS,
                        help="only this run (repeatable; the others' earlier results stay)")  # fmt: skip
    parser.add_argument("--out", default=str(ROOT / "bench" / "overload"))
    parser.add_argument("--root", help="where the runs' buckets and logs go (kept)")
    args = parser.parse_args()
    if len(args.speed) != LEARNERS:
        parser.error(f"--speed needs {LEARNERS} factors, one per learner")
    root = Path(args.root or tempfile.mkdtemp(prefix="overload-"))
    print(f"runs, buckets and logs in {root}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # With --only, the other run's results from an earlier invocation stay in the table.
    results: list[dict] = []
    if args.only and (out / "results.json").exists():
        earlier = json.loads((out / "results.json").read_text()).get("results", [])
        results = [r for r in earlier if r["name"] not in args.only]
    for name in [n for n in RUNS if n in (args.only or RUNS)]:
        r = train(name, args, root)
        r["command"] = "python bench/overload/run.py " + " ".join(sys.argv[1:])
        print(row(r), flush=True)
        results.append(r)
        write(out, args, results)  # after each run: nothing is lost


if __name__ == "__main__":
    main()
