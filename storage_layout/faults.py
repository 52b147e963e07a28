"""Seeded, replayable storage faults: a ``Bucket`` that misbehaves on purpose.

Given an ``Injector`` (of a plan: ``Injector(plan)``, or ``Injector.from_env()``, which a
process reads once from ``DILOCO_FAULTS``, JSON, and hands to the stores it makes),
``open_bucket`` returns a ``FaultyBucket``; without one it returns a plain ``Bucket``, so
normal runs are unchanged. Fault kinds (each with its own ``{kind}_rate`` in the plan,
all 0 by default):

- ``error``: the request fails before it is sent (``InjectedFault``, an ``OSError``);
- ``timeout_before``: the request times out before it takes effect: nothing is written
  (``InjectedTimeout``, a ``TimeoutError``);
- ``timeout_after``: the request takes effect (the write lands, the traffic is counted),
  then its response is lost (``InjectedTimeout``);
- ``truncate`` / ``corrupt`` (reads): ``get`` and ``get_many`` return a prefix of the
  object (half of it) or the object with one byte flipped;
- ``stale_list`` (listings): the lexicographically last ``stale_list_drop`` names are
  left out; keys are zero-padded counters, so these are the newest objects;
- ``latency``: the request first waits ``latency_seconds``;
- ``crash``: the process kills itself (SIGKILL) instead of writing a commit marker
  (``put_exclusive``) whose key contains one of ``crash_keys``: the writer dies between
  its data and its marker, e.g. a learner during an upload (``/contributions/``) or a
  checkpoint write (``/checkpoints/``);
- ``outage``: for one region, from ``t0 + start`` for ``seconds``, every request fails
  (``RegionOutage``), whatever the rates, ``regions`` and ``ops``;
- ``disk_full``: for one region, its disk is full: every write (``put``, each key of
  ``put_many``, ``put_exclusive``, ``probe_exclusive``) fails with ``OSError(ENOSPC, "No
  space left on device")`` (``InjectedDiskFull``) before it takes effect, while reads,
  listings and deletes work; from ``t0 + start`` for ``seconds``, or, with neither given,
  while ``Injector.fill_disk(region)`` holds it full (a test fills and frees it from the
  run's own progress: CI cannot mount a small filesystem).

Every fault is logged (logger ``storage_layout.faults``, WARNING) as ``injected <kind>
fault: <op> <key> in region <r>`` and counted per kind (``Injector.counts``); with ``log_path``
set, also appended as a JSON line (time, pid, kind, op, key, region) to that file, which
every process of a run can share (a benchmark counts the faults of all its workers).
With ``trace_path`` set, every request (not only a fault) is appended there as a JSON
line of its salt, region, op and key: what each process of a run reads and writes (the
tests check the buckets' write policies against it).

**Replay rule.** Whether a request draws a fault of a kind depends only on the plan's
seed and salt and on (region, op, key, n, kind), where ``n`` counts how often this process asked
for this (region, op, key) before. A uniform number is hashed from these values, never
taken from a shared random stream, so thread interleaving does not change the faults:
the same seed and the same requests per key give the same faults; another seed gives
others. ``put_many``, ``get_many`` and ``delete`` draw once per key (as ``put``, ``get``
and ``delete``), so a batched request meets the same faults as one request per key; in
``put_many`` and ``get_many`` each key fails or goes through on its own, as concurrent
requests do, and the failed keys come back in a ``PartialFailure``.
Only the outage and the disk-full window depend on the clock (or on the test).

Requests that the bucket makes on its own behalf (``put_many`` calling ``put`` on a
local filesystem, ``delete_prefix`` calling ``delete``, ``probe_exclusive``) are not
drawn again: one call from outside is one request to the plan.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from storage_layout.bucket import Bucket, BucketError, PartialFailure, raise_partial
from storage_layout.fault_plan import ENV_VAR as ENV_VAR  # (its name, re-exported)
from storage_layout.fault_plan import FaultPlan, FaultPlanError, plan_from_env, uniform
from storage_layout.traffic import Traffic

log = logging.getLogger(__name__)
T = TypeVar("T")


class InjectedFault(OSError):
    """A failure the injector made up; ``kind`` says which fault it is."""

    kind: str = "error"


class InjectedTimeout(InjectedFault, TimeoutError):
    """A request that timed out, before (``timeout_before``) or after its effect."""


class RegionOutage(InjectedFault):
    """A request to a region inside its outage window."""


class InjectedDiskFull(InjectedFault):
    """A write to a region whose disk is full: ``errno`` is ``ENOSPC``, as the operating
    system says it."""


WRITE_OPS = ("put", "put_exclusive", "probe_exclusive")  # what a full disk refuses


# --- decisions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """The ``n``-th request of ``op`` on ``key`` in ``region`` in this process."""

    plan: FaultPlan
    region: str
    op: str
    key: str
    n: int

    def draw(self, kind: str) -> float:
        plan = self.plan
        return uniform(plan.seed, plan.salt, self.region, self.op, self.key, self.n, kind)

    def hits(self, kind: str) -> bool:
        rate = self.plan.rate(kind) if self.plan.targets(self.region, self.op) else 0.0
        return rate > 0 and self.draw(kind) < rate


class Injector:
    """One active plan: numbers the requests per (region, op, key) and records faults."""

    def __init__(self, plan: FaultPlan | Mapping[str, Any]):
        self.plan = FaultPlan.from_dict(plan) if isinstance(plan, Mapping) else plan
        self._asked: Counter[tuple[str, str, str]] = Counter()
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._filled: set[str] = set()  # regions whose disk ``fill_disk`` filled
        self._local = threading.local()  # depth > 0: inside a request already drawn

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Injector | None:
        """The injector of the plan ``DILOCO_FAULTS`` holds (None without one): what a
        process reads once, where it starts, and gives the stores it opens."""
        plan = plan_from_env(environ)
        return cls(plan) if plan is not None else None

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """A request drawn already: the bucket's own calls within it are not drawn again."""
        self._local.depth = self.depth + 1
        try:
            yield
        finally:
            self._local.depth -= 1

    @property
    def depth(self) -> int:
        return getattr(self._local, "depth", 0)

    def request(self, region: str, op: str, key: str) -> Request:
        with self._lock:
            n = self._asked[(region, op, key)]
            self._asked[(region, op, key)] = n + 1
        if self.plan.trace_path:
            line = {"salt": self.plan.salt, "region": region, "op": op, "key": key}
            with open(self.plan.trace_path, "a") as f:  # one short append: atomic on POSIX
                f.write(json.dumps(line) + "\n")
        return Request(self.plan, region, op, key, n)

    def outage(self, region: str, now: float | None = None) -> str | None:
        """Why ``region`` is down now, or None when it is not."""
        out = self.plan.outage
        if out is None or out.region != region:
            return None
        return out.reason(self.plan.t0, time.time() if now is None else now)

    def disk_full(self, region: str, now: float | None = None) -> str | None:
        """Why ``region``'s disk is full now, or None when it is not."""
        full = self.plan.disk_full
        if full is None or full.region != region:
            return None
        if full.by_hand:
            with self._lock:
                filled = region in self._filled
            return f"disk of region {region} is full (filled by hand)" if filled else None
        return full.reason(self.plan.t0, time.time() if now is None else now)

    def fill_disk(self, region: str) -> None:
        """From now on, ``region``'s writes fail with ENOSPC (until ``free_disk``): the
        plan's ``disk_full`` names this region and gives no clock window."""
        full = self.plan.disk_full
        if full is None or full.region != region or not full.by_hand:
            raise FaultPlanError(
                f"fill_disk({region!r}): the plan's disk_full must name region {region!r} "
                f"with no start and seconds (it is {full!r})"
            )
        with self._lock:
            self._filled.add(region)

    def free_disk(self, region: str) -> None:
        """``region``'s disk has space again: its writes go through."""
        with self._lock:
            self._filled.discard(region)

    def record(self, kind: str, request: Request, detail: str = "") -> str:
        """Log and count one fault; returns its message."""
        key = request.key or "/"  # the bucket's root: an open, a listing of the top
        message = f"injected {kind} fault: {request.op} {key} in region {request.region}"
        message += f" ({detail})" if detail else ""
        with self._lock:
            self._counts[kind] += 1
        log.warning("%s", message)
        if self.plan.log_path:
            line = {"time": time.time(), "pid": os.getpid(), "kind": kind, "op": request.op,
                    "key": request.key, "region": request.region, "detail": detail}  # fmt: skip
            with open(self.plan.log_path, "a") as f:  # one short append: atomic on POSIX
                f.write(json.dumps(line) + "\n")
        return message

    def counts(self) -> dict[str, int]:
        """Faults this injector made, by kind."""
        with self._lock:
            return dict(self._counts)


