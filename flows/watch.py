"""The launcher's watch over its workers (``watch``): every ``pipeline.eval_seconds`` the
newest versions evaluated, the progress artifact, the live metrics and the display
updated, a progress line (or why the run stands still) logged, a stalled syncer shard
given a stand-by, a worker's end noted (given up, with why); between evaluations, the
learners' phases on a live display. Reports to the Prefect API are best effort."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from prefect.artifacts import update_progress_artifact
from prefect.states import State

from diloco.cost import bill
from diloco.liveness import Verdict
from diloco.rate import Rate, duration_text, rate_text
from flows.display import Display
from flows.metrics import LiveMetrics
from flows.monitor import STARTUP, Monitor, RunStalled, cross_region_bytes
from flows.observe import BestEffort, LiveTable, artifact_key
from flows.supervision import STAND_BY
from flows.worker_table import worker_rows
from storage_layout.commit import CorruptVersion

log = logging.getLogger(__name__)


def flush_prefect(timeout: float = 10.0) -> None:
    """Send the logs and events still queued to the API (before a local server stops)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=timeout)


def watch(names: list[str], futures: list[Any], monitor: Monitor, bar: Any, every: float,
           log: Any, display: Display | None = None, metrics: LiveMetrics | None = None,
           stand_by: Callable[[str], tuple[str, Any] | None] | None = None,
           oom: Mapping[str, int] | None = None, report: BestEffort | None = None,
           signalled: threading.Event | None = None) -> dict[str, float]:  # fmt: skip
    """Evaluate and log progress every ``every`` seconds until every worker's task has
    ended; returns when each ended (its machine was freed: the end of its allocation).
    Each evaluation also updates the progress artifact, the live ``metrics`` and the
    ``display``; a live display also shows the learners' phases every few seconds. A
    syncer shard seen stalled gets a stand-by (``stand_by(name)``: the name and future of
    the worker it started, watched from then on like the others). ``oom``: how many times
    the OOM killer killed each worker (``LaunchMode.oom_kills``). ``signalled`` (the
    launch's: a Ctrl-C whose KeyboardInterrupt may have been swallowed on its way) ends
    the watch with a KeyboardInterrupt within half a second."""
    display, report = display or Display(), report or BestEffort()
    last_eval = last_look = time.monotonic()
    ended: dict[str, float] = {}
    given_up: list[str] = []
    started = False  # every learner has started up: progress lines from then on
    rates = Pace()  # speed and time left
    table: LiveTable | None = None  # the workers' table artifact, made at the first look
    # The thread pool's own futures, waited on plainly: ``prefect.futures.wait`` with a
    # timeout arms an asynchronous exception (an alarm signal in the main thread), which
    # can land inside a lock and end a run with "release unlocked lock".
    pool = [f.wrapped_future for f in futures]
    while True:
        if signalled is not None and signalled.is_set():
            raise KeyboardInterrupt
        running = concurrent.futures.wait(pool, timeout=0.5).not_done
        _note_ends(names, pool, ended, given_up, log)
        if not running:
            return ended
        if time.monotonic() - last_eval < every:
            if display.live and time.monotonic() - last_look >= LOOK_SECONDS:
                last_look = _look(display, monitor, oom)
            continue
        last_eval = last_look = time.monotonic()
        errors, statuses = monitor.errors, monitor.statuses()
        point = _evaluate(monitor, statuses, errors, every, log)
        if point is None:
            continue
        pct = monitor.progress(statuses)
        steps = monitor.steps(statuses)
        rates.add(time.monotonic(), point["tokens"], pct, steps, point["versions"])
        pace = rates.text()
        verdicts = monitor.verdicts(statuses)
        statuses = monitor.phases(statuses)
        still = _standstill(monitor, verdicts, point, pct, log)
        for name, future in _stand_bys(monitor, statuses, verdicts, point, stand_by):
            names.append(name)  # watched from now on like the others
            futures.append(future)
            pool.append(future.wrapped_future)
        if bar is not None:
            report(update_progress_artifact, bar, pct, progress_note(monitor, statuses, pace))
        table = _show_workers(monitor, statuses, verdicts, display, bar, report, table)
        show_phases(display, statuses, point["versions"], point, pct, oom, pace)
        if metrics is not None:
            report(report_metrics, metrics, monitor, point, statuses, rates)
        if still is None:  # (else said above)
            started = _progress_line(log, statuses, point, pct, rates, oom, started)


