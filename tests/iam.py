"""The buckets' write policies (``local.writes`` in ``infra/terraform/main.tf``, which
every policy there is made of) against what the processes of a real run write: each
write and delete a run's workers and launcher make, traced by the fault injector's
``trace_path`` (one JSON line per request: its salt, which names the worker, and its
key), must fall under a key or prefix its role's list grants."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

MAIN_TF = Path(__file__).resolve().parents[1] / "infra" / "terraform" / "main.tf"
WRITES = {"put", "put_exclusive", "probe_exclusive", "delete", "delete_prefix"}


def policy_writes() -> dict[str, list[str]]:
    """``local.writes``: role -> the keys and prefixes (ending in "/" or "*") it writes."""
    text = MAIN_TF.read_text()
    block = text[text.index("  writes = {") :]
    block = block[: block.index("\n  }\n")]
    lists = re.findall(r"^    (\w+) = \[(.*?)^    \]", block, re.S | re.M)
    return {role: re.findall(r'"([^"]+)"', re.sub(r"#[^\n]*", "", body)) for role, body in lists}


def granted(patterns: Iterable[str], key: str) -> bool:
    return any(
        key.startswith(p.rstrip("*")) if p.endswith(("/", "*")) else key == p for p in patterns
    )


def role_of(salt: str) -> tuple[str, str | None]:
    """(role, its own id) of a traced process: a worker's salt is ``WRITER/START``, the
    launcher's (traced in its own process) empty."""
    writer = salt.split("/")[0]
    if not writer:
        return "launcher", None
    return re.sub(r"-\d+$", "", writer), writer


def writes_outside_policy(trace: Path, run: str) -> tuple[list[str], set[str]]:
    """The traced writes and deletes no policy grants (each as ``role id: op key``), and
    the roles seen writing."""
    policy = policy_writes()
    outside, roles = [], set()
    for line in trace.read_text().splitlines():
        r = json.loads(line)
        if r["op"] not in WRITES:
            continue
        role, own = role_of(r["salt"])
        roles.add(role)
        mine = [p.replace("LEARNER", own or "") for p in policy.get(role, [])]
        rel = r["key"].removeprefix(f"{run}/")
        if rel == r["key"] or not granted(mine, rel):
            outside.append(f"{role} {own or ''}: {r['op']} {r['key']} in {r['region']}")
    return sorted(set(outside)), roles
