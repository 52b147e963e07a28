"""What the flows show people: run loggers, artifact keys, flow-run tags and the rows of
a run's summary (the CLI's table and the launcher's markdown artifact share them).

Prefect is imported inside the functions: the `diloco` command imports this module at
start-up and most of its subcommands never touch Prefect.
"""

from __future__ import annotations

import contextvars
import logging
import math
import os
import re
import stat
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from protocol.topology import learner_index

log = logging.getLogger(__name__)

QUIET_SECONDS = 60.0  # one kind of failure to report is logged at most this often


def run_logger(fallback: str) -> Any:
    """Prefect's run logger inside a flow or task run, else the standard logger
    ``fallback`` (the runtimes are also driven directly, in tests). A process that has
    not imported Prefect is in no run, and is spared its import (seconds)."""
    if "prefect" not in sys.modules:
        return logging.getLogger(fallback)
    from prefect import get_run_logger

    try:
        return get_run_logger()
    except Exception:
        return logging.getLogger(fallback)


REPORT_SECONDS = 10.0  # the watch waits at most this long for a report to the Prefect API


class BestEffort:
    """Calls for what only reports (a progress or summary artifact, the live metrics'
    tables): each run off the calling thread and waited for at most ``wait`` seconds, so
    an API that is gone (whose client retries for minutes) never holds up the watch or a
    Ctrl-C; one at a time per call (one still under way skips the next). A failure or a
    call that takes too long is logged by name, at most once every ``QUIET_SECONDS`` per
    call, and never raised: the run needs none of it. The launcher's watch and
    supervisors hold one, and each learner process for its round table: a learner
    trains on while the API is away."""

    def __init__(self) -> None:
        self.reported: dict[str, float] = {}  # call -> when its failure was last logged
        self.running: dict[str, threading.Thread] = {}  # call -> its call still under way

    def __call__(self, call: Callable[..., Any], *args: Any, wait: float = REPORT_SECONDS,
                 label: str | None = None, **kwargs: Any) -> Any:  # fmt: skip
        """``call(*args, **kwargs)``'s result, or None; ``label`` names the call in the log
        (one at a time per label; the call's name by default)."""
        name = label or getattr(call, "__name__", str(call))

        def report(what: str) -> None:
            now = time.monotonic()
            if now - self.reported.get(name, -math.inf) >= QUIET_SECONDS:
                self.reported[name] = now
                log.warning("%s %s; the run goes on without it", name, what)

        busy = self.running.get(name)
        if busy is not None and busy.is_alive():
            busy.join(wait)
            if busy.is_alive():
                report("is still waiting on an earlier call (the Prefect API may be down)")
                return None
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["value"] = call(*args, **kwargs)
            except Exception as exc:
                report(f"failed ({type(exc).__name__}: {str(exc)[:300]})")

        context = contextvars.copy_context()  # (the flow run's, for the artifacts' links)
        thread = threading.Thread(target=context.run, args=(run,), daemon=True, name=name)
        self.running[name] = thread
        thread.start()
        thread.join(wait)
        if wait > 0 and thread.is_alive():
            report(f"did not answer in {wait:.0f} s")
        return result.get("value")

    def drain(self, timeout: float = REPORT_SECONDS) -> None:
        """Wait, at most ``timeout`` seconds in all, for the calls still under way (before
        the flow run or the process that would end them ends)."""
        deadline = time.monotonic() + timeout
        for thread in list(self.running.values()):
            thread.join(max(0.0, deadline - time.monotonic()))


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys: lowercase letters, digits and dashes."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")


class LiveTable:
    """A table artifact kept as one artifact and updated in place as its rows change (a
    keyed artifact created again is a new version: hundreds in a long run). Made on the
    first ``show`` (linked to the flow run then current), updated from then on."""

    def __init__(self, key: str, description: str):
        self.key, self.description = key, description
        self.id: Any = None
        self.rows: list[dict[str, Any]] | None = None  # as last shown

    def show(self, rows: list[dict[str, Any]]) -> None:
        """Show ``rows`` (nothing is sent when they did not change); raises what the
        Prefect API raises: a caller for whom the table is best effort catches it."""
        from prefect.artifacts import ArtifactUpdate, TableArtifact, create_table_artifact
        from prefect.client.orchestration import get_client

        if rows == self.rows:
            return
        if self.id is None:
            self.id = create_table_artifact(rows, key=self.key, description=self.description)
        else:
            data = TableArtifact(table=rows).format(_sync=True)
            with get_client(sync_client=True) as client:
                client.update_artifact(self.id, ArtifactUpdate(data=data))
        self.rows = rows


