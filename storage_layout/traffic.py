"""What a client moved between regions: bytes and requests per (source, destination)
region pair, summed over a run's writers for its traffic table."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Traffic:
    """Bytes and requests per (source region, destination region); thread-safe."""

    bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    requests: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    uploaded: int = 0  # bytes this client wrote, to any region
    downloaded: int = 0  # bytes this client read, from any region
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, src: str, dst: str, nbytes: int, upload: bool = False) -> None:
        with self._lock:
            self.bytes[(src, dst)] += nbytes
            self.requests[(src, dst)] += 1
            if upload:
                self.uploaded += nbytes
            else:
                self.downloaded += nbytes

    def as_dict(self) -> dict[str, dict[str, int]]:
        with self._lock:
            pairs = sorted(set(self.bytes) | set(self.requests))
            return {
                f"{s}->{d}": {"bytes": self.bytes[(s, d)], "requests": self.requests[(s, d)]}
                for s, d in pairs
            }

    @property
    def cross_region_bytes(self) -> int:
        return sum(n for (s, d), n in self.bytes.items() if s != d)


def sum_traffic(statuses: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """Bytes and requests per region pair (``source->destination``), summed over status
    records (each checked as a ``Status``), largest first."""
    out: dict[str, dict[str, int]] = {}
    for status in statuses:
        for pair, t in (status.get("traffic") or {}).items():
            acc = out.setdefault(pair, {"bytes": 0, "requests": 0})
            acc["bytes"] += int(t.get("bytes", 0))
            acc["requests"] += int(t.get("requests", 0))
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["bytes"]))
