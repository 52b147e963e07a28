"""Authenticated contributions: who may write a learner's contributions into a bucket.

Bucket permissions say who can write to a region; they do not say which learner wrote a
contribution. So each learner signs its contribution markers with a key of its own, and
a syncer rejects a marker whose signature is missing or does not verify.

- The **run secret** (``DILOCO_RUN_SECRET``) is held by the syncers and the launcher.
- A **learner's key** is ``HMAC-SHA256(secret, "{run}/{learner}")``: a learner process
  gets only its own (``DILOCO_LEARNER_KEY``, hex), so it cannot sign for another learner,
  nor for the same learner id in another run. A process that holds the secret derives
  any learner's key.
- The **signature** is an HMAC-SHA256 with the learner's key over the marker's canonical
  JSON without the signature field: kind, data prefix, every object with its size and
  sha256, writer, write id and meta. A reader checks each object against the marker's
  sha256, so the signature authenticates the data as well.

- The **claims key** is ``HMAC-SHA256(secret, "diloco-claims/{run}")``, held by every
  process of the run (``DILOCO_CLAIMS_KEY``, hex, for a learner or a joiner). A claim is
  an object whose existence is the claim, made by an exclusive create: a generation, a
  block of seqs, a data unit, a span given back, a record of a learner's data ledger, a
  join, the run lock. Its key ends in a tag, ``{base}.{tag}.json`` with ``tag`` the
  first 16 hex digits of ``HMAC(claims key, base)`` (``claim_tag``), so whoever holds no
  key cannot name a claim before it is made: a forged object at the next number is not
  that number's claim, and neither blocks a take nor skips what it would have claimed.
  A reader with the key passes over every object whose tag is not its own. A claim's
  JSON is **sealed** too (``seal``: an HMAC of its canonical JSON under a key of its own,
  ``seal_key(claims key, base)``), so one overwritten by someone without the key, or
  copied to another claim's key, reads as no claim.

The keys are symmetric: a syncer holding the secret could sign for any learner. They keep
out whoever can write to a bucket but holds no key (a leaked bucket credential, another
tenant of the bucket, a misrouted job), not a syncer. Global versions and checkpoints are
not signed.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from storage_layout.commit import CommitMarker, CorruptVersion

RUN_SECRET_ENV = "DILOCO_RUN_SECRET"
LEARNER_KEY_ENV = "DILOCO_LEARNER_KEY"
CLAIMS_KEY_ENV = "DILOCO_CLAIMS_KEY"
ALGORITHM = "hmac-sha256"
MIN_SECRET_CHARS = 16
KEY_BYTES = 32  # an HMAC-SHA256 digest
UNAUTHENTICATED = (
    "contributions are not authenticated: whoever can write to a region's bucket can add "
    f"contributions in any learner's name. Set {RUN_SECRET_ENV} for the syncers and give "
    f"each learner its {LEARNER_KEY_ENV} (diloco train does both; see docs/deploy.md, "
    "'Authenticated contributions')"
)


class Unauthenticated(CorruptVersion):
    """A contribution marker that is unsigned, or whose signature does not verify with
    its learner's key: not written by that learner (forged or tampered)."""


def new_run_secret() -> str:
    """A fresh run secret: 256 random bits, hex."""
    return secrets.token_hex(32)


def check_secret(secret: str, source: str = RUN_SECRET_ENV) -> str:
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(
            f"the run secret in {source} has {len(secret)} characters; use at least "
            f"{MIN_SECRET_CHARS} "
            "(python -c 'import secrets; print(secrets.token_hex(32))' makes one)"
        )
    return secret


class SecretMismatch(ValueError):
    """A run secret that is not the one the run started with (its fingerprint differs
    from the one stored in the run): every genuine contribution would be rejected."""


def secret_fingerprint(secret: str, run: str) -> str:
    """What a run stores of its secret: HMAC-SHA256(secret, "diloco-fingerprint/{run}"),
    hex. It tells a changed secret from the original without revealing it."""
    message = f"diloco-fingerprint/{run}".encode()
    return hmac.new(check_secret(secret).encode(), message, hashlib.sha256).hexdigest()


