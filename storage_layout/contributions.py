"""Learners' contributions, their outer gradients (``store.contributions``): committed by
content, read verified, revoked.

A part of a ``storage_layout.store.RunStore``, over its buckets and ``layout.py``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from protocol.quantize import QuantizedTensor
from storage_layout.auth import signer, verify
from storage_layout.codec import GroupWriter, group_kind, root_objects
from storage_layout.commit import (
    REVOKED,
    CommitMarker,
    CorruptVersion,
    Revoked,
    content_write_id_of,
    entry,
    new_write_id,
    read_marker,
)
from storage_layout.layout import data_prefix_of
from storage_layout.part import Part
from storage_layout.reading import read_groups

log = logging.getLogger(__name__)


def _write_delta(
    put: Callable[[str, bytes], None],
    shapes: Mapping[str, Sequence[int]],
    kind: str,
    block_size: int,
    pieces: Callable[[], Iterable[tuple[str, QuantizedTensor]]],
) -> int:
    """A contribution's objects (its root metadata and the ``delta`` group) to ``put``, a
    piece at a time; the payload's bytes."""
    for rel, blob in root_objects({"kind": "contribution"}).items():
        put(rel, blob)
    writer = GroupWriter(put, "delta", kind, shapes, block_size)
    payload = 0
    for name, q in pieces():
        writer.append(name, q)
        payload += q.nbytes
    writer.close()
    return payload


