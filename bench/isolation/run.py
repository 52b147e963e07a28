"""Isolation benchmark: the home region's Prefect worker killed mid-run, on the local stack.

`python -m infra.local_stack up` (a Prefect server, moto's S3 for us-east, fake GCS for
eu-west, a process worker per region), then the run as an operator starts it: a flow run
of the `train/us-east` deployment with ``via=deployments``, so the launcher itself is a
flow run of the us-east worker, and every learner and syncer a flow run of its region's.
Once the learners have trained ``--kill-at`` of the budget, the us-east worker is
SIGKILLed (its flow runs, the launcher's included, are its children: they stay); after
``--down`` seconds a new us-east worker starts. Every second the learners' status objects
are read from the buckets; per region, the steps trained per minute before, during and
after the outage are reported, with the launcher's final state and the run's summary.

What it checks (issue 57): the other region trains on through the outage at its pace; the
home region's learners train on until their bounded flow runs end (a new one waits for a
worker); the launcher neither dies with its worker (``flows.observe.PipeSafe``) nor
cancels anything, and the run completes.

    python bench/isolation/run.py [--tokens 1500000] [--kill-at 0.3] [--down 60]
        [--out bench/isolation]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.machine import machine  # noqa: E402
from infra import local_stack  # noqa: E402


def steps_by_region(run: str) -> dict[str, int]:
    """Inner steps the learners of each region have trained (their status objects)."""
    from diloco.topology import run_slots
    from storage_layout.store import RunStore

    store = RunStore(run, local_stack.REGIONS, "us-east", writer="bench")
    out: dict[str, int] = {}
    for lid, region in run_slots(store.read_spec()).items():
        status = store.read_metrics(lid, region) or {}
        out[region] = out.get(region, 0) + int(status.get("step") or 0)
    return out


def launcher_state(flow_run_id: str) -> str:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(uuid.UUID(flow_run_id)).state
    return state.name if state else "?"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1_500_000)
    parser.add_argument("--kill-at", type=float, default=0.3)
    parser.add_argument("--down", type=float, default=60.0)
    parser.add_argument("--out", default=str(ROOT / "bench" / "isolation"))
    args = parser.parse_args()
    run = f"iso-{uuid.uuid4().hex[:6]}"
    state = local_stack.up()
    env = {**os.environ, **state["env"]}
    samples: list[tuple[float, dict[str, int]]] = []
    try:
        overrides = json.dumps([f"budget.tokens={args.tokens}", "pipeline.spares=0"])
        started = subprocess.run(
            [sys.executable, "-m", "prefect", "deployment", "run", "train/us-east",
             "--param", f"run={run}", "--param", "via=deployments", "--param",
             f"overrides={overrides}"], env=env, cwd=ROOT, capture_output=True, text=True,
            check=True)  # fmt: skip
        flow_run_id = started.stdout.split("UUID: ")[1].split()[0]
        budget_steps = None
        killed = back = None
        t0 = time.time()
        while True:
            time.sleep(1.0)
            now = time.time()
            try:
                steps = steps_by_region(run)
            except (FileNotFoundError, OSError, ValueError):
                steps = {}  # (the spec not written yet)
            samples.append((now - t0, steps))
            if budget_steps is None and steps:
                from diloco.config import load_config

                cfg = load_config("tiny", overrides=[f"budget.tokens={args.tokens}"])
                budget_steps = cfg.budget_steps
            if (
                killed is None
                and budget_steps
                and sum(steps.values()) >= args.kill_at * budget_steps
            ):
                os.kill(state["pids"]["worker-us-east"], signal.SIGKILL)
                killed = now - t0
                print(f"{killed:.0f} s: killed the us-east worker at {steps}", flush=True)
            if killed is not None and back is None and now - t0 >= killed + args.down:
                state["pids"]["worker-us-east"] = local_stack._spawn(
                    "worker-us-east", [sys.executable, "-m", "prefect", "worker", "start",
                                       "--pool", "us-east", "--type", "process"], env)  # fmt: skip
                local_stack._save(state)
                back = now - t0
                print(f"{back:.0f} s: a new us-east worker started", flush=True)
            final = launcher_state(flow_run_id)
            if final in ("Completed", "Failed", "Crashed", "Cancelled") or now - t0 > 3600:
                break
    finally:
        local_stack.down()
    rows = []
    for region in local_stack.REGIONS:
        windows = {"before": (0.0, killed), "during": (killed, back), "after": (back, None)}
        cells = []
        for lo, hi in windows.values():
            inside = [(t, s.get(region, 0)) for t, s in samples
                      if lo is not None and t >= lo and (hi is None or t <= hi)]  # fmt: skip
            if len(inside) < 2 or inside[-1][0] == inside[0][0]:
                cells.append("-")
                continue
            rate = 60 * (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])
            cells.append(f"{rate:.0f}")
        rows.append((region, *cells))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"run": run, "tokens": args.tokens, "killed_s": killed, "restarted_s": back,
              "launcher": final, "rows": rows, "samples": samples}  # fmt: skip
    (out / "results.json").write_text(json.dumps(result, indent=1))
    table = "\n".join(f"| {r} | {b} | {d} | {a} |" for r, b, d, a in rows)
    (out / "results.md").write_text(
        f"# Isolation: the home region's Prefect worker killed for {args.down:g} s\n\n"
        f"`python bench/isolation/run.py --tokens {args.tokens} --kill-at {args.kill_at} "
        f"--down {args.down:g}` on {machine()}.\n\n"
        f"Killed at {killed or 0:.0f} s, "
        + (f"a new worker at {back:.0f} s" if back else "the run ended before a new worker")
        + f"; the launcher's flow run (a flow run of the killed worker) ended **{final}**.\n\n"
        "Inner steps trained per minute by each region's learners (their status objects, "
        "read every second):\n\n"
        "| region | before | during the outage | after |\n|---|---|---|---|\n" + table + "\n"
    )
    print((out / "results.md").read_text())
    return 0 if final == "Completed" else 1


if __name__ == "__main__":
    sys.exit(main())
