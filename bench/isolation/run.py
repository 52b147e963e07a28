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

``--machine``: the home region's machine dies instead: the worker and every flow run it
started (the launcher, the region's learners and syncers) are SIGKILLed. Their flow runs
stop beating; Prefect's zombie detection sets them Crashed, and the automation that runs
a crashed launcher again starts a new ``train/us-east`` flow run (``infra.automations``),
which takes the run over once a new worker is up. Reported: when the old launcher was
Crashed, when the new one ran, and the run's end.

    python bench/isolation/run.py [--tokens 1500000] [--kill-at 0.3] [--down 60]
        [--machine] [--out bench/isolation]
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
    from protocol.topology import run_slots
    from storage_layout.store import RunStore

    store = RunStore(run, local_stack.REGIONS, "us-east", writer="bench")
    out: dict[str, int] = {}
    for lid, region in run_slots(store.read_spec()).items():
        status = store.progress.read_metrics(lid, region) or {}
        out[region] = out.get(region, 0) + int(status.get("step") or 0)
    return out


def launchers(run: str) -> list[tuple[str, str]]:
    """The run's launcher flow runs, oldest first: (id, state name)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.client.schemas.sorting import FlowRunSort

    tags = FlowRunFilterTags(all_=[f"run:{run}", "launcher"])
    with get_client(sync_client=True) as client:
        found = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=tags),
                                      sort=FlowRunSort.EXPECTED_START_TIME_ASC)  # fmt: skip
    return [(str(f.id), f.state.name if f.state else "?") for f in found]


def kill_machine(worker: int) -> int:
    """SIGKILL ``worker`` and every process under it (its flow runs): a machine lost."""
    import psutil

    procs = [*psutil.Process(worker).children(recursive=True), psutil.Process(worker)]
    for proc in procs:
        proc.kill()
    return len(procs)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1_500_000)
    parser.add_argument("--kill-at", type=float, default=0.3)
    parser.add_argument("--down", type=float, default=60.0)
    parser.add_argument(
        "--machine", action="store_true", help="kill the worker's flow runs too (the machine died)"
    )
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
        print(f"the launcher: flow run {flow_run_id} of train/us-east", flush=True)
        budget_steps = None
        killed = back = None
        events: dict[str, float] = {}  # what happened to the launchers, when
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
                if args.machine:
                    n = kill_machine(state["pids"]["worker-us-east"])
                    what = f"the us-east machine (its worker and {n - 1} flow run processes)"
                else:
                    os.kill(state["pids"]["worker-us-east"], signal.SIGKILL)
                    what = "the us-east worker"
                killed = now - t0
                print(f"{killed:.0f} s: killed {what} at {steps}", flush=True)
            if killed is not None and back is None and now - t0 >= killed + args.down:
                state["pids"]["worker-us-east"] = local_stack._spawn(
                    "worker-us-east", [sys.executable, "-m", "prefect", "worker", "start",
                                       "--pool", "us-east", "--type", "process"], env)  # fmt: skip
                local_stack._save(state)
                back = now - t0
                print(f"{back:.0f} s: a new us-east worker started", flush=True)
            seen = launchers(run)
            for i, (_, name) in enumerate(seen):
                if f"{i}:{name}" not in events:
                    events[f"{i}:{name}"] = now - t0
                    print(f"{now - t0:.0f} s: launcher flow run {i} is {name}", flush=True)
            final = seen[-1][1] if seen else "?"
            done = final in ("Completed", "Failed", "Cancelled") or (
                final == "Crashed" and not args.machine
            )
            if done or now - t0 > 3600:
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
              "machine": args.machine, "launcher": final, "launchers": events, "rows": rows,
              "samples": samples}  # fmt: skip
    (out / f"results-{'machine' if args.machine else 'worker'}.json").write_text(
        json.dumps(result, indent=1)
    )
    table = "\n".join(f"| {r} | {b} | {d} | {a} |" for r, b, d, a in rows)
    name = "machine" if args.machine else "worker"
    history = ", ".join(f"flow run {k.split(':')[0]} {k.split(':')[1]} at {t:.0f} s"
                        for k, t in events.items())  # fmt: skip
    (out / f"results-{name}.md").write_text(
        f"# Isolation: the home region's {'machine' if args.machine else 'Prefect worker'} "
        f"killed, a new one {args.down:g} s later\n\n"
        f"`python bench/isolation/run.py --tokens {args.tokens} --kill-at {args.kill_at} "
        f"--down {args.down:g}{' --machine' if args.machine else ''}` on {machine()}.\n\n"
        f"Killed at {killed or 0:.0f} s, "
        + (f"a new worker at {back:.0f} s" if back else "the run ended before a new worker")
        + f"; the run's last launcher flow run ended **{final}** (launchers: {history}).\n\n"
        "Inner steps trained per minute by each region's learners (their status objects, "
        "read every second):\n\n"
        "| region | before | during the outage | after |\n|---|---|---|---|\n" + table + "\n"
    )
    print((out / f"results-{name}.md").read_text())
    return 0 if final == "Completed" else 1


if __name__ == "__main__":
    sys.exit(main())
