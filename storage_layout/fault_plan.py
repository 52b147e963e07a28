"""A storage fault plan (``storage_layout.faults`` injects it): its kinds and rates, the
regions and operations it targets, an outage or a full disk in one region; checked as it
is read (``FaultPlanError`` names the field), carried to a child process as ``DILOCO_FAULTS``
(JSON), and the uniform number each request draws from it (the replay rule)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

ENV_VAR = "DILOCO_FAULTS"


KINDS = (
    "error",
    "timeout_before",
    "timeout_after",
    "truncate",
    "corrupt",
    "stale_list",
    "latency",
    "crash",
    "outage",
    "disk_full",
)


RANDOM_KINDS = KINDS[:-2]  # drawn per request; the outage and the full disk are windows


OPS = (
    "open",
    "put",
    "put_exclusive",
    "get",
    "list",
    "exists",
    "info",
    "delete",
    "delete_prefix",
    "probe_exclusive",
)


class FaultPlanError(ValueError):
    """A fault plan that does not validate; the message names the field."""


def _check_number(
    name: str, value: Any, low: float, high: float = math.inf, integer: bool = False
) -> None:
    wanted = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, wanted):
        kind = "an integer" if integer else "a number"
        raise FaultPlanError(f"fault plan field {name!r}: expected {kind}, got {value!r}")
    if not low <= value <= high:
        raise FaultPlanError(
            f"fault plan field {name!r}: must be between {low} and {high}, got {value!r}"
        )


def _check_names(name: str, value: Any, allowed: Iterable[str] | None = None) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise FaultPlanError(f"fault plan field {name!r}: expected a list of names, got {value!r}")
    for item in value:
        if not isinstance(item, str) or not item:
            raise FaultPlanError(f"fault plan field {name!r}: {item!r} is not a name")
        if allowed is not None and item not in allowed:
            raise FaultPlanError(
                f"fault plan field {name!r}: unknown {item!r} (one of {', '.join(allowed)})"
            )
    return tuple(value)


def _reject_unknown(cls: type, data: Any, where: str) -> None:
    if not isinstance(data, Mapping):
        what = f"fault plan field {where!r}" if where else "a fault plan"
        raise FaultPlanError(f"{what}: expected an object, got {data!r}")
    known = [f.name for f in dataclasses.fields(cls)]
    for name in data:
        if name not in known:
            full = f"{where}.{name}" if where else str(name)
            raise FaultPlanError(
                f"fault plan field {full!r}: unknown field (known: {', '.join(known)})"
            )


@dataclass(frozen=True)
class Outage:
    """``region`` is down from ``t0 + start`` (the plan's ``t0``) for ``seconds``."""

    region: str
    start: float
    seconds: float

    field_name = "outage"  # the plan's field, as errors name it

    def __post_init__(self) -> None:
        name = self.field_name
        if not isinstance(self.region, str) or not self.region:
            raise FaultPlanError(f"fault plan field '{name}.region': {self.region!r} is no name")
        _check_number(f"{name}.start", self.start, 0.0)
        _check_number(f"{name}.seconds", self.seconds, 0.0)

    @classmethod
    def from_dict(cls, data: Any) -> Outage:
        _reject_unknown(cls, data, cls.field_name)
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in data]
        if missing:
            raise FaultPlanError(f"fault plan field '{cls.field_name}.{missing[0]}': missing")
        return cls(**data)

    def reason(self, t0: float, now: float) -> str | None:
        """Why the window holds at ``now`` (Unix time), or None when it does not."""
        start = t0 + self.start
        if start <= now < start + self.seconds:
            return f"region {self.region} is out for {self.seconds:g} s from t0 + {self.start:g} s"
        return None


@dataclass(frozen=True)
class DiskFull:
    """``region``'s disk is full from ``t0 + start`` for ``seconds``; with neither given,
    while ``Injector.fill_disk(region)`` holds it full (tests open and close the window
    from the run's progress)."""

    region: str
    start: float | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.region, str) or not self.region:
            raise FaultPlanError(f"fault plan field 'disk_full.region': {self.region!r} is no name")
        if (self.start is None) != (self.seconds is None):
            given = "start" if self.seconds is None else "seconds"
            raise FaultPlanError(
                f"fault plan field 'disk_full.{given}': give both start and seconds (a window "
                "on the clock) or neither (filled and freed by Injector.fill_disk)"
            )
        if self.start is not None:
            _check_number("disk_full.start", self.start, 0.0)
            _check_number("disk_full.seconds", self.seconds, 0.0)

    @classmethod
    def from_dict(cls, data: Any) -> DiskFull:
        _reject_unknown(cls, data, "disk_full")
        if "region" not in data:
            raise FaultPlanError("fault plan field 'disk_full.region': missing")
        return cls(**data)

    @property
    def by_hand(self) -> bool:
        return self.start is None

    def reason(self, t0: float, now: float) -> str | None:
        """Why the disk is full at ``now`` by the clock, or None when it is not."""
        if self.start is None or self.seconds is None:
            return None
        start = t0 + self.start
        if start <= now < start + self.seconds:
            return (f"disk of region {self.region} is full for {self.seconds:g} s from "
                    f"t0 + {self.start:g} s")  # fmt: skip
        return None