def learner_key(secret: str, run: str, learner: str) -> bytes:
    """``learner``'s key in ``run``: HMAC-SHA256(secret, "{run}/{learner}")."""
    message = f"{run}/{learner}".encode()
    return hmac.new(check_secret(secret).encode(), message, hashlib.sha256).digest()


def claims_key(secret: str, run: str) -> bytes:
    """The key that tags ``run``'s claims: HMAC-SHA256(secret, "diloco-claims/{run}")."""
    message = f"diloco-claims/{run}".encode()
    return hmac.new(check_secret(secret).encode(), message, hashlib.sha256).digest()


def claim_tag(key: bytes, base: str) -> str:
    """The tag of the claim at ``base`` (its key without the tag and ``.json``): the first
    16 hex digits of HMAC-SHA256(key, base)."""
    return hmac.new(key, base.encode(), hashlib.sha256).hexdigest()[:16]


def parse_key(text: str, source: str = LEARNER_KEY_ENV) -> bytes:
    """A learner key from its hex form (as ``diloco train`` passes it)."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise ValueError(f"{source} is not a learner key ({2 * KEY_BYTES} hex digits)")
    return key


def signed_content(marker: CommitMarker) -> bytes:
    """What a signature covers: the marker as stored, without its signature, as canonical
    JSON. It goes through the marker's own JSON first, so the writer (with tuples, say) and
    a reader (with lists) sign and check the same bytes."""
    body = json.loads(marker.to_json())
    body.pop("signature", None)
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def signature(marker: CommitMarker, key: bytes) -> str:
    return hmac.new(key, signed_content(marker), hashlib.sha256).hexdigest()


def sign(marker: CommitMarker, key: bytes) -> CommitMarker:
    """``marker`` with its signature under ``key``."""
    return replace(marker, signature={"alg": ALGORITHM, "value": signature(marker, key)})


def signer(key: bytes) -> Callable[[CommitMarker], CommitMarker]:
    """``commit_version``'s ``sign`` hook for ``key``."""
    return lambda marker: sign(marker, key)


def verify(marker: CommitMarker, key: bytes, learner: str, where: str) -> None:
    """Raise ``Unauthenticated`` (naming ``where``, the marker's key, and ``learner``)
    unless ``marker`` carries a signature that verifies with ``learner``'s ``key``."""
    sig = marker.signature
    if sig is None:
        raise Unauthenticated(
            f"{where}: unsigned, but this syncer requires {learner}'s signature: not written "
            f"with {learner}'s key (forged, or {learner} runs without {LEARNER_KEY_ENV})"
        )
    if sig.get("alg") != ALGORITHM:
        raise Unauthenticated(f"{where}: signed with {sig.get('alg')!r}, not {ALGORITHM}")
    if not hmac.compare_digest(sig.get("value", "").encode(), signature(marker, key).encode()):
        raise Unauthenticated(
            f"{where}: signature does not verify: not written by {learner}'s key "
            "(forged or tampered)"
        )


