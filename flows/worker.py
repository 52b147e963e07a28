"""One learner or syncer process: runs bounded flow runs one after another until done.

    python -m flows.worker learner --run R --bucket URL --region us-east --index 2
    python -m flows.worker syncer --run R --regions '{"us-east": "file:///..."}' \\
        --home us-east --shard 0 --shards 2

    python -m flows.worker standby [--warm JSON]  # a spare: imports, then reads its job
                                                  # from stdin
    python -m flows.worker zygote                 # imports once, forks spares on demand
    python -m flows.worker follow [FLOW_RUN_ID]   # processes 1..N-1 of a deployment's
                                                  # learner over several nodes

Every flow run resumes from the buckets (checkpoint or newest versions), so this process
can be killed at any point and started again. Exit status: 0 when the role is done,
130 when interrupted (after a checkpoint), ``API_DOWN`` (75) when it failed while the
Prefect API was unreachable (the launcher waits for the API, and counts no crash), 1 on
another error (the launcher restarts it).

Started by the launcher, each flow run is a subflow of the launcher's task run that
started this process (``flows.observe.run_linked``): the launcher's flow run lists every
learner and syncer flow run of the run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
import urllib.request
from typing import Any

from flows.process import WorkerProcess, worker_process
from infra.processes import die_with_parent

API_DOWN = 75  # exit status: failed while the Prefect API was unreachable (EX_TEMPFAIL)


def prefect_api_reachable(url: str | None = None, timeout: float = 5.0) -> bool:
    """Whether the Prefect API (``url``, by default ``PREFECT_API_URL``) answers its health
    check; True when there is none to ask (an ephemeral API lives in this process)."""
    url = url or os.environ.get("PREFECT_API_URL")
    if not url:
        return True
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout) as answer:
            return answer.status == 200
    except OSError:
        return False


def api_away(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is the Prefect API being away rather than a
    fault of this process: a refused or dropped connection, a timeout, or an answer of
    5xx or 429 (a loaded or restarting server). The one place that tells them apart."""
    import httpx

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, httpx.TransportError):  # connect, read, protocol errors
            return True
        if isinstance(exc, httpx.HTTPStatusError):
            code = exc.response.status_code
            return code >= 500 or code == 429
        exc = exc.__cause__ or exc.__context__
    return False


def main(argv: list[str] | None = None, process: WorkerProcess | None = None) -> int:
    """Serve the role ``argv`` names, as ``process`` (a fresh ``WorkerProcess`` unless
    given: ``diloco join`` gives one that takes Ctrl-C as a preemption notice)."""
    parser = argparse.ArgumentParser(prog="python -m flows.worker")
    sub = parser.add_subparsers(dest="role", required=True)
    lrn = sub.add_parser("learner")
    lrn.add_argument("--run", required=True)
    lrn.add_argument("--bucket", required=True)
    lrn.add_argument("--region", required=True)
    lrn.add_argument("--index", type=int, required=True)
    syn = sub.add_parser("syncer")
    syn.add_argument("--run", required=True)
    syn.add_argument("--regions", required=True, help="JSON object: region -> bucket URL")
    syn.add_argument("--home", required=True)
    syn.add_argument("--shard", type=int, default=0)
    syn.add_argument("--shards", type=int, default=1)
    for p in (lrn, syn):
        p.add_argument("--pipeline", default="{}", help="JSON object of pipeline.* fields")
    args = parser.parse_args(argv)
    with worker_process(process) as process:
        return _serve(args.role, args, json.loads(args.pipeline), process)


def _flow_run(role: str, args: argparse.Namespace, pipeline: dict) -> tuple[Any, dict, list]:
    """The flow ``role``'s next flow run runs, its parameters and its tags."""
    from flows.observe import worker_tags

    if role == "learner":
        from flows.learner import learner_flow

        params = {"run": args.run, "bucket": args.bucket, "region": args.region,
                  "index": args.index, "pipeline": pipeline, "continued": True}  # fmt: skip
        return learner_flow, params, worker_tags(args.run, args.region, f"learner:{args.index}")
    from flows.syncer import syncer_flow

    params = {"run": args.run, "regions": json.loads(args.regions), "home": args.home,
              "shard": args.shard, "shards": args.shards, "pipeline": pipeline}  # fmt: skip
    return syncer_flow, params, worker_tags(args.run, args.home, "syncer")


