"""The syncer of one fragment: collect, decide when to merge, validate, weight, merge,
step the outer optimizer and produce the next global version.

When to merge is two pure decisions (``quorum_met`` and ``grace_window``) so the
simulator's clock and the Prefect syncer's wall clock use the same rule.

Replacement rule: pending contributions are keyed by their anchor (learner, base
version, anchor seq). A newer contribution with the same anchor replaces the older one
(which is then *superseded*), because both are measured from the same anchor and the
newer one's outer gradient already contains the older one's steps. Contributions of
one learner from different anchors are separate work (the learner was re-anchored in
between, or failed and rejoined) and are merged side by side, each with its own
staleness. Every outcome other than a merge (rejected, superseded) is carried into the
next version's record, so the versions account for every contribution.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import numpy as np
import optax

from diloco import records
from diloco.config import OuterConfig
from diloco.merge import merge_rule
from diloco.outer import (
    Anchored,
    Contribution,
    FlatParams,
    merge_weights,
    outer_optimizer,
)
from diloco.tensors import (
    ArrayTensors,
    Difference,
    LastPiece,
    MemorySink,
    PayloadTensors,
    SinkFactory,
    Tensors,
    as_tensors,
    leaves_to_slots,
    loop_beside,
    overlapped,
    payload_view,
    pieces,
    slot_leaves,
    state_slots,
    step_piece,
)
from diloco.validate import ContributionRejected, check_contribution

NORM_WINDOW, NORM_MIN = 32, 4  # recent accepted norms kept; needed before the check


def budget_spent(shared: bool, budget_steps: int, progresses: Iterable[Mapping[str, int]]) -> bool:
    """Sharing the budget (``shared``), whether the inner steps the versions report merged
    reach it: each fragment's ``progress`` (every learner's newest merged step,
    ``FragmentSyncer.progress``) summed, the furthest fragment's sum against
    ``budget_steps``. The syncers end on it; a joiner is refused by it."""
    if not shared:
        return False
    merged = [sum(int(step) for step in progress.values()) for progress in progresses]
    return bool(merged) and max(merged) >= budget_steps


def quorum_met(learners_present: Collection[str], quorum: int) -> bool:
    """At least ``quorum`` distinct learners have a pending contribution."""
    return len(set(learners_present)) >= quorum


def grace_window(
    step_seconds: float, tau: int, quorum_wait: float, sync_seconds: float, gamma: float
) -> float:
    """Seconds to keep waiting after the quorum: ``gamma * slack``, never negative.

    ``slack = tau * step_seconds - (quorum_wait + sync_seconds)`` is the time learners can
    still train before they need the new version (they apply it tau steps after sending),
    less what collecting the quorum took and what the merge and transfers will take.
    """
    slack = tau * step_seconds - (quorum_wait + sync_seconds)
    return max(0.0, gamma * slack)


def estimate_step_seconds(pending: Collection[Contribution], default: float) -> float:
    """Median measured seconds per inner step among the pending contributions."""
    rates = [c.seconds / c.steps for c in pending if c.steps > 0 and c.seconds > 0]
    return statistics.median(rates) if rates else default


@dataclass(frozen=True)
class GlobalVersion:
    fragment: int
    version: int
    params: Tensors  # the new master copy (arrays, or a version being streamed out)
    slots: list[Tensors]  # the outer optimizer's state, per parameter (``state_slots``)
    consumed: tuple[tuple[str, int], ...]  # (learner, seq) merged into this version
    cursor: dict[str, int]  # per learner, the highest seq processed (merged, replaced, rejected)
    weights: dict[str, float]  # merge weight per "learner/seq" (``outer.merge_weights``)
    staleness: dict[str, int]
    tokens: int  # tokens behind the merged contributions (new work only)
    seconds: float  # learner time behind them (new work only), for goodput
    merged: dict[str, list[float]] = field(default_factory=dict)  # see FragmentSyncer.merged
    progress: dict[str, int] = field(default_factory=dict)  # see FragmentSyncer.progress
    steps: int = 0  # the fragment's outer steps, this version's included (FragmentSyncer.steps)
    # Its ``records.version_id`` and those of the versions inside the staleness window,
    # and the tokens each of those merged (``FragmentSyncer.window_tokens``).
    ids: dict[int, str] = field(default_factory=dict)
    window_tokens: dict[int, int] = field(default_factory=dict)
    # The other outcomes decided since the previous version, so that the versions alone
    # account for every contribution (``storage_layout.audit``):
    rejected: tuple[tuple[str, int, str], ...] = ()  # (learner, seq, reason)
    superseded: tuple[tuple[str, int, int], ...] = ()  # (learner, seq, by seq): work inside


@dataclass
class MergeOutcome:
    version: GlobalVersion | None
    rejected: list[ContributionRejected] = field(default_factory=list)


def _merged_from(
    fragment: int, merged: Mapping[str, list[float]]
) -> dict[tuple[str, int, int], tuple[Contribution, Tensors | None]]:
    """``FragmentSyncer.merged_from`` from a version's ``merged`` counters (the outer
    gradients are not stored: a re-sent contribution is then merged whole)."""
    out: dict[tuple[str, int, int], tuple[Contribution, Tensors | None]] = {}
    for key, (seq, tokens, steps, seconds) in merged.items():
        learner, base, *anchor = key.split("/")  # (no anchor seq: stored before it existed)
        c = Contribution(learner, fragment, int(seq), int(base), int(tokens), int(steps),
                         float(seconds), {}, anchor_seq=int(anchor[0]) if anchor else 0)  # fmt: skip
        out[c.anchor] = (c, None)
    return out


class FragmentSyncer:
    """Owns fragment ``fragment``: its global value, outer momentum and version counter."""

    def __init__(
        self,
        fragment: int,
        init: FlatParams | Tensors,
        cfg: OuterConfig,
        learners: Collection[str],
        is_embedding: Callable[[str], bool],
        version: int = 0,
        opt_leaves: list[Any] | None = None,
        cursor: dict[str, int] | None = None,
        merged: dict[str, list[float]] | None = None,
        progress: dict[str, int] | None = None,
        sink: SinkFactory | None = None,
        block_size: int = 128,
        steps: int | None = None,
        ids: Mapping[int, str] | None = None,
        warmup_steps: int = 0,
    ):
        self.fragment, self.cfg, self.is_embedding = fragment, cfg, is_embedding
        self.learners = frozenset(learners)
        self.tx = outer_optimizer(cfg)
        # The master copy (and below, the outer optimizer's state) is read a piece at a
        # time: arrays in memory, or a version in a bucket (``flows.bucket_io``).
        self.params: Tensors = as_tensors(init)
        self.shapes = {n: tuple(s) for n, s in self.params.shapes.items()}
        self.block_size, self.warmup_steps = block_size, warmup_steps
        self.sink: SinkFactory = sink or MemorySink
        self.slots_per_param = state_slots(self.tx, self.shapes)
        if opt_leaves is not None:  # resuming from a stored version
            self.slots = leaves_to_slots(opt_leaves, self.shapes, self.slots_per_param)
        else:
            zeros = ArrayTensors({n: np.zeros(s, np.float32) for n, s in self.shapes.items()})
            self.slots = [zeros] * self.slots_per_param
        self.version = version
        # The outer steps taken (the optimizer's count: ``seal`` takes none); one a version
        # for a version stored before they were recorded.
        self.steps = version if steps is None else steps
        if not isinstance(self.steps, int) or self.steps < 0:
            raise ValueError(f"fragment {fragment} v{version}: outer_steps {self.steps!r}")
        self.cursor: dict[str, int] = dict(cursor or {})
        # Per learner, the inner step of its newest merged contribution: the learners read
        # the run's progress from it (a shared budget ends when their sum reaches it).
        self.progress: dict[str, int] = {k: int(v) for k, v in (progress or {}).items()}
        self.pending: dict[tuple[str, int, int], Contribution] = {}  # by Contribution.anchor
        # Outcomes other than a merge, carried into the next version's record.
        self.rejections: list[tuple[str, int, str]] = []
        self.superseded: list[tuple[str, int, int]] = []
        # Norms per inner step of the recently accepted contributions made past the
        # learners' warm-up (an outlier check: ``_admit``).
        self.norms: deque[float] = deque(maxlen=NORM_WINDOW)
        # Versions inside the staleness window: master copies, tokens merged (anchored).
        self.history: dict[int, Tensors] = {version: self.params}
        self.window_tokens: dict[int, int] = {}
        # Their ids (``records.version_id``): a contribution names the one it was made on.
        # None given at version 0: a new fragment's; {}: versions stored before ids.
        fresh = ids is None and version == 0
        self.ids = {0: records.version_id(fragment, 0, [])} if fresh else dict(ids or {})
        # Per anchor (learner, base version, anchor seq): the last merged contribution, so a
        # later, cumulative one from the same anchor is merged as its increment only.
        self.merged_from = _merged_from(fragment, merged or {})

    @property
    def merged(self) -> dict[str, list[float]]:
        """The counters of ``merged_from`` (stored with each version, so that a restarted
        syncer still merges a re-sent cumulative contribution as its increment only)."""
        return {
            f"{learner}/{base}/{anchor}": [c.seq, c.tokens, c.steps, c.seconds]
            for (learner, base, anchor), (c, _) in self.merged_from.items()
        }

    @property
    def opt_leaves(self) -> list[np.ndarray]:
        """The outer optimizer state as optax lists its leaves, whole (small fragments:
        the simulator's store; a streamed version wrote its state as it went)."""
        return slot_leaves(self.slots, self.shapes)

    @property
    def in_memory(self) -> bool:
        """Whether the state is held in arrays (else a bucket holds it: a version the
        merge streamed out, which its transport publishes as written)."""
        return all(isinstance(x, ArrayTensors) for x in (self.params, *self.slots))

    @property
    def opt_state(self) -> optax.OptState:
        """The outer optimizer state as optax holds it, whole (tests, small fragments)."""
        template = self.tx.init({n: np.zeros(s, np.float32) for n, s in self.shapes.items()})
        given = iter(self.opt_leaves)
        leaves = [np.asarray(self.steps, np.int32) if np.shape(x) == () else next(given)
                  for x in jax.tree_util.tree_leaves(template)]  # fmt: skip
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), leaves)

    def is_new(self, learner: str, seq: int) -> bool:
        """Not yet processed by any committed version (restarts must not double-count)."""
        return seq > self.cursor.get(learner, 0)

    def offer(self, c: Contribution) -> None:
        if not self.is_new(c.learner, c.seq):
            return
        key = c.anchor
        old = self.pending.get(key)
        if old is None or c.seq > old.seq:
            self.pending[key] = c
            if old is not None:
                self.superseded.append((c.learner, old.seq, c.seq))
        elif c.seq < old.seq:
            self.superseded.append((c.learner, c.seq, old.seq))

    def supersede(self, learner: str, seq: int, by: int) -> None:
        """Note a contribution passed over unread: ``by``, newer and from the same anchor,
        carries its steps (``SyncerLoop`` offers ``by`` next)."""
        if self.is_new(learner, seq):
            self.superseded.append((learner, seq, by))

    def reject(self, learner: str, seq: int, reason: str) -> None:
        """Note a contribution rejected before it was offered (unreadable, forged)."""
        self.rejections.append((learner, seq, reason))

    @property
    def present(self) -> set[str]:
        """The learners with a pending contribution that counts towards the quorum: one
        made on a version this syncer published (``unanchored``: never a lone fresh one)."""
        return {c.learner for c in self.pending.values() if self.unanchored(c) is None}

    def unanchored(self, c: Contribution) -> str | None:
        """Why ``c`` was not made on the version it names (None: it was, or that version's
        id is unknown: stored before ids existed). Its ``base_id`` is the id the learner
        read with that version as it applied it; a learner that applied none (a fresh or
        re-initialised member training from its own initialisation) has none to send,
        and its outer gradient would pull the global towards those parameters."""
        known = self.ids.get(c.base_version)
        if known is None or c.base_id == known:
            return None
        return (f"made on no version the syncer published (base version {c.base_version} "
                f"is {known}, it names {c.base_id}): a learner that applied no global "
                "version, such as a fresh or re-initialised one")  # fmt: skip

    def _new_work(self, item: tuple[Contribution, Tensors]) -> tuple[Contribution, Tensors] | None:
        """The part of ``c`` not merged yet. A learner that sends again before it has
        received the version holding its previous contribution (same anchor) sends a
        cumulative outer gradient; merging it whole would count the earlier steps twice.
        Counters always become the new work's; under the ``delta`` reference the outer
        gradient does too (the ``anchored`` one already measures what is left: current
        global minus the learner's parameters). None when nothing new is left."""
        c, delta = item
        key = c.anchor
        previous = self.merged_from.get(key)
        self.merged_from[key] = (c, delta)
        if previous is None:
            return item
        before, before_delta = previous
        steps = c.steps - before.steps
        if steps <= 0:
            self.superseded.append((c.learner, c.seq, before.seq))  # nothing new in it
            return None
        if self.cfg.reference == "delta" and before_delta is not None:
            # (after a restart only the counters are known; the delta is then merged whole)
            delta = Difference(delta, before_delta)
        tokens, seconds = c.tokens - before.tokens, c.seconds - before.seconds
        return replace(c, tokens=tokens, steps=steps, seconds=seconds), delta

    @property
    def typical_norm(self) -> float | None:
        """The median norm per inner step of the recently accepted contributions (None
        until there are a few: the outlier check needs something to compare with)."""
        return statistics.median(self.norms) if len(self.norms) >= NORM_MIN else None

    def _admit(self) -> tuple[list[tuple[Contribution, Tensors]], list[ContributionRejected]]:
        """Validate and take every pending contribution (the cursor moves past each one,
        accepted or not); returns the new work to merge and the rejections."""
        accepted: list[tuple[Contribution, Tensors]] = []
        rejected: list[ContributionRejected] = []
        cfg = self.cfg
        for c in sorted(self.pending.values(), key=lambda c: (c.learner, c.seq)):
            # Held to the recent norms only with its steps all past the inner warm-up
            # (``warmup_steps``): while the learning rate rises so does the norm per step
            # (tiny's first sends, at step 2, were a tenth of the next ones, and had every
            # learner's next sends rejected as 13x their median).
            warm = c.step - c.steps >= self.warmup_steps
            try:
                scan = check_contribution(c, self.shapes, self.learners, self.version,
                                          cfg.max_staleness, cfg.max_norm,
                                          self.typical_norm if warm else None,
                                          cfg.max_norm_ratio, self.block_size)  # fmt: skip
            except ContributionRejected as exc:
                rejected.append(exc)
                continue
            reason = self.unanchored(c)
            if (
                reason is None
                and cfg.reference == "anchored"
                and c.base_version not in self.history
            ):
                reason = f"base version {c.base_version} is no longer held"
            if reason is not None:
                rejected.append(ContributionRejected(c, reason))
                continue
            accepted.append((c, PayloadTensors(payload_view(c.payload))))
            if warm:
                self.norms.append(scan.norm / c.steps)
        for c in self.pending.values():
            self.cursor[c.learner] = max(self.cursor.get(c.learner, 0), c.seq)
        self.pending.clear()
        return [item for item in map(self._new_work, accepted) if item is not None], rejected

    def _outer_gradients(
        self, accepted: list[tuple[Contribution, Tensors]], params: Tensors
    ) -> list[Tensors]:
        """Each accepted contribution's outer gradient as merged: as sent (``delta``), or
        rebased on the current version ``params`` (``anchored``: current - base +
        delta), each base version read once a piece whoever was made on it."""
        if self.cfg.reference != "anchored":
            return [d for _, d in accepted]
        bases = {v: params if v == self.version else LastPiece(self.history[v])
                 for v in {c.base_version for c, _ in accepted}}  # fmt: skip
        return [Anchored(params, bases[c.base_version], d) for c, d in accepted]

    def merge(self) -> MergeOutcome:
        """Merge every pending contribution that passes validation into version v + 1,
        a piece at a time (``diloco.tensors``): for each piece, the contributions'
        values, the master copy's and the optimizer state's, the merge, the outer step,
        and the new version's piece written to the sink. If anything fails half way,
        the sink drops what it wrote and the error propagates (the caller reloads this
        fragment from its newest committed version).

        Returns no version when nothing valid is pending (rejections are still reported).
        """
        accepted, rejected = self._admit()
        self.rejections.extend((r.contribution.learner, r.contribution.seq, r.reason)
                               for r in rejected)  # fmt: skip
        if not accepted:
            return MergeOutcome(None, rejected)

        staleness = [self.version - c.base_version for c, _ in accepted]
        since = [self.merged_since(c) for c, _ in accepted]
        weights = merge_weights([c for c, _ in accepted], staleness, self.cfg, since)
        self._write_next(accepted, weights)
        self.steps += 1
        self._advance([c.key for c, _ in accepted])
        self.window_tokens[self.version] = sum(c.tokens for c, _ in accepted)

        for c, _ in accepted:
            self.progress[c.learner] = max(self.progress.get(c.learner, 0), c.step)
        label = lambda c: f"{c.learner}/{c.seq}"  # noqa: E731
        return MergeOutcome(
            GlobalVersion(
                fragment=self.fragment,
                version=self.version,
                params=self.params,
                slots=self.slots,
                consumed=tuple(c.key for c, _ in accepted),
                cursor=dict(self.cursor),
                weights={label(c): float(w) for (c, _), w in zip(accepted, weights, strict=True)},
                staleness={label(c): s for (c, _), s in zip(accepted, staleness, strict=True)},
                tokens=self.window_tokens[self.version],
                seconds=sum(c.seconds for c, _ in accepted),
                merged=self.merged,
                progress=dict(self.progress),
                steps=self.steps,
                rejected=tuple(self._take(self.rejections)),
                superseded=tuple(self._take(self.superseded)),
                ids=dict(self.ids),
                window_tokens=dict(self.window_tokens),
            ),
            rejected,
        )

    def merged_since(self, c: Contribution) -> int:
        """The tokens merged after ``c``'s base version (to this one) that ``c``'s learner
        did not train: the others' work, which an anchored outer gradient would carry back
        (0 under the delta reference). Its own earlier sends from the same anchor, merged
        meanwhile, are in its parameters (``c`` is then the increment: ``_new_work``)."""
        if self.cfg.reference != "anchored":
            return 0
        own = self.merged_from[c.anchor][0].tokens - c.tokens
        return max(0, sum(t for v, t in self.window_tokens.items() if v > c.base_version) - own)

    def _advance(self, consumed: list[tuple[str, int]]) -> None:
        """Number the version just written, which merged ``consumed``, and forget the
        versions (master copies, ids, merge counters) that fell out of the window."""
        self.version += 1
        self.history[self.version] = self.params
        self.ids[self.version] = records.version_id(self.fragment, self.version, consumed)
        oldest = self.version - self.cfg.max_staleness
        for window in (self.history, self.ids, self.window_tokens):
            for v in [v for v in window if v < oldest]:
                del window[v]
        for key in [k for k in self.merged_from if k[1] < oldest]:
            del self.merged_from[key]

    def _write_next(self, accepted: list[tuple[Contribution, Tensors]], w: list[float]) -> None:
        """Version v + 1's parameters and optimizer state, a piece at a time: for each
        piece the reads and the decoding (on this thread) and, beside them in piece order,
        the rebase, the merge, the outer step and the write to the sink."""
        current = LastPiece(self.params)  # (read by the step and by anchored deltas)
        deltas = self._outer_gradients(accepted, current)
        rule = merge_rule(self.cfg)
        momentum = self.slots[0] if self.slots else None  # (the optimizer's first state)
        prepared = rule.prepare(deltas, w, self.shapes, self.is_embedding, self.block_size,
                                momentum)  # fmt: skip
        sink = self.sink(self.fragment, self.version + 1, self.shapes, self.slots_per_param)

        def read() -> Iterator[tuple[str, int, list[Any], np.ndarray, list[np.ndarray]]]:
            for name, start, stop in pieces(self.shapes, self.block_size):
                values = [d.parts(name, start, stop) if isinstance(d, Anchored)
                          else d.piece(name, start, stop) for d in deltas]  # fmt: skip
                slots = [s.piece(name, start, stop) for s in self.slots]
                yield name, start, values, current.piece(name, start, stop), slots

        def step(item: tuple[str, int, list[Any], np.ndarray, list[np.ndarray]]) -> None:
            name, start, parts, params, slots = item
            values = [Anchored.combine(v) if isinstance(v, tuple) else v for v in parts]
            merged = rule.piece(name, values, w, prepared, slots[0] if slots else None)
            new, new_slots = step_piece(self.tx, name, params, slots, merged, self.steps)
            sink.write(name, start, new, new_slots)

        try:
            overlapped(read(), step, beside=loop_beside(self.shapes, self.block_size))
            self.params, self.slots = sink.finish()
        except BaseException:
            sink.abort()
            raise

    def seal(self) -> GlobalVersion | None:
        """A version that merges nothing and records the outcomes decided since the last
        one (rejections, replacements, the cursor past them), for the run's end, when no
        merge will carry them; the parameters and the outer state stay (copied a piece at
        a time into the new version). None when there is nothing to record."""
        if not (self.rejections or self.superseded):
            return None
        sink = self.sink(self.fragment, self.version + 1, self.shapes, self.slots_per_param)
        try:
            for name, start, stop in pieces(self.shapes, self.block_size):
                sink.write(name, start, self.params.piece(name, start, stop),
                           [s.piece(name, start, stop) for s in self.slots])  # fmt: skip
            self.params, self.slots = sink.finish()
        except BaseException:
            sink.abort()
            raise
        self._advance([])
        return GlobalVersion(
            fragment=self.fragment, version=self.version, params=self.params,
            slots=self.slots, consumed=(), cursor=dict(self.cursor), weights={},
            staleness={}, tokens=0, seconds=0.0, merged=self.merged, progress=dict(self.progress),
            steps=self.steps, ids=dict(self.ids), window_tokens=dict(self.window_tokens),
            rejected=tuple(self._take(self.rejections)),
            superseded=tuple(self._take(self.superseded)),
        )  # fmt: skip

    @staticmethod
    def _take(items: list) -> list:
        out = list(items)
        items.clear()
        return out