class PipeSafe:
    """An output stream that outlives its reader. A flow run of a deployment writes to a
    pipe its Prefect worker reads; should that worker die, the next write would raise
    ``BrokenPipeError``, on which Prefect's console handler (rich) ends the process with
    ``SystemExit(1)`` and the flow run with it. Here the descriptor is pointed at
    ``/dev/null`` instead, once, and the process goes on: its logs still reach the
    Prefect API, and the bucket holds its work."""

    def __init__(self, stream: Any):
        self.stream = stream
        self.broken = False

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._to_null()
            return self.stream.write(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._to_null()
            self.stream.flush()

    def _to_null(self) -> None:
        if self.broken:
            raise BrokenPipeError("the output stream is broken even after /dev/null")
        self.broken = True
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, self.stream.fileno())  # (its children and C code write there too)
        os.close(null)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _a_pipe(stream: Any) -> bool:
    try:
        return stat.S_ISFIFO(os.fstat(stream.fileno()).st_mode)
    except (AttributeError, OSError, ValueError):  # (no descriptor: a test's capture)
        return False


def outlive_the_reader() -> None:
    """Make this process's standard output and error, where they are pipes (a Prefect
    worker reads them), and every logging handler writing to them (Prefect's console
    handler included), ``PipeSafe``: a flow run goes on when whoever reads its output
    dies. Once per stream."""
    swapped = {}
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, PipeSafe) and _a_pipe(stream):
            swapped[id(stream)] = PipeSafe(stream)
            setattr(sys, name, swapped[id(stream)])
    if not swapped:
        return
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            safe = swapped.get(id(getattr(handler, "stream", None)))
            if safe is None:
                continue
            handler.stream = safe
            console = getattr(handler, "console", None)  # Prefect's: a rich Console
            if console is not None:
                console.file = safe


def worker_tags(run: str, region: str, role: str) -> list[str]:
    """The tags of a learner's (``role`` "learner:N") or a syncer's flow runs."""
    return [f"run:{run}", f"region:{region}", role]


def tag_flow_run(tags: list[str]) -> None:
    """Tag the current flow run (run, region, role) so the UI can filter on them.

    Set on the flow run itself rather than through ``prefect.tags(...)``: task runs
    inherit context tags, and a tagged task run makes two concurrency-limit calls to the
    API on every start and end, which stalls rounds whenever the API is busy."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    try:
        ctx = FlowRunContext.get()
        if ctx is None or ctx.flow_run is None:
            return
        current = set(ctx.flow_run.tags or [])
        if current >= set(tags):  # created with them (``run_linked``): no API call
            return
        with get_client(sync_client=True) as client:
            client.update_flow_run(ctx.flow_run.id, tags=sorted(current | set(tags)))
    except Exception as exc:  # tags are for people; never stop training for them
        run_logger("diloco").warning("could not tag the flow run: %s", exc)


# A process the launcher starts learns from these which task run started it, so that its
# flow runs show up as subflows of the launcher's flow run (``flows.worker``).
PARENT_FLOW_RUN_ENV = "DILOCO_PARENT_FLOW_RUN"
PARENT_TASK_RUN_ENV = "DILOCO_PARENT_TASK_RUN"


def parent_env() -> dict[str, str]:
    """The current task run and its flow run as environment variables for a process it
    starts (empty outside a task run): the process links its own flow runs under it."""
    from prefect.context import TaskRunContext

    ctx = TaskRunContext.get()
    if ctx is None:
        return {}
    return {PARENT_FLOW_RUN_ENV: str(ctx.task_run.flow_run_id),
            PARENT_TASK_RUN_ENV: str(ctx.task_run.id)}  # fmt: skip


def linked_flow_run(flow: Any, parameters: dict[str, Any], env: Any, tags: list[str] = ()) -> Any:
    """A new flow run of ``flow``, a subflow of the task run that ``env`` names
    (``parent_env``), or None when it names none.

    Prefect links a flow run to its parent through a task run in the parent's flow run
    that stands for it (``parent_task_run_id``), as ``run_deployment`` and in-process
    subflows do; that task run is created here, with the launcher's task run as its
    upstream, and the server keeps its state in step with the flow run's."""
    from uuid import UUID, uuid4

    from prefect import Task
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import TaskRunResult
    from prefect.states import Pending

    parent_flow_run, parent_task_run = env.get(PARENT_FLOW_RUN_ENV), env.get(PARENT_TASK_RUN_ENV)
    if not (parent_flow_run and parent_task_run):
        return None
    # Named now, as the flow's ``flow_run_name`` names it when it starts: a worker killed
    # before it starts leaves a Pending flow run the UI (and a search by name) can place.
    template = flow.flow_run_name
    name = template.format(**parameters) if isinstance(template, str) else None
    stand_in = Task(name=name or flow.name, fn=lambda: None)
    stand_in.task_key = f"{__name__}.linked_flow_run.{flow.name}"
    with get_client(sync_client=True) as client:
        task_run = client.create_task_run(
            task=stand_in,
            flow_run_id=UUID(parent_flow_run),
            dynamic_key=uuid4().hex,
            task_inputs={"__parents__": [TaskRunResult(id=UUID(parent_task_run))]},
            state=Pending(),
        )
        return client.create_flow_run(
            flow=flow,
            name=name,
            parameters=flow.serialize_parameters(parameters),
            state=Pending(),
            parent_task_run_id=task_run.id,
            tags=list(tags),
        )


