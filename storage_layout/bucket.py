"""A region's bucket through fsspec: plain and exclusive writes, fresh listings, and
per-region-pair traffic accounting.

Exclusive create ("write only if absent") is what makes commit markers write-once:

- ``s3://``: ``PutObject`` with ``If-None-Match: *`` (s3fs ``mode="create"``);
- ``gs://``: ``ifGenerationMatch=0`` (gcsfs ``mode="create"``);
- ``file://``: the object is written to a temporary name and hard-linked into place,
  which fails atomically if the name exists (fsspec's generic ``mode="create"`` checks
  and then writes, which two writers can both pass);
- ``memory://``: an exclusive open in one process.

Any other protocol is refused unless the user passes ``allow_unsafe_overwrite=True``.

On a local disk a bucket is a folder anyone with write access may plant things in, so
nothing is followed out of it: a key whose path resolves outside the folder (through a
link anywhere along it) is neither read, written, listed nor deleted, and a read opens
regular files only (``O_NOFOLLOW``, non-blocking: a link, a FIFO or a device is refused,
never waited on). What is refused is named (``ForeignObject``); sweeps name it in the log
and leave it alone.

Credentials come from the environment, as each client reads them (``AWS_*`` and
``AWS_ENDPOINT_URL`` for S3; ``GOOGLE_APPLICATION_CREDENTIALS`` or
``STORAGE_EMULATOR_HOST`` for GCS), or from ``storage_options``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import stat
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import fsspec
import fsspec.asyn

from storage_layout.layout import LayoutError, check_key
from storage_layout.traffic import Traffic

EXCLUSIVE_PROTOCOLS = {"file", "local", "memory", "s3", "s3a", "gs", "gcs"}


class BucketError(OSError):
    """A bucket that is missing, unreachable, or unsafe to write to; the message says which."""


log = logging.getLogger(__name__)


class Refused(ValueError):
    """An object read no further because of what it is, not what it holds; asking again
    gives the same answer."""


class ObjectTooLarge(Refused):
    """An object larger than any of its kind may be."""


class ForeignObject(Refused):
    """On a local disk: a key that is not a regular file inside the bucket (a link, a
    FIFO, a device, or a path that resolves outside the bucket's folder)."""


class PartialFailure(OSError):
    """A batched request (``put_many``, ``get_many``) of which some keys failed and the
    others went through: ``failed`` maps each failed key to its error, ``done`` holds what
    the others read (empty for writes). Asking again for the failed keys alone is enough
    (``storage_layout.commit.put_patiently`` / ``get_patiently`` do)."""

    def __init__(
        self, failed: Mapping[str, BaseException], done: Mapping[str, bytes] | None = None
    ):
        self.failed, self.done = dict(failed), dict(done or {})
        key, first = next(iter(self.failed.items()))
        more = f" (and {len(self.failed) - 1} more)" if len(self.failed) > 1 else ""
        super().__init__(f"{key}: {first!r}{more}")


def _check_s3_credentials(region: str, url: str, options: Mapping[str, Any]) -> None:
    """s3fs silently falls back to anonymous requests when it finds no credentials, which
    then fail with misleading errors ("bucket does not exist"). Say what is missing."""
    if options.get("anon") or options.get("key") or options.get("profile"):
        return
    import botocore.session

    if botocore.session.get_session().get_credentials() is None:
        raise BucketError(
            f"region {region}: no S3 credentials found for {url}; set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or pass storage option anon=True for a "
            "public bucket"
        )


def _check_gcs_credentials(
    region: str, url: str, fs: fsspec.AbstractFileSystem, options: Mapping[str, Any]
) -> None:
    """gcsfs, too, falls back to anonymous access when every credential source fails."""
    if options.get("token") or os.environ.get("STORAGE_EMULATOR_HOST"):
        return
    if getattr(getattr(fs, "credentials", None), "method", None) == "anon":
        raise BucketError(
            f"region {region}: no GCS credentials found for {url}; set "
            "GOOGLE_APPLICATION_CREDENTIALS to a service-account key file (or run `gcloud auth "
            "application-default login`), or pass storage option token='anon' for a public "
            "bucket"
        )


def raise_partial(
    failed: Mapping[str, BaseException], done: Mapping[str, bytes], total: int
) -> None:
    """Nothing when nothing failed; the first error itself when every key failed (a region
    down, a permission refused: the batch failed as a whole); else ``PartialFailure``."""
    if not failed:
        return
    if len(failed) == total:
        error = next(iter(failed.values()))
        if isinstance(error, Exception):
            raise error
    raise PartialFailure(failed, done)


def same_bucket(a: str, b: str) -> bool:
    """Whether URLs ``a`` and ``b`` name one bucket folder (``/x`` and ``file:///x/`` do;
    a local path is compared resolved)."""

    def norm(url: str) -> tuple[str, str]:
        protocol, path = fsspec.core.split_protocol(url)
        protocol = protocol or "file"
        if protocol in ("file", "local"):
            return "file", os.path.realpath(path)
        return protocol.replace("s3a", "s3").replace("gcs", "gs"), path.rstrip("/")

    return norm(a) == norm(b)


def protocol_of(fs: fsspec.AbstractFileSystem) -> str:
    proto = fs.protocol
    return proto if isinstance(proto, str) else proto[0]


class Bucket:
    """``url`` (``file:///data/us``, ``s3://bkt/prefix``, ``gs://bkt``, ``memory://x``) seen
    from ``client_region``. Keys are relative to the URL."""

    def __init__(
        self,
        url: str,
        region: str = "default",
        client_region: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        traffic: Traffic | None = None,
        allow_unsafe_overwrite: bool = False,
        scope: str | None = None,
    ):
        self.url = url
        self.region = region
        self.scope = scope  # a run's prefix: no key outside it is asked for
        self.client_region = client_region or region
        self.traffic = traffic if traffic is not None else Traffic()
        protocol = fsspec.core.split_protocol(url)[0] or "file"
        if protocol not in EXCLUSIVE_PROTOCOLS and not allow_unsafe_overwrite:
            raise BucketError(
                f"region {region}: {url!r}: {protocol}:// cannot write objects exclusively, so "
                f"two syncers could both publish one version (supported: "
                f"{', '.join(sorted(EXCLUSIVE_PROTOCOLS))}); pass allow_unsafe_overwrite=True "
                "only if a single writer per key is guaranteed some other way"
            )
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        except (ImportError, ValueError, OSError) as exc:
            raise BucketError(f"region {region}: cannot open {url!r}: {exc}") from exc
        self.root = self.root.rstrip("/")
        self.protocol = protocol_of(self.fs)
        if self.protocol in ("s3", "s3a"):
            _check_s3_credentials(region, url, storage_options or {})
        if self.protocol in ("gs", "gcs"):
            _check_gcs_credentials(region, url, self.fs, storage_options or {})
        self.check_reachable()

    def __repr__(self) -> str:
        return f"Bucket({self.url!r}, region={self.region!r})"

    def path(self, key: str) -> str:
        """The full path of ``key``; a key that is not a plain relative one (``..``, an
        empty segment, a leading ``/``), or lies outside the bucket's ``scope`` (a run's
        prefix), is refused (``LayoutError``), whoever built it."""
        if self.scope is not None and not (key == self.scope or key.startswith(f"{self.scope}/")):
            raise LayoutError(f"key {key[:200]!r} lies outside run {self.scope!r}'s prefix")
        return f"{self.root}/{check_key(key)}" if key else self.root

    @property
    def local(self) -> bool:
        return self.protocol in ("file", "local")

    def _inside(self, key: str) -> str:
        """``key``'s path; on a local disk, ``ForeignObject`` if it resolves outside the
        bucket's folder (a link along the way, or the key itself a link out)."""
        path = self.path(key)
        if self.local:
            root = os.path.realpath(self.root)
            real = os.path.realpath(path)
            if real != root and not real.startswith(f"{root}/"):
                raise ForeignObject(
                    f"{self.url}/{key} resolves to {real}, outside the bucket (through a "
                    "link): not followed"
                )
        return path

    def _read_local(self, key: str, limit: int | None) -> bytes:
        """A regular file's bytes (at most ``limit + 1``): a link is not followed and a
        FIFO or device is refused at once, never waited on."""
        path = self._inside(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ForeignObject(f"{self.url}/{key} is a link: not followed") from exc
            raise
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(fd).st_mode
            if stat.S_ISDIR(mode):
                raise IsADirectoryError(path)
            if not stat.S_ISREG(mode):
                raise ForeignObject(f"{self.url}/{key} is not a regular file: not read")
            return f.read(-1 if limit is None else limit + 1)

    def _foreign(self, key: str) -> str | None:
        """Why a sweep must leave ``key`` alone (a link, or a path out of the bucket), or
        None; always None off a local disk."""
        if not self.local:
            return None
        try:
            path = self._inside(key)
        except ForeignObject as exc:
            return str(exc)
        return f"{self.url}/{key} is a link: left alone" if os.path.islink(path) else None

    def check_reachable(self) -> None:
        try:
            ok = self.fs.exists(self.root) or self.protocol == "memory"
        except PermissionError as exc:
            raise BucketError(
                f"region {self.region}: access to {self.url} denied ({exc}); check the credentials"
            ) from exc
        except Exception as exc:
            raise BucketError(
                f"region {self.region}: bucket {self.url} is not reachable: {exc}"
            ) from exc
        if not ok:
            raise BucketError(f"region {self.region}: bucket {self.url} does not exist")

    # writes -------------------------------------------------------------------------
    def _up(self, nbytes: int) -> None:
        self.traffic.add(self.client_region, self.region, nbytes, upload=True)

    def _down(self, nbytes: int) -> None:
        self.traffic.add(self.region, self.client_region, nbytes)

    def put(self, key: str, data: bytes) -> None:
        path = self._inside(key)
        if self.local:
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        self.fs.pipe_file(path, data)
        self._up(len(data))

    def _gather(self, calls: list) -> list:
        """Run the async filesystem's coroutines concurrently on its event loop."""

        async def gather() -> list:
            return await asyncio.gather(*calls, return_exceptions=True)

        return fsspec.asyn.sync(self.fs.loop, gather)

    def put_many(self, objects: Mapping[str, bytes]) -> None:
        """Write several objects; concurrently on async backends (S3, GCS). Each is its
        own request: when some fail, the others are written all the same and
        ``PartialFailure`` names the failed ones."""
        if self.fs.async_impl:
            calls = [self.fs._pipe_file(self.path(k), v) for k, v in objects.items()]
            results = dict(zip(objects, self._gather(calls), strict=True))
        else:
            results = {}
            for key, data in objects.items():
                try:
                    self.put(key, data)
                    results[key] = None
                except OSError as exc:
                    results[key] = exc
        failed = {k: r for k, r in results.items() if isinstance(r, BaseException)}
        if self.fs.async_impl:
            for key in results.keys() - failed.keys():
                self.fs.invalidate_cache(self.path(key))
                self._up(len(objects[key]))
        raise_partial(failed, {}, len(objects))

    def put_exclusive(self, key: str, data: bytes) -> None:
        """Write ``key`` only if it does not exist; ``FileExistsError`` otherwise."""
        path = self._inside(key)
        self._up(len(data))
        if self.local:
            folder = path.rsplit("/", 1)[0]
            os.makedirs(folder, exist_ok=True)
            tmp = f"{folder}/.tmp-{uuid.uuid4().hex}"
            try:  # a full disk fails the write: the temporary goes either way
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.link(tmp, path)  # atomic; fails if the name exists
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        elif self.protocol == "memory":
            with self.fs.open(path, "xb") as f:
                f.write(data)
        elif self.protocol in EXCLUSIVE_PROTOCOLS:
            self.fs.pipe_file(path, data, mode="create")
        else:  # opted out of exclusivity
            if self.fs.exists(path):
                raise FileExistsError(path)
            self.fs.pipe_file(path, data)

    # reads --------------------------------------------------------------------------
    def get(self, key: str, limit: int | None = None) -> bytes:
        """``key``'s bytes; with ``limit``, at most ``limit + 1`` of them are read (a ranged
        read), so an object larger than its kind may be is refused without holding it:
        ``ObjectTooLarge``."""
        if self.local:
            data = self._read_local(key, limit)
        elif limit is None:
            data = self.fs.cat_file(self.path(key))
        else:
            data = self.fs.cat_file(self.path(key), start=0, end=limit + 1)
        self._down(len(data))
        if limit is not None and len(data) > limit:
            raise ObjectTooLarge(f"{self.url}/{key} is larger than {limit} bytes")
        return data

    def get_many(self, keys: list[str], limit: int | None = None) -> dict[str, bytes]:
        """Read several objects; concurrently on async backends. A missing one raises
        ``FileNotFoundError`` naming its key (an answer: asking again changes nothing);
        when others fail, ``PartialFailure`` carries what was read. With ``limit``, at
        most ``limit + 1`` bytes of each are read: one that long is larger than its kind
        may be (``get`` names it)."""
        end = None if limit is None else limit + 1
        if self.fs.async_impl:
            results = self._gather([self.fs._cat_file(self.path(k), start=0 if end else None,
                                                      end=end) for k in keys])  # fmt: skip
        else:
            results = []
            for k in keys:
                try:
                    results.append(self._read_local(k, limit) if self.local else
                                   self.fs.cat_file(self.path(k), start=0 if end else None,
                                                    end=end))  # fmt: skip
                except (OSError, Refused) as exc:
                    results.append(exc)
        out, failed = {}, {}
        for key, value in zip(keys, results, strict=True):
            if isinstance(value, FileNotFoundError):
                raise FileNotFoundError(key)
            if isinstance(value, BaseException):
                failed[key] = value
                continue
            self._down(len(value))
            out[key] = value
        raise_partial(failed, out, len(keys))
        return out

    def exists(self, key: str) -> bool:
        self.traffic.add(self.region, self.client_region, 0)
        self.fs.invalidate_cache(self.path(key).rsplit("/", 1)[0])
        return self.fs.exists(self.path(key))

    def list(self, prefix: str) -> list[str]:
        """Names directly under ``prefix`` (sorted), bypassing fsspec's listing cache so
        other writers' new objects are seen. A missing prefix lists as empty."""
        if reason := self._foreign(prefix):
            log.warning("not listed: %s", reason)
            return []
        path = self.path(prefix)
        self.traffic.add(self.region, self.client_region, 0)
        try:
            self.fs.invalidate_cache(path)
            entries = self.fs.ls(path, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        names = [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]
        return sorted(n for n in names if n and not n.startswith(".tmp-"))

    def temporaries(self, prefix: str) -> list[str]:
        """Names of the temporaries directly under ``prefix`` (sorted) that ``list`` hides:
        ``.tmp-*`` files of exclusive creates on a local disk, left by a writer killed
        between writing one and linking it into place. Other stores write none."""
        if not self.local or self._foreign(prefix):
            return []
        try:
            names = os.listdir(self.path(prefix))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(n for n in names if n.startswith(".tmp-"))

    def info(self, key: str) -> dict[str, Any]:
        return self.fs.info(self.path(key))

    def probe_exclusive(self) -> None:
        """Ask the store for a real conflicting exclusive create (some S3-compatible
        servers ignore ``If-None-Match`` and let the second write through); a store that
        does not refuse it is refused here, naming the bucket."""
        key = f"{self.scope + '/' if self.scope else ''}.diloco-probe/{uuid.uuid4().hex}"
        self.put_exclusive(key, b"first")
        try:
            try:
                self.put_exclusive(key, b"second")
            except FileExistsError:
                return  # refused, as it must be
            raise BucketError(
                f"region {self.region}: bucket {self.url} does not honour exclusive creates "
                f"(a second create of {key} succeeded), so two syncers could both publish "
                "one version; use a store that honours If-None-Match / ifGenerationMatch, "
                "or set pipeline.probe_exclusive=false only if a single writer per key is "
                "guaranteed some other way"
            )
        finally:
            self.delete([key])

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys``; on a local disk a link, or a key that resolves out of the
        bucket, is named in the log and left alone (nothing is deleted through a link)."""
        paths = []
        for key in keys:
            if reason := self._foreign(key):
                log.warning("not deleted: %s", reason)
                continue
            paths.append(self.path(key))
        for path in paths:
            self.traffic.add(self.client_region, self.region, 0)
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(path)
        for folder in {p.rsplit("/", 1)[0] for p in paths}:
            self.fs.invalidate_cache(folder)

    def delete_prefix(self, prefix: str) -> None:
        """Remove every object under ``prefix`` (only ever a write-id-unique data prefix).

        Object by object: gcsfs's batched recursive delete can hang on some servers. On a
        local disk the walk follows no link (a link found is named and left alone), and
        the emptied folders go too.
        """
        path = self.path(check_key(prefix, "prefix to delete"))  # never the whole bucket
        if not self.local:
            self.fs.invalidate_cache(path)
            try:
                found = self.fs.find(path)
            except FileNotFoundError:
                found = []
            self.delete(f[len(self.root) + 1 :] for f in found)
            return
        if reason := self._foreign(prefix):
            log.warning("not deleted: %s", reason)
            return
        for folder, dirs, files in os.walk(path, topdown=False, followlinks=False):
            links = [d for d in dirs if os.path.islink(f"{folder}/{d}")]
            self.delete(f"{folder[len(self.root) + 1 :]}/{name}" for name in files + links)
            with contextlib.suppress(OSError):  # not empty: it holds a link left alone
                os.rmdir(folder)
        self.fs.invalidate_cache(path)