class Contributions(Part):
    def contribution_seqs(self, learner: str, fragment: int, region: str) -> list[int]:
        return self.store.numbers(
            self.bucket(region), self.layout.contribution_commits(learner, fragment), "s"
        )

    def put_contribution(
        self,
        learner: str,
        fragment: int,
        seq: int,
        tensors: Mapping[str, QuantizedTensor],
        meta: Mapping[str, Any],
        key: bytes | None = None,
        check: Callable[[], None] | None = None,
    ) -> CommitMarker:
        """Commit contribution ``seq`` of ``learner``'s ``fragment`` (its tensors and JSON
        meta) in this store's region, the learner's own; its marker is signed with ``key``
        (the learner's, ``storage_layout.auth``) if one is given. The objects are those
        ``encode`` makes of ``{"delta": tensors}``, written as ``put_contribution_stream``
        writes them (each tensor one piece). ``check``: called once the objects are up,
        just before the marker is written (it raises if the writer may commit no more)."""
        kind, block_size = group_kind("delta", tensors)

        def whole() -> Iterator[tuple[str, QuantizedTensor]]:
            for name in sorted(tensors):
                q = tensors[name]
                yield name, QuantizedTensor(kind, (q.size,), q.data, q.scales, q.block_size)

        shapes = {name: q.shape for name, q in tensors.items()}
        return self.put_contribution_stream(
            learner, fragment, seq, shapes, kind, block_size, whole, meta, key, check
        )

    def put_contribution_stream(
        self,
        learner: str,
        fragment: int,
        seq: int,
        shapes: Mapping[str, Sequence[int]],
        kind: str,
        block_size: int,
        pieces: Callable[[], Iterable[tuple[str, QuantizedTensor]]],
        meta: Mapping[str, Any],
        key: bytes | None = None,
        check: Callable[[], None] | None = None,
    ) -> CommitMarker:
        """``put_contribution`` of tensors of ``shapes`` given a piece at a time, so the
        learner never holds its whole payload encoded: ``pieces()`` yields ``(name, flat
        piece)`` in ``GroupWriter`` order (names sorted, each tensor's pieces in order) and
        is called twice, giving the same pieces both times. The first pass only hashes
        the chunk objects, for the write id that names the content (``content_write_id``:
        a retried upload rewrites its own prefix and finds its own marker); the second
        uploads them (``ObjectSink``), then the marker is committed. Same objects, write
        id and marker fields as ``put_contribution`` of the same tensors."""
        marker_key = self.layout.contribution_marker(learner, fragment, seq)
        payload = [0]

        def write(put: Callable[[str, bytes], None]) -> None:
            payload[0] = _write_delta(put, shapes, kind, block_size, pieces)

        def body() -> dict[str, Any]:  # made once the objects are up, for the marker
            if check is not None:
                check()
            return {**meta, "learner": learner, "fragment": fragment, "seq": seq,
                    "payload_bytes": payload[0], "written_at": time.time()}  # fmt: skip

        return self._put_by_content(
            marker_key, lambda wid: self.layout.contribution_data(learner, fragment, seq, wid),
            write, "contribution", body, None if key is None else signer(key),
        )  # fmt: skip

    def _put_by_content(
        self,
        marker_key: str,
        data_prefix: Callable[[str], str],
        write: Callable[[Callable[[str, bytes], None]], None],
        kind: str,
        body: Callable[[], dict[str, Any]],
        sign: Callable[[CommitMarker], CommitMarker] | None = None,
    ) -> CommitMarker:
        """Commit at home the objects ``write(put)`` puts, a chunk at a time, under a
        write id that names their content (``content_write_id``: a retried write rewrites
        its own prefix and finds its own marker). ``write`` runs twice and must put the
        same objects both times: the first pass only hashes them (for the id), the second
        uploads them (``ObjectSink``); then the marker (``body()`` its meta) is committed.
        So no writer holds its objects whole, whatever their size."""
        hashed: dict[str, dict[str, Any]] = {}

        def record(rel: str, data: bytes) -> None:
            hashed[rel] = entry(data)

        write(record)
        write_id = content_write_id_of(marker_key, hashed)
        return self.put_streamed(marker_key, data_prefix(write_id), write, kind, body,
                                 write_id, sign, hashed)  # fmt: skip

    def revoke_contribution(self, learner: str, fragment: int, seq: int, why: str) -> bool:
        """Hold contribution ``seq`` of ``learner``'s ``fragment`` in this store's home (the
        learner's region) with a ``REVOKED`` marker, an exclusive create, so that a commit
        of it still under way in a fenced process fails (``commit_marker`` finds the key
        held); False when a contribution was committed there first. Every reader of
        contribution markers skips a revoked one (``contribution_head`` raises
        ``Revoked``)."""
        key = self.layout.contribution_marker(learner, fragment, seq)
        write_id = new_write_id()
        marker = CommitMarker(REVOKED, data_prefix_of(key, write_id), {}, self.store.writer, write_id,
                              {"learner": learner, "fragment": fragment, "seq": seq, "why": why,
                               "time": time.time()})  # fmt: skip
        return (
            self.store.create(key, marker.to_json()) or read_marker(self.home, key).kind == REVOKED
        )

    def get_contribution(
        self, learner: str, fragment: int, seq: int, region: str, key: bytes | None = None
    ) -> tuple[dict[str, QuantizedTensor], dict[str, Any]]:
        """One committed contribution's tensors and meta, verified against its marker
        (``CorruptVersion`` if anything does not match). With ``learner``'s ``key``, the
        marker must be signed with it (``Unauthenticated``, before any data is fetched)."""
        marker = self.contribution_head(learner, fragment, seq, region, key)
        return self.contribution_tensors(marker, learner, fragment, seq, region), dict(marker.meta)

    def contribution_head(
        self, learner: str, fragment: int, seq: int, region: str, key: bytes | None = None
    ) -> CommitMarker:
        """A committed contribution's marker, without its data: signed with ``key`` if one
        is given (``Unauthenticated``) and describing this very contribution
        (``CorruptVersion``). A reader that finds a newer one from the same anchor need
        not read this one's data at all."""
        where = self.layout.contribution_marker(learner, fragment, seq)
        marker = read_marker(self.bucket(region), where)
        if marker.kind == REVOKED:
            raise Revoked(f"{where}: revoked by {marker.writer} ({marker.meta.get('why')})")
        if key is not None:
            verify(marker, key, learner, where)
        m = marker.meta
        if (m.get("learner"), m.get("fragment"), m.get("seq")) != (learner, fragment, seq):
            raise CorruptVersion(f"{where}: marker describes another contribution ({m})")
        return marker

    def contribution_tensors(
        self, marker: CommitMarker, learner: str, fragment: int, seq: int, region: str
    ) -> dict[str, QuantizedTensor]:
        """The tensors a contribution's ``marker`` (from ``contribution_head``) lists,
        each object checked against it."""
        where = self.layout.contribution_marker(learner, fragment, seq)
        return read_groups(self.bucket(region), marker, where, ("delta",))["delta"]

    def contribution_meta(self, learner: str, fragment: int, seq: int, region: str) -> dict:
        """The meta of one committed contribution's marker (no tensors are read)."""
        key = self.layout.contribution_marker(learner, fragment, seq)
        return dict(read_marker(self.bucket(region), key).meta)
