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
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Annotated, Any

import numpy as np
from pydantic import Field

from diloco.quantize import (
    Pieces,
    QuantizedTensor,
    dequantize,
    exact_values,
    piece_step,
    quantize,
)
from diloco.topology import learner_index, learner_region, run_deal, run_slots
from storage_layout import heartbeat, record
from storage_layout.auth import (
    SecretMismatch,
    claim_tag,
    record_verifies,
    seal,
    seal_key,
    secret_fingerprint,
    sign_record,
    signer,
    verify,
)
from storage_layout.bucket import Bucket, BucketError, PartialFailure, Refused, Traffic
from storage_layout.codec import (
    CHUNK,
    FormatError,
    GroupWriter,
    encode,
    group_kind,
    root_objects,
    write_group,
)
from storage_layout.commit import (
    REVOKED,
    CommitConflict,
    CommitMarker,
    CorruptVersion,
    Revoked,
    commit_marker,
    commit_version,
    content_write_id_of,
    entry,
    get_patiently,
    new_write_id,
    patiently,
    put_patiently,
    read_marker,
    writer_identity,
)
from storage_layout.faults import open_bucket
from storage_layout.layout import (
    FORMAT_VERSION,
    RunLayout,
    check_name,
    claim_stem,
    data_prefix_of,
    number,
    parse_marker_name,
)
from storage_layout.record import Counter, Name, Record, Time, Tokens
from storage_layout.stream import PARALLEL, ObjectSink, VersionReader, checked_object

log = logging.getLogger(__name__)


class Written(Record):
    """What ``RunStore._record`` adds to each write-once record it makes."""

    writer: Name | None = None
    host: Name | None = None
    pid: Annotated[int, Field(ge=0, lt=1 << 32)] | None = None
    time: Time | None = None


class SeqBlock(Written):
    first: Counter
    end: Counter


class Generation(Written):
    """A process's claim of a learner's generation, or a syncer's fence (``fence``)."""

    fence: Annotated[str, Field(max_length=2000)] | None = None


class Join(Record):
    """A joiner's record of taking a slot (``flows.join``), signed where the run signs."""

    join: Counter
    time: Time


class Spec(Record):
    format_version: int | None = None
    config: dict[str, Any] = Field(default_factory=dict)


class Pipeline(Record):
    pipeline: dict[str, Any]


class Budget(Record):
    tokens: Tokens
    previous: Annotated[int, Field(ge=0, lt=10**18)] | None = None
    time: Time | None = None


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


def sum_traffic(statuses: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """Bytes and requests per region pair (``source->destination``), summed over status
    records (each checked as a ``Status``), largest first."""
    out: dict[str, dict[str, int]] = {}
    for status in statuses:
        for pair, t in (status.get("traffic") or {}).items():
            acc = out.setdefault(pair, {"bytes": 0, "requests": 0})
            acc["bytes"] += int(t.get("bytes", 0))
            acc["requests"] += int(t.get("requests", 0))
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["bytes"]))


STATUS_BYTES = 1 << 20  # a status holds a few dozen fields and a traffic table
SPEC_BYTES = 4 << 20  # a spec is a config, a plan of fragments, a data set's manifest


class SpecMismatch(ValueError):
    """The run spec given does not match the one stored in the bucket."""


class RegionDown(BucketError):
    """A region's bucket could not be reached; only work touching it waits."""


class HomeCopiesLost(ValueError):
    """The home region lacks global versions of a fragment that other regions or the
    retention ledger show were committed: its master copies (fp32 parameters, outer
    optimizer state) are gone, and no syncer may go on or start over from version 0."""


class SeqNotReserved(RuntimeError):
    """A learner process asked to commit a sequence number outside the blocks it holds:
    another process of that learner has reserved numbers above it since (``reserve_seqs``)."""


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


@dataclass
class GlobalState:
    fragment: int
    version: int
    params: dict[str, np.ndarray]
    opt_leaves: list[np.ndarray]
    meta: dict[str, Any]
    # The stored name of each of ``opt_leaves`` (same order): its path in the optax state
    # tree (``0/trace/blocks.0.up.kernel``), or ``0000``, ``0001``... in versions written
    # before leaves had names. ``flows.bucket_io`` puts them back in the tree's order.
    opt_names: list[str] = field(default_factory=list)


@dataclass
class PublishReport:
    version: int
    committed: list[str] = field(default_factory=list)  # regions holding the version now
    lagging: dict[str, str] = field(default_factory=dict)  # region -> why it was skipped


WIRE = ("wire",)  # what a learner reads of a version: its full copy
LEARNER_GROUPS = ("wire", "delta")  # what regions other than home hold: also the update


def learner_view(objects: Mapping[str, bytes]) -> dict[str, bytes]:
    """A global version's objects without the master copy and optimizer state."""
    return {
        k: v for k, v in objects.items() if "/" not in k or k.split("/", 1)[0] in LEARNER_GROUPS
    }


def _fp32(values: Mapping[str, np.ndarray]) -> dict[str, QuantizedTensor]:
    return {n: quantize(v, "fp32") for n, v in values.items()}


def _write_streamed(put: Callable[[str, bytes], None], gname: str, group: Any) -> None:
    """``write_group`` of float32 ``Tensors``, a chunk of values at a time (same objects)."""
    writer = GroupWriter(put, gname, "fp32", group.shapes)
    for name, shape in sorted(group.shapes.items()):
        size = int(np.prod(shape))
        for start in range(0, size, CHUNK):
            stop = min(size, start + CHUNK)
            writer.append(name, quantize(group.piece(name, start, stop), "fp32"))
    writer.close()


MAX_PART_BYTES = 16 << 20  # a part's manifest: its objects' records and its boxes


def checkpoint_part_group(part: int) -> str:
    """The group of a checkpoint that holds host ``part``'s shards (``opt.p0003``)."""
    if not 0 <= part < 10_000:
        raise ValueError(f"checkpoint part {part} is outside 0..9999")
    return f"opt.p{part:04d}"


def checkpoint_part_key(part: int) -> str:
    """Host ``part``'s manifest, relative to its checkpoint's data prefix."""
    return f"parts/{checkpoint_part_group(part)}.json"


def _checked_part(
    manifest: CommitMarker, key: str, prefix: str, write_id: str, part: int
) -> CommitMarker:
    """A part's manifest, taken only if it is this part of this write: its kind, write id,
    data prefix and part number, every object inside its own group, and boxes that are
    ``{tensor: {"leaf": str, "index": [[start, stop], ...]}}`` (the reader checks that
    they tile each leaf). ``CorruptVersion`` naming what is wrong otherwise."""
    gname = checkpoint_part_group(part)
    wrong = []
    if manifest.kind != "checkpoint-part":
        wrong.append(f"kind {manifest.kind!r}")
    if manifest.write_id != write_id or manifest.data_prefix != prefix:
        wrong.append(f"write {manifest.write_id!r} at {manifest.data_prefix!r}")
    if manifest.meta.get("part") != part:
        wrong.append(f"part {manifest.meta.get('part')!r}")
    outside = [rel for rel in manifest.objects if not rel.startswith(f"{gname}/")]
    if outside:
        wrong.append(f"objects outside {gname}/: {outside[:3]}")
    slices = manifest.meta.get("slices")
    try:
        for box in slices.values():
            if not isinstance(box["leaf"], str) or not all(
                len(pair) == 2 and all(type(x) is int and x >= 0 for x in pair)
                for pair in box["index"]
            ):
                raise TypeError(box)
    except (AttributeError, KeyError, TypeError) as exc:
        wrong.append(f"boxes that are not {{tensor: {{leaf, index}}}} ({exc!r:.80})")
    if wrong:
        raise CorruptVersion(f"{key} is not part {part} of write {write_id}: {'; '.join(wrong)}")
    return manifest


