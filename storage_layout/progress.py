"""What writers report as they go (``store.progress``): metrics (progress, traffic) and
learners' round history.

A part of a ``storage_layout.store.RunStore``, over its buckets and ``layout.py``."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field

from storage_layout import record
from storage_layout.commit import CorruptVersion, get_patiently, patiently
from storage_layout.part import Part, read_or_none
from storage_layout.record import Name, Record, Time

if TYPE_CHECKING:
    from storage_layout.store import RunStore

log = logging.getLogger(__name__)

Amount = Annotated[int, Field(ge=0, lt=10**18)]  # bytes or requests, summed over a run


class TrafficRow(Record):
    bytes: Amount = 0
    requests: Amount = 0


class Status(Record):
    """A writer's metrics object: progress and traffic, rewritten as it goes."""

    time: Time | None = None
    step: Annotated[int, Field(ge=0, lt=10**15)] | None = None
    traffic: dict[Name, TrafficRow] = Field(default_factory=dict)
    bytes_up: Amount = 0
    bytes_down: Amount = 0
    rejected: list[Any] = Field(default_factory=list)


STATUS_BYTES = 1 << 20  # a status holds a few dozen fields and a traffic table


HISTORY_FORMAT = "diloco-round"  # a learner's round row (``put_round``)


def _history_row(data: bytes | None, key: str, learner: str, round_number: int) -> dict:
    """A history object's row, checked: JSON, of the format, of this learner and round."""
    if data is None:
        raise CorruptVersion(f"{key} was not read")
    try:
        row = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptVersion(f"not JSON: {exc}") from exc
    if not isinstance(row, dict) or row.get("format") != HISTORY_FORMAT:
        raise CorruptVersion("not a round row")
    digest = row.pop("sha256", None)
    if hashlib.sha256(json.dumps(row, sort_keys=True).encode()).hexdigest() != digest:
        raise CorruptVersion("damaged: its sha256 does not match")
    if (row.get("learner"), row.get("round")) != (learner, round_number):
        raise CorruptVersion(f"describes another round ({row.get('learner')}, {row.get('round')})")
    return row


