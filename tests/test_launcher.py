"""The launcher outlives what its workers outlive: storage that refuses connections, the
Prefect API going away and coming back, a second launcher of the same run, its own
death (its workers die with it; a relaunch stops what its predecessor left), a paused
syncer. Real servers throughout: moto's S3 behind a forwarder that can refuse
connections, Prefect servers of the test's own where one is killed."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import fsspec
import httpx
import pytest
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_progress_artifact
from prefect.task_runners import ThreadPoolTaskRunner

from diloco.config import load_config
from diloco.liveness import Verdict
from flows import run_lock
from flows.monitor import Monitor
from flows.pace import MEMBERS_EVERY
from flows.run import Run, initialize_run
from flows.run_lock import RunLock, RunLocked
from flows.summary import run_summary
from flows.supervision import stop_predecessors
from flows.watch import watch
from flows.worker import PARENT_ENV
from infra.local_servers import Forwarder
from infra.prefect_server import free_port, prefect_server, server_env, wait_healthy
from infra.processes import command_line, environment_holds, write_pids
from protocol.topology import run_slots
from storage_layout.audit import audit_run
from storage_layout.auth import claims_key, new_run_secret
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
    monitor = Monitor(
        Run(store.run, store.urls, store.client_region, store.read_spec(), cfg), store
    )

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
        ended = watch(["learner us-east/0"], [worker.submit()], monitor, bar, 0.05,
                       get_run_logger())  # fmt: skip
        return ended, run_summary(monitor, 1.0, 1.0)

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
                                         env=server_env(self.home, self.port), start_new_session=True)  # fmt: skip
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


# Liveness limits far below a slowed learner's round: silent after 3 s without a beat.
FAST_LIVENESS = ["--set=liveness.heartbeat_seconds=0.5", "--set=liveness.silent_min_seconds=2",
                 "--set=liveness.silent_max_seconds=3"]  # fmt: skip


def _train(root: Path, run: str, tokens: int, env: dict[str, str], log: Path,
           learners: int = 4, sets: tuple[str, ...] = (),
           **pipeline: object) -> subprocess.Popen:  # fmt: skip
    """`diloco train` of ``run`` under ``root`` (``learners`` of the tiny preset, dealt to
    us-east and eu-west in turn, ``sets`` laid over), its output to ``log``."""
    argv = [sys.executable, "-m", "flows.cli", "train", "--dir", str(root), "--run", run,
            "--tokens", str(tokens), f"--set=topology.learners={learners}", *sets]  # fmt: skip
    argv += [f"--set=pipeline.{k}={v}" for k, v in {**PIPELINE, **pipeline}.items()]
    with log.open("ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)


def _lock_run(tmp_path: Path, run: str = "locked") -> RunStore:
    (tmp_path / "us").mkdir(parents=True, exist_ok=True)
    regions = {"us-east": f"file://{tmp_path / 'us'}"}
    store = RunStore(run, regions, "us-east", writer="launcher")
    initialize_run(store, load_config("tiny", overrides=["budget.tokens=20000"]))
    return store


def _foreign_claim(store: RunStore, claim: int, age: float, host: str = "elsewhere",
                   pid: int = 1) -> None:  # fmt: skip
    """A launcher's claim as another process would have written it, renewed ``age`` s ago."""
    body = {"claim": claim, "host": host, "pid": pid, "time": time.time() - age, "nonce": "x"}
    key = f"{store.layout.launcher_claims()}/s{claim:012d}.json"
    store.home.put_exclusive(key, json.dumps(body).encode())
    store.home.put(store.layout.launcher_lease(claim), json.dumps(body).encode())


