"""What a bucket holds: runs, regions, learners, fragments, newest versions, staleness,
sizes and traffic per region pair; ``verify`` re-checks every committed object's hash.

Works on any URL a ``Bucket`` opens (local folders, ``memory://``, ``s3://``, ``gs://``).
The run's other regions are read from the URLs in its spec.
"""

from __future__ import annotations

import time
from typing import Any

from storage_layout.bucket import Bucket, BucketError
from storage_layout.commit import REVOKED, CorruptVersion, read_marker
from storage_layout.layout import RunLayout, parse_marker_name
from storage_layout.store import RunStore
from storage_layout.stream import verify_version
from storage_layout.traffic import sum_traffic


def find_runs(bucket: Bucket) -> list[str]:
    runs = []
    for name in bucket.list(""):
        try:
            RunLayout(name)
        except ValueError:
            continue
        if bucket.exists(RunLayout(name).spec):
            runs.append(name)
    return runs


def _verify(bucket: Bucket, commits_dir: str, letter: str, problems: list[str]) -> int:
    checked = 0
    for name in bucket.list(commits_dir):
        if parse_marker_name(name, letter) is None:
            problems.append(f"{bucket.region}: foreign object {commits_dir}/{name}")
            continue
        key = f"{commits_dir}/{name}"
        try:
            verify_version(bucket, read_marker(bucket, key), key)
            checked += 1
        except (CorruptVersion, OSError) as exc:
            problems.append(f"{bucket.region}: {exc}")
    return checked


