"""One launcher per run: a lock with a lease in the run's home bucket.

A launcher claims the run with the next numbered claim (``launcher/claims/sN``, written
by an exclusive create, so of two launchers started together only one gets it) and
renews the claim's lease (``launcher/leases/sN``) every ``RENEW_SECONDS``. Both are
claims, tagged with the run's claims key where the launcher holds the run secret
(``storage_layout.auth``): an object that whoever holds no key put there is no claim.
Another launcher of the run is refused, naming the holder, while the newest claim's
lease is fresh. It takes the run over when that lease is released (its launcher ended),
stale (not renewed for ``LEASE_SECONDS``: its launcher died, or lost its storage for
that long), or held by a process of this host that is gone. A launcher whose claim has
been overtaken so is fenced: it stops its workers and ends naming the one that took
over, so two launchers never supervise one run for long.

Lease ages compare the holder's clock with the reader's; hosts that launch one run are
expected to keep their clocks within seconds of each other (NTP).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import Field

from storage_layout.commit import patiently
from storage_layout.layout import MAX_NUMBER
from storage_layout.record import BadRecord, Counter, Name, Record, Time, read, read_or_none
from storage_layout.store import RunStore

log = logging.getLogger(__name__)

LEASE_SECONDS = 30.0  # a lease not renewed for this long is stale: its run may be taken over
RENEW_SECONDS = 5.0

_held: dict[str, RunLock] = {}  # run -> the lock this process holds on it


class LockClaim(Record):
    """A claim on the run, or its lease (the claim's renewals)."""

    claim: Counter
    host: Name
    pid: Annotated[int, Field(ge=0, lt=1 << 32)]
    time: Time
    nonce: Name
    released: bool = False


class RunLocked(RuntimeError):
    """The run is held by another live launcher (or was just claimed by one)."""


class RunTakenOver(RuntimeError):
    """This launcher's claim was overtaken: another launcher took the run over."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe(holder: dict[str, Any], now: float | None = None) -> str:
    """``launcher pid 123 on host h (claim 4), lease renewed 3 s ago``."""
    age = (now or time.time()) - float(holder.get("time", 0.0))
    return (f"launcher pid {holder.get('pid')} on host {holder.get('host')} (claim "
            f"{holder.get('claim')}), lease renewed {age:.0f} s ago")  # fmt: skip


class RunLock:
    """The lock on ``store``'s run (see the module's docstring). ``acquire`` takes it or
    raises ``RunLocked``; ``on_lost`` is called (once, from the renewing thread) if
    another launcher takes the run over; ``release`` lets the next launcher start at
    once."""

    def __init__(self, store: RunStore, logger: Any = log,
                 on_lost: Callable[[str], None] | None = None):  # fmt: skip
        self.store, self.log, self.on_lost = store, logger, on_lost
        self.prefix = store.layout.launcher_claims()
        self.claim: int | None = None
        self.lost: str | None = None  # who took the run over
        self.nonce = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reported = -math.inf
        self._bad: set[int] = set()  # claim numbers whose record is not a claim

    # reading ------------------------------------------------------------------------
    def _claims(self) -> tuple[int, set[int]]:
        """The newest claim that reads as one (its record a ``LockClaim`` of its own
        number), and every number listed: a forged or damaged claim is named once and
        passed over, so one numbered far ahead neither blocks a launch nor takes the run
        over."""
        listed = set(self.store.claim_numbers(self.store.home, self.prefix))
        for n in sorted(listed - self._bad, reverse=True):
            key = self.store.numbered_claim(self.prefix, n)
            try:
                claim = read(self.store.home, key, LockClaim, sealed_by=self.store.seal_of(key))
            except FileNotFoundError:
                continue
            except BadRecord as exc:
                claim = exc
            if isinstance(claim, LockClaim) and claim.claim == n:
                return n, listed
            self.log.warning("run lock: ignored %s: %s", key, claim if isinstance(
                claim, BadRecord) else f"it holds claim {claim.claim}")  # fmt: skip
            self._bad.add(n)
        return 0, listed

    def _newest(self) -> int:
        return self._claims()[0]

    def _read(self, key: str) -> dict[str, Any] | None:
        found = read_or_none(self.store.home, key, LockClaim, warn=self.log.warning,
                             sealed_by=self.store.seal_of(key))  # fmt: skip
        return None if found is None else found.model_dump()

    def holder(self, claim: int) -> dict[str, Any]:
        """Claim ``claim``'s holder, with its lease's newest renewal (the claim's own
        time if it has none yet)."""
        found = self._read(self.store.numbered_claim(self.prefix, claim)) or {"claim": claim}
        lease = self._read(self.store.claim_key(self.store.layout.launcher_lease(claim))) or {}
        return {**found, **{k: v for k, v in lease.items() if k in ("time", "released")}}

    def live(self, holder: dict[str, Any]) -> bool:
        """Whether ``holder`` still holds the run: not released, renewed within
        ``LEASE_SECONDS``, and, on this host, a process that exists (and is not this
        one, which holds no lock it does not know of)."""
        if holder.get("released"):
            return False
        if holder.get("host") == socket.gethostname():
            pid = holder.get("pid", 0)
            if pid == os.getpid():  # this process: live if it still holds that claim
                mine = _held.get(self.store.run)
                return mine is not None and mine.claim == holder.get("claim")
            if not _alive(pid):
                return False
        return time.time() - float(holder.get("time", 0.0)) < LEASE_SECONDS

    # taking and keeping ---------------------------------------------------------------
    def acquire(self) -> RunLock:
        run = self.store.run
        newest, listed = self._claims()
        if newest:
            holder = self.holder(newest)
            if self.live(holder):
                raise RunLocked(
                    f"run {run!r} is already running: {describe(holder)}; stop that launcher "
                    f"first (Ctrl-C), or pass another --run; a launcher that died is taken "
                    f"over once its lease is {LEASE_SECONDS:.0f} s old"
                )
        claim = next((n for n in range(newest + 1, MAX_NUMBER + 1) if n not in listed), None)
        if claim is None:
            raise RunLocked(f"run {run!r}: no claim number is left above {newest} in "
                            f"{self.store.home.url}/{self.prefix} (forged claims?)")  # fmt: skip
        key = self.store.numbered_claim(self.prefix, claim)
        body = self.store.sealed(key, self._body(claim))
        try:
            patiently(lambda: self.store.home.put_exclusive(key, body), key)
        except FileExistsError:
            other = self._read(key)
            if other is None or other.get("nonce") != self.nonce:  # (ours if a lost answer)
                raise RunLocked(
                    f"run {run!r} was claimed by another launcher at the same moment: "
                    f"{describe(other or {'claim': claim})}; stop it first, or pass another "
                    "--run"
                ) from None
        self.claim = claim
        self._write_lease()
        _held[run] = self
        self._thread = threading.Thread(target=self._keep, name=f"run-lock-{run}", daemon=True)
        self._thread.start()
        if newest and not holder.get("released"):
            self.log.warning("run %s: took the run over from %s", run, describe(holder))
        return self

    def _body(self, claim: int, **extra: Any) -> bytes:
        return json.dumps({"claim": claim, "host": socket.gethostname(), "pid": os.getpid(),
                           "time": time.time(), "nonce": self.nonce, **extra}).encode()  # fmt: skip

    def _write_lease(self, released: bool = False) -> None:
        key = self.store.claim_key(self.store.layout.launcher_lease(self.claim))
        data = self.store.sealed(key, self._body(self.claim, released=released))
        patiently(lambda: self.store.home.put(key, data), key)

    def _keep(self) -> None:
        """Renew the lease until released; notice being taken over (a thread: it never
        raises; a renewal that fails is logged once a minute and tried again)."""
        while not self._stop.wait(RENEW_SECONDS):
            try:
                newest = self._newest()
                if newest > self.claim:
                    self.lost = describe(self.holder(newest))
                    self.log.error("run %s was taken over by %s (this launcher's lease had "
                                   "gone stale); this launcher stops its workers",
                                   self.store.run, self.lost)  # fmt: skip
                    _held.pop(self.store.run, None)
                    if self.on_lost is not None:
                        self.on_lost(self.lost)
                    return
                self._write_lease()
            except Exception as exc:
                if time.monotonic() - self._reported >= 60.0:
                    self._reported = time.monotonic()
                    self.log.warning("renewing the lock on run %s failed (%s: %s); trying "
                                     "again in %.0f s (after %.0f s without a renewal another "
                                     "launcher may take the run over)", self.store.run,
                                     type(exc).__name__, exc, RENEW_SECONDS, LEASE_SECONDS)  # fmt: skip

    def release(self) -> None:
        """Stop renewing and mark the lease released (best effort: if that fails, the
        lease goes stale in ``LEASE_SECONDS``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if _held.get(self.store.run) is self:
            del _held[self.store.run]
        if self.claim is not None and self.lost is None:
            try:
                self._write_lease(released=True)
            except Exception as exc:
                self.log.warning("could not release the lock on run %s (%s: %s); it goes "
                                 "stale in %.0f s", self.store.run, type(exc).__name__, exc,
                                 LEASE_SECONDS)  # fmt: skip


def held(run: str) -> RunLock | None:
    """The lock this process holds on ``run``, if any."""
    return _held.get(run)
