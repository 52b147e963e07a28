"""Scale benchmark: billion-parameter fragments through the buckets, on the real code paths.

    python bench/scale/run.py [--sizes 10M 100M 1B] [--largest] [--fragments 4 8]
                              [--backends file s3] [--versions 3] [--step-timeout 900]

A synthetic model of S fp32 parameters (16 large 2-D tensors and 32 small ones) is dealt
to P fragments by the pipeline's own plan (``plan_fragments``), with M = 4 learners in two
regions (home, the syncers', and one other) and K = 4 contributions merged per version
(quorum 4). The run config is the ``large`` preset's (outer Nesterov momentum, bf16
globals, int4 contributions) with those overrides and any ``--set KEY=VALUE``. No process
holds the whole model: each step generates the tensors of one fragment from a seed.

Per size, backend and P, for one fragment (the others are the same work; with
``--largest``, every fragment in turn, each one's objects deleted after it so the disk
holds one at a time; the fragments after the first run steps 1 to 3 only), each measured step in its own fresh process:

1. ``publish0``: version 0 (``RunStore.ensure_spec`` with ``flows.spec.run_spec``, then
   ``RunStore.versions.publish_global``, as ``initialize_run`` does);
2. ``learner`` x 4: one int4 contribution per learner (``BucketStore.put_contribution``,
   after ``sent_so_far`` as a starting learner does), from its own region;
3. ``syncer``: one version through ``diloco.syncer_loop.SyncerLoop`` over
   ``flows.syncer.PipelineSyncerTransport`` (as ``SyncerRuntime`` wires them): load the
   fragment, collect the contributions, merge, outer step, publish to both regions;
4. ``download``: a learner of the other region reads the new version
   (``BucketStore.read_global``, the learner view);
5. ``raw``: raw fsspec (``fs.pipe`` / ``fs.cat``) of an object set of the same number and
   sizes as version 1 wrote in each region, and read back as the learner read it;
6. ``advance``: versions 2..N in one process (learners' contributions and one syncer loop
   kept across them: the steady state), so the buckets hold what a run keeps after N.

A step prints JSON: seconds, ``ru_maxrss`` (peak resident memory) and the resident memory
right after its imports. A step killed for memory (the kernel's OOM killer, or resident
memory over ``--max-rss-gb``, which guards a shared machine) or over ``--step-timeout`` is
recorded as such; any other failure stops the benchmark with a non-zero exit that names
the step. Writes ``results.md`` and ``results.json`` beside this file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
# This checkout's code, not whatever the virtual environment's editable install names.
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))

SEED = 0
PRESET = "large"
LEARNERS = 4
QUORUM = 4
REGIONS = ("home", "other")
LARGE_TENSORS = 16
RESULT = "BENCH-RESULT "
LADDER = ["1B", "2B", "4B", "7B", "12B", "30B", "72B"]  # what --largest tries
DISK_RESERVE = 5 << 30  # left free on the disk by --largest
GB = 1e9
BEFORE = "before-6f7d683.md"  # the tables measured before the streamed formats, kept beside


# --- sizes and the synthetic model ------------------------------------------------------


def parse_size(text: str) -> int:
    units = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}
    text = text.strip().upper()
    try:
        return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(
            f"size {text!r}: give a number such as 10M or 1B"
        ) from None


def size_name(n: int) -> str:
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return str(n)


def model_shapes(total: int) -> dict[str, tuple[int, ...]]:
    """About ``total`` parameters: 16 matrices (w, 4w) and their biases (4w,) and norm
    scales (w,), as the blocks of a transformer hold them (no embedding: ``is_embedding``
    would change the merge of an ``rda`` run only)."""
    w = max(8, round(math.sqrt(total / (4 * LARGE_TENSORS)) / 8) * 8)
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(LARGE_TENSORS):
        shapes[f"blocks.{i:02d}.mlp.kernel"] = (w, 4 * w)
        shapes[f"blocks.{i:02d}.mlp.bias"] = (4 * w,)
        shapes[f"blocks.{i:02d}.norm.scale"] = (w,)
    return shapes


def plan(total: int, fragments: int, strategy: str) -> tuple[tuple[str, ...], ...]:
    from diloco.fragments import plan_fragments

    sizes = {n: int(np.prod(s)) for n, s in model_shapes(total).items()}
    return plan_fragments(sizes, fragments, strategy)


def piece_values(
    shapes: dict, name: str, what: tuple[int, ...], start: int, stop: int, scale: float
) -> np.ndarray:
    """Values [start, stop) of one flattened tensor, the same for the same ``what``
    (version, learner, round) and piece whoever makes them: a step makes a fragment a
    piece at a time and never holds it whole."""
    index = sorted(shapes).index(name)
    rng = np.random.default_rng([SEED, *what, index, start])
    out = rng.standard_normal(stop - start, dtype=np.float32)
    out *= np.float32(scale)
    return out


def run_config(fragments: int, overrides: list[str]):
    from diloco.config import load_config

    return load_config(
        PRESET,
        overrides=[f"topology.fragments={fragments}", f"topology.learners={LEARNERS}",
                   f"topology.quorum={QUORUM}", *overrides],
    )  # fmt: skip


# --- the steps (each in its own process) ------------------------------------------------


def rss_now() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def peak_rss() -> int:
    """The process's peak resident memory (``VmHWM``: since its start, or since a step
    reset it, ``/proc/self/clear_refs``, to measure a phase alone)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


class Ctx:
    """What every step is given: the run, its regions, the size, P and the fragment."""

    def __init__(self, a: dict):
        self.a = a
        self.run, self.regions, self.fragment = a["run"], a["regions"], a["fragment"]
        self.home = REGIONS[0]
        self.cfg = run_config(a["P"], a["overrides"])
        self.shapes = model_shapes(a["size"])
        self.plan = plan(a["size"], a["P"], self.cfg.topology.fragment_strategy)
        self.names = self.plan[self.fragment]

    def spec(self) -> dict:
        from flows.spec import run_spec

        return run_spec(self.cfg, self.plan, self.regions)

    def slots(self) -> dict[str, str]:
        from protocol.topology import run_slots

        return run_slots(self.spec())

    def bucket_store(self, writer: str):
        from flows.bucket_io import BucketStore

        topo = self.cfg.topology
        return BucketStore(self.run, self.regions, self.home, self.slots(),
                           topo.global_dtype, writer, downlink=topo.downlink,
                           block_size=topo.block_size)  # fmt: skip


