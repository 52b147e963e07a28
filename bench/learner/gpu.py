"""The learner on one GPU: tokens/s, model FLOP utilisation and memory, per preset.

For each configuration (a preset, its batch, remat, the attention kernel), in a fresh
process on one device, both after a warm-up that compiles everything they run:

- ``bare``: a jitted train loop, ``InnerTrainer.step`` of the preset's model on its own
  parameters and AdamW state, nothing else;
- ``learner``: the pipeline's learner loop (``diloco.learner_loop.LearnerLoop`` driving a
  ``diloco.learner.Learner`` on the wall clock), with everything it does on the device:
  when a fragment is due, its outer gradient taken and quantized where the parameters
  live and the codes brought to the host; tau steps later, the answer (a global version
  of the fragment, host arrays) placed and applied. Its transport keeps the sends in
  memory and answers each at once, as a syncer next door would. The bucket I/O (uploads
  and checkpoints, in background threads) is not here: ``bench/scale`` measures it, and
  ``bench/learner/run.py`` the whole learner over a bucket on CPU.

MFU: model FLOPs per token (``diloco.memory.model_flops_per_token``: ``6 N + 12 L d T``,
N the parameters of the matmuls, the output head included, the embedding lookup not;
remat's recomputation is not counted), times tokens/s, over the device's
dense bf16 peak from its datasheet. Beside it, the rate of a large bf16 matrix product
measured on the same device, the practical ceiling. Memory: the device allocator's peak
(``memory_stats``), against ``diloco.memory``'s estimate for one device.

    python bench/learner/gpu.py [--configs llama-150m:16 llama-1b:8] [--steps 30]

A configuration is ``PRESET:BATCH[:remat|:noremat][:auto|:xla|:cudnn][:spill]``; the
preset's own values where left out. ``spill``: the answers are read from local files
tensor by tensor (``SpilledParams``), as a pipeline learner holds its global versions,
not from host arrays. ``host_peak_bytes`` is the process's peak resident memory. Writes ``results-gpu.md`` and ``results-gpu.json`` into
``--out`` (by default ``bench-learner-gpu`` in the temporary folder: this folder's
results-gpu.md is several runs' tables merged by hand, with what was learned from them),
after each configuration, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# Dense bf16 peak, FLOP/s, by the vendor's datasheet (SXM parts), keyed by the start of
# jax's device_kind.
PEAKS = {"NVIDIA H100": 989.4e12, "NVIDIA H200": 989.4e12, "NVIDIA A100": 312e12}


def parse(spec: str) -> tuple[str, list[str]]:
    """``PRESET:BATCH[:remat|:noremat][:auto|:xla|:cudnn]`` -> (preset, overrides)."""
    preset, *rest = spec.split(":")
    overrides = []
    for part in rest:
        if part == "spill":
            continue  # measure_one's
        if part.isdigit():
            overrides.append(f"data.batch_size={part}")
        elif part in ("remat", "noremat"):
            overrides.append(f"model.remat={'true' if part == 'remat' else 'false'}")
        elif part in ("auto", "xla", "cudnn"):
            overrides.append(f"model.attention={part}")
        else:
            raise SystemExit(f"configuration {spec!r}: {part!r} is not a batch, remat or kernel")
    return preset, overrides


class Batches:
    """A reader of random tokens (a few batches made once, cycled): the data loader's
    own speed is ``bench/learner/loader.py``'s."""

    def __init__(self, batch_size: int, context: int, vocab: int, seed: int = 0):
        import numpy as np

        rng = np.random.default_rng(seed)
        self.batch_size, self.context, self.position = batch_size, context, 0
        self.batches = [
            rng.integers(0, vocab, (batch_size, context + 1), dtype=np.int32) for _ in range(4)
        ]

    def next_batch(self):
        self.position += 1
        return self.batches[self.position % len(self.batches)]


class Echo:
    """A ``LearnerTransport`` that keeps each send in memory (its size only) and answers
    it at once with a new global version of the fragment: the host arrays it was given."""

    def __init__(self, globals_):
        self.globals = dict(globals_)
        self.sent = 0
        self.sent_bytes = 0

    def send(self, c) -> None:
        from diloco.loops import GlobalView

        self.sent += 1
        self.sent_bytes += sum(q.nbytes for q in c.payload.values())
        old = self.globals[c.fragment]
        self.globals[c.fragment] = GlobalView(c.fragment, old.version + 1, old.params)

    def want(self, fragment: int, above: int) -> None:
        pass

    def backed_up(self) -> bool:
        return False

    def latest_global(self, fragment: int):
        return self.globals[fragment]

    def save_checkpoint(self, ckpt) -> None:
        pass

    def load_checkpoint(self):
        return None

    def sent_so_far(self) -> tuple[int, int]:
        return 0, 0


