"""One learner or syncer process: runs bounded flow runs one after another until done.

    python -m flows.worker learner --run R --bucket URL --region us-east --index 2
    python -m flows.worker syncer --run R --regions '{"us-east": "file:///..."}' \\
        --home us-east --shard 0 --shards 2

    python -m flows.worker standby [--warm JSON]  # a spare: imports, then reads its job
                                                  # from stdin

Every flow run resumes from the buckets (checkpoint or newest versions), so this process
can be killed at any point and started again. Exit status: 0 when the role is done,
130 when interrupted (after a checkpoint), 1 on an error (the launcher restarts it).

Started by the launcher, each flow run is a subflow of the launcher's task run that
started this process (``flows.observe.run_linked``): the launcher's flow run lists every
learner and syncer flow run of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time


def main(argv: list[str] | None = None) -> int:
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
    pipeline = json.loads(args.pipeline)

    from flows.observe import run_linked, worker_tags
    from storage_layout.bucket import BucketError  # slow imports: after argument errors

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # the learner flow checkpoints on its way out

    signal.signal(signal.SIGTERM, interrupted)
    try:
        while True:
            if args.role == "learner":
                from flows.learner import learner_flow

                params = {"run": args.run, "bucket": args.bucket, "region": args.region,
                          "index": args.index, "pipeline": pipeline}  # fmt: skip
                tags = worker_tags(args.run, args.region, f"learner:{args.index}")
                result = run_linked(learner_flow, params, os.environ, tags)
            else:
                from flows.syncer import syncer_flow

                params = {"run": args.run, "regions": json.loads(args.regions),
                          "home": args.home, "shard": args.shard, "shards": args.shards,
                          "pipeline": pipeline}  # fmt: skip
                tags = worker_tags(args.run, args.home, "syncer")
                result = run_linked(syncer_flow, params, os.environ, tags)
            if result["done"]:
                return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BucketError as exc:  # a region down: the launcher retries with backoff
        print(f"error: {exc}", file=sys.stderr)
        time.sleep(1)
        return 1


def _warm_up(warm: dict[str, str]) -> None:
    import flows.learner

    try:
        flows.learner.warm_up(**warm)
    except Exception as exc:  # a spare that could not warm up still serves, cold
        print(f"warm-up failed, the worker will start cold: {exc!r}", file=sys.stderr)


def standby(warm: dict[str, str] | None = None) -> int:
    """A spare worker (``flows.launcher.Spares``): do the slow imports now (and, given the
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

        if warm:  # in the background: a job that comes first must not wait for it
            threading.Thread(target=_warm_up, args=(warm,), daemon=True).start()
        line = sys.stdin.readline()
    except KeyboardInterrupt:
        return 130
    if not line.strip():
        return 0
    job = json.loads(line)
    fd = os.open(job["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(job["env"])
    return main(job["argv"])


if __name__ == "__main__":
    if sys.argv[1:2] == ["standby"]:
        warm = json.loads(sys.argv[3]) if sys.argv[2:3] == ["--warm"] else None
        sys.exit(standby(warm))
    sys.exit(main())
