"""Chunk objects off the critical path: a version's written in the background while its
producer makes the next (``ObjectSink``), and checked ones kept on the local disk for one
more read (``ChunkSpool``) in a temporary folder of this process (``process_folder``)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import tempfile
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from storage_layout.bucket import Bucket
from storage_layout.commit import discard_data, entry, put_patiently
from storage_layout.layout import check_key

log = logging.getLogger(__name__)


class ObjectSink:
    """Uploads a version's data objects under ``data_prefix`` in the background while
    its producer makes the next ones: at most ``in_flight`` uploads outstanding (``put``
    waits for a free one), each written ``patiently`` (``commit.put_patiently``). A
    failed upload is never lost: the next ``put``, or ``finish``, raises it. For one
    producer thread; a context manager that aborts (deletes the prefix) on an exception.
    """

    def __init__(self, bucket: Bucket, data_prefix: str, in_flight: int = 4):
        if in_flight < 1:
            raise ValueError(f"in_flight must be at least 1, got {in_flight}")
        self.bucket, self.data_prefix = bucket, data_prefix
        self._pool = ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="object-sink")
        self._slots = threading.Semaphore(in_flight)
        self._lock = threading.Lock()
        self._entries: dict[str, dict[str, Any]] = {}
        self._pending: set[Future] = set()
        self._seen: set[str] = set()
        self._failure: BaseException | None = None
        self._done = False

    def __enter__(self) -> ObjectSink:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            try:
                self.abort()
            except Exception:  # the exception under way is the one to report
                log.exception("could not discard %s after a failed write", self.data_prefix)
        elif not self._done:
            self.finish()

    def put(self, rel: str, data: bytes | bytearray) -> None:
        """Upload ``data`` as ``{data_prefix}/{rel}`` in the background. ``bytes``, or a
        ``bytearray`` that is the sink's from now on (its producer writes to it no more:
        ``codec.GroupWriter``'s chunks); any other buffer is copied."""
        self._raise_failure()
        if self._done:
            raise RuntimeError(f"{self.data_prefix}: put of {rel!r} after finish or abort")
        key = check_key(f"{self.data_prefix}/{rel}", "object key")
        if rel in self._seen:
            raise ValueError(f"{key} is put twice")
        self._seen.add(rel)
        if not isinstance(data, bytes | bytearray):
            data = bytes(data)  # the producer may reuse its buffer
        self._slots.acquire()
        try:
            self._raise_failure()
            future = self._pool.submit(self._upload, rel, key, data)
        except BaseException:
            self._slots.release()
            raise
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._settled)

    def _upload(self, rel: str, key: str, data: bytes) -> None:
        try:
            record = entry(data)
            put_patiently(self.bucket, {key: data}, f"writing {key}")
        except BaseException as exc:
            with self._lock:
                if self._failure is None:
                    self._failure = exc
            log.warning("upload of %s failed: %r", key, exc)
            return
        with self._lock:
            self._entries[rel] = record

    def _settled(self, future: Future) -> None:
        with self._lock:
            self._pending.discard(future)
        self._slots.release()

    def _raise_failure(self) -> None:
        with self._lock:
            failure = self._failure
        if failure is not None:
            raise failure

    def _drain(self) -> None:
        with self._lock:
            pending = list(self._pending)
        wait(pending)
        self._pool.shutdown(wait=True)
        self._done = True

    def finish(self) -> dict[str, dict[str, Any]]:
        """Wait for every upload; the marker entries ``{rel: entry(object)}`` sorted by
        ``rel``, or the first upload's failure (raised once all have ended)."""
        self._drain()
        self._raise_failure()
        with self._lock:
            return {rel: self._entries[rel] for rel in sorted(self._entries)}

    def abort(self) -> None:
        """Wait for the uploads under way, then delete everything under the data prefix."""
        self._drain()
        discard_data(self.bucket, self.data_prefix)


class ChunkSpool:
    """Checked chunk objects kept on the local disk for one more read: a syncer scans each
    contribution when it is listed and reads it again to merge; the scan's reader puts
    the chunks it fetched and checked here (``fill``), the merge's reader takes them
    (``reuse``), so each is fetched from the bucket and hashed once. A chunk is keyed by
    its bucket, key and the sha256 its marker records, and dropped once taken. Bounded by
    ``limit`` bytes: when full, the oldest chunks go first (those of contributions that
    were never merged, superseded ones, age out). Its files live in a temporary folder
    of this process (``process_folder``), deleted by ``close`` or when the spool is
    garbage collected. Thread-safe."""

    def __init__(self, limit: int, directory: str | None = None):
        if limit < 1:
            raise ValueError(f"a chunk spool holds at least one byte, not {limit}")
        self.limit = limit
        self.folder = process_folder("chunk-spool", directory)
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self.size = 0  # bytes held
        self.taken = 0  # chunks a read took from here instead of the bucket
        self._lock = threading.Lock()
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.folder, True)

    def _path(self, key: str) -> str:
        return os.path.join(self.folder, hashlib.sha256(key.encode()).hexdigest())

    def put(self, key: str, data: bytes) -> None:
        """Keep ``data`` (already checked) under ``key``, the oldest going if need be;
        not kept if larger than the whole spool."""
        if len(data) > self.limit:
            return
        with self._lock:
            if key in self._sizes:
                return
            while self._sizes and self.size + len(data) > self.limit:
                old, n = self._sizes.popitem(last=False)
                self.size -= n
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self._path(old))
            with open(self._path(key), "wb") as f:
                f.write(data)
            self._sizes[key] = len(data)
            self.size += len(data)

    def take(self, key: str) -> bytes | None:
        """The chunk kept under ``key``, no longer kept; None if it is not here (or its
        file is not whole: read it from the bucket)."""
        with self._lock:
            n = self._sizes.pop(key, None)
            if n is None:
                return None
            self.size -= n
            path = self._path(key)
            try:
                with open(path, "rb") as f:
                    data = f.read()
                os.remove(path)
            except OSError:
                return None
            if len(data) != n:
                return None
            self.taken += 1
            return data

    def close(self) -> None:
        with self._lock:
            self._sizes.clear()
            self.size = 0
        self._cleanup()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def process_folder(kind: str, directory: str | None = None) -> str:
    """A new local folder for this process's ``kind`` of files (``KIND-PID-random`` in
    ``directory``, the temporary directory by default). A process killed outright never
    deletes its own, so this first deletes the ``kind`` folders of processes no longer
    alive (a folder whose owner cannot be told is kept)."""
    directory = directory or tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            m = re.fullmatch(rf"{re.escape(kind)}-(\d+)-\w+", entry.name)
            if m and entry.is_dir(follow_symlinks=False) and not _alive(int(m.group(1))):
                shutil.rmtree(entry.path, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{kind}-{os.getpid()}-", dir=directory)
