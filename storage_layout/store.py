"""One run across its regions' buckets: the API learners, syncers and tools use.

- The **run spec** is written once to every region (create-exclusive). Opening a run
  with a spec that differs from the stored one fails with the differences listed.
- A **learner** writes contributions and checkpoints only under its own prefix in its
  own region's bucket, and reads global versions from its own region.
- A **syncer** lists learners' contribution markers in every region, reads and verifies
  them, and publishes each global version to every region. The syncer's home region is
  the arbiter: the version is committed there first (so of two racing syncers exactly
  one wins), then copied to the other regions. Only the home region keeps the fp32
  master copy and the outer optimizer state (what a restarted syncer needs); the other
  regions get the ``wire`` group learners download, so a version crosses regions once,
  in the wire dtype. A region that is down is skipped and
  brought up to date by ``sync_regions`` once it is back; it stops no other region.
- Every byte and request is counted per (source region, destination region).

``RunStore`` itself keeps the run's buckets, its spec (and budget, pipeline settings,
secret fingerprint) and the claims every record kind makes (``claim_key``, ``put_next``:
tagged, sealed, each number once). The records are kept by its parts, one per kind,
each over ``layout.py``:

- ``store.members`` (``members.py``): generations and fences, seq blocks, member and
  join records, heartbeats;
- ``store.units`` (``unit_claims.py``): data ledgers, fresh, returned and offered units;
- ``store.contributions`` (``contributions.py``): learners' outer gradients;
- ``store.versions`` (``versions.py``): global versions, published and copied;
- ``store.checkpoints`` (``checkpoints.py``): learners' checkpoints, whole or in parts;
- ``store.progress`` (``progress.py``): metrics and learners' round history.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Annotated, Any

from pydantic import Field

from storage_layout.auth import SecretMismatch, claim_tag, seal, seal_key, secret_fingerprint
from storage_layout.bucket import Bucket, BucketError
from storage_layout.checkpoints import Checkpoints
from storage_layout.commit import CorruptVersion, patiently, writer_identity
from storage_layout.contributions import Contributions
from storage_layout.faults import Injector, open_bucket
from storage_layout.layout import (
    FORMAT_VERSION,
    RunLayout,
    check_name,
    claim_stem,
    number,
    parse_marker_name,
)
from storage_layout.members import Members
from storage_layout.part import read_json, read_or_none
from storage_layout.progress import Progress
from storage_layout.record import Record, Time, Tokens
from storage_layout.traffic import Traffic
from storage_layout.unit_claims import Units
from storage_layout.versions import Versions

log = logging.getLogger(__name__)


class Spec(Record):
    format_version: int | None = None
    config: dict[str, Any] = Field(default_factory=dict)


class Pipeline(Record):
    pipeline: dict[str, Any]


class Budget(Record):
    tokens: Tokens
    previous: Annotated[int, Field(ge=0, lt=10**18)] | None = None
    time: Time | None = None


SPEC_BYTES = 4 << 20  # a spec is a config, a plan of fragments, a data set's manifest


class SpecMismatch(ValueError):
    """The run spec given does not match the one stored in the bucket."""


class RegionDown(BucketError):
    """A region's bucket could not be reached; only work touching it waits."""


def spec_home(spec: Mapping[str, Any]) -> str:
    """A stored spec's home region: its ``home``, or (a spec written before it was
    recorded) the first of its regions."""
    home = spec.get("home") or next(iter(spec.get("regions") or {}), None)
    if not isinstance(home, str) or home not in (spec.get("regions") or {}):
        raise CorruptVersion(f"the run spec names no home region among its regions ({home!r})")
    return home


