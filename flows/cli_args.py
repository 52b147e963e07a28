"""What several ``diloco`` commands' arguments share (``flows.cli``, ``cli_plan``,
``cli_buckets``)."""

from __future__ import annotations

from pathlib import Path

SET_HELP = (
    "override a config field, e.g. outer.lr=0.5 (values are JSON when they parse); "
    "`diloco config show` lists every KEY with its value and meaning"
)


def count(text: str) -> int:
    """``1.2e6`` or ``1200000`` -> 1200000 (chip counts read better in e-notation)."""
    return int(float(text))


def bucket_url(url: str) -> str:
    """A bucket URL, or a folder as a ``file://`` URL."""
    return url if "://" in url else "file://" + str(Path(url).resolve())
