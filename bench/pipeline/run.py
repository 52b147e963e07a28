"""Pipeline overheads, measured in one `diloco train` run.

1. Learner throughput inside the pipeline (tokens/s per round, from the learners' round
   tables in Prefect) vs a bare jitted training loop of the same model and batch, run
   alone in its own process first. Target: pipeline / bare >= 0.95.
2. Prefect overhead per round: the round task run's wall time less the round's own
   measured time, plus the gap to the next round's task run.
3. Latency from a contribution's commit (``written_at`` in its marker) to the publish of
   the version that merged it (``published_at`` in the version's marker).

    python bench/pipeline/run.py [--preset small] [--learners 1] [--tokens 400000]

Writes ``bench/pipeline/results.md`` and ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.machine import machine  # noqa: E402

BARE = """
import json, sys, time
from diloco.config import load_config
from diloco.run_data import RunData
from flows.run import build_model
cfg = load_config(sys.argv[1], overrides=[f"topology.learners={sys.argv[2]}"])
model = build_model(cfg)
trainer, r = model.trainer, RunData(cfg).reader(0)
params = trainer.place_params(model.init)
opt = trainer.init_opt_state(params)
for i in range(5):
    params, opt, loss = trainer.step(params, opt, r.next_batch(), i)
loss.block_until_ready()
steps = int(sys.argv[3])
start = time.perf_counter()
for i in range(steps):
    params, opt, loss = trainer.step(params, opt, r.next_batch(), 5 + i)
loss.block_until_ready()
seconds = time.perf_counter() - start
print(json.dumps({"tokens_per_s": steps * cfg.tokens_per_step / seconds, "steps": steps}))
"""


def bare_throughput(preset: str, learners: int, steps: int) -> float:
    out = subprocess.run([sys.executable, "-c", BARE, preset, str(learners), str(steps)],
                         cwd=ROOT, capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"]


def api_post(api: str, path: str, body: dict) -> list[dict]:
    """The REST API directly: the sync client sends None for fields this server requires."""
    import httpx

    response = httpx.post(f"{api}/{path}", json={"offset": 0, **body}, timeout=30)
    response.raise_for_status()
    return response.json()


def round_tables(api: str, run: str, learners: int) -> list[dict]:
    keys = [f"{run}-learner-{i}-rounds" for i in range(learners)]
    body = {"artifacts": {"key": {"any_": keys}}, "sort": "CREATED_DESC", "limit": 200}
    rows = []
    for art in api_post(api, "artifacts/filter", body):
        i = int(art["key"].rsplit("-", 2)[1])
        rows += [{**row, "learner": i} for row in json.loads(art["data"])]
    return rows


def task_runs(api: str) -> list[dict]:
    out, offset = [], 0
    while True:
        body = {"sort": "EXPECTED_START_TIME_ASC", "limit": 200, "offset": offset}
        page = api_post(api, "task_runs/filter", body)
        out += page
        if len(page) < 200:
            return out
        offset += 200


def prefect_overheads(api: str, learners: int, seconds_by_round: dict) -> list[float]:
    """Per round: the task run's wall time less the round's own time, plus the gap to the
    next round's task run (task creation, state updates, logging)."""
    from datetime import datetime

    def ts(text: str) -> float:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()

    runs = [t for t in task_runs(api) if t["start_time"] and t["end_time"]]
    out = []
    for i in range(learners):
        mine = sorted((t for t in runs if f"/{i} " in t["name"] and t["name"].startswith("learner")),
                      key=lambda t: ts(t["start_time"]))  # fmt: skip
        rounds = [t for t in mine if " round " in t["name"] and not t["name"].endswith(" round 1")]
        if rounds:
            SPANS.append((i, ts(rounds[0]["start_time"]), ts(rounds[-1]["end_time"])))
        for cur, nxt in zip(mine, [*mine[1:], None], strict=True):
            if " round " not in cur["name"]:
                continue
            number = int(cur["name"].rsplit(" ", 1)[1])
            measured = seconds_by_round.get((i, number))
            if measured is None or number == 1:
                continue  # the first round includes the learner's warm-up
            wall = ts(cur["end_time"]) - ts(cur["start_time"])
            gap = (
                ts(nxt["start_time"]) - ts(cur["end_time"])
                if nxt and " round " in nxt["name"]
                else 0.0
            )
            out.append(wall - measured + gap)
            DETAIL.append({"task": cur["name"], "wall": wall, "measured": measured, "gap": gap})
    return out


DETAIL: list[dict] = []  # per round, for results.json
SPANS: list[tuple[int, float, float]] = []  # per learner: start of round 2, end of the last


