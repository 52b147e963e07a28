"""What the tests read of a run's flow runs in the Prefect API."""


def subflow_of(client, child, launcher, starter: str):
    """The task run standing in for flow run ``child`` in the launcher's flow run
    (``launcher``: its id), which the launcher's task ``{starter} {child.name}`` (start
    or run) is the parent of: a subflow of the launcher, under the task that started it."""
    assert child.parent_task_run_id is not None, child.name
    stand_in = client.read_task_run(child.parent_task_run_id)
    assert stand_in.flow_run_id == launcher, child.name  # a subflow of the launcher
    (parent,) = stand_in.task_inputs["__parents__"]
    started_by = client.read_task_run(parent.id)
    assert started_by.name == f"{starter} {child.name}", (child.name, started_by.name)
    return stand_in