def step_publish0(ctx: Ctx) -> dict:
    """Version 0 as ``initialize_run`` publishes it (the spec, then the initial parameters
    and the outer optimizer's initial state, zeros), written through the syncer's
    ``StreamedVersion`` a piece at a time as the values are made (the generation of the
    values is timed apart and not counted)."""
    import jax

    from diloco import records
    from diloco.outer import outer_optimizer
    from diloco.tensors import pieces, state_slots
    from flows.spec import spec_defaults
    from flows.state_io import outer_names
    from flows.version_stream import StreamedVersion, slot_names
    from storage_layout.store import RunStore

    base = rss_now()
    p, outer, topo = ctx.fragment, ctx.cfg.outer, ctx.cfg.topology
    store = RunStore(ctx.run, ctx.regions, ctx.home, writer="syncer-0")
    store.ensure_spec(ctx.spec(), spec_defaults(ctx.regions))
    shapes = {n: ctx.shapes[n] for n in ctx.names}
    tx = outer_optimizer(outer)
    slots = state_slots(tx, shapes)
    init = jax.tree_util.tree_leaves(tx.init({n: np.ones(2, np.float32) for n in shapes}))
    if any(np.any(np.asarray(leaf)) for leaf in init):
        raise RuntimeError("the outer optimizer's initial state is not zeros; write it here")
    names = slot_names(outer_names(outer, shapes), shapes, slots)
    start = time.perf_counter()
    made = 0.0
    sink = StreamedVersion(store, p, 0, shapes, names, topo.global_dtype, "full",
                           topo.block_size)  # fmt: skip
    try:
        for name, a, b in pieces(shapes, topo.block_size):
            t = time.perf_counter()
            values = piece_values(ctx.shapes, name, (0,), a, b, 0.02)
            zeros = [np.zeros(b - a, np.float32) for _ in range(slots)]
            made += time.perf_counter() - t
            sink.write(name, a, values, zeros)
        sink.finish()
    except BaseException:
        sink.abort()
        raise
    sink.commit(records.initial_version(p, 0.0))
    return {"seconds": time.perf_counter() - start - made, "generate_seconds": made,
            "rss_imports": base}  # fmt: skip


def send(ctx: Ctx, store, learner: str, seq: int, base: int, base_id: str | None, rnd: int) -> dict:
    """``learner``'s int4 outer gradient of round ``rnd``, anchored on version ``base``
    (whose id is ``base_id``),
    made and quantized a piece at a time and streamed out
    (``RunStore.contributions.put_contribution_stream``, which calls the generator twice: hashing, then
    uploading), after the checks ``BucketStore.put_contribution`` makes (its seq
    reserved, still the newest process, its key). Seconds: the upload alone, without
    the generation and quantization of the values."""
    from diloco.outer import Contribution
    from diloco.tensors import pieces
    from flows.learner_buckets import contribution_meta
    from protocol.quantize import quantize

    topo = ctx.cfg.topology
    index = int(learner.rsplit("-", 1)[1])
    shapes = {n: ctx.shapes[n] for n in ctx.names}
    made = [0.0]

    def gradient():
        for name, a, b in pieces(shapes, topo.block_size):
            t = time.perf_counter()
            values = piece_values(ctx.shapes, name, (1, rnd, index), a, b, 1e-5)
            q = quantize(values, topo.quantization, topo.block_size)
            made[0] += time.perf_counter() - t
            yield name, q

    steps = topo.inner_steps
    tokens = steps * ctx.cfg.data.batch_size * ctx.cfg.model.context
    c = Contribution(learner, ctx.fragment, seq, base, tokens, steps, float(steps), None,
                     step=steps * rnd, anchor_seq=seq - 1, base_id=base_id)  # fmt: skip
    start = time.perf_counter()
    # BucketStore.put_contribution's checks; it takes whole tensors, so not it.
    store._reserved(learner, seq)
    store.check_newest(learner)
    store.writer_for(learner).contributions.put_contribution_stream(
        learner, ctx.fragment, seq, shapes, topo.quantization, topo.block_size, gradient,
        contribution_meta(c), key=store.keys.signing_key(learner),
    )  # fmt: skip
    return {"seconds": time.perf_counter() - start - made[0], "quantize_seconds": made[0]}


def step_learner(ctx: Ctx) -> dict:
    from diloco import records

    store = ctx.bucket_store(ctx.a["learner"])
    base = rss_now()
    learner = ctx.a["learner"]
    seq, _ = store.sent_so_far(learner)
    version = store.newest_version(learner, ctx.fragment)
    record = store.main.versions.global_marker(ctx.fragment, version).meta
    out = send(ctx, store, learner, seq + 1, version, records.ids_of(record).get(version), 1)
    return {**out, "rss_imports": base, "bytes": store.traffic.uploaded}


def syncer_loop(ctx: Ctx, store, timings: dict):
    """The core loop over the pipeline's transport, as ``SyncerRuntime`` wires them; each
    publish is timed through the transport's ``wrap`` hook (a Prefect task in the flow)."""
    import logging

    from diloco.loops import WallClock
    from diloco.syncer_loop import SyncerLoop
    from flows.syncer_transport import PipelineSyncerTransport

    log = logging.getLogger("bench.syncer")
    cfg = ctx.cfg
    transport = PipelineSyncerTransport(store, [ctx.fragment], cfg.kept_versions,
                                        cfg.outer.max_staleness, log, cfg.budget.tokens)  # fmt: skip

    def timed(gv, call):
        start = time.perf_counter()
        try:
            return call()
        finally:
            timings.setdefault("publish", []).append(time.perf_counter() - start)

    transport.wrap = timed
    learners = list(ctx.slots())
    return SyncerLoop(cfg, [ctx.fragment], learners, transport, WallClock(), lambda r: None, log)