def spec_differences(stored: Any, given: Any, path: str = "", defaults: Any = None) -> list[str]:
    """Human-readable differences between two JSON-like values.

    ``defaults`` (the same shape as ``given``) holds the value a key has when a spec
    does not name it: a key that newer code added is no difference in a spec stored by
    older code, as long as the given value is that default (the run keeps behaving as
    it did)."""
    if isinstance(stored, dict) and isinstance(given, dict):
        out = []
        defaults = defaults if isinstance(defaults, dict) else {}
        for key in sorted(set(stored) | set(given), key=str):
            where = f"{path}.{key}" if path else str(key)
            if key not in stored:
                if key in defaults and given[key] == defaults[key]:
                    continue
                out.append(f"{where}: not in the stored spec, given {given[key]!r}")
            elif key not in given:
                out.append(f"{where}: stored {stored[key]!r}, missing from the given spec")
            else:
                out.extend(spec_differences(stored[key], given[key], where, defaults.get(key)))
        return out
    if isinstance(stored, list) and isinstance(given, list) and len(stored) == len(given):
        return [
            d
            for i, (a, b) in enumerate(zip(stored, given, strict=True))
            for d in spec_differences(a, b, f"{path}[{i}]")
        ]
    return [] if stored == given else [f"{path}: stored {stored!r}, given {given!r}"]


