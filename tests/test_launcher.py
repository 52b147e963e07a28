"""The launcher outlives what its workers outlive: storage that refuses connections, the
Prefect API going away and coming back, a second launcher of the same run, its own
death (its workers die with it; a relaunch stops what its predecessor left), a paused
syncer. Real servers throughout: moto's S3 behind a forwarder that can refuse
connections, Prefect servers of the test's own where one is killed."""

from __future__ import annotations

import time
import uuid

import fsspec
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_progress_artifact
from prefect.task_runners import ThreadPoolTaskRunner

from diloco.config import load_config
from flows.launcher import Monitor, _watch
from flows.run import initialize_run
from infra.local_servers import Forwarder
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