def one_version(ctx: Ctx, loop) -> dict:
    """Collect and merge one version of the fragment; an error if the quorum is not there
    or nothing was published (the benchmark must not time an empty merge)."""
    p = ctx.fragment
    start = time.perf_counter()
    found = loop.collect()
    collected = time.perf_counter()
    present = loop.syncers[p].present
    if len(present) < ctx.cfg.quorum:
        raise RuntimeError(f"fragment {p}: {found} contributions found, from {sorted(present)}; "
                           f"the quorum is {ctx.cfg.quorum}")  # fmt: skip
    if p not in loop.due(finishing=True):
        raise RuntimeError(f"fragment {p} is not due with its quorum met")
    record = loop.merge(p)
    if record is None:
        raise RuntimeError(
            f"fragment {p}: the merge published nothing (fenced off, or all rejected)"
        )
    return {"collect": collected - start, "version_seconds": time.perf_counter() - start,
            "version": record["version"], "merged": len(record["consumed"])}  # fmt: skip


def step_syncer(ctx: Ctx) -> dict:
    store = ctx.bucket_store("syncer-0")
    base = rss_now()
    timings: dict = {}
    start = time.perf_counter()
    loop = syncer_loop(ctx, store, timings)
    loaded = time.perf_counter()
    out = one_version(ctx, loop)
    return {"seconds": out["version_seconds"], "load_seconds": loaded - start,
            "collect_seconds": out["collect"], "publish_seconds": timings["publish"][0],
            "version": out["version"], "merged": out["merged"], "rss_imports": base}  # fmt: skip


def step_download(ctx: Ctx) -> dict:
    learner = ctx.a["learner"]
    store = ctx.bucket_store(learner)
    base = rss_now()
    version = store.newest_version(learner, ctx.fragment)
    if version != ctx.a["version"]:
        raise RuntimeError(f"{learner} sees version {version}, expected {ctx.a['version']}")
    from diloco.transport import StoreLearnerView
    from storage_layout.chunks import process_folder
    from storage_layout.spill import SpillFolder

    # As a learner reads it: into its spill folder, a tensor at a time (flows.learner).
    folder = process_folder("global-views")
    view = StoreLearnerView(store, learner, SpillFolder(folder))
    through_update = ctx.cfg.topology.downlink != "full"
    if through_update:  # it holds the version before, and reads the compact update
        view.read(ctx.fragment, version - 1)
        Path("/proc/self/clear_refs").write_text("5")  # the peak below is the update's
        base, downloaded = rss_now(), store.traffic.downloaded
    start = time.perf_counter()
    got = view.read(ctx.fragment, version)
    seconds = time.perf_counter() - start
    if sorted(got.params) != sorted(ctx.names):
        raise RuntimeError(f"version {version} holds {sorted(got.params)[:3]}...")
    if through_update and got.nbytes is None:
        raise RuntimeError(f"version {version} was read whole, not through its update")
    shutil.rmtree(folder)
    moved = store.traffic.downloaded - (downloaded if through_update else 0)
    return {"seconds": seconds, "bytes": moved, "rss_imports": base,
            "through_update": through_update}  # fmt: skip


RAW_BATCH = 32  # objects per fs.pipe / fs.cat call: concurrent on S3, a bounded amount held


def _batches(items: list, n: int = RAW_BATCH):
    for i in range(0, len(items), n):
        yield items[i : i + n]


def step_raw(ctx: Ctx) -> dict:
    """Raw fsspec for the same bytes, ``RAW_BATCH`` objects a call (``fs.pipe`` /
    ``fs.cat``: concurrent requests on S3): objects of the sizes version 1 wrote in each
    region; reads of the objects the syncer read for it (version 0's master copy and
    state, the K contributions) and of those the learner read (the wire group, not what
    the marker inlines); a write of objects of the sizes of one contribution."""
    import fsspec

    from protocol.topology import deal_learners
    from storage_layout.commit import read_marker
    from storage_layout.store import RunStore
    from storage_layout.versions import WIRE

    base = rss_now()
    store = RunStore(ctx.run, ctx.regions, ctx.home, writer="bench")
    version = ctx.a["version"]
    sets = {r: store.versions.global_marker(ctx.fragment, version, r) for r in ctx.regions}
    v0 = store.versions.global_marker(ctx.fragment, version - 1, ctx.home)
    inputs = {ctx.home: [f"{v0.data_prefix}/{rel}" for rel, o in v0.objects.items()
                         if "inline" not in o and rel.split("/", 1)[0] in ("params", "opt")]}  # fmt: skip
    contribution = None
    for learner, region in deal_learners(LEARNERS, ctx.regions).items():
        seq = store.contributions.contribution_seqs(learner, ctx.fragment, region)[0]
        key = store.layout.contribution_marker(learner, ctx.fragment, seq)
        marker = read_marker(store.bucket(region), key)
        contribution = contribution or marker
        inputs.setdefault(region, []).extend(
            f"{marker.data_prefix}/{rel}" for rel, o in marker.objects.items() if "inline" not in o
        )
    largest = max(o["size"] for m in sets.values() for o in m.objects.values())
    pool = np.random.default_rng(SEED).bytes(largest)
    out: dict = {"write_seconds": 0.0, "read_seconds": 0.0, "syncer_read_seconds": 0.0,
                 "rss_imports": base}  # fmt: skip
    learner_region = ctx.a["learner_region"]
    for region, url in ctx.regions.items():
        fs, root = fsspec.core.url_to_fs(url)
        folder = f"{root.rstrip('/')}/raw-{uuid.uuid4().hex[:8]}"
        if not fs.async_impl:  # a local disk: the folder must exist
            fs.makedirs(folder, exist_ok=True)
        objects = sets[region].objects
        paths = {rel: f"{folder}/{i:04d}" for i, rel in enumerate(sorted(objects))}
        out[f"write_bytes_{region}"] = 0
        for batch in _batches(sorted(objects)):
            data = {paths[rel]: pool[: objects[rel]["size"]] for rel in batch}
            start = time.perf_counter()
            fs.pipe(data)
            out["write_seconds"] += time.perf_counter() - start
            out[f"write_bytes_{region}"] += sum(len(v) for v in data.values())
        fs.invalidate_cache()
        # What the syncer read from this region (the real objects).
        wanted = [f"{root.rstrip('/')}/{k}" for k in inputs.get(region, [])]
        start = time.perf_counter()
        for batch in _batches(wanted):
            fs.cat(batch)
        out["syncer_read_seconds"] += time.perf_counter() - start
        if region == learner_region:
            wanted = [paths[rel] for rel, o in objects.items()
                      if "inline" not in o and rel.split("/", 1)[0] in WIRE]  # fmt: skip
            out["read_bytes"] = 0
            start = time.perf_counter()
            for batch in _batches(wanted):
                out["read_bytes"] += sum(len(v) for v in fs.cat(batch).values())
            out["read_seconds"] = time.perf_counter() - start
            # The floor of a verified read: the same reads, each object's sha256 taken
            # (what every reader of the protocol must do before it uses a byte).
            start = time.perf_counter()
            for batch in _batches(wanted):
                for body in fs.cat(batch).values():
                    hashlib.sha256(body).digest()
            out["read_hashed_seconds"] = time.perf_counter() - start
        if region == ctx.home and contribution is not None:
            sizes = [o["size"] for o in contribution.objects.values()]
            start = time.perf_counter()
            for i, batch in enumerate(_batches(sizes)):
                fs.pipe({f"{folder}/up-{i:03d}-{j:03d}": pool[:n] for j, n in enumerate(batch)})
            out["upload_seconds"] = time.perf_counter() - start
        fs.rm(folder, recursive=True)
    out["seconds"] = out["write_seconds"] + out["read_seconds"]
    return out