@dataclass(frozen=True)
class FaultPlan:
    """What to inject. Rates are per request, in [0, 1]; ``t0`` is Unix time (by default
    when the plan was made; a launcher pins it so all its workers share one window)."""

    seed: int = 0
    error_rate: float = 0.0
    timeout_before_rate: float = 0.0
    timeout_after_rate: float = 0.0
    truncate_rate: float = 0.0
    corrupt_rate: float = 0.0
    stale_list_rate: float = 0.0
    stale_list_drop: int = 1  # names a stale listing leaves out
    latency_rate: float = 0.0
    latency_seconds: float = 0.0
    crash_rate: float = 0.0
    crash_keys: tuple[str, ...] = ("/contributions/", "/checkpoints/")
    outage: Outage | None = None
    disk_full: DiskFull | None = None
    t0: float = field(default_factory=time.time)
    regions: tuple[str, ...] | None = None  # only these regions draw random faults
    ops: tuple[str, ...] | None = None  # only these operations draw random faults
    log_path: str | None = None  # a JSON line per fault is appended here
    # A JSON line per request (its salt, region, op and key) is appended here: what each
    # process of a run reads and writes (tests check the buckets' policies against it).
    trace_path: str | None = None
    # Tells processes apart (a launcher sets "WORKER/START"): a restarted worker repeats
    # its predecessor's requests, and must not meet the same faults forever.
    salt: str = ""

    def __post_init__(self) -> None:
        _check_number("seed", self.seed, -math.inf, integer=True)
        for kind in RANDOM_KINDS:
            _check_number(f"{kind}_rate", self.rate(kind), 0.0, 1.0)
        _check_number("stale_list_drop", self.stale_list_drop, 1, integer=True)
        _check_number("latency_seconds", self.latency_seconds, 0.0, 3600.0)
        _check_number("t0", self.t0, 0.0)
        if isinstance(self.outage, Mapping):
            object.__setattr__(self, "outage", Outage.from_dict(self.outage))
        elif self.outage is not None and not isinstance(self.outage, Outage):
            raise FaultPlanError(
                f"fault plan field 'outage': expected an object, got {self.outage!r}"
            )
        if isinstance(self.disk_full, Mapping):
            object.__setattr__(self, "disk_full", DiskFull.from_dict(self.disk_full))
        elif self.disk_full is not None and not isinstance(self.disk_full, DiskFull):
            raise FaultPlanError(
                f"fault plan field 'disk_full': expected an object, got {self.disk_full!r}"
            )
        if self.regions is not None:
            object.__setattr__(self, "regions", _check_names("regions", self.regions))
        if self.ops is not None:
            object.__setattr__(self, "ops", _check_names("ops", self.ops, OPS))
        object.__setattr__(self, "crash_keys", _check_names("crash_keys", self.crash_keys))
        if not isinstance(self.salt, str):
            raise FaultPlanError(f"fault plan field 'salt': {self.salt!r} is not a string")
        for name in ("log_path", "trace_path"):
            path = getattr(self, name)
            if path is not None and not isinstance(path, str):
                raise FaultPlanError(f"fault plan field {name!r}: {path!r} is no path")

    @classmethod
    def from_dict(cls, data: Any, source: str | None = None) -> FaultPlan:
        """A validated plan; ``FaultPlanError`` names the field that is wrong (and the
        ``source`` the plan came from, if given)."""
        try:
            _reject_unknown(cls, data, "")
            plan = cls(**data)
            if source is not None and plan.disk_full is not None and plan.disk_full.by_hand:
                raise FaultPlanError(
                    "fault plan field 'disk_full.start': a plan for a run needs a window on "
                    "the clock (start and seconds); only a test fills a disk by hand"
                )
            return plan
        except FaultPlanError as exc:
            if source is None:
                raise
            raise FaultPlanError(f"{source}: {exc}") from None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def to_env(self) -> dict[str, str]:
        """The environment that activates this plan (``t0`` included) in a child process."""
        return {ENV_VAR: self.to_json()}

    def rate(self, kind: str) -> float:
        return getattr(self, f"{kind}_rate")

    @property
    def inert(self) -> bool:
        windows = (self.outage, self.disk_full)
        quiet = all(w is None for w in windows) and not any(self.rate(k) for k in RANDOM_KINDS)
        return quiet and self.trace_path is None

    def targets(self, region: str, op: str) -> bool:
        """Whether requests of ``op`` to ``region`` draw random faults."""
        return (self.regions is None or region in self.regions) and (
            self.ops is None or op in self.ops
        )


def plan_from_env(environ: Mapping[str, str] | None = None) -> FaultPlan | None:
    """The plan in ``DILOCO_FAULTS`` (JSON), or None when it is unset or empty."""
    raw = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise FaultPlanError(f"{ENV_VAR} is not JSON ({exc}): {raw[:200]!r}") from None
    return FaultPlan.from_dict(data, source=ENV_VAR)


def uniform(*parts: object) -> float:
    """A number in [0, 1) that depends on ``parts`` only (the replay rule)."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64
