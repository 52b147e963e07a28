"""A learner as a group of processes: joining ``jax.distributed``, and starting and
supervising the group on one machine.

    python -m flows.hosts --processes 2 -- python -m flows.worker learner --run R ...

starts the command N times, process i with ``DILOCO_PROCESS_ID=i``,
``DILOCO_PROCESS_COUNT=N`` and ``DILOCO_COORDINATOR=127.0.0.1:PORT`` (a free port, or
``--port``), and ends when they end. The group lives and dies as one learner: when one
of its processes ends with an error or a signal, the others are killed at once (their
collectives would wait on it) and the group ends the way that one did, so the
launcher's one restart policy (``flows.supervision.Restarts``) restarts the whole learner,
which rejoins from the bucket like any other (``LearnerLoop.start``). On several nodes a
deployment sets the same three variables itself (``docs/deploy.md``); a peer that
vanishes there is noticed by the coordination service's heartbeat.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

from infra.processes import die_with_parent

COORDINATOR_ENV = "DILOCO_COORDINATOR"  # host:port of process 0's coordination service
PROCESS_ID_ENV = "DILOCO_PROCESS_ID"  # this process's index in its learner (0: the leader)
PROCESS_COUNT_ENV = "DILOCO_PROCESS_COUNT"  # processes of the learner
HEARTBEAT_ENV = "DILOCO_HEARTBEAT_SECONDS"
INDEXED_JOB_ENV = "JOB_COMPLETION_INDEX"  # a Kubernetes indexed Job's pod index
HEARTBEAT_SECONDS = 30  # a peer silent this long is taken for dead (JAX's default: 100)
PARENT_ENV = "DILOCO_PARENT_PID"  # as flows.worker: a process dies with its parent


def join(env: os._Environ[str] | dict[str, str] = os.environ) -> int:
    """Join this process's learner group when the environment names one of more than one
    process (``jax.distributed.initialize``, before any JAX computation); returns the
    group's size. On CPUs the processes' collectives go over gloo. A process whose peer
    stops answering for ``DILOCO_HEARTBEAT_SECONDS`` is stopped by JAX's coordination
    service, never left hanging."""
    count = int(env.get(PROCESS_COUNT_ENV, "1"))
    if count <= 1:
        return 1
    import jax

    if jax.distributed.is_initialized():  # (a later flow run of the same process)
        return count
    index = env.get(PROCESS_ID_ENV, env.get(INDEXED_JOB_ENV))
    coordinator = env.get(COORDINATOR_ENV)
    if index is None or not coordinator:
        raise ValueError(
            f"{PROCESS_COUNT_ENV}={count} needs {COORDINATOR_ENV} (host:port of process 0) "
            f"and {PROCESS_ID_ENV} (or {INDEXED_JOB_ENV}) for this process"
        )
    if not 0 <= int(index) < count:
        raise ValueError(f"{PROCESS_ID_ENV}={index} is not in 0..{count - 1}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices only
    # One CPU computation at a time: dispatched ahead, a train step's all-reduce and the
    # next broadcast ran at once on the CPU client's threads, in different orders in the
    # processes, and deadlocked (seen under load). GPUs keep their streams' order.
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    heartbeat = int(env.get(HEARTBEAT_ENV, HEARTBEAT_SECONDS))
    jax.distributed.initialize(
        coordinator, count, int(index), heartbeat_timeout_seconds=heartbeat,
        initialization_timeout=300, shutdown_timeout_seconds=heartbeat,
    )  # fmt: skip
    return count


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(argv: list[str], processes: int, port: int | None = None) -> int:
    """Run ``argv`` as a group of ``processes`` processes; returns an exit status (the
    first failed member's; the negative of a signal that ended it)."""
    port = port or free_port()
    procs: list[subprocess.Popen] = []
    for i in range(processes):
        env = {**os.environ, COORDINATOR_ENV: f"127.0.0.1:{port}", PROCESS_ID_ENV: str(i),
               PROCESS_COUNT_ENV: str(processes), PARENT_ENV: str(os.getpid())}  # fmt: skip
        procs.append(subprocess.Popen(argv, env=env))

    def stop(signum: int, frame: object) -> None:  # the launcher stops: the group with it
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        codes = [p.poll() for p in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            index, code = failed[0]
            for p in procs:
                if p.poll() is None:
                    p.kill()  # its collectives would wait for the one that is gone
            for p in procs:
                p.wait()
            print(f"learner process {index} of {processes} ended with status {code}; "
                  f"stopped the others", file=sys.stderr, flush=True)  # fmt: skip
            return code
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.hosts")
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.processes < 1 or not command:
        parser.error("needs --processes N (N >= 1) and a command after --")
    code = run_group(command, args.processes, args.port)
    if code < 0:  # ended as its member did: a kill is a kill to the launcher
        if -code != signal.SIGKILL:  # (SIGKILL has no handler to reset)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    parent = os.environ.get(PARENT_ENV)
    die_with_parent(signal.SIGTERM, int(parent) if parent else None)
    sys.exit(main())
