"""The launch mode that runs each worker as a flow run of its region's Prefect deployment
(``--via deployments``): started with ``run_deployment`` on the region's work pool, watched
through the API, restarted under the one policy (``flows.supervision.Restarts``)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from diloco.config import RunConfig
from flows.supervision import STOP_SECONDS, LaunchMode, api_url, as_task, run_log, wait_for_api
from flows.worker import prefect_api_reachable
from flows.workers import Status, Worker
from protocol.topology import home_region
from storage_layout import faults
from storage_layout.store import RunStore


class Deployments(LaunchMode):
    """Each worker as flow runs of its region's deployment (``Worker.deployment``, its
    parameters ``Worker.params``), one after another until the worker's status object in
    the bucket says ``done``, each resuming from the buckets; a flow run that does not
    complete is a crash under ``Restarts``. Stopping cancels the flow runs in progress.
    A launcher that dies otherwise leaves them going, and the next one adopts them
    (``left_running``) rather than start a second of each."""

    outlives_launcher = True

    @classmethod
    def for_launch(cls, run: str, regions: dict[str, str], cfg: RunConfig, logs: Path,
                   stopping: threading.Event, log: Any, secret: str | None,
                   fault_plan: faults.FaultPlan | None) -> LaunchMode:  # fmt: skip
        return cls(run, regions, cfg.pipeline.max_failed_starts, stopping)

    def __init__(self, run: str, regions: dict[str, str], limit: int,
                 stopping: threading.Event | None = None):  # fmt: skip
        super().__init__(run, regions, limit, stopping)
        self.flow_runs: set[Any] = set()  # ids of the flow runs in progress
        self.supervise = as_task(self._supervise, name="deployment", task_run_name="run {name}")

    def start(self, worker: Worker) -> Any:
        return self.supervise.submit(worker.name, worker.deployment, worker.params,
                                     worker.tags(self.run), worker.status)  # fmt: skip

    def _supervise(
        self, name: str, deployment: str, parameters: dict[str, Any], tags: list[str],
        status: Status,
    ) -> int:  # fmt: skip
        from prefect.deployments import run_deployment

        writer, region, _ = status
        store = RunStore(self.run, self.regions, region, writer="launcher")
        home = RunStore(self.run, self.regions, home_region(self.regions), writer="launcher")
        log = run_log()
        restarts = self.restarts(name, home, status, unit="flow runs")
        adopting = True  # the first start looks for a flow run left going
        while not self.stopping.is_set():
            restarts.start()
            try:
                flow_run = self.left_running(parameters) if adopting else None
                if flow_run is not None:
                    log.info("%s: adopting its flow run %s (%s), left going by an earlier "
                             "launcher", name, flow_run.name, flow_run.id)  # fmt: skip
                # as_subflow: linked under this task run, in the launcher's flow run
                flow_run = flow_run or run_deployment(deployment, parameters=parameters,
                                                      tags=tags, timeout=0, as_subflow=True)  # fmt: skip
            except Exception as exc:
                if restarts.api_waited(exc):  # (no flow run: nothing counts)
                    continue
                raise
            adopting = False
            self.flow_runs.add(flow_run.id)
            try:
                state = self._wait_flow_run(flow_run.id, name, log)
            finally:
                self.flow_runs.discard(flow_run.id)
            if store.progress.done(writer):
                return 0
            if self.stopping.is_set():
                return 130
            if not state.is_completed():
                restarts.crashed(f"flow run ended {state.name}", ended=f"ended {state.type.value}")
        return 130

    def left_running(self, parameters: dict[str, Any]) -> Any:
        """The flow run of the worker ``parameters`` name (its region and index, or its
        home and shard) that a deployment started for this run and that is still
        scheduled, pending or running (an earlier launcher's, which died), or None."""
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import (
            FlowRunFilter,
            FlowRunFilterDeploymentId,
            FlowRunFilterState,
            FlowRunFilterStateType,
            FlowRunFilterTags,
        )
        from prefect.client.schemas.objects import StateType

        who = {k: parameters[k] for k in ("region", "index", "home", "shard") if k in parameters}
        going = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING]
        found = FlowRunFilter(
            tags=FlowRunFilterTags(all_=[f"run:{self.run}"]),
            deployment_id=FlowRunFilterDeploymentId(is_null_=False),
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=going)),
        )
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(flow_run_filter=found, limit=200)
        mine = [r for r in runs if all(r.parameters.get(k) == v for k, v in who.items())]
        return mine[0] if mine else None

    def _wait_flow_run(self, flow_run_id: Any, name: str, log: Any, poll: float = 2.0) -> Any:
        """The final state of a flow run; while the API is unreachable, waits for it."""
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            while True:
                try:
                    state = client.read_flow_run(flow_run_id).state
                except Exception as exc:
                    if wait_for_api(name, log, self.stopping, exc=exc):
                        continue
                    raise
                if state is not None and state.is_final():
                    return state
                time.sleep(poll)

    def reap(self, timeout: float = STOP_SECONDS) -> None:
        """Ask the work pools' workers to cancel the flow runs this launch started (not
        with the API unreachable: its client would retry for minutes)."""
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelling

        if not self.flow_runs or not prefect_api_reachable(api_url()):
            return
        with get_client(sync_client=True) as client:
            for flow_run_id in list(self.flow_runs):
                client.set_flow_run_state(flow_run_id, Cancelling(), force=True)
