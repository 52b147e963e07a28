"""What `diloco train` shows in a terminal while a run goes: its phases (Prefect server,
run spec, learners starting and compiling, the first contribution merged, training,
finishing), each with what it is doing and for how long, and a progress bar of the
training (share of inner steps, tokens merged, validation loss, versions).

On a terminal this is a rich live display at the bottom of the screen; the flow run's
log lines scroll above it, except the start-up and progress lines it replaces (logged
with ``extra={"display": True}``: they still reach the Prefect API, so the flow run's
logs read like the run). Anywhere else (CI, a pipe, a log file) nothing changes: plain
log lines, no control codes.

The launcher flow finds the display its caller opened with ``current()``; a flow run with
none (a test, a deployment) gets a plain one that does nothing.
"""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from typing import Any

from rich.console import Console, Group
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

PHASES = {
    "server": "Prefect server",
    "spec": "run spec",
    "learners": "learners",
    "first": "first contribution",
    "training": "training",
    "finishing": "finishing",
}


class Display:
    """No display: the log lines say it all (not a terminal)."""

    live = False

    def phase(self, name: str, state: str = "running", detail: str = "") -> None:
        """Set phase ``name`` (a key of ``PHASES``) to ``state`` (``running``, ``done`` or
        ``failed``) with a short ``detail``."""

    def progress(self, percent: float, detail: str) -> None:
        """The training bar: share of all learners' inner steps done, and what to say."""

    def state(self, name: str) -> str:
        """Phase ``name``'s state (``pending``, ``running``, ``done``...)."""
        return "pending"

    def workers(self, rows: list[dict[str, str]]) -> None:
        """What every worker is doing (``flows.worker_table``: one row each, as text)."""

    def adopt_prefect_logging(self) -> None:
        """Route Prefect's console log lines through the display (once Prefect is set up)."""

    def __enter__(self) -> Display:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        pass


class _Quiet(logging.Filter):
    """Keeps the lines the live display replaces off the terminal (not off the API)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "display", False)


class LiveDisplay(Display):
    """A rich live display of the phases on ``console``'s terminal."""

    live = True

    def __init__(self, console: Console, title: str = ""):
        self.console, self.title = console, title
        self.states: dict[str, tuple[str, str, float | None, float | None]] = {
            name: ("pending", "", None, None) for name in PHASES
        }  # name -> (state, detail, started, ended)
        self.spinners = {name: Spinner("dots", style="cyan") for name in PHASES}
        self.bar = Progress(
            TextColumn("  "),
            BarColumn(bar_width=30),
            TaskProgressColumn(),
            TextColumn("{task.description}"),
            console=console,
        )
        self.task = self.bar.add_task("", total=100.0, start=False)
        self.rows: list[dict[str, str]] = []  # the workers' table
        self.quiet = _Quiet()
        self.adopted: list[tuple[Any, Any]] = []  # (Prefect console handler, its file)
        from rich.live import Live

        self.screen = Live(console=console, get_renderable=self.render, refresh_per_second=4,
                           redirect_stdout=True, redirect_stderr=True)  # fmt: skip
        self.screen.start()

    def phase(self, name: str, state: str = "running", detail: str = "") -> None:
        old, _, started, ended = self.states[name]
        now = time.monotonic()
        if state == "running" and old != "running":
            started, ended = now, None
        elif state != "running":
            started, ended = started or now, ended if old == state else now
        self.states[name] = (state, detail, started, ended)
        if name == "training" and state == "running":
            self.bar.start_task(self.task)
        if name == "training" and state != "running":
            self.bar.stop_task(self.task)

    def state(self, name: str) -> str:
        return self.states[name][0]

    def progress(self, percent: float, detail: str) -> None:
        self.bar.update(self.task, completed=min(100.0, percent), description=detail)

    def workers(self, rows: list[dict[str, str]]) -> None:
        self.rows = rows

    def render(self) -> Any:
        grid = Table.grid(padding=(0, 1))
        grid.add_column(width=2)
        grid.add_column(style="bold", min_width=20)
        grid.add_column()
        grid.add_column(justify="right", style="dim")
        now = time.monotonic()
        for name, label in PHASES.items():
            state, detail, started, ended = self.states[name]
            icon: Any = {"done": Text("✓", "green"), "failed": Text("✗", "red"),
                         "stopped": Text("■", "yellow"),
                         "pending": Text("·", "dim")}.get(state) or self.spinners[name]  # fmt: skip
            seconds = "" if started is None else f"{(ended or now) - started:.0f} s"
            grid.add_row(icon, label if state != "pending" else Text(label, "dim"), detail,
                         seconds)  # fmt: skip
        parts: list[Any] = [Text(self.title, "bold")] if self.title else []
        parts.append(grid)
        if self.states["training"][0] != "pending":
            parts.append(self.bar)
        if self.rows:
            parts.append(self._workers_table())
        return Group(*parts)

    def _workers_table(self) -> Table:
        table = Table(box=None, padding=(0, 2), header_style="dim")
        for column in self.rows[0]:
            table.add_column(column, justify="right" if column in ("at", "speed") else "left")
        for row in self.rows:
            style = "yellow" if row["state"] in ("lagging", "silent", "fenced", "stalled") else None
            table.add_row(*row.values(), style=style)
        return table

    def adopt_prefect_logging(self) -> None:
        """Print Prefect's console log lines above the display and drop the ones it
        replaces; undone by ``close``. (Its handler's console writes to the terminal
        itself, past any redirection, and would tear the display.)"""
        from prefect.logging.handlers import PrefectConsoleHandler

        for handler in logging.getLogger().handlers:
            if isinstance(handler, PrefectConsoleHandler) and not isinstance(
                handler.console, _Above
            ):
                self.adopted.append((handler, handler.console))
                handler.console = _Above(handler.console, self.console)
                handler.addFilter(self.quiet)

    def __exit__(self, kind: type | None, *exc: object) -> None:
        """Phases still running stop there: failed on an error, stopped otherwise (Ctrl-C)."""
        for name, (state, detail, _, _) in self.states.items():
            if state == "running":
                self.phase(name, "failed" if kind and kind is not KeyboardInterrupt else "stopped",
                           detail)  # fmt: skip
        self.screen.refresh()
        self.close()

    def close(self) -> None:
        for handler, own in self.adopted:
            handler.removeFilter(self.quiet)
            handler.console = own
        self.adopted.clear()
        if self.screen.is_started:
            self.screen.stop()
        if _CURRENT.get() is self:
            _CURRENT.set(None)


class _Above:
    """Stands in for a log handler's console: renders a line as that console would
    (colors, highlighting), then prints it through the live display's console, above the
    display."""

    def __init__(self, own: Console, live: Console):
        self.own, self.live = own, live

    def print(self, *objects: Any, **kwargs: Any) -> None:
        with self.own.capture() as captured:
            self.own.print(*objects, **kwargs)
        self.live.print(Text.from_ansi(captured.get().rstrip("\n")), soft_wrap=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.own, name)


_CURRENT: ContextVar[Display | None] = ContextVar("diloco_display", default=None)


def open_display(console: Console, title: str = "") -> Display:
    """A live display on ``console`` if it is a terminal (not a dumb one), else a plain
    one; either becomes ``current()`` until closed."""
    live = console.is_terminal and not console.is_dumb_terminal
    display = LiveDisplay(console, title) if live else Display()
    _CURRENT.set(display)
    return display


def current() -> Display:
    """The display the caller's context opened (a plain one if none is open)."""
    return _CURRENT.get() or Display()
