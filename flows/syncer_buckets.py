"""The syncer's half of ``BucketStore`` (``flows.bucket_io``): contributions listed as
headers and read a piece at a time (every chunk checked, its values scanned), a
fragment's stored versions inside the staleness window, and new versions merged straight
into the buckets and published."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import jax
import numpy as np

from diloco.loops import StoredFragment, Unreadable
from diloco.outer import Contribution
from diloco.records import Record
from diloco.syncer import GlobalVersion
from diloco.tensors import Tensors, materialize, pieces
from diloco.transport import downlink_update
from diloco.validate import Scan, scan_payload
from flows.learner_buckets import READ_ATTEMPTS
from flows.state_io import (
    named_outer_leaves,
    ordered_outer_leaves,
    outer_names,
)
from flows.version_stream import (
    ReaderPayload,
    ReaderTensors,
    StreamedVersion,
    slot_names,
    uploads_in_flight,
)
from storage_layout.auth import Unauthenticated
from storage_layout.chunks import ChunkSpool
from storage_layout.commit import CommitConflict, CorruptVersion, Revoked, patiently, read_marker
from storage_layout.store import poll
from storage_layout.stream import VersionReader

log = logging.getLogger(__name__)

LISTING_PATIENCE = 30.0  # seconds a syncer lists its fragment's versions before it gives up


def contribution_from(
    learner: str,
    fragment: int,
    seq: int,
    tensors: Mapping[str, Any] | None,
    meta: Mapping[str, Any],
) -> Contribution:
    """A contribution from its marker's meta; ``tensors`` None: a header (no payload)."""
    return Contribution(
        learner=learner, fragment=fragment, seq=seq, base_version=int(meta["base_version"]),
        tokens=int(meta["tokens"]), steps=int(meta["steps"]), seconds=float(meta["seconds"]),
        payload=None if tensors is None else dict(tensors), step=int(meta.get("step", 0)),
        anchor_seq=int(meta.get("anchor_seq", 0)), base_id=_base_id(meta.get("base_id")),
    )  # fmt: skip


def _base_id(value: Any) -> str | None:
    """A contribution's ``base_id`` (None: sent before ids existed), checked."""
    if value is None or (isinstance(value, str) and re.fullmatch(r"[0-9a-f]{16}", value)):
        return value
    raise ValueError(f"base_id {value!r} is not a version id")


class _Guarded:
    """``Tensors`` that call ``on_damage`` before a read failure propagates."""

    def __init__(self, tensors: Tensors, on_damage: Callable[[], None]):
        self.tensors, self.on_damage = tensors, on_damage

    @property
    def shapes(self) -> Mapping[str, tuple[int, ...]]:
        return self.tensors.shapes

    def piece(self, name: str, start: int, stop: int) -> np.ndarray:
        try:
            return self.tensors.piece(name, start, stop)
        except (CorruptVersion, KeyError, ValueError, OSError):
            self.on_damage()
            raise