def test_one_launcher_per_run_a_second_is_refused_by_name_and_a_stale_one_taken_over(
    tmp_path, monkeypatch
):
    """Defect: two launchers of one run both ran (two Prefect servers on one database,
    learners fencing each other all run long). The run's lock in its home bucket refuses
    a second launcher, naming the first, and of two started at the same moment exactly
    one gets the run; a launcher that died is taken over once its lease is stale (at
    once on its own host), and the one taken over learns it and stops."""
    monkeypatch.setattr(run_lock, "RENEW_SECONDS", 0.05)
    store = _lock_run(tmp_path)
    first = RunLock(store).acquire()
    with pytest.raises(RunLocked, match=r"run 'locked' is already running: launcher pid "
                       rf"{os.getpid()} on host .* \(claim 1\), lease renewed \d+ s ago"):  # fmt: skip
        RunLock(RunStore("locked", store.urls, "us-east")).acquire()
    first.release()
    again = RunLock(store).acquire()  # released: the next one starts at once
    assert again.claim == 2
    again.release()

    # Two at the same moment: one claim, one clear refusal.
    racers = [RunLock(RunStore("locked", store.urls, "us-east")) for _ in range(2)]
    results: list[object] = []
    barrier = threading.Barrier(2)

    def race(lock: RunLock) -> None:
        barrier.wait()
        try:
            results.append(lock.acquire())
        except RunLocked as exc:
            results.append(exc)

    threads = [threading.Thread(target=race, args=(lock,)) for lock in racers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [r for r in results if isinstance(r, RunLock)]
    lost = [r for r in results if isinstance(r, RunLocked)]
    assert len(won) == 1 and len(lost) == 1, results
    assert "run 'locked'" in str(lost[0]) and "launcher pid" in str(lost[0])
    won[0].release()

    # Another host's launcher: live while its lease is fresh, taken over once stale.
    _foreign_claim(store, 4, age=1.0)
    with pytest.raises(RunLocked, match="on host elsewhere"):
        RunLock(store).acquire()
    other = _lock_run(tmp_path / "b", "stale")
    _foreign_claim(other, 1, age=run_lock.LEASE_SECONDS + 1)
    taken = RunLock(other).acquire()
    assert taken.claim == 2
    taken.release()
    # A dead process of this host: at once.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    third = _lock_run(tmp_path / "c", "dead")
    _foreign_claim(third, 1, age=0.0, host=socket.gethostname(), pid=dead.pid)
    assert RunLock(third).acquire().claim == 2

    # The launcher taken over (its lease went stale while it could not renew) is told.
    lost_to: list[str] = []
    old = RunLock(RunStore("fenced", store.urls, "us-east"), on_lost=lost_to.append)
    _lock_run(tmp_path, "fenced")
    old.acquire()
    _foreign_claim(old.store, 2, age=0.0)  # another host took it over
    until(lambda: lost_to, "the old launcher to be told")
    assert "host elsewhere (claim 2)" in lost_to[0] and old.lost == lost_to[0]
    old.release()


def _claim_body(claim: int, age: float) -> bytes:
    return json.dumps({"claim": claim, "host": "elsewhere", "pid": 1,
                       "time": time.time() - age, "nonce": "x"}).encode()  # fmt: skip


@pytest.mark.parametrize(
    ("n", "body"),
    [(999999999999, lambda: _claim_body(1, 0.0)),  # as far ahead as a key can be numbered
     (7, lambda: _claim_body(7, -30 * 365 * 86400.0)),  # dated 30 years ahead
     (5, lambda: b"[1, 2]"), (6, lambda: b'{"time": "soon"}'), (8, lambda: b"[" * 100_000)],
)  # fmt: skip
def test_a_forged_lock_claim_neither_blocks_a_launch_nor_takes_the_run(tmp_path, n, body, caplog):
    """Defect: a forged claim ``s999999999999`` made every launch fail with a raw
    ``LayoutError``, and one dated 30 years ahead held the run locked for ever. A claim
    that does not read as one (of another number, from the future, malformed) is named
    and passed over; the launch takes the next free number."""
    store = _lock_run(tmp_path)
    RunLock(store).acquire().release()
    store.home.put_exclusive(f"{store.layout.launcher_claims()}/s{n:012d}.json", body())
    lock = RunLock(RunStore("locked", store.urls, "us-east")).acquire()
    assert lock.claim == 2
    lock.release()
    assert f"s{n:012d}.json" in caplog.text


def test_where_the_launcher_holds_the_run_secret_no_object_put_by_someone_else_is_a_claim(
    tmp_path, caplog
):
    """Issue 56: a lock claim written by someone without the run's key, even a well-formed
    one of the very number a launcher would take next and a live holder, neither blocks a
    launch nor holds the run: lock claims and their leases are tagged with the run's claims
    key (``storage_layout.auth``), and an object without the tag is named and passed over.
    The launch then takes that same number, under its own tag."""
    key = claims_key(new_run_secret(), "locked")
    store = _lock_run(tmp_path)
    store.claims_key = key
    RunLock(store).acquire().release()
    prefix = store.layout.launcher_claims()
    forged = _claim_body(2, -5.0)  # claim 2, renewed just now, by a live launcher elsewhere
    for name in ("s000000000002.json", "s000000000002.0123456789abcdef.json"):
        store.home.put_exclusive(f"{prefix}/{name}", forged)
        store.home.put(f"{store.layout.launcher_lease(2)}.json", forged)
    lock = RunLock(RunStore("locked", store.urls, "us-east", claims_key=key)).acquire()
    assert lock.claim == 2 and store.home.exists(store.numbered_claim(prefix, 2))
    with pytest.raises(RunLocked, match="claim 2"):  # the real claim 2 holds the run
        RunLock(RunStore("locked", store.urls, "us-east", claims_key=key)).acquire()
    lock.release()
    assert "s000000000002.0123456789abcdef.json" in caplog.text


def test_a_relaunch_stops_the_workers_its_dead_predecessor_left(tmp_path, caplog):
    """Defect: a killed launcher's workers trained on unsupervised beside its successor's.
    The launcher records its workers' pids in the run's folder; the next launcher stops
    each that is still a worker of that launcher (a pid reused by another program, or by
    another run's worker, is left alone)."""
    pids = tmp_path / "pids.json"
    # The launcher that recorded them: this process (a worker whose recorded parent is
    # not its parent stops at once; so they must be this one's children).
    env = {**os.environ, PARENT_ENV: str(os.getpid())}
    worker = subprocess.Popen([sys.executable, "-m", "flows.worker", "standby"],
                              stdin=subprocess.PIPE, start_new_session=True, env=env)  # fmt: skip
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env)
    another_runs = subprocess.Popen([sys.executable, "-m", "flows.worker", "standby"],
                                    stdin=subprocess.PIPE)  # fmt: skip
    procs = (worker, other, another_runs)
    try:
        write_pids(pids, {"learner us-east/0": worker.pid, "syncer us-east/0": other.pid,
                          "learner us-east/2": another_runs.pid, PARENT_ENV: os.getpid()})  # fmt: skip
        until(lambda: all("flows.worker" in command_line(p.pid) for p in (worker, another_runs)),
              "the workers to start")  # fmt: skip
        with caplog.at_level("WARNING"):
            stop_predecessors(pids, logging.getLogger("test"))
        assert worker.wait(timeout=60) != 0
        assert other.poll() is None  # not a worker: not ours to stop
        assert another_runs.poll() is None  # a worker, but not of that launcher
        messages = [r.getMessage() for r in caplog.records]
        assert any(f"learner us-east/0 (pid {worker.pid})" in m for m in messages), messages
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_prefect_server_left_by_a_dead_launcher_is_stopped_before_another_starts(tmp_path):
    """Defect: a killed launcher's Prefect server was never stopped, and the next one
    shared its database. A server left in the run's Prefect home (its pid file) is stopped
    before a new one starts there."""
    home = tmp_path / "prefect"
    left = OwnPrefectServer(home).start()
    write_pids(home / "server.pid", {"server": left.proc.pid})
    try:
        with prefect_server(home) as url:
            assert left.proc.poll() is not None  # stopped
            assert url != left.url and httpx.get(f"{url}/health").status_code == 200
        assert not (home / "server.pid").exists()
    finally:
        left.kill()


TURNS_TOKENS = 120_000  # a 2-learner run long enough for two versions before its stop