class RunStore:
    def __init__(
        self,
        run: str,
        regions: Mapping[str, str],
        client_region: str,
        writer: str | None = None,
        storage_options: Mapping[str, Mapping[str, Any]] | None = None,
        traffic: Traffic | None = None,
        allow_unsafe_overwrite: bool = False,
        claims_key: bytes | None = None,
        faults: Injector | None = None,
    ):
        if client_region not in regions:
            raise ValueError(f"client region {client_region!r} is not one of {sorted(regions)}")
        self.layout = RunLayout(run)
        self.run = run
        self.client_region = client_region
        self.writer = writer or writer_identity(client_region)
        self.traffic = traffic if traffic is not None else Traffic()
        self.urls = {check_name("region", r): url for r, url in regions.items()}
        self._options = storage_options or {}
        self._unsafe = allow_unsafe_overwrite
        self._buckets: dict[str, Bucket] = {}
        self.faults = faults  # its buckets meet this injector's faults (``storage_layout.faults``)
        # The key that tags the run's claims (``storage_layout.auth``): with it, claims are
        # made tagged and only those tagged with it are read; without it, untagged, and
        # every claim is read (unchecked: a view for people, ``diloco inspect``).
        self.claims_key = claims_key
        self.passed_over: set[str] = set()  # objects named once as no claim of the run
        self._tags_seen: dict[str, str] = {}  # base -> its tag as listed (without a key)
        # The records of the run, by kind, each over this store's buckets and claims.
        self.members = Members(self)
        self.units = Units(self)
        self.contributions = Contributions(self)
        self.versions = Versions(self)
        self.checkpoints = Checkpoints(self)
        self.progress = Progress(self)

    def bucket(self, region: str) -> Bucket:
        """The region's bucket, opened on first use; ``RegionDown`` if it cannot be reached."""
        if region not in self._buckets:
            if region not in self.urls:
                raise ValueError(f"unknown region {region!r}; this run has {sorted(self.urls)}")
            opening = partial(open_bucket, self.urls[region], region=region,
                              client_region=self.client_region,
                              storage_options=self._options.get(region), traffic=self.traffic,
                              allow_unsafe_overwrite=self._unsafe,
                              scope=self.run, injector=self.faults)  # fmt: skip
            try:
                self._buckets[region] = patiently(opening, f"opening region {region}")
            except BucketError as exc:
                raise RegionDown(str(exc)) from exc
        return self._buckets[region]

    @property
    def home(self) -> Bucket:
        return self.bucket(self.client_region)

    # run spec -------------------------------------------------------------------------
    def ensure_spec(
        self,
        spec: Mapping[str, Any],
        defaults: Mapping[str, Any] | None = None,
        any_budget: bool = False,
    ) -> dict[str, Any]:
        """Write ``spec`` to every region once; if one is stored, it must match exactly,
        but for keys it lacks whose given value is their default (``spec_differences``),
        and, with ``any_budget``, for the token budget (about to be extended)."""
        body = {"format_version": FORMAT_VERSION, **spec}
        data = json.dumps(body, sort_keys=True, indent=1).encode()
        for region in self.urls:
            bucket = self.bucket(region)
            try:
                bucket.put_exclusive(self.layout.spec, data)
            except FileExistsError:
                stored = self.read_spec(region)
                given = json.loads(data)
                if any_budget:
                    given["config"]["budget"]["tokens"] = stored["config"]["budget"]["tokens"]
                diffs = spec_differences(stored, given, defaults=defaults)
                if diffs:
                    raise SpecMismatch(
                        f"run {self.run!r} in region {region} was started with another spec; "
                        "refusing to mix them:\n  " + "\n  ".join(diffs)
                    ) from None
        return body

    def read_spec(self, region: str | None = None) -> dict[str, Any]:
        """The run spec, with its token budget raised to ``budget.json``'s if that is
        larger (``extend_budget``): every process that reads the spec works to it."""
        bucket = self.bucket(region or self.client_region)
        try:
            spec = read_json(bucket, self.layout.spec, Spec, SPEC_BYTES)
        except FileNotFoundError:
            raise FileNotFoundError(f"no run {self.run!r} in {bucket.url} (no spec.json)") from None
        if spec.get("format_version") != FORMAT_VERSION:
            raise CorruptVersion(
                f"run {self.run!r} has format version {spec.get('format_version')!r}; "
                f"this code reads {FORMAT_VERSION}"
            )
        extended = self._extended_budget(bucket)
        budget = spec.get("config", {}).get("budget", {})
        if extended is not None and extended > int(budget.get("tokens", 0)):
            spec["config"]["budget"] = {**budget, "tokens": extended}
        return spec

    def check_secret(self, secret: str, source: str) -> None:
        """Store the run secret's fingerprint at home on first use; later, refuse a secret
        whose fingerprint differs (``SecretMismatch``, naming ``source``): a swapped
        secret would have every genuine contribution rejected as forged. So is a run
        whose fingerprint does not say that its claims are tagged (started by an older
        diloco: every claim it made would be passed over)."""
        key = self.layout.secret_fingerprint
        ours = secret_fingerprint(secret, self.run)
        body = json.dumps({"alg": "hmac-sha256", "fingerprint": ours, "claims": "tagged"}).encode()
        try:
            patiently(lambda: self.home.put_exclusive(key, body), key)
            return
        except FileExistsError:
            if self.holds(key, body):
                return
        stored = read_or_none(self.home, key)
        if stored is None or stored.get("fingerprint") != ours:
            raise SecretMismatch(
                f"the run secret from {source} is not the one run {self.run!r} started with "
                f"(its fingerprint in {self.home.url}/{key} differs): the syncers would reject "
                "every learner's contributions as forged. Use the original secret (the "
                "run folder's run-secret file, or the DILOCO_RUN_SECRET it started with)"
            )
        if stored.get("claims") != "tagged":
            raise SecretMismatch(
                f"run {self.run!r} was started by an older diloco, which did not tag its "
                "claims with the run's key (storage_layout.auth): this one would pass over "
                "every claim it made and hand its data out again. Finish it with the "
                "version that started it, or start another run"
            )

    def _extended_budget(self, bucket: Bucket) -> int | None:
        try:
            return read_json(bucket, self.layout.budget, Budget)["tokens"]
        except FileNotFoundError:
            return None

    def extend_budget(self, tokens: int, previous: int) -> None:
        """Raise the run's token budget from ``previous`` to ``tokens`` in every region:
        the spec stays as it was written, and ``budget.json`` beside it holds the new
        budget, which ``read_spec`` reports from then on (a smaller one is never read)."""
        body = json.dumps({"tokens": tokens, "previous": previous, "writer": self.writer,
                           "time": time.time()}, sort_keys=True).encode()  # fmt: skip
        self._put_everywhere(self.layout.budget, body)

    def _put_everywhere(self, key: str, body: bytes) -> None:
        """``body`` at ``key`` in every region's bucket (overwritten), each put patiently."""
        for region in self.urls:
            bucket = self.bucket(region)
            patiently(lambda b=bucket: b.put(key, body), key)

    def put_pipeline(self, settings: Mapping[str, Any]) -> None:
        """Record the pipeline settings this launch runs with (``pipeline.*``, which the
        spec leaves out: they may change between launches) in every region, for machines
        that join the run later (``read_pipeline``)."""
        body = json.dumps({"pipeline": dict(settings), "writer": self.writer,
                           "time": time.time()}, sort_keys=True).encode()  # fmt: skip
        self._put_everywhere(self.layout.pipeline, body)

    def read_pipeline(self, region: str | None = None) -> dict[str, Any]:
        """The pipeline settings of the run's newest launch ({} if none was recorded: a
        run launched before they were); ``CorruptVersion`` naming the object if it is
        not what ``put_pipeline`` writes. What they hold is checked where they are used
        (``validate_config``), like any settings."""
        bucket = self.bucket(region or self.client_region)
        try:
            return read_json(bucket, self.layout.pipeline, Pipeline)["pipeline"]
        except FileNotFoundError:
            return {}

    # discovery ----------------------------------------------------------------------
    def numbers(self, bucket: Bucket, prefix: str, letter: str) -> list[int]:
        out = []
        for name in patiently(lambda: bucket.list(prefix), f"listing {prefix}"):
            n = parse_marker_name(name, letter)
            if n is None:
                log.warning("ignoring foreign object %s/%s in %s", prefix, name, bucket.url)
                continue
            out.append(n)
        return sorted(out)

    def claim_key(self, base: str) -> str:
        """The key of the claim at ``base`` (``prefix/sN`` or ``prefix/name``):
        ``{base}.{tag}.json``, tagged with the run's claims key, where this store holds
        one (``storage_layout.auth.claim_tag``), else ``{base}.json`` or, for a claim
        this store listed tagged, its key as listed (a view for people)."""
        if self.claims_key is None:
            tag = self._tags_seen.get(base)
            return f"{base}.json" if tag is None else f"{base}.{tag}.json"
        return f"{base}.{claim_tag(self.claims_key, base)}.json"

    def numbered_claim(self, prefix: str, n: int) -> str:
        """The key of claim ``n`` under ``prefix``."""
        return self.claim_key(f"{prefix}/s{number(n)}")

    def seal_of(self, key: str) -> bytes | None:
        """The key that seals the claim at ``key`` (``storage_layout.auth.seal``); None
        where this store holds no claims key (claims are then neither sealed nor
        checked)."""
        if self.claims_key is None:
            return None
        base = key.removesuffix(".json").rsplit(".", 1)[0]  # ``claim_key``'s, its tag cut
        return seal_key(self.claims_key, base)

    def sealed(self, key: str, data: bytes) -> bytes:
        """The claim ``data`` (a JSON object) to write at ``key``, sealed (``seal_of``)."""
        k = self.seal_of(key)
        return data if k is None else json.dumps(seal(json.loads(data), k), sort_keys=True).encode()

    def claim(self, key: str, data: bytes) -> bool:
        """``create`` of the claim ``data`` at ``key``, sealed."""
        return self.create(key, self.sealed(key, data))

    def claim_names(self, bucket: Bucket, prefix: str) -> list[str]:
        """The claims listed under ``prefix``, by name (without tag and ``.json``). With
        a claims key, only those tagged with it: any other object is named once and
        passed over (forged, or left by a diloco that did not tag its claims), so it
        neither blocks nor skips a claim; without one, every claim, tagged or not."""
        out = []
        for name in patiently(lambda: bucket.list(prefix), f"listing {prefix}"):
            stem, tag = claim_stem(name) or ("", None)
            if self.claims_key is None and stem and tag is not None:  # unchecked
                self._tags_seen[f"{prefix}/{stem}"] = tag
            ok = stem != "" and self.claim_key(f"{prefix}/{stem}") == f"{prefix}/{name}"
            if ok:
                out.append(stem)
            elif f"{bucket.url}/{prefix}/{name}" not in self.passed_over:
                self.passed_over.add(f"{bucket.url}/{prefix}/{name}")
                log.warning("passing over %s/%s in %s: not a claim of run %s (%s)", prefix,
                            name, bucket.url, self.run, "not tagged with the run's claims key"
                            if self.claims_key is not None else "not a claim's name")  # fmt: skip
        return sorted(out)

    def claim_numbers(self, bucket: Bucket, prefix: str) -> list[int]:
        """The numbers of the claims listed under ``prefix`` (``claim_names``)."""
        names = (
            parse_marker_name(f"{stem}.json", "s") for stem in self.claim_names(bucket, prefix)
        )
        return sorted(n for n in names if n is not None)

    # learner generations -------------------------------------------------------------
    def stamped(self, fields: Mapping[str, Any]) -> bytes:
        """``fields`` as a write-once record: with who wrote it, from where, and when (a
        retried write finds its own bytes: ``put_next``, ``holds``)."""
        return json.dumps({**fields, "writer": self.writer, "host": socket.gethostname(),
                           "pid": os.getpid(), "time": time.time()}).encode()  # fmt: skip

    def put_next(
        self, prefix: str, body: bytes | Callable[[int], bytes], after: int | None = None,
        dense: bool = False,
    ) -> int:  # fmt: skip
        """Write ``body`` (or ``body(N)``) as the next numbered object ``prefix/sN.json`` at
        home, with an exclusive create, so two writers never share a number; returns N.
        The first number tried is the one after ``after`` or after the newest listed
        (``dense``: the first not listed, so that a number written far ahead by someone
        else, which the run's writers never make, neither skips the numbers below it nor
        ends the count); a number another writer holds is a conflict, and the next free
        one is tried, so a listing that leaves the newest out costs tries, never a shared
        number. A number taken by this very write (its answer was lost, and the retry
        found it there) is ours. ``body(N)`` should hold something unique to the write (a
        time, a pid), so that two writers never write the same bytes."""

        def free(at_least: int) -> int:
            taken = self.claim_numbers(self.home, prefix)
            if not dense:
                return max(at_least, (taken[-1] if taken else 0) + 1)
            held, n = set(taken), at_least
            while n in held:
                n += 1
            return n

        n = free(1) if after is None else after + 1
        while True:
            key = self.numbered_claim(prefix, n)
            data = self.sealed(key, body(n) if callable(body) else body)
            try:
                patiently(lambda: self.home.put_exclusive(key, data), key)  # noqa: B023
                return n
            except FileExistsError:
                if self.holds(key, data):
                    return n
                n = free(n + 1)

    def create(self, key: str, data: bytes) -> bool:
        """Create ``key`` at home holding ``data`` (an exclusive create); False when another
        writer's object is there (one holding exactly ``data`` is this write's own, its
        answer lost: ``holds``)."""
        try:
            patiently(lambda: self.home.put_exclusive(key, data), key)
            return True
        except FileExistsError:
            return self.holds(key, data)

    def holds(self, key: str, data: bytes, reads: int = 3) -> bool:
        """Whether ``key`` at home holds exactly ``data``: read up to ``reads`` times, as a
        read can come back damaged (one that matches cannot be a damaged one)."""
        for _ in range(reads):
            with contextlib.suppress(OSError):
                if patiently(lambda: self.home.get(key), key) == data:
                    return True
        return False

    # learner sequence numbers ----------------------------------------------------------

    # learners beyond the spec's slots ------------------------------------------------

    # data units ------------------------------------------------------------------

    # contributions ------------------------------------------------------------------

    # global versions ----------------------------------------------------------------

    # checkpoints and metrics ----------------------------------------------------------

    # heartbeats -------------------------------------------------------------------------

    # learners' round history ------------------------------------------------------------


def poll(
    probe: Callable[[], Any],
    timeout: float,
    first_delay: float = 0.05,
    max_delay: float = 2.0,
    sleep: Callable[[float], None] = time.sleep,
) -> Any:
    """Call ``probe`` until it returns something truthy, backing off exponentially.

    Returns the value, or None after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    delay = first_delay
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() + delay > deadline:
            return None
        sleep(delay)
        delay = min(max_delay, delay * 2)
