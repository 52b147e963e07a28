"""One way in for every small JSON record read from a bucket.

A bucket holds whatever anyone with write access to it put there, so a record (a lock
claim, a lease, a budget, a heartbeat, a status, a join) is taken from it only through
``read``, which:

- reads a regular object only (``Bucket``: on a local disk no link, FIFO or device) and
  at most ``limit`` bytes of it (a larger one is refused unread);
- parses it into the kind's pydantic model, whose fields are bounded: counters within
  what a run can number (``Counter``), times not ahead of the reader's clock by more
  than ``MAX_SKEW_SECONDS`` (``Time``), strings of a stated length;
- checks its signature where its writer signs (``signed_by``), and its seal where it is
  a claim of a run whose claims are sealed (``sealed_by``, ``storage_layout.auth``).

A record that fails is ``BadRecord``, naming its key and what is wrong, never a raw
``ValueError`` and never waited on; ``read_or_none`` logs it by name and takes it as
absent, which is what most readers do. A read torn by a concurrent rewrite (not JSON)
is read again (``patiently``) before it counts as bad.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from storage_layout.auth import record_verifies, seal_holds
from storage_layout.bucket import Bucket, Refused
from storage_layout.commit import CorruptVersion, patiently
from storage_layout.layout import MAX_NUMBER

log = logging.getLogger(__name__)

# Hosts of one run keep their clocks within seconds of each other (NTP); a record dated
# further ahead of the reader than this was not written by one of them.
MAX_SKEW_SECONDS = 300.0
SMALL = 64 << 10  # the cap of a record of a few fields


def _not_ahead(t: float) -> float:
    if t > time.time() + MAX_SKEW_SECONDS:
        raise ValueError(f"dated {t - time.time():.0f} s ahead of this host's clock "
                         f"(more than {MAX_SKEW_SECONDS:.0f} s of skew)")  # fmt: skip
    return t


Counter = Annotated[int, Field(ge=0, le=MAX_NUMBER)]
Time = Annotated[float, Field(ge=0), AfterValidator(_not_ahead)]
Name = Annotated[str, Field(max_length=256)]
Tokens = Annotated[int, Field(ge=1, lt=10**18)]


class Record(BaseModel):
    """A stored record: unknown fields are kept (a newer writer's), known ones checked
    strictly (a number is a number, never a string that reads as one)."""

    model_config = ConfigDict(extra="allow", frozen=True, strict=True)


class BadRecord(CorruptVersion):
    """A record that is not what its kind must be; the message names its key and why."""


M = TypeVar("M", bound=BaseModel)


def parse(raw: bytes, where: str, model: type[M], signed_by: bytes | None = None) -> M:
    """``raw`` as a ``model`` (and, given ``signed_by``, signed with that key), or
    ``BadRecord`` naming ``where`` and what is wrong."""
    return check(_json(raw, where), where, model, signed_by)


def check(body: Any, where: str, model: type[M], signed_by: bytes | None = None,
          sealed_by: bytes | None = None) -> M:  # fmt: skip
    """A parsed ``body`` as a ``model`` (see ``parse``), sealed with ``sealed_by``."""
    try:
        record = model.model_validate(body)
    except ValidationError as exc:
        errors = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'the record'}: {e['msg']}"
                           for e in exc.errors()[:3])  # fmt: skip
        raise BadRecord(f"{where} is not a {model.__name__}: {errors[:400]}") from None
    if signed_by is not None and not record_verifies(body, signed_by):
        raise BadRecord(f"{where} is not signed with its writer's key (forged, or of "
                        "another run)")  # fmt: skip
    if sealed_by is not None and not seal_holds(body, sealed_by):
        raise BadRecord(f"{where} is not sealed with the run's claims key: rewritten by "
                        "someone without it, or copied from another claim")  # fmt: skip
    return record


def _json(raw: bytes, where: str) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise BadRecord(f"{where} is not JSON: {str(exc)[:200]}") from None


def fetch(bucket: Bucket, key: str, limit: int = SMALL) -> Any:
    """The JSON at ``key``, at most ``limit`` bytes of a regular object; a read torn by a
    concurrent rewrite (not JSON) is asked again. ``FileNotFoundError``, or ``BadRecord``."""
    where = f"{bucket.url}/{key}"
    try:
        return patiently(lambda: _json(bucket.get(key, limit), where), where)
    except Refused as exc:
        raise BadRecord(f"{exc}; refused unread") from None


def read(
    bucket: Bucket, key: str, model: type[M], limit: int = SMALL,
    signed_by: bytes | None = None, sealed_by: bytes | None = None,
) -> M:  # fmt: skip
    """The record at ``key`` (see the module's docstring); ``FileNotFoundError`` if there
    is none, ``BadRecord`` if it is not one."""
    return check(fetch(bucket, key, limit), f"{bucket.url}/{key}", model, signed_by, sealed_by)


def read_body(
    bucket: Bucket, key: str, model: type[M], limit: int = SMALL,
    signed_by: bytes | None = None, sealed_by: bytes | None = None,
) -> dict[str, Any]:  # fmt: skip
    """``read``, but the record as stored (a dict whose fields ``model`` checked): what
    a caller re-verifies or passes on unchanged."""
    body = fetch(bucket, key, limit)
    check(body, f"{bucket.url}/{key}", model, signed_by, sealed_by)
    return body


def read_or_none(
    bucket: Bucket, key: str, model: type[M], limit: int = SMALL,
    signed_by: bytes | None = None, warn: Callable[..., None] = log.warning,
    sealed_by: bytes | None = None,
) -> M | None:  # fmt: skip
    """``read``, with a missing record and a bad one (logged by name with ``warn``)
    both None."""
    try:
        return read(bucket, key, model, limit, signed_by, sealed_by)
    except FileNotFoundError:
        return None
    except BadRecord as exc:
        warn("ignored: %s", exc)
        return None


def dump(record: BaseModel | dict[str, Any]) -> bytes:
    """A record as stored."""
    body = record.model_dump() if isinstance(record, BaseModel) else record
    return json.dumps(body, sort_keys=True).encode()