@pytest.mark.slow
def test_a_runs_launchers_one_refused_one_stopped_one_killed_and_the_last_resumes_it(tmp_path):
    """One run's launchers in turn, on the run's own Prefect server:

    - two `diloco train` of the run started together (defect: the second died with a raw
      SQLite traceback, or, later, both ran): one is refused by name;
    - a user's Ctrl-C (SIGINT) to the one that runs, once versions are published: it
      exits 130 saying how to resume, no worker outlives it, and its flow run ends
      Cancelled (defect: it ended Crashed, "Crash detected!", an error in the log and in
      the Prefect UI);
    - the same command again, SIGKILLed once its workers run (defect: its Prefect server
      and workers ran on unsupervised): its workers and server die with it, and no other
      process of the run's Prefect home is left;
    - the same command once more takes the run over at once (its predecessor is gone)
      and finishes it: the summary keeps the run's first loss, and the audit finds every
      contribution merged once across the stop and the kill."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    root, run = tmp_path / "runs", "turns"
    root.mkdir()
    regions = {r: f"file://{root / run / 'buckets' / r}" for r in ("us-east", "eu-west")}
    procs = {name: _train(root, run, TURNS_TOKENS, env, root / f"{name}.log", learners=2)
             for name in "ab"}  # fmt: skip
    left: list[int] = []
    try:
        first = until(lambda: next((n for n, p in procs.items() if p.poll() is not None), None),
                      "one of the two launchers to end")  # fmt: skip
        name = "b" if first == "a" else "a"
        loser, winner, log = procs[first], procs[name], root / f"{name}.log"
        output = (root / f"{first}.log").read_text()
        assert loser.returncode == 2, output[-3000:]
        assert f"run '{run}' is already running: launcher pid {winner.pid}" in output or (
            f"run '{run}' was claimed by another launcher at the same moment" in output
        ), output[-3000:]
        assert "Traceback" not in output and "sqlite" not in output.lower()
        store = until(lambda: (root / run / "buckets" / "us-east" / run / "spec.json").exists()
                      and RunStore(run, regions, "us-east"), "the run's spec")  # fmt: skip
        until(lambda: (store.versions.latest_global(0) or 0) >= 2, "two versions of fragment 0")
        workers = _started(log)
        winner.send_signal(signal.SIGINT)
        code = winner.wait(timeout=300)
        output = log.read_text()
        assert code == 130, output[-3000:]
        assert f"resume with the same command (run '{run}')" in output, output[-3000:]
        assert f"Flow run 'train {run}' - Finished in state Cancelled(" in output, output[-3000:]
        assert "Crash detected" not in output and "Traceback" not in output, output[-3000:]
        assert len(workers) == 3 and not any(command_line(pid) for pid in workers.values())
        assert not (root / run / "summary.json").exists()

        procs["c"] = killed = _train(root, run, TURNS_TOKENS, env, root / "c.log", learners=2)
        workers = until(lambda: len(found := _started(root / "c.log")) == 3 and found,
                        "the relaunch's 2 learners and its syncer")  # fmt: skip
        server = json.loads((root / run / "prefect" / "server.pid").read_text())["server"]
        left = [*workers.values(), server]
        assert all(command_line(pid) for pid in left)
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        until(lambda: not any(command_line(pid) for pid in left),
              "the killed launcher's workers and server to die with it", timeout=120)  # fmt: skip
        # nor any other process of the run's Prefect home: the launcher's own Prefect used
        # to start an ephemeral server of its own on the run's database, which outlived it
        home = f"PREFECT_HOME={(root / run / 'prefect').resolve()}"
        mine = [int(d) for d in os.listdir("/proc") if d.isdigit()
                and int(d) != os.getpid() and environment_holds(int(d), home)]  # fmt: skip
        left += mine
        assert not [command_line(pid) for pid in mine if command_line(pid)]

        procs["d"] = _train(root, run, TURNS_TOKENS, env, root / "d.log", learners=2)
        code = procs["d"].wait(timeout=600)
        output = (root / "d.log").read_text()
        assert code == 0, output[-4000:]
        assert "already running" not in output
        summary = json.loads((root / run / "summary.json").read_text())
        assert summary["failed"] == [] and set(summary["learner_states"].values()) == {"done"}
        assert summary["tokens"] >= TURNS_TOKENS and "this launch began at" in output
        report = audit_run(run, regions)
        assert report.ok, dict(report.violations)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=120)
        for pid in left:  # what a failed test left
            if "flows.worker" in command_line(pid) or "prefect" in command_line(pid):
                os.kill(pid, signal.SIGKILL)


def _state(pid: int) -> str:
    """A process's state letter (``T``: stopped), '' once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
    except (OSError, IndexError):
        return ""


