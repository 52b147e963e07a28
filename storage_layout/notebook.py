"""Execute a parameterised notebook headless (``notebooks/train_run.ipynb`` on your run).

    python -m storage_layout.notebook notebooks/train_run.ipynb \\
        -p buckets=runs/quickstart/buckets/us-east -p run=quickstart -o report.ipynb

Papermill's convention without papermill: the values given replace the defaults of the
cell tagged ``parameters`` through a cell tagged ``injected-parameters`` right after it,
and the notebook runs top to bottom in a ``python3`` kernel of this interpreter's
environment (``ipykernel`` from the lock; jupyter_client starts it with
``sys.executable``, so it sees this checkout's packages). Relative paths in values are
relative to the working directory, where the kernel runs. Needs ``nbclient`` and
``ipykernel`` (in ``requirements.lock`` and the ``test`` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PARAMETERS, INJECTED = "parameters", "injected-parameters"


def inject(nb: Any, parameters: Mapping[str, Any]) -> Any:
    """Put ``parameters`` (name -> value, written with ``repr``) in a cell tagged
    ``injected-parameters`` after the one tagged ``parameters`` (or first), replacing
    any earlier injection. Returns the notebook (changed in place)."""
    import nbformat

    cells = [c for c in nb.cells if INJECTED not in c.get("metadata", {}).get("tags", [])]
    at = next((i + 1 for i, c in enumerate(cells)
               if PARAMETERS in c.get("metadata", {}).get("tags", [])), 0)  # fmt: skip
    if parameters:
        source = "# Injected parameters\n" + "".join(
            f"{name} = {value!r}\n" for name, value in parameters.items()
        )
        cells.insert(at, nbformat.v4.new_code_cell(source, metadata={"tags": [INJECTED]}))
    nb.cells = cells
    return nb


def execute(
    notebook: str | Path | Any,
    parameters: Mapping[str, Any] | None = None,
    cwd: str | Path | None = None,
    timeout: int = 600,
) -> Any:
    """Run ``notebook`` (a path or an ``nbformat`` notebook) with ``parameters`` in a
    ``python3`` kernel whose working directory is ``cwd`` (default: ours); returns the
    executed notebook. A cell that raises stops it with ``CellExecutionError``."""
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from nbclient import NotebookClient

    nb = nbformat.read(notebook, as_version=4) if isinstance(notebook, str | Path) else notebook
    inject(nb, parameters or {})
    # No debugger warning about frozen modules from the kernel process.
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    # The kernel is ipykernel's own spec of this interpreter (sys.executable), never a
    # "python3" kernelspec installed elsewhere on the machine (no kernel directories are
    # searched). It talks to us over local TCP, encrypted with CurveZMQ keys the manager
    # makes when pyzmq can (so ipykernel has no plain-text warning to give).
    km = AsyncKernelManager(kernel_name="python3", transport_encryption="auto",
                            kernel_spec_manager=KernelSpecManager(kernel_dirs=[]))  # fmt: skip
    client = NotebookClient(
        nb, km=km, timeout=timeout, resources={"metadata": {"path": str(cwd or Path.cwd())}}
    )
    client.execute(cleanup_kc=True)  # shut the kernel down after (we made its manager)
    return nb


def _value(text: str) -> Any:
    """A ``-p`` value: JSON if it parses (lists, numbers, null), else the string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def main(argv: list[str] | None = None) -> int:
    import nbformat
    from nbclient.exceptions import CellExecutionError

    parser = argparse.ArgumentParser(prog="python -m storage_layout.notebook",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("notebook", type=Path)
    parser.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE",
                        help="a parameter (JSON, or a plain string); repeatable")  # fmt: skip
    parser.add_argument("-o", "--out", type=Path, help="where to write the executed notebook "
                        "(default: NOTEBOOK-out.ipynb in the working directory)")  # fmt: skip
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = parser.parse_args(argv)
    parameters = {}
    for item in args.param:
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier():
            parser.error(f"-p {item!r}: expected NAME=VALUE")
        parameters[name] = _value(value)
    out = args.out or Path(f"{args.notebook.stem}-out.ipynb")
    nb = nbformat.read(args.notebook, as_version=4)
    try:
        execute(nb, parameters, timeout=args.timeout)
    except CellExecutionError as exc:
        nbformat.write(nb, out)
        print(f"{args.notebook}: a cell failed (the notebook so far: {out}):\n{exc}",
              file=sys.stderr)  # fmt: skip
        return 1
    nbformat.write(nb, out)
    print(f"executed {args.notebook} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