def matmul_rate(n: int = 8192, repeats: int = 20) -> float:
    """FLOP/s of an ``n``-cubed bf16 matrix product on the default device (random data)."""
    import jax
    import jax.numpy as jnp

    a, b = (jax.random.normal(jax.random.key(i), (n, n), jnp.bfloat16) for i in (1, 2))
    f = jax.jit(lambda a, b: a @ b)
    f(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f(a, b).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times)


def device_facts() -> dict:
    """The device, the jax version, the datasheet peak and a measured matmul rate."""
    import jax

    kind = jax.devices()[0].device_kind
    return {
        "device": kind,
        "jax": jax.__version__,
        "matmul_flops": matmul_rate() if jax.default_backend() == "gpu" else None,
        "peak_flops": next((v for k, v in PEAKS.items() if kind.startswith(k)), None),
    }


def measure_one(spec: str, steps: int) -> dict:
    """One configuration, in this process: the bare loop, then the learner loop."""
    import jax
    import numpy as np

    from diloco.config import load_config
    from diloco.fragments import plan_fragments
    from diloco.inner import InnerTrainer
    from diloco.learner import Learner
    from diloco.learner_loop import LearnerLoop
    from diloco.loops import STEP, GlobalView, WallClock
    from diloco.memory import learner_memory, model_flops_per_token
    from diloco.model import ParamCodec
    from storage_layout.spill import SpilledParams

    preset, overrides = parse(spec)
    spill = "spill" in spec.split(":")[1:]
    cfg = load_config(preset, overrides=overrides)
    m, topo = cfg.model, cfg.topology
    device = jax.devices()[0]
    started = time.perf_counter()
    codec, state = ParamCodec.create(m, cfg.seed)
    init = codec.to_flat(state)
    del state
    plan = plan_fragments(codec.sizes, topo.fragments, topo.fragment_strategy)
    trainer = InnerTrainer(codec, cfg.inner, cfg.steps_per_learner, devices=[device])
    tokens = cfg.data.batch_size * m.context
    built = time.perf_counter() - started

    def peak() -> int | None:
        stats = device.memory_stats() or {}
        return stats.get("peak_bytes_in_use")

    # The bare loop: compile and warm up on 3 steps, then time ``steps``.
    shape = (cfg.data.batch_size, m.context, m.vocab_size)
    reader = Batches(*shape)
    params = trainer.place_params(init)
    opt = trainer.init_opt_state(params)
    started = time.perf_counter()
    for i in range(3):
        params, opt, loss = trainer.step(params, opt, reader.next_batch(), i)
    loss.block_until_ready()
    compile_s = time.perf_counter() - started
    started = time.perf_counter()
    for i in range(steps):
        params, opt, loss = trainer.step(params, opt, reader.next_batch(), 3 + i)
    first_loss = float(loss)
    bare_s = time.perf_counter() - started
    bare_peak = peak()
    del params, opt, loss

    # The learner loop: ``steps``, or more to hold a send and its answer, after a
    # warm-up that sends every fragment and applies its answer once (compiling each
    # tensor's outer gradient, quantization and blend).
    if spill:  # each fragment in a local file, read back tensor by tensor when applied
        folder = tempfile.mkdtemp(prefix="gpu-bench-views-")
        views = {
            p: GlobalView(p, 0, SpilledParams.write(f"{folder}/f{p}.f32",
                                                    ((n, init[n]) for n in names)))
            for p, names in enumerate(plan)
        }  # fmt: skip
    else:
        views = {
            p: GlobalView(p, 0, {n: np.asarray(init[n], np.float32) for n in names})
            for p, names in enumerate(plan)
        }
    echo = Echo(views)
    learner = Learner("bench", trainer, plan, topo, init, Batches(*shape))
    loop = LearnerLoop(learner, cfg, echo, WallClock())
    for request in loop.run(1):
        assert request is STEP  # the echo never makes it wait
    for p in range(len(plan)):
        loop.send(p, loop.losses[-1])
    for request in loop.run(topo.tau + 1):  # each answer applied, tau steps on
        assert request is STEP
    assert all(f.base_version == 1 for f in learner.fragments), "warm-up applied no answer"
    jax.block_until_ready(learner.params)
    cadence = max(1, topo.inner_steps // len(plan))
    sends_before, bytes_before = echo.sent, echo.sent_bytes
    timed = max(steps, cadence + topo.tau + 1)  # a send and its answer at least
    started = time.perf_counter()
    for request in loop.run(timed):
        assert request is STEP
    jax.block_until_ready((learner.params, learner.opt_state))
    learner_s = time.perf_counter() - started
    losses = [float(x) for x in loop.losses]

    flops = model_flops_per_token(m)
    peak_flops = next((v for k, v in PEAKS.items() if device.device_kind.startswith(k)), None)
    bare_tps, learner_tps = steps * tokens / bare_s, timed * tokens / learner_s
    return {
        "config": spec,
        "preset": preset,
        "device": device.device_kind,
        "platform": device.platform,
        "jax": jax.__version__,
        "params": codec.num_params,
        "batch": cfg.data.batch_size,
        "context": m.context,
        "remat": m.remat,
        "attention": m.attention_kernel(jax.default_backend()),
        "build_seconds": built,
        "compile_seconds": compile_s,
        "bare_steps": steps,
        "bare_step_seconds": bare_s / steps,
        "bare_tokens_per_s": bare_tps,
        "learner_steps": timed,
        "learner_step_seconds": learner_s / timed,
        "learner_tokens_per_s": learner_tps,
        "learner_over_bare": learner_tps / bare_tps,
        "sends": echo.sent - sends_before,
        "send_bytes": echo.sent_bytes - bytes_before,
        "loss_first_last": [first_loss, losses[-1] if losses else None],
        "model_flops_per_token": flops,
        "peak_flops": peak_flops,
        "mfu_bare": bare_tps * flops / peak_flops if peak_flops else None,
        "mfu_learner": learner_tps * flops / peak_flops if peak_flops else None,
        "peak_bytes_bare": bare_peak,
        "peak_bytes": peak(),
        "spill": spill,
        "host_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "estimate_bytes": learner_memory(cfg, codec.num_params, platform=device.platform).total,
    }


def table(rows: list[dict], ceiling: float | None) -> str:
    head = (
        "| config | params | attention | tokens/s bare | tokens/s learner | learner / bare "
        "| MFU bare | MFU learner | of the matmul rate | step (s) | peak memory | estimate "
        "| host peak |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | failed: {r['error']} |" + " |" * 11)
            continue
        pct = lambda x: f"{100 * x:.1f} %" if x is not None else "n/a"  # noqa: E731
        of_ceiling = (
            r["learner_tokens_per_s"] * r["model_flops_per_token"] / ceiling if ceiling else None
        )
        gb = lambda b: f"{b / 1e9:.1f} GB" if b else "n/a"  # noqa: E731
        lines.append(
            f"| {r['config']} | {r['params'] / 1e6:,.0f} M | {r['attention']} "
            f"| {r['bare_tokens_per_s']:,.0f} | {r['learner_tokens_per_s']:,.0f} "
            f"| {r['learner_over_bare']:.3f} | {pct(r['mfu_bare'])} | **{pct(r['mfu_learner'])}** "
            f"| {pct(of_ceiling)} | {r['learner_step_seconds']:.3f} | {gb(r['peak_bytes'])} "
            f"| {gb(r['estimate_bytes'])} | {gb(r.get('host_peak_bytes'))} |"
        )
    return head + "\n".join(lines) + "\n"


def write(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results-gpu.json").write_text(json.dumps(result, indent=1) + "\n")
    rows = result["rows"]
    device = result.get("device", "unknown device")
    ceiling = result.get("matmul_flops")
    (out / "results-gpu.md").write_text(f"""# The learner on one GPU

Command: `{result["command"]}`
Device: {device}, one GPU; jax {result.get("jax", "?")}; code at {result.get("commit", "?")}
Measured bf16 matrix product (8192 cubed, random data): {(ceiling or 0) / 1e12:,.0f} TFLOP/s;
datasheet dense bf16 peak used for MFU: {(result.get("peak_flops") or 0) / 1e12:,.1f} TFLOP/s.

Configurations are `PRESET:BATCH[:remat|:noremat][:attention kernel]`. The learner is
the pipeline's learner loop on the device (sends quantized on the device, answers
applied), without bucket I/O; `bench/learner/gpu.py` says what each column is.

{table(rows, ceiling)}""")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=["llama-150m:16", "llama-1b:8"])
    parser.add_argument("--steps", type=int, default=30, help="timed steps of the bare loop")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per configuration")
    parser.add_argument("--out", type=Path,
                        default=Path(tempfile.gettempdir()) / "bench-learner-gpu")  # fmt: skip
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        got = device_facts() if args.one == "device" else measure_one(args.one, args.steps)
        print(json.dumps(got), flush=True)
        return 0

    def child(spec: str) -> dict:
        """``--one spec`` in a fresh process: its memory peak is its own, and the GPU is
        free for the next one when it ends."""
        cmd = [sys.executable, __file__, "--one", spec, "--steps", str(args.steps)]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return {"config": spec, "error": f"not done in {args.timeout:.0f} s"}
        if out.returncode:
            print(out.stderr[-4000:], file=sys.stderr)
            last = out.stderr.strip().splitlines()[-1:] or [f"exit {out.returncode}"]
            return {"config": spec, "error": last[0][:300]}
        return json.loads(out.stdout.strip().splitlines()[-1])

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    facts = child("device")
    result = {
        "command": " ".join(["python bench/learner/gpu.py", *sys.argv[1:]]),
        "commit": commit or None,
        **facts,
        "rows": [],
    }
    for spec in args.configs:
        row = child(spec)
        print(json.dumps(row), flush=True)
        result["rows"].append(row)
        write(args.out, result)
    print((args.out / "results-gpu.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