def step_advance(ctx: Ctx) -> dict:
    """Versions ``first``..``last`` in one process: each learner sends, the syncer (one
    loop kept across versions, as a running shard) merges and publishes."""
    syncer = ctx.bucket_store("syncer-0")
    learners = list(ctx.slots())
    stores = {lid: ctx.bucket_store(lid) for lid in learners}
    seqs = {lid: stores[lid].sent_so_far(lid)[0] for lid in learners}
    timings: dict = {}
    loop = syncer_loop(ctx, syncer, timings)
    versions = []
    for rnd in range(ctx.a["first"], ctx.a["last"] + 1):
        on = loop.syncers[ctx.fragment]  # the version the learners anchor on
        for lid in learners:
            seqs[lid] += 1
            send(ctx, stores[lid], lid, seqs[lid], on.version, on.ids[on.version], rnd)
        versions.append(one_version(ctx, loop))
    return {"seconds": sum(v["version_seconds"] for v in versions),
            "version_seconds": [v["version_seconds"] for v in versions],
            "publish_seconds": timings.get("publish", []), "rss_imports": 0}  # fmt: skip


STEPS = {"publish0": step_publish0, "learner": step_learner, "syncer": step_syncer,
         "download": step_download, "raw": step_raw, "advance": step_advance}  # fmt: skip


def child(name: str, raw: str) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING)
    ctx = Ctx(json.loads(raw))
    if os.environ.get("BENCH_PROFILE") == name:  # a profile of one step, for development
        import cProfile

        with cProfile.Profile() as prof:
            out = STEPS[name](ctx)
        prof.dump_stats(f"{tempfile.gettempdir()}/bench-scale-{name}-{os.getpid()}.prof")
    else:
        out = STEPS[name](ctx)
    out["peak_rss"] = peak_rss()
    print(RESULT + json.dumps(out), flush=True)
    return 0


# --- the driver ----------------------------------------------------------------------------


class StepFailed(SystemExit):
    pass


def run_step(name: str, params: dict, args, env: dict) -> dict:
    """One step in a fresh process, watched: its JSON, or ``{"failed": why}`` when it was
    killed for memory or time; any other failure ends the benchmark, naming the step."""
    from flows.memory import Watch

    label = params.get("label", name)
    limit = int(args.max_rss_gb * (1 << 30))
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, __file__, "--step", name, json.dumps(params)],
                                cwd=ROOT, stdout=out, stderr=err, env=env)  # fmt: skip
        watch, started, why = Watch(proc.pid, time.monotonic()), time.monotonic(), None
        while proc.poll() is None:
            watch.sample()
            if watch.peak > limit:
                why = f"killed: resident memory over --max-rss-gb {args.max_rss_gb:g}"
            elif time.monotonic() - started > args.step_timeout:
                why = f"timeout: over --step-timeout {args.step_timeout:g} s"
            if why:
                proc.kill()
                proc.wait()
                break
            time.sleep(0.2)
        code = proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    wall = time.monotonic() - started
    if why is None and code != 0:
        death, oom = watch.death(code) if code < 0 else (f"exit code {code}", False)
        if not oom:
            tail = "\n".join(stderr.strip().splitlines()[-25:])
            raise StepFailed(f"step {label} failed ({death}):\n{tail}")
        why = death
    if why is not None:
        peak = watch.peak / GB
        print(f"  {label}: {why} (peak {peak:.2f} GB, {wall:.0f} s)", flush=True)
        return {"failed": why, "peak_rss": watch.peak, "wall": wall}
    lines = [ln for ln in stdout.splitlines() if ln.startswith(RESULT)]
    if not lines:
        raise StepFailed(f"step {label} printed no result:\n{stderr[-3000:]}")
    result = json.loads(lines[-1][len(RESULT) :])
    result["wall"] = wall
    print(f"  {label}: {result['seconds']:.2f} s, peak {result['peak_rss'] / GB:.2f} GB",
          flush=True)  # fmt: skip
    return result


