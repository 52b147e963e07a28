"""Live metrics: the learners' round history in the buckets (write-once, read in order,
damage skipped and named, nothing lost when a learner is killed), the TensorBoard view
the launcher builds from it (incremental, and a relaunch adds no point twice), the curve
and the start-up display."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from diloco.config import load_config
from flows.display import Display, LiveDisplay, current, open_display
from flows.metrics import LiveMetrics
from flows.sinks import open_sinks
from protocol.topology import run_slots
from storage_layout.history import global_versions, learner_rounds, read_history
from storage_layout.store import RunStore

LEARNERS = {"learner-0": "us", "learner-1": "eu"}


def _regions(tmp_path: Path) -> dict[str, str]:
    out = {}
    for region in ("us", "eu"):
        (tmp_path / region).mkdir(exist_ok=True)
        out[region] = f"file://{tmp_path / region}"
    return out


def _row(r: int, loss: float = 3.0) -> dict:
    return {"round": r, "step": 10 * r, "steps": 10, "tokens": 5120 * r, "loss": loss,
            "tokens_per_s": 1000.0, "staleness": 1, "merge_weight": 0.5, "bytes_up": 100,
            "bytes_down": 200, "seconds": 1.5, "time": 1_700_000_000.0 + r}  # fmt: skip


def _learner_store(regions, lid):
    region = LEARNERS[lid]
    return RunStore("r", {region: regions[region]}, region, writer=lid)


@pytest.mark.parametrize("backend", ["file", "memory"])
def test_round_history_is_write_once_and_read_in_order_with_damage_skipped(make_bucket,
                                                                           backend):  # fmt: skip
    url = make_bucket(backend)
    store = RunStore("r", {"us": url}, "us", writer="learner-0")
    for r in (1, 2, 3, 4):
        assert store.progress.put_round("learner-0", r, _row(r))
    assert store.progress.put_round("learner-0", 2, _row(2))  # a retry whose first answer was lost
    assert not store.progress.put_round(
        "learner-0", 2, _row(2, loss=9.0)
    )  # a redo: the first stays
    key = store.layout.history_entry("learner-0", 3)
    raw = store.home.get(key)
    store.home.put(key, raw.replace(b'"loss": 3.0', b'"loss": 8.0'))  # one flipped digit
    store.home.put(store.layout.history_entry("learner-0", 4), b"{not json")
    got = learner_rounds(store, {"learner-0": "us"})
    assert [row["round"] for row in got.rounds["learner-0"]] == [1, 2]
    assert got.rounds["learner-0"][1]["loss"] == 3.0
    assert len(got.damaged) == 2 and "sha256" in got.damaged[0] and "not JSON" in got.damaged[1]
    later = learner_rounds(store, {"learner-0": "us"}, after={"learner-0": 1})
    assert [row["round"] for row in later.rounds["learner-0"]] == [2]


def test_the_history_reader_loads_no_training_code():
    code = ("import sys, storage_layout.history; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'optax')))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def _version(store: RunStore, p: int, v: int, consumed: int) -> None:
    meta = {"time": 1_700_000_000.0 + v, "consumed": [["learner-0", i] for i in range(consumed)],
            "staleness": {"learner-0": v % 3}, "rejected": [["learner-1", v, "stale"]],
            "superseded": [], "tokens": 512 * consumed, "tokens_total": 512 * v}  # fmt: skip
    store.versions.publish_global(p, v, {"w": np.full(4, v, np.float32)}, [], meta)


def _scalars(folder: Path, run: str, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder / "tensorboard" / run))
    acc.Reload()
    if tag not in acc.Tags()["scalars"]:
        return []
    return [(e.step, round(e.value, 4)) for e in acc.Scalars(tag)]


def test_tensorboard_grows_with_the_history_and_a_relaunch_writes_no_point_twice(tmp_path):
    regions = _regions(tmp_path)
    home = RunStore("r", regions, "us", writer="launcher")
    spec = {"learners": LEARNERS, "fragments": [["w"], ["w"]]}
    for p in (0, 1):
        _version(home, p, 0, 0)
    for lid in LEARNERS:
        for r in (1, 2):
            _learner_store(regions, lid).progress.put_round(lid, r, _row(r, loss=4.0 - r))
    _version(home, 0, 1, 2)
    folder = tmp_path / "runs" / "r"
    live = LiveMetrics(home, spec, folder, tables=False)
    live.tick({"tokens": 0, "loss": 5.5, "versions": {0: 1, 1: 0}}, {"goodput/so_far": 0.0})
    assert _scalars(folder, "learner-1", "loss/train") == [(10, 3.0), (20, 2.0)]
    assert _scalars(folder, "fragment-0", "versions/contributions") == [(1, 2.0)]
    assert _scalars(folder, "global", "loss/validation") == [(0, 5.5)]

    # The next tick adds only what is new.
    _learner_store(regions, "learner-1").progress.put_round("learner-1", 3, _row(3, loss=0.5))
    _version(home, 0, 2, 1)
    _version(home, 1, 1, 3)
    live.tick({"tokens": 2048, "loss": 4.0, "versions": {0: 2, 1: 1}})
    live.tick({"tokens": 2048, "loss": 4.0, "versions": {0: 2, 1: 1}})  # nothing new
    live.close()
    assert _scalars(folder, "learner-1", "loss/train") == [(10, 3.0), (20, 2.0), (30, 0.5)]
    assert _scalars(folder, "learner-0", "loss/train") == [(10, 3.0), (20, 2.0)]
    assert _scalars(folder, "fragment-0", "versions/contributions") == [(1, 2.0), (2, 1.0)]
    assert _scalars(folder, "fragment-1", "versions/rejected") == [(1, 1.0)]
    assert _scalars(folder, "global", "loss/validation") == [(0, 5.5), (2048, 4.0)]

    # A relaunch of the run reads the whole history again but writes only what is new.
    _learner_store(regions, "learner-0").progress.put_round("learner-0", 3, _row(3, loss=1.0))
    again = LiveMetrics(home, spec, folder, tables=False)
    again.tick({"tokens": 2048, "loss": 4.0, "versions": {0: 2, 1: 1}})
    again.tick({"tokens": 4096, "loss": 3.5, "versions": {0: 3, 1: 1}}, {"cost/dollars": 0.25})
    again.close()
    assert _scalars(folder, "learner-0", "loss/train") == [(10, 3.0), (20, 2.0), (30, 1.0)]
    assert _scalars(folder, "learner-1", "loss/train") == [(10, 3.0), (20, 2.0), (30, 0.5)]
    assert _scalars(folder, "fragment-0", "versions/contributions") == [(1, 2.0), (2, 1.0)]
    assert _scalars(folder, "global", "loss/validation") == [(0, 5.5), (2048, 4.0), (4096, 3.5)]
    assert _scalars(folder, "global", "cost/dollars") == [(4096, 0.25)]
    assert again.cost_curve() == [(4096.0, 0.25)]  # the plot's cost panel: the points priced
    assert sorted(len(rows) for rows in again.rounds.values()) == [3, 3]
    # The end's training curve: each round at the tokens all learners had processed then.
    curve = again.training_curve()
    assert [t for t, _ in curve] == sorted(t for t, _ in curve) and curve[-1][0] == 2 * 3 * 5120
    tables = again.table_rows({"learner-0": {"state": "training", "step": 30}})
    assert tables["learners"][0]["rounds"] == 3 and tables["learners"][0]["loss"] == 1.0
    assert [v["version"] for v in tables["versions"]] == [2, 1]
    assert [v["rejected_so_far"] for v in tables["versions"]] == [3, 2]  # v0 has one too
    # the staleness of each contribution merged into a version read (v % 3 in _version)
    merged = [row["version"] % 3 for rows in again.versions.values() for row in rows]
    assert again.merged_staleness() == merged and len(merged) >= 5
    versions = global_versions(home, 2)
    assert [m["version"] for m in versions.versions[0]] == [0, 1, 2]


def _wandb_points(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every point the offline W&B runs under ``folder`` hold (what ``wandb sync`` would
    upload), by key, against its series' step: their ``.wandb`` files read record by
    record (W&B's log format: 32 KiB blocks of records, each a 7-byte header, then a
    piece of a ``Record`` protobuf)."""
    from wandb.proto import wandb_internal_pb2 as pb

    points: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(folder.rglob("run-*.wandb")):
        data, offset, held = path.read_bytes(), 7, b""  # (after the file's header)
        while offset + 7 <= len(data):
            if 32768 - offset % 32768 < 7:  # the rest of a block is padding
                offset += 32768 - offset % 32768
                continue
            _, length, kind = struct.unpack_from("<IHB", data, offset)
            held, offset = held + data[offset + 7 : offset + 7 + length], offset + 7 + length
            if kind in (1, 4):  # a whole record, or a record's last piece
                record, held = pb.Record.FromString(held), b""
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                       for i in record.history.item}  # fmt: skip
                for key, value in row.items():
                    series = key.split("/")[0]
                    if "/" in key and key != f"{series}/step":
                        points.setdefault(key, []).append((row[f"{series}/step"], value))
            elif kind == 0:
                break
    return points


