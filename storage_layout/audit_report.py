"""What an audit (``storage_layout.audit``) finds: the invariants it checks, a sent
contribution and its outcome, and the report (``AuditReport``: violations by invariant,
outcomes, the data each learner merged)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

INVARIANTS = (
    "objects-verify",
    "versions-contiguous",
    "not-overwritten",
    "merged-once",
    "merged-committed",
    "one-outcome",
    "home-complete",
    "no-strangers",
    "data-once",
    "tokens-balance",
)


OUTCOMES = ("merged", "superseded", "rejected", "pending", "lost")


@dataclass
class Sent:
    """One committed contribution, as its marker (or the ledger) describes it."""

    learner: str
    seq: int
    base_version: int
    anchor_seq: int
    tokens: int
    write_id: str
    new_tokens: int = 0  # tokens less those of its predecessor from the same anchor
    outcome: str = ""
    where: str = ""  # the version that merged it, the reason it was rejected, ...
    damage: str = ""  # why its objects do not verify, if they do not
    data: tuple[int, int] | None = None  # the learner's data positions it carries, [from, to)

    @property
    def anchor(self) -> tuple[str, int, int]:
        return (self.learner, self.base_version, self.anchor_seq)


@dataclass
class AuditReport:
    run: str
    regions: dict[str, str]  # region -> URL read
    from_spec: list[str]  # regions read at the spec's URL (not given)
    violations: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    lagging: dict[str, dict[int, int]] = field(default_factory=dict)  # region -> fragment -> v
    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("committed", "versions", *OUTCOMES), 0))  # fmt: skip
    versions: int = 0  # versions accounted for (held or in the ledger), all fragments
    rejections: int = 0  # contributions the versions record as rejected (with a reason)
    objects: int = 0  # committed markers whose objects were read and verified
    # Damaged contributions no syncer read: superseded by a newer one from their anchor.
    unread_damage: list[str] = field(default_factory=list)
    # Each contribution's outcome and where (fragment, learner, seq) -> "merged v12",
    # "rejected <reason>", ...: for whoever asks about one (bench/chaos, of its forgeries).
    # Not in ``as_dict``: a run holds thousands.
    outcome_of: dict[tuple[int, str, int], str] = field(default_factory=dict)
    # Per learner, the data positions (batches of its stream) its merged contributions
    # trained, merged into ranges [from, to): what of its data reached the model.
    data: dict[str, list[list[int]]] = field(default_factory=dict)
    # Per learner, its work accounted for (see the module docstring): state, trained,
    # sent (batches), unsent, and tokens by outcome (each fragment's sends carry all of
    # the learner's steps: the mean over fragments).
    learners: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Per region, its data ledger's pool (``data.assign = "units"``, filled by
    # ``flows.ledger_audit.audit_units``): units handed out, spans given back and waiting,
    # claims no learner recorded.
    units: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Per learner and fragment, the end of the data its committed sends carry.
    _sent_to: dict[str, dict[int, int]] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return not any(self.violations.values())

    def fail(self, invariant: str, what: str) -> None:
        self.violations[invariant].append(what)

    def as_dict(self) -> dict[str, Any]:
        return {
            "run": self.run, "regions": self.regions, "from_spec": self.from_spec,
            "ok": self.ok, "violations": {k: v for k, v in self.violations.items() if v},
            "lagging": self.lagging, "outcomes": self.outcomes, "tokens": self.tokens,
            "versions": self.versions, "objects_verified": self.objects,
            "rejections": self.rejections, "unread_damage": self.unread_damage,
            "data": self.data, "learners": self.learners, "units": self.units,
        }  # fmt: skip
