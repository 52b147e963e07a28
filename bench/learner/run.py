"""The learner's own throughput on CPU: the pipeline's learner against a bare loop.

Each measurement is its own process, one after the other (never side by side):

- ``bare``: a jitted train loop of the preset's model and batch, nothing else (the
  trainer and batch reader the learner uses, ``flows.run.build_model`` / ``reader``);
- ``learner``: the pipeline's learner, a ``LearnerRuntime`` (``flows/learner.py``) in
  a run of one learner over a ``file://`` bucket, rounds of ``pipeline.round_steps``
  steps with everything a round does: fragments' outer gradients quantized and
  uploaded in the background, checkpoints, the round history, status objects. No
  syncer runs, so no version arrives: what is measured is the learner alone.

tokens/s of the learner's rounds (after the first, which compiles) over the bare
loop's, the median of ``--repeats`` alternating pairs (the machine is shared), and each
process's peak resident memory against ``diloco.memory``'s estimate.

    python bench/learner/run.py [--preset llama-tiny] [--steps 300] [--repeats 3]

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

COMMON = """
import json, resource, sys, time
from diloco.config import load_config
preset, steps, folder = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ROUND = 50
tokens = (steps + 2 * ROUND) * load_config(preset).tokens_per_step  # the learner's share
cfg = load_config(preset, overrides=["topology.learners=1", "budget.shared=false",
    f"budget.tokens={tokens}", f"pipeline.round_steps={ROUND}",
    f"pipeline.checkpoint_every={ROUND}"])
def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
"""

BARE = (
    COMMON
    + """
from flows.run import build_model, reader
model = build_model(cfg)
trainer, r = model.trainer, reader(cfg, 0)
params = trainer.place_params(model.init)
opt = trainer.init_opt_state(params)
for i in range(ROUND):  # as the learner's first round: compile and warm up
    params, opt, loss = trainer.step(params, opt, r.next_batch(), i)
loss.block_until_ready()
start = time.perf_counter()
for i in range(steps):
    params, opt, loss = trainer.step(params, opt, r.next_batch(), ROUND + i)
loss.block_until_ready()
seconds = time.perf_counter() - start
print(json.dumps({"tokens_per_s": steps * cfg.tokens_per_step / seconds, "peak": peak(),
                  "params": model.codec.num_params, "loss": float(loss)}))
"""
)

LEARNER = (
    COMMON
    + """
from flows.learner import LearnerRuntime
from flows.run import initialize_run
from storage_layout.store import RunStore
regions = {"us": "file://" + folder}
spec = initialize_run(RunStore("bench", regions, "us", writer="launcher"), cfg)
lid = next(iter(spec["learners"]))
rt = LearnerRuntime("bench", regions["us"], "us", lid, cfg.pipeline.model_dump())
rows = []
while not rt.finished and sum(r["steps"] for r in rows[1:]) < steps:
    rows.append(rt.train_round())
rt.checkpoint(wait=True)
rt.close()
timed = rows[1:]
tokens = sum(r["steps"] for r in timed) * cfg.tokens_per_step
seconds = sum(r["seconds"] for r in timed)
print(json.dumps({"tokens_per_s": tokens / seconds, "peak": peak(), "rounds": len(timed),
                  "sent": sum(r["sent"] for r in timed), "loss": timed[-1]["loss"]}))
"""
)


def measure(code: str, preset: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = subprocess.run([sys.executable, "-c", code, preset, str(steps), folder], cwd=ROOT,
                             capture_output=True, text=True)  # fmt: skip
    if out.returncode:
        raise RuntimeError(f"measurement failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="llama-tiny")
    parser.add_argument("--steps", type=int, default=300, help="timed steps per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="alternating pairs")
    args = parser.parse_args()

    from diloco.config import load_config
    from diloco.memory import learner_memory, param_count

    pairs = []
    for i in range(args.repeats):
        bare = measure(BARE, args.preset, args.steps)
        learner = measure(LEARNER, args.preset, args.steps)
        pairs.append({"bare": bare, "learner": learner,
                      "ratio": learner["tokens_per_s"] / bare["tokens_per_s"]})  # fmt: skip
        print(f"pair {i + 1}: bare {bare['tokens_per_s']:,.0f} tokens/s, learner "
              f"{learner['tokens_per_s']:,.0f} tokens/s, ratio {pairs[-1]['ratio']:.3f}",
              flush=True)  # fmt: skip
    cfg = load_config(args.preset)
    estimate = learner_memory(cfg, param_count(cfg.model)).total
    ratio = statistics.median(p["ratio"] for p in pairs)
    result = {
        "command": " ".join(["python bench/learner/run.py", *sys.argv[1:]]),
        "machine": machine(),
        "preset": args.preset,
        "params": pairs[0]["bare"]["params"],
        "batch": f"{cfg.data.batch_size} x {cfg.model.context}",
        "steps": args.steps,
        "pairs": pairs,
        "ratio_median": ratio,
        "estimate_bytes": estimate,
    }
    here = Path(__file__).parent
    (here / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    med = {k: statistics.median(p[k]["tokens_per_s"] for p in pairs) for k in ("bare", "learner")}
    peaks = {k: max(p[k]["peak"] for p in pairs) for k in ("bare", "learner")}
    rows = "\n".join(
        f"| {i + 1} | {p['bare']['tokens_per_s']:,.0f} | {p['learner']['tokens_per_s']:,.0f} | "
        f"{p['ratio']:.3f} | {p['learner']['rounds']} rounds, {p['learner']['sent']} sends |"
        for i, p in enumerate(pairs)
    )
    (here / "results.md").write_text(f"""# Learner throughput (CPU)

Command: `{result["command"]}`
Machine: {result["machine"]}, shared with other work while it ran
Model: preset `{args.preset}` ({result["params"]:,} parameters), batch {result["batch"]}
tokens, {args.steps} timed steps per measurement, one process at a time.

The pipeline's learner (`LearnerRuntime` rounds of 50 steps over a `file://` bucket,
after its first round: outer gradients of its fragments quantized and uploaded in the
background, checkpoints, history and status objects) against a bare jitted loop of the
same trainer, model and batch (after as many warm-up steps), alternating.

| pair | bare loop tokens/s | learner tokens/s | learner / bare | learner did |
|---|---|---|---|---|
{rows}

| metric | value | target |
|---|---|---|
| bare loop (median) | {med["bare"]:,.0f} tokens/s | |
| learner (median) | {med["learner"]:,.0f} tokens/s | |
| learner / bare (median of pairs) | **{ratio:.3f}** | >= 0.97 |
| peak resident memory, bare loop | {peaks["bare"] / 1e9:.2f} GB | |
| peak resident memory, learner process | {peaks["learner"] / 1e9:.2f} GB | |
| estimate (`diloco/memory.py`, one learner) | {estimate / 1e9:.2f} GB | |
""")
    print((here / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
