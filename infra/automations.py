"""Prefect automations that pick up after a machine that died, for a Prefect server that
runs the project's deployments (the local stack installs them; `python -m
infra.automations` on any other).

- **Flow runs whose machine died are Crashed.** A flow run of a deployment beats every
  ``HEARTBEAT_SECONDS`` (its worker's ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``); one whose
  beats stop for ``MISSED`` periods without a final state (its machine lost, its
  process SIGKILLed with its worker) is set Crashed, Prefect's own zombie detection
  (docs.prefect.io, "Detect zombie flows"). A launcher watching a learner's or a
  syncer's flow run then sees it end and starts it again.
- **A launcher that crashed is run again.** A flow run tagged ``launcher`` (the
  ``train/REGION`` deployments) that ends Crashed is run again from its deployment with
  its own parameters, ``RESUME_AFTER`` later: by then the dead launcher's lease on the
  run has gone stale (``flows.run_lock``), the new one takes the run over and adopts the
  learners and syncers still going (``flows.launch_deployments.Deployments.left_running``). A
  launcher that ends Failed (a worker given up) or Cancelled (stopped) is left as it is.

This is Prefect's own machinery (events, automations, deployments), not a loop of ours;
a launcher's restarts of its learners and syncers stay with the launcher, as they need
the run's state.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import TYPE_CHECKING

from flows.run_lock import LEASE_SECONDS

if TYPE_CHECKING:  # (imported where used: importing this module reads no Prefect settings)
    from prefect.automations import Automation

HEARTBEAT_SECONDS = 30  # the workers' PREFECT_FLOWS_HEARTBEAT_FREQUENCY (Prefect's least)
MISSED = 3  # beats missed before a flow run is a zombie
RESUME_AFTER = timedelta(seconds=LEASE_SECONDS + 10)
# train_flow's parameters, passed on as the crashed flow run had them (types kept)
LAUNCHER_PARAMETERS = ("run", "regions", "config", "logs", "via", "preset", "overrides")
FINAL = ("Completed", "Failed", "Cancelled", "Crashed")


def zombies() -> Automation:
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    return Automation(
        name="diloco: crash flow runs whose heartbeat stopped",
        description=f"A flow run that missed {MISSED} heartbeats ({HEARTBEAT_SECONDS} s each) "
        "without ending: its machine died. Crashed, its launcher starts it again.",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *(f"prefect.flow-run.{s}" for s in FINAL)},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=MISSED * HEARTBEAT_SECONDS),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED, message=(
            f"no heartbeat for {MISSED * HEARTBEAT_SECONDS} s: its machine or process died"))],
    )  # fmt: skip


def resume_launchers() -> Automation:
    from prefect.automations import Automation
    from prefect.events.actions import RunDeployment
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    parameters = {p: f"{{{{ flow_run.parameters.get('{p}') }}}}" for p in LAUNCHER_PARAMETERS}
    return Automation(
        name="diloco: run a crashed launcher again",
        description="A train flow run that crashed (its machine died) is run again with "
        f"its parameters after {RESUME_AFTER.seconds} s; it takes the run over and adopts "
        "the learners and syncers still going.",
        trigger=EventTrigger(
            expect={"prefect.flow-run.Crashed"},
            match=ResourceSpecification({"prefect.resource.id": "prefect.flow-run.*"}),
            match_related=ResourceSpecification({"prefect.resource.id": "prefect.tag.launcher"}),
            posture=Posture.Reactive,
            threshold=1,
        ),
        actions=[RunDeployment(source="inferred", parameters=parameters,
                               schedule_after=RESUME_AFTER)],
    )  # fmt: skip


def install() -> list[str]:
    """Create the automations the server does not have yet (by name); their names."""
    from prefect.automations import Automation

    made = []
    for automation in (zombies(), resume_launchers()):
        try:
            Automation.read(name=automation.name)
        except ValueError:
            automation.create()
            made.append(automation.name)
    return made


def main() -> int:
    made = install()
    print("\n".join(f"created: {name}" for name in made) or "the automations are there")
    return 0


if __name__ == "__main__":
    sys.exit(main())
