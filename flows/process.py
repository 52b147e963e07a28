"""What one worker process keeps across its flow runs (``flows.worker``): its stop, its
preemption notice, and the learner's or syncer's runtime that the next flow run goes on
with. A signal is the process's, so this is too; but it is one object, made by the
worker's entry (``worker_process``) and found by the flows through a context variable,
not state scattered over modules: a test makes its own, and nothing leaks into the next.
A flow run outside a worker (a deployment's, a test's) gets a fresh one on first use."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from flows.notice import NOTICE_ENV, NoticeWatcher, notice_source
from storage_layout.faults import Injector


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@dataclass(eq=False)
class WorkerProcess:
    """One worker process's state:

    - ``stop``: set by a stop (SIGINT: the launcher's, or a Ctrl-C; SIGTERM to a syncer)
      as well as raised: the ``KeyboardInterrupt`` is lost where it lands in a JAX
      garbage collector callback (Python ignores it there) or as a flow run ends
      (Prefect's engine swallows an exception raised after the flow's own code returned),
      and the worker would train on. The flows look at it every round or poll, the worker
      between flow runs;
    - ``preempted``: set when the process is told it will be preempted (the first SIGTERM,
      or the machine's notice): the learner sends what it trained, checkpoints, leaves;
    - ``notices``: the signals taken as a preemption notice (SIGTERM; SIGINT too for
      ``diloco join``);
    - ``runtimes``: the learner's or syncer's runtime by (role, run, region, id), created
      by its first flow run and continued by the next (a flow-run boundary is
      bookkeeping, not a restart);
    - ``faults``: the storage faults its buckets meet (``storage_layout.faults``): the
      plan ``DILOCO_FAULTS`` holds as the process state is made (its start), or a
      test's."""

    stop: threading.Event = field(default_factory=threading.Event)
    preempted: threading.Event = field(default_factory=threading.Event)
    notices: list[int] = field(default_factory=lambda: [signal.SIGTERM])
    runtimes: dict[tuple, Any] = field(default_factory=dict)
    watcher: NoticeWatcher | None = None
    faults: Injector | None = field(default_factory=Injector.from_env)

    def take_sigterm(self) -> None:
        """Take a first SIGTERM as a preemption notice (a spot VM shut down, a pod
        deleted, the launcher gone), as the cloud's own notice where one is named
        (``watch_notice``): set ``preempted``, so the learner finishes its step, sends what
        it trained, checkpoints and leaves (``LearnerRuntime.leave``). A second SIGTERM
        stops it at once: a ``KeyboardInterrupt``, on which the learner flow checkpoints
        and ends.

        Called by the worker and again at the start of each learner flow run: Prefect's
        flow engine installs its own SIGTERM handler for the run (and restores the one
        before it after), which would raise ``TerminationSignal`` wherever the learner is,
        mid-step included, and end the run without a checkpoint."""

        def notice(signum: int, frame: Any) -> None:
            if self.preempted.is_set():
                raise KeyboardInterrupt
            self.preempted.set()
            name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            _say(f"{name}: the learner sends what it trained, checkpoints and leaves "
                 "(again: stop at once)")  # fmt: skip

        with contextlib.suppress(ValueError):  # not the main thread: not ours to take
            for signum in self.notices:
                signal.signal(signum, notice)
        self.watch_notice()

    def leave_on_interrupt(self) -> None:
        """Take Ctrl-C (SIGINT) as SIGTERM is taken: for ``diloco join``, whose machine
        was lent by whoever runs it, and whose Ctrl-C gives it back. The learner leaves as
        a preempted one does (its work sent, a checkpoint, its status ``preempted``, its
        data given back): the syncers stop counting it at once, not after its heartbeat
        goes silent. A second Ctrl-C stops it at once. (A worker the launcher started
        keeps Python's own: the launcher's Ctrl-C stops the whole run.)"""
        if signal.SIGINT not in self.notices:
            self.notices.append(signal.SIGINT)

    def watch_notice(self) -> None:
        """Watch this machine's preemption notice (``DILOCO_PREEMPTION_NOTICE``, see
        ``flows.notice``), once: a notice sets ``preempted`` as a first SIGTERM does, with
        the notice's lead time (two minutes on AWS) to send and checkpoint. A value that
        names no source is an error naming it, before the learner starts."""
        source = notice_source(os.environ.get(NOTICE_ENV))
        if source is None or self.watcher is not None:
            return

        def noticed(text: str) -> None:
            self.preempted.set()
            _say(f"preemption notice ({source}): {text}: the learner sends what it "
                 "trained, checkpoints and leaves")  # fmt: skip

        self.watcher = NoticeWatcher(source, noticed)
        self.watcher.start()
        _say(f"watching for a preemption notice ({source}) every {self.watcher.every:g} s")


_CURRENT: ContextVar[WorkerProcess | None] = ContextVar("diloco_worker_process", default=None)


def this_process() -> WorkerProcess:
    """The worker process the caller runs in: the one ``worker_process`` entered, or a
    fresh one, kept for the rest of this context."""
    found = _CURRENT.get()
    if found is None:
        found = WorkerProcess()
        _CURRENT.set(found)
    return found


@contextlib.contextmanager
def worker_process(process: WorkerProcess | None = None) -> Iterator[WorkerProcess]:
    """Run the body as ``process`` (a fresh one by default): the worker's entry, a test."""
    process = process or WorkerProcess()
    token = _CURRENT.set(process)
    try:
        yield process
    finally:
        _CURRENT.reset(token)