def _opt_group(leaves: Sequence[np.ndarray] | Mapping[str, np.ndarray]) -> dict:
    """A version's ``opt`` group: the outer optimizer state's leaves under the names given
    (their paths in the optax state tree, ``flows.bucket_io``); a plain list is named by
    position, ``0000``, ``0001``... (as every version was before leaves had names)."""
    if isinstance(leaves, Mapping):
        return _fp32(leaves)
    return _fp32({f"{i:04d}": leaf for i, leaf in enumerate(leaves)})


def _write_delta(
    put: Callable[[str, bytes], None],
    shapes: Mapping[str, Sequence[int]],
    kind: str,
    block_size: int,
    pieces: Callable[[], Iterable[tuple[str, QuantizedTensor]]],
) -> int:
    """A contribution's objects (its root metadata and the ``delta`` group) to ``put``, a
    piece at a time; the payload's bytes."""
    for rel, blob in root_objects({"kind": "contribution"}).items():
        put(rel, blob)
    writer = GroupWriter(put, "delta", kind, shapes, block_size)
    payload = 0
    for name, q in pieces():
        writer.append(name, q)
        payload += q.nbytes
    writer.close()
    return payload


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
        self._metrics_base: dict[str, dict[str, Any]] = {}  # as stored before our first write
        self._members: dict[tuple[str, str], Any] = {}  # member records read (written once)
        # The key that tags the run's claims (``storage_layout.auth``): with it, claims are
        # made tagged and only those tagged with it are read; without it, untagged, and
        # every claim is read (unchecked: a view for people, ``diloco inspect``).
        self.claims_key = claims_key
        self.passed_over: set[str] = set()  # objects named once as no claim of the run
        self._tags_seen: dict[str, str] = {}  # base -> its tag as listed (without a key)

    def bucket(self, region: str) -> Bucket:
        """The region's bucket, opened on first use; ``RegionDown`` if it cannot be reached."""
        if region not in self._buckets:
            if region not in self.urls:
                raise ValueError(f"unknown region {region!r}; this run has {sorted(self.urls)}")
            opening = partial(open_bucket, self.urls[region], region=region,
                              client_region=self.client_region,
                              storage_options=self._options.get(region), traffic=self.traffic,
                              allow_unsafe_overwrite=self._unsafe,
                              scope=self.run)  # fmt: skip
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
            spec = _read_json(bucket, self.layout.spec, Spec, SPEC_BYTES)
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
            if self._holds(key, body):
                return
        stored = _read_or_none(self.home, key)
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
            return _read_json(bucket, self.layout.budget, Budget)["tokens"]
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
            return _read_json(bucket, self.layout.pipeline, Pipeline)["pipeline"]
        except FileNotFoundError:
            return {}

    # discovery ----------------------------------------------------------------------
    def _numbers(self, bucket: Bucket, prefix: str, letter: str) -> list[int]:
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

    def _claim(self, key: str, data: bytes) -> bool:
        """``_create`` of the claim ``data`` at ``key``, sealed."""
        return self._create(key, self.sealed(key, data))

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

    def contribution_seqs(self, learner: str, fragment: int, region: str) -> list[int]:
        return self._numbers(
            self.bucket(region), self.layout.contribution_commits(learner, fragment), "s"
        )

    def global_versions(self, fragment: int, region: str | None = None) -> list[int]:
        return self._numbers(
            self.bucket(region or self.client_region), self.layout.global_commits(fragment), "v"
        )

    def latest_global(self, fragment: int, region: str | None = None) -> int | None:
        versions = self.global_versions(fragment, region)
        return versions[-1] if versions else None

    def check_home(self, fragment: int) -> int | None:
        """The newest version of ``fragment`` at home (None for a run not started), after
        checking that no other region holds a newer one and that, if home holds none, no
        region and no ledger entry shows one was ever committed: else ``HomeCopiesLost``,
        naming what is missing (a relaunch must never republish version 0 over a run)."""
        home = self.latest_global(fragment)
        newer = {}
        for region in self.urls:
            if region != self.client_region:
                theirs = self.latest_global(fragment, region)
                if theirs is not None and (home is None or theirs > home):
                    newer[region] = theirs
        ledger = self.claim_numbers(self.home, self.layout.ledger_commits(fragment))
        if newer or (home is None and ledger):
            where = ", ".join(f"{r} holds v{v}" for r, v in sorted(newer.items()))
            where = where or f"the ledger records {len(ledger)} retention passes"
            raise HomeCopiesLost(
                f"run {self.run!r}: the home region {self.client_region} holds "
                f"{'no version' if home is None else f'v{home} at newest'} of fragment "
                f"{fragment}, but {where}: the master copies are gone from "
                f"{self.home.url}; restore them from a backup (or start another run)"
            )
        return home

    def checkpoint_steps(self, learner: str, region: str | None = None) -> list[int]:
        return self._numbers(
            self.bucket(region or self.client_region), self.layout.checkpoint_commits(learner), "s"
        )

    # learner generations -------------------------------------------------------------
    def _record(self, fields: Mapping[str, Any]) -> bytes:
        """``fields`` as a write-once record: with who wrote it, from where, and when (a
        retried write finds its own bytes: ``put_next``, ``_holds``)."""
        return json.dumps({**fields, "writer": self.writer, "host": socket.gethostname(),
                           "pid": os.getpid(), "time": time.time()}).encode()  # fmt: skip

    def claim_generation(self, learner: str) -> int:
        """Claim the next generation of ``learner`` in its home region (an exclusive
        create, so two starters never share one). A process holding an older generation
        is fenced off: it must stop once it sees a newer one."""
        return self.put_next(self.layout.lease_commits(learner), self._record({}))

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
                if self._holds(key, data):
                    return n
                n = free(n + 1)

    def _create(self, key: str, data: bytes) -> bool:
        """Create ``key`` at home holding ``data`` (an exclusive create); False when another
        writer's object is there (one holding exactly ``data`` is this write's own, its
        answer lost: ``_holds``)."""
        try:
            patiently(lambda: self.home.put_exclusive(key, data), key)
            return True
        except FileExistsError:
            return self._holds(key, data)

    def _holds(self, key: str, data: bytes, reads: int = 3) -> bool:
        """Whether ``key`` at home holds exactly ``data``: read up to ``reads`` times, as a
        read can come back damaged (one that matches cannot be a damaged one)."""
        for _ in range(reads):
            with contextlib.suppress(OSError):
                if patiently(lambda: self.home.get(key), key) == data:
                    return True
        return False

    # learner sequence numbers ----------------------------------------------------------
    def reserve_seqs(
        self, learner: str, at_least: int, count: int, after: int | None = None
    ) -> tuple[int, int, int]:
        """Reserve a block of ``count`` sequence numbers for ``learner``'s contributions,
        none below ``at_least`` and all above every block reserved before (by any process
        of it); returns (claim number, first, end). ``after``: the caller's own newest
        claim, to try the next number without a listing.

        A learner process commits only seqs inside blocks it holds. So a restarted one
        never takes a seq below one an earlier process may have committed, even when a
        listing leaves the newest contributions out: the claims are numbered and written
        with an exclusive create (``put_next``), and each block starts at the end of the
        claim before it, read by its key (a read of a known key is never stale)."""
        prefix = self.layout.seq_claims(learner)
        block: dict[str, int] = {}

        def claim(n: int) -> bytes:
            first = at_least
            if n > 1:
                key = self.numbered_claim(prefix, n - 1)
                before = _read_json(self.home, key, SeqBlock, sealed_by=self.seal_of(key))
                first = max(first, before["end"])
            block.update(first=first, end=first + count)
            return self._record(block)

        n = self.put_next(prefix, claim, after)
        return n, block["first"], block["end"]

    def seq_blocks(self, learner: str, newest: int = 2) -> list[tuple[int, int]]:
        """The ``newest`` blocks of seqs reserved for ``learner`` (``reserve_seqs``), as
        ``(first, end)``, oldest first (a listing and one read each)."""
        prefix = self.layout.seq_claims(learner)
        claims = self.claim_numbers(self.home, prefix)[-newest:] if newest > 0 else []
        out = []
        for n in claims:
            key = self.numbered_claim(prefix, n)
            block = _read_or_none(self.home, key, SeqBlock, sealed_by=self.seal_of(key))
            if block is not None:
                out.append((block["first"], block["end"]))
        return out

    # learners beyond the spec's slots ------------------------------------------------
    def put_member(self, learner: str, record: Mapping[str, Any], key: bytes | None) -> bool:
        """Add learner slot ``learner`` to the run in this store's region (a joiner that
        found no vacant slot, ``flows.join``): ``record`` signed with ``key`` (if any),
        written once; False when another joiner's record holds that id."""
        body = sign_record(record, key) if key is not None else dict(record)
        return self._create(self.layout.member(learner), json.dumps(body, sort_keys=True).encode())

    def run_learners(
        self, spec: Mapping[str, Any], key_of: Callable[[str], bytes | None] | None = None,
        regions: Iterable[str] | None = None,
    ) -> RunLearners:  # fmt: skip
        """The run's learners: the spec's slots, then the slots joiners added
        (``put_member``) in ``regions`` (this store's, by default), each record checked:
        named after its learner, a learner id (``learner-N``) the spec does not hold, in
        the bucket of the region it names, which is that id's (``learner_region``: no two
        regions add the same id), and, with ``key_of``
        (learner -> its key, None where nothing is signed), signed with its learner's
        key. A record that is not is refused (``RunLearners.refused`` names its key and
        why), never taken: its learner's contributions are then a stranger's."""
        dealt, deal = run_slots(spec), run_deal(spec)
        found: dict[str, tuple[str, dict[str, Any]]] = {}
        refused: list[str] = []
        folder = self.layout.members_folder()
        for region in self.urls if regions is None else regions:
            bucket = self.bucket(region)
            listed = patiently(partial(bucket.list, folder), f"listing {folder}")
            for name in sorted(listed):
                where = f"{bucket.url}/{folder}/{name}"
                record = self._members.get((region, name))  # written once: read once
                try:
                    record = record or _read_json(bucket, f"{folder}/{name}")
                except FileNotFoundError:
                    continue
                except CorruptVersion as exc:
                    refused.append(f"{where}: {exc}")
                    continue
                self._members[(region, name)] = record
                lid = name.removesuffix(".json")
                why = _member_problem(lid, name, region, record, dealt, deal, key_of)
                if why is not None:
                    refused.append(f"{where}: {why}")
                    continue
                found[lid] = (region, record)
        added = {lid: found[lid] for lid in sorted(found, key=learner_index)}
        return RunLearners(
            {**dealt, **{lid: region for lid, (region, _) in added.items()}},
            {lid: record for lid, (_, record) in added.items()}, refused,
        )  # fmt: skip

    def put_join(
        self, learner: str, record: Callable[[int], bytes], after: int | None = None
    ) -> int | None:
        """Add a join record of ``learner`` (``record(N)``: its signed JSON as join N) in
        this store's region, the learner's own, written once; returns N. With ``after``
        (the newest join its joiner saw when it chose the slot: ``newest_join``) it is
        join ``after + 1`` or none: None when another joiner wrote that one first (the
        slot is theirs), so two joiners racing for one slot never both take it."""
        prefix = self.layout.join_commits(learner)
        if after is None:
            return self.put_next(prefix, record)
        taken = self._claim(self.numbered_claim(prefix, after + 1), record(after + 1))
        return after + 1 if taken else None

    def joins(self, learner: str, region: str | None = None) -> list[dict[str, Any]]:
        """``learner``'s join records in ``region`` (its own), oldest first, as stored:
        check their signatures (``auth.record_verifies``)."""
        prefix = self.layout.join_commits(learner)
        bucket = self.bucket(region or self.client_region)
        keys = [self.numbered_claim(prefix, n) for n in self.claim_numbers(bucket, prefix)]
        found = (_read_or_none(bucket, key, Join, sealed_by=self.seal_of(key)) for key in keys)
        return [r for r in found if r is not None]

    def join_count(self, learner: str, region: str | None = None) -> int:
        """How many join records ``learner``'s slot holds in ``region`` (a listing, no
        record read)."""
        prefix = self.layout.join_commits(learner)
        return len(self.claim_numbers(self.bucket(region or self.client_region), prefix))

    def newest_join(
        self, learner: str, region: str | None = None, after: int = 0,
        key: bytes | None = None,
    ) -> tuple[int, dict[str, Any] | None] | None:  # fmt: skip
        """``learner``'s newest join number and record, read only if that number is above
        ``after`` (one listing otherwise); None if there is none (newer). The record is
        None when it is not a join record (dated ahead, or, given ``key``, not signed with
        it: named in the log): the number is taken all the same."""
        prefix = self.layout.join_commits(learner)
        bucket = self.bucket(region or self.client_region)
        numbers = self.claim_numbers(bucket, prefix)
        if not numbers or numbers[-1] <= after:
            return None
        where = self.numbered_claim(prefix, numbers[-1])
        found = _read_or_none(bucket, where, Join, signed_by=key, sealed_by=self.seal_of(where))
        return numbers[-1], found

    # data units ------------------------------------------------------------------
    def put_unit_record(self, learner: str, record: Mapping[str, Any],
                        after: int | None = None) -> int:  # fmt: skip
        """Add ``record`` (a span taken, or a stream given back) to ``learner``'s data
        ledger in this store's home (its region's bucket), written once; its number.
        ``after``: the newest record number the caller saw (no listing then)."""
        return self.put_next(self.layout.unit_records(learner), lambda n: self._record(record),
                             after)  # fmt: skip

    def put_unit_record_at(self, learner: str, n: int, record: Mapping[str, Any]) -> bool:
        """Write ``record`` as exactly record ``n`` of ``learner``'s data ledger (an
        exclusive create); False when another writer holds that number: a record whose
        meaning depends on the ones before it (a stream given back) is never written
        after one its writer did not read."""
        return self._claim(self.numbered_claim(self.layout.unit_records(learner), n),
                            self._record(record))  # fmt: skip

    def unit_records(self, learner: str, after: int = 0) -> list[tuple[int, Any]]:
        """``learner``'s data ledger records numbered above ``after``, oldest first, as
        stored (JSON: check them)."""
        prefix = self.layout.unit_records(learner)
        numbers = [n for n in self.claim_numbers(self.home, prefix) if n > after]
        keys = [self.numbered_claim(prefix, n) for n in numbers]
        return list(zip(numbers, _read_jsons(self.home, keys, Written, self.seal_of), strict=True))

    def claim_fresh_unit(self, learner: str, after: int | None = None,
                         offer: str | None = None) -> int:  # fmt: skip
        """Claim the next unit no one had (an exclusive create: each unit once); returns
        its claim's number N (the pool's unit N - 1, ``diloco.units.pool_unit``).
        ``after``: the newest claim number the caller saw, to try the next without a
        listing. ``offer``: claimed by a syncer to offer it to that region's learners
        (``offer_unit``), not by ``learner`` to train it."""
        fields = {"learner": learner, **({"offer": offer} if offer else {})}
        return self.put_next(self.layout.units_fresh(), lambda n: self._record(fields), after,
                             dense=True)  # fmt: skip

    def has_fresh_claim(self, n: int) -> bool:
        """Whether fresh claim ``n`` is written (one request)."""
        key = self.numbered_claim(self.layout.units_fresh(), n)
        return patiently(lambda: self.home.exists(key), key)

    def fresh_claims(self) -> list[int]:
        """The numbers of the fresh units' claims (one listing)."""
        return self.claim_numbers(self.home, self.layout.units_fresh())

    def fresh_frontier(self) -> int:
        """The number of fresh claims made in turn from the first (one listing): claims
        are dense (``claim_fresh_unit``), so one beyond a gap was made by no claimer of
        the run and moves no frontier."""
        n = 0
        for claim in self.fresh_claims():
            if claim != n + 1:
                break
            n = claim
        return n

    def unit_claim(self, claim: str) -> Any:
        """The record of a unit's claim as stored (JSON: check it): ``fresh-N`` (fresh
        claim N) or the name of a span given back (``units_returned``)."""
        key = self._claim_key(claim)
        return _read_or_none(self.home, key, Written, sealed_by=self.seal_of(key))

    def _claim_key(self, claim: str) -> str:
        fresh = claim.removeprefix("fresh-")
        if fresh != claim and fresh.isdigit():
            return self.numbered_claim(self.layout.units_fresh(), int(fresh))
        return self.claim_key(self.layout.units_returned(claim))

    def claim_returned(self, claim: str, learner: str, offer: str | None = None) -> bool:
        """Claim span ``claim`` that someone gave back, or that a syncer offered here
        (an exclusive create); False when another learner claimed it first. ``offer``: as
        in ``claim_fresh_unit``."""
        fields = {"learner": learner, **({"offer": offer} if offer else {})}
        return self._claim(self.claim_key(self.layout.units_returned(claim)),
                            self._record(fields))  # fmt: skip

    def returned_claims(self) -> set[str]:
        """The claims of spans given back, taken so far (one listing)."""
        return set(self.claim_names(self.home, self.layout.units_returned_folder()))

    def unit_claims(self, claims: list[str]) -> list[Any]:
        """The records of ``claims`` (as ``unit_claim``), read 64 at a time."""
        return _read_jsons(self.home, [self._claim_key(c) for c in claims], Written, self.seal_of)

    def offer_unit(self, claim: str, record: Mapping[str, Any]) -> bool:
        """Offer a span of another region's pool to this region's learners
        (``units_offered``, an exclusive create); False if it is offered already."""
        return self._claim(self.claim_key(self.layout.units_offered(claim)),
                            self._record(record))  # fmt: skip

    def unit_offers(self, known: Collection[str] = ()) -> dict[str, Any]:
        """The spans offered to this region (claim -> record as stored: check it), but
        those in ``known`` (records are written once: a caller keeps what it read)."""
        claims = sorted(self.offered_claims() - set(known))
        keys = [self.claim_key(self.layout.units_offered(c)) for c in claims]
        return dict(zip(claims, _read_jsons(self.home, keys, Written, self.seal_of), strict=True))

    def offered_claims(self) -> set[str]:
        """The names of the spans offered to this region (one listing)."""
        return set(self.claim_names(self.home, self.layout.units_offered_folder()))

    def newest_generation(self, learner: str) -> int:
        taken = self.claim_numbers(self.home, self.layout.lease_commits(learner))
        return taken[-1] if taken else 0

    def superseded(self, learner: str, generation: int) -> bool:
        """Whether ``learner``'s generation after ``generation`` has been claimed (a fence,
        or a process that took over): a read of that claim's key, never a stale listing."""
        key = self.numbered_claim(self.layout.lease_commits(learner), generation + 1)
        return patiently(lambda: self.home.exists(key), key)

    def generation(self, learner: str, n: int) -> dict[str, Any] | None:
        """The record of ``learner``'s generation ``n`` as stored; None if there is none,
        or it is not one (named in the log)."""
        key = self.numbered_claim(self.layout.lease_commits(learner), n)
        return _read_or_none(self.home, key, Generation, sealed_by=self.seal_of(key))

    def fence(self, learner: str, newest: int, why: str) -> bool:
        """Claim generation ``newest + 1`` of ``learner`` for no process (an exclusive
        create of exactly that number, ``{"fence": why}``): a process holding ``newest``
        (silent, perhaps only cut off) commits nothing more (``check_newest`` reads the
        next number before each commit). False when someone claimed it first: a process
        that started as the learner, or another fence."""
        key = self.numbered_claim(self.layout.lease_commits(learner), newest + 1)
        return self._claim(key, self._record({"fence": why}))

    # contributions ------------------------------------------------------------------
    def put_contribution(
        self,
        learner: str,
        fragment: int,
        seq: int,
        tensors: Mapping[str, QuantizedTensor],
        meta: Mapping[str, Any],
        key: bytes | None = None,
        check: Callable[[], None] | None = None,
    ) -> CommitMarker:
        """Commit contribution ``seq`` of ``learner``'s ``fragment`` (its tensors and JSON
        meta) in this store's region, the learner's own; its marker is signed with ``key``
        (the learner's, ``storage_layout.auth``) if one is given. The objects are those
        ``encode`` makes of ``{"delta": tensors}``, written as ``put_contribution_stream``
        writes them (each tensor one piece). ``check``: called once the objects are up,
        just before the marker is written (it raises if the writer may commit no more)."""
        kind, block_size = group_kind("delta", tensors)

        def whole() -> Iterator[tuple[str, QuantizedTensor]]:
            for name in sorted(tensors):
                q = tensors[name]
                yield name, QuantizedTensor(kind, (q.size,), q.data, q.scales, q.block_size)

        shapes = {name: q.shape for name, q in tensors.items()}
        return self.put_contribution_stream(
            learner, fragment, seq, shapes, kind, block_size, whole, meta, key, check
        )

    def put_contribution_stream(
        self,
        learner: str,
        fragment: int,
        seq: int,
        shapes: Mapping[str, Sequence[int]],
        kind: str,
        block_size: int,
        pieces: Callable[[], Iterable[tuple[str, QuantizedTensor]]],
        meta: Mapping[str, Any],
        key: bytes | None = None,
        check: Callable[[], None] | None = None,
    ) -> CommitMarker:
        """``put_contribution`` of tensors of ``shapes`` given a piece at a time, so the
        learner never holds its whole payload encoded: ``pieces()`` yields ``(name, flat
        piece)`` in ``GroupWriter`` order (names sorted, each tensor's pieces in order) and
        is called twice, giving the same pieces both times. The first pass only hashes
        the chunk objects, for the write id that names the content (``content_write_id``:
        a retried upload rewrites its own prefix and finds its own marker); the second
        uploads them (``ObjectSink``), then the marker is committed. Same objects, write
        id and marker fields as ``put_contribution`` of the same tensors."""
        marker_key = self.layout.contribution_marker(learner, fragment, seq)
        payload = [0]

        def write(put: Callable[[str, bytes], None]) -> None:
            payload[0] = _write_delta(put, shapes, kind, block_size, pieces)

        def body() -> dict[str, Any]:  # made once the objects are up, for the marker
            if check is not None:
                check()
            return {**meta, "learner": learner, "fragment": fragment, "seq": seq,
                    "payload_bytes": payload[0], "written_at": time.time()}  # fmt: skip

        return self._put_by_content(
            marker_key, lambda wid: self.layout.contribution_data(learner, fragment, seq, wid),
            write, "contribution", body, None if key is None else signer(key),
        )  # fmt: skip

    def _put_by_content(
        self,
        marker_key: str,
        data_prefix: Callable[[str], str],
        write: Callable[[Callable[[str, bytes], None]], None],
        kind: str,
        body: Callable[[], dict[str, Any]],
        sign: Callable[[CommitMarker], CommitMarker] | None = None,
    ) -> CommitMarker:
        """Commit at home the objects ``write(put)`` puts, a chunk at a time, under a
        write id that names their content (``content_write_id``: a retried write rewrites
        its own prefix and finds its own marker). ``write`` runs twice and must put the
        same objects both times: the first pass only hashes them (for the id), the second
        uploads them (``ObjectSink``); then the marker (``body()`` its meta) is committed.
        So no writer holds its objects whole, whatever their size."""
        hashed: dict[str, dict[str, Any]] = {}

        def record(rel: str, data: bytes) -> None:
            hashed[rel] = entry(data)

        write(record)
        write_id = content_write_id_of(marker_key, hashed)
        return self._put_streamed(marker_key, data_prefix(write_id), write, kind, body,
                                  write_id, sign, hashed)  # fmt: skip

    def _put_streamed(
        self,
        marker_key: str,
        prefix: str,
        write: Callable[[Callable[[str, bytes], None]], None],
        kind: str,
        body: Callable[[], dict[str, Any]],
        write_id: str,
        sign: Callable[[CommitMarker], CommitMarker] | None = None,
        hashed: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> CommitMarker:
        """Upload what ``write(put)`` puts under ``prefix`` (``ObjectSink``, a chunk at a
        time), then commit the marker; ``hashed``: what a first pass recorded, which
        the upload must match."""
        # Not ObjectSink's context manager: its abort deletes the data prefix, and one a
        # content id names may hold an earlier attempt's committed objects.
        sink = ObjectSink(self.home, prefix)
        try:
            write(sink.put)
            entries = sink.finish()
        except BaseException:
            with contextlib.suppress(Exception):
                sink.finish()  # let the uploads under way end; the failure is the one raised
            raise
        if hashed is not None and entries != hashed:
            differ = sorted(r for r in entries.keys() | hashed.keys()
                            if entries.get(r) != hashed.get(r))  # fmt: skip
            raise ValueError(
                f"{marker_key}: pieces() gave other objects on its second call ({differ[:3]}); "
                "it must give the same pieces both times"
            )
        return commit_marker(self.home, marker_key, prefix, entries, kind, body(),
                             self.writer, write_id, sign=sign)  # fmt: skip

    def revoke_contribution(self, learner: str, fragment: int, seq: int, why: str) -> bool:
        """Hold contribution ``seq`` of ``learner``'s ``fragment`` in this store's home (the
        learner's region) with a ``REVOKED`` marker, an exclusive create, so that a commit
        of it still under way in a fenced process fails (``commit_marker`` finds the key
        held); False when a contribution was committed there first. Every reader of
        contribution markers skips a revoked one (``contribution_head`` raises
        ``Revoked``)."""
        key = self.layout.contribution_marker(learner, fragment, seq)
        write_id = new_write_id()
        marker = CommitMarker(REVOKED, data_prefix_of(key, write_id), {}, self.writer, write_id,
                              {"learner": learner, "fragment": fragment, "seq": seq, "why": why,
                               "time": time.time()})  # fmt: skip
        return self._create(key, marker.to_json()) or read_marker(self.home, key).kind == REVOKED

    def get_contribution(
        self, learner: str, fragment: int, seq: int, region: str, key: bytes | None = None
    ) -> tuple[dict[str, QuantizedTensor], dict[str, Any]]:
        """One committed contribution's tensors and meta, verified against its marker
        (``CorruptVersion`` if anything does not match). With ``learner``'s ``key``, the
        marker must be signed with it (``Unauthenticated``, before any data is fetched)."""
        marker = self.contribution_head(learner, fragment, seq, region, key)
        return self.contribution_tensors(marker, learner, fragment, seq, region), dict(marker.meta)

    def contribution_head(
        self, learner: str, fragment: int, seq: int, region: str, key: bytes | None = None
    ) -> CommitMarker:
        """A committed contribution's marker, without its data: signed with ``key`` if one
        is given (``Unauthenticated``) and describing this very contribution
        (``CorruptVersion``). A reader that finds a newer one from the same anchor need
        not read this one's data at all."""
        where = self.layout.contribution_marker(learner, fragment, seq)
        marker = read_marker(self.bucket(region), where)
        if marker.kind == REVOKED:
            raise Revoked(f"{where}: revoked by {marker.writer} ({marker.meta.get('why')})")
        if key is not None:
            verify(marker, key, learner, where)
        m = marker.meta
        if (m.get("learner"), m.get("fragment"), m.get("seq")) != (learner, fragment, seq):
            raise CorruptVersion(f"{where}: marker describes another contribution ({m})")
        return marker

    def contribution_tensors(
        self, marker: CommitMarker, learner: str, fragment: int, seq: int, region: str
    ) -> dict[str, QuantizedTensor]:
        """The tensors a contribution's ``marker`` (from ``contribution_head``) lists,
        each object checked against it."""
        where = self.layout.contribution_marker(learner, fragment, seq)
        return read_groups(self.bucket(region), marker, where, ("delta",))["delta"]

    def contribution_meta(self, learner: str, fragment: int, seq: int, region: str) -> dict:
        """The meta of one committed contribution's marker (no tensors are read)."""
        key = self.layout.contribution_marker(learner, fragment, seq)
        return dict(read_marker(self.bucket(region), key).meta)

    # global versions ----------------------------------------------------------------
    @staticmethod
    def global_objects(
        params: Mapping[str, np.ndarray],
        opt_leaves: list[np.ndarray],
        meta: Mapping[str, Any],
        wire_dtype: str = "fp32",
        wire: Mapping[str, np.ndarray] | None = None,
        delta: Mapping[str, QuantizedTensor] | None = None,
    ) -> dict[str, bytes]:
        """A global version: fp32 ``params`` and ``opt`` (what a restarted syncer needs) and
        ``wire``, the learners' full copy in the dtype they download (default: ``params``
        rounded to it), and optionally ``delta``, the compact update that turns the
        learners' copy of version ``meta["delta_base"]`` into this one."""
        opt = _opt_group(opt_leaves)
        groups = {
            "params": _fp32(params),
            "opt": opt,
            "wire": {n: quantize(v, wire_dtype) for n, v in (wire or params).items()},
        }
        if delta is not None:
            groups["delta"] = dict(delta)
        return encode(groups, {"kind": "global", "wire_dtype": wire_dtype, **meta})

    def publish_global(
        self,
        fragment: int,
        version: int,
        params: Mapping[str, np.ndarray],
        opt_leaves: list[np.ndarray],
        meta: Mapping[str, Any],
        wire_dtype: str = "fp32",
        wire: Mapping[str, np.ndarray] | None = None,
        delta: Mapping[str, QuantizedTensor] | None = None,
        delta_base: int | None = None,
    ) -> PublishReport:
        """Commit version ``version`` of ``fragment`` at home (the arbiter), then everywhere
        (``global_objects`` says what a version holds; ``delta`` turns the learners' copy
        of version ``delta_base`` into this one's).

        Raises ``CommitConflict`` if another syncer already holds this version at home.
        """
        meta = {"fragment": fragment, "version": version, **meta}
        if delta is not None:
            meta["delta_base"] = delta_base if delta_base is not None else version - 1
        objects = self.global_objects(params, opt_leaves, meta, wire_dtype, wire, delta)
        write_id = new_write_id()
        report = PublishReport(version)

        def commit_in(region: str) -> None:
            commit_version(
                self.bucket(region),
                self.layout.global_marker(fragment, version),
                self.layout.global_data(fragment, version, write_id),
                objects if region == self.client_region else learner_view(objects),
                "global",
                meta,
                self.writer,
                write_id,
            )
            self.point_latest(region, fragment, version, write_id)

        commit_in(self.client_region)  # the arbiter: a conflict here means we lost the race
        others = [r for r in self.urls if r != self.client_region]
        return self.commit_elsewhere(fragment, commit_in, others, report)

    def commit_elsewhere(
        self,
        fragment: int,
        commit_in: Callable[[str], None],
        others: Sequence[str],
        report: PublishReport,
    ) -> PublishReport:
        """After a version committed at home: ``commit_in`` each of ``others`` at once;
        one that fails is ``lagging`` (caught up later by ``sync_regions``), never an
        error of the version's."""
        report.committed.append(self.client_region)
        with ThreadPoolExecutor(max_workers=max(1, len(others))) as pool:
            futures = {region: pool.submit(commit_in, region) for region in others}
        for region, future in futures.items():
            exc = future.exception()
            if exc is None:
                report.committed.append(region)
            elif isinstance(exc, CommitConflict):
                report.lagging[region] = "holds another write of this version"
            elif isinstance(exc, OSError):
                report.lagging[region] = f"unreachable: {exc}"
                log.warning("region %s is behind on fragment %d: %s", region, fragment, exc)
            else:
                raise exc
        return report

    def get_global(
        self,
        fragment: int,
        version: int,
        region: str | None = None,
        learner_view: bool = False,
        collect: Callable[[Iterator[tuple[str, np.ndarray]]], Mapping[str, Any]] | None = None,
    ) -> GlobalState:
        """A verified global version. ``learner_view`` fetches only the ``wire`` parameters
        (what a learner applies), not the fp32 master copy and the optimizer state; with
        ``collect``, they are handed to it one tensor at a time as ``(name,
        TensorPieces)``, each read and decoded to float32 a piece at a time, and its result
        is the version's parameters (a learner spills them to a local file:
        ``storage_layout.spill``), so the process never holds them all, nor a whole
        tensor."""
        bucket = self.bucket(region or self.client_region)
        key = self.layout.global_marker(fragment, version)
        marker = read_marker(bucket, key)
        if learner_view and collect is not None:
            params = collect(decoded_pieces(bucket, marker, key, WIRE[0]))
            return GlobalState(fragment, version, params, [], dict(marker.meta), [])
        if not learner_view and "params/zarr.json" not in marker.objects:
            raise CorruptVersion(
                f"{bucket.url}/{key} holds the learner view only; the master copy and the "
                f"optimizer state are in the syncer's home region"
            )
        groups = read_decoded(bucket, marker, key, WIRE if learner_view else ("params", "opt"))
        params = groups["wire"] if learner_view else groups["params"]
        opt_names = [] if learner_view else sorted(groups["opt"])
        opt = [groups["opt"][k] for k in opt_names]
        return GlobalState(fragment, version, params, opt, dict(marker.meta), opt_names)

    def get_global_delta(
        self, fragment: int, version: int, region: str | None = None
    ) -> tuple[int, VersionReader, dict] | None:
        """A version's compact update as learners read it: (the version it applies to, a
        reader of its ``delta`` group, the marker's meta); None if it was published whole
        only. The marker and the group's index are checked here; the values are read (and
        each chunk checked) as the caller asks for them, a range at a time, the next chunks
        read ahead meanwhile."""
        bucket = self.bucket(region or self.client_region)
        key = self.layout.global_marker(fragment, version)
        marker = read_marker(bucket, key)
        if "delta/zarr.json" not in marker.objects or "delta_base" not in marker.meta:
            return None
        with _named_damage(key):
            reader = VersionReader(bucket, marker, key, ahead=PARALLEL)  # read in order
            reader.index("delta")
            base = marker.meta["delta_base"]
            if not isinstance(base, int) or isinstance(base, bool):
                raise ValueError(f"delta_base is {base!r}, not a version number")
        return base, reader, dict(marker.meta)

    def point_latest(self, region: str, fragment: int, version: int, write_id: str) -> None:
        """Overwrite the advisory ``globals/f{P}/latest.json`` in ``region`` after ``version``
        committed there: a hint for tools that would rather not list ``commits/``. The
        markers stay the truth (the pointer may lag, or name a version retention has since
        deleted), so nothing of ours reads it, and a failed write is logged, never raised."""
        key = self.layout.global_latest(fragment)
        body = {"fragment": fragment, "version": version,
                "marker": self.layout.global_marker(fragment, version),
                "data_prefix": self.layout.global_data(fragment, version, write_id),
                "writer": self.writer, "written_at": time.time(),
                "note": "advisory: the newest marker under commits/ is the truth"}  # fmt: skip
        try:
            self.bucket(region).put(key, json.dumps(body, sort_keys=True).encode())
        except Exception as exc:  # an advisory object never fails the commit behind it
            log.warning("could not update %s in region %s: %s", key, region, exc)

    def global_marker(self, fragment: int, version: int, region: str | None = None) -> CommitMarker:
        return read_marker(
            self.bucket(region or self.client_region), self.layout.global_marker(fragment, version)
        )

    def sync_regions(self, fragment: int) -> dict[str, int]:
        """Copy the home region's newest version of ``fragment`` to regions that lag.

        The objects are copied as committed (verified first), under the same write id, so
        every region holds byte-identical versions. Returns region -> version copied;
        regions still down are left for the next call.
        """
        newest = self.latest_global(fragment)
        copied: dict[str, int] = {}
        if newest is None:
            return copied
        key = self.layout.global_marker(fragment, newest)
        marker: CommitMarker | None = None
        for region in self.urls:
            if region == self.client_region:
                continue
            try:
                theirs = self.latest_global(fragment, region)
                if theirs is not None and theirs >= newest:
                    continue
                marker = marker or read_marker(self.home, key)
                self._copy_version(marker, key, region)
                self.point_latest(region, fragment, newest, marker.write_id)
                copied[region] = newest
            except (OSError, CommitConflict) as exc:
                log.warning("region %s still behind on fragment %d: %s", region, fragment, exc)
        return copied

    def _copy_version(self, marker: CommitMarker, key: str, region: str) -> None:
        """Copy a version's learner view from home to ``region`` object by object (each
        checked against the marker as it is read; a few uploads in flight), then its
        marker: a copy of any size in a few chunks' memory."""
        target = self.bucket(region)
        wanted = [rel for rel in marker.objects
                  if "/" not in rel or rel.split("/", 1)[0] in LEARNER_GROUPS]  # fmt: skip
        with ObjectSink(target, marker.data_prefix) as sink:
            for rel in wanted:
                sink.put(rel, checked_object(self.home, marker, key, rel))
            entries = sink.finish()
        commit_marker(target, key, marker.data_prefix, entries, "global", marker.meta,
                      self.writer, marker.write_id)  # fmt: skip

    # checkpoints and metrics ----------------------------------------------------------
    def put_checkpoint(
        self,
        learner: str,
        step: int,
        tensors: Mapping[str, Mapping[str, np.ndarray]],
        meta: Mapping[str, Any],
    ) -> CommitMarker:
        """Commit a learner checkpoint: named groups of float32 arrays plus JSON ``meta``,
        written a chunk at a time in one pass (``_put_streamed``): the objects ``encode``
        makes of them, never all held at once beside the arrays. A group that is
        ``Tensors`` (``shapes`` and ``piece``, like a learner's sharded optimizer state) is
        read a piece at a time, so not even its arrays are held whole. The write id is
        random, not the content's (a contribution's): naming the content takes a first
        pass over the whole state, 2.7 times the seconds of one at 1 B (``bench/hosts``),
        and a writer asked again finds the step committed (``checkpoint_steps``) or, if
        its lost answer races it, a ``CommitConflict`` that removes only its own copy."""

        def write(put: Callable[[str, bytes], None]) -> None:
            for rel, blob in root_objects({"kind": "checkpoint"}).items():
                put(rel, blob)
            for gname, group in tensors.items():
                if hasattr(group, "piece"):
                    _write_streamed(put, gname, group)
                else:
                    write_group(put, gname, _fp32(group))

        write_id = new_write_id()
        return self._put_streamed(
            self.layout.checkpoint_marker(learner, step),
            self.layout.checkpoint_data(learner, step, write_id), write, "checkpoint",
            lambda: {"learner": learner, "step": step, **meta}, write_id,
        )  # fmt: skip

    # A checkpoint in parts: each host of a learner writes its own part (``put_checkpoint_
    # part``), the leader commits them as one checkpoint (``commit_checkpoint_parts``).
    def put_checkpoint_part(
        self,
        learner: str,
        step: int,
        write_id: str,
        part: int,
        tensors: Any,
        slices: Mapping[str, Mapping[str, Any]],
    ) -> None:
        """Write host ``part``'s share of checkpoint ``learner@step``: its float32
        ``tensors`` (``Tensors``: its shards of the optimizer state, a chunk at a time) as
        group ``opt.p{part}`` under the data prefix of write ``write_id``, then its
        manifest (``checkpoint_part_key``): an uncommitted marker listing the part's
        objects, with ``slices`` (each tensor's ``{"leaf", "index"}``: which leaf and which
        box of it) as meta. Nothing is committed: a part the leader never commits is an
        orphan, swept like any other."""
        prefix = self.layout.checkpoint_data(learner, step, write_id)
        gname = checkpoint_part_group(part)
        sink = ObjectSink(self.home, prefix)
        try:
            _write_streamed(sink.put, gname, tensors)
            entries = sink.finish()
        except BaseException:
            with contextlib.suppress(Exception):
                sink.finish()
            raise
        manifest = CommitMarker("checkpoint-part", prefix, entries, self.writer, write_id,
                                {"part": part, "slices": {k: dict(v) for k, v in slices.items()}})  # fmt: skip
        key = f"{prefix}/{checkpoint_part_key(part)}"
        patiently(lambda: self.home.put(key, manifest.to_json()), key)

    def commit_checkpoint_parts(
        self,
        learner: str,
        step: int,
        write_id: str,
        parts: int,
        meta: Mapping[str, Any],
        timeout: float = 600.0,
        poll: float = 0.1,
    ) -> CommitMarker:
        """Commit checkpoint ``learner@step`` made of ``parts`` hosts' parts of write
        ``write_id``, once every part's manifest is there (``TimeoutError`` after
        ``timeout`` seconds: a host that died takes its learner down with it). Each
        manifest is checked before it is taken: its write, part number and data prefix,
        its objects inside its own group. The marker lists every part's objects and
        manifest, so verifying and auditing read it like any checkpoint, and its meta
        maps each part's tensors to their leaf and box (``parts``)."""
        prefix = self.layout.checkpoint_data(learner, step, write_id)
        deadline = time.monotonic() + timeout
        entries: dict[str, dict[str, Any]] = {}
        boxes: dict[str, dict[str, Any]] = {}
        for part in range(parts):
            rel = checkpoint_part_key(part)
            key = f"{prefix}/{rel}"
            while True:
                try:
                    raw = patiently(lambda: self.home.get(key, MAX_PART_BYTES), key)  # noqa: B023
                    break
                except FileNotFoundError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"checkpoint {learner}@{step}: part {part} of {parts} was not "
                            f"written within {timeout:.0f} s ({key} is missing)"
                        ) from None
                    time.sleep(poll)
            got = _checked_part(CommitMarker.from_json(raw, key), key, prefix, write_id, part)
            entries.update(got.objects)
            entries[rel] = entry(raw)
            boxes[checkpoint_part_group(part)] = got.meta["slices"]
        root = root_objects({"kind": "checkpoint"})
        put_patiently(self.home, {f"{prefix}/{rel}": blob for rel, blob in root.items()}, prefix)
        entries.update({rel: entry(blob) for rel, blob in root.items()})
        body = {"learner": learner, "step": step, **meta, "parts": boxes}
        return commit_marker(self.home, self.layout.checkpoint_marker(learner, step), prefix,
                             entries, "checkpoint", body, self.writer, write_id)  # fmt: skip

    def get_checkpoint(
        self, learner: str, step: int
    ) -> tuple[dict[str, dict[str, np.ndarray]], dict]:
        key = self.layout.checkpoint_marker(learner, step)
        marker = read_marker(self.home, key)
        return read_decoded(self.home, marker, key), marker.meta

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
        for pair, t in self.traffic.as_dict().items():
            acc = traffic.setdefault(pair, {"bytes": 0, "requests": 0})
            acc["bytes"] += t["bytes"]
            acc["requests"] += t["requests"]
        body = {
            "traffic": traffic,
            "bytes_up": old.get("bytes_up", 0) + self.traffic.uploaded,
            "bytes_down": old.get("bytes_down", 0) + self.traffic.downloaded,
            **{k: old.get(k, 0) + v for k, v in (totals or {}).items()},
            **record,
        }
        data = json.dumps(body, sort_keys=True).encode()
        patiently(lambda: self.home.put(self.layout.metrics(name), data), f"metrics of {name}")

    def read_metrics(self, name: str, region: str | None = None) -> dict[str, Any] | None:
        """A writer's metrics object, or None if it has written none yet, or it is not
        one (named in the log)."""
        bucket = self.bucket(region or self.client_region)
        return _read_or_none(bucket, self.layout.metrics(name), Status, STATUS_BYTES)

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

    # heartbeats -------------------------------------------------------------------------
    def write_heartbeat(self, beat: Mapping[str, Any], key: bytes | None = None) -> None:
        """Rewrite a learner's heartbeat at home (``storage_layout.heartbeat``), signed
        with ``key`` if given."""
        heartbeat.write(self.home, self.layout, beat, key)

    def read_heartbeat(
        self, learner: str, region: str | None = None, key: bytes | None = None
    ) -> heartbeat.Heartbeat | None:
        """``learner``'s heartbeat in ``region``, checked (given ``key``, its signature
        too); None when there is none or it does not read."""
        bucket = self.bucket(region or self.client_region)
        return heartbeat.read(bucket, self.layout, learner, key)

    # learners' round history ------------------------------------------------------------
    def put_round(self, learner: str, round_number: int, row: Mapping[str, Any]) -> bool:
        """Add round ``round_number`` of ``learner`` (its table row: loss, tokens, tokens/s,
        staleness, merge weight, bytes...) to its history in this store's region, the
        learner's own: an exclusive create, never overwritten. True if the stored row is
        this one (also when an earlier attempt landed and only its answer was lost);
        False if the round was already recorded by another write (an earlier process of
        the learner ran it before a restart set the learner back: the first row stays)."""
        key = self.layout.history_entry(learner, round_number)
        fields = {**row, "format": HISTORY_FORMAT, "learner": learner, "round": round_number,
                  "writer": self.writer}  # fmt: skip
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
        region = region or self.client_region
        return self._numbers(self.bucket(region), self.layout.history(learner), "s")

    def get_rounds(
        self, learner: str, rounds: Sequence[int], region: str | None = None
    ) -> tuple[list[dict[str, Any]], list[str]]:
        """Rows ``rounds`` of ``learner``'s history (concurrently where the bucket can) and
        the problems met: a row that is missing, does not parse, or describes another
        round is skipped and named (``key: why``), never raised."""
        bucket = self.bucket(region or self.client_region)
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


