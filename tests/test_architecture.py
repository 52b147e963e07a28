"""The import rules docs/architecture.md states, read from the code (``ast``, no import
runs): a module that breaks one fails here, naming the file and line."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What each package may not import (a top-level name, or a module of the project).
FORBIDDEN = {
    # a leaf both sides import: the wire codes and the learner slots
    "protocol": {"diloco", "storage_layout", "flows", "infra", "prefect", "jax", "flax", "optax"},
    "diloco": {"storage_layout", "flows", "infra", "prefect"},  # pure: no storage, no Prefect
    # no training code
    "storage_layout": {"diloco", "flows", "infra", "prefect", "jax", "flax", "optax"},
}
PACKAGES = ("protocol", "diloco", "storage_layout", "flows", "infra")


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports (at any depth: a function's imports count too)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def _breaks(package: str) -> list[str]:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, module in _imports(path):
            top = module.split(".")[0]
            if top in FORBIDDEN[package]:
                found.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return found


def test_diloco_imports_no_storage_and_no_prefect():
    assert _breaks("diloco") == []


def test_storage_layout_imports_no_training_code_and_no_prefect():
    assert _breaks("storage_layout") == []


def test_protocol_is_a_leaf():
    assert _breaks("protocol") == []


def test_the_rules_see_an_import_that_breaks_them(tmp_path, monkeypatch):
    """The check itself: a nested import of a forbidden package is found."""
    package = tmp_path / "diloco"
    package.mkdir()
    (package / "bad.py").write_text("def f():\n    from storage_layout.store import RunStore\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _breaks("diloco") == ["diloco/bad.py:2 imports storage_layout.store"]


def _module_imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules ``path`` imports, at any depth but under ``if TYPE_CHECKING``
    (annotations only: never run)."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
        for stmt in node.body
        for n in ast.walk(stmt)
    }
    out = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out |= {n for n in names if n in modules}
    return out


def _cycles(root: Path) -> list[list[str]]:
    """The import circles among the packages' modules (each as the modules on it)."""
    files = {
        ".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): f
        for package in PACKAGES
        for f in (root / package).rglob("*.py")
    }
    graph = {m: _module_imports(f, set(files)) for m, f in files.items()}
    found, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            found.append(path[path.index(module) :])
            return
        if module in done:
            return
        for other in sorted(graph[module]):
            visit(other, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return found


def test_no_module_imports_itself_through_others():
    assert _cycles(ROOT) == []


def test_the_circle_check_sees_a_circle(tmp_path, monkeypatch):
    """The check itself: a circle closed by an import inside a function is found; one
    closed only under ``TYPE_CHECKING`` is not a circle."""
    package = tmp_path / "flows"
    package.mkdir()
    (package / "a.py").write_text("from flows.b import x\n")
    (package / "b.py").write_text("x = 1\ndef f():\n    from flows import a\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                  "    from flows.d import y\n")  # fmt: skip
    (package / "d.py").write_text("from flows.c import z\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", ("flows",))
    assert _cycles(tmp_path) == [["flows.a", "flows.b"]]


def test_each_package_names_its_public_api_and_loads_it_only_when_used():
    """Every name a package's ``__init__.py`` lists is there; importing the package
    imports none of its heavy modules (``diloco inspect`` and the notebook kernel must
    not load JAX by importing ``storage_layout``)."""
    code = (
        "import sys, diloco, flows, storage_layout, protocol, infra\n"
        "assert 'jax' not in sys.modules and 'prefect' not in sys.modules, 'loaded'\n"
        "for p in (diloco, flows, storage_layout, protocol, infra):\n"
        "    assert p.__all__, p\n"
        "    for n in p.__all__: getattr(p, n)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# What in ``diloco`` touches files, sockets or processes: the config file and the corpus
# (docs/architecture.md: "its only I/O is reading the corpus").
IO_MODULES = {"fsspec", "subprocess", "socket", "urllib", "tempfile", "shutil", "os", "pathlib"}
DILOCO_IO = {"diloco/config/run.py", "diloco/data.py", "diloco/dataset.py", "diloco/prepare.py"}


def test_diloco_reads_its_config_and_corpus_and_nothing_else():
    found = set()
    for path in sorted((ROOT / "diloco").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        calls_open = any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "open"
                         for n in ast.walk(tree))  # fmt: skip
        if calls_open or any(m.split(".")[0] in IO_MODULES for _, m in _imports(path)):
            found.add(str(path.relative_to(ROOT)))
    assert found == DILOCO_IO, found


def test_no_package_exports_a_name_of_one_of_its_modules():
    """``protocol.quantize`` is a module and was also the exported function: the function
    took the module's place (``import protocol.quantize as q`` gave the function)."""
    for package in ("protocol", "diloco", "flows", "storage_layout"):
        modules = {p.stem for p in (ROOT / package).glob("*.py")}
        code = f"import {package}; print(' '.join({package}.__all__))"
        names = subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT,
                               capture_output=True, text=True).stdout.split()  # fmt: skip
        assert not modules & set(names), (package, modules & set(names))


# Module-level state that stays, for its reason: one thread pool for the whole process.
# (A fault plan is an ``Injector`` given to the stores: ``storage_layout.faults``.)
STATE_ALLOWED = {"storage_layout/stream.py"}
MUTABLE_CALLS = {"Event", "local", "Counter", "defaultdict"}


def _module_state(path: Path) -> list[str]:
    """``path``'s ``global`` statements and module-level flags, thread-locals and
    counters (``threading.Event()`` and the like)."""
    tree = ast.parse(path.read_text(), str(path))
    found = [f"{node.lineno}: global {', '.join(node.names)}"
             for node in ast.walk(tree) if isinstance(node, ast.Global)]  # fmt: skip
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, ast.Call):
            name = getattr(value.func, "attr", getattr(value.func, "id", ""))
            if name in MUTABLE_CALLS:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_keeps_state_between_calls():
    """A worker process's stop, preemption notice and runtimes are one object
    (``flows.process.WorkerProcess``) the worker enters; the launcher's display is its
    caller's (a context variable): no module holds a flag or a ``global``."""
    found = [f"{path.relative_to(ROOT)}:{line}"
             for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
             if str(path.relative_to(ROOT)) not in STATE_ALLOWED
             for line in _module_state(path)]  # fmt: skip
    assert found == [], found


def test_the_state_check_sees_a_flag_and_a_global(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import threading\nSTOP = threading.Event()\n"
                    "def f():\n    global X\n    X = 1\n")  # fmt: skip
    assert _module_state(path) == ["4: global X", "2: STOP = threading.Event()"]
