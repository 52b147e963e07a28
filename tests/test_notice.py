"""Preemption notices read from a cloud's metadata service (``flows.notice``), against a
metadata server on loopback that speaks AWS's IMDSv2 and GCE's protocol and refuses what
they refuse (``infra.local_servers.LocalMetadata``). Every wait is on the watcher's own
looks, never on time."""

from __future__ import annotations

import threading
import time

import pytest

from flows.notice import NOTICE_ENV, NoticeWatcher, notice_source
from infra.local_servers import LocalMetadata


@pytest.fixture
def metadata():
    server = LocalMetadata().start()
    yield server
    server.stop()


def _until(what: str, done) -> None:
    deadline = time.monotonic() + 60  # a guard against a hang, not a measure
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.mark.parametrize("kind", ["aws", "gcp", "url"])
def test_a_watcher_reports_the_notice_once_it_is_out_and_not_before(metadata, kind):
    """No notice: looks go on and nothing is reported; once the service announces one,
    the next look reports it, once, and the watch ends. The AWS look goes through an
    IMDSv2 session token (the server refuses one without, or one expired), GCE's with
    its header."""
    value = f"{metadata.url}/notice" if kind == "url" else f"{kind}={metadata.url}"
    source = notice_source(value)
    notices: list[str] = []
    said: list[str] = []
    watcher = NoticeWatcher(source, notices.append, every=0.01, say=said.append)
    watcher.start()
    _until("three looks", lambda: watcher.looks >= 3)
    assert notices == [] and said == []
    metadata._tokens.clear()  # (aws) the session expired: the next look asks a new one
    metadata.announce("terminate")
    watcher.join(timeout=60)
    assert not watcher.is_alive()
    expected = "TRUE" if kind == "gcp" else "terminate at "
    assert len(notices) == 1 and notices[0].startswith(expected), notices


def test_a_watcher_outlives_a_service_that_blinks_and_says_so_once(metadata):
    """A metadata service answering 500 is said once (not at every look), the watch goes
    on, says when it reads again, and still reports the notice."""
    said: list[str] = []
    noticed = threading.Event()
    metadata.failing = True
    watcher = NoticeWatcher(notice_source(f"aws={metadata.url}"), lambda _: noticed.set(),
                            every=0.01, say=said.append)  # fmt: skip
    watcher.start()
    _until("the first failed look", lambda: said)
    time.sleep(0.1)  # more failed looks: said no more
    assert len(said) == 1 and "cannot read the preemption notice (aws at" in said[0], said
    metadata.failing = False
    _until("a look that works", lambda: watcher.looks >= 2)
    assert "can be read again" in said[-1]
    metadata.announce()
    _until("the notice", noticed.is_set)


def test_the_sources_a_machine_may_name_and_one_it_may_not():
    assert notice_source(None) is None and notice_source("  ") is None
    aws, gcp = notice_source("aws"), notice_source("gcp=http://127.0.0.1:9/")
    assert (aws.kind, aws.url, str(aws)) == ("aws", "http://169.254.169.254", "aws")
    assert (gcp.kind, gcp.url) == ("gcp", "http://127.0.0.1:9")
    assert notice_source("https://agent.local/preempt").kind == "url"
    for bad in ("azure", "aws=ftp://x", "gcp=metadata", "169.254.169.254"):
        with pytest.raises(ValueError, match=f"{NOTICE_ENV}=.* is not a preemption notice"):
            notice_source(bad)
