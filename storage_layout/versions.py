"""Global versions of each fragment (``store.versions``): published at home then
everywhere, read whole, as a delta or in pieces, copied to regions that lag.

A part of a ``storage_layout.store.RunStore``, over its buckets and ``layout.py``."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protocol.quantize import QuantizedTensor, quantize
from storage_layout.chunks import ObjectSink
from storage_layout.codec import encode
from storage_layout.commit import (
    CommitConflict,
    CommitMarker,
    CorruptVersion,
    commit_marker,
    commit_version,
    new_write_id,
    read_marker,
)
from storage_layout.part import Part, fp32
from storage_layout.reading import decoded_pieces, named_damage, read_decoded
from storage_layout.stream import PARALLEL, VersionReader, checked_object

log = logging.getLogger(__name__)


class HomeCopiesLost(ValueError):
    """The home region lacks global versions of a fragment that other regions or the
    retention ledger show were committed: its master copies (fp32 parameters, outer
    optimizer state) are gone, and no syncer may go on or start over from version 0."""


@dataclass
class GlobalState:
    fragment: int
    version: int
    params: dict[str, np.ndarray]
    opt_leaves: list[np.ndarray]
    meta: dict[str, Any]
    # The stored name of each of ``opt_leaves`` (same order): its path in the optax state
    # tree (``0/trace/blocks.0.up.kernel``), or ``0000``, ``0001``... in versions written
    # before leaves had names. ``flows.bucket_io`` puts them back in the tree's order.
    opt_names: list[str] = field(default_factory=list)


@dataclass
class PublishReport:
    version: int
    committed: list[str] = field(default_factory=list)  # regions holding the version now
    lagging: dict[str, str] = field(default_factory=dict)  # region -> why it was skipped


WIRE = ("wire",)  # what a learner reads of a version: its full copy


LEARNER_GROUPS = ("wire", "delta")  # what regions other than home hold: also the update


def learner_view(objects: Mapping[str, bytes]) -> dict[str, bytes]:
    """A global version's objects without the master copy and optimizer state."""
    return {
        k: v for k, v in objects.items() if "/" not in k or k.split("/", 1)[0] in LEARNER_GROUPS
    }


def _opt_group(leaves: Sequence[np.ndarray] | Mapping[str, np.ndarray]) -> dict:
    """A version's ``opt`` group: the outer optimizer state's leaves under the names given
    (their paths in the optax state tree, ``flows.bucket_io``); a plain list is named by
    position, ``0000``, ``0001``... (as every version was before leaves had names)."""
    if isinstance(leaves, Mapping):
        return fp32(leaves)
    return fp32({f"{i:04d}": leaf for i, leaf in enumerate(leaves)})


