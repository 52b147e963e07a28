"""Preemption notices from a cloud's metadata service, for learners on spot capacity.

A spot or preemptible VM is told before it is taken away: AWS posts an interruption
notice two minutes ahead (``spot/instance-action`` in the instance metadata, through
IMDSv2's session token); GCP sets ``instance/preempted`` to ``TRUE`` about 30 s ahead
(and then shuts the VM down, which sends SIGTERM). A learner that watches for the
notice leaves as on SIGTERM (``WorkerProcess.preempted``, ``flows.process``): it sends what it trained,
checkpoints and leaves, with the notice's whole lead time to do it in.

``DILOCO_PREEMPTION_NOTICE`` (this machine's: a work pool's job variables, a VM's
environment) says where to look:

- ``aws`` or ``gcp``: the cloud's metadata service at its usual address;
- ``aws=URL`` or ``gcp=URL``: the same protocol at another address (a proxy; the tests'
  loopback server);
- an ``http://`` or ``https://`` URL that answers 200 once a notice is out and 404 until
  then (a node agent's, a scheduler's).

Unset or empty: no watching (a SIGTERM still is a notice). Written here rather than
taken from a library: the two requests are a few lines of ``urllib``, and the cloud SDKs
that wrap them (boto3's IMDS fetcher, google-auth's metadata helpers) expose neither the
interruption notice nor the preempted flag.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

NOTICE_ENV = "DILOCO_PREEMPTION_NOTICE"
POLL_SECONDS = 5.0  # AWS asks for a look every 5 s; GCP's notice comes 30 s ahead
REQUEST_SECONDS = 2.0
ADDRESSES = {"aws": "http://169.254.169.254", "gcp": "http://metadata.google.internal"}
TOKEN_TTL = "21600"  # IMDSv2 session token, seconds


@dataclass
class NoticeSource:
    """Where this machine's preemption notice is read (``notice_source``)."""

    kind: str  # "aws", "gcp" or "url"
    url: str
    _token: str | None = field(default=None, repr=False)

    def __str__(self) -> str:
        return self.kind if self.url == ADDRESSES.get(self.kind) else f"{self.kind} at {self.url}"

    def noticed(self, timeout: float = REQUEST_SECONDS) -> str | None:
        """The notice, if one is out (its text: AWS's action and time, GCP's flag, the
        URL's answer); None if not. ``OSError`` when the service cannot be asked."""
        if self.kind == "aws":
            return self._aws(timeout)
        if self.kind == "gcp":
            text = self._get(f"{self.url}/computeMetadata/v1/instance/preempted",
                             {"Metadata-Flavor": "Google"}, timeout)  # fmt: skip
            return text if text is not None and text.strip().upper() == "TRUE" else None
        return self._get(self.url, {}, timeout)

    def _aws(self, timeout: float) -> str | None:
        path = f"{self.url}/latest/meta-data/spot/instance-action"
        try:
            return self._get(path, self._aws_session(timeout), timeout)
        except urllib.error.HTTPError as exc:
            if exc.code != 401:
                raise
            self._token = None  # expired: a new session token, once
            return self._get(path, self._aws_session(timeout), timeout)

    def _aws_session(self, timeout: float) -> dict[str, str]:
        """IMDSv2's header: a session token, asked for once and kept until refused."""
        if self._token is None:
            request = urllib.request.Request(
                f"{self.url}/latest/api/token", method="PUT",
                headers={"X-aws-ec2-metadata-token-ttl-seconds": TOKEN_TTL},
            )  # fmt: skip
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                self._token = answer.read().decode()
        return {"X-aws-ec2-metadata-token": self._token}

    @staticmethod
    def _get(url: str, headers: dict[str, str], timeout: float) -> str | None:
        """The body of a 200 answer; None for a 404 (no notice); raises otherwise."""
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                        timeout=timeout) as answer:  # fmt: skip
                return answer.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise


def notice_source(value: str | None) -> NoticeSource | None:
    """``DILOCO_PREEMPTION_NOTICE``'s value as a source (None: unset or empty); a value
    that is none of the forms in this module's docstring is a ``ValueError`` naming it."""
    value = (value or "").strip()
    if not value:
        return None
    kind, _, url = value.partition("=")
    if kind in ADDRESSES:
        url = url or ADDRESSES[kind]
    elif value.startswith(("http://", "https://")):
        kind, url = "url", value
    else:
        url = ""
    if not url.startswith(("http://", "https://")):
        raise ValueError(
            f"{NOTICE_ENV}={value!r} is not a preemption notice source: give 'aws' or "
            "'gcp' (their metadata service), 'aws=URL' or 'gcp=URL' (the same at another "
            "address), or an http(s) URL that answers 200 once a notice is out"
        )
    return NoticeSource(kind, url.rstrip("/"))


class NoticeWatcher(threading.Thread):
    """Asks ``source`` every ``every`` seconds until a notice is out, then calls
    ``on_notice(text)`` once and ends. A failed look (the service down, or anything
    else) is said once (``say``) until a look works again, and never ends the watch: a
    metadata service that blinks must not leave a learner deaf to its notice."""

    def __init__(self, source: NoticeSource, on_notice: Callable[[str], None],
                 every: float = POLL_SECONDS, say: Callable[[str], None] | None = None):  # fmt: skip
        super().__init__(name="preemption-notice", daemon=True)
        self.source, self.on_notice, self.every = source, on_notice, every
        self.say = say or (lambda text: print(text, file=sys.stderr, flush=True))
        self.stopped = threading.Event()
        self.looks = 0  # answered looks (a test's measure of progress)

    def run(self) -> None:
        failing = False
        while not self.stopped.is_set():
            try:
                text = self.source.noticed()
                self.looks += 1
                if failing:
                    self.say(f"the preemption notice ({self.source}) can be read again")
                    failing = False
                if text is not None:
                    self.on_notice(_brief(text))
                    return
            except Exception as exc:  # a thread never dies silently, nor says it each look
                if not failing:
                    why = exc if isinstance(exc, OSError) else repr(exc)
                    self.say(f"cannot read the preemption notice ({self.source}): {why}; "
                             f"asking again every {self.every:g} s")  # fmt: skip
                failing = True
            self.stopped.wait(self.every)

    def stop(self) -> None:
        self.stopped.set()


def _brief(text: str) -> str:
    """A notice's text for a log line: AWS's JSON as ``action at time``."""
    try:
        notice = json.loads(text)
    except ValueError:
        return text.strip()[:200]
    if isinstance(notice, dict) and "action" in notice:
        return f"{notice['action']} at {notice.get('time', '?')}"
    return text.strip()[:200]


@contextlib.contextmanager
def noting_ctrl_c(stop: threading.Event, what: str) -> Iterator[None]:
    """While it is held, a first Ctrl-C (SIGINT) is noted in ``stop`` and said (``what``
    happens now), not raised: the code held asks ``stop`` where it may stop. Raised, a
    ``KeyboardInterrupt`` is swallowed when it comes during one of JAX's garbage collector
    callbacks ("Exception ignored in ... _xla_gc_callback": a `diloco join` warming up
    took a slot and trained on), and one that stops a compilation leaves XLA to crash the
    process at its exit. A second Ctrl-C raises at once. Only on the main thread (the only
    one a handler can be set on); the handler before is put back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def noted(signum: int, frame: object) -> None:
        if stop.is_set():
            raise KeyboardInterrupt  # asked twice: at once
        stop.set()
        print(f"Ctrl-C: {what} (Ctrl-C again: at once)", flush=True)

    before = signal.signal(signal.SIGINT, noted)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
