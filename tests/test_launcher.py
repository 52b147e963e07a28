"""The launcher outlives what its workers outlive: storage that refuses connections, the
Prefect API going away and coming back, a second launcher of the same run, its own
death (its workers die with it; a relaunch stops what its predecessor left), a paused
syncer. Real servers throughout: moto's S3 behind a forwarder that can refuse
connections, Prefect servers of the test's own where one is killed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import fsspec
import pytest
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_progress_artifact
from prefect.task_runners import ThreadPoolTaskRunner

from diloco.config import load_config
from flows.launcher import Monitor, _watch
from flows.run import initialize_run
from infra.local_servers import Forwarder
from infra.prefect_server import free_port, server_env, wait_healthy
from storage_layout.store import RunStore


def until(check, what: str, timeout: float = 300.0):
    """Wait for ``check()`` to be true (driven by what the code under test does; the
    timeout only ends a test that would otherwise hang)."""
    deadline = time.monotonic() + timeout
    while not (found := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return found


def test_the_launcher_watches_on_while_s3_refuses_connections(prefect_api, s3_server, caplog):
    """Defect: S3 refusing connections for 30 s ended the run: botocore's
    EndpointConnectionError (no OSError) escaped the watch and the launcher interrupted
    every worker. The watch now logs it by name, once, goes on, notices the storage back
    and ends with a summary."""
    bucket = f"outage-{uuid.uuid4().hex[:10]}"
    fsspec.filesystem("s3").mkdir(bucket)
    regions = {"us-east": f"s3://{bucket}"}
    cfg = load_config("tiny", overrides=["budget.tokens=20000"])
    initialize_run(RunStore("outage", regions, "us-east"), cfg)
    proxy = Forwarder(s3_server.removeprefix("http://")).start()
    # The launcher's view of the bucket goes through the forwarder (one attempt per
    # request: botocore's own retries would only make the outage slower to see).
    options = {"endpoint_url": proxy.url, "config_kwargs": {"retries": {"max_attempts": 1}}}
    store = RunStore("outage", regions, "us-east", writer="launcher",
                     storage_options={"us-east": options})  # fmt: skip
    monitor = Monitor(store, cfg, store.read_spec())

    @task
    def worker() -> int:
        proxy.stop()  # S3 refuses connections ...
        until(lambda: monitor.errors >= 6, "the watch to look through the outage")
        proxy.start()  # ... and is back, on the same port
        until(lambda: monitor.down_since is None, "the watch to see the storage back")
        return 0

    @flow(task_runner=ThreadPoolTaskRunner(max_workers=2))
    def launch() -> tuple[dict, dict]:
        bar = create_progress_artifact(0.0)
        ended = _watch(["learner us-east/0"], [worker.submit()], monitor, bar, 0.05,
                       get_run_logger())  # fmt: skip
        return ended, monitor.summary(1.0, 1.0)

    try:
        with caplog.at_level("WARNING"):
            ended, summary = launch()
    finally:
        proxy.stop()
    assert list(ended) == ["learner us-east/0"]
    assert summary["run"] == "outage" and summary["versions"] == {0: 0, 1: 0}
    named = [r.getMessage() for r in caplog.records if "EndpointConnectionError" in r.getMessage()]
    assert named and all("the watch goes on" in m for m in named), named
    assert len(named) <= 3, named  # rate-limited: once per kind and per what was read
    assert any("storage answers again" in r.getMessage() for r in caplog.records)


class OwnPrefectServer:
    """A Prefect server of this test's own (its own PREFECT_HOME and port), that it may
    kill and start again on the same port and database: never the session's."""

    def __init__(self, home: Path):
        self.home, self.port, self.proc = home, free_port(), None
        self.url = f"http://127.0.0.1:{self.port}/api"

    def start(self) -> OwnPrefectServer:
        self.home.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                "--port", str(self.port), "--no-scheduler", "--no-late-runs"]  # fmt: skip
        with (self.home / "server.log").open("ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                         env=server_env(self.home), start_new_session=True)  # fmt: skip
        wait_healthy(self.url, self.proc, self.home / "server.log", timeout=180)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _started(log: Path) -> dict[str, int]:
    """The newest pid of each worker ("learner 1", "syncer 0") the launcher's log names."""
    text = log.read_text(errors="replace") if log.exists() else ""
    found = re.findall(r"(learner|syncer) [\w-]+/(\d+) started \(pid (\d+)", text)
    return {f"{role} {index}": int(pid) for role, index, pid in found}


PIPELINE = {"round_steps": 20, "rounds_per_flow_run": 2, "checkpoint_every": 20,
            "poll_seconds": 0.1, "eval_seconds": 2.0, "syncer_shards": 1,
            "max_failed_starts": 2, "spares": 0}  # fmt: skip


def _train(root: Path, run: str, tokens: int, env: dict[str, str], *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "flows.cli", "train", "--dir", str(root), "--run", run,
            "--tokens", str(tokens), *extra]  # fmt: skip
    argv += [f"--set=pipeline.{k}={v}" for k, v in PIPELINE.items()]
    out = (root / f"{run}.log").open("ab")
    return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)


@pytest.mark.slow
def test_a_run_outlives_its_prefect_server_killed_and_restarted(tmp_path):
    """Defect: with the Prefect server killed mid-run, worker restarts failed to reach
    the API and counted towards giving up, and the launcher's flow crashed and hung
    without a summary. A restart now waits for the API, counts no crash, and the run
    ends with its summary once the server is back."""
    server = OwnPrefectServer(tmp_path / "prefect").start()
    env = {**os.environ, "PREFECT_API_URL": server.url, "PREFECT_HOME": str(server.home)}
    root, run = tmp_path / "runs", "api"
    root.mkdir()
    proc = _train(root, run, 200_000, env)
    log = root / f"{run}.log"
    regions = {r: f"file://{root / run / 'buckets' / r}" for r in ("us-east", "eu-west")}
    try:
        store = until(lambda: (root / run / "buckets" / "us-east" / run / "spec.json").exists()
                      and RunStore(run, regions, "us-east"), "the run's spec")  # fmt: skip
        until(lambda: (store.latest_global(0) or 0) >= 1, "the first merged version")
        server.kill()  # the API goes away mid-run ...
        os.kill(_started(log)["learner 1"], signal.SIGKILL)  # ... and a restart needs it
        until(lambda: "the Prefect API at" in log.read_text() or proc.poll() is not None,
              "the launcher to wait for the API")  # fmt: skip
        server.start()  # the same port and database
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
        server.kill()
    output = log.read_text()
    assert code == 0, output[-4000:]
    assert "is unreachable; waiting for it before starting learner eu-west/1 again" in output
    assert "gave up" not in output and "failed without progress" not in output
    summary = json.loads((root / run / "summary.json").read_text())
    assert summary["failed"] == [] and set(summary["learner_states"].values()) == {"done"}
