"""Moto's S3 server on loopback for the learner benches, with one bucket made."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import fsspec


@contextlib.contextmanager
def local_s3(bucket: str) -> Iterator[fsspec.AbstractFileSystem]:
    """A fresh S3 filesystem on a local server holding an empty ``bucket``; the server
    stops on exit (it keeps every object in RAM)."""
    from infra.local_servers import LocalS3

    s3 = LocalS3().start()
    os.environ.update(AWS_ENDPOINT_URL=s3.url, AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x")
    try:
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        fs.mkdir(bucket)
        yield fs
    finally:
        s3.stop()