class Versions(Part):
    def global_versions(self, fragment: int, region: str | None = None) -> list[int]:
        return self.store.numbers(
            self.bucket(region or self.store.client_region),
            self.layout.global_commits(fragment),
            "v",
        )

    def latest_global(self, fragment: int, region: str | None = None) -> int | None:
        versions = self.global_versions(fragment, region)
        return versions[-1] if versions else None

    def check_home(self, fragment: int) -> int | None:
        """The newest version of ``fragment`` at home (None for a run not started), after
        checking that no other region holds a newer one and that, if home holds none, no
        region and no ledger entry shows one was ever committed: else ``HomeCopiesLost``,
        naming what is missing (a relaunch must never republish version 0 over a run)."""
        home = self.latest_global(fragment)
        newer = {}
        for region in self.store.urls:
            if region != self.store.client_region:
                theirs = self.latest_global(fragment, region)
                if theirs is not None and (home is None or theirs > home):
                    newer[region] = theirs
        ledger = self.store.claim_numbers(self.home, self.layout.ledger_commits(fragment))
        if newer or (home is None and ledger):
            where = ", ".join(f"{r} holds v{v}" for r, v in sorted(newer.items()))
            where = where or f"the ledger records {len(ledger)} retention passes"
            raise HomeCopiesLost(
                f"run {self.store.run!r}: the home region {self.store.client_region} holds "
                f"{'no version' if home is None else f'v{home} at newest'} of fragment "
                f"{fragment}, but {where}: the master copies are gone from "
                f"{self.home.url}; restore them from a backup (or start another run)"
            )
        return home

    @staticmethod
    def global_objects(
        params: Mapping[str, np.ndarray],
        opt_leaves: list[np.ndarray],
        meta: Mapping[str, Any],
        wire_dtype: str = "fp32",
        wire: Mapping[str, np.ndarray] | None = None,
        delta: Mapping[str, QuantizedTensor] | None = None,
    ) -> dict[str, bytes]:
        """A global version: fp32 ``params`` and ``opt`` (what a restarted syncer needs) and
        ``wire``, the learners' full copy in the dtype they download (default: ``params``
        rounded to it), and optionally ``delta``, the compact update that turns the
        learners' copy of version ``meta["delta_base"]`` into this one."""
        opt = _opt_group(opt_leaves)
        groups = {
            "params": fp32(params),
            "opt": opt,
            "wire": {n: quantize(v, wire_dtype) for n, v in (wire or params).items()},
        }
        if delta is not None:
            groups["delta"] = dict(delta)
        return encode(groups, {"kind": "global", "wire_dtype": wire_dtype, **meta})

    def publish_global(
        self,
        fragment: int,
        version: int,
        params: Mapping[str, np.ndarray],
        opt_leaves: list[np.ndarray],
        meta: Mapping[str, Any],
        wire_dtype: str = "fp32",
        wire: Mapping[str, np.ndarray] | None = None,
        delta: Mapping[str, QuantizedTensor] | None = None,
        delta_base: int | None = None,
    ) -> PublishReport:
        """Commit version ``version`` of ``fragment`` at home (the arbiter), then everywhere
        (``global_objects`` says what a version holds; ``delta`` turns the learners' copy
        of version ``delta_base`` into this one's).

        Raises ``CommitConflict`` if another syncer already holds this version at home.
        """
        meta = {"fragment": fragment, "version": version, **meta}
        if delta is not None:
            meta["delta_base"] = delta_base if delta_base is not None else version - 1
        objects = self.global_objects(params, opt_leaves, meta, wire_dtype, wire, delta)
        write_id = new_write_id()
        report = PublishReport(version)

        def commit_in(region: str) -> None:
            commit_version(
                self.bucket(region),
                self.layout.global_marker(fragment, version),
                self.layout.global_data(fragment, version, write_id),
                objects if region == self.store.client_region else learner_view(objects),
                "global",
                meta,
                self.store.writer,
                write_id,
            )
            self.point_latest(region, fragment, version, write_id)

        commit_in(self.store.client_region)  # the arbiter: a conflict here means we lost the race
        others = [r for r in self.store.urls if r != self.store.client_region]
        return self.commit_elsewhere(fragment, commit_in, others, report)

    def commit_elsewhere(
        self,
        fragment: int,
        commit_in: Callable[[str], None],
        others: Sequence[str],
        report: PublishReport,
    ) -> PublishReport:
        """After a version committed at home: ``commit_in`` each of ``others`` at once;
        one that fails is ``lagging`` (caught up later by ``sync_regions``), never an
        error of the version's."""
        report.committed.append(self.store.client_region)
        with ThreadPoolExecutor(max_workers=max(1, len(others))) as pool:
            futures = {region: pool.submit(commit_in, region) for region in others}
        for region, future in futures.items():
            exc = future.exception()
            if exc is None:
                report.committed.append(region)
            elif isinstance(exc, CommitConflict):
                report.lagging[region] = "holds another write of this version"
            elif isinstance(exc, OSError):
                report.lagging[region] = f"unreachable: {exc}"
                log.warning("region %s is behind on fragment %d: %s", region, fragment, exc)
            else:
                raise exc
        return report

    def get_global(
        self,
        fragment: int,
        version: int,
        region: str | None = None,
        learner_view: bool = False,
        collect: Callable[[Iterator[tuple[str, np.ndarray]]], Mapping[str, Any]] | None = None,
    ) -> GlobalState:
        """A verified global version. ``learner_view`` fetches only the ``wire`` parameters
        (what a learner applies), not the fp32 master copy and the optimizer state; with
        ``collect``, they are handed to it one tensor at a time as ``(name,
        TensorPieces)``, each read and decoded to float32 a piece at a time, and its result
        is the version's parameters (a learner spills them to a local file:
        ``storage_layout.spill``), so the process never holds them all, nor a whole
        tensor."""
        bucket = self.bucket(region or self.store.client_region)
        key = self.layout.global_marker(fragment, version)
        marker = read_marker(bucket, key)
        if learner_view and collect is not None:
            params = collect(decoded_pieces(bucket, marker, key, WIRE[0]))
            return GlobalState(fragment, version, params, [], dict(marker.meta), [])
        if not learner_view and "params/zarr.json" not in marker.objects:
            raise CorruptVersion(
                f"{bucket.url}/{key} holds the learner view only; the master copy and the "
                f"optimizer state are in the syncer's home region"
            )
        groups = read_decoded(bucket, marker, key, WIRE if learner_view else ("params", "opt"))
        params = groups["wire"] if learner_view else groups["params"]
        opt_names = [] if learner_view else sorted(groups["opt"])
        opt = [groups["opt"][k] for k in opt_names]
        return GlobalState(fragment, version, params, opt, dict(marker.meta), opt_names)

    def get_global_delta(
        self, fragment: int, version: int, region: str | None = None
    ) -> tuple[int, VersionReader, dict] | None:
        """A version's compact update as learners read it: (the version it applies to, a
        reader of its ``delta`` group, the marker's meta); None if it was published whole
        only. The marker and the group's index are checked here; the values are read (and
        each chunk checked) as the caller asks for them, a range at a time, the next chunks
        read ahead meanwhile."""
        bucket = self.bucket(region or self.store.client_region)
        key = self.layout.global_marker(fragment, version)
        marker = read_marker(bucket, key)
        if "delta/zarr.json" not in marker.objects or "delta_base" not in marker.meta:
            return None
        with named_damage(key):
            reader = VersionReader(bucket, marker, key, ahead=PARALLEL)  # read in order
            reader.index("delta")
            base = marker.meta["delta_base"]
            if not isinstance(base, int) or isinstance(base, bool):
                raise ValueError(f"delta_base is {base!r}, not a version number")
        return base, reader, dict(marker.meta)

    def point_latest(self, region: str, fragment: int, version: int, write_id: str) -> None:
        """Overwrite the advisory ``globals/f{P}/latest.json`` in ``region`` after ``version``
        committed there: a hint for tools that would rather not list ``commits/``. The
        markers stay the truth (the pointer may lag, or name a version retention has since
        deleted), so nothing of ours reads it, and a failed write is logged, never raised."""
        key = self.layout.global_latest(fragment)
        body = {"fragment": fragment, "version": version,
                "marker": self.layout.global_marker(fragment, version),
                "data_prefix": self.layout.global_data(fragment, version, write_id),
                "writer": self.store.writer, "written_at": time.time(),
                "note": "advisory: the newest marker under commits/ is the truth"}  # fmt: skip
        try:
            self.bucket(region).put(key, json.dumps(body, sort_keys=True).encode())
        except Exception as exc:  # an advisory object never fails the commit behind it
            log.warning("could not update %s in region %s: %s", key, region, exc)

    def global_marker(self, fragment: int, version: int, region: str | None = None) -> CommitMarker:
        return read_marker(
            self.bucket(region or self.store.client_region),
            self.layout.global_marker(fragment, version),
        )

    def sync_regions(self, fragment: int) -> dict[str, int]:
        """Copy the home region's newest version of ``fragment`` to regions that lag.

        The objects are copied as committed (verified first), under the same write id, so
        every region holds byte-identical versions. Returns region -> version copied;
        regions still down are left for the next call.
        """
        newest = self.latest_global(fragment)
        copied: dict[str, int] = {}
        if newest is None:
            return copied
        key = self.layout.global_marker(fragment, newest)
        marker: CommitMarker | None = None
        for region in self.store.urls:
            if region == self.store.client_region:
                continue
            try:
                theirs = self.latest_global(fragment, region)
                if theirs is not None and theirs >= newest:
                    continue
                marker = marker or read_marker(self.home, key)
                self._copy_version(marker, key, region)
                self.point_latest(region, fragment, newest, marker.write_id)
                copied[region] = newest
            except (OSError, CommitConflict) as exc:
                log.warning("region %s still behind on fragment %d: %s", region, fragment, exc)
        return copied

    def _copy_version(self, marker: CommitMarker, key: str, region: str) -> None:
        """Copy a version's learner view from home to ``region`` object by object (each
        checked against the marker as it is read; a few uploads in flight), then its
        marker: a copy of any size in a few chunks' memory."""
        target = self.bucket(region)
        wanted = [rel for rel in marker.objects
                  if "/" not in rel or rel.split("/", 1)[0] in LEARNER_GROUPS]  # fmt: skip
        with ObjectSink(target, marker.data_prefix) as sink:
            for rel in wanted:
                sink.put(rel, checked_object(self.home, marker, key, rel))
            entries = sink.finish()
        commit_marker(target, key, marker.data_prefix, entries, "global", marker.meta,
                      self.store.writer, marker.write_id)  # fmt: skip
