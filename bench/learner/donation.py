"""What a train step holds at its peak, with and without donating the state it is given.

``InnerTrainer.step`` donates the parameters and the AdamW state (``donate_argnums``):
the step writes the new ones into the old ones' buffers. Without it the step holds both
for a moment, 12 bytes a parameter more (4 for the parameters, 8 for the two moments).
A checkpoint being written while training goes on holds a copy of the optimizer state
(``Learner.checkpoint``); without donation it held the old state instead, alive beside
the step's new one.

Each case runs in a fresh process on one device: the preset's model, two compiled train
steps (the second measured as well as the first), and the process's peak resident memory
(``ru_maxrss``; on a GPU also the allocator's peak, ``memory_stats``). Cases:

- ``donated``: the learner's step as it is;
- ``kept``: the same step compiled without donation (the code before ``donate_argnums``);
- ``donated+checkpoint`` / ``kept+checkpoint``: the same, with a checkpoint of the state
  before the steps in flight across both (a device copy, as ``Learner.checkpoint`` takes;
  or, kept, the old state itself).

    python bench/learner/donation.py [--preset llama-150m] [--batch 1] [--context 256]

Writes ``donation.md`` and ``donation.json`` into ``--out`` (this folder by default).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

CASES = ("kept", "donated", "kept+checkpoint", "donated+checkpoint")


def measure(preset: str, batch: int, context: int, case: str) -> dict:
    """One case in this process (see the module docstring)."""
    import jax
    import numpy as np

    from diloco.config import load_config
    from diloco.inner import InnerTrainer, own
    from diloco.model import ParamCodec

    cfg = load_config(preset, overrides=[f"data.batch_size={batch}", f"model.context={context}"])
    codec, state = ParamCodec.create(cfg.model, 0)
    trainer = InnerTrainer(codec, cfg.inner, 100, jax.devices()[:1])
    if case.startswith("kept"):  # the step as it was compiled before donation
        trainer._train_step = jax.jit(trainer._train_step.__wrapped__)
    params = trainer.place_params(codec.to_flat(state))
    del state
    opt = trainer.init_opt_state(params)
    jax.block_until_ready((params, opt))
    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rng = np.random.default_rng(0)
    batch_ids = rng.integers(0, cfg.model.vocab_size, (batch, context + 1)).astype(np.int32)
    held = None  # what a checkpoint of the state before the steps holds while it is written
    if case.endswith("+checkpoint"):
        held = jax.tree.map(own, opt) if case.startswith("donated") else opt
    for _ in range(2):
        params, opt, loss = trainer.step(params, opt, batch_ids, 1.0)
        jax.block_until_ready((params, opt, held))
    float(loss)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    stats = jax.devices()[0].memory_stats() or {}
    return {
        "preset": preset,
        "batch": batch,
        "context": context,
        "case": case,
        "params": codec.num_params,
        "state_bytes": 12 * codec.num_params,  # parameters and AdamW's two moments, fp32
        "host_peak_bytes": peak,
        "host_before_steps_bytes": start,
        "device_peak_bytes": stats.get("peak_bytes_in_use"),
        "platform": jax.default_backend(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama-150m")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    ap.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # one case, in-process
    args = ap.parse_args()
    if args.case:
        print(json.dumps(measure(args.preset, args.batch, args.context, args.case)))
        return
    from bench.machine import machine

    rows = []
    for case in CASES:
        cmd = [sys.executable, __file__, "--preset", args.preset, "--batch", str(args.batch),
               "--context", str(args.context), "--case", case]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    gb = lambda b: f"{b / 1e9:.2f}" if b is not None else "-"  # noqa: E731
    base = {r["case"]: r["host_peak_bytes"] for r in rows}
    lines = [
        "# A train step's peak memory, with and without donating its state",
        "",
        f"Command: `python bench/learner/donation.py --preset {args.preset} --batch "
        f"{args.batch} --context {args.context}`",
        f"Machine: {machine()}",
        "",
        f"{rows[0]['preset']}, {rows[0]['params'] / 1e6:.1f} M parameters (state: "
        f"{gb(rows[0]['state_bytes'])} GB of fp32 parameters and AdamW moments), batch "
        f"{args.batch} x {args.context} tokens, one {rows[0]['platform']} device.",
        "",
        "| case | peak resident GB | before the steps GB | device peak GB | vs kept |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        ref = base["kept+checkpoint" if r["case"].endswith("checkpoint") else "kept"]
        lines.append(
            f"| {r['case']} | {gb(r['host_peak_bytes'])} | {gb(r['host_before_steps_bytes'])} "
            f"| {gb(r['device_peak_bytes'])} | {(r['host_peak_bytes'] - ref) / 1e9:+.2f} GB "
            f"({(r['host_peak_bytes'] - ref) / r['params']:+.1f} B/param) |"
        )
    (args.out / "donation.md").write_text("\n".join(lines) + "\n")
    (args.out / "donation.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