@dataclass(frozen=True)
class Keys:
    """The key material one process holds for ``run``.

    A syncer (or the launcher, or a simulation) holds the run ``secret``: it derives every
    learner's key, so it signs for any learner and verifies all of them. A learner process
    holds only its own ``key`` and the run's ``claims`` key. With neither, nothing is
    signed or verified.
    """

    run: str
    secret: str | None = field(default=None, repr=False)  # never in a log line
    learner: str | None = None
    key: bytes | None = field(default=None, repr=False)
    claims: bytes | None = field(default=None, repr=False)

    @property
    def claims_key(self) -> bytes | None:
        """The key that tags the run's claims (None: they are not tagged)."""
        return claims_key(self.secret, self.run) if self.secret is not None else self.claims

    def signing_key(self, learner: str) -> bytes | None:
        if self.secret is not None:
            return learner_key(self.secret, self.run, learner)
        return self.key if learner == self.learner else None

    def verifying_key(self, learner: str) -> bytes | None:
        """``learner``'s key if contributions must be signed (this process has the secret)."""
        return None if self.secret is None else learner_key(self.secret, self.run, learner)

    @property
    def verifies(self) -> bool:
        return self.secret is not None

    @classmethod
    def from_env(
        cls, run: str, learner: str | None = None, environ: Mapping[str, str] | None = None
    ) -> Keys:
        """Keys from ``DILOCO_RUN_SECRET`` or, for the process of ``learner``,
        ``DILOCO_LEARNER_KEY`` and ``DILOCO_CLAIMS_KEY`` (one without the other is an
        error). A learner key that is not ``learner``'s under the secret (both set) is an
        error now rather than every contribution rejected later."""
        env = os.environ if environ is None else environ
        secret = env.get(RUN_SECRET_ENV) or None
        if secret is not None:
            check_secret(secret)
        raw = env.get(LEARNER_KEY_ENV) or None
        if learner is None or raw is None:
            return cls(run, secret, learner)
        key = parse_key(raw)
        if secret is not None:
            if not hmac.compare_digest(key, learner_key(secret, run, learner)):
                raise ValueError(f"{LEARNER_KEY_ENV} is not {learner}'s key in run {run!r} "
                                 f"under {RUN_SECRET_ENV}")  # fmt: skip
            return cls(run, secret, learner, key)
        if not env.get(CLAIMS_KEY_ENV):
            raise ValueError(f"{LEARNER_KEY_ENV} is set but {CLAIMS_KEY_ENV} is not: a learner "
                             "needs both (`diloco train` and `diloco join` set them)")  # fmt: skip
        return cls(run, None, learner, key, parse_key(env[CLAIMS_KEY_ENV], CLAIMS_KEY_ENV))


def run_secret(
    path: Path | None, environ: Mapping[str, str] | None = None
) -> tuple[str | None, str]:
    """The run secret and where it comes from: ``DILOCO_RUN_SECRET`` if set, else the
    file ``path``, created (mode 0600, exclusively) with a new secret on first use, so a
    resumed run signs with the keys it started with; else (no ``path``) none."""
    env = os.environ if environ is None else environ
    if env.get(RUN_SECRET_ENV):
        return check_secret(env[RUN_SECRET_ENV]), RUN_SECRET_ENV
    if path is None:
        return None, ""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return check_secret(path.read_text().strip(), str(path)), str(path)
    secret = new_run_secret()
    with os.fdopen(fd, "w") as out:
        out.write(secret + "\n")
    return secret, str(path)


# Joining a running run ------------------------------------------------------------------
JOIN_TOKEN_ENV = "DILOCO_JOIN_TOKEN"
JOIN_TOKEN_PREFIX = "diloco-join-3:"
OLD_JOIN_TOKEN_PREFIXES = ("diloco-join-1:", "diloco-join-2:")


class JoinRefused(ValueError):
    """A learner that may not join a run (no token, a token of another run or for other
    learners), or no place in the run to join: the message says which and why."""


