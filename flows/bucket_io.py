"""The one adapter between training types and the storage layer.

``storage_layout`` stores named tensors and JSON meta under its commit protocol and
knows nothing of training. This module turns contributions, learner checkpoints
(the inner optimizer state) and global versions (parameters, outer optimizer state,
the version record) into that form and back, and implements the core's ``Store``
(``diloco.transport``) over a run's buckets: the simulator's ``--store`` runs and
the pipeline's learner and syncer processes use this same class.

What it adds to the storage layer is the training-side reading of failures: an
unreadable contribution becomes ``Unreadable`` (the syncer rejects it and goes on), a
corrupt checkpoint falls back to the one before, a corrupt version inside the staleness
window is left out of the syncer's history. It also holds the process's keys
(``storage_layout.auth``): a learner signs its contributions, and a syncer holding the run
secret turns one its learner did not sign into ``Unreadable`` as well.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import jax
import numpy as np
import optax

from diloco.config import OuterConfig
from diloco.learner import LearnerCheckpoint
from diloco.loops import GlobalView, StoredFragment, Unreadable
from diloco.outer import Contribution
from diloco.records import Record
from diloco.syncer import GlobalVersion
from diloco.tensors import Tensors, materialize, pieces
from diloco.transport import Collect, GlobalDelta, downlink_update
from diloco.units import RegionalLedger, UnitPlan
from diloco.validate import Scan, scan_payload
from flows.ledger import region_ledger, region_pools
from flows.state_io import (
    HostPart,
    named_outer_leaves,
    optimizer_leaves,
    ordered_outer_leaves,
    outer_names,
    read_checkpoint,
)
from flows.unit_offers import UnitOffers
from flows.version_stream import (
    ReaderPayload,
    ReaderTensors,
    StreamedVersion,
    reads_ahead,
    slot_names,
    uploads_in_flight,
)
from protocol.topology import learner_region, run_deal, run_slots
from storage_layout.auth import Keys, Unauthenticated
from storage_layout.chunks import ChunkSpool
from storage_layout.commit import CommitConflict, CorruptVersion, Revoked, patiently, read_marker
from storage_layout.members import SeqNotReserved
from storage_layout.retention import prune_checkpoints
from storage_layout.store import RunStore, poll
from storage_layout.stream import VersionReader
from storage_layout.traffic import Traffic
from storage_layout.versions import PublishReport

log = logging.getLogger(__name__)

READ_ATTEMPTS = 3  # reads of a contribution before it is rejected as corrupt
# Seqs a learner process reserves at a time (``RunStore.members.reserve_seqs``): one small write
# per this many sends; a restart skips at most this many numbers.
SEQ_BLOCK = 8
LISTING_PATIENCE = 30.0  # seconds a syncer lists its fragment's versions before it gives up
REVOKED_BLOCKS = 4  # the newest blocks of seqs ``revoke_unsent`` holds
# Contribution fields kept in the marker's meta (the tensors are the payload).
_COUNTERS = ("base_version", "anchor_seq", "step", "tokens", "steps", "seconds")


def contribution_meta(c: Contribution) -> dict[str, Any]:
    # "data": the learner's data positions (its batches, one per inner step) whose steps
    # this send carries, [from, to): the audit shows them and checks none merged twice.
    return {**{k: getattr(c, k) for k in _COUNTERS}, "data": [c.step - c.steps, c.step]}


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
        anchor_seq=int(meta.get("anchor_seq", 0)),
    )  # fmt: skip


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


class BucketStore:
    """A run's ``Store`` in its regions' buckets (see the module docstring).

    ``learners`` maps learner id -> region; a learner's writes go to its own region
    through a store whose writer is the learner. ``home`` is the region this process
    reads globals from and the syncers publish to first. ``place`` (the trainer's) and
    ``opt_template`` (a freshly initialized inner optimizer state) rebuild checkpoints;
    they are needed only where checkpoints are read. ``keys`` default to the environment's
    (``Keys.from_env``; a learner's own key when ``writer`` is a learner).
    """

    def __init__(
        self,
        run: str,
        regions: Mapping[str, str],
        home: str,
        learners: Mapping[str, str],
        wire_dtype: str,
        writer: str,
        place: Callable[[dict], dict] | None = None,
        opt_template: Callable[[], optax.OptState] | None = None,
        traffic: Traffic | None = None,
        keys: Keys | None = None,
        downlink: str = "full",
        block_size: int = 128,
        syncer_memory_mb: int = 512,
        syncer_spool_mb: int = 2048,
    ):
        self.run, self.regions, self.home = run, dict(regions), home
        self.syncer_memory_mb = syncer_memory_mb
        # chunks per array the syncer's readers fetch ahead of its merge
        self.ahead = reads_ahead(syncer_memory_mb, len(self.regions), len(learners))
        # contributions' chunks checked by the scan, kept on disk for the merge (made on
        # the first scan: learners never need one); 0 MB: none, the merge fetches again
        self.syncer_spool_mb = syncer_spool_mb
        self._spool: ChunkSpool | None = None
        self.downlink, self.block_size = downlink, block_size
        # fragment -> (version, learners' copy) this process published last: the base of
        # the next version's compact update (read back from home when it is not this one)
        self._published: dict[int, tuple[int, dict[str, np.ndarray]]] = {}
        # (fragment, version) -> the version a merge is streaming out, until published
        self._streams: dict[tuple[int, int], StreamedVersion] = {}
        # (fragment, version) whose learners' copy could not be read as a compact
        # update's base: the next version goes out whole
        self._bad_bases: set[tuple[int, int]] = set()
        # (learner, fragment) -> seq -> the marker of a listed contribution not read yet
        self._heads: dict[tuple[str, int], dict[int, Any]] = {}
        # learner -> (claim, first, end) of the block of seqs this process holds
        self._seqs: dict[str, tuple[int | None, int, int]] = {}
        # learner -> the generation this process claimed as it (``claim_generation``)
        self._generations: dict[str, int] = {}
        # (learner, fragment, seq) held by a revoked marker: no contribution there, ever
        self._revoked: set[tuple[str, int, int]] = set()
        self.learners = dict(learners)
        if keys is None:
            keys = Keys.from_env(run, writer if writer in self.learners else None)
        self.keys = keys
        self.wire_dtype = wire_dtype
        self.place, self.opt_template = place, opt_template
        self.traffic = traffic if traffic is not None else Traffic()
        self.checkpoint_traffic = Traffic()  # not synchronization traffic
        self.main = RunStore(run, regions, home, writer=writer, traffic=self.traffic,
                             claims_key=keys.claims_key)  # fmt: skip
        self._writers: dict[str, RunStore] = {}
        self._checkpoints: dict[str, RunStore] = {}
        self.last_report: PublishReport | None = None

    def writer_for(self, learner: str, checkpoints: bool = False) -> RunStore:
        """The store ``learner`` writes through: its own region, itself as the writer."""
        cache = self._checkpoints if checkpoints else self._writers
        if learner not in cache:
            region = self.region_of(learner)
            traffic = self.checkpoint_traffic if checkpoints else self.traffic
            cache[learner] = RunStore(
                self.run,
                {region: self.regions[region]},
                region,
                writer=learner,
                traffic=traffic,
                claims_key=self.keys.claims_key,
            )
        return cache[learner]

    def region_store(self, region: str) -> RunStore:
        """A store of ``region``'s bucket alone, this process its writer."""
        return RunStore(self.run, {region: self.regions[region]}, region, writer=self.main.writer,
                        traffic=self.traffic, claims_key=self.keys.claims_key)  # fmt: skip

    def region_of(self, learner: str) -> str:
        if learner not in self.learners:
            raise ValueError(f"{learner!r} is not a learner of run {self.run!r}")
        return self.learners[learner]

    # learner side ---------------------------------------------------------------------
    def put_contribution(self, c: Contribution) -> None:
        """Commit ``c`` in its learner's region, signed with the learner's key if this
        process holds it (a syncer holding the run secret rejects unsigned ones). Its seq
        must lie in a block this process reserved (``SeqNotReserved`` if another process of
        the learner holds the numbers above it)."""
        self._reserved(c.learner, c.seq)
        self.check_newest(c.learner)  # before the upload, and again just before the marker:
        key = self.keys.signing_key(c.learner)  # a process fenced meanwhile commits nothing
        self.writer_for(c.learner).contributions.put_contribution(
            c.learner, c.fragment, c.seq, c.payload, contribution_meta(c), key=key,
            check=lambda: self.check_newest(c.learner),
        )  # fmt: skip

    def claim_generation(self, learner: str) -> int:
        """Claim the next generation of ``learner`` for this process (``RunStore.
        claim_generation``); every later commit checks that it is still the newest."""
        self._generations[learner] = self.writer_for(learner).members.claim_generation(learner)
        return self._generations[learner]

    def check_newest(self, learner: str) -> None:
        """``SeqNotReserved`` if another process has started as ``learner`` since this one
        claimed its generation, or has reserved seqs above this one's block: the next
        claim's key is read, not listed (a read by key is never stale), just before each
        commit, so a process that is no longer the newest commits nothing, not even a
        seq inside a block it reserved before the newer one started."""
        store = self.writer_for(learner)
        bucket, layout = store.home, store.layout
        nexts = []
        if learner in self._generations:
            nexts.append(("generation", layout.lease_commits(learner),
                          self._generations[learner]))  # fmt: skip
        claim = self._seqs.get(learner, (None, 0, 0))[0]
        if claim is not None:
            nexts.append(("block of seqs", layout.seq_claims(learner), claim))
        for what, prefix, held in nexts:
            key = store.numbered_claim(prefix, held + 1)
            if patiently(lambda: bucket.exists(key), key):  # noqa: B023
                raise SeqNotReserved(
                    f"{learner}: another process runs as this learner now (it holds "
                    f"{what} {held + 1}, this one {held}); this one commits nothing more"
                )

    def _reserved(self, learner: str, seq: int) -> None:
        """Make sure this process holds ``seq`` of ``learner`` (``RunStore.members.reserve_seqs``)."""
        claim, first, end = self._seqs.get(learner, (None, 0, 0))
        if first <= seq < end:
            return
        if seq >= end:
            claim, first, end = self.writer_for(learner).members.reserve_seqs(
                learner, seq, SEQ_BLOCK, after=claim
            )
            self._seqs[learner] = (claim, first, end)
        if first != seq:
            raise SeqNotReserved(
                f"{learner}: seq {seq} is not this process's to commit: another process of "
                f"{learner} has reserved the numbers from {first} on since (it runs as this "
                "learner now); this one must stop"
            )

    def sent_so_far(self, learner: str) -> tuple[int, int]:
        """(newest seq, its step) among ``learner``'s committed contributions, for a process
        that starts as ``learner``: it also reserves the first block of seqs this process
        commits, so the seq returned is the one below that block, never below a seq an
        earlier process may have committed (``RunStore.members.reserve_seqs``), even when the
        listings leave the newest contributions out. The step is that of the newest
        contribution of its own (signed with its key, when it has one: a forged marker
        with a far-future seq must not carry it there), listed or found by key among the
        numbers the earlier processes reserved, so work already sent is not trained
        again."""
        store, region = self.writer_for(learner), self.region_of(learner)
        seq, step = 0, 0  # of the newest own contribution listed
        for p in range(self._fragments()):
            for listed in reversed(store.contributions.contribution_seqs(learner, p, region)):
                if listed <= seq:
                    break
                meta = self._own(learner, p, listed)
                if meta is not None:
                    seq, step = listed, int(meta.get("step", 0))
                    break
        self._seqs[learner] = store.members.reserve_seqs(learner, seq + 1, SEQ_BLOCK)
        first = self._seqs[learner][1]
        # What a stale listing left out: the predecessor's newest is in its last blocks.
        bucket = store.bucket(region)
        for unlisted in range(first - 1, max(seq, first - 1 - 2 * SEQ_BLOCK), -1):
            for p in range(self._fragments()):
                key = store.layout.contribution_marker(learner, p, unlisted)
                if patiently(lambda: bucket.exists(key), key):  # noqa: B023
                    meta = self._own(learner, p, unlisted)
                    if meta is not None:
                        return first - 1, int(meta.get("step", 0))
        return first - 1, step

    def revoke_unsent(self, learner: str, why: str) -> int:
        """Hold the keys of ``learner``'s reserved seqs that hold no contribution, in every
        fragment (its newest ``REVOKED_BLOCKS`` blocks: a process commits only inside the
        blocks it holds, and each syncer that gives the learner's data back reserves one
        more, ``sent_so_far``), so that a commit still under way in a fenced process
        lands nowhere (``RunStore.contributions.revoke_contribution``): what is committed once this
        returns is all that ever will be. Returns how many keys it held."""
        region = self.region_of(learner)
        store = self.region_store(region)
        fragments = range(self._fragments())
        sent = {
            s for p in fragments for s in store.contributions.contribution_seqs(learner, p, region)
        }
        held = 0
        for first, end in store.members.seq_blocks(learner, newest=REVOKED_BLOCKS):
            for seq in range(first, end):
                if seq not in sent:
                    held += sum(
                        store.contributions.revoke_contribution(learner, p, seq, why)
                        for p in fragments
                    )
        return held

    def _own(self, learner: str, fragment: int, seq: int) -> dict[str, Any] | None:
        """The meta of ``learner``'s contribution ``seq`` if its marker reads and is signed
        with the learner's key (when this process holds it); None (and a warning) if not."""
        store, region = self.writer_for(learner), self.region_of(learner)
        key = self.keys.signing_key(learner)
        try:
            marker = patiently(
                lambda: store.contributions.contribution_head(learner, fragment, seq, region, key),
                f"{learner} fragment {fragment} seq {seq}",
                READ_ATTEMPTS,
            )
        except Revoked:
            return None  # held by a syncer: never sent
        except (Unauthenticated, CorruptVersion, FileNotFoundError, KeyError, ValueError) as exc:
            log.warning("%s: not counting contribution %d of fragment %d as its own: %s",
                        learner, seq, fragment, exc)  # fmt: skip
            return None
        return dict(marker.meta)

    def _fragments(self) -> int:
        if not hasattr(self, "_fragment_count"):
            self._fragment_count = len(self.main.read_spec()["fragments"])
        return self._fragment_count

    def _outer(self) -> OuterConfig:
        """The run's outer optimizer config (its state's structure names the stored leaves)."""
        if not hasattr(self, "_outer_cfg"):
            self._outer_cfg = OuterConfig.model_validate(self.main.read_spec()["config"]["outer"])
        return self._outer_cfg

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

    def save_checkpoint(self, learner: str, ckpt: LearnerCheckpoint) -> None:
        """Commit ``ckpt``; one whose state is a ``HostPart`` (a learner over several
        processes) writes this host's part, and the leader (part 0) commits once every
        part is written (``RunStore.checkpoints.commit_checkpoint_parts``)."""
        store = self.writer_for(learner, checkpoints=True)
        if ckpt.step in store.checkpoints.checkpoint_steps(learner):
            return  # this step is saved already (a flow run ended right after one)
        meta = {"seq": ckpt.seq, "data_position": ckpt.step}
        part = ckpt.opt_state if isinstance(ckpt.opt_state, HostPart) else None
        if part is not None:
            store.checkpoints.put_checkpoint_part(learner, ckpt.step, part.write_id, part.index, part,
                                      part.slices)  # fmt: skip
            if part.index != 0:
                return
        self.check_newest(learner)  # a superseded process mixes no checkpoint in
        try:
            if part is not None:
                store.checkpoints.commit_checkpoint_parts(
                    learner, ckpt.step, part.write_id, part.count, meta
                )
            else:
                store.checkpoints.put_checkpoint(
                    learner, ckpt.step, {"opt": optimizer_leaves(ckpt.opt_state)}, meta
                )
        except CommitConflict as exc:
            log.warning(
                "checkpoint %s@%d already written by another process: %s", learner, ckpt.step, exc
            )
        prune_checkpoints(store, learner, keep=2)

    def load_checkpoint(self, learner: str, step: int | None = None) -> LearnerCheckpoint | None:
        """The newest readable checkpoint (a corrupt one is reported and skipped), or the
        one at ``step`` (its damage raised: another process of the learner read it)."""
        if self.place is None or self.opt_template is None:
            raise ValueError(
                "this store was opened without the trainer; it cannot read checkpoints"
            )
        store = self.writer_for(learner, checkpoints=True)

        def read(step: int) -> LearnerCheckpoint:
            opt, meta = read_checkpoint(store, learner, step, self.opt_template(), self.place)
            return LearnerCheckpoint(step=int(meta["step"]), seq=int(meta["seq"]), opt_state=opt)

        if step is not None:
            return read(step)
        for step in reversed(store.checkpoints.checkpoint_steps(learner)):
            try:
                return read(step)
            except (CorruptVersion, KeyError, ValueError) as exc:
                log.error(
                    "checkpoint %s@%d is unreadable, trying an older one: %s", learner, step, exc
                )
        return None

    def newest_version(self, learner: str | None, fragment: int) -> int | None:
        region = self.home if learner is None else self.region_of(learner)
        store = self.main if learner is None else self.writer_for(learner)
        return store.versions.latest_global(fragment, region)

    def read_global(
        self, learner: str, fragment: int, version: int, collect: Collect | None = None
    ) -> GlobalView:
        state = self.writer_for(learner).versions.get_global(
            fragment, version, learner_view=True, collect=collect
        )
        return GlobalView(fragment, version, state.params, state.meta)

    def read_delta(self, learner: str, fragment: int, version: int) -> GlobalDelta | None:
        got = self.writer_for(learner).versions.get_global_delta(fragment, version)
        if got is None:
            return None
        base, reader, meta = got
        return GlobalDelta(version, base, ReaderPayload(reader, "delta"), meta)

    # syncer side ----------------------------------------------------------------------
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

    def ledger(self, plan: UnitPlan) -> RegionalLedger:
        """The data ledger: each region's pool in its own bucket (``flows.ledger``); the
        pool of a region with no member is offered to the others as the syncers do."""
        pools = region_pools(self.main.read_spec())
        offers = UnitOffers(self.run, self.regions, self.learners, plan, self.main.writer,
                            logging.getLogger("diloco.syncer"), pools, self.traffic,
                            self.keys.claims_key)  # fmt: skip
        return RegionalLedger(
            {r: region_ledger(self.region_store(r), plan, self.learners, r,
                              members=lambda: self.learners, pools=pools)
             for r in pools},
            self.learners, offers.tend,
        )  # fmt: skip

    def add_learner(self, learner: str) -> None:
        """Add ``learner`` beyond the run's slots in its region (``learner_region``), as
        ``diloco join`` does: its member record, signed with its key where this process
        holds one, then its contributions are the run's (``RunStore.members.run_learners``)."""
        spec = self.main.read_spec()
        region = learner_region(learner, run_slots(spec), run_deal(spec))
        self.learners[learner] = region
        record = {"learner": learner, "region": region, "host": "simulator", "time": time.time()}
        if not self.writer_for(learner).members.put_member(
            learner, record, self.keys.signing_key(learner)
        ):
            raise FileExistsError(f"{learner} is added to run {self.run!r} already")

    def close(self, summary: dict[str, Any]) -> None:
        """Record the simulation's summary and the traffic of every writer it drove."""
        self.main.progress.write_metrics("simulator", {"summary": summary})