def new_regions(backend: str, tmp: Path) -> dict[str, str]:
    import fsspec

    tag = uuid.uuid4().hex[:8]
    regions = {}
    for region in REGIONS:
        name = f"scale-{region}-{tag}"
        if backend == "file":
            (tmp / name).mkdir()
            regions[region] = f"file://{tmp / name}"
        else:
            fsspec.filesystem("s3").mkdir(name)
            regions[region] = f"s3://{name}"
    return regions


def drop(regions: dict[str, str], prefix: str | None = None) -> None:
    """Delete a run's objects (``prefix``) or the buckets themselves."""
    import fsspec

    for url in regions.values():
        fs, root = fsspec.core.url_to_fs(url)
        path = f"{root}/{prefix}" if prefix else root
        if fs.exists(path):
            fs.rm(path, recursive=True)
        fs.invalidate_cache()


def stored_bytes(url: str, prefix: str) -> int:
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    path = f"{root}/{prefix}"
    return int(fs.du(path)) if fs.exists(path) else 0


def written_bytes(run: str, regions: dict, fragment: int, version: int) -> dict:
    """What version ``version`` and round ``version``'s contributions wrote per region: the
    sums of their markers' object sizes."""
    from protocol.topology import deal_learners
    from storage_layout.commit import read_marker
    from storage_layout.store import RunStore

    store = RunStore(run, regions, REGIONS[0], writer="bench")
    out = {}
    for region in regions:
        out[f"version_{region}"] = store.versions.global_marker(fragment, version, region).size
        out[f"contributions_{region}"] = 0
    for learner, region in deal_learners(LEARNERS, regions).items():
        seqs = store.contributions.contribution_seqs(learner, fragment, region)
        if seqs:  # round 1's: the first of each learner
            key = store.layout.contribution_marker(learner, fragment, seqs[0])
            out[f"contributions_{region}"] += read_marker(store.bucket(region), key).size
    return out


def disk_need(fragment_params: int, cfg) -> int:
    """Bytes a fragment's round needs on a local disk: versions 0 and 1 in both regions
    (fp32 master, one fp32 leaf per outer optimizer slot, the wire copy, a compact update),
    K int4 contributions, and the raw copy of version 1."""
    topo, outer = cfg.topology, cfg.outer
    wire = {"fp32": 4, "bf16": 2}[topo.global_dtype]
    delta = 0 if topo.downlink == "full" else {"int8": 1.03, "int4": 0.53}[topo.downlink]
    home = 4 + (4 if outer.momentum > 0 else 0) + wire + delta
    other = wire + delta
    contrib = {"fp32": 4, "bf16": 2, "int8": 1.03, "int4": 0.53}[topo.quantization]
    per_param = 3 * (home + other) + QUORUM * contrib
    return int(fragment_params * per_param * 1.05)