@pytest.mark.slow
def test_a_run_outlives_its_prefect_server_killed_and_a_paused_syncer(tmp_path):
    """One run, two faults in turn (the launcher watching throughout):

    - its Prefect server killed mid-run, and a learner with it, whose restart needs the
      API (defect: worker restarts failed to reach the API and counted towards giving
      up, and the launcher's flow crashed and hung without a summary): the restart
      waits for the API, counts no crash, and the run ends with its summary once the
      server is back;
    - a syncer paused (SIGSTOP) once the server is back (defect: it froze its fragments
      while the learners trained on, and nothing said so): the launcher names it once
      its fragments have had no new version for ``stall_seconds`` while the learners
      trained, and starts a stand-by that publishes the next versions while it is still
      paused; when it wakes, the commit protocol fences the two: the audit finds every
      contribution merged once.

    And a slow learner is not a dead one: learner 3 is slowed 100 times, so that its
    rounds (and its status, written once a round) take longer than the run's silence
    limit (3 s): its heartbeat keeps it a member, and no learner is ever fenced."""
    server = OwnPrefectServer(tmp_path / "prefect").start()
    env = {**os.environ, "PREFECT_API_URL": server.url, "PREFECT_HOME": str(server.home)}
    root, run = tmp_path / "runs", "paused"
    root.mkdir()
    log = root / "train.log"
    proc = _train(root, run, 300_000, env, log, stall_seconds=10,
                  sets=(*FAST_LIVENESS, "--set=pipeline.speeds=[1,1,1,100]"))  # fmt: skip
    regions = {r: f"file://{root / run / 'buckets' / r}" for r in ("us-east", "eu-west")}
    paused = None
    try:
        store = until(lambda: (root / run / "buckets" / "us-east" / run / "spec.json").exists()
                      and RunStore(run, regions, "us-east"), "the run's spec")  # fmt: skip
        until(lambda: (store.versions.latest_global(0) or 0) >= 1, "the first merged version")
        server.kill()  # the API goes away mid-run ...
        killed = _started(log)["learner 1"]
        os.kill(killed, signal.SIGKILL)  # ... and a restart needs it
        until(lambda: "the Prefect API at" in log.read_text() or proc.poll() is not None,
              "the launcher to wait for the API")  # fmt: skip
        server.start()  # the same port and database
        until(lambda: _started(log)["learner 1"] != killed or proc.poll() is not None,
              "learner 1 started again")  # fmt: skip
        paused = _started(log)["syncer 0"]
        os.kill(paused, signal.SIGSTOP)
        frozen = store.versions.latest_global(0)
        until(lambda: "syncer us-east/0 has published no version of fragments [0, 1]" in log.read_text(),
              "the launcher to name the paused syncer")  # fmt: skip
        # and the workers' table (a Prefect artifact, as the terminal shows it) says so, at
        # the versions it was named stalled at (an update the API's outage held up may
        # show an older table first)
        newest = re.findall(r"newest (f0:v\d+ f1:v\d+)\)", log.read_text())[-1]
        row = until(lambda: _worker_row(server.url, run, "syncer us-east/0", "stalled", newest),
                    f"the workers' table to name the paused syncer at {newest}")  # fmt: skip
        assert row["age"].endswith(" ago"), row
        # A stand-by publishes while the paused one is still stopped.
        until(lambda: (store.versions.latest_global(0) or 0) > frozen or proc.poll() is not None,
              "a version from the stand-by")  # fmt: skip
        assert _state(paused) == "T" and store.versions.latest_global(0) > frozen
        os.kill(paused, signal.SIGCONT)
        code = proc.wait(timeout=600)
    finally:
        _wake_and_stop([paused] if paused is not None else [], proc)
        server.kill()
    output = log.read_text()
    assert code == 0, output[-4000:]
    # The restart waited for the API: before starting it (found away), or once the new
    # process, forked at once from the zygote, found it away and exited 75; never a crash.
    assert ("is unreachable; waiting for it before starting learner eu-west/1 again" in output
            or "exiting with status 75 (the launcher waits for it)" in _logs(root / run / "logs")
            ), output[-4000:]  # fmt: skip
    assert "gave up" not in output and "failed without progress" not in output
    assert "syncer us-east/0: starting a stand-by for fragments [0, 1]" in output
    assert output.count("starting a stand-by") == 1, output[-4000:]  # one while it lives
    summary = json.loads((root / run / "summary.json").read_text())
    assert summary["failed"] == [] and set(summary["learner_states"].values()) == {"done"}
    # Its progress lines say how fast it goes and how long it has left (diloco.rate).
    assert re.search(r"\d% \| tokens [\d,]+ at [\d,]+/s \| (\d+ s|\d+ min \d\d s) left \|",
                     output), output[-3000:]  # fmt: skip
    report = audit_run(run, regions)
    assert report.ok, dict(report.violations)
    slow = RunStore(run, regions, "eu-west")  # learner-3 lives in eu-west
    rows, _ = slow.progress.get_rounds("learner-3", slow.progress.history_rounds("learner-3"))
    rounds = [r["seconds"] for r in rows]
    logs = _logs(root / run / "logs")
    for lid, region in run_slots(slow.read_spec()).items():
        # Learner 1 was killed, and any learner may have reached the end of a flow run
        # while the API was away (its process then exits 75): out until the API was
        # back, these may be fenced.
        out = _logs(root / run / "logs", f"learner-*-{lid.removeprefix('learner-')}.log")
        if lid == "learner-1" or "exiting with status 75" in out:
            continue
        own = RunStore(run, regions, region)
        fences = [g for g in range(1, own.members.newest_generation(lid) + 1)
                  if "fence" in (own.members.generation(lid, g) or {})]  # fmt: skip
        assert fences == [], (lid, fences, rounds)
        # (one not started yet, with no heartbeat, may be: as a vacant slot)
        assert f"{lid} is not counted towards the quorum: no heartbeat for" not in logs, rounds


def _worker_row(api: str, run: str, worker: str, state: str, at: str) -> dict | None:
    """The row of ``worker`` in the run's workers' table artifact, if it is in ``state``
    ``at`` those versions."""
    body = {"artifacts": {"key": {"any_": [f"{run}-workers"]}}, "limit": 1, "offset": 0}
    try:
        found = httpx.post(f"{api}/artifacts/filter", json=body, timeout=10).json()
    except httpx.HTTPError:
        return None
    rows = json.loads(found[0]["data"]) if found else []
    return next((r for r in rows if (r["worker"], r["state"], r["at"]) == (worker, state, at)),
                None)  # fmt: skip


def _wake_and_stop(paused: list[int], proc: subprocess.Popen) -> None:
    """After a test: wake the workers it paused, and stop its `diloco train` if it runs."""
    for pid in paused:
        if _state(pid):
            os.kill(pid, signal.SIGCONT)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)


def _logs(folder: Path, pattern: str = "*.log") -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(folder.glob(pattern)))


