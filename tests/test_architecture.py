"""The import rules docs/architecture.md states, read from the code (``ast``, no import
runs): a module that breaks one fails here, naming the file and line."""

from __future__ import annotations

import ast
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
