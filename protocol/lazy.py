"""A package's public API loaded on first use: its ``__init__`` names each public name's
module (``_API``) and ``__getattr__ = lazy_api(__name__, _API)`` imports that module only
when the name is asked for, so importing a package loads none of JAX, Prefect or the
storage clients (``tests/test_architecture.py``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module


def lazy_api(package: str, api: Mapping[str, str]) -> Callable[[str], object]:
    """The module ``__getattr__`` of ``package``: a name of ``api`` from its module."""

    def __getattr__(name: str) -> object:
        if name in api:
            return getattr(import_module(api[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