@pytest.mark.slow
def test_a_run_whose_every_learner_hangs_ends_with_a_named_error(prefect_api, tmp_path):
    """Both learners hung (SIGSTOP: their processes alive, their heartbeats stopped) once
    versions are out: the syncers take them for silent and fence them; the
    launcher, seeing no new version, says why in one line instead of the progress line
    (who is fenced or silent), and, nobody being there to take the slots, ends the run with a named
    error rather than waiting for ever; the workers are stopped."""
    root, run = tmp_path / "runs", "hung"
    root.mkdir()
    log = root / "train.log"
    # A short outer round (H = 2): the run is called standing still after 3 rounds without
    # a version (and a silence), which at H = 10 on a busy machine is a minute and more.
    proc = _train(root, run, 50_000_000, dict(os.environ), log, learners=2, stall_seconds=2,
                  sets=(*FAST_LIVENESS, "--set=topology.inner_steps=2"))  # fmt: skip
    regions = {r: f"file://{root / run / 'buckets' / r}" for r in ("us-east", "eu-west")}
    hung: list[int] = []
    try:
        store = until(lambda: (root / run / "buckets" / "us-east" / run / "spec.json").exists()
                      and RunStore(run, regions, "us-east"), "the run's spec")  # fmt: skip
        # Several versions in: the learners' step time, which the wait scales with, is
        # measured past their slow first steps by then.
        until(lambda: (store.versions.latest_global(0) or 0) >= 6, "six versions of fragment 0")
        until(lambda: all(store.members.read_heartbeat(lid, r) for lid, r in run_slots(store.read_spec()).items()),
              "both learners to beat (a process hung before its first beat is only named)")  # fmt: skip
        hung = [pid for name, pid in _started(log).items() if name.startswith("learner")]
        for pid in hung:
            os.kill(pid, signal.SIGSTOP)
        code = proc.wait(timeout=300)  # a guard against a hang
    finally:
        _wake_and_stop(hung, proc)
    output = log.read_text()
    assert code == 1, output[-4000:]
    said = " ".join(output.split())
    assert "the run cannot make progress by itself: no new version for" in said, said[-4000:]
    for lid in ("learner-0", "learner-1"):  # fenced once a syncer has given its data back
        assert re.search(rf"{lid} (fenced|silent) \(no heartbeat for", said), said[-4000:]
    assert re.search(r"\| no new version for \d+ s .*learner-1 (fenced|silent)", said), said[-4000:]
    assert "Traceback" not in output, output[-4000:]


def test_a_syncer_is_called_stalled_only_while_the_learners_train_past_its_versions(
    tmp_path, caplog
):
    """The rule behind the paused-syncer warning: a shard whose fragments have had no new
    version for ``stall_seconds`` while a quorum of the members' steps went up is named,
    once per stall; not while the learners stand still (starting, or all done) or fewer
    than a quorum of the members train (the others compiling), and it is said when it
    publishes again. Silent learners are no members: one learner beside them is a
    quorum."""
    store = _lock_run(tmp_path, "stall")
    cfg = load_config("tiny", overrides=["budget.tokens=20000", "pipeline.stall_seconds=0.01",
                                         "pipeline.syncer_shards=2"])  # fmt: skip

    def monitor() -> Monitor:
        return Monitor(Run(store.run, store.urls, store.client_region, store.read_spec(), cfg),
                       store)  # fmt: skip

    learners = list(run_slots(store.read_spec()))

    def steps(n: int, state: str = "training") -> dict:
        return {lid: {"step": n, "state": state} for lid in learners}

    def stalled(m: Monitor, statuses: dict, versions: dict, silent=()) -> list[str]:
        verdicts = {k: Verdict("silent", "no heartbeat") if k in silent else Verdict(s["state"])
                    for k, s in statuses.items()}  # fmt: skip
        return m.stalled_syncers(statuses, versions, verdicts)

    versions, one = {0: 1, 1: 1}, monitor()
    assert stalled(one, steps(10), versions) == []  # first sight
    time.sleep(0.05)  # past stall_seconds
    assert stalled(one, steps(10), versions) == []  # nobody trained since
    assert stalled(one, steps(10, "done"), versions) == []
    # One learner trained while the others still start: the syncer waits for its quorum.
    alone = {**steps(10), learners[0]: {"step": 50, "state": "training"}}
    assert stalled(one, alone, versions) == []
    with caplog.at_level("WARNING"):
        assert stalled(one, steps(12), versions) == ["syncer us-east/0", "syncer us-east/1"]
        assert stalled(one, steps(14), versions) == []  # named once per stall
        assert stalled(one, steps(16), {0: 2, 1: 1}) == []
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("syncer us-east/0 has published no version of fragments [0]")
               and "while the learners trained 8 steps" in m for m in messages), messages  # fmt: skip
    assert "syncer us-east/0 publishes again (versions f0:v2)" in messages
    assert one.stalled == {"syncer us-east/1"}
    other = monitor()
    assert stalled(other, steps(10), versions) == []
    time.sleep(0.05)
    assert stalled(other, alone, versions, silent=learners[1:]) == ["syncer us-east/0",
                                                                     "syncer us-east/1"]  # fmt: skip


def test_the_one_restart_policy_resets_on_progress_and_gives_a_worker_up_by_name(tmp_path):
    """``Restarts``, as both launch modes use it (here counting a deployment's flow runs):
    crashes in a row are counted, progress read from the bucket (a new version of the
    shard's fragment) starts the count again, and the limit gives the worker up, named
    with its last failure and recorded for the syncers."""
    import numpy as np

    from flows.supervision import Restarts

    (tmp_path / "us").mkdir()
    store = RunStore("r", {"us": f"file://{tmp_path / 'us'}"}, "us", writer="launcher")
    store.ensure_spec({"learners": {"learner-0": "us"}, "fragments": [["w"]]})
    stopping = threading.Event()
    stopping.set()  # (the backoff waits on it: no wait in a test)
    restarts = Restarts("syncer us/0", store, ("syncer-0", "us", [0]), 3,
                        logging.getLogger("t"), stopping, unit="flow runs")  # fmt: skip
    failed = []
    for attempt in range(4):
        restarts.start()
        if attempt == 1:  # this start got somewhere: version 0 of its fragment
            store.versions.publish_global(
                0, 0, {"w": np.ones(4, np.float32)}, [], {"weights": {}}, "bf16"
            )
        try:
            restarts.crashed(f"flow run {attempt} ended Crashed", ended="ended CRASHED")
        except RuntimeError as exc:
            failed.append(str(exc))
        assert restarts.failed == [1, 1, 2, 3][attempt]
    assert failed == ["syncer us/0: 3 flow runs in a row ended CRASHED without progress; "
                      "last: flow run 3 ended Crashed"]  # fmt: skip
    assert (
        "flow run 3 ended Crashed"
        in store.progress.read_metrics("launcher")["given_up"]["syncer-0"]
    )
    assert restarts.delay == 8.0  # 2 s doubling, started again by the progress


