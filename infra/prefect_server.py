"""A Prefect API server for one run (or one local stack), as a child process.

The ephemeral API that Prefect starts on its own lives inside one process; learners and
syncers are separate processes, so they need a real server. This starts
``prefect server start`` on a free loopback port with its own ``PREFECT_HOME`` (SQLite
database, logs) and stops it on exit. The database stays, so the run can be browsed
later with ``PREFECT_HOME=<home> prefect server start``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from infra.processes import dying_with_this_process, read_pids, stop_leftovers, write_pids


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(home: Path, port: int = 4200) -> dict[str, str]:
    """The environment of a server on ``port``. Its UI asks the API at
    ``PREFECT_SERVER_UI_API_URL``, which Prefect otherwise derives from
    ``PREFECT_SERVER_API_PORT`` (4200), not from ``--port``: a server on any other port
    would serve a UI that cannot reach it ("Can't connect to Server API")."""
    return {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_SERVER_UI_API_URL": f"http://127.0.0.1:{port}/api",
    }


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(f"the Prefect server exited with {proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"the Prefect server at {url} did not answer in {timeout:.0f} s (log {log})")


@contextmanager
def prefect_server(home: Path, port: int | None = None, services: bool = False) -> Iterator[str]:
    """Start a server whose state lives in ``home``; yields its API URL. The server stops
    when this process dies (``die_with_parent``), and one that a dead process left in
    ``home`` is stopped first."""
    home.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    log = home / "server.log"
    argv = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
            "--port", str(port), "--analytics-off"]  # fmt: skip
    if not services:
        # Flows run in our own processes: no scheduling. The event services stay on: task
        # runs reach the database (and the UI) only through them.
        argv += ["--no-scheduler", "--no-late-runs"]
    # A server of this home that a process which died left running (its pid file): two
    # servers must never share one database. (The caller holds the run, so the process
    # that started it is gone.)
    pid_file = home / "server.pid"
    stop_leftovers(
        read_pids(pid_file),
        "prefect",
        grace=15.0,
        groups=("server",),
        environ=f"PREFECT_HOME={home}",
    )  # (a pid reused elsewhere is left alone)
    with log.open("ab") as out:
        # Its own session: a Ctrl-C in the terminal must not stop it before the launcher has
        # recorded the final states of its flow runs. It dies with this process, though.
        proc = subprocess.Popen(dying_with_this_process(argv), stdout=out,
                                stderr=subprocess.STDOUT, env=server_env(home, port),
                                start_new_session=True)  # fmt: skip
    write_pids(pid_file, {"server": proc.pid})
    url = f"http://127.0.0.1:{port}/api"
    try:
        wait_healthy(url, proc, log)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        pid_file.unlink(missing_ok=True)