def inspect_run(
    bucket: Bucket, run: str, verify: bool = False, spec: dict[str, Any] | None = None,
    given: dict[str, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """``run`` as ``bucket`` and the run's other regions hold it. ``given`` (region ->
    URL) are the buckets read in place of the spec's URLs for those regions (a copy, a
    backup), and the ones ``verify`` re-hashes; by default the bucket itself, if it is
    one of the run's regions."""
    spec = spec or RunStore(run, {bucket.region: bucket.url}, bucket.region).read_spec()
    regions: dict[str, str] = dict(spec.get("regions") or {bucket.region: bucket.url})
    if given is None:
        given = {bucket.region: bucket.url} if bucket.region in regions else {}
    unknown = sorted(set(given) - set(regions))
    if unknown:
        raise ValueError(f"run {run!r} has no region {unknown}; its regions are {sorted(regions)}")
    if verify and not given:
        raise ValueError(
            f"{bucket.url} is none of run {run!r}'s regions ({regions}); to verify a copy "
            f"of one, name the region it holds: --run {run} REGION={bucket.url}"
        )
    regions.update(given)
    fragments = len(spec.get("fragments") or [])
    home = bucket.region if bucket.region in regions else next(iter(regions))
    store = RunStore(run, regions, home, writer="inspect")
    out: dict[str, Any] = {"run": run, "regions": regions, "problems": []}
    reachable = []
    for region in regions:
        try:
            store.bucket(region)
            reachable.append(region)
        except BucketError as exc:
            out["problems"].append(str(exc))
    out["fragments"] = _fragment_rows(store, fragments, reachable)
    newest = {row["fragment"]: row["newest"] for row in out["fragments"] if "newest" in row}
    found = store.members.run_learners(spec, regions=reachable)  # with those joiners added
    learners = found.regions
    out["problems"] += [f"a learner added to the run is refused: {p}" for p in found.refused]
    added = {lid: {"added": True, **_joined_from(r)} for lid, r in found.added.items()}
    out["learners"] = [
        _learner_row(store, learner, region, fragments, newest, region in reachable)
        | added.get(learner, {})
        for learner, region in sorted(learners.items())
    ]
    budget = ((spec.get("config") or {}).get("budget") or {}).get("tokens")
    out["speed"] = run_speed(out["fragments"], budget, time.time())
    out["traffic"] = _traffic(store, reachable, out["problems"])
    if (spec.get("config") or {}).get("data", {}).get("assign") == "units":
        out["units"] = {r: _units(store, r) for r in reachable}
    if verify:  # the buckets given, never the spec's URLs in their place
        out["verified"] = {r: regions[r] for r in given if r in reachable}
        out["verified_versions"] = sum(
            _verify_region(store, region, fragments, learners, out["problems"])
            for region in out["verified"]
        )
    return out


def _joined_from(record: dict[str, Any]) -> dict[str, Any]:
    """What the member record of a learner a joiner added says of its machine: its host,
    and the devices and speed hint ``diloco join`` recorded (``--speed``), each shown only
    when it is what the joiner writes (a short name, a positive number)."""
    out: dict[str, Any] = {"host": str(record.get("host") or "?")[:80]}
    devices, speed = record.get("devices"), record.get("speed")
    if isinstance(devices, str) and devices:
        out["devices"] = devices[:80]
    if isinstance(speed, int | float) and not isinstance(speed, bool) and 0 < speed < 1e6:
        out["speed"] = float(speed)
    return out


def _units(store: RunStore, region: str) -> dict[str, int]:
    """A region's pool of data units (``data.assign = "units"``): the units handed out
    (fresh claims), the spans given back or offered from other regions' pools that a
    learner took (their claims), and the spans offered here (by the syncers, from a region
    no learner was in). Counted from three listings; ``diloco inspect --audit`` reads and
    checks the records."""
    here = RunStore(store.run, store.urls, region, writer="inspect")
    return {"handed_out": len(here.units.fresh_claims()), "returns_taken": len(here.units.returned_claims()),
            "offered_here": len(here.units.offered_claims())}  # fmt: skip


def _fragment_rows(store: RunStore, fragments: int, reachable: list[str]) -> list[dict]:
    """Per fragment: the newest version in each reachable region; at home its details."""
    rows = []
    for p in range(fragments):
        row: dict[str, Any] = {"fragment": p, "versions": {}}
        for region in reachable:
            versions = store.versions.global_versions(p, region)
            row["versions"][region] = versions[-1] if versions else None
            if versions and region == store.client_region:
                marker = store.versions.global_marker(p, versions[-1], region)
                row.update(
                    newest=versions[-1],
                    kept=len(versions),
                    bytes=marker.size,
                    consumed=len(marker.meta.get("consumed", [])),
                    tokens=marker.meta.get("tokens"),
                    # who the syncer counted, and the quorum it merged under (records.version)
                    members=list(marker.meta.get("members") or []),
                    quorum=marker.meta.get("quorum"),
                    pace=_pace(store, p, versions, marker.meta),
                )
        rows.append(row)
    return rows


# The versions a fragment's recent pace is measured over (its newest and the one this
# many before it, or its oldest kept).
PACE_VERSIONS = 10


def _pace(store: RunStore, p: int, versions: list[int], newest: dict[str, Any]
          ) -> dict[str, float] | None:  # fmt: skip
    """Fragment ``p``'s tokens merged in all (``tokens_total``), when its newest version
    was published, and the tokens per second merged over its last ``PACE_VERSIONS``
    versions (None: too few, or a record without times)."""
    then = versions[max(0, len(versions) - 1 - PACE_VERSIONS)]
    old = store.versions.global_marker(p, then).meta if then != versions[-1] else newest
    t1, t0 = newest.get("time"), old.get("time")
    n1, n0 = newest.get("tokens_total"), old.get("tokens_total")
    if not all(isinstance(x, int | float) for x in (t1, t0, n1, n0)):
        return None
    rate = (n1 - n0) / (t1 - t0) if t1 > t0 else None
    return {"tokens_total": float(n1), "time": float(t1), "tokens_per_second": rate}


def run_speed(fragments: list[dict[str, Any]], budget: int | None, now: float
              ) -> dict[str, Any] | None:  # fmt: skip
    """The run's speed from its fragments' paces (mean over fragments: each fragment's
    versions carry every learner's tokens): tokens merged, tokens per second over the
    last versions, the newest version's age, and the seconds left at that rate to the
    spec's ``budget`` (None: unknown)."""
    paces = [f["pace"] for f in fragments if f.get("pace")]
    if not paces:
        return None
    tokens = sum(p["tokens_total"] for p in paces) / len(paces)
    rates = [p["tokens_per_second"] for p in paces if p["tokens_per_second"]]
    rate = sum(rates) / len(rates) if len(rates) == len(paces) else None
    left = None
    if budget and rate and tokens < budget:
        left = (budget - tokens) / rate
    return {"tokens": tokens, "budget": budget, "tokens_per_second": rate,
            "newest_age_s": max(0.0, now - max(p["time"] for p in paces)),
            "seconds_left": 0.0 if budget and tokens >= budget else left}  # fmt: skip


def _learner_row(
    store: RunStore, learner: str, region: str, fragments: int, newest: dict[int, int],
    reachable: bool,
) -> dict[str, Any]:  # fmt: skip
    """A learner's newest contribution per fragment (its staleness) and checkpoint, what
    its status object says (``state``: training, preempted, done...; None: it has written
    none, the slot never started) and how long ago by this machine's clock, its newest
    heartbeat (``beat``: its phase, generation and age), and how many times the slot was
    taken by ``diloco join``."""
    row: dict[str, Any] = {"learner": learner, "region": region, "fragments": {}}
    if not reachable:
        return row
    status = store.progress.read_metrics(learner, region) or {}
    row["state"] = status.get("state")
    if isinstance(status.get("time"), int | float):
        row["status_age_s"] = round(max(0.0, time.time() - status["time"]), 1)
    beat = store.members.read_heartbeat(learner, region)
    if beat is not None:
        row["beat"] = {"state": beat.state, "generation": beat.generation,
                       "age_s": round(max(0.0, time.time() - beat.time), 1)}  # fmt: skip
    row["joins"] = store.members.join_count(learner, region)
    lb = store.bucket(region)
    for p in range(fragments):
        seqs = store.contributions.contribution_seqs(learner, p, region)
        markers = (read_marker(lb, store.layout.contribution_marker(learner, p, s))
                   for s in reversed(seqs))  # fmt: skip
        marker = next((m for m in markers if m.kind != REVOKED), None)  # held by a syncer
        if marker is None:
            continue
        meta = marker.meta
        base = int(meta.get("base_version", 0))
        row["fragments"][p] = {
            "newest_seq": int(meta.get("seq", seqs[-1])),
            "stored": len(seqs),
            "base_version": base,
            "staleness": newest.get(p, base) - base,
            "bytes": int(meta.get("payload_bytes", 0)),
        }
    ckpts = store.checkpoints.checkpoint_steps(learner, region)
    row["checkpoint_step"] = ckpts[-1] if ckpts else None
    return row


def _traffic(store: RunStore, reachable: list[str], problems: list[str]) -> dict[str, dict]:
    """Bytes and requests per region pair, summed over every writer's metrics object."""
    statuses = []
    for region in reachable:
        found, bad = store.progress.statuses(region)
        statuses.extend(found.values())
        problems.extend(bad)
    return dict(sorted(sum_traffic(statuses).items()))


def _verify_region(
    store: RunStore, region: str, fragments: int, learners: dict[str, str], problems: list[str]
) -> int:
    """Re-hash every committed object in ``region``; returns how many versions were read."""
    b, layout = store.bucket(region), store.layout
    local = [learner for learner, r in learners.items() if r == region]
    checked = 0
    for p in range(fragments):
        checked += _verify(b, layout.global_commits(p), "v", problems)
        for learner in local:
            checked += _verify(b, layout.contribution_commits(learner, p), "s", problems)
    for learner in local:
        checked += _verify(b, layout.checkpoint_commits(learner), "s", problems)
    return checked


def inspect_bucket(
    url: str, run: str | None = None, verify: bool = False, given: dict[str, str] | None = None
) -> dict[str, Any]:
    """Every run in the bucket at ``url`` (or ``run``). ``given`` (with ``run``: region ->
    URL, ``url`` among them) names the buckets to read and verify in place of the spec's
    URLs (``inspect_run``)."""
    bucket = Bucket(url, region="inspect")
    runs = [run] if run else find_runs(bucket)
    if run and not bucket.exists(RunLayout(run).spec):
        raise FileNotFoundError(f"no run {run!r} in {url}")
    result = {"url": url, "runs": []}
    for name in runs:
        # Name the inspected bucket after its region in the spec, so it is read directly.
        spec = RunStore(name, {"inspect": url}, "inspect").read_spec()
        region = next(
            (r for r, u in (given or spec.get("regions") or {}).items()
             if u.rstrip("/") == url.rstrip("/")),
            "inspect",
        )  # fmt: skip
        result["runs"].append(inspect_run(Bucket(url, region=region), name, verify, spec, given))
    return result