def test_a_run_that_gave_a_worker_up_ends_failed_naming_it_never_completed(prefect_api, tmp_path):
    """Defect: a launch that gave workers up ended its flow run Completed (green in the
    UI), its summary silent about them. Here each learner's node is misconfigured (a
    preemption notice source that names none) and fails every start before it trains:
    both are given up, the syncers stop waiting for them and the run ends; the train
    flow run ends Failed naming each with why, the summary lists them, `diloco train`
    says so and exits 1; each is named as it is given up, with its region left empty."""
    root, run = tmp_path / "runs", "given-up"
    root.mkdir()
    log = root / "train.log"
    env = {**os.environ, "DILOCO_PREEMPTION_NOTICE": "nowhere"}
    code = _train(root, run, 40_000, env, log, learners=2).wait(timeout=600)  # a hang's guard
    output = log.read_text()
    said = " ".join(output.split())
    assert code == 1, output[-4000:]
    for name in ("learner us-east/0", "learner eu-west/1"):
        assert f"gave up on {name}: 2 starts in a row failed without progress" in said, said[-4000:]
    assert re.search(r"Finished in state Failed\('gave up on learner us-east/0 \(2 starts in "
                     r"a row failed .*\); learner eu-west/1 \(2 starts", said), said[-4000:]  # fmt: skip
    assert "is not a preemption notice source" in said, said[-4000:]
    for region in ("us-east", "eu-west"):  # said as it happened, not only at the end
        assert re.search(rf"ERROR .* gave up on learner {region}/\d \(2 starts in a row failed"
                         rf"[^)]*\): the run goes on without it; region {region} has no "
                         "learner left", said), said[-4000:]  # fmt: skip
    summary = json.loads((root / run / "summary.json").read_text())
    assert sorted(summary["failed"]) == ["learner eu-west/1", "learner us-east/0"], summary
    assert "syncer us-east/0" not in summary["given_up"], summary["given_up"]
    assert summary["learner_states"] == {"learner-0": "given up", "learner-1": "given up"}


def test_a_resume_keeps_the_runs_home_whatever_order_its_regions_come_in(tmp_path):
    """A launcher run again by a Prefect automation gets its regions as a JSON object
    sorted by name (seen: eu-west before us-east, and the resumed run refused as "started
    with another spec"): the run's regions are put back in the order its spec records,
    its home first, wherever one region can be read; a new run keeps the order given."""
    from flows.spec import in_run_order

    urls = {r: f"file://{tmp_path / r}" for r in ("us-east", "eu-west", "ap-south")}
    for url in urls.values():
        Path(url.removeprefix("file://")).mkdir()
    given = {r: urls[r] for r in sorted(urls)}  # ap-south, eu-west, us-east
    assert list(in_run_order("new", given)) == ["ap-south", "eu-west", "us-east"]
    spec = {"regions": urls, "home": "us-east", "deal": ["us-east", "eu-west", "ap-south"]}
    RunStore("r", urls, "us-east").ensure_spec(spec)
    assert list(in_run_order("r", given)) == ["us-east", "eu-west", "ap-south"]
    assert in_run_order("r", given) == urls
    down = {**given, "ap-south": "file:///nonexistent/ap-south"}  # the first one tried is down
    assert list(in_run_order("r", down)) == ["us-east", "eu-west", "ap-south"]
    (tmp_path / "eu-west" / "r" / "spec.json").unlink()  # the next one lost its copy
    assert list(in_run_order("r", down)) == ["us-east", "eu-west", "ap-south"]


def test_the_launch_config_is_validated_once_and_overrides_are_laid_over_it():
    """`diloco train` hands the launcher the config it validated: carried as it is; a
    deployment's `overrides` are laid over it (and over a preset) and checked by name."""
    from diloco.config import ConfigError
    from flows.launcher import launch_config

    cfg = load_config("tiny", overrides=["topology.tau=3"])
    assert launch_config(cfg) is cfg
    laid = launch_config(cfg, overrides=["budget.tokens=1000"])
    assert (laid.budget.tokens, laid.topology.tau) == (1000, 3)
    assert launch_config(None, "small", ["topology.tau=1"]).topology.inner_steps == 40
    with pytest.raises(ConfigError, match=r"topology\.tau"):
        launch_config(cfg, overrides=["topology.tau=soon"])


def test_the_monitor_reads_the_members_at_most_every_few_seconds_and_at_the_end(tmp_path):
    """Each look at the statuses (a live display: every second) LISTed ``members/`` in
    every region; the members change only when a joiner adds one, so they are read at
    most every ``MEMBERS_EVERY`` seconds of the monitor's clock, and once more, fresh,
    for the run's summary (a learner added at the end is in it)."""
    store = _lock_run(tmp_path, "paced")
    cfg = load_config("tiny", overrides=["budget.tokens=20000"])
    now, reads = [0.0], []
    listed = store.members.run_learners
    store.members.run_learners = lambda *a, **k: reads.append(now[0]) or listed(*a, **k)
    monitor = Monitor(
        Run(store.run, store.urls, store.client_region, store.read_spec(), cfg),
        store,
        clock=lambda: now[0],
    )  # (reads them)
    spec_learners = set(run_slots(store.read_spec()))
    added = f"learner-{len(spec_learners)}"  # the id us-east adds first
    assert set(monitor.statuses()) == spec_learners
    assert store.members.put_member(added, {"learner": added, "region": "us-east"}, None)
    for t in (1.0, 2.0, MEMBERS_EVERY - 0.5):
        now[0] = t
        assert set(monitor.statuses()) == spec_learners  # not looked at again yet
    assert reads == [0.0]
    now[0] = MEMBERS_EVERY
    assert set(monitor.statuses()) == spec_learners | {added}
    assert reads == [0.0, MEMBERS_EVERY]
    monitor.learners(fresh=True)
    assert reads == [0.0, MEMBERS_EVERY, MEMBERS_EVERY]


