"""Where a run's live metrics go besides TensorBoard's event files (``pipeline.sinks``):
Weights & Biases and MLflow, each set up as its own library is, by its environment, so a
team's existing settings apply unchanged:

- ``wandb``: ``WANDB_PROJECT`` (default ``diloco``), ``WANDB_ENTITY``, ``WANDB_MODE``
  (``offline`` needs no account: ``wandb sync`` uploads it later), ``WANDB_API_KEY``;
- ``mlflow``: ``MLFLOW_TRACKING_URI`` (a server, ``sqlite:///mlflow.db``, ...) and
  ``MLFLOW_EXPERIMENT_NAME`` (default ``diloco``).

Each gets the series TensorBoard gets (``flows.metrics.LiveMetrics``), named
``SERIES/TAG`` (``global/loss/validation``, ``learner-0/loss/train``,
``fragment-1/merge/contributions``), each against its own x axis (tokens merged, the
learner's inner step, the version number). A relaunch of the run goes on in the same W&B
or MLflow run. A new sink is a class here and its name in ``SINKS``.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from diloco.config import ConfigError

MLFLOW_BATCH = 1000  # metrics per request (MLflow's limit)


class Sink(Protocol):
    def scalar(self, series: str, tag: str, value: float, step: int, walltime: float) -> None:
        """One point of ``series/tag`` at ``step`` (its series' x axis), taken at
        ``walltime`` (Unix seconds)."""

    def flush(self) -> None:
        """Send what is held (called after each tick)."""

    def close(self) -> None: ...


def _run_id(run: str) -> str:
    """A W&B run id from the run's name: its characters W&B allows, so that each launch of
    the run writes to one W&B run."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", run)[:64]


class WandbSink:
    """Each series' points logged with that series' x axis as its step metric."""

    library = "wandb"

    def __init__(self, run: str, folder: Path):
        import wandb

        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "diloco"), name=run,
                              id=_run_id(run), resume="allow", dir=str(folder))  # fmt: skip
        self.axes: set[str] = set()

    def scalar(self, series: str, tag: str, value: float, step: int, walltime: float) -> None:
        if series not in self.axes:
            self.run.define_metric(f"{series}/step", hidden=True)
            self.run.define_metric(f"{series}/*", step_metric=f"{series}/step")
            self.axes.add(series)
        self.run.log({f"{series}/{tag}": value, f"{series}/step": step})

    def flush(self) -> None:
        pass  # (W&B sends in the background)

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    """Points held and sent in batches at each flush, in the MLflow run tagged with the
    run's name (made on first launch)."""

    library = "mlflow"

    def __init__(self, run: str, folder: Path):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "diloco")
        found = self.client.get_experiment_by_name(name)
        experiment = found.experiment_id if found else self.client.create_experiment(name)
        runs = self.client.search_runs([experiment], f"tags.`diloco.run` = '{run}'", max_results=1)
        self.run_id = (runs[0] if runs else self.client.create_run(
            experiment, run_name=run, tags={"diloco.run": run})).info.run_id  # fmt: skip
        self.held: list[Any] = []

    def scalar(self, series: str, tag: str, value: float, step: int, walltime: float) -> None:
        from mlflow.entities import Metric

        self.held.append(Metric(f"{series}/{tag}", value, int(walltime * 1000), int(step)))

    def flush(self) -> None:
        while self.held:
            batch, self.held = self.held[:MLFLOW_BATCH], self.held[MLFLOW_BATCH:]
            self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self.flush()


SINKS = {"wandb": WandbSink, "mlflow": MlflowSink}


def _not_installed(name: str, why: object) -> ConfigError:
    return ConfigError(f"pipeline.sinks names {name}, whose library is not installed "
                       f"({why}): pip install 'decoupled-diloco[{name}]'")  # fmt: skip


def check_sinks(names: Iterable[str]) -> None:
    """Before anything of a run starts: each sink's library is installed (else the error
    ``open_sinks`` would give once the workers run)."""
    for name in names:
        if importlib.util.find_spec(SINKS[name].library) is None:
            raise _not_installed(name, f"no module named {SINKS[name].library!r}")


def open_sinks(names: Iterable[str], run: str, folder: Path, log: Any) -> dict[str, Sink]:
    """The sinks ``names`` of ``run``, their local files (W&B's) under ``folder``. One whose
    library is not installed is an error that says how to install it; one that cannot be
    opened (a server away) is said and left out: the run goes on without it."""
    sinks = {}
    for name in names:
        try:
            sinks[name] = SINKS[name](run, folder / name)
        except ImportError as exc:
            raise _not_installed(name, exc) from exc
        except Exception as exc:
            log.warning("metrics to %s are off for this launch: %r", name, exc)
    return sinks
