"""Where everything of a run lives in a bucket (no I/O here).

    {root}/{run}/spec.json                                         run spec, written once
    {root}/{run}/secret-fingerprint.json       the run secret's fingerprint, written once
    {root}/{run}/budget.json                 a larger token budget than the spec's, if any
    {root}/{run}/learners/{learner}/contributions/f{P}/commits/s{SEQ}.json      markers
    {root}/{run}/learners/{learner}/contributions/f{P}/data/s{SEQ}-{WRITE_ID}/  Zarr group
    {root}/{run}/learners/{learner}/checkpoints/commits/s{STEP}.json
    {root}/{run}/learners/{learner}/checkpoints/data/s{STEP}-{WRITE_ID}/
    {root}/{run}/learners/{learner}/history/s{ROUND}.json     one round's row, written once
    {root}/{run}/learners/{learner}/joins/s{N}.json     a join of its slot, signed, written once
    {root}/{run}/learners/{learner}/heartbeat.json  its liveness, signed, rewritten every few s
    {root}/{run}/globals/f{P}/commits/v{VERSION}.json
    {root}/{run}/globals/f{P}/data/v{VERSION}-{WRITE_ID}/
    {root}/{run}/globals/f{P}/latest.json             advisory pointer to the newest version
    {root}/{run}/ledger/f{P}/s{N}.json                 what retention deleted (for audits)
    {root}/{run}/metrics/{writer}.json
    {root}/{run}/launcher/claims/s{N}.json      a launcher's claim on the run, written once
    {root}/{run}/launcher/leases/s{N}.json      claim N's lease, renewed by its launcher

Numbers are zero-padded to 12 digits (fragments to 4), so keys sort lexicographically in
version order, and they are logical counters, never wall-clock times. Markers sit in
their own ``commits/`` prefix so discovery lists markers only, never data. Data prefixes
carry the writer's random write id: two writers racing for one version never write the
same object, so the loser cannot damage the winner's data.

A claim (an object whose existence is the claim, made by an exclusive create: a
generation under ``leases/``, a block of seqs, a join, a data unit, a record of a
learner's data ledger, a span given back or offered, the run lock and its lease) is
named here by its base, ``.../s{N}`` or ``.../{name}``; its key ends in the run's tag
of that base, ``{base}.{tag}.json`` (``storage_layout.auth``, ``RunStore.claim_key``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FORMAT_VERSION = 2  # 2: the spec holds the whole config; contributions record their step
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_NUMBERED = re.compile(r"^([sv])(\d{12})\.json$")
# A commit marker's key, and the one data prefix it may name: the same folder's ``data/``
# with the marker's number and the write id (16 hex digits, ``storage_layout.commit``).
_MARKER_KEY = re.compile(r"^((?:.+/)?)commits/([sv]\d{12})\.json$")
WRITE_ID_RE = re.compile(r"^[0-9a-f]{16}$")
_TAG = WRITE_ID_RE  # a claim's tag: 16 hex digits too
_SEGMENT = re.compile(r"^[A-Za-z0-9_.=-]+$")


class LayoutError(ValueError):
    """A name that cannot be a run, region or learner id, or a key not of this layout."""


def check_name(kind: str, name: str) -> str:
    if not NAME_RE.match(name):
        raise LayoutError(
            f"{kind} name {name!r} must be 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


MAX_NUMBER = 10**12 - 1  # the largest counter a numbered key holds (twelve digits)


def number(n: int) -> str:
    if n < 0 or n > MAX_NUMBER:
        raise LayoutError(f"counter {n} is outside 0..10^12")
    return f"{n:012d}"


def check_key(key: str, what: str = "key") -> str:
    """``key`` if it is a plain relative key (segments of letters, digits, ``._=-``; no
    ``.`` or ``..`` segment, no empty one, no leading ``/``), else ``LayoutError``. Every
    key a bucket is asked for passes here, so no key, wherever it came from, reaches
    outside the bucket's root."""
    segments = key.split("/")
    if not key or any(s in ("", ".", "..") or not _SEGMENT.match(s) for s in segments):
        raise LayoutError(f"{what} {key[:200]!r} is not a plain relative key of a bucket")
    return key