def read_groups(
    bucket: Bucket, marker: CommitMarker, key: str, groups: Sequence[str] | None = None
) -> dict[str, dict[str, QuantizedTensor]]:
    """The named groups (default: all) of the version ``marker`` commits, tensor by
    tensor: each chunk object fetched and checked as it is read (``stream.VersionReader``),
    so what is held is the tensors themselves, never the objects besides them.
    ``CorruptVersion`` names what does not read."""
    try:
        reader = VersionReader(bucket, marker, key)
        return {g: reader.tensors(g) for g in (reader.groups() if groups is None else groups)}
    except (FormatError, KeyError, ValueError) as exc:
        if isinstance(exc, CorruptVersion):
            raise
        raise CorruptVersion(f"{key}: {exc}") from exc


def read_decoded(
    bucket: Bucket, marker: CommitMarker, key: str, groups: Sequence[str] | None = None
) -> dict[str, dict[str, np.ndarray]]:
    """``read_groups``, each tensor decoded to float32 as it arrives (while the next ones
    are fetched), its stored form dropped at once: what is held is the float32 values."""
    with _named_damage(key):
        reader = VersionReader(bucket, marker, key)
        names = reader.groups() if groups is None else groups
        out = {}
        for g in names:
            got = dict(decoded_each(bucket, marker, key, g, reader))
            out[g] = {n: got[n] for n in reader.index(g)}  # in the group's own order
        return out