def latencies(store, fragments: int, since: float) -> list[float]:
    from protocol.topology import run_slots
    from storage_layout.commit import read_marker

    slots = run_slots(store.read_spec())
    out = []
    for p in range(fragments):
        for v in store.versions.global_versions(p):
            meta = store.versions.global_marker(p, v).meta
            if meta.get("published_at", 0) < since:
                continue
            for learner, seq in meta.get("consumed", []):
                region = slots[learner]
                key = store.layout.contribution_marker(learner, p, seq)
                written = read_marker(store.bucket(region), key).meta.get("written_at")
                if written:
                    out.append(meta["published_at"] - written)
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small")
    parser.add_argument("--learners", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=400_000)
    parser.add_argument("--round-steps", type=int, default=50)
    parser.add_argument("--eval-seconds", type=float, default=30.0)
    parser.add_argument("--out", default=str(ROOT / "bench" / "pipeline"))
    args = parser.parse_args()

    from diloco.config import load_config

    cfg = load_config(args.preset, overrides=[
        f"topology.learners={args.learners}", f"budget.tokens={args.tokens}",
        f"pipeline.round_steps={args.round_steps}", "pipeline.syncer_shards=1",
        f"pipeline.eval_seconds={args.eval_seconds}",
    ])  # fmt: skip
    bare = bare_throughput(args.preset, args.learners, 200)
    print(f"bare loop: {bare:,.0f} tokens/s", flush=True)

    work = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    regions = {r: f"file://{work / r}" for r in ("us-east", "eu-west")}
    for r in regions:
        (work / r).mkdir()
    from infra.prefect_server import prefect_server

    with prefect_server(work / "prefect") as api:
        import os

        os.environ["PREFECT_API_URL"] = api
        from flows.launcher import train_flow
        from flows.run import initialize_run
        from flows.watch import flush_prefect
        from storage_layout.store import RunStore

        store = RunStore("bench", regions, "us-east")
        initialize_run(store, cfg)
        started = time.time()
        summary = train_flow("bench", regions, cfg, str(work / "logs"))
        flush_prefect()
        rows = round_tables(api, "bench", args.learners)
        by_round = {(r["learner"], r["round"]): r["seconds"] for r in rows}
        overheads = prefect_overheads(api, args.learners, by_round)
        lat = latencies(store, cfg.topology.fragments, started)

    steady = [r for r in rows if r["round"] > 1]
    inside = statistics.mean(r["tokens_per_s"] for r in steady)
    # End to end: every token of rounds 2+ over the wall time from the start of round 2 to
    # the end of the last round (task scheduling, checkpoints and all).
    span = sum(end - start for _, start, end in SPANS)
    effective = sum(r["steps"] for r in steady) * cfg.tokens_per_step / span
    round_seconds = statistics.mean(r["seconds"] for r in steady)
    result = {
        "preset": args.preset, "learners": args.learners, "tokens": args.tokens,
        "round_steps": args.round_steps, "bare_tokens_per_s": bare,
        "pipeline_tokens_per_s": inside, "ratio": inside / bare,
        "effective_tokens_per_s": effective, "effective_ratio": effective / bare,
        "round_seconds": round_seconds,
        "prefect_overhead_s": {"mean": statistics.mean(overheads), "p50": pct(overheads, 0.5),
                               "p90": pct(overheads, 0.9), "rounds": len(overheads)},
        "commit_to_publish_s": {"mean": statistics.mean(lat), "p50": pct(lat, 0.5),
                                "p90": pct(lat, 0.9), "max": max(lat), "contributions": len(lat)},
        "rounds": DETAIL,
        "final_loss": summary["final_loss"], "initial_loss": summary["initial_loss"],
        "goodput": summary["goodput"], "wall_seconds": summary["wall_seconds"],
        "machine": machine(),
    }  # fmt: skip
    out = Path(args.out)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    command = " ".join(["python bench/pipeline/run.py", *sys.argv[1:]])
    o, c = result["prefect_overhead_s"], result["commit_to_publish_s"]
    md = f"""# Pipeline overheads

Command: `{command}`
Machine: {result["machine"]}
Run: preset `{args.preset}`, {args.learners} learner(s), 1 syncer shard, two `file://`
regions, {args.tokens:,} tokens, {args.round_steps} inner steps per round; the learner,
the syncer, the launcher and the Prefect server share the machine.

| metric | value | target |
|---|---|---|
| bare jitted loop (same model and batch, alone) | {bare:,.0f} tokens/s | |
| learner inside the pipeline (rounds 2+) | {inside:,.0f} tokens/s | |
| pipeline / bare | **{inside / bare:.3f}** | >= 0.95 |
| learner end to end (rounds 2+, incl. task scheduling and checkpoints) | {effective:,.0f} tokens/s = **{effective / bare:.3f}** of bare | |
| round length | {round_seconds:.2f} s | |
| Prefect overhead per round (mean / p50 / p90, {o["rounds"]} rounds) | {o["mean"] * 1000:.0f} / {o["p50"] * 1000:.0f} / {o["p90"] * 1000:.0f} ms | |
| contribution commit -> publish of its version (mean / p50 / p90 / max, {c["contributions"]} merged) | {c["mean"]:.2f} / {c["p50"]:.2f} / {c["p90"]:.2f} / {c["max"]:.2f} s | |
| validation loss | {result["initial_loss"]:.3f} -> {result["final_loss"]:.3f} | |
| goodput (incl. process start-up) | {result["goodput"]:.1%} | |
"""
    (out / "results.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
