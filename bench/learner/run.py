"""The learner's own throughput on CPU: the pipeline's learner against a bare loop.

In one process, segment by segment, alternating (so that whatever else the shared
machine runs slows both alike):

- ``learner``: a round of the pipeline's learner, a ``LearnerRuntime``
  (``flows/learner.py``) in a run of one learner over a ``file://`` bucket:
  ``pipeline.round_steps`` (50) steps with everything a round does, the fragments'
  outer gradients quantized and uploaded in the background, checkpoints, the round
  history, status objects. No syncer runs, so no version arrives: what is measured is
  the learner alone;
- ``bare``: as many steps of a jitted train loop of the same trainer, model and batch
  reader (``flows.run.build_model`` / ``RunData.reader``), its own parameters and optimizer
  state, nothing else.

Both after a first round and a first bare segment (compiling, warming up). Reported:
each pair's ratio (learner / the bare segment before it), their median, the ratio of
the two fastest segments (the least disturbed), and the process's peak resident memory
against ``diloco.memory``'s estimate.

    python bench/learner/run.py [--preset llama-tiny] [--pairs 12]

Writes ``bench/learner/results.md`` and ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.machine import machine  # noqa: E402

SCRIPT = """
import json, resource, sys, time
from diloco.config import load_config
from protocol.topology import run_slots
from flows.learner_runtime import LearnerRuntime
from diloco.run_data import RunData
from flows.run import build_model, initialize_run
from storage_layout.store import RunStore
preset, pairs, folder = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ROUND = 50
tokens = (pairs + 3) * ROUND * load_config(preset).tokens_per_step  # the learner's share
cfg = load_config(preset, overrides=["topology.learners=1", "budget.shared=false",
    f"budget.tokens={tokens}", f"pipeline.round_steps={ROUND}",
    f"pipeline.checkpoint_every={ROUND}"])
regions = {"us": "file://" + folder}
spec = initialize_run(RunStore("bench", regions, "us", writer="launcher"), cfg)
lid = next(iter(run_slots(spec)))
rt = LearnerRuntime("bench", regions["us"], "us", lid, cfg.pipeline.model_dump())
model = build_model(cfg, learner=True)
trainer, r = model.trainer, RunData(cfg).reader(0)
params = trainer.place_params(model.init)
opt = trainer.init_opt_state(params)
step = 0

def bare():
    global params, opt, step
    start = time.perf_counter()
    for _ in range(ROUND):
        params, opt, loss = trainer.step(params, opt, r.next_batch(), step)
        step += 1
    loss.block_until_ready()
    return ROUND * cfg.tokens_per_step / (time.perf_counter() - start)

bare()
rt.train_round()
out = []
for _ in range(pairs):
    b = bare()
    row = rt.train_round()
    out.append({"bare": b, "learner": row["steps"] * cfg.tokens_per_step / row["seconds"],
                "sent": row["sent"]})
rt.checkpoint(wait=True)
rt.close()
print(json.dumps({"pairs": out, "params": model.codec.num_params,
                  "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def measure(preset: str, pairs: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = subprocess.run([sys.executable, "-c", SCRIPT, preset, str(pairs), folder],
                             cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    if out.returncode:
        raise RuntimeError(f"measurement failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="llama-tiny")
    parser.add_argument("--pairs", type=int, default=12, help="learner rounds timed")
    args = parser.parse_args()

    from diloco.config import load_config
    from diloco.memory import learner_memory, param_count

    got = measure(args.preset, args.pairs)
    pairs = got["pairs"]
    for p in pairs:
        p["ratio"] = p["learner"] / p["bare"]
    cfg = load_config(args.preset)
    estimate = learner_memory(cfg, param_count(cfg.model), platform="cpu").total
    ratio = statistics.median(p["ratio"] for p in pairs)
    best = {k: max(p[k] for p in pairs) for k in ("bare", "learner")}
    med = {k: statistics.median(p[k] for p in pairs) for k in ("bare", "learner")}
    result = {
        "command": " ".join(["python bench/learner/run.py", *sys.argv[1:]]),
        "machine": machine(),
        "preset": args.preset,
        "params": got["params"],
        "batch": f"{cfg.data.batch_size} x {cfg.model.context}",
        "pairs": pairs,
        "ratio_median": ratio,
        "ratio_fastest": best["learner"] / best["bare"],
        "peak_bytes": got["peak"],
        "estimate_bytes": estimate,
    }
    here = Path(__file__).parent
    (here / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    rows = "\n".join(
        f"| {i + 1} | {p['bare']:,.0f} | {p['learner']:,.0f} | {p['ratio']:.3f} | {p['sent']} |"
        for i, p in enumerate(pairs)
    )
    (here / "results.md").write_text(f"""# Learner throughput (CPU)

Command: `{result["command"]}`
Machine: {result["machine"]}; shared with other engineers' tests while it ran
Model: preset `{args.preset}` ({result["params"]:,} parameters), batch {result["batch"]}
tokens, 50 steps per segment.

The pipeline's learner (a `LearnerRuntime` round over a `file://` bucket: outer
gradients of its fragments quantized and uploaded in the background, checkpoints,
history and status objects) against a bare jitted loop of the same trainer, model and
batch, alternating segment by segment in one process (`bench/learner/run.py` says
why).

| pair | bare loop tokens/s | learner round tokens/s | learner / bare | sends in the round |
|---|---|---|---|---|
{rows}

| metric | value | target |
|---|---|---|
| bare loop (median / fastest segment) | {med["bare"]:,.0f} / {best["bare"]:,.0f} tokens/s | |
| learner (median / fastest round) | {med["learner"]:,.0f} / {best["learner"]:,.0f} tokens/s | |
| learner / bare, median of the pairs | **{ratio:.3f}** | >= 0.97 |
| learner / bare, fastest against fastest | **{result["ratio_fastest"]:.3f}** | >= 0.97 |
| peak resident memory of the process | {got["peak"] / 1e9:.2f} GB | |
| estimate (`diloco/memory.py`, one learner) | {estimate / 1e9:.2f} GB | |
""")
    print((here / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