def open_bucket(
    url: str,
    region: str = "default",
    client_region: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    traffic: Traffic | None = None,
    allow_unsafe_overwrite: bool = False,
    scope: str | None = None,
    injector: Injector | None = None,
) -> Bucket:
    """A ``Bucket`` (same arguments); a ``FaultyBucket`` meeting ``injector``'s faults when
    one is given and its plan injects any."""
    kwargs: dict[str, Any] = dict(
        region=region,
        client_region=client_region,
        storage_options=storage_options,
        traffic=traffic,
        allow_unsafe_overwrite=allow_unsafe_overwrite,
        scope=scope,
    )
    if injector is None or injector.plan.inert:
        return Bucket(url, **kwargs)
    return FaultyBucket(url, injector=injector, **kwargs)


# --- the bucket ----------------------------------------------------------------------------------


class FaultyBucket(Bucket):
    """A ``Bucket`` whose requests meet the faults of ``injector``'s plan."""

    def __init__(self, url: str, *args: Any, injector: Injector, **kwargs: Any):
        self.injector = injector
        super().__init__(url, *args, **kwargs)

    def __repr__(self) -> str:
        return f"FaultyBucket({self.url!r}, region={self.region!r})"

    def _call(
        self,
        op: str,
        keys: list[str],
        effect: Callable[[], T],
        finish: Callable[[T, list[Request]], T] | None = None,
    ) -> T:
        """Draw one request per key, fail or delay before ``effect``, lose its response
        after it, or damage what it returns (``finish``)."""
        if self.injector.depth or not keys:
            return effect()
        requests = [self.injector.request(self.region, op, key) for key in keys]
        self._before(requests)
        with self.injector.inside():
            result = effect()
        for r in requests:
            if r.hits("timeout_after"):
                raise self._fault(InjectedTimeout, "timeout_after", r, "it took effect")
        return finish(result, requests) if finish else result

    def _before(self, requests: list[Request]) -> None:
        self._outage_and_latency(requests)
        for r in requests:
            self._fail_before(r)

    def _outage_and_latency(self, requests: list[Request]) -> None:
        """The region's outage fails them all, and so does its full disk when they are
        writes; one latency spike delays them all (they go out together)."""
        injector = self.injector
        down = injector.outage(self.region)
        if down:
            raise self._fault(RegionOutage, "outage", requests[0], down)
        full = requests[0].op in WRITE_OPS and injector.disk_full(self.region)
        if full:
            message = injector.record("disk_full", requests[0], full)
            exc = InjectedDiskFull(errno.ENOSPC, f"No space left on device ({message})")
            exc.kind = "disk_full"
            raise exc
        slow = next((r for r in requests if r.hits("latency")), None)
        if slow is not None:
            seconds = injector.plan.latency_seconds
            injector.record("latency", slow, f"+{seconds:g} s")
            time.sleep(seconds)

    def _fail_before(self, r: Request) -> None:
        if r.hits("error"):
            raise self._fault(InjectedFault, "error", r)
        if r.hits("timeout_before"):
            raise self._fault(InjectedTimeout, "timeout_before", r, "nothing done")

    def _call_each(
        self,
        op: str,
        keys: list[str],
        effect: Callable[[list[str]], dict[str, Any]],
        finish: Callable[[dict[str, Any], list[Request]], dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """A batch of one request per key, each meeting its own faults, as a real batch of
        concurrent requests would: the keys that fail before their effect are left out of
        it, those whose response is lost fail after it, the others go through; then
        ``PartialFailure`` (or the error itself when every key failed) names the failed
        keys and carries what the others read."""
        if self.injector.depth or not keys:
            return effect(keys)
        requests = {key: self.injector.request(self.region, op, key) for key in keys}
        self._outage_and_latency(list(requests.values()))
        failed: dict[str, BaseException] = {}
        for key, r in requests.items():
            try:
                self._fail_before(r)
            except InjectedFault as exc:
                failed[key] = exc
        sent = [k for k in keys if k not in failed]
        done: dict[str, Any] = {}
        if sent:
            with self.injector.inside():
                try:
                    done = effect(sent)
                except PartialFailure as exc:  # a real failure beneath the injected ones
                    failed.update(exc.failed)
                    done = exc.done
        for key in sent:
            if key not in failed and requests[key].hits("timeout_after"):
                failed[key] = self._fault(
                    InjectedTimeout, "timeout_after", requests[key], "it took effect"
                )
        done = {k: v for k, v in done.items() if k not in failed}
        if finish is not None:
            done = finish(done, [requests[k] for k in done])
        raise_partial(failed, done, len(keys))
        return done

    def _fault(
        self, cls: type[InjectedFault], kind: str, request: Request, detail: str = ""
    ) -> InjectedFault:
        exc = cls(self.injector.record(kind, request, detail))
        exc.kind = kind
        return exc

    def _damage(self, request: Request, data: bytes) -> bytes:
        """A truncated or corrupted copy of ``data`` when ``request`` draws one."""
        if data and request.hits("truncate"):
            self.injector.record("truncate", request, f"{len(data) // 2} of {len(data)} bytes")
            return data[: len(data) // 2]
        if data and request.hits("corrupt"):
            at = int(request.draw("corrupt-position") * len(data))
            self.injector.record("corrupt", request, f"byte {at} flipped")
            return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]
        return data

    def _stale(self, names: list[str], requests: list[Request]) -> list[str]:
        if names and requests[0].hits("stale_list"):
            drop = min(self.injector.plan.stale_list_drop, len(names))
            self.injector.record("stale_list", requests[0], f"{drop} newest left out")
            return names[:-drop]
        return names

    # the Bucket API, each call one request (one per key for the batched ones) -------------
    def check_reachable(self) -> None:
        try:
            self._call("open", [""], super().check_reachable)
        except InjectedFault as exc:  # an unreachable bucket, as Bucket reports it
            raise BucketError(
                f"region {self.region}: bucket {self.url} is not reachable: {exc}"
            ) from exc

    def put(self, key: str, data: bytes) -> None:
        self._call("put", [key], partial(super().put, key, data))

    def put_many(self, objects: Mapping[str, bytes]) -> None:
        def effect(keys: list[str]) -> dict[str, Any]:
            Bucket.put_many(self, {k: objects[k] for k in keys})
            return {}

        self._call_each("put", list(objects), effect)

    def put_exclusive(self, key: str, data: bytes) -> None:
        self._call("put_exclusive", [key], partial(self._marker, key, data))

    def _marker(self, key: str, data: bytes) -> None:
        """An exclusive write; or the writer's death just before it (``crash``)."""
        plan = self.injector.plan
        if plan.crash_rate and any(k in key for k in plan.crash_keys):
            request = self.injector.request(self.region, "crash", key)
            if request.draw("crash") < plan.crash_rate:
                self.injector.record("crash", request, f"pid {os.getpid()} killed itself")
                logging.shutdown()  # the record reaches the log before the process goes
                os.kill(os.getpid(), signal.SIGKILL)
        super().put_exclusive(key, data)

    def get(self, key: str, limit: int | None = None) -> bytes:
        return self._call(
            "get", [key], partial(super().get, key, limit),
            lambda data, rs: self._damage(rs[0], data),
        )  # fmt: skip

    def get_many(self, keys: list[str], limit: int | None = None) -> dict[str, bytes]:
        def damage(found: dict[str, bytes], requests: list[Request]) -> dict[str, bytes]:
            return {r.key: self._damage(r, found[r.key]) for r in requests}

        def effect(sent: list[str]) -> dict[str, bytes]:
            return Bucket.get_many(self, sent, limit)

        return self._call_each("get", list(keys), effect, damage)

    def exists(self, key: str) -> bool:
        return self._call("exists", [key], partial(super().exists, key))

    def list(self, prefix: str) -> list[str]:
        return self._call("list", [prefix], partial(super().list, prefix), self._stale)

    def temporaries(self, prefix: str) -> list[str]:
        return self._call("list", [prefix], partial(super().temporaries, prefix))

    def info(self, key: str) -> dict[str, Any]:
        return self._call("info", [key], partial(super().info, key))

    def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        self._call("delete", keys, partial(super().delete, keys))

    def delete_prefix(self, prefix: str) -> None:
        self._call("delete_prefix", [prefix], partial(super().delete_prefix, prefix))

    def probe_exclusive(self) -> None:
        key = f"{self.scope + '/' if self.scope else ''}.diloco-probe/"  # (the probe's folder)
        self._call("probe_exclusive", [key], super().probe_exclusive)
