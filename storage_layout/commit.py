"""The commit protocol: every version complete and immutable, or invisible.

Writing a version:
1. every data object under a fresh prefix that carries a random write id;
2. then a small JSON **commit marker** listing each object's key, size and sha256, the
   writer's identity and the write id, written create-exclusive.

Exactly one writer wins a marker key; a second one gets ``CommitConflict`` and its data
objects, under its own write id, never touch the winner's. When a marker write fails
without a clear answer (a lost response), the marker is read back: our write id means we
won, another means we lost, none means the write did not happen and is retried.

Reading a version: read the marker, fetch exactly the objects it lists, check sizes and
hashes, and only then decode. A version without a marker does not exist for readers.

A marker may carry a ``signature`` (``storage_layout.auth``: learners sign their
contributions). It covers every other field, and the marker lists each object's sha256,
so it authenticates the data too. Unsigned markers read as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from storage_layout.bucket import Bucket, PartialFailure, Refused
from storage_layout.layout import FORMAT_VERSION, LayoutError, check_key, data_prefix_of

log = logging.getLogger(__name__)
T = TypeVar("T")
ATTEMPTS = 3  # of a request that failed in passing, before its failure is believed

MARKER_FORMAT = "diloco-commit"
# Objects up to this size (the Zarr metadata documents) are also inlined in the marker, so
# a reader needs one request for the marker and one per chunk, not one per object.
INLINE_BYTES = 4096
# The largest marker read: a marker lists one entry (about 150 bytes) per object, one per
# Zarr chunk of at most 1 Mi values (4 MiB of fp32), so a version of 1 B fp32 values
# lists about 1,000 (150 KB) and this bound is reached near 100 GB of data. A larger one
# is refused before it is parsed, let alone authenticated.
MAX_MARKER_BYTES = 4 << 20


class CommitConflict(RuntimeError):
    """Another writer committed this version first (we were fenced off)."""

    def __init__(self, key: str, ours: str, theirs: CommitMarker):
        self.key, self.ours, self.theirs = key, ours, theirs
        super().__init__(
            f"{key} was committed by {theirs.writer} (write {theirs.write_id}); "
            f"our write {ours} lost and its data is discarded"
        )


class CorruptVersion(ValueError):
    """A committed version whose marker or objects do not check out; the message says how."""


# The kind of a marker that holds a contribution's key so that no commit can land there:
# written by a syncer that gives back a fenced learner's data (``RunStore.contributions.revoke_contribution``).
REVOKED = "revoked"


class Revoked(ValueError):
    """A contribution's key held by a ``REVOKED`` marker: there is no contribution there,
    and never will be (its readers skip it)."""


# Failures that are answers, not accidents: asking again gives the same one.
_DEFINITE = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
             NotADirectoryError)  # fmt: skip


def patiently(call: Callable[[], T], what: str, attempts: int = ATTEMPTS) -> T:
    """``call()``, asked again after a failure in passing: an ``OSError`` that is not an
    answer (a timeout, a reset connection, a region that blinked) or a ``CorruptVersion``
    (a damaged read of an object that is immutable once committed). The clients retry
    their own transport errors; this covers what still gets through. The last failure
    is raised; a missing object is believed at once."""
    delay = 0.05
    for attempt in range(attempts):
        try:
            return call()
        except _DEFINITE:
            raise
        except (OSError, CorruptVersion) as exc:
            if attempt == attempts - 1:
                raise
            log.info("%s failed (%s); asking again in %.2f s", what, exc, delay)
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


def put_patiently(bucket: Bucket, objects: Mapping[str, bytes], what: str) -> None:
    """``bucket.put_many(objects)``, ``patiently``: when some objects fail
    (``PartialFailure``), only those are written again (every write here is idempotent:
    data objects live under a write-id-unique prefix)."""
    left = dict(objects)

    def attempt() -> None:
        try:
            bucket.put_many(left)
        except PartialFailure as exc:
            for key in set(left) - set(exc.failed):
                del left[key]
            raise

    patiently(attempt, what)


def get_patiently(
    bucket: Bucket, keys: list[str], what: str, limit: int | None = None
) -> dict[str, bytes]:
    """``bucket.get_many(keys, limit)``, ``patiently``: when some reads fail
    (``PartialFailure``), only those are asked again."""
    got: dict[str, bytes] = {}

    def attempt() -> dict[str, bytes]:
        try:
            got.update(bucket.get_many([k for k in keys if k not in got], limit))
        except PartialFailure as exc:
            got.update(exc.done)
            raise
        return got

    return patiently(attempt, what)


def writer_identity(role: str) -> str:
    return f"{role}@{socket.gethostname()}:{os.getpid()}"


def new_write_id() -> str:
    return uuid.uuid4().hex[:16]


def content_write_id(marker_key: str, objects: Mapping[str, bytes]) -> str:
    """A write id that names the content: the same objects for the same marker give the
    same id. A writer that retries a write whose marker landed but whose answer was lost
    (a learner's upload, asked again from the top) then finds its own write, not a
    conflict, and a retry rewrites the same data prefix instead of leaving another."""
    return content_write_id_of(
        marker_key, {rel: {"sha256": sha256(b)} for rel, b in objects.items()}
    )


def content_write_id_of(marker_key: str, entries: Mapping[str, Mapping[str, Any]]) -> str:
    """``content_write_id`` from the marker's records of the objects (``{rel: entry(object)}``),
    for a writer that streams its objects and never holds them all."""
    digest = hashlib.sha256(marker_key.encode())
    for rel in sorted(entries):
        digest.update(f"\0{rel}\0{entries[rel]['sha256']}".encode())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class CommitMarker:
    kind: str  # contribution | global | checkpoint
    data_prefix: str  # bucket-relative prefix of the objects
    objects: dict[str, dict[str, Any]]  # key -> {"size", "sha256"[, "inline": utf-8 text]}
    writer: str
    write_id: str
    meta: dict[str, Any]
    # {"alg": "hmac-sha256", "value": hex} over the rest of the marker, or None (unsigned)
    signature: dict[str, str] | None = None

    def to_json(self) -> bytes:
        body: dict[str, Any] = {
            "format": MARKER_FORMAT,
            "format_version": FORMAT_VERSION,
            "kind": self.kind,
            "data_prefix": self.data_prefix,
            "objects": self.objects,
            "writer": self.writer,
            "write_id": self.write_id,
            "meta": self.meta,
        }
        if self.signature is not None:
            body["signature"] = self.signature
        return json.dumps(body, sort_keys=True, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, key: str) -> CommitMarker:
        try:
            body = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CorruptVersion(f"marker {key} is not JSON ({exc}); truncated or foreign") from exc
        if not isinstance(body, dict) or body.get("format") != MARKER_FORMAT:
            raise CorruptVersion(f"marker {key} is not a {MARKER_FORMAT} marker")
        if body.get("format_version") != FORMAT_VERSION:
            raise CorruptVersion(
                f"marker {key} has format version {body.get('format_version')!r}; "
                f"this code reads {FORMAT_VERSION}"
            )
        try:
            objects = {}
            for k, v in body["objects"].items():
                entry = {"size": int(v["size"]), "sha256": str(v["sha256"])}
                if "inline" in v:
                    entry["inline"] = str(v["inline"])
                objects[str(k)] = entry
            return cls(
                kind=str(body["kind"]),
                data_prefix=str(body["data_prefix"]),
                objects=objects,
                writer=str(body["writer"]),
                write_id=str(body["write_id"]),
                meta=dict(body.get("meta") or {}),
                signature=_signature(body.get("signature")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptVersion(f"marker {key} lacks a field or has a wrong one: {exc}") from exc

    @property
    def size(self) -> int:
        return sum(o["size"] for o in self.objects.values())


def _signature(value: Any) -> dict[str, str] | None:
    """A marker's signature field as stored: absent (None) or a flat object of strings."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"signature is a {type(value).__name__}, not an object")
    return {str(k): str(v) for k, v in value.items()}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def entry(data: bytes) -> dict[str, Any]:
    """A marker's record of one object: its size and sha256, and the object itself when
    it is small UTF-8 text (the Zarr metadata documents, or a small chunk whose bytes
    happen to be; see ``INLINE_BYTES``)."""
    record: dict[str, Any] = {"size": len(data), "sha256": sha256(data)}
    if len(data) <= INLINE_BYTES:
        with contextlib.suppress(UnicodeDecodeError):
            record["inline"] = data.decode("utf-8")
    return record


def commit_version(
    bucket: Bucket,
    marker_key: str,
    data_prefix: str,
    objects: Mapping[str, bytes],
    kind: str,
    meta: Mapping[str, Any],
    writer: str,
    write_id: str | None = None,
    attempts: int = 4,
    sign: Callable[[CommitMarker], CommitMarker] | None = None,
) -> CommitMarker:
    """Write ``objects`` under ``data_prefix`` and then the marker, exclusively
    (``commit_marker``; a writer that streams its objects up, ``storage_layout.stream``,
    calls that itself).

    ``sign`` (e.g. ``storage_layout.auth.signer(key)``) returns the marker with its
    signature; it is applied to the finished marker, so it covers all of it.
    Returns the committed marker (ours). Raises ``CommitConflict`` when another writer
    holds the marker.
    """
    write_id = write_id or new_write_id()
    entries = {rel: entry(blob) for rel, blob in objects.items()}
    data = {f"{data_prefix}/{rel}": blob for rel, blob in objects.items()}
    put_patiently(bucket, data, f"writing {data_prefix}")
    return commit_marker(
        bucket, marker_key, data_prefix, entries, kind, meta, writer, write_id, attempts, sign
    )


def commit_marker(
    bucket: Bucket,
    marker_key: str,
    data_prefix: str,
    entries: Mapping[str, Mapping[str, Any]],
    kind: str,
    meta: Mapping[str, Any],
    writer: str,
    write_id: str,
    attempts: int = 4,
    sign: Callable[[CommitMarker], CommitMarker] | None = None,
) -> CommitMarker:
    """Commit the objects already written under ``data_prefix``: the marker listing
    ``entries`` (``{relative key: entry(object)}``), written create-exclusive.

    A write whose answer was lost is read back: our ``write_id`` means it landed. When
    another writer holds the marker, our data prefix is deleted and ``CommitConflict``
    raised. ``sign`` as for ``commit_version``.
    """
    marker = CommitMarker(
        kind=kind,
        data_prefix=data_prefix,
        objects={rel: dict(entries[rel]) for rel in sorted(entries)},
        writer=writer,
        write_id=write_id,
        meta=dict(meta),
    )
    if sign is not None:
        marker = sign(marker)
    body = marker.to_json()
    delay = 0.1
    for attempt in range(attempts):
        try:
            bucket.put_exclusive(marker_key, body)
            return marker
        except FileExistsError:
            pass  # someone holds it: maybe us, if an earlier attempt's answer was lost
        except OSError:
            if attempt == attempts - 1:
                raise
        try:
            held = CommitMarker.from_json(bucket.get(marker_key, MAX_MARKER_BYTES), marker_key)
        except FileNotFoundError:
            time.sleep(delay)  # the write did not land: try again
            delay *= 2
            continue
        except (OSError, CorruptVersion):
            time.sleep(delay)  # no clear answer from the read-back either: ask again
            delay *= 2
            continue
        if held.write_id == write_id:
            return held  # our write landed; only its response was lost
        discard_data(bucket, data_prefix)
        raise CommitConflict(marker_key, write_id, held)
    raise OSError(f"could not write marker {marker_key} after {attempts} attempts")


def discard_data(bucket: Bucket, data_prefix: str) -> None:
    """Remove a losing or abandoned write's data (its prefix holds its write id alone)."""
    bucket.delete_prefix(data_prefix)


def read_marker(bucket: Bucket, marker_key: str) -> CommitMarker:
    """The marker at ``marker_key``, checked before anything trusts it: at most
    ``MAX_MARKER_BYTES``, well-formed, naming exactly the data prefix its key and write id
    give (``layout.data_prefix_of``) and only plain relative object keys. A marker that
    names any other prefix (``../..``, another version's data, another run) is
    ``CorruptVersion``: nothing is read or deleted on a stored object's word alone."""

    def read() -> CommitMarker:
        try:
            data = bucket.get(marker_key, limit=MAX_MARKER_BYTES)
        except Refused as exc:
            raise CorruptVersion(f"marker {marker_key}: {exc}; refused unread") from exc
        return checked_marker(CommitMarker.from_json(data, marker_key), marker_key)

    return patiently(read, marker_key)


def checked_marker(marker: CommitMarker, marker_key: str) -> CommitMarker:
    """``marker`` if its data prefix and object keys are the ones ``marker_key`` allows;
    else ``CorruptVersion`` naming what is wrong."""
    try:
        expected = data_prefix_of(marker_key, marker.write_id)
        for rel in marker.objects:
            check_key(rel, "object key")
    except LayoutError as exc:
        raise CorruptVersion(f"marker {marker_key}: {exc}") from exc
    if marker.data_prefix != expected:
        raise CorruptVersion(
            f"marker {marker_key} names data prefix {marker.data_prefix[:200]!r}, not its own "
            f"{expected!r}: forged or foreign; nothing it names is read or deleted"
        )
    return marker


def read_version(bucket: Bucket, marker_key: str) -> tuple[CommitMarker, dict[str, bytes]]:
    """The marker and its objects, each checked against the marker's size and sha256."""
    marker = read_marker(bucket, marker_key)
    return marker, fetch_objects(bucket, marker, marker_key)


def fetch_objects(
    bucket: Bucket,
    marker: CommitMarker,
    marker_key: str,
    groups: tuple[str, ...] | None = None,
    use_inline: bool = True,
) -> dict[str, bytes]:
    """The marker's objects (or only the root metadata and the named Zarr subgroups),
    each checked against the size and sha256 the marker records (a mismatch is read
    again, ``patiently``, before it is ``CorruptVersion``). Inlined copies are used
    unless ``use_inline`` is False (a full verification reads every stored object)."""
    wanted = {
        rel: expect
        for rel, expect in marker.objects.items()
        if groups is None or "/" not in rel or rel.split("/", 1)[0] in groups
    }
    out: dict[str, bytes] = {}
    for rel, expect in wanted.items():
        if use_inline and "inline" in expect:
            key = f"{marker.data_prefix}/{rel}"
            out[rel] = _checked(expect["inline"].encode("utf-8"), expect, key, marker_key)
    # What checks out is kept across attempts: only a failed or damaged read is asked again.
    return patiently(lambda: _fetch_rest(bucket, marker, marker_key, wanted, out), marker_key)


def _checked(data: bytes, expect: Mapping[str, Any], key: str, marker_key: str) -> bytes:
    if len(data) != expect["size"]:
        raise CorruptVersion(
            f"{marker_key}: object {key} has {len(data)} bytes, the marker says {expect['size']}"
        )
    if sha256(data) != expect["sha256"]:
        raise CorruptVersion(f"{marker_key}: object {key} does not match its sha256")
    return data


def _fetch_rest(
    bucket: Bucket,
    marker: CommitMarker,
    marker_key: str,
    wanted: Mapping[str, Mapping[str, Any]],
    out: dict[str, bytes],
) -> dict[str, bytes]:
    """Read the ``wanted`` objects not in ``out`` yet into it; each that arrives whole is
    kept, a damaged one raises ``CorruptVersion`` (after the others are kept)."""
    keys = {f"{marker.data_prefix}/{rel}": rel for rel in wanted if rel not in out}
    fetched: dict[str, bytes] = {}
    try:
        fetched = bucket.get_many(list(keys))
    except FileNotFoundError as exc:
        raise CorruptVersion(
            f"{marker_key}: object {exc.args[0]} listed in the marker is missing"
        ) from exc
    except PartialFailure as exc:
        fetched, failure = exc.done, exc
    else:
        failure = None
    damaged = None
    for key, data in fetched.items():
        rel = keys[key]
        try:
            out[rel] = _checked(data, wanted[rel], key, marker_key)
        except CorruptVersion as exc:
            damaged = exc
    if failure is not None:
        raise failure
    if damaged is not None:
        raise damaged
    return dict(out)
