"""A learner over several processes: what each host holds and how long it takes to save
a checkpoint, resume from it and take a new global version, per host against through the
leader.

    python bench/hosts/run.py [--preset llama-150m] [--processes 2] [--devices 2]
    python bench/hosts/run.py --platform gpu --processes 1 --preset llama-1b   # one GPU

One learner of ``--processes`` processes with ``--devices`` CPU devices each (with
``--platform gpu``: each process's GPUs, one process a GPU), its
parameters and inner optimizer state sharded over all of them (``pipeline.fsdp`` = every
device: FSDP across hosts), on a file:// bucket made by ``initialize_run``. Two methods,
each in a fresh group of processes and its own run:

- ``per-host`` (the code as it is): ``hosts.ReplicatedTransport`` over each process's own
  ``StoreLearnerView`` (as ``LearnerRuntime`` wires it, with the transport synchronous):
  each process writes its part of the checkpoint (``HostPart``) and the leader commits,
  each resumes from the step the leader names placing its own slices, each reads the
  version the leader names into its own spill folder;
- ``through-leader`` (what 9f36a57 did, reproduced here with the same storage calls):
  every process gathers the whole state to the host (``inner.to_host``, an all-gather)
  and the leader writes it; the leader reads the checkpoint as host arrays and
  broadcasts them (``hosts.broadcast_object``), each process places them; the leader
  reads each fragment's version into memory and broadcasts it;
- ``one-host`` (with ``--processes 1`` only, not run unless named in ``--methods``): a
  learner of one process, as most are: its ``StoreLearnerView`` alone, the checkpoint
  written leaf by leaf (``OptimizerLeaves``) and read leaf by leaf onto the devices.

Each phase (save, then load what was saved, then read version 0 of every fragment) runs
in a fresh group of processes, so that memory an earlier phase freed does not hide a
later one's. Per phase and process: the seconds (to a barrier after the phase: the
group's slowest), and the peak resident memory during the phase above what the process
held when it began (the peak reset first: ``/proc/self/clear_refs``). Writes ``results.md`` and
``results.json`` beside this file.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))

PHASES = ("save", "load", "version")
METHODS = ("through-leader", "per-host", "one-host")


def _status_kb(field: str) -> int:
    return _status_kb_of(os.getpid(), field)


def child(method: str, phase: str, run: str, bucket: str, pipeline: str) -> None:
    from flows.hosts import join

    join()
    import jax
    from jax.experimental import multihost_utils

    from diloco import hosts
    from diloco.inner import to_host
    from diloco.learner import LearnerCheckpoint
    from diloco.transport import StoreLearnerView
    from flows.run import bucket_store, build_model
    from flows.spec import config_from_spec
    from flows.state_io import HostPart
    from protocol.topology import run_slots
    from storage_layout.chunks import process_folder
    from storage_layout.spill import SpillFolder
    from storage_layout.store import RunStore

    spec = RunStore(run, {"us": bucket}, "us").read_spec()
    cfg = config_from_spec(spec, json.loads(pipeline))
    model = build_model(cfg, learner=True)
    trainer, (lid,) = model.trainer, list(run_slots(spec))
    store = bucket_store(run, {"us": bucket}, spec, cfg, lid, home="us", model=model)
    # only the save phase holds a trained state (so no other phase starts with its
    # temporaries free in the heap, which would hide what the phase allocates)
    state = trainer.init_opt_state(trainer.place_params(model.init)) if phase == "save" else None
    fragments = len(model.plan)
    rank, count = jax.process_index(), jax.process_count()
    folder = process_folder("bench-hosts")
    view = StoreLearnerView(store, lid, SpillFolder(folder) if method != "through-leader" else None)
    rt = hosts.ReplicatedTransport(
        view, view.read, lambda step: store.load_checkpoint(lid, step),
        lambda st, write_id: HostPart(st, write_id, rank, count),
    )  # fmt: skip
    template = jax.eval_shape(trainer.tx.init, model.init)
    leaves = sum(x.size for x in jax.tree.leaves(template))

    def save() -> None:
        if method == "one-host":
            view.save_checkpoint(LearnerCheckpoint(step=1, seq=0, opt_state=state))
        elif method == "per-host":
            rt.save_checkpoint(LearnerCheckpoint(step=1, seq=0, opt_state=state))
        else:
            host = jax.tree.map(to_host, state)
            if rank == 0:
                store.save_checkpoint(lid, LearnerCheckpoint(step=1, seq=0, opt_state=host))

    def load() -> object:
        if method == "one-host":
            return view.load_checkpoint().opt_state
        if method == "per-host":
            return rt.load_checkpoint().opt_state
        if rank == 0:
            store.place, store.opt_template = (lambda host: host), (lambda: template)
        ckpt = hosts.broadcast_object(store.load_checkpoint(lid) if rank == 0 else None)
        return jax.tree.map(trainer.place, ckpt.opt_state)

    def version() -> object:
        if method == "one-host":
            return [view.latest_global(p) for p in range(fragments)]
        if method == "per-host":
            return [rt.latest_global(p) for p in range(fragments)]
        return [hosts.broadcast_object(view.latest_global(p) if rank == 0 else None)
                for p in range(fragments)]  # fmt: skip

    call = {"save": save, "load": load, "version": version}[phase]
    gc.collect()
    multihost_utils.sync_global_devices(f"before {phase}")
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
    before = _status_kb("VmRSS")
    start = time.perf_counter()
    made = call()
    jax.block_until_ready(made if phase == "load" else 0)
    multihost_utils.sync_global_devices(f"after {phase}")
    seconds = time.perf_counter() - start
    peak = _status_kb("VmHWM")
    rows = [{"method": method, "phase": phase, "process": rank, "seconds": seconds,
             "peak_above_mb": (peak - before) / 1024, "rss_before_mb": before / 1024,
             "state_values": int(leaves)}]  # fmt: skip
    print("RESULT " + json.dumps(rows), flush=True)


def _group(
    processes: int, env: dict, method: str, phase: str, bucket: str, cfg, max_rss_gb: float
) -> list:
    from flows.hosts import free_port

    port = free_port()
    procs = []
    for i in range(processes):
        penv = {**env, "DILOCO_COORDINATOR": f"127.0.0.1:{port}", "DILOCO_PROCESS_ID": str(i),
                "DILOCO_PROCESS_COUNT": str(processes)}  # fmt: skip
        if env["JAX_PLATFORMS"] == "cuda":
            penv["CUDA_VISIBLE_DEVICES"] = str(i)
        command = [sys.executable, __file__, "--child", method, phase, method, bucket,
                   cfg.pipeline.model_dump_json()]  # fmt: skip
        procs.append(subprocess.Popen(command, env=penv, stdout=subprocess.PIPE, text=True))
    over = _watch(procs, max_rss_gb)
    rows = []
    for p in procs:
        out, _ = p.communicate()
        if over:
            return [{"method": method, "phase": phase, "process": i, "killed": over}
                    for i in range(processes)]  # fmt: skip
        if p.returncode != 0:
            print(out, file=sys.stderr)
            raise SystemExit(f"{method} {phase}: a process ended with {p.returncode}")
        rows += json.loads(out.split("RESULT ", 1)[1])
    return rows


def _watch(procs: list[subprocess.Popen], max_rss_gb: float) -> str | None:
    """Wait for ``procs``; kill them all once their resident memory together passes
    ``max_rss_gb`` (this machine is shared: no OOM killer picking a victim), and say so."""
    while any(p.poll() is None for p in procs):
        total = 0
        for p in procs:
            with contextlib.suppress(OSError, KeyError):
                total += _status_kb_of(p.pid, "VmRSS")
        if total > max_rss_gb * 2**20:
            for p in procs:
                p.kill()
            return f"killed over {max_rss_gb:g} GB resident"
        time.sleep(0.1)
    return None


def _gpu_name() -> str:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()  # fmt: skip
    return out.splitlines()[0] if out else "a GPU"


def _status_kb_of(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-150m")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    parser.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS[:2]))
    parser.add_argument(
        "--max-rss-gb",
        type=float,
        default=16.0,
        help="kill a phase whose processes hold more than this together",
    )
    args = parser.parse_args()
    if "one-host" in args.methods and args.processes != 1:
        parser.error("--methods one-host is a learner of one process (--processes 1)")
    # this process only builds the run on its CPU; the learner's processes take the GPUs
    os.environ["JAX_PLATFORMS"] = "cpu"
    from machine import machine

    from diloco.config import load_config
    from flows.run import build_model, initialize_run
    from storage_layout.store import RunStore

    gpu = args.platform == "gpu"
    devices = args.processes * (1 if gpu else args.devices)
    where = "GPUs" if gpu else "CPU devices"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()  # fmt: skip
    cfg = load_config(args.preset, overrides=["topology.learners=1", f"pipeline.fsdp={devices}",
                                              "topology.quantization=fp32"])  # fmt: skip
    params = sum(int(v.size) for v in build_model(cfg).init.values())
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(
           [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}"}  # fmt: skip
    if gpu:  # one GPU a process, its memory allocated as used (not 75 % up front)
        env.update(JAX_PLATFORMS="cuda", XLA_PYTHON_CLIENT_PREALLOCATE="false")
        env.pop("XLA_FLAGS")
    rows = []
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-hosts-") as tmp:
        for method in args.methods:
            (Path(tmp) / method).mkdir()
            bucket = f"file://{Path(tmp) / method}"
            initialize_run(RunStore(method, {"us": bucket}, "us", writer="launcher"), cfg)
            for phase in PHASES:  # each in fresh processes: a phase's peak is its own
                rows += _group(args.processes, env, method, phase, bucket, cfg, args.max_rss_gb)
                print(f"{method} {phase}: {json.dumps(rows[-args.processes :])}", flush=True)
            shutil.rmtree(Path(tmp) / method)  # (a 1 B run's buckets take tens of GB)
            print(f"{method}: done", flush=True)
            (args.out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    state_values = next(r["state_values"] for r in rows if "state_values" in r)
    table = [
        f"# A learner over {args.processes} processes: per host against through the leader",
        "",
        f"`python bench/hosts/run.py --preset {args.preset} --processes {args.processes} "
        + ("--platform gpu` " if gpu else f"--devices {args.devices}` ")
        + f"on {machine(_gpu_name() if gpu else None)}; commit "
        f"{commit}.",
        "",
        f"{args.preset}: {params / 1e6:.0f} M parameters, its inner optimizer state "
        f"{state_values / 1e6:.0f} M values ({state_values * 4 / 2**20:.0f} MiB "
        f"as float32), sharded over {devices} {where} of {args.processes} processes.",
        "",
        "| phase | method | seconds | peak above start, per process (MiB) |",
        "|---|---|---|---|",
    ]  # fmt: skip
    for phase in PHASES:
        for method in args.methods:
            mine = sorted((r for r in rows if r["phase"] == phase and r["method"] == method),
                          key=lambda r: r["process"])  # fmt: skip
            if "killed" in mine[0]:
                table.append(f"| {phase} | {method} | {mine[0]['killed']} | |")
                continue
            peaks = " / ".join(f"{r['peak_above_mb']:.0f}" for r in mine)
            table.append(
                f"| {phase} | {method} | {max(r['seconds'] for r in mine):.2f} | {peaks} |"
            )
    (args.out / "results.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(*sys.argv[2:7])
    else:
        sys.exit(main())