def key_check(key: bytes, run: str, learner: str) -> str:
    """What a bucket keeps to check a learner key against, never the key: an HMAC under
    it of the run and learner (a key of another run or learner gives another)."""
    return hmac.new(key, f"diloco-key-check/{run}/{learner}".encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class JoinToken:
    """What a run's owner gives a machine that may join ``run``: the keys of the learner
    slots it may take and the run's claims key (never the run secret), an id, when it was
    issued and when it expires (None: never). The run's buckets keep its ``record``: the
    id and times and a ``key_check`` of each key, so a joiner's token is checked against the run before
    anything is taken (a token of another run, relabelled, is refused), and a token is
    revoked by a record beside it (``flows.join``)."""

    run: str
    id: str
    issued: float
    expires: float | None
    keys: dict[str, bytes]
    claims: bytes

    @property
    def text(self) -> str:
        body = {"run": self.run, "id": self.id, "issued": self.issued, "expires": self.expires,
                "keys": {lid: k.hex() for lid, k in self.keys.items()},
                "claims": self.claims.hex()}  # fmt: skip
        raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        return JOIN_TOKEN_PREFIX + base64.urlsafe_b64encode(raw).decode()

    def record(self) -> dict[str, object]:
        return {"id": self.id, "issued": self.issued, "expires": self.expires,
                "checks": {lid: key_check(k, self.run, lid) for lid, k in self.keys.items()},
                "claims_check": key_check(self.claims, self.run, "claims")}  # fmt: skip


def join_token(
    secret: str, run: str, learners: list[str], expires_in: float | None = None,
    now: float | None = None,
) -> JoinToken:  # fmt: skip
    """A new token for ``learners`` of ``run`` (its keys derived from ``secret``), valid
    for ``expires_in`` seconds (None: until revoked)."""
    issued = round(time.time() if now is None else now, 3)
    expires = None if expires_in is None else round(issued + expires_in, 3)
    keys = {lid: learner_key(secret, run, lid) for lid in learners}
    return JoinToken(run, secrets.token_hex(8), issued, expires, keys, claims_key(secret, run))


def parse_join_token(text: str, run: str) -> JoinToken:
    """The join token in ``text`` for ``run``; ``JoinRefused`` naming what is wrong with
    one that is malformed, of an older kind, or made for another run."""
    text = text.strip()
    if text.startswith(OLD_JOIN_TOKEN_PREFIXES):
        raise JoinRefused(f"{JOIN_TOKEN_ENV} was made by an older diloco (it has no id, no "
                          "issue time and no expiry, and cannot be checked against the run): "
                          "make a new one with `diloco join-token`")  # fmt: skip
    if not text.startswith(JOIN_TOKEN_PREFIX):
        raise JoinRefused(f"{JOIN_TOKEN_ENV} is not a join token (it starts with "
                          f"{JOIN_TOKEN_PREFIX!r}; `diloco join-token` makes one)")  # fmt: skip
    try:
        body = json.loads(base64.urlsafe_b64decode(text[len(JOIN_TOKEN_PREFIX) :]))
        keys = {str(lid): parse_key(k, JOIN_TOKEN_ENV) for lid, k in body["keys"].items()}
        token = JoinToken(str(body["run"]), str(body["id"]), float(body["issued"]),
                          None if body["expires"] is None else float(body["expires"]), keys,
                          parse_key(body["claims"], JOIN_TOKEN_ENV))  # fmt: skip
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise JoinRefused(f"{JOIN_TOKEN_ENV} is damaged: {exc!r}") from None
    if token.run != run:
        raise JoinRefused(f"{JOIN_TOKEN_ENV} is a join token of run {token.run!r}, not {run!r}")
    return token


def _mac(record: Mapping[str, object], key: bytes, without: tuple[str, ...]) -> str:
    body = {k: v for k, v in record.items() if k not in without}
    content = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hmac.new(key, content.encode(), hashlib.sha256).hexdigest()


def record_signature(record: Mapping[str, object], key: bytes) -> str:
    """HMAC-SHA256 under ``key`` of ``record``'s canonical JSON without its signature
    (nor its seal, added after it)."""
    return _mac(record, key, ("signature", "seal"))


def seal_key(claims: bytes, base: str) -> bytes:
    """The key that seals the claim at ``base`` under the run's ``claims`` key."""
    return hmac.new(claims, f"diloco-seal/{base}".encode(), hashlib.sha256).digest()


def seal(record: Mapping[str, object], key: bytes) -> dict[str, object]:
    """``record`` (a claim's JSON) with its ``seal`` under ``key`` (``seal_key``)."""
    return {**record, "seal": _mac(record, key, ("seal",))}


def seal_holds(record: Mapping[str, object], key: bytes) -> bool:
    value = record.get("seal")
    return isinstance(value, str) and hmac.compare_digest(
        value.encode(), _mac(record, key, ("seal",)).encode()
    )


def sign_record(record: Mapping[str, object], key: bytes) -> dict[str, object]:
    """``record`` (JSON) with its ``signature``: a join record, signed by its learner."""
    return {**record, "signature": {"alg": ALGORITHM, "value": record_signature(record, key)}}


def record_verifies(record: Mapping[str, object], key: bytes) -> bool:
    sig = record.get("signature")
    if not isinstance(sig, Mapping) or sig.get("alg") != ALGORITHM:
        return False
    value = str(sig.get("value", ""))
    return hmac.compare_digest(value.encode(), record_signature(record, key).encode())