def crash_linked(env: Any, name: str, why: str) -> int:
    """Set Crashed, saying ``why``, each unfinished flow run named ``name`` that a process
    started with ``env`` (``parent_env``) linked under its task run, and the task runs
    inside it left unfinished (a learner's round): a process that was killed or died
    cannot end them, and the UI would show them Running (or Pending) for ever. Returns how
    many flow runs; links are for people: a caller catches what the API raises."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterName,
        FlowRunFilterParentFlowRunId,
        FlowRunFilterState,
        FlowRunFilterStateType,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    parent_flow_run, parent_task_run = env.get(PARENT_FLOW_RUN_ENV), env.get(PARENT_TASK_RUN_ENV)
    if not (parent_flow_run and parent_task_run):
        return 0
    unfinished = [StateType.PENDING, StateType.SCHEDULED, StateType.RUNNING,
                  StateType.PAUSED, StateType.CANCELLING]  # fmt: skip
    crashed = 0
    with get_client(sync_client=True) as client:
        flow_runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            name=FlowRunFilterName(any_=[name]),
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[UUID(parent_flow_run)]),
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=unfinished)),
        ))  # fmt: skip
        for flow_run in flow_runs:
            stand_in = client.read_task_run(flow_run.parent_task_run_id)
            parents = {str(p.id) for p in stand_in.task_inputs.get("__parents__", [])}
            if parent_task_run not in parents:  # a stand-by's of that name
                continue
            client.set_flow_run_state(flow_run.id, Crashed(message=why), force=True)
            crashed += 1
            inside = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])),
                task_run_filter=TaskRunFilter(state=TaskRunFilterState(
                    type=TaskRunFilterStateType(any_=unfinished))),
            )  # fmt: skip
            for task_run in inside:
                client.set_task_run_state(task_run.id, Crashed(message=why), force=True)
    return crashed


def stopped(what: str) -> Any:
    """The state a flow run told to stop returns (a Ctrl-C to `diloco train`, the
    launcher's SIGINT to its workers): Cancelled, saying ``what`` it did, not Crashed
    ("Crash detected!", an error in the log and in the Prefect UI, for a stop that was
    asked for). Whoever called the flow gets ``prefect.exceptions.CancelledRun``."""
    from prefect.states import Cancelled

    return Cancelled(message=what)


def run_linked(flow: Any, parameters: dict[str, Any], env: Any, tags: list[str] = ()) -> Any:
    """Call ``flow`` with ``parameters`` as a subflow of the task run ``env`` names (see
    ``linked_flow_run``), or as a flow run of its own when it names none or the link
    cannot be made (links are for people: training never waits on them)."""
    from prefect.flow_engine import run_flow

    try:
        flow_run = linked_flow_run(flow, parameters, env, tags)
    except Exception as exc:
        run_logger("diloco").warning("could not link the flow run to its launcher: %s", exc)
        flow_run = None
    if flow_run is None:
        return flow(**parameters)
    return run_flow(flow, flow_run=flow_run, parameters=parameters)


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def train_summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(metric, value) rows of a `diloco train` summary."""
    loss = "-"
    if summary.get("final_loss") is not None:
        start = summary.get("initial_loss")
        loss = f"{'?' if start is None else format(start, '.4f')} -> {summary['final_loss']:.4f}"
        if summary.get("launch_loss") not in (None, start):  # a resumed run
            loss += f" (this launch began at {summary['launch_loss']:.4f})"
    ratio = summary.get("bandwidth_ratio_vs_dp")
    return [*_base_rows(summary, loss, ratio), *_chaos_rows(summary.get("chaos"))]


def _chaos_rows(chaos: dict[str, Any] | None) -> list[tuple[str, str]]:
    """What was done to the run on purpose, and what a learner kill cost."""
    if not chaos:
        return []
    rejoin = chaos.get("kill_to_rejoin") or {}
    missed = chaos.get("missed") or []  # actions at shares of the run it ended before
    return [
        ("chaos", " · ".join(f"{k.replace('_', ' ')} {v}" for k, v in chaos["actions"].items()) or "-"),
        *([("chaos missed (run ended first)", " · ".join(missed))] if missed else []),
        ("storage faults", " · ".join(f"{k} {v}" for k, v in chaos["faults"].items()) or "-"),
        ("kill to next contribution",
         f"median {rejoin['median']:.1f} s · p90 {rejoin['p90']:.1f} s ({rejoin['n']} kills)"
         if rejoin else "-"),
    ]  # fmt: skip


def _learners(summary: dict[str, Any]) -> str:
    """The run's learner slots, or, where this launch started fewer or learners joined
    (``diloco join``), who took part: ``2 started + 2 joined (4 slots + 1 added)``."""
    m, joined = summary["learners"], summary.get("joined") or []
    started = summary.get("started", m)
    if started == m and not joined:
        return str(m)
    added = sum(1 for lid in joined if learner_index(lid) >= m)  # beyond the spec's slots
    slots = f"{m} slots" + (f" + {added} added" if added else "")
    return f"{started} started + {len(joined)} joined ({slots})"


def _base_rows(summary: dict[str, Any], loss: str, ratio: float | None) -> list[tuple[str, str]]:
    speed = summary.get("tokens_per_second")  # (a summary written before it: none)
    return [
        ("mode", summary["mode"]),
        ("parameters", f"{summary['params']:,}"),
        ("learners / quorum", f"{_learners(summary)} / {summary['quorum']}"),
        *([("given up", ", ".join(summary["failed"]))] if summary.get("failed") else []),
        ("tokens", f"{summary['tokens']:,}"),
        ("validation loss", loss),
        ("wall time", f"{summary['wall_seconds']:.0f} s"),
        *([("speed", f"{speed:,.0f} tokens/s over this launch")] if speed is not None else []),
        ("goodput", f"{summary['goodput']:.1%}"),
        (
            "learner time",
            " · ".join(f"{k} {v:.0%}" for k, v in summary.get("time_breakdown", {}).items()) or "-",
        ),
        ("global versions", " ".join(f"f{p}:v{v}" for p, v in summary["versions"].items())),
        ("rejected contributions", str(summary["rejected"])),
        *_traffic_rows(summary),
        ("learners' bytes up + down", human_bytes(summary["learner_bytes"])),
        ("cross-region bytes", human_bytes(summary["cross_region_bytes"])),
        ("data-parallel would move", human_bytes(summary["dp_bytes"])),
        ("bandwidth saving vs dp", f"{ratio:.1f}x" if ratio else "-"),
        *_cost_rows(summary.get("cost")),
    ]


def _traffic_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """Bytes per region pair, and what they cost (a summary written before costs: none)."""
    dollars = (summary.get("cost") or {}).get("pairs", {})
    return [(f"bytes {pair}", human_bytes(t["bytes"])
             + (f" · {dollar(dollars[pair])}" if pair in dollars else ""))
            for pair, t in summary["traffic"].items()]  # fmt: skip


def dollar(x: float) -> str:
    """US dollars, to the cent, or to 4 significant figures below a dollar."""
    return f"${x:,.2f}" if x >= 1 else f"${x:.4g}"


def _cost_rows(cost: dict[str, Any] | None) -> list[tuple[str, str]]:
    """What the run's traffic cost (``diloco.cost``), its projection to the budget's end,
    and what data-parallel's would have."""
    if not cost:
        return []
    ahead = (
        "" if cost["projected"] is None else f"; {dollar(cost['projected'])} at the budget's end"
    )
    return [
        ("traffic cost", f"{dollar(cost['total'])} (bytes between regions "
                         f"{dollar(cost['egress'])}, requests {dollar(cost['requests'])}){ahead}"),
        ("data-parallel's egress", f"{dollar(cost['dp_egress'])} for "
                                   f"{human_bytes(cost['dp_cross_region_bytes'])} between regions"),
    ]  # fmt: skip