def test_the_summary_counts_the_time_of_learners_that_joined_beside_those_it_started(tmp_path):
    """Goodput is the learner time merged over the learner time there was. The summary
    counted the merged work of learners that joined (``diloco join``) but only the time of
    those the launcher started (a run that 1 learner joined reported 87 %). A joiner's
    time since the launch is what its status reports (start-up and training); a learner
    the launcher started, or a slot no one took, adds none."""
    from flows.observe import train_summary_rows

    store = _lock_run(tmp_path, "joined")
    cfg = load_config("tiny", overrides=["budget.tokens=20000", "pipeline.learners_started=2"])
    spec = store.read_spec()
    region = run_slots(spec)["learner-3"]

    def report(lid: str, where: str, startup: float, train: float) -> None:
        writer = RunStore("joined", store.urls, where, writer=lid)  # a process of its own
        status = {"state": "training", "time": time.time(), "tokens": 3_000}
        writer.progress.write_metrics(lid, status, totals={"startup_seconds": startup,
                                                           "train_seconds": train})  # fmt: skip

    report("learner-3", region, 1.0, 2.0)  # an earlier launch's joiner: not this one's time
    monitor = Monitor(Run(store.run, store.urls, store.client_region, spec, cfg), store)
    monitor.started -= 100.0  # this launch began 100 s ago
    added = "learner-4"  # the id us-east adds first
    assert store.members.put_member(added, {"learner": added, "region": "us-east"}, None)
    monitor.learners(fresh=True)
    report("learner-0", run_slots(spec)["learner-0"], 4.0, 60.0)  # started by the launcher
    report("learner-3", region, 2.0, 6.0)  # joined the vacant slot again: 8 s in this launch
    report(added, "us-east", 1.0, 4.0)  # added a slot: 5 s
    statuses = monitor.statuses()
    assert monitor.joined(statuses) == {"learner-3": 8.0, added: 5.0}
    before = sum(monitor.model.shares[p] * s for p, s in monitor.merged_before.items())
    so_far = monitor.goodput_so_far({"learner_seconds_merged": before + 50.0}, statuses)
    assert so_far == pytest.approx(50.0 / (2 * 100.0 + 13.0), rel=1e-2)
    monitor.curve = [{"tokens": 1_000, "loss": 5.0}]  # this launch's first evaluation
    summary = run_summary(monitor, wall=100.0, allocated=200.0)
    assert (summary["started"], summary["joined"]) == (2, ["learner-3", added])
    # its speed: the 3 x 3,000 tokens the statuses report, less the 1,000 before, in 100 s
    assert summary["tokens"] == 9_000 and summary["tokens_per_second"] == 80.0
    shares = summary["time_breakdown"]
    assert shares["start-up"] == pytest.approx((4.0 + 2.0 + 1.0) / 213.0)
    assert sum(shares.values()) == pytest.approx(1.0)
    rows = dict(train_summary_rows({**summary, "final_loss": None}))
    assert rows["speed"] == "80 tokens/s over this launch"
    assert (
        rows["learners / quorum"]
        == f"2 started + 2 joined (4 slots + 1 added) / {summary['quorum']}"
    )
    fixed = dict(train_summary_rows({**summary, "started": 4, "joined": [], "final_loss": None}))
    assert fixed["learners / quorum"] == f"4 / {summary['quorum']}"


def test_a_ctrl_c_swallowed_on_its_way_still_ends_the_watch():
    """The launcher's Ctrl-C raises KeyboardInterrupt from its handler; raised inside a
    garbage collector callback (JAX has some: seen in `diloco join`), Python swallows
    it, and the watch went on until the workers it had stopped ended, then summed the run
    up as if it were done. The handler also sets ``signalled``, on which the watch raises
    the interrupt again within half a second."""
    import concurrent.futures
    import contextlib

    from flows.launcher import Launch

    launch = Launch()
    with contextlib.suppress(KeyboardInterrupt):  # swallowed, as Python does in a gc callback
        launch.on_signal(signal.SIGINT, None)
    assert launch.stopping.is_set() and launch.signalled.is_set()

    class Running:  # a worker's task that has not ended
        wrapped_future: concurrent.futures.Future = concurrent.futures.Future()

    with pytest.raises(KeyboardInterrupt):
        watch(["learner us-east/0"], [Running()], None, None, 1e9, None,
               signalled=launch.signalled)  # fmt: skip