def _look(display: Display, monitor: Monitor, oom: Mapping[str, int] | None) -> float:
    """The learners' phases in the live display between evaluations (by the heartbeats
    of the last one; a failed read shows the last state read); returns when it looked."""
    when = time.monotonic()
    show_phases(display, monitor.phases(monitor.statuses()), monitor.versions(), oom=oom)
    return when


def _show_workers(monitor: Monitor, statuses: dict[str, dict], verdicts: dict[str, Verdict],
                  display: Display, bar: Any, report: BestEffort, table: LiveTable | None
                  ) -> LiveTable | None:  # fmt: skip
    """What every worker is doing (``flows.worker_table``), in the display and, beside the
    progress artifact (``bar``), in the run's workers' table artifact (``table``, made at
    the first look); returns that table."""
    rows = worker_rows(monitor, statuses, verdicts)
    display.workers(rows)
    if bar is None:
        return table
    run = monitor.store.run
    table = table or LiveTable(
        artifact_key(run, "workers"), f"run {run}: what every worker is doing"
    )
    report(table.show, rows)
    return table


def _stand_bys(monitor: Monitor, statuses: dict[str, dict], verdicts: dict[str, Verdict],
               point: dict[str, Any], stand_by: Callable[[str], tuple[str, Any] | None] | None
               ) -> list[tuple]:  # fmt: skip
    """The name and future of a stand-by started for each syncer shard seen stalled (each
    warned about, with or without one)."""
    stalled = monitor.stalled_syncers(statuses, point["versions"], verdicts)
    started = [stand_by(name) for name in stalled] if stand_by is not None else []
    return [extra for extra in started if extra is not None]


def _standstill(monitor: Monitor, verdicts: dict[str, Verdict], point: dict[str, Any],
                pct: float, log: Any) -> tuple | None:  # fmt: skip
    """Why the run stands still (said, in place of the same progress line again), or
    None; ``RunStalled`` when it cannot move by itself."""
    still = monitor.standstill(point["versions"], verdicts)
    if still is None:
        return None
    log.warning("%5.1f%% | %s", pct, still[1], extra=SHOWN)
    if monitor.hopeless(still[0], verdicts):
        raise RunStalled(
            f"the run cannot make progress by itself: {still[1]}. Every learner not done "
            "is silent and nobody takes its slot (a hung process holds it, or a dead one "
            "is not restarted): mend that, and the same command resumes the run"
        )
    return still


def _evaluate(monitor: Monitor, statuses: dict[str, dict], errors: int, every: float,
              log: Any) -> dict[str, Any] | None:  # fmt: skip
    """The newest versions' evaluation, or None when it failed (said: the workers go on,
    and so does watching them); storage is said to answer again if no read failed since
    the monitor counted ``errors``."""
    try:
        point = monitor.evaluate(statuses)
    except CorruptVersion as exc:
        log.error("evaluation failed, trying again in %.0f s: %r", every, exc)
        return None
    except Exception as exc:
        monitor.storage_error("evaluating the newest versions", exc)
        return None
    if monitor.errors == errors:
        monitor.storage_ok()
    return point


def _note_ends(names: list[str], pool: list[Any], ended: dict[str, float],
               given_up: list[str], log: Any) -> None:  # fmt: skip
    """Note when each worker whose task ended since the last look ended; name each one
    given up (a stand-by's end is only noted)."""
    for name, future in zip(names, pool, strict=True):
        if future.done() and name not in ended:
            ended[name] = time.time()
            why = None if name.endswith(STAND_BY) else failure(future)
            if why is not None:
                given_up.append(name)
                log.error("%s", given_up_line(name, why, names, given_up))


def _progress_line(log: Any, statuses: dict[str, dict], point: dict[str, Any], pct: float,
                   rates: Pace, oom: Mapping[str, int] | None, started: bool) -> bool:  # fmt: skip
    """Log where the learners' start-up is until every learner has started, then the
    progress line (``rates``: the run's recent rates and the time left, ``Pace``);
    returns whether they all have (``started``: they had already)."""
    starting = None if started else startup_line(statuses, point["versions"], oom)
    if starting:
        log.info("%s | validation loss %.4f", starting, point["loss"], extra=SHOWN)
        return False
    restarting = Counter(s.get("state") for s in statuses.values() if s.get("state") in STARTUP)
    log.info(
        "%5.1f%% | tokens %s at %s | validation loss %.4f | versions %s%s",
        pct,
        f"{point['tokens']:,}",
        rates.text(),
        point["loss"],
        rates.versions_text(point["versions"]),
        "".join(f" | {n} restarting ({phase})" for phase, n in restarting.items()),
        extra=SHOWN,
    )
    return True


