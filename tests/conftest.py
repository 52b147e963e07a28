"""Test-wide setup.

- Two host devices for every test, so the data-parallel sharding inside a learner is
  exercised everywhere (must be set before JAX is imported).
- Real object-storage servers on loopback, started once per session on first use:
  moto's S3 server and fake-gcs-server. ``bucket_url`` gives each test a fresh, empty
  bucket on the backend it is parametrized with.
- ``prefect_api``: one Prefect server for the session, shared by its xdist workers.
- One persistent JAX compilation cache for the session, shared by the test process and
  every learner, syncer and spare it starts (the launcher gives a run's workers one the
  same way): a computation of the same shapes is compiled once in the session, not
  once per process (a warm learner starts about 30 % sooner). Removed at the end.
- A failing test that ran processes shows the tails of their logs (every ``*.log``
  under its ``tmp_path``) in its report: a CI failure can be read from CI's output.
"""

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# Tests choose their own keys (storage_layout.auth); none leak in from the shell.
os.environ.pop("DILOCO_RUN_SECRET", None)
os.environ.pop("DILOCO_LEARNER_KEY", None)

import fsspec
import pytest

from infra.local_servers import LocalGCS, LocalS3
from infra.prefect_server import free_port, wait_healthy

BACKENDS = ["file", "memory", "s3", "gcs"]
LOG_TAIL_LINES = 40  # per log file
LOG_FILES = 12  # at most, per failing test
PREFECT_API_FILE = "prefect-api.json"  # in the session's folder: the shared server's url, pid


def pytest_configure(config):
    """The session's JAX compilation cache (before any test module imports JAX)."""
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        config.jax_cache = tempfile.mkdtemp(prefix="diloco-jax-cache-")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = config.jax_cache
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"


def pytest_unconfigure(config):
    """The session's JAX cache removed, and its Prefect API server stopped (by the
    controller, once every xdist worker is done with it)."""
    if not hasattr(config, "workerinput"):
        found = _session_folder(config) / PREFECT_API_FILE
        if found.exists():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(json.loads(found.read_text())["pid"], signal.SIGTERM)
    if cache := getattr(config, "jax_cache", None):
        shutil.rmtree(cache, ignore_errors=True)
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    tmp = item.funcargs.get("tmp_path") if hasattr(item, "funcargs") else None
    if report.when == "call" and report.failed and isinstance(tmp, Path):
        logs = sorted(tmp.rglob("*.log"), key=lambda f: str(f))
        for log in logs[:LOG_FILES]:
            lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            report.sections.append((f"log tail {log.relative_to(tmp)}", "\n".join(lines)))
        if len(logs) > LOG_FILES:
            report.sections.append(("logs left out", "\n".join(map(str, logs[LOG_FILES:]))))
    return report


@pytest.fixture(scope="session")
def s3_server():
    server = LocalS3().start()
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
def gcs_server():
    server = LocalGCS().start()
    yield server.url
    server.stop()


def new_bucket(backend: str, request, tmp_path) -> str:
    name = f"t-{uuid.uuid4().hex[:12]}"
    if backend == "file":
        path = tmp_path / name
        path.mkdir()
        return f"file://{path}"
    if backend == "memory":
        return f"memory://{name}"
    if backend == "s3":
        request.getfixturevalue("s3_server")
        fsspec.filesystem("s3").mkdir(name)
        return f"s3://{name}"
    request.getfixturevalue("gcs_server")
    fsspec.filesystem("gs").mkdir(name)
    return f"gs://{name}"


def _session_folder(config) -> Path:
    """The folder every process of this pytest session shares: the session's base
    temporary folder (an xdist worker's own is a folder in it)."""
    base = config._tmp_path_factory.getbasetemp()
    return base.parent if hasattr(config, "workerinput") else base


def _start_prefect_api(folder: Path) -> dict[str, object]:
    """A Prefect API server as Prefect's test harness runs one (its ephemeral services, no
    UI, a SQLite database in ``folder``), in a session of its own: it outlives the xdist
    worker that started it, and ``pytest_unconfigure`` of the controller stops it."""
    port = free_port()
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
           "PREFECT_HOME": str(folder / "prefect-home"),
           "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{folder / 'prefect.db'}"}  # fmt: skip
    argv = [sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app",
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "error", "--lifespan", "on"]  # fmt: skip
    log = folder / "prefect-api.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}/api"
    try:
        wait_healthy(url, proc, log, timeout=180)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return {"url": url, "pid": proc.pid}


@pytest.fixture(scope="session")
def prefect_api(request):
    """One Prefect API server for the whole session, shared by the xdist workers (the first
    that needs it starts it; the learner and syncer processes, and Prefect workers, reach
    it too): its startup (some 15 s of CPU) and its services' idle work are paid once."""
    from prefect.context import _temporary_global_settings_context, get_settings_context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    folder = _session_folder(request.config)
    with open(folder / "prefect-api.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = folder / PREFECT_API_FILE
        if not found.exists():
            found.write_text(json.dumps(_start_prefect_api(folder)))
        url = json.loads(found.read_text())["url"]
    os.environ["PREFECT_API_URL"] = url
    # (the second for code in a context copied before this one, as Prefect's harness does;
    # it is made once the first is entered)
    with (
        temporary_settings(updates={PREFECT_API_URL: url}),
        _temporary_global_settings_context(get_settings_context()),
    ):
        yield url
    os.environ.pop("PREFECT_API_URL", None)


@pytest.fixture(params=BACKENDS)
def bucket_url(request, tmp_path):
    return new_bucket(request.param, request, tmp_path)


@pytest.fixture
def make_bucket(request, tmp_path):
    """Another fresh bucket on a named backend: ``make_bucket("s3")``."""
    return lambda backend: new_bucket(backend, request, tmp_path)