class SyncerBuckets:
    """What a syncer process asks of the run's buckets (mixed into ``BucketStore``)."""

    def _named_opt(
        self, fragment: int, params: Mapping[str, Any], leaves: list[Any]
    ) -> dict[str, np.ndarray] | list[Any]:
        """The outer optimizer leaves by their path in the state tree, as a version stores
        them; by position (as before names) if the run's spec cannot be read just now."""
        try:
            return named_outer_leaves(self._outer(), params, leaves)
        except (CorruptVersion, OSError, KeyError, ValueError) as exc:
            log.warning("fragment %d: outer optimizer leaves stored by position: %s", fragment, exc)
            return leaves

    def contributions(
        self, learner: str, fragment: int, after: int
    ) -> list[Contribution | Unreadable]:
        """New committed contributions in seq order, as headers: each marker is read and
        checked, the data is not (``read`` fetches it; a newer contribution from the same
        anchor makes an older one's data unneeded). One whose marker cannot be read yet
        (an ``OSError``) ends the list, to be read on the next look. With the run secret,
        one not signed with its learner's key is ``Unreadable``, named as such."""
        region = self.region_of(learner)
        key = self.keys.verifying_key(learner)
        heads = self._heads.setdefault((learner, fragment), {})
        for seq in [s for s in heads if s <= after]:
            del heads[seq]  # settled: listed, read or passed over
        out: list[Contribution | Unreadable] = []
        for seq in self.main.contributions.contribution_seqs(learner, fragment, region):
            if seq <= after or (learner, fragment, seq) in self._revoked:
                continue
            try:
                head = partial(self.main.contributions.contribution_head, learner, fragment)
                marker = heads.get(seq) or patiently(
                    partial(head, seq, region, key), f"{learner} fragment {fragment} seq {seq}",
                    READ_ATTEMPTS,
                )  # fmt: skip
                heads[seq] = marker
                out.append(contribution_from(learner, fragment, seq, None, marker.meta))
            except Revoked:  # no contribution there, ever (``SilentReleases``)
                self._revoked.add((learner, fragment, seq))
            except Unauthenticated as exc:
                out.append(Unreadable(learner, fragment, seq, f"not authentic: {exc}", True))
            except (CorruptVersion, KeyError, ValueError, TypeError) as exc:
                out.append(Unreadable(learner, fragment, seq, f"unreadable: {exc}"))
            except OSError as exc:
                log.warning(
                    "cannot read %s fragment %d seq %d yet: %s", learner, fragment, seq, exc
                )
                break
        return out

    def read(self, c: Contribution) -> Contribution | Unreadable:
        """``c`` (a header from ``contributions``) with its payload, read a piece at a time
        (``ReaderPayload``), or ``Unreadable`` when its data does not match its marker
        after ``READ_ATTEMPTS`` reads (a read can come back damaged while the object is
        whole; a rejection is for good). Every chunk is read and checked here, and its
        values scanned (``validate.scan_payload``: dtypes, NaN, the norm), in bounded
        memory; the merge reads them again. An ``OSError`` means: not readable yet."""
        if c.payload is not None:
            return c
        learner, fragment, seq = c.learner, c.fragment, c.seq
        marker = self._heads[(learner, fragment)][seq]
        bucket = self.main.bucket(self.region_of(learner))
        where = self.main.layout.contribution_marker(learner, fragment, seq)

        spool = self._contribution_spool()

        def scan() -> Scan:
            reader = VersionReader(bucket, marker, where, cache=1, ahead=self.ahead, fill=spool)
            return scan_payload(ReaderPayload(reader), self.block_size)

        try:
            found = patiently(scan, f"{learner} fragment {fragment} seq {seq}", READ_ATTEMPTS)
        except (CorruptVersion, KeyError, ValueError) as exc:
            return Unreadable(learner, fragment, seq, f"unreadable: {exc}")
        # A fresh reader for the merge: it holds no chunk until then, and takes those
        # the scan kept in the spool instead of fetching them again.
        reader = VersionReader(bucket, marker, where, cache=1, ahead=self.ahead, reuse=spool)
        return replace(c, payload=ReaderPayload(reader), scan=found)

    def _contribution_spool(self) -> ChunkSpool | None:
        if self._spool is None and self.syncer_spool_mb > 0:
            self._spool = ChunkSpool(self.syncer_spool_mb * 2**20)
        return self._spool

    def _reader(self, bucket: Any, marker: Any, key: str) -> VersionReader:
        """A reader for the syncer's merge: one chunk kept per array, ``self.ahead``
        fetched and checked ahead in the background (bounded by ``syncer_memory_mb``)."""
        return VersionReader(bucket, marker, key, cache=1, ahead=self.ahead)

    def version_sink(
        self, fragment: int, version: int, shapes: Mapping[str, Sequence[int]], slots: int
    ) -> StreamedVersion:
        """Where the syncer merges version ``version`` of ``fragment``: straight into the
        buckets (``StreamedVersion``); ``publish`` commits it."""
        names = outer_names(self._outer(), shapes)
        base = None
        if (
            self.downlink != "full"
            and version > 0
            and (fragment, version - 1) not in self._bad_bases
        ):
            base = self._wire_of(fragment, version - 1)
        sink = StreamedVersion(
            self.main, fragment, version, shapes, slot_names(names, shapes, slots),
            self.wire_dtype, self.downlink, self.block_size, base,
            in_flight=uploads_in_flight(self.syncer_memory_mb, len(self.regions),
                                        len(self.learners)),
        )  # fmt: skip
        self._streams[(fragment, version)] = sink
        return sink

    def _wire_of(self, fragment: int, version: int) -> Tensors | None:
        """The learners' copy of ``version`` at home, read a piece at a time (the base of
        the next compact update), or None (that version goes out whole) when it cannot
        be opened; a damaged chunk found while merging marks it (``_bad_bases``), and the
        merge, tried again, sends the version whole."""
        key = self.main.layout.global_marker(fragment, version)
        try:
            reader = self._reader(self.main.home, read_marker(self.main.home, key), key)
            return _Guarded(ReaderTensors(reader, "wire"),
                            lambda: self._bad_bases.add((fragment, version)))  # fmt: skip
        except (CorruptVersion, KeyError, ValueError, OSError) as exc:
            log.warning("fragment %d: the learners' copy of version %d is unreadable (%s); "
                        "version %d goes out whole", fragment, version, exc, version + 1)  # fmt: skip
            return None

    def publish(self, gv: GlobalVersion, opt_leaves: list[Any], record: Record) -> bool:
        streamed = self._streams.pop((gv.fragment, gv.version), None)
        for key in [k for k in self._streams if k[0] == gv.fragment and k[1] < gv.version]:
            del self._streams[key]  # merges that failed before a publish
        if streamed is not None:
            try:
                self.last_report = streamed.commit(record)
            except CommitConflict:
                return False
            return True
        base = self._learners_copy(gv.fragment, gv.version - 1)
        params = materialize(gv.params)
        wire, delta = downlink_update(params, base, self.wire_dtype, self.downlink,
                                      self.block_size)  # fmt: skip
        self._published.pop(gv.fragment, None)
        opt = self._named_opt(gv.fragment, params, opt_leaves)
        try:
            self.last_report = self.main.versions.publish_global(
                gv.fragment, gv.version, params, opt, record, self.wire_dtype,
                wire=wire, delta=delta, delta_base=gv.version - 1,
            )  # fmt: skip
        except CommitConflict:
            return False
        self._published[gv.fragment] = (gv.version, wire)
        return True

    def _learners_copy(self, fragment: int, version: int) -> dict[str, np.ndarray] | None:
        """The learners' copy of ``version`` (the base of the next compact update), or None
        (no update: the next version goes out whole) when the downlink is ``full`` or the
        version cannot be read."""
        if self.downlink == "full" or version < 0:
            return None
        held = self._published.get(fragment)
        if held is not None and held[0] == version:
            return held[1]
        try:
            return self.main.versions.get_global(fragment, version, learner_view=True).params
        except (CorruptVersion, OSError) as exc:
            log.warning("fragment %d: the learners' copy of version %d is unreadable (%s); "
                        "version %d goes out whole", fragment, version, exc, version + 1)  # fmt: skip
            return None

    def load_fragment(self, fragment: int, window: int) -> StoredFragment:
        """Fragment ``fragment``'s newest version that reads at home, and the versions
        inside the staleness window, each read a piece at a time when used (nothing of
        them is held here). The newest is read through once, every chunk checked, so a
        damaged one is found now (and declared lost), not half way through a merge."""
        store = self.main
        # Version 0 is written before any syncer starts: none listed is a listing that
        # left the newest out (a stale one), so it is asked again before it is believed.
        versions = poll(lambda: store.versions.global_versions(fragment), timeout=LISTING_PATIENCE)
        if not versions:
            raise FileNotFoundError(f"run {self.run!r} has no version of fragment {fragment} "
                                    f"(listed for {LISTING_PATIENCE:g} s)")  # fmt: skip
        lost = []
        for version in reversed(versions):  # the newest that reads (only home holds it all)
            try:
                params, slots, meta = self._stored(fragment, version, check=True)
                break
            except (CorruptVersion, KeyError, ValueError) as exc:
                log.error("fragment %d version %d is corrupt at home: %s", fragment, version, exc)
                lost.append(version)
        else:
            raise CorruptVersion(f"no version of fragment {fragment} reads at home")
        history = {}
        for v in versions:
            if version - window <= v < version:
                try:
                    history[v] = self._stored(fragment, v)[0]
                except (CorruptVersion, KeyError, ValueError) as exc:
                    # Contributions based on it are rejected ("no longer held"); the rest merge.
                    log.error("fragment %d version %d is corrupt; left out: %s", fragment, v, exc)
        return StoredFragment(version, params, slots, meta, history, lost)

    def _stored(
        self, fragment: int, version: int, check: bool = False
    ) -> tuple[Tensors, list[Tensors], dict[str, Any]]:
        """A version's master copy and outer optimizer state at home, as ``Tensors``
        (``check``: every chunk read once and checked)."""
        home, key = self.main.home, self.main.layout.global_marker(fragment, version)
        marker = read_marker(home, key)
        if "params/zarr.json" not in marker.objects:
            raise CorruptVersion(f"{home.url}/{key} holds the learner view only; the master "
                                 "copy and the optimizer state are in the syncers' home region")  # fmt: skip
        reader = self._reader(home, marker, key)
        params = ReaderTensors(reader, "params")
        stored = sorted(reader.index("opt"))
        # The stored leaf names in the optimizer's order: the rule whole leaves follow
        # (``ordered_outer_leaves``), applied to the names themselves.
        shaped = {n: jax.ShapeDtypeStruct(s, np.float32) for n, s in params.shapes.items()}
        wanted_in_order = ordered_outer_leaves(self._outer(), shaped, stored, stored)
        count = len(wanted_in_order) // max(1, len(params.shapes))
        slots = [ReaderTensors(reader, "opt", names)
                 for names in slot_names(wanted_in_order, params.shapes, count)]  # fmt: skip
        if check:
            for tensors in (params, *slots):
                for name, start, stop in pieces(params.shapes):
                    tensors.piece(name, start, stop)
            reader = self._reader(home, marker, key)  # one holding no chunk
            params = ReaderTensors(reader, "params")
            slots = [ReaderTensors(reader, "opt", s.names) for s in slots]
        return params, slots, dict(marker.meta)