def progress_note(monitor: Monitor, statuses: dict[str, dict[str, Any]], pace: str = "") -> str:
    """The progress artifact's description: what it measures, how fast it goes (``pace``,
    while the run goes on), and who trains where."""
    pace = f" (tokens at {pace})" if pace else ""
    return (f"run {monitor.store.run}: share of all learners' inner steps done{pace}; "
            f"{monitor.by_region(statuses)}")  # fmt: skip


class Pace:
    """The run's recent rates (``diloco.rate``), from what the launcher reads at each
    evaluation: the merged tokens, the budget's share (the time left), the learners'
    inner steps and the fragments' versions (their mean over the fragments)."""

    def __init__(self) -> None:
        self.tokens, self.share, self.steps, self.versions = Rate(), Rate(), Rate(), Rate()

    def add(self, when: float, tokens: float, pct: float, steps: float,
            versions: Mapping[int, int]) -> None:  # fmt: skip
        self.tokens.add(when, tokens)
        self.share.add(when, pct)
        self.steps.add(when, steps)
        self.versions.add(when, sum(versions.values()) / max(len(versions), 1))

    def text(self) -> str:
        """``9,412/s | 25 s left | 12.5 steps/s``: the tokens' rate, the time left at
        the budget's rate (``time left unknown`` until the run moves), the steps' rate."""
        left = self.share.time_to(100.0)
        steps = self.steps.per_second()
        return " | ".join([
            rate_text(self.tokens.per_second()),
            "time left unknown" if left is None else f"{duration_text(left)} left",
            f"{'?' if steps is None else f'{steps:,.1f}'} steps/s",
        ])  # fmt: skip

    def scalars(self) -> dict[str, float | None]:
        """The same for TensorBoard (None while unknown: not written)."""
        steps, versions = self.steps.per_second(), self.versions.per_second()
        return {
            "throughput/learner_steps_per_s": steps,
            "throughput/versions_per_min": None if versions is None else versions * 60,
            "time/seconds_left": self.share.time_to(100.0),
        }

    def versions_text(self, versions: Mapping[int, int]) -> str:
        """``f0:v12 f1:v11 at 3.2/min``: each fragment's newest version and how many a
        fragment gets a minute."""
        rate = self.versions.per_second()
        each = " ".join(f"f{p}:v{v}" for p, v in versions.items())
        return f"{each} at {'?' if rate is None else f'{rate * 60:,.1f}'}/min"


def failure(future: concurrent.futures.Future) -> BaseException | None:
    """The error a worker's finished task (its thread's future: a Prefect state) ended
    with; None when it ended well or was cancelled."""
    if future.cancelled():
        return None
    outcome = future.exception() or future.result()
    if isinstance(outcome, State) and outcome.is_failed():
        error = outcome.result(raise_on_failure=False)
        return error if isinstance(error, BaseException) else RuntimeError(outcome.message)
    return outcome if isinstance(outcome, BaseException) else None


def given_up_line(name: str, exc: BaseException, names: list[str], given_up: list[str]) -> str:
    """What the launcher says as it gives ``name`` up (``exc``: why), the moment it does:
    and, for a learner, when its region has no learner left (``names``: every worker
    watched; ``given_up``: those given up so far, ``name`` included)."""
    line = f"gave up on {name} ({first_line(reason(name, exc))}): the run goes on without it"
    region = name.split(" ")[-1].split("/")[0]
    mates = [n for n in names if n.startswith(f"learner {region}/")]
    if name.startswith("learner ") and set(mates) <= set(given_up):
        line += f"; region {region} has no learner left"
    return line


LOOK_SECONDS = 2.0  # how often a live display shows the learners' phases between evaluations


SHOWN = {"display": True}  # log lines a live display shows instead (flows/display.py)