def decoded_each(
    bucket: Bucket, marker: CommitMarker, key: str, group: str, reader: VersionReader | None = None
) -> Iterator[tuple[str, np.ndarray]]:
    """Group ``group``'s tensors, each decoded to float32 as it arrives, in the order they
    lie in the group (``VersionReader.each``): the caller holds one at a time."""
    with _named_damage(key):
        for name, q in (reader or VersionReader(bucket, marker, key)).each(group):
            yield name, dequantize(q, owned=True)  # (read here: ours to give away)


class TensorPieces(Pieces):
    """Tensor ``name`` of group ``group`` of a version, read and decoded to float32 a
    piece of at most ``PIECE_VALUES`` at a time (``diloco.quantize.Pieces``; or kept as
    bfloat16 where it is stored so: ``exact_pieces``). A damaged object is
    ``CorruptVersion`` naming the version's key."""

    def __init__(self, reader: VersionReader, key: str, group: str, name: str,
                 shape: tuple[int, ...], block: int):  # fmt: skip
        self.reader, self.key, self.group, self.name = reader, key, group, name
        self.shape, self.step = shape, piece_step(block)

    def pieces(self) -> Iterator[np.ndarray]:
        return self._pieces(dequantize)

    def exact_pieces(self) -> Iterator[np.ndarray]:
        return self._pieces(exact_values)

    def _pieces(self, decode: Callable[..., np.ndarray]) -> Iterator[np.ndarray]:
        n = math.prod(self.shape)
        with _named_damage(self.key):
            for start in range(0, n, self.step):
                q = self.reader.read(self.group, self.name, start, min(n, start + self.step))
                yield decode(q, owned=True).reshape(-1)  # (read here: ours)