def data_prefix_of(marker_key: str, write_id: str) -> str:
    """The data prefix that the commit marker at ``marker_key`` with ``write_id`` owns:
    ``X/commits/s0...7.json`` -> ``X/data/s0...7-{write_id}``. A marker is read only if
    the prefix it names is this one, so nothing is ever fetched or deleted on the word of
    a stored object alone."""
    match = _MARKER_KEY.match(marker_key)
    if not match:
        raise LayoutError(f"{marker_key!r} is not a commit marker's key")
    if not WRITE_ID_RE.match(write_id):
        raise LayoutError(f"write id {write_id[:80]!r} of {marker_key} is not 16 hex digits")
    return f"{match.group(1)}data/{match.group(2)}-{write_id}"


def claim_stem(name: str) -> tuple[str, str | None] | None:
    """A claim's object name, ``{stem}.json`` or ``{stem}.{tag}.json`` (``tag``: 16 hex
    digits), as (stem, tag or None); None for a name no claim has."""
    if not name.endswith(".json") or "/" in name:
        return None
    body = name.removesuffix(".json")
    stem, _, tag = body.rpartition(".")
    if stem and _TAG.match(tag):
        return stem, tag
    return (body, None) if body else None


def parse_marker_name(name: str, prefix: str) -> int | None:
    """``s000000000012.json`` -> 12 (prefix 's' or 'v'); None for a foreign file."""
    match = _NUMBERED.match(name.rsplit("/", 1)[-1])
    if not match or match.group(1) != prefix:
        return None
    return int(match.group(2))