def show_phases(
    display: Display,
    statuses: dict[str, dict[str, Any]],
    versions: dict[int, int],
    point: dict[str, Any] | None = None,
    pct: float | None = None,
    oom: Mapping[str, int] | None = None,
    pace: str = "",
) -> None:
    """Set the display's learner, first-contribution and training phases from the
    learners' status objects and the newest versions (and ``point``, an evaluation, with
    its ``pace``: ``Pace.text``)."""
    if not display.live:
        return
    counts, detail = learner_phases(statuses, oom)
    display.phase("learners", "running" if any(counts.get(p) for p in STARTUP) else "done", detail)
    shown = " ".join(f"f{p}:v{v}" for p, v in versions.items())
    if any(v > 0 for v in versions.values()):
        if display.state("first") != "done":  # the first versions merged, and when
            display.phase("first", "done", f"versions {shown}")
    else:
        display.phase("first", "running", "waiting for the first contribution to be merged")
    if counts.get("training") or counts.get("done") or any(v > 0 for v in versions.values()):
        display.phase("training", "running", "")
    if point is not None and pct is not None:
        at = f" at {pace.replace(' | ', ' · ')}" if pace else ""
        display.progress(pct, f"tokens {point['tokens']:,}{at} · validation loss "
                              f"{point['loss']:.4f} · versions {shown}")  # fmt: skip


def report_metrics(
    metrics: LiveMetrics,
    monitor: Monitor,
    point: dict[str, Any],
    statuses: dict[str, dict[str, Any]],
    rates: Pace | None = None,
) -> None:
    """Add what is new to the live metrics (TensorBoard, Prefect tables), ``rates`` among
    them; a failure is logged and the run goes on."""
    try:
        traffic, learner_bytes, _ = monitor.traffic()
        spent = bill(traffic, monitor.cfg.cost)
        ahead = spent.projected(point["tokens"], monitor.cfg.budget.tokens)
        extra = {
            "goodput/so_far": monitor.goodput_so_far(point, statuses),
            "bytes/learners_up_down": learner_bytes,
            "bytes/cross_region": cross_region_bytes(traffic),
            "cost/dollars": spent.total,
            **({"cost/projected_dollars": ahead} if ahead is not None else {}),
            **(rates.scalars() if rates is not None else {}),
        }
        metrics.tick(point, extra, statuses)
    except Exception as exc:  # (logged by name, once a minute per kind)
        monitor.storage_error("updating the live metrics", exc)


def learner_phases(
    statuses: dict[str, dict[str, Any]], oom: Mapping[str, int] | None = None
) -> tuple[Counter, str]:
    """How many learners are in each state (start-up phases first, then training), and
    that as text: ``1 compiling, 3 training``; with ``oom`` (worker -> OOM kills), those
    the OOM killer killed, and how often."""
    counts = Counter(s.get("state") or "starting" for s in statuses.values())
    order = [*STARTUP, "training", *sorted(set(counts) - {*STARTUP, "training"})]
    text = ", ".join(f"{counts[phase]} {phase}" for phase in order if counts.get(phase))
    oom = {w: n for w, n in dict(oom or {}).items() if n and w in statuses}
    if oom:  # restarted after each, it shows "compiling" most of the time: say so apart
        text += " (" + ", ".join(f"{w} OOM-killed {n}x" for w, n in sorted(oom.items())) + ")"
    return counts, text


def startup_line(
    statuses: dict[str, dict[str, Any]],
    versions: dict[int, int],
    oom: Mapping[str, int] | None = None,
) -> str | None:
    """What the run is doing while it starts, instead of a progress line at 0 %: how many
    learners are in each phase, and whether a contribution has been merged yet. None once
    every learner trains and a version beyond 0 exists (from then on the watch loop logs
    progress, and names the learners that are restarting)."""
    counts, learners = learner_phases(statuses, oom)
    merged = any(v > 0 for v in versions.values())
    if merged and not any(counts.get(phase) for phase in STARTUP):
        return None
    first = "first versions published" if merged else "waiting for the first contribution"
    return f"starting up | learners: {learners} | {first}"


def first_line(text: str) -> str:
    return text.splitlines()[0].removesuffix(":") if text else text


def reason(name: str, exc: BaseException) -> str:
    """Why worker ``name`` was given up: its error, less its name."""
    return str(exc).removeprefix(f"{name}: ")
