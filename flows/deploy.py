"""Steps for the ``pull`` section of ``prefect.yaml``: each flow run of a deployment runs
them on its node, in its own process, before the flow starts (Prefect imports a step by
its dotted name and passes it the step's fields; see docs/deploy.md).

- ``load_credentials``: the bucket credentials a Prefect Secret block holds, into this
  flow run's environment. The block's name is all a deployment or a worker names; the
  values stay in the block, out of job variables, parameters and events.
- ``use_checkout``: a checkout of the project (a ``git_clone`` step's) on the import
  path for the whole flow run, and for the processes it starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

CREDENTIALS_BLOCK_ENV = "DILOCO_CREDENTIALS_BLOCK"
# Variables whose value is a file's path: a Secret may hold the file's content instead.
FILE_VARIABLES = ("GOOGLE_APPLICATION_CREDENTIALS",)


def load_credentials(block: str | None = None) -> dict[str, str]:
    """Set the environment variables that the Secret block ``block`` holds (default: the
    block named by ``DILOCO_CREDENTIALS_BLOCK`` in the job variables or the worker's
    environment; none named: nothing to do, the worker's environment has them).

    The Secret's value is a JSON object, variable -> value: ``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, ``GOOGLE_APPLICATION_CREDENTIALS`` (a
    path, or the service account key itself as an object: written to a private file).
    They override the worker's own for this flow run and what it starts. Returns the
    names set, never the values (Prefect records a step's output)."""
    name = block or os.environ.get(CREDENTIALS_BLOCK_ENV, "")
    if not name:
        return {"credentials": ""}
    from prefect.blocks.system import Secret

    value = Secret.load(name).get()
    if isinstance(value, str):
        with contextlib.suppress(ValueError):  # not JSON: refused below
            value = json.loads(value)
    if not isinstance(value, dict) or not value:
        raise ValueError(
            f"Secret block {name!r} must hold a JSON object of environment variables, "
            'e.g. {"AWS_ACCESS_KEY_ID": "...", "AWS_SECRET_ACCESS_KEY": "..."}'
        )
    for key, item in value.items():
        if key in FILE_VARIABLES and isinstance(item, dict):
            fd, path = tempfile.mkstemp(prefix="diloco-", suffix=".json")  # mode 0600
            with os.fdopen(fd, "w") as out:
                json.dump(item, out)
            item = path
        os.environ[str(key)] = str(item)
    names = ", ".join(sorted(value))
    print(f"credentials from Secret block {name!r}: {names}")  # a step's log is its output
    return {"credentials": names}


def use_checkout(directory: str = ".") -> dict[str, str]:
    """Import the project from ``directory`` (a checkout, e.g. a ``git_clone`` step's)
    for the rest of this flow run: first on ``sys.path``, and on ``PYTHONPATH`` for the
    processes it starts (a launcher's learners and syncers). Prefect puts the working
    folder on the path only while it imports the entrypoint; modules imported later
    would otherwise come from wherever else the project is installed, or not at all."""
    path = str(Path(directory).resolve())
    if not (Path(path) / "flows" / "__init__.py").exists():
        raise FileNotFoundError(f"{path} is not a checkout of this project (no flows/)")
    if path not in sys.path:
        sys.path.insert(0, path)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [path, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    )
    return {"directory": path}
