"""The launch modes by name (``train --via``, the train flow's ``via``): a new one is a
``LaunchMode`` (``flows.supervision``) in a file of its own and an entry here."""

from __future__ import annotations

from typing import Literal

from diloco.config import ConfigError
from flows.launch_deployments import Deployments
from flows.launch_processes import Processes
from flows.supervision import LaunchMode

# The launch modes by name (``train --via``, the train flow's ``via``): a new one is a
# class above and an entry here.
LAUNCH_MODES: dict[str, type[LaunchMode]] = {"processes": Processes, "deployments": Deployments}


Via = Literal[tuple(LAUNCH_MODES)]  # (the train flow's parameter: Prefect checks it)


def launch_mode(via: str) -> type[LaunchMode]:
    """The launch mode named ``via``; ``ConfigError`` naming the modes if there is none."""
    if via not in LAUNCH_MODES:
        raise ConfigError(f"via must be one of {', '.join(LAUNCH_MODES)}, not {via!r}")
    return LAUNCH_MODES[via]
