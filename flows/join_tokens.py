"""Join tokens (``diloco join-token``): the slots' keys a joiner holds (``join_keys``), and the
record a run keeps of each token it issued (never the keys), so a token of another run,
an expired or a revoked one is refused by name (``check_token``)."""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Mapping
from typing import Annotated

from pydantic import Field

from storage_layout import record
from storage_layout.auth import (
    JOIN_TOKEN_ENV,
    RUN_SECRET_ENV,
    JoinRefused,
    JoinToken,
    check_secret,
    claims_key,
    key_check,
    parse_join_token,
)
from storage_layout.record import Name, Record, Time
from storage_layout.store import RunStore


def join_keys(store: RunStore, environ: Mapping[str, str]) -> dict[str, bytes] | None:
    """The learner keys this machine holds for the run (None: every slot's, from the run
    secret), from ``DILOCO_RUN_SECRET`` or ``DILOCO_JOIN_TOKEN`` (checked against the
    run's bucket: ``check_token``); {} when it holds none. ``store`` takes the run's
    claims key from either (``storage_layout.auth``)."""
    if environ.get(RUN_SECRET_ENV):
        store.claims_key = claims_key(check_secret(environ[RUN_SECRET_ENV]), store.run)
        return None
    if environ.get(JOIN_TOKEN_ENV):
        token = parse_join_token(environ[JOIN_TOKEN_ENV], store.run)
        check_token(store, token)
        store.claims_key = token.claims
        return token.keys
    return {}


class TokenRecord(Record):
    id: Name
    issued: Time
    expires: Annotated[float, Field(allow_inf_nan=False)] | None = None
    checks: dict[Name, Name]
    claims_check: Name


def issue_token(store: RunStore, token: JoinToken) -> None:
    """Keep ``token``'s record (never its keys) in every region of the run, so a joiner
    anywhere can check its token against the run (``check_token``)."""
    body = json.dumps(token.record(), sort_keys=True).encode()
    for region in store.urls:
        store.bucket(region).put_exclusive(store.layout.join_token(token.id), body)


def revoke_token(store: RunStore, token_id: str) -> None:
    """Revoke a join token in every region: no joiner takes a slot with it after this
    (one that joined with it already trains on: stop its process to end it)."""
    body = json.dumps({"id": token_id, "revoked": time.time()}).encode()
    for region in store.urls:
        store.bucket(region).put(store.layout.revoked_token(token_id), body)


def check_token(store: RunStore, token: JoinToken, now: float | None = None) -> None:
    """``JoinRefused`` unless ``token`` is one the run's owner issued for this run (its
    record is in the joiner's bucket and each of its keys matches the record's check),
    has not expired and is not revoked: checked before anything is taken."""
    bucket, now = store.home, time.time() if now is None else now
    key = store.layout.join_token(token.id)
    try:
        kept = record.read(bucket, key, TokenRecord)
    except FileNotFoundError:
        raise JoinRefused(f"join token {token.id} was not issued for run {store.run!r} (no "
                          f"record of it in {bucket.url}): a token of another run, or one "
                          "made without the run's bucket (`diloco join-token --url`)") from None  # fmt: skip
    except record.BadRecord as exc:
        raise JoinRefused(f"join token {token.id} cannot be checked: {exc}") from None
    wrong = [lid for lid, k in token.keys.items()
             if kept.checks.get(lid) != key_check(k, store.run, lid)]  # fmt: skip
    if kept.claims_check != key_check(token.claims, store.run, "claims"):
        wrong.append("the run's claims")
    if wrong:
        raise JoinRefused(f"join token {token.id} holds keys that are not run {store.run!r}'s "
                          f"for {', '.join(wrong)} (a token of another run, relabelled, or "
                          "altered): refused before anything was taken")  # fmt: skip
    expires = min((t for t in (token.expires, kept.expires) if t is not None), default=None)
    if expires is not None and now > expires:
        ago = dt.datetime.fromtimestamp(expires, dt.UTC).isoformat(timespec="seconds")
        raise JoinRefused(f"join token {token.id} expired at {ago}: ask the run's owner for "
                          "a new one (`diloco join-token --expires ...`)")  # fmt: skip
    if bucket.exists(store.layout.revoked_token(token.id)):
        raise JoinRefused(f"join token {token.id} was revoked by the run's owner")