class Progress(Part):
    def __init__(self, store: RunStore):
        super().__init__(store)
        self._metrics_base: dict[str, dict[str, Any]] = {}  # as stored before our first write

    def write_metrics(
        self, name: str, record: Mapping[str, Any], totals: Mapping[str, float] | None = None
    ) -> None:
        """Overwrite this writer's metrics object (traffic, progress) in its home region.

        Traffic and ``totals`` (this process's counters, e.g. seconds spent) accumulate over
        the processes that wrote under ``name`` before: the first write of this store reads
        what is stored and every write adds this process's counts to it."""
        if name not in self._metrics_base:
            self._metrics_base[name] = self.read_metrics(name) or {}
        old = self._metrics_base[name]
        traffic = {pair: dict(t) for pair, t in old.get("traffic", {}).items()}
        for pair, t in self.store.traffic.as_dict().items():
            acc = traffic.setdefault(pair, {"bytes": 0, "requests": 0})
            acc["bytes"] += t["bytes"]
            acc["requests"] += t["requests"]
        body = {
            "traffic": traffic,
            "bytes_up": old.get("bytes_up", 0) + self.store.traffic.uploaded,
            "bytes_down": old.get("bytes_down", 0) + self.store.traffic.downloaded,
            **{k: old.get(k, 0) + v for k, v in (totals or {}).items()},
            **record,
        }
        data = json.dumps(body, sort_keys=True).encode()
        patiently(lambda: self.home.put(self.layout.metrics(name), data), f"metrics of {name}")

    def read_metrics(self, name: str, region: str | None = None) -> dict[str, Any] | None:
        """A writer's metrics object, or None if it has written none yet, or it is not
        one (named in the log)."""
        bucket = self.bucket(region or self.store.client_region)
        return read_or_none(bucket, self.layout.metrics(name), Status, STATUS_BYTES)

    def done(self, writer: str, region: str | None = None, tokens: int | None = None) -> bool:
        """Whether ``writer``'s status object says it is done: a learner writes that only
        once its final checkpoint and every contribution before it are committed, and the
        syncers, the launcher and a resumed `diloco train` end on it. Given the run's
        budget (``tokens``), done means done at that budget: a learner that finished
        before the budget was extended trains on."""
        status = self.read_metrics(writer, region) or {}
        if status.get("state") != "done":
            return False
        return tokens is None or int(status.get("budget_tokens", 0)) >= tokens

    def statuses(self, region: str) -> tuple[dict[str, dict[str, Any]], list[str]]:
        """Every writer's status object in ``region`` (name -> record, each checked as a
        ``Status``), and a problem naming each that is not one."""
        bucket, prefix = self.bucket(region), self.layout.metrics_prefix
        found: dict[str, dict[str, Any]] = {}
        problems: list[str] = []
        for name in bucket.list(prefix):
            if not name.endswith(".json"):
                continue  # the launcher's loss.png
            try:
                found[name.removesuffix(".json")] = record.read_body(
                    bucket, f"{prefix}/{name}", Status, STATUS_BYTES)  # fmt: skip
            except (record.BadRecord, FileNotFoundError) as exc:
                problems.append(f"{region}: metrics {name} unreadable: {exc}")
        return found, problems

    def put_round(self, learner: str, round_number: int, row: Mapping[str, Any]) -> bool:
        """Add round ``round_number`` of ``learner`` (its table row: loss, tokens, tokens/s,
        staleness, merge weight, bytes...) to its history in this store's region, the
        learner's own: an exclusive create, never overwritten. True if the stored row is
        this one (also when an earlier attempt landed and only its answer was lost);
        False if the round was already recorded by another write (an earlier process of
        the learner ran it before a restart set the learner back: the first row stays)."""
        key = self.layout.history_entry(learner, round_number)
        fields = {**row, "format": HISTORY_FORMAT, "learner": learner, "round": round_number,
                  "writer": self.store.writer}  # fmt: skip
        fields.pop("sha256", None)
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
        body = json.dumps({**fields, "sha256": digest}, sort_keys=True).encode()
        try:
            patiently(lambda: self.home.put_exclusive(key, body), key)
            return True
        except FileExistsError:
            return patiently(lambda: self.home.get(key), key) == body

    def history_rounds(self, learner: str, region: str | None = None) -> list[int]:
        """The round numbers in ``learner``'s history, in order."""
        region = region or self.store.client_region
        return self.store.numbers(self.bucket(region), self.layout.history(learner), "s")

    def get_rounds(
        self, learner: str, rounds: Sequence[int], region: str | None = None
    ) -> tuple[list[dict[str, Any]], list[str]]:
        """Rows ``rounds`` of ``learner``'s history (concurrently where the bucket can) and
        the problems met: a row that is missing, does not parse, or describes another
        round is skipped and named (``key: why``), never raised."""
        bucket = self.bucket(region or self.store.client_region)
        keys = [self.layout.history_entry(learner, r) for r in rounds]
        try:  # a part that fails is asked again alone
            raw: dict[str, Any] = (
                get_patiently(bucket, keys, f"history of {learner}") if keys else {}
            )
        except OSError:  # still failing, or one vanished: each on its own below
            raw = {}
        rows, problems = [], []
        for r, key in zip(rounds, keys, strict=True):
            try:
                rows.append(_history_row(raw.get(key), key, learner, r))
            except CorruptVersion:  # a damaged read, or missing from a failed batch
                try:
                    data = patiently(lambda k=key: bucket.get(k), key)
                    rows.append(_history_row(data, key, learner, r))
                except (OSError, CorruptVersion) as exc:
                    problems.append(f"{key}: {exc}")
        return rows, problems