def decoded_pieces(
    bucket: Bucket, marker: CommitMarker, key: str, group: str
) -> Iterator[tuple[str, TensorPieces]]:
    """Group ``group``'s tensors in the order they lie in it, each as ``TensorPieces``
    (read when its pieces are asked for, the next chunks read ahead meanwhile)."""
    with _named_damage(key):
        reader = VersionReader(bucket, marker, key, ahead=PARALLEL)  # read in order
        index = reader.index(group)
        for name in reader.in_order(group):
            info = index[name]
            yield name, TensorPieces(reader, key, group, name, tuple(info.shape), info.block_size)


@contextlib.contextmanager
def _named_damage(key: str) -> Iterator[None]:
    """A malformed stored object read under ``key`` raised as ``CorruptVersion`` naming it."""
    try:
        yield
    except (FormatError, KeyError, ValueError) as exc:
        if isinstance(exc, CorruptVersion):
            raise
        raise CorruptVersion(f"{key}: {exc}") from exc


@dataclass(frozen=True)
class RunLearners:
    """``RunStore.run_learners``: learner id -> region (the spec's slots first, then the
    added ones by index), the added slots' records, and the records refused, each named."""

    regions: dict[str, str]
    added: dict[str, dict[str, Any]]
    refused: list[str]


def _member_problem(
    lid: str, name: str, region: str, record: Any, dealt: Mapping[str, str],
    deal: list[str] | None, key_of: Callable[[str], bytes | None] | None,
) -> str | None:  # fmt: skip
    """Why a member record (``RunStore.run_learners``) is not to be taken, or None."""
    try:
        learner_index(lid)
        check_name("learner", lid)
    except ValueError as exc:
        return f"{name} does not name a learner ({exc})"
    if not name.endswith(".json"):
        return f"{name} is not a member record (LEARNER.json)"
    if not isinstance(record, dict):
        return f"not a member record: {record!r:.120}"
    if record.get("learner") != lid or record.get("region") != region:
        return (f"it names learner {record.get('learner')!r} in region "
                f"{record.get('region')!r}, not {lid!r} in {region!r} where it lies")  # fmt: skip
    if lid in dealt:
        return f"{lid} is a slot of the run's spec (in region {dealt[lid]!r})"
    if dealt and learner_region(lid, dealt, deal) != region:
        return f"{lid} is a learner of region {learner_region(lid, dealt, deal)!r}, not {region!r}"
    key = key_of(lid) if key_of is not None else None
    if key is not None and not record_verifies(record, key):
        return f"it is not signed with {lid}'s key (forged, or the key of another run)"
    return None


