"""The learner's half of ``BucketStore`` (``flows.bucket_io``): its contributions, kept
under blocks of seqs it reserved and fenced by its generation, its checkpoints, and the
global versions and compact updates it reads from its own region."""

from __future__ import annotations

import logging
from typing import Any

from diloco.learner import LearnerCheckpoint
from diloco.loops import GlobalView
from diloco.outer import Contribution
from diloco.transport import Collect, GlobalDelta
from flows.state_io import (
    HostPart,
    optimizer_leaves,
    read_checkpoint,
)
from flows.version_stream import (
    ReaderPayload,
)
from storage_layout.auth import Unauthenticated
from storage_layout.commit import CommitConflict, CorruptVersion, Revoked, patiently
from storage_layout.members import SeqNotReserved
from storage_layout.retention import prune_checkpoints

log = logging.getLogger(__name__)

READ_ATTEMPTS = 3  # reads of a contribution before it is rejected as corrupt
# Seqs a learner process reserves at a time (``RunStore.members.reserve_seqs``): one small write
# per this many sends; a restart skips at most this many numbers.
SEQ_BLOCK = 8
REVOKED_BLOCKS = 4  # the newest blocks of seqs ``revoke_unsent`` holds
# Contribution fields kept in the marker's meta (the tensors are the payload).
_COUNTERS = ("base_version", "anchor_seq", "step", "tokens", "steps", "seconds")


def contribution_meta(c: Contribution) -> dict[str, Any]:
    # "data": the learner's data positions (its batches, one per inner step) whose steps
    # this send carries, [from, to): the audit shows them and checks none merged twice.
    # "base_id": the id of the version it was made on (``FragmentSyncer.unanchored``).
    meta = {**{k: getattr(c, k) for k in _COUNTERS}, "data": [c.step - c.steps, c.step]}
    return meta if c.base_id is None else {**meta, "base_id": c.base_id}


class LearnerBuckets:
    """What a learner process asks of the run's buckets (mixed into ``BucketStore``)."""

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