def pick_largest(args, tmp: Path) -> tuple[int | None, list[int], str]:
    """The largest size of ``LADDER`` whose one-fragment round fits the free disk for some
    P asked (with ``DISK_RESERVE`` left free), the Ps it fits with, and why it stopped."""
    free = shutil.disk_usage(tmp).free - DISK_RESERVE
    chosen, fits, why, fitted = None, [], "", ""
    for name in LADDER:
        size = parse_size(name)
        ok = []
        needs = []
        for p in args.fragments:
            need = disk_need(size // p, run_config(p, args.set))
            needs.append(f"P={p}: {need / GB:.0f} GB")
            if need <= free:
                ok.append(p)
        if not ok:
            why = (f"{name} needs {', '.join(needs)} per fragment on disk, more than the "
                   f"{free / GB:.0f} GB free (keeping {DISK_RESERVE / GB:.0f} GB) in {tmp}")  # fmt: skip
            break
        chosen, fits = size, ok
        fitted = f"{name} fits ({', '.join(needs)} per fragment; {free / GB:.0f} GB free)"
    return chosen, fits, f"{fitted}; {why}" if chosen and why else why or fitted


def bench_case(
    backend: str, size: int, p: int, args, tmp: Path, env: dict, every: bool, rows: list, saved
) -> None:
    """One size, backend and P: the steps above for one fragment (every fragment, one at a
    time, when ``every``); its row is added to ``rows`` first, and ``saved()`` called
    after each fragment, so a run stopped half way keeps what it measured."""
    cfg = run_config(p, args.set)
    fragments = plan(size, p, cfg.topology.fragment_strategy)
    shapes = model_shapes(size)
    params_of = [sum(int(np.prod(shapes[n])) for n in f) for f in fragments]
    versions = args.versions if size <= parse_size(args.versions_up_to) else 1
    row = {"backend": backend, "size": size, "P": p, "fragment_params": params_of[0],
           "model_params": sum(params_of), "versions": versions, "fragments_done": 0,
           "steps": {}, "failed": None}  # fmt: skip
    rows.append(row)
    regions = new_regions(backend, tmp)
    from protocol.topology import deal_learners

    learners = deal_learners(LEARNERS, regions)
    reader = next(lid for lid, r in learners.items() if r != REGIONS[0])
    todo = range(p) if every else [0]
    try:
        for fragment in todo:
            run = f"scale-{uuid.uuid4().hex[:6]}"
            base = {"run": run, "regions": regions, "size": size, "P": p, "fragment": fragment,
                    "overrides": args.set}  # fmt: skip
            tag = f"{backend} {size_name(size)} P={p} f{fragment}"
            print(f"{tag}: {params_of[fragment]:,} parameters", flush=True)
            steps: dict = row["steps"] if fragment == 0 else {}
            if fragment:
                row.setdefault("more_fragments", []).append(steps)

            def step(name, key=None, tag=tag, steps=steps, **extra):
                got = run_step(name, {**base, **extra, "label": f"{tag} {key or name}"}, args, env)  # noqa: B023
                steps[key or name] = got
                saved()
                if "failed" in got:
                    raise _Stop(f"{key or name}: {got['failed']}")
                return got

            step("publish0")
            for lid in learners:
                step("learner", f"learner {lid}", learner=lid)
            step("syncer")
            if fragment:  # the other fragments are merged and published; the rest is the same
                row["fragments_done"] += 1
                saved()
                drop(regions, run)  # the disk holds one fragment at a time
                continue
            step("download", learner=reader, version=1)
            step("raw", version=1, learner_region=learners[reader])
            if fragment == 0:
                row["written"] = w = written_bytes(run, regions, fragment, 1)
                per = w["version_home"] + w["version_other"]
                newest = w["contributions_home"] + w["contributions_other"]
                row["kept_at_keep_versions"] = {
                    "keep_versions": cfg.kept_versions,
                    "bytes": p * (cfg.kept_versions * per + newest),
                    "formula": "P x (keep_versions x one version's bytes in every region + "
                    "each learner's newest contribution)",
                }
            if versions > 1:
                step("advance", first=2, last=versions)
            if fragment == 0:
                row["kept"] = {r: stored_bytes(u, run) for r, u in regions.items()}
            row["fragments_done"] += 1
            saved()
            if every:
                drop(regions, run)  # the disk holds one fragment at a time
    except _Stop as stop:
        row["failed"] = str(stop)
    finally:
        drop(regions)
    saved()


class _Stop(Exception):
    """A step was killed (memory, time): the rest of this case is not run."""


# --- the report ----------------------------------------------------------------------------


def fmt_gb(n: float | None) -> str:
    return "–" if n is None else f"{n / GB:.2f}"


def row_cells(r: dict) -> list[str]:
    s = r["steps"]

    def val(step, key="seconds", f="{:.2f}"):
        got = s.get(step)
        if got is None:
            return "–"
        if "failed" in got:
            return "killed" if "memory" in got["failed"] or "OOM" in got["failed"] else "timeout"
        return f.format(got[key])

    learners = [k for k in s if k.startswith("learner ")]
    failed = [k for k in learners if "failed" in s[k]]
    upload = "–"
    if failed:
        upload = val(failed[0])
    elif learners:
        upload = f"{np.mean([s[k]['seconds'] for k in learners]):.2f}"
    syn = s.get("syncer")
    syncer_rss = "–"
    if syn is not None:
        syncer_rss = (f"{fmt_gb(syn['peak_rss'])} ({fmt_gb(syn['rss_imports'])})"
                      if "failed" not in syn else f">{fmt_gb(syn['peak_rss'])} killed")  # fmt: skip
    peaks = [v["peak_rss"] for k, v in s.items() if k.startswith("learner ") or k == "download"]
    imports = [v.get("rss_imports", 0) for k, v in s.items()
               if (k.startswith("learner ") or k == "download") and "failed" not in v]  # fmt: skip
    learner_rss = (f"{fmt_gb(max(peaks))} ({fmt_gb(max(imports))})" if peaks and imports
                   else "–")  # fmt: skip
    raw = s.get("raw")
    pub = rd = up = "–"
    if raw and "failed" not in raw and syn and "failed" not in syn:
        pub = f"{(raw['write_seconds'] + raw['syncer_read_seconds']) / syn['seconds']:.2f}"
        dl = s.get("download")
        if dl and "failed" not in dl and raw["read_seconds"] > 0:
            rd = f"{raw['read_seconds'] / dl['seconds']:.2f}"
            if raw.get("read_hashed_seconds"):
                rd += f" ({raw['read_hashed_seconds'] / dl['seconds']:.2f} of raw + sha256)"
        if learners and not failed and raw.get("upload_seconds"):
            up = f"{raw['upload_seconds'] / np.mean([s[k]['seconds'] for k in learners]):.2f}"
    fp = r["fragment_params"]
    w = r.get("written")
    per_version = "–"
    if w:
        h, o = w["version_home"], w["version_other"]
        ch, co = w["contributions_home"], w["contributions_other"]
        per_version = (f"{h / GB:.3g} / {o / GB:.3g} GB ({h / fp:.2f} / {o / fp:.2f} B/param; "
                       f"+ contributions {ch / fp:.2f} / {co / fp:.2f})")  # fmt: skip
    kept = "–"
    if r.get("kept"):
        k = r["kept"]
        kept = (f"{sum(k.values()) / GB:.3g} GB after {r['versions']} "
                f"({k['home'] / fp:.1f} / {k['other'] / fp:.1f} B/param)")  # fmt: skip
    window = "–"
    if r.get("kept_at_keep_versions"):
        window = f"{r['kept_at_keep_versions']['bytes'] / GB:,.1f} GB"
    syncer_s = val("syncer")
    if syn is not None and "failed" not in syn:
        syncer_s += f" (publish {syn['publish_seconds']:.2f}, load {syn['load_seconds']:.2f})"
    adv = s.get("advance")
    if adv and "failed" not in adv and adv["version_seconds"]:
        syncer_s += f"; next {', '.join(f'{x:.2f}' for x in adv['version_seconds'])}"
    return [
        size_name(r["size"]), str(r["P"]), f"{fp / 1e6:.1f} M",
        syncer_s, syncer_rss, upload, val("download"), learner_rss, pub, up, rd, per_version,
        kept, window,
    ]  # fmt: skip


def targets(rows: list[dict]) -> list[str]:
    out = []
    # Syncer peak RSS flat in model size (per backend and P: largest over smallest size).
    flat = []
    for key in sorted({(r["backend"], r["P"]) for r in rows}):
        group = sorted((r for r in rows if (r["backend"], r["P"]) == key), key=lambda r: r["size"])
        peaks = [(r["size"], r["steps"].get("syncer", {})) for r in group]
        peaks = [(s, st["peak_rss"], "failed" in st) for s, st in peaks if st.get("peak_rss")]
        if len(peaks) >= 2:
            (s0, p0, _), (s1, p1, k1) = peaks[0], peaks[-1]
            flat.append((key, s0, p0, s1, p1, k1, not k1 and p1 <= 1.25 * p0))
    if flat:
        met = all(f[-1] for f in flat)
        detail = "; ".join(f"{b} P={p}: {fmt_gb(p0)} GB at {size_name(s0)}, "
                           f"{'over ' if k1 else ''}{fmt_gb(p1)} GB at {size_name(s1)}"
                           f"{' (killed)' if k1 else ''}"
                           for (b, p), s0, p0, s1, p1, k1, _ in flat)  # fmt: skip
        out.append(f"- Syncer peak RSS flat in model size (largest within 1.25x of smallest): "
                   f"**{'met' if met else 'not met'}** ({detail}).")  # fmt: skip
    else:
        out.append("- Syncer peak RSS flat in model size: not measured (one size only).")
    at1b = [r for r in rows if r["size"] == 10**9]
    ran = [r for r in at1b if "syncer" in r["steps"]]
    if ran:
        ok = all("failed" not in r["steps"]["syncer"] for r in ran)
        met = ok and max(r["steps"]["syncer"]["peak_rss"] for r in ran) < 2 * (1 << 30)
        detail = "; ".join(f"{r['backend']} P={r['P']}: {row_cells(r)[4]}" for r in ran)
        out.append(f"- Syncer peak RSS under 2 GB at 1 B: **{'met' if met else 'not met'}** "
                   f"({detail}).")  # fmt: skip
    elif at1b:
        detail = "; ".join(f"P={r['P']}: {r['failed']}" for r in at1b)
        out.append(f"- Syncer peak RSS under 2 GB at 1 B: **not met**: no syncer ran ({detail}).")
    else:
        out.append("- Syncer peak RSS under 2 GB at 1 B: not measured (no 1 B row).")
    ratios: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        cells = row_cells(r)
        for what, cell in zip(("syncer", "upload", "read"), cells[8:11], strict=True):
            if cell != "–":
                ratios.setdefault((r["backend"], what), []).append(float(cell.split()[0]))
    if ratios:
        met = min(min(v) for v in ratios.values()) >= 0.8
        detail = "; ".join(f"{b} {what} {min(v):.2f}–{max(v):.2f}x"
                           for (b, what), v in sorted(ratios.items()))  # fmt: skip
        out.append(f"- Publish (the syncer's version), upload and read >= 0.8x raw fsspec: "
                   f"**{'met' if met else 'not met'}** ({detail}).")  # fmt: skip
    seven = [r for r in rows if r["size"] >= 7 * 10**9]
    whole = [r for r in seven if not r["failed"] and r["fragments_done"] == r["P"]]
    if whole:
        r = whole[0]
        syn = [r["steps"]["syncer"], *(m["syncer"] for m in r.get("more_fragments", []))]
        out.append("- A 7 B model's fragments merged and published: **met** "
                   f"({size_name(r['model_params'])} parameters, P={r['P']}, every fragment "
                   f"in turn: {min(m['seconds'] for m in syn):.0f} to "
                   f"{max(m['seconds'] for m in syn):.0f} s per version, syncer peak RSS at "
                   f"most {fmt_gb(max(m['peak_rss'] for m in syn))} GB).")  # fmt: skip
    elif seven:
        why = [f"{size_name(r['size'])} P={r['P']}: "
               + (r["failed"] or f"{r['fragments_done']} of {r['P']} fragments done when the "
                  "benchmark was stopped") for r in seven]  # fmt: skip
        out.append(f"- A 7 B model's fragments merged and published: **not met** "
                   f"({'; '.join(why)}).")  # fmt: skip
    else:
        out.append("- A 7 B model's fragments merged and published: not measured in this run "
                   "(`--largest` picks it where the disk allows).")  # fmt: skip
    return out


HEADER = [
    "size", "P", "fragment params", "syncer s/version", "syncer peak RSS GB (after imports)",
    "learner upload s", "learner download s", "learner peak RSS GB (after imports)",
    "syncer throughput / raw (its reads + writes)", "upload throughput / raw",
    "read throughput / raw",
    "bytes per version home / other", "bytes kept (one fragment)",
    "kept by the whole model at kept_versions",
]  # fmt: skip


def report(data: dict) -> str:
    rows, notes, overrides = data["rows"], data["notes"], data["set"]
    lines = [
        "# bench/scale results",
        "",
        f"Command: `python bench/scale/run.py {' '.join(data['command'])}`".rstrip(),
        f"Machine: {data['machine']}; {notes[0]}",
        f"Code measured: commit {data['commit']}.",
        "",
        f"Config: the `{PRESET}` preset with M = {LEARNERS} learners in two regions (home and "
        f"other, two learners each), K = quorum = {QUORUM}"
        + (f", {' '.join(overrides)}" if overrides else "")
        + ". One fragment per size and P (the others are the same work). Seconds are the "
        "operation alone (the process's start and imports, and the generation of the "
        "synthetic tensors, are not counted); peak RSS is the process's `VmHWM` "
        "(`ru_maxrss`), with its resident memory right after imports in brackets. "
        "Throughput / raw: raw fsspec time "
        "for the same bytes over the protocol's time, raw requests made "
        f"{RAW_BATCH} objects a call (syncer: objects of the sizes version 1 wrote in both "
        "regions, and the objects the syncer read for it, version 0's master copy and "
        "state and the K contributions, over its whole s/version, which streams the "
        "version out while it merges; upload: objects of the sizes of one contribution "
        "over a learner's upload; read: the objects the learner fetched over its "
        "download). Syncer s/version: collect, merge, outer step and streamed publish of "
        "version 1 in a fresh process (in brackets its publish alone, now the markers' "
        "commit as the data went out during the merge, and the load of version 0 before "
        "it); `next`: versions 2..N in one process that keeps its loop (the steady state). "
        "Version 0 is written through the syncer's `StreamedVersion` and each learner's "
        "contribution through `RunStore.contributions.put_contribution_stream`, the values made and "
        "quantized a piece at a time (their making is not counted); a learner's download "
        "(`BucketStore.read_global`) writes each tensor into a local file as a learner "
        "does (`SpilledParams`, since 82cbde8; before, the fragment decoded whole; since "
        "the bf16 spill, as the wire's bf16 codes, not decoded to float32), so no "
        "step holds a whole fragment. With `topology.downlink` int4 or int8 the download "
        "is a learner that holds version 0 (read first, not counted) reading version 1 "
        "through its compact update; its peak RSS and the RSS in brackets are then from "
        "the moment version 0 was held (the peak reset, `/proc/self/clear_refs`).",
        *[f"{n}" for n in notes[1:]],
        "",
    ]
    for backend in ("file", "s3"):
        mine = [r for r in rows if r["backend"] == backend]
        if not mine:
            continue
        title = {"file": "file:// (two folders on the local disk)",
                 "s3": "s3:// (moto's server on loopback; it keeps objects in RAM)"}[backend]  # fmt: skip
        lines += [f"## {title}", "", "| " + " | ".join(HEADER) + " |",
                  "|" + "---|" * len(HEADER)]  # fmt: skip
        for r in mine:
            lines.append("| " + " | ".join(row_cells(r)) + " |")
        for r in mine:
            if r["failed"]:
                killed = [v for v in r["steps"].values() if "failed" in v]
                how = (f" (peak {fmt_gb(killed[0]['peak_rss'])} GB, {killed[0]['wall']:.0f} s "
                       "after its start)" if killed else "")  # fmt: skip
                lines.append(f"\n{size_name(r['size'])} P={r['P']}: stopped at {r['failed']}{how}.")
        lines.append("")
    for r in rows:
        more = r.get("more_fragments") or []
        if more:
            syn = [m["syncer"] for m in more if "syncer" in m]
            ok = [m for m in syn if "failed" not in m]
            lines.append(
                f"{size_name(r['size'])} P={r['P']} ({r['backend']}): {r['fragments_done']} of "
                f"{r['P']} fragments merged and published, one at a time; fragments 1.. : "
                "syncer s/version " + ", ".join(f"{m['seconds']:.0f}" for m in ok)
                + ", syncer peak RSS " + ", ".join(fmt_gb(m["peak_rss"]) for m in syn)
                + " GB.\n"
            )  # fmt: skip
    lines += ["## Targets (issue 28)", "", *targets(rows), ""]
    before = Path(__file__).with_name(BEFORE)
    if before.exists():
        lines += [before.read_text().rstrip(), ""]
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--step":
        return child(sys.argv[2], sys.argv[3])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=parse_size, nargs="*", default=None,
                        help="total fp32 parameters (default 10M 100M 1B)")  # fmt: skip
    parser.add_argument("--largest", action="store_true",
                        help="also the largest size the free disk allows, every fragment")  # fmt: skip
    parser.add_argument("--fragments", type=int, nargs="+", default=[4, 8], help="P values")
    parser.add_argument("--backends", nargs="+", default=["file", "s3"], choices=["file", "s3"])
    parser.add_argument("--s3-max", type=parse_size, default=parse_size("100M"),
                        help="largest size run on s3 (moto holds every object in RAM)")  # fmt: skip
    parser.add_argument("--versions", type=int, default=3, help="versions N published")
    parser.add_argument("--versions-up-to", default="100M",
                        help="sizes above this publish one version only")  # fmt: skip
    parser.add_argument("--step-timeout", type=float, default=900.0)
    parser.add_argument("--max-rss-gb", type=float, default=14.0,
                        help="a step over this resident memory is killed (a shared machine)")  # fmt: skip
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides, e.g. topology.downlink=int4")  # fmt: skip
    parser.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--note", default="", help="a line for the results (e.g. the load)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    parser.add_argument("--render", type=Path, metavar="RESULTS_JSON",
                        help="only write results.md (in --out) again from a results.json")  # fmt: skip
    args = parser.parse_args()
    if args.render:
        print(save(json.loads(args.render.read_text()), args.out))
        return 0
    if args.versions < 1:
        parser.error("--versions must be at least 1")
    sizes = args.sizes if args.sizes is not None else [parse_size(s) for s in ("10M", "100M", "1B")]
    run_config(args.fragments[0], args.set)  # a bad --set fails here, before any work
    tmp = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=args.tmp))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip() or "unknown"  # fmt: skip
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    commit += " (with uncommitted changes)" if dirty else ""
    load = os.getloadavg()[0]
    notes = [args.note or "the machine is shared; load from other processes not controlled.", ""]
    cases: list[tuple[str, int, list[int], bool]] = []
    for backend in args.backends:
        for size in sizes:
            if backend == "s3" and size > args.s3_max:
                notes.append(f"- s3 runs sizes up to {size_name(args.s3_max)} (`--s3-max`): "
                             f"moto keeps every object in RAM; {size_name(size)} not run.")  # fmt: skip
                continue
            cases.append((backend, size, args.fragments, False))
    cases.sort(key=lambda c: c[1])  # the small sizes first: a big one may take long or fail
    if args.largest:
        size, fits, why = pick_largest(args, tmp)
        notes.append(f"- `--largest`: {why}." if size is None else
                     f"- `--largest` picked {size_name(size)} with P = "
                     f"{', '.join(map(str, fits))}: {why}.")  # fmt: skip
        if size is not None:
            cases.append(("file", size, fits, True))
    server = None
    env = dict(os.environ)
    if any(c[0] == "s3" for c in cases):
        from infra.local_servers import LocalS3

        server = LocalS3().start()
        env.update(server.environment())
    from machine import machine

    rows: list[dict] = []
    data = {"command": sys.argv[1:], "machine": machine(), "commit": commit, "notes": notes,
            "set": args.set, "rows": rows}  # fmt: skip
    try:
        for backend, size, ps, every in cases:
            for p in ps:
                bench_case(backend, size, p, args, tmp, env, every, rows,
                           lambda: save(data, args.out))  # fmt: skip
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    notes[0] += (f" Load average (1 min) {load:.1f} at the start, {os.getloadavg()[0]:.1f} at "
                 f"the end, on {os.cpu_count()} cores.")  # fmt: skip
    print(save(data, args.out))
    return 0


def save(data: dict, out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    text = report(data)
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps(data, indent=1))
    return text


if __name__ == "__main__":
    try:
        sys.exit(main())
    except StepFailed as exc:
        print(exc.code, file=sys.stderr)
        sys.exit(1)