@dataclass(frozen=True)
class RunLayout:
    """Keys of one run, relative to the bucket root."""

    run: str

    def __post_init__(self) -> None:
        check_name("run", self.run)

    @property
    def spec(self) -> str:
        return f"{self.run}/spec.json"

    @property
    def secret_fingerprint(self) -> str:
        """The run secret's fingerprint (``storage_layout.auth``), written once."""
        return f"{self.run}/secret-fingerprint.json"

    @property
    def budget(self) -> str:
        return f"{self.run}/budget.json"

    @property
    def pipeline(self) -> str:
        """The pipeline settings of the run's newest launch (``diloco join`` starts from
        them); rewritten by each launch, unlike the spec."""
        return f"{self.run}/pipeline.json"

    def metrics(self, writer: str) -> str:
        return f"{self.metrics_prefix}/{check_name('writer', writer)}.json"

    def join_token(self, token: str) -> str:
        """A join token's record (``auth.JoinToken.record``), written by its issuer."""
        return f"{self.run}/join-tokens/{check_name('join token', token)}.json"

    def revoked_token(self, token: str) -> str:
        """The mark that revokes a join token (``diloco join-token --revoke``)."""
        return f"{self.run}/join-tokens/revoked/{check_name('join token', token)}.json"

    @property
    def metrics_prefix(self) -> str:
        return f"{self.run}/metrics"

    # contributions ---------------------------------------------------------------
    def _contrib(self, learner: str, fragment: int) -> str:
        return f"{self.run}/learners/{check_name('learner', learner)}/contributions/f{fragment:04d}"

    def contribution_commits(self, learner: str, fragment: int) -> str:
        return f"{self._contrib(learner, fragment)}/commits"

    def contribution_marker(self, learner: str, fragment: int, seq: int) -> str:
        return f"{self.contribution_commits(learner, fragment)}/s{number(seq)}.json"

    def contribution_data(self, learner: str, fragment: int, seq: int, write_id: str) -> str:
        return f"{self._contrib(learner, fragment)}/data/s{number(seq)}-{write_id}"

    def seq_claims(self, learner: str) -> str:
        """A learner's reserved blocks of sequence numbers (``s{CLAIM}.json``, each written
        once, each block above the one before it)."""
        return f"{self.run}/learners/{check_name('learner', learner)}/seqs"

    # globals -----------------------------------------------------------------------
    def global_commits(self, fragment: int) -> str:
        return f"{self.run}/globals/f{fragment:04d}/commits"

    def global_marker(self, fragment: int, version: int) -> str:
        return f"{self.global_commits(fragment)}/v{number(version)}.json"

    def global_data(self, fragment: int, version: int, write_id: str) -> str:
        return f"{self.run}/globals/f{fragment:04d}/data/v{number(version)}-{write_id}"

    def global_latest(self, fragment: int) -> str:
        """Advisory pointer to the newest version (overwritten; the markers are the truth)."""
        return f"{self.run}/globals/f{fragment:04d}/latest.json"

    # retention ledger --------------------------------------------------------------
    def ledger_commits(self, fragment: int) -> str:
        return f"{self.run}/ledger/f{fragment:04d}"

    # checkpoints -------------------------------------------------------------------
    def lease_commits(self, learner: str) -> str:
        return f"{self.run}/learners/{check_name('learner', learner)}/leases"

    def join_commits(self, learner: str) -> str:
        """A learner slot's join records (``s{N}.json``, each written once, signed with the
        learner's key): who took the slot, from where, with what (``diloco join``)."""
        return f"{self.run}/learners/{check_name('learner', learner)}/joins"

    # members beyond the spec's learner slots (``diloco join`` growing the run) ----------
    def members_folder(self) -> str:
        return f"{self.run}/members"

    def member(self, learner: str) -> str:
        """The record of a learner slot a joiner added to the run (beyond the spec's
        ``learners``), in its region's bucket: written once (exclusive create), signed
        with the learner's key (``flows.join``; ``RunStore.members.run_learners`` reads them)."""
        return f"{self.members_folder()}/{check_name('learner', learner)}.json"

    # data units (``data.assign = "units"``, diloco/units.py) --------------------------
    def unit_records(self, learner: str) -> str:
        """A learner's data ledger (``s{N}.json``, each written once): the spans it took
        and the streams it gave back, in order."""
        return f"{self.run}/learners/{check_name('learner', learner)}/units"

    def units_fresh(self) -> str:
        """Claims of units no one had (``s{N}.json``: unit N - 1 over all epochs)."""
        return f"{self.run}/units/fresh"

    def units_returned_folder(self) -> str:
        return f"{self.run}/units/returned"

    def units_returned(self, claim: str) -> str:
        """The claim of a span given back (``claim``: the record that gave it back and the
        span's place in it), written once by the learner that takes it (a claim's base)."""
        return f"{self.units_returned_folder()}/{check_name('claim', claim)}"

    def units_offered_folder(self) -> str:
        return f"{self.run}/units/offered"

    def units_offered(self, claim: str) -> str:
        """A span of another region's pool offered to this region's learners by a syncer
        (that region had no learner in it: ``flows.unit_offers.UnitOffers``), written once;
        ``claim``, ``from-{region}-{its claim there}``, is taken like a span given back
        (``units_returned``); a claim's base."""
        return f"{self.units_offered_folder()}/{check_name('claim', claim)}"

    def checkpoint_commits(self, learner: str) -> str:
        return f"{self.run}/learners/{check_name('learner', learner)}/checkpoints/commits"

    def checkpoint_marker(self, learner: str, step: int) -> str:
        return f"{self.checkpoint_commits(learner)}/s{number(step)}.json"

    def checkpoint_data(self, learner: str, step: int, write_id: str) -> str:
        return f"{self.run}/learners/{check_name('learner', learner)}/checkpoints/data/s{number(step)}-{write_id}"

    # the launcher's lock on the run -------------------------------------------------
    def launcher_claims(self) -> str:
        """Launchers' claims on the run (``s{N}.json``, each written once by an exclusive
        create): the newest claim holds the run while its lease is fresh."""
        return f"{self.run}/launcher/claims"

    def launcher_lease(self, claim: int) -> str:
        """Claim ``claim``'s lease, overwritten by its launcher each time it renews it (a
        claim's base: tagged like the claim)."""
        return f"{self.run}/launcher/leases/s{number(claim)}"

    def heartbeat(self, learner: str) -> str:
        """A learner's heartbeat (``storage_layout.heartbeat``), rewritten every few seconds."""
        return f"{self.run}/learners/{check_name('learner', learner)}/heartbeat.json"

    # learners' round history -------------------------------------------------------
    def history(self, learner: str) -> str:
        """A learner's per-round rows (``s{ROUND}.json``, each written once)."""
        return f"{self.run}/learners/{check_name('learner', learner)}/history"

    def history_entry(self, learner: str, round_number: int) -> str:
        return f"{self.history(learner)}/s{number(round_number)}.json"
