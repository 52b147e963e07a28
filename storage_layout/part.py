"""What the parts of a ``RunStore`` share (``store.members``, ``store.units``,
``store.contributions``, ``store.versions``, ``store.checkpoints``, ``store.progress``):
the store they belong to, its buckets, and the readers of small JSON records."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Annotated, Any

import numpy as np
from pydantic import Field

from protocol.quantize import QuantizedTensor, quantize
from storage_layout import record
from storage_layout.bucket import Bucket, PartialFailure, Refused
from storage_layout.chunks import ObjectSink
from storage_layout.commit import CommitMarker, commit_marker, get_patiently
from storage_layout.record import Name, Record, Time

if TYPE_CHECKING:
    from storage_layout.store import RunStore

log = logging.getLogger(__name__)


class Written(Record):
    """What ``RunStore.stamped`` adds to each write-once record it makes."""

    writer: Name | None = None
    host: Name | None = None
    pid: Annotated[int, Field(ge=0, lt=1 << 32)] | None = None
    time: Time | None = None


class Part:
    """The records of one kind of a run, over its store's buckets and ``layout.py``."""

    def __init__(self, store: RunStore):
        self.store = store
        self.layout = store.layout

    def bucket(self, region: str | None = None) -> Bucket:
        """``region``'s bucket (default: the store's own region's)."""
        return self.store.bucket(region or self.store.client_region)

    @property
    def home(self) -> Bucket:
        return self.store.home

    def read_claim(self, bucket: Bucket, key: str, kind: type[Record] = Record) -> Any:
        """The claim at ``key`` (``read_or_none``), checked to be sealed with the run's
        claims key where the store holds one (``RunStore.seal_of``)."""
        return read_or_none(bucket, key, kind, sealed_by=self.store.seal_of(key))

    def put_streamed(
        self,
        marker_key: str,
        prefix: str,
        write: Callable[[Callable[[str, bytes], None]], None],
        kind: str,
        body: Callable[[], dict[str, Any]],
        write_id: str,
        sign: Callable[[CommitMarker], CommitMarker] | None = None,
        hashed: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> CommitMarker:
        """Upload at home what ``write(put)`` puts under ``prefix`` (``ObjectSink``, a
        chunk at a time), then commit the marker; ``hashed``: what a first pass
        recorded, which the upload must match."""
        # Not ObjectSink's context manager: its abort deletes the data prefix, and one a
        # content id names may hold an earlier attempt's committed objects.
        sink = ObjectSink(self.home, prefix)
        try:
            write(sink.put)
            entries = sink.finish()
        except BaseException:
            with contextlib.suppress(Exception):
                sink.finish()  # let the uploads under way end; the failure is the one raised
            raise
        if hashed is not None and entries != hashed:
            differ = sorted(r for r in entries.keys() | hashed.keys()
                            if entries.get(r) != hashed.get(r))  # fmt: skip
            raise ValueError(
                f"{marker_key}: pieces() gave other objects on its second call ({differ[:3]}); "
                "it must give the same pieces both times"
            )
        return commit_marker(self.home, marker_key, prefix, entries, kind, body(),
                             self.store.writer, write_id, sign=sign)  # fmt: skip


def fp32(values: Mapping[str, np.ndarray]) -> dict[str, QuantizedTensor]:
    return {n: quantize(v, "fp32") for n, v in values.items()}


def read_json(
    bucket: Bucket, key: str, kind: type[Record] = Record, limit: int = record.SMALL,
    signed_by: bytes | None = None, sealed_by: bytes | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The ``kind`` of record at ``key``, as stored (``storage_layout.record.read_body``:
    ``FileNotFoundError`` or a named ``BadRecord``)."""
    return record.read_body(bucket, key, kind, limit, signed_by, sealed_by)


def read_or_none(bucket: Bucket, key: str, kind: type[Record] = Record,
                 limit: int = record.SMALL, signed_by: bytes | None = None,
                 sealed_by: bytes | None = None) -> Any:  # fmt: skip
    """``read_json``, with a missing record and a bad one (named in the log) None."""
    try:
        return read_json(bucket, key, kind, limit, signed_by, sealed_by)
    except FileNotFoundError:
        return None
    except record.BadRecord as exc:
        log.warning("ignored: %s", exc)
        return None


def read_jsons(bucket: Bucket, keys: list[str], kind: type[Record] = Record,
               sealed_by: Callable[[str], bytes | None] = lambda key: None,
               batch: int = 64) -> list[dict[str, Any] | None]:  # fmt: skip
    """``kind`` records, read ``batch`` at a time concurrently (``Bucket.get_many``: one
    round trip each, not one per object, over S3 or GCS); one that does not read is read
    again alone, and None (named in the log) if it stays bad. ``sealed_by``: the key that
    seals the claim at a key (``RunStore.seal_of``)."""
    out: list[dict[str, Any] | None] = []
    for i in range(0, len(keys), batch):
        part = keys[i : i + batch]
        try:
            got = get_patiently(bucket, part, f"{len(part)} objects from {part[0]}",
                                record.SMALL)  # fmt: skip
        except (PartialFailure, Refused):
            got = {}  # each read alone
        for key in part:
            try:
                body = json.loads(got[key])
                record.check(body, key, kind, sealed_by=sealed_by(key))
                out.append(body)
            except (KeyError, ValueError, RecursionError):
                out.append(read_or_none(bucket, key, kind, sealed_by=sealed_by(key)))
    return out