def _serve(role: str, args: argparse.Namespace, pipeline: dict, process: WorkerProcess) -> int:
    """Run ``role``'s flow runs one after another until it is done (``main``)."""
    from prefect.exceptions import CancelledRun

    from flows.observe import run_linked
    from storage_layout.bucket import BucketError  # slow imports: after argument errors

    def interrupted(signum: int, frame: object) -> None:
        process.stop.set()
        raise KeyboardInterrupt  # the learner flow checkpoints on its way out

    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    if role == "learner":
        from flows.hosts import join

        process.take_sigterm()  # a first SIGTERM is a preemption notice: send, leave
        join()  # one of a learner's several processes: join the others
    try:
        while True:
            flow, params, tags = _flow_run(role, args, pipeline)
            result = run_linked(flow, params, os.environ, tags)
            if result["done"]:
                return 0
            if result.get("preempted"):
                return 128 + signal.SIGTERM  # it left as told: ended by SIGTERM, cleanly
            if process.stop.is_set():  # the stop came as the flow run ended: it stops here
                raise KeyboardInterrupt
    except (KeyboardInterrupt, CancelledRun):  # (its flow run ended Cancelled)
        if role == "learner":
            from flows.learner import stop_between_flow_runs

            stop_between_flow_runs()
        print("interrupted", file=sys.stderr)
        return 130
    except BucketError as exc:  # a region down: the launcher retries with backoff
        print(f"error: {exc}", file=sys.stderr)
        time.sleep(1)
        return 1
    except Exception as exc:
        if not api_away(exc) and prefect_api_reachable():
            raise
        import traceback

        traceback.print_exc()
        print(f"error: the Prefect API at {os.environ.get('PREFECT_API_URL')} is away "
              f"({type(exc).__name__}: {str(exc)[:200]}); exiting with status {API_DOWN} "
              "(the launcher waits for it)", file=sys.stderr)  # fmt: skip
        return API_DOWN


def follow(flow_run_id: str | None = None) -> int:
    """Run a follower of a learner whose leader is a flow run of a ``learner/REGION``
    deployment (its process 0, on another node): the same flow with the same parameters,
    read from that flow run (``PREFECT__FLOW_RUN_ID``, which Prefect sets in every pod
    or process of the flow run's job), as a flow run of its own, once. The leader's flow
    run ends after the same rounds (the group's decisions agree), and so does this one."""
    from prefect import get_client
    from prefect.exceptions import CancelledRun

    from flows.hosts import join
    from flows.learner import learner_flow

    flow_run_id = flow_run_id or os.environ.get("PREFECT__FLOW_RUN_ID")
    if not flow_run_id:
        raise ValueError("a follower needs the leader's flow run: set PREFECT__FLOW_RUN_ID")
    with get_client(sync_client=True) as client:
        parameters = client.read_flow_run(flow_run_id).parameters
    join()
    try:
        learner_flow(**parameters)
    except CancelledRun:  # stopped by a signal: it checkpointed (observe.stopped)
        return 130
    return 0


class WarmUp:
    """A spare's warm-up for a learner of the run (``flows.learner_runtime.warm_up``) in a thread
    of its own, so that a job that comes first does not wait for it. A spare that becomes
    a syncer ends it at its next step (``not_needed``): it compiles no learner's step it
    would never run (seconds of a core, beside the learners starting on it)."""

    class Stopped(Exception):
        """Raised inside the warm-up to end it: not needed."""

    def __init__(self, warm: dict[str, str]):
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(warm,), daemon=True)
        self.thread.start()

    def _go_on(self) -> None:
        if self._stop.is_set():
            raise self.Stopped

    def _run(self, warm: dict[str, str]) -> None:
        from flows.learner_runtime import warm_up

        try:
            warm_up(**warm, go_on=self._go_on)
        except self.Stopped:
            pass
        except Exception as exc:  # a spare that could not warm up still serves, cold
            print(f"warm-up failed, the worker will start cold: {exc!r}", file=sys.stderr)

    def not_needed(self) -> None:
        self._stop.set()