def test_one_stand_by_per_syncer_shard_while_it_lives(caplog):
    """A shard seen stalled again while its stand-by still runs gets no second one (it
    would only fence the first); once that one has ended, a new stall gets a new one."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from flows.launcher import StandBys

    started: list[Future] = []

    class Mode:
        stopping = threading.Event()

        def stand_by(self, worker):  # (a Prefect future, wrapping the pool's)
            started.append(Future())
            return f"{worker.name} stand-by", SimpleNamespace(wrapped_future=started[-1])

    class Worker:
        name, status = "syncer us-east/0", ("", "", [0, 1])

    log = logging.getLogger("test-stand-by")
    stand_bys = StandBys(Mode(), {"syncer us-east/0": Worker()}, log)
    with caplog.at_level("WARNING", "test-stand-by"):
        assert stand_bys.start("syncer us-east/0")[0] == "syncer us-east/0 stand-by"
        assert stand_bys.start("syncer us-east/0") is None  # the first one lives
        assert stand_bys.start("syncer us-east/9") is None  # no such shard
        started[0].set_result(0)
        assert stand_bys.start("syncer us-east/0") is not None  # it ended: a new stall
    assert len(started) == 2
    assert "syncer us-east/0: its stand-by is running already; no second one" in caplog.text


def test_a_run_standing_still_is_said_why_and_ends_only_when_nobody_beats(tmp_path):
    """The monitor's standstill: nothing while versions move or for ``stall_after`` (3 of
    the learners' rounds when those are longer than ``pipeline.stall_seconds``); then one
    line naming each learner's state. Hopeless only once every learner not done is
    silent by a heartbeat that stopped, never for learners that have not started."""
    store = _lock_run(tmp_path, "still")
    cfg = load_config("tiny", overrides=["budget.tokens=20000", "pipeline.stall_seconds=10"])
    now = [0.0]
    monitor = Monitor(
        Run(store.run, store.urls, store.client_region, store.read_spec(), cfg),
        store,
        clock=lambda: now[0],
    )
    monitor.round_seconds = 20.0  # (as the heartbeats measure it): stall after 60 s
    verdicts = {"learner-0": Verdict("training", beating=True),
                "learner-1": Verdict("lagging", "no send for 90 s", beating=True),
                "learner-2": Verdict("compiling", beating=True), "learner-3": Verdict("done")}  # fmt: skip
    assert monitor.standstill({0: 3, 1: 3}, verdicts) is None  # first sight
    now[0] = 59.0
    assert monitor.standstill({0: 3, 1: 3}, verdicts) is None
    now[0] = 61.0
    quiet, line = monitor.standstill({0: 3, 1: 3}, verdicts)
    assert quiet == 61.0 and line == (
        "no new version for 61 s (f0:v3 f1:v3; the learners' round is 20 s): learner-0 "
        "training; learner-1 lagging (no send for 90 s); learner-2 compiling; learner-3 done"
    )
    assert monitor.standstill({0: 4, 1: 3}, verdicts) is None  # it moves
    silent = Verdict("silent", "no heartbeat for 70 s", beating=True)
    hung = {"learner-0": silent, "learner-1": silent, "learner-2": silent,
            "learner-3": Verdict("done")}  # fmt: skip
    limit = monitor.stall_after() + cfg.liveness.silent_max_seconds
    assert not monitor.hopeless(limit, hung) and monitor.hopeless(limit + 1, hung)
    unstarted = {**hung, "learner-2": Verdict("silent", "no heartbeat, and no new status")}
    assert not monitor.hopeless(limit + 1, unstarted)
    assert not monitor.hopeless(limit + 1, {**hung, "learner-1": verdicts["learner-1"]})


def _loaded_api():
    """A loopback server that answers its health check and 503 to every other call, as
    a loaded Prefect server does; ``shutdown()`` it after."""
    import http.server

    class Loaded(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.send_response(200 if self.path.endswith("/health") else 503)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"true" if self.path.endswith("/health") else b'{"detail": "busy"}')

        do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Loaded)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_worker_whose_prefect_api_answers_503_exits_75_not_crashed(tmp_path):
    """Defect: a restarted syncer whose first Prefect call was answered 503 (a loaded
    server; its health check answered) exited 1, counted as a crash. An API that answers
    5xx is away, as one that refuses connections: exit ``API_DOWN`` (the launcher waits)."""
    from flows.worker import API_DOWN

    server = _loaded_api()
    (tmp_path / "us").mkdir()
    regions = {"us-east": f"file://{tmp_path / 'us'}"}
    initialize_run(RunStore("busy", regions, "us-east"), load_config("tiny"))
    env = {**os.environ, "PREFECT_API_URL": f"http://127.0.0.1:{server.server_port}/api",
           "PREFECT_CLIENT_MAX_RETRIES": "0", "PREFECT_HOME": str(tmp_path / "prefect")}  # fmt: skip
    try:
        done = subprocess.run(
            [sys.executable, "-m", "flows.worker", "syncer", "--run", "busy", "--regions",
             json.dumps(regions), "--home", "us-east"],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        server.shutdown()
    assert done.returncode == API_DOWN, done.stderr[-3000:]
    assert "503" in done.stderr and "is away" in done.stderr


def test_a_deployment_start_answered_503_is_waited_out_never_counted_a_crash(tmp_path, monkeypatch):
    """Defect: ``run_deployment`` answered 503 by a loaded server (its health check
    answering) was re-raised, its task failed and the worker was dropped for good, in
    silence. The launcher's restart policy takes it as the API away: it waits and asks
    again, counting no crash, as it does for an unreachable API."""
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    from flows import supervision

    monkeypatch.setattr(supervision, "BLIP_SECONDS", 0.1)
    (tmp_path / "us").mkdir()
    store = RunStore("blip", {"us-east": f"file://{tmp_path / 'us'}"}, "us-east")
    initialize_run(store, load_config("tiny"))
    said: list[str] = []
    log = type("Log", (), {"warning": lambda self, msg, *a: said.append(msg % a)})()
    restarts = supervision.Restarts("learner us-east/0", store, ("learner-0", "us-east", 1),
                                    3, log, threading.Event(), unit="flow runs")  # fmt: skip
    server = _loaded_api()
    url = f"http://127.0.0.1:{server.server_port}/api"
    try:
        with temporary_settings({PREFECT_API_URL: url, PREFECT_CLIENT_MAX_RETRIES: 0}):
            for _ in range(4):  # more than the crash limit: none counts
                with pytest.raises(Exception) as answered:
                    run_deployment("learner/us-east", timeout=0)
                assert restarts.api_waited(answered.value)
    finally:
        server.shutdown()
    assert restarts.failed == 0 and len(said) == 4 and "503" in said[0], said
    assert "not counted as a crash" in said[0]


def test_the_launcher_takes_no_heartbeat_that_is_not_its_learners(tmp_path):
    """The launcher judges a learner by its heartbeat only when the beat is signed with
    that learner's key (it holds the run secret): one written by anyone else is no beat."""
    from storage_layout.auth import Keys, learner_key, new_run_secret

    store = _lock_run(tmp_path, "beats")
    cfg = load_config("tiny", overrides=["budget.tokens=20000"])
    secret = new_run_secret()
    beat = {"learner": "learner-0", "generation": 1, "beat": 1, "period": 5.0,
            "state": "training", "step": 3, "sends": 0, "time": time.time()}  # fmt: skip
    keys = Keys("beats", secret)

    def verdict(signer: str) -> Verdict:
        store.members.write_heartbeat(beat, learner_key(secret, "beats", signer))
        monitor = Monitor(
            Run(store.run, store.urls, store.client_region, store.read_spec(), cfg),
            store,
            verifying_key=keys.verifying_key,
        )
        return monitor.verdicts({})["learner-0"]

    assert verdict("learner-0").beating  # its own: judged by it
    forged = verdict("learner-1")  # signed with another learner's key: no heartbeat
    assert not forged.beating and forged.state == "starting", forged


def test_a_launch_mode_is_found_by_name_in_one_place():
    """``--via`` and the train flow's ``via`` name a class of ``LAUNCH_MODES``; what
    differs between modes is asked of the class, and an unknown name is refused with the
    modes there are (``diloco train`` does it before anything starts)."""
    from diloco.config import ConfigError
    from flows.launch_deployments import Deployments
    from flows.launch_modes import LAUNCH_MODES, Via, launch_mode
    from flows.launch_processes import Processes

    assert launch_mode("processes") is Processes and launch_mode("deployments") is Deployments
    assert Processes.local and not Deployments.local and Deployments.outlives_launcher
    assert set(Via.__args__) == set(LAUNCH_MODES)
    with pytest.raises(ConfigError, match="via must be one of processes, deployments, not 'ray'"):
        launch_mode("ray")
