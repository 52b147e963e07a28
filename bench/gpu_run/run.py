"""Several learners trained end to end on one GPU, against data-parallel, in one call.

    python bench/gpu_run/run.py [--cpu] [--minutes 9] [--out DIR] [--tokens N]

One command, in the order a user would do it:

1. ``diloco data prepare`` on text present on any machine (packages of the Python
   standard library's source) into a BPE data set;
2. ``diloco train``: ``--learners`` learners (4) sharing the device, 2 syncer shards, 2
   regions on ``file://`` buckets, a Llama preset (``llama-150m`` at context 1024 on a
   GPU; ``llama-tiny`` with ``--cpu``). Each process may take a fifth of the device's
   memory as it needs it (``XLA_PYTHON_CLIENT_MEM_FRACTION=0.2``, no preallocation), so
   four learners and the launcher's evaluation share one card;
3. ``diloco simulate --mode dp`` of the same model, data and tokens, alone on the device;
4. one table (``results.md`` and ``results.json`` in ``--out``): validation loss of
   each and their ratio, tokens/s (merged, and each learner's) and MFU against the
   device's datasheet peak, goodput, bytes moved and the ratio to dp's, the device's peak
   memory in use (sampled with ``nvidia-smi``), wall time, the device's name.

It stops itself within ``--minutes`` (each phase gets what is left, less a reserve for
the next), and writes the table after each phase: a run cut short keeps what it measured,
and says what was cut. ``--cpu`` runs the same path on CPUs with the tiny preset
(``tests/test_gpu_run.py`` runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.learner.gpu import PEAKS  # noqa: E402  (the datasheets' dense bf16 peaks)
from bench.machine import machine  # noqa: E402

# The standard library's source the data set is made of: all of it on a GPU (about 30 MB
# of text, some 9 M tokens), two packages on CPUs (about 230 kB).
TEXT = {"gpu": ("",), "cpu": ("json", "logging")}
CHUNK = {"gpu": 65536, "cpu": 2048}  # tokens per chunk (a data unit is 4)
PRESET = {"gpu": "llama-150m", "cpu": "llama-tiny"}
MODEL = {"gpu": ["model.context=1024", "data.batch_size=8", "topology.inner_steps=50",
                 "pipeline.eval_seconds=20"],
         "cpu": ["data.batch_size=4", "topology.inner_steps=10", "model.context=64",
                 "pipeline.spares=0", "pipeline.eval_seconds=5"]}  # fmt: skip
VOCAB = {"gpu": 8192, "cpu": 512}
TOKENS = {"gpu": 40_000_000, "cpu": 24_000}
RESERVE = {"prepare": 0.55, "train": 0.45}  # of the time left, kept for the phases after


class GpuMemory:
    """The device's peak memory in use while it runs, sampled with ``nvidia-smi`` every
    second (None on a machine without one)."""

    def __init__(self) -> None:
        self.peak: int | None = None
        self.name: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _query(self) -> list[str] | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.used",
                                  "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip().splitlines()[0].split(", ") if out.returncode == 0 else None

    def _sample(self) -> None:
        while not self._stop.wait(1.0):
            row = self._query()
            if row is None:
                return
            self.name, used = row[0], int(float(row[1])) * 2**20
            self.peak = max(self.peak or 0, used)

    def __enter__(self) -> GpuMemory:
        self.peak = None
        row = self._query()
        if row is not None:
            self.name = row[0]
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._stop.clear()
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=15)


def phase(argv: list[str], env: dict[str, str], seconds: float, log: Path) -> tuple[int, float]:
    """Run ``argv`` (its output into ``log``) for at most ``seconds``: its exit code (None
    if it was cut short) and its wall time."""
    started = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
        try:
            code = proc.wait(timeout=max(1.0, seconds))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 2)  # Ctrl-C: a launcher stops its workers and sums up
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
            code = None
    return code, time.monotonic() - started


def learner_rates(root: Path, run: str, regions: dict[str, str]) -> dict[str, float]:
    """Each learner's median tokens/s over its rounds (its round history in the buckets)."""
    from storage_layout.history import learner_rounds
    from storage_layout.store import RunStore

    rounds = learner_rounds(RunStore(run, regions, next(iter(regions)))).rounds
    out = {}
    for lid, held in rounds.items():
        rates = sorted(r["tokens_per_s"] for r in held if r.get("tokens_per_s"))
        if rates:
            out[lid] = rates[len(rates) // 2]
    return out


def table(result: dict) -> str:
    """The result as markdown."""
    t, d = result.get("train") or {}, result.get("dp") or {}

    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    rows = [
        ("validation loss", num(t.get("final_loss"), ".4f"), num(d.get("final_loss"), ".4f")),
        ("decoupled / dp loss", num(result.get("loss_ratio"), ".4f"), ""),
        ("tokens", num(t.get("tokens"), ","), num(d.get("tokens"), ",")),
        ("tokens/s (merged, whole run)", num(t.get("tokens_per_second"), ",.0f"),
         num(d.get("tokens_per_second"), ",.0f")),
        ("tokens/s per learner (median of its rounds)",
         " ".join(f"{k}:{v:,.0f}" for k, v in (t.get("learner_tokens_per_s") or {}).items()) or "-",
         ""),
        ("MFU (learners together / dp)", num(t.get("mfu"), ".1%"), num(d.get("mfu"), ".1%")),
        ("goodput", num(t.get("goodput"), ".1%"), ""),
        ("bytes moved (learners up + down)", num(t.get("learner_bytes"), ",.0f"),
         num(t.get("dp_bytes"), ",.0f")),
        ("dp / decoupled bytes", num(t.get("bandwidth_ratio_vs_dp"), ".0f"), ""),
        ("peak device memory in use", num(t.get("peak_device_bytes"), ",.0f"),
         num(d.get("peak_device_bytes"), ",.0f")),
        ("wall time (s)", num(t.get("wall_seconds"), ".0f"), num(d.get("wall_seconds"), ".0f")),
    ]  # fmt: skip
    lines = [f"# bench/gpu_run ({result['device']})", "",
             f"Command: `{result['command']}`", f"Machine: {result['machine']}",
             f"Model: `{result['preset']}` {' '.join(result['overrides'])} "
             f"({num(t.get('params'), ',')} parameters), {result['learners']} learners, "
             "2 syncer shards, 2 regions on file:// buckets", "",
             "| | decoupled (`diloco train`) | data-parallel (`diloco simulate --mode dp`) |",
             "|---|---|---|", *[f"| {a} | {b} | {c} |" for a, b, c in rows]]  # fmt: skip
    if result.get("cut"):
        lines += [
            "",
            f"Cut short: {', '.join(result['cut'])} (at --minutes {result['minutes']:g}).",
        ]
    return "\n".join(lines) + "\n"


def save(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "results.md").write_text(table(result))


def mfu(tokens_per_second: float | None, flops_per_token: int, device: str) -> float | None:
    peak = next((v for k, v in PEAKS.items() if device.startswith(k)), None)
    if not (peak and tokens_per_second):
        return None
    return tokens_per_second * flops_per_token / peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cpu", action="store_true", help="the CPU path: llama-tiny, a little text"
    )
    parser.add_argument("--minutes", type=float, default=9.0, help="stop within this (default 9)")
    parser.add_argument("--tokens", type=int, help="tokens of each run (default: by device)")
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    parser.add_argument("--work", type=Path, help="scratch folder (default: OUT/work)")
    args = parser.parse_args(argv)
    kind = "cpu" if args.cpu else "gpu"
    deadline = time.monotonic() + 60 * args.minutes
    work = args.work or args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
           "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.2"}  # fmt: skip
    if args.cpu:
        env["JAX_PLATFORMS"] = "cpu"
    tokens = args.tokens or TOKENS[kind]
    overrides = [*MODEL[kind], f"model.vocab_size={VOCAB[kind]}"]
    result: dict = {"command": shlex.join([sys.executable, *sys.argv]) if argv is None else
                    shlex.join(["python", "bench/gpu_run/run.py", *argv]),
                    "machine": machine(), "device": "CPU", "preset": PRESET[kind],
                    "overrides": overrides, "learners": args.learners, "tokens": tokens,
                    "minutes": args.minutes, "cut": []}  # fmt: skip
    cli = [sys.executable, "-m", "flows.cli"]

    def left(share: float = 0.0) -> float:
        return (deadline - time.monotonic()) * (1 - share)

    # 1. the data set
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = work / "text"
    for package in TEXT[kind]:
        for f in sorted((stdlib / package).rglob("*.py")):
            if "site-packages" in f.parts:
                continue
            dest = text / f.relative_to(stdlib)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(f.read_text(errors="replace"))
    data = work / "tokens"
    code, _ = phase([*cli, "data", "prepare", str(text), "--out", str(data), "--vocab-size",
                     str(VOCAB[kind]), "--chunk-tokens", str(CHUNK[kind]), "--quiet"], env, left(RESERVE["prepare"]),
                    work / "prepare.log")  # fmt: skip
    if code != 0:
        result["cut"].append(f"data prepare ({'timed out' if code is None else f'exit {code}'})")
        save(result, args.out)
        return 1
    overrides.append(f"data.source={data}")
    sets = [f"--set={o}" for o in overrides]

    # 2. decoupled, through the pipeline
    run = "gpu-run"
    regions = {r: f"file://{work / 'buckets' / r}" for r in ("us-east", "eu-west")}
    argv_train = [*cli, "train", "--dir", str(work), "--run", run, "--tokens", str(tokens),
                  "--preset", PRESET[kind], "--create-buckets", *sets,
                  f"--set=topology.learners={args.learners}", "--set=pipeline.syncer_shards=2",
                  *[f"--region={r}={u}" for r, u in regions.items()]]  # fmt: skip
    with GpuMemory() as memory:
        code, wall = phase(argv_train, env, left(RESERVE["train"]), work / "train.log")
    summary_file = work / run / "summary.json"
    if summary_file.exists():
        s = json.loads(summary_file.read_text())
        result["train"] = {k: s.get(k) for k in ("final_loss", "tokens", "tokens_per_second",
                           "goodput", "learner_bytes", "dp_bytes", "bandwidth_ratio_vs_dp",
                           "params", "wall_seconds")}  # fmt: skip
        result["train"]["learner_tokens_per_s"] = learner_rates(work, run, regions)
        result["train"]["peak_device_bytes"] = memory.peak
    result["device"] = memory.name or "CPU"
    if code != 0:
        result["cut"].append(f"diloco train ({'timed out' if code is None else f'exit {code}'})")
    save(result, args.out)

    # 3. data-parallel, alone on the device, the same tokens
    dp_out = work / "dp"
    with GpuMemory() as memory:
        code, wall = phase([*cli, "simulate", "--mode", "dp", "--preset", PRESET[kind], *sets,
                            f"--set=topology.learners={args.learners}", "--tokens",
                            str(tokens), "--out", str(dp_out), "--quiet"], env, left(),
                           work / "dp.log")  # fmt: skip
    if (dp_out / "summary.json").exists():
        s = json.loads((dp_out / "summary.json").read_text())
        result["dp"] = {"final_loss": s.get("final_loss"), "tokens": s.get("tokens"),
                        "wall_seconds": wall, "peak_device_bytes": memory.peak,
                        "tokens_per_second": (s.get("tokens") or 0) / wall if wall else None}  # fmt: skip
    if code != 0:
        result["cut"].append(f"dp ({'timed out' if code is None else f'exit {code}'})")
    _ratios(result, PRESET[kind], overrides)
    save(result, args.out)
    return 0 if not result["cut"] else 1


def _ratios(result: dict, preset: str, overrides: list[str]) -> None:
    """The loss ratio and each side's MFU, where both numbers are there."""
    from diloco.config import load_config
    from diloco.memory import model_flops_per_token

    t, d = result.get("train") or {}, result.get("dp") or {}
    if t.get("final_loss") and d.get("final_loss"):
        result["loss_ratio"] = t["final_loss"] / d["final_loss"]
    flops = model_flops_per_token(load_config(preset, overrides=overrides).model)
    if t:  # the learners together, each at its median round's pace
        t["mfu"] = mfu(sum((t.get("learner_tokens_per_s") or {}).values()), flops, result["device"])
    if d:
        d["mfu"] = mfu(d.get("tokens_per_second"), flops, result["device"])


if __name__ == "__main__":
    raise SystemExit(main())