def standby(warm: dict[str, str] | None = None) -> int:
    """A spare worker (``flows.spares``): do the slow imports now (and, given the
    run in ``warm``, build its model and compile its train step: ``--warm JSON``), then
    wait for one line on stdin, ``{"argv": [...], "env": {...}, "log": PATH}``, and become
    that worker: its environment, its log on stdout and stderr, its command line. End
    quietly when stdin closes first (the launcher needs no more workers, or is gone).

    Only what is read when used may differ from the spare's own environment (the keys,
    the fault plan's salt); Prefect's and JAX's settings are the launcher's for both."""
    try:
        # The slow part, done ahead of need.
        import flows.learner
        import flows.syncer  # noqa: F401

        warming = WarmUp(warm) if warm else None
        line = sys.stdin.readline()
    except KeyboardInterrupt:
        return 130
    if not line.strip():
        return 0
    job = json.loads(line)
    if warming is not None and job["argv"][:1] != ["learner"]:
        warming.not_needed()
    fd = os.open(job["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(job["env"])
    return main(job["argv"])


def zygote() -> int:
    """A fork server for spares (``flows.spares.Zygote`` drives it): import what a
    worker needs once, then fork a spare for each request, so a spare costs its warm-up
    (model, compiled step, corpus), not the seconds of imports again. Nothing here starts
    a thread before forking (the imports start none, and a JAX backend is started only
    in the children), so a fork is safe.

    One JSON object a line on stdin: ``{"spawn": N, "log": PATH, "warm": {...} | null}``
    forks spare N (its output to PATH) and answers ``{"spawned": N, "pid": P}`` on
    stdout; ``{"job": N, "line": TEXT}`` hands spare N its job (its stdin line); every
    spare that ends is answered ``{"exit": N, "code": C}`` (C as ``Popen.returncode``).
    When stdin closes, the idle spares are told to end (their stdin closes) and the
    zygote ends once every child has.

    Why by hand: ``multiprocessing``'s fork server imports in the launcher's environment,
    not the worker's (Prefect reads its settings at import), gives its children no
    stdin, and ends them with ``os._exit``, which skips Prefect's flush of their logs."""
    import flows.learner
    import flows.syncer  # noqa: F401

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the workers: report them
    server = _ForkServer()
    pending = b""
    while server.reading or server.children:
        if server.reading and server.sel.select(timeout=0.05):
            chunk = os.read(0, 1 << 16)
            if not chunk:
                server.stop_reading()
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                msg = json.loads(line)
                if "job" in msg:
                    server.give(msg["job"], (msg["line"].rstrip("\n") + "\n").encode())
                elif server.fork(msg) == 0:  # the spare
                    return standby(msg.get("warm"))
        elif not server.reading:
            time.sleep(0.05)
        server.reap()
    return 0


class _ForkServer:
    """The zygote's bookkeeping: its answers (stdout, the launcher's), each spare's stdin
    until its job is given, and its children."""

    def __init__(self) -> None:
        import selectors

        self.answers = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)  # stray prints go to the zygote's log, not into the answers
        self.jobs: dict[int, int] = {}  # spare -> the write end of its stdin, until its job
        self.children: dict[int, int] = {}  # pid -> spare
        self.sel = selectors.DefaultSelector()
        self.sel.register(0, selectors.EVENT_READ)
        self.reading = True

    def answer(self, **msg: object) -> None:
        with contextlib.suppress(OSError):  # the launcher is gone: nobody to tell
            self.answers.write(json.dumps(msg) + "\n")

    def give(self, spare: int, line: bytes) -> None:
        fd = self.jobs.pop(spare, None)
        if fd is None:
            return
        with contextlib.suppress(OSError):  # it ended before its job: reported as it exits
            os.write(fd, line)
        os.close(fd)

    def stop_reading(self) -> None:
        self.reading = False
        for spare in list(self.jobs):
            self.give(spare, b"")  # idle spares end quietly

    def fork(self, msg: dict[str, Any]) -> int:
        """Fork spare ``msg["spawn"]``: 0 in the spare (its own stdin and log, the default
        Ctrl-C), its pid in the zygote."""
        read_end, write_end = os.pipe()
        zygote_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            die_with_parent(signal.SIGTERM, zygote_pid)  # (a fork clears it)
            os.dup2(read_end, 0)
            for fd in (read_end, write_end, *self.jobs.values()):
                os.close(fd)
            self.answers.close()
            self.sel.close()
            fd = os.open(msg["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            return 0
        os.close(read_end)
        self.jobs[msg["spawn"]], self.children[pid] = write_end, msg["spawn"]
        self.answer(spawned=msg["spawn"], pid=pid)
        return pid

    def reap(self) -> None:
        """Answer each spare that ended."""
        while self.children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return
            spare = self.children.pop(pid, None)
            if spare is not None:
                self.give(spare, b"")
                self.answer(exit=spare, code=os.waitstatus_to_exitcode(status))


PARENT_ENV = "DILOCO_PARENT_PID"  # the launcher's pid, as it starts a worker


if __name__ == "__main__":
    # A worker dies with its launcher (SIGTERM: a learner checkpoints first), rather than
    # train on unsupervised; one whose launcher is already gone stops at once.
    parent = os.environ.get(PARENT_ENV)
    die_with_parent(signal.SIGTERM, int(parent) if parent else None)
    if sys.argv[1:2] == ["standby"]:
        warm = json.loads(sys.argv[3]) if sys.argv[2:3] == ["--warm"] else None
        sys.exit(standby(warm))
    if sys.argv[1:2] == ["zygote"]:
        sys.exit(zygote())
    if sys.argv[1:2] == ["follow"]:
        sys.exit(follow(sys.argv[2] if len(sys.argv) > 2 else None))
    sys.exit(main())