# (MLflow's SQLAlchemy store configures every mapper in the process, Prefect's too, and
# SQLAlchemy warns of both projects' deprecated uses: not this project's to fix)
@pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SADeprecationWarning")
def test_wandb_and_mlflow_get_what_tensorboard_gets_and_a_relaunch_goes_on_in_the_same_run(
    tmp_path, monkeypatch
):
    """``pipeline.sinks = ["wandb", "mlflow"]``: W&B offline (no account) and MLflow over
    a SQLite store get every point TensorBoard gets, each series against its own axis,
    and a relaunch of the run writes only what is new, into the same W&B and MLflow run."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    regions = _regions(tmp_path)
    home = RunStore("r", regions, "us", writer="launcher")
    spec = {"learners": LEARNERS, "fragments": [["w"], ["w"]]}
    for p in (0, 1):
        _version(home, p, 0, 0)
    for r in (1, 2):
        _learner_store(regions, "learner-1").progress.put_round("learner-1", r, _row(r, 4.0 - r))
    _version(home, 0, 1, 2)
    folder = tmp_path / "runs" / "r"
    for tokens, loss in ((0, 5.5), (2048, 4.0)):  # two launches of the run
        live = LiveMetrics(home, spec, folder, tables=False,
                           sinks=open_sinks(["wandb", "mlflow"], "r", folder, logging.getLogger()))  # fmt: skip
        live.tick({"tokens": tokens, "loss": loss, "versions": {0: 1, 1: 0}})
        live.close()
        if not tokens:  # new work between the launches
            _learner_store(regions, "learner-1").progress.put_round("learner-1", 3, _row(3, 0.5))
            _version(home, 0, 2, 1)
    client = MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("diloco").experiment_id])
    wandb = _wandb_points(folder / "wandb")
    for series, tag in (("learner-1", "loss/train"), ("fragment-0", "versions/contributions"),
                        ("global", "loss/validation")):  # fmt: skip
        board = _scalars(folder, series, tag)
        assert len(board) > 1, (series, tag)
        history = client.get_metric_history(run.info.run_id, f"{series}/{tag}")
        assert sorted((m.step, round(m.value, 4)) for m in history) == board, (series, tag)
        assert sorted(wandb[f"{series}/{tag}"]) == board, (series, tag)
    # Every sink is named in the config (``pipeline.sinks``), and only those.
    from typing import get_args

    from diloco.config.pipeline import PipelineConfig
    from flows.sinks import SINKS

    named = get_args(PipelineConfig.model_fields["sinks"].annotation)[0]  # tuple[Literal, ...]
    assert set(get_args(named)) == set(SINKS)


def test_a_sink_whose_library_is_missing_stops_the_run_before_anything_starts(
    tmp_path, monkeypatch
):
    """``diloco train --set pipeline.sinks=["wandb"]`` without W&B installed: an error
    that names the sink and how to install it, before the run's Prefect server, spec or
    workers (it used to come from the launcher's first look, once the workers ran)."""
    from flows.cli import main
    from flows.sinks import SINKS

    monkeypatch.setattr(SINKS["wandb"], "library", "wandb_not_installed_here")
    argv = ["train", "--dir", str(tmp_path), "--run", "nosink", "--tokens", "20000",
            "--set", 'pipeline.sinks=["wandb"]']  # fmt: skip
    out = io.StringIO()
    monkeypatch.setattr("flows.train.console", Console(file=out, width=300))
    assert main(argv) == 2
    said = out.getvalue()
    assert "pipeline.sinks names wandb, whose library is not installed" in said, said
    assert "pip install 'decoupled-diloco[wandb]'" in said, said
    assert not (tmp_path / "nosink" / "prefect").exists()  # no server was started
    assert not list(tmp_path.rglob("spec.json"))  # nor the run written


DRIVER = """
import json, sys
from flows.learner_runtime import LearnerRuntime
run, bucket, region, lid, pipeline = sys.argv[1:]
rt = LearnerRuntime(run, bucket, region, lid, json.loads(pipeline))
print("generation", rt.generation, "resumes from", rt.resumed_from, flush=True)
while not rt.finished:
    rt.train_round()
rt.checkpoint(wait=True)
rt.close()
"""


@pytest.mark.slow
def test_the_round_history_survives_a_killed_learner(tmp_path):
    """A learner process SIGKILLed mid-run: its successor (here in the test's process)
    resumes from its checkpoint and goes on; the history holds every round the first one
    wrote, unchanged, then the successor's, each round once and none missing."""
    from flows.learner_runtime import LearnerRuntime
    from flows.run import initialize_run

    pipeline = {"round_steps": 4, "checkpoint_every": 4, "poll_seconds": 0.05}
    # One learner and no syncer: no version reports the others' progress, so it trains
    # its even share (a shared budget would have it train the others' too).
    cfg = load_config("tiny", overrides=["budget.tokens=81920", "budget.shared=false"]
                      + [f"pipeline.{k}={v}" for k, v in pipeline.items()])  # fmt: skip
    regions = _regions(tmp_path)
    home = RunStore("killed", regions, "us", writer="launcher")
    spec = initialize_run(home, cfg)
    lid, region = next(iter(run_slots(spec).items()))
    store = RunStore("killed", regions, region)
    total_rounds = -(-cfg.steps_per_learner // pipeline["round_steps"])
    argv = [sys.executable, "-c", DRIVER, "killed", regions[region], region, lid,
            json.dumps(cfg.pipeline.model_dump())]  # fmt: skip
    log = tmp_path / "first.log"
    with log.open("wb") as out:
        first = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while len(store.progress.history_rounds(lid, region)) < 3:
            assert first.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "no third round in time"
            time.sleep(0.05)
        os.kill(first.pid, signal.SIGKILL)
    finally:
        if first.poll() is None:
            first.kill()
        first.wait()
    before = learner_rounds(store, {lid: region}).rounds[lid]
    assert 3 <= len(before) < total_rounds, "killed too late to test a successor"
    successor = LearnerRuntime("killed", regions[region], region, lid, cfg.pipeline.model_dump())
    try:
        assert successor.generation == 2 and successor.round <= len(before) + 1
        while not successor.finished:
            successor.train_round()
    finally:
        successor.close()

    after = read_history(store)  # every learner's rounds, every fragment's versions
    rows = after.rounds[lid]
    assert set(after.rounds) == set(run_slots(spec)) and len(after.versions) == 2
    assert after.damaged == []
    assert [row["round"] for row in rows] == list(range(1, total_rounds + 1))
    assert rows[: len(before)] == before  # nothing lost, nothing overwritten
    assert {row["generation"] for row in rows[: len(before)]} == {1}
    assert {row["generation"] for row in rows[len(before) :]} == {2}
    assert rows[-1]["step"] == cfg.steps_per_learner
    assert all(row["loss"] is not None and row["tokens_per_s"] > 0 for row in rows)


def test_the_live_display_shows_the_phases_and_is_plain_off_a_terminal():
    assert type(open_display(Console(file=io.StringIO()))) is Display  # a pipe, a log file
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120)
    with open_display(console, "diloco train demo") as display:
        assert isinstance(display, LiveDisplay) and current() is display
        display.phase("server", "done", "http://127.0.0.1:4200/api")
        display.phase("learners", "running", "2 compiling, 2 training")
        display.phase("training", "running")
        display.progress(42.0, "tokens 1,024 · validation loss 3.2100")
        console.print(display.render())
    assert type(current()) is Display  # closed: the next flow run gets a plain one
    text = buf.getvalue()
    for words in ("Prefect server", "2 compiling, 2 training", "validation loss 3.2100", "42%"):
        assert words in text, text
    # The watch's evaluation shows the speed and the time left beside the tokens.
    from flows.watch import show_phases

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=160)
    with open_display(console, "diloco train demo") as display:
        point = {"tokens": 1024, "loss": 3.21, "versions": {0: 1, 1: 1}}
        show_phases(display, {"learner-0": {"state": "training"}}, point["versions"], point,
                    42.0, pace="500/s | 40 s left")  # fmt: skip
        console.print(display.render())
    assert "tokens 1,024 at 500/s · 40 s left · validation loss 3.2100" in buf.getvalue()


def test_the_curve_holds_each_model_once_and_the_plot_has_the_learners_loss(tmp_path):
    from flows.monitor import Monitor
    from flows.run import Run, initialize_run
    from flows.summary import loss_plot_png

    cfg = load_config("tiny", overrides=["budget.tokens=20000"])
    regions = _regions(tmp_path)
    store = RunStore("curve", regions, "us", writer="launcher")
    spec = initialize_run(store, cfg)
    monitor = Monitor(
        Run(store.run, store.urls, store.client_region, spec, cfg), store, logging.getLogger("test")
    )
    first = monitor.evaluate(monitor.statuses())
    assert monitor.evaluate(monitor.statuses()) is first and len(monitor.curve) == 1
    png = loss_plot_png(monitor.curve, "run curve", [(100.0, 5.0), (200.0, 4.0)], [0, 1, 1, 3],
                        [(100.0, 0.01), (200.0, 0.03)], 1e-3)  # fmt: skip
    assert png.startswith(b"\x89PNG")
    # four panels: against tokens, against wall time, the staleness merged, the cost
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (1100, 700)