def _read_json(
    bucket: Bucket, key: str, kind: type[Record] = Record, limit: int = record.SMALL,
    signed_by: bytes | None = None, sealed_by: bytes | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The ``kind`` of record at ``key``, as stored (``storage_layout.record.read_body``:
    ``FileNotFoundError`` or a named ``BadRecord``)."""
    return record.read_body(bucket, key, kind, limit, signed_by, sealed_by)


def _read_or_none(bucket: Bucket, key: str, kind: type[Record] = Record,
                  limit: int = record.SMALL, signed_by: bytes | None = None,
                  sealed_by: bytes | None = None) -> Any:  # fmt: skip
    """``_read_json``, with a missing record and a bad one (named in the log) None."""
    try:
        return _read_json(bucket, key, kind, limit, signed_by, sealed_by)
    except FileNotFoundError:
        return None
    except record.BadRecord as exc:
        log.warning("ignored: %s", exc)
        return None


def _read_jsons(bucket: Bucket, keys: list[str], kind: type[Record] = Record,
                sealed_by: Callable[[str], bytes | None] = lambda key: None,
                batch: int = 64) -> list[dict[str, Any] | None]:  # fmt: skip
    """``kind`` records, read ``batch`` at a time concurrently (``Bucket.get_many``: one
    round trip each, not one per object, over S3 or GCS); one that does not read is read
    again alone, and None (named in the log) if it stays bad. ``sealed_by``: the key that
    seals the claim at a key (``RunStore.seal_of``)."""
    out: list[dict[str, Any] | None] = []
    for i in range(0, len(keys), batch):
        part = keys[i : i + batch]
        try:
            got = get_patiently(bucket, part, f"{len(part)} objects from {part[0]}",
                                record.SMALL)  # fmt: skip
        except (PartialFailure, Refused):
            got = {}  # each read alone
        for key in part:
            try:
                body = json.loads(got[key])
                record.check(body, key, kind, sealed_by=sealed_by(key))
                out.append(body)
            except (KeyError, ValueError, RecursionError):
                out.append(_read_or_none(bucket, key, kind, sealed_by=sealed_by(key)))
    return out


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
