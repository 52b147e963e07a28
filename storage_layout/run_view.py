"""A run's buckets opened for reading (``open_run``, ``storage_layout.report``): every region
the run names, those that could be reached, and what could not be read, collected as the
readers go; commit markers read in parallel."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.topology import run_slots
from storage_layout.bucket import Bucket, BucketError
from storage_layout.commit import CorruptVersion, read_marker
from storage_layout.inspect import find_runs
from storage_layout.layout import RunLayout
from storage_layout.store import RunStore

READERS = 16  # markers read at once (one GET each)


@dataclass
class Run:
    """A run opened for reading: its name, region -> bucket URL read, its spec, a store
    whose own region is the first bucket given, the regions that could be reached, and
    what could not be read (filled as the readers below go)."""

    name: str
    regions: dict[str, str]
    spec: dict[str, Any]
    store: RunStore
    reachable: list[str]
    problems: list[str]

    @functools.cached_property
    def learners(self) -> dict[str, str]:
        """The spec's slots and the learners joiners added (``RunStore.members.run_learners``);
        what cannot be read is a problem named, and the learners that can be are shown."""
        try:
            slots = run_slots(self.spec)
        except ValueError as exc:  # a damaged spec: the report goes on without learners
            self.problems.append(f"cannot read the run's learner slots: {exc}")
            return {}
        try:
            return self.store.members.run_learners(self.spec, regions=self.reachable).regions
        except (OSError, ValueError) as exc:
            self.problems.append(f"cannot read the learners added to the run: {exc}")
            return slots

    @property
    def fragments(self) -> int:
        return len(self.spec.get("fragments") or [])


def _same_url(a: str, b: str) -> bool:
    """Whether two bucket URLs name the same place (``file://`` and plain paths alike)."""

    def norm(u: str) -> str:
        u = u.rstrip("/")
        if "://" not in u:
            return str(Path(u).resolve())
        return str(Path(u.removeprefix("file://")).resolve()) if u.startswith("file://") else u

    return norm(a) == norm(b)


def parse_buckets(buckets: str | Sequence[str] | Mapping[str, str]) -> list[tuple[str | None, str]]:
    """``"URL"``, ``["us=URL", "URL", ...]`` or ``{"us": URL}`` as (region or None, URL)."""
    if isinstance(buckets, Mapping):
        return [(str(r), str(u)) for r, u in buckets.items()]
    items = [buckets] if isinstance(buckets, str) else list(buckets)
    out: list[tuple[str | None, str]] = []
    for item in items:
        region, sep, url = str(item).partition("=")
        # A bare URL may hold '=' in its query, never before '://'.
        if not sep or "://" in region or "/" in region:
            out.append((None, str(item)))
        else:
            out.append((region, url))
    if not out:
        raise ValueError("no bucket given")
    return out


def open_run(buckets: str | Sequence[str] | Mapping[str, str], run: str | None = None) -> Run:
    """Open ``run`` (the only run in the first bucket when None) for reading.

    ``buckets`` names one or more of the run's buckets, as a URL (its region is found by
    its URL in the run's spec) or ``REGION=URL`` (a copy somewhere else). Regions not
    given are read at the URLs in the spec, as ``diloco inspect --audit`` does."""
    given = parse_buckets(buckets)
    first_region, first_url = given[0]
    probe = Bucket(first_url, region=first_region or "report")
    if run is None:
        runs = find_runs(probe)
        if len(runs) != 1:
            raise ValueError(f"{first_url} holds runs {runs}; name one (run = ...)")
        run = runs[0]
    RunLayout(run)  # a valid name, or a clear error
    spec = RunStore(run, {probe.region: first_url}, probe.region, writer="report").read_spec()
    urls = dict(spec.get("regions") or {})
    resolved = []
    for region, url in given:
        if region is None:
            region = next((r for r, u in urls.items() if _same_url(u, url)), None)
            if region is None:
                raise ValueError(
                    f"{url} is not one of run {run!r}'s buckets {urls}; "
                    "give it as REGION=URL if it is a copy"
                )
        elif region not in urls:
            raise ValueError(f"run {run!r} has no region {region!r}; it has {sorted(urls)}")
        resolved.append(region)
        urls[region] = url
    home = resolved[0]
    store = RunStore(run, urls, home, writer="report")
    reachable, problems = [], []
    for region in urls:  # once: a region that is down is not asked again
        try:
            store.bucket(region)
            reachable.append(region)
        except BucketError as exc:
            problems.append(str(exc))
    return Run(run, urls, spec, store, reachable, problems)


def read_markers(bucket: Bucket, keys: list[str], problems: list[str]) -> dict[str, Any]:
    """key -> its commit marker, read in parallel; unreadable ones are named in
    ``problems`` and left out."""

    def read(key: str) -> Any:
        try:
            return read_marker(bucket, key)
        except (CorruptVersion, OSError) as exc:
            problems.append(f"{bucket.region}: {key}: {exc}")
            return None

    with ThreadPoolExecutor(READERS) as pool:
        found = dict(zip(keys, pool.map(read, keys), strict=True))
    return {k: m for k, m in found.items() if m is not None}
