"""``diloco inspect --audit``: a run's invariants, read from its buckets alone.

The buckets are the whole truth of a run: every contribution a learner committed, every
global version with its record (what it merged, rejected and found superseded, the
per-learner cursor), and the retention ledger (what was deleted, with the same fields).
The audit reads them and checks, naming the objects that break each invariant:

- ``objects-verify``: every committed object matches the size and sha256 its marker
  records (all of them are read again, in every region audited), except those of a
  contribution a syncer rejected for it (the damage was found and the work refused), of
  a contribution superseded unread (a newer send from its anchor carried its steps: the
  syncer never fetched its data, so it reached no model; listed as ``unread_damage``,
  not a violation), of a contribution still pending (above the newest cursor: no syncer
  has read it yet, one that does rejects it; a run stopped while a forger's damaged
  contribution waits leaves one; also ``unread_damage``) and of a version a later one
  declares lost (a syncer could not read it at home, went on from an older one and
  merged again what it had merged: its merges are void);
- ``versions-contiguous``: the versions of each fragment, held or in the ledger, are
  0, 1, ..., newest (none missing);
- ``not-overwritten``: each version and contribution was written once: every copy, in
  every region and in the ledger, carries one write id;
- ``merged-once``: no contribution is in the consumed list of two versions (also across
  syncer restarts and duplicate syncers);
- ``merged-committed``: every contribution a version merged was committed by its learner;
- ``one-outcome``: every committed contribution was merged into a named version,
  superseded by a newer one from the same anchor that was merged, rejected with a
  reason, or is pending (after the newest version's cursor); none is lost;
- ``home-complete``: the home region (the syncers', the first of the spec) holds the
  newest version of every fragment that any region or the ledger knows, with its master
  copy (the fp32 parameters and the outer optimizer state a syncer resumes from), and
  it verifies: a run whose master copies are gone cannot go on, however sound every
  other copy is;
- ``no-strangers``: contributions lie only under the learners dealt to each region, or
  added to it by a joiner (``members/``, ``RunStore.members.run_learners``; the syncer never
  reads others: one under an unknown learner, or a learner of another region, was
  written by someone else, and is named here, as is an added learner's record out of
  place);
- ``data-once``: the data a learner's merged contributions to one fragment trained (their
  ``data`` positions, [from, to) of the learner's batches) do not overlap between
  anchors: no batch of a learner reached a fragment twice, also across its restarts
  (sends from one anchor are cumulative, so they overlap each other by design); with
  ``data.assign = "units"`` also across learners: the windows of the spans each
  learner's merged batches read (its data ledger) are apart from every other learner's
  (``flows.ledger_audit.audit_units``, which ``diloco inspect --audit`` runs after this one:
  the data set's units are a training type);
- ``tokens-balance``: the tokens the versions say they merged equal the new tokens of
  the contributions merged or superseded (a send from an anchor carries all its steps so
  far, so each one's new tokens are its count less its predecessor's from that anchor);
  committed = merged + superseded + rejected + pending.

Beside the invariants, each learner's work is accounted for (``learners``): its last
status (``done``, ``preempted``, or a state it never left: a learner that vanished), the
batches it trained, the batches its committed sends carry (on every fragment), and the
tokens of its sends by outcome, and who joined its slot (``diloco join``: each join
record's number, host, time and what the slot was; as stored, the audit holds no key to
check their signatures, the syncers do). ``unsent`` batches were trained but left in no send:
lost with a learner that vanished (a preempted one sends them before it leaves, so it
has none); ``pending`` tokens were committed and not merged when the audit ran.

Regions that hold an older newest version than the home region are reported as lagging
(not a violation: they catch up). The buckets audited are the ones given; a region of
the run not given is read at the URL in the run's spec and said so.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from itertools import pairwise
from typing import Any

from storage_layout.audit_report import OUTCOMES, AuditReport, Sent
from storage_layout.auth import Keys
from storage_layout.bucket import BucketError
from storage_layout.commit import REVOKED, CorruptVersion, read_marker
from storage_layout.retention import read_ledger
from storage_layout.store import RunStore, spec_home
from storage_layout.stream import verify_version


def audit_run(run: str, buckets: Mapping[str, str]) -> AuditReport:
    """Audit ``run`` in ``buckets`` (region -> URL; at least one). The run's spec is read
    from the first one; regions it names that are not given are read at its URLs."""
    first, url = next(iter(buckets.items()))
    spec = RunStore(run, {first: url}, first, writer="audit").read_spec()
    regions = dict(spec.get("regions") or {})
    unknown = sorted(set(buckets) - set(regions))
    if unknown:
        raise ValueError(f"run {run!r} has no region {unknown}; its regions are {sorted(regions)}")
    urls = {r: buckets.get(r, u) for r, u in regions.items()}
    home = spec_home(spec)
    store = RunStore(run, urls, home, writer="audit")
    report = AuditReport(run, urls, sorted(set(regions) - set(buckets)))
    for region in urls:
        try:
            store.bucket(region)
        except BucketError as exc:
            raise BucketError(f"cannot audit run {run!r}: {exc}") from exc
    # the run's slots and the learners joiners added (a record out of place is a stranger's;
    # with the run secret in DILOCO_RUN_SECRET, as is one not signed with its learner's
    # key: without it, the records as stored, the syncers check them)
    found = store.members.run_learners(spec, Keys.from_env(run).verifying_key)
    learners = found.regions
    fragments = len(spec.get("fragments") or [])
    for p in range(fragments):
        _audit_fragment(store, p, learners, report)
    _strangers(store, learners, report)
    for problem in found.refused:
        report.fail("no-strangers", f"a learner added to the run is refused: {problem}")
    _account(store, learners, fragments, report)
    for lid in found.added:
        report.learners[lid]["added"] = True
    return report


def _account(
    store: RunStore, learners: Mapping[str, str], fragments: int, report: AuditReport
) -> None:
    """Each learner's work (``report.learners``): its status against what it sent."""
    for learner, region in sorted(learners.items()):
        try:
            status = store.progress.read_metrics(learner, region) or {}
        except (OSError, ValueError):
            status = {}
        acc = report.learners.setdefault(learner, {"tokens": dict.fromkeys(OUTCOMES, 0)})
        sent_to = report._sent_to.get(learner, {})
        sent = min((sent_to.get(p, 0) for p in range(fragments)), default=0)
        trained = int(status.get("step") or 0)
        try:
            joins = store.members.joins(learner, region)
        except (OSError, ValueError):
            joins = []
        acc.update(
            region=region,
            state=status.get("state"),
            trained=trained,
            sent=sent,
            unsent=max(0, trained - sent) if status else None,
            joins=[{k: j.get(k) for k in ("join", "host", "time", "took")} for j in joins],
        )
        acc["tokens"] = {k: v // max(1, fragments) for k, v in acc["tokens"].items()}


def _strangers(store: RunStore, learners: Mapping[str, str], report: AuditReport) -> None:
    for region in store.urls:
        bucket = store.bucket(region)
        for name in bucket.list(f"{store.run}/learners"):
            if learners.get(name) == region:
                continue
            held = bucket.list(f"{store.run}/learners/{name}/contributions")
            if held:
                owner = (
                    f"learner of {learners[name]}" if name in learners else "no learner of the run"
                )
                report.fail("no-strangers", f"{region}: {store.run}/learners/{name} holds "
                            f"contributions ({', '.join(held)}) but is {owner}")  # fmt: skip


def _audit_fragment(
    store: RunStore, p: int, learners: Mapping[str, str], report: AuditReport
) -> None:
    records, write_ids, ledger_sent, damaged = _versions(store, p, report)
    sent = _contributions(store, p, learners, ledger_sent, report)
    _check_writes(p, write_ids, report)
    newest = max(records, default=0)
    missing = sorted(set(range(newest + 1)) - set(records) - set(damaged))
    if missing:
        report.fail("versions-contiguous", f"fragment {p}: versions {missing} are missing")
    report.versions += len(set(records) | set(damaged))
    # Versions a later one declares lost (unreadable at home: a syncer went on from an
    # older one and merged their contributions again): their damage was found and dealt
    # with, and their merges are void.
    lost = {int(v) for r in records.values() for v in r.get("lost_versions") or []}
    for v, problems in sorted(damaged.items()):
        if v not in lost:
            for problem in problems:
                report.fail("objects-verify", problem)
    _home_complete(store, p, newest, damaged, report)
    live = {v: r for v, r in records.items() if v not in lost}
    decide_outcomes(p, live, sent, report)
    _balance(p, live, sent, report)
    _data_once(p, sent, report)
    for c in sent.values():
        acc = report.learners.setdefault(c.learner, {"tokens": dict.fromkeys(OUTCOMES, 0)})
        acc["tokens"][c.outcome] += c.new_tokens
        if c.data is not None:
            ends = report._sent_to.setdefault(c.learner, {})
            ends[p] = max(ends.get(p, 0), c.data[1])


def _home_complete(
    store: RunStore, p: int, newest: int, damaged: Mapping[int, list[str]], report: AuditReport
) -> None:
    """The home region holds version ``newest`` of fragment ``p``, whole, master copy
    included (``_versions`` has verified each copy it could read)."""
    home = store.client_region
    key = store.layout.global_marker(p, newest)
    if newest not in store.versions.global_versions(p, home):
        report.fail("home-complete", f"fragment {p}: the home region {home} does not hold "
                    f"v{newest} (its master copy is gone)")  # fmt: skip
        return
    if any(d.startswith(f"{home}: ") for d in damaged.get(newest, [])):
        report.fail("home-complete", f"fragment {p}: the home copy of v{newest} does not verify")
        return
    try:
        marker = read_marker(store.bucket(home), key)
    except (CorruptVersion, FileNotFoundError) as exc:
        report.fail("home-complete", f"fragment {p}: {home}: {exc}")
        return
    groups = {rel.split("/", 1)[0] for rel in marker.objects if "/" in rel}
    if not {"params", "opt"} <= groups:
        report.fail("home-complete", f"fragment {p}: the home copy of v{newest} ({key}) lacks "
                    "the master copy (params and opt)")  # fmt: skip


def _versions(
    store: RunStore, p: int, report: AuditReport
) -> tuple[
    dict[int, dict], dict[tuple[str, int], dict[str, str]], list[dict], dict[int, list[str]]
]:
    """Version records of fragment ``p`` (home's first, then other regions', then the
    ledger's), each copy's write id, the ledger's deleted contributions, and the copies
    that do not verify (version -> what is wrong with each)."""
    records: dict[int, dict] = {}
    damaged: dict[int, list[str]] = defaultdict(list)
    write_ids: dict[tuple[str, int], dict[str, str]] = defaultdict(dict)  # (kind, n) -> where
    home_newest = None
    for region in store.urls:
        bucket = store.bucket(region)
        versions = store.versions.global_versions(p, region)
        if region == store.client_region:
            home_newest = versions[-1] if versions else None
        elif versions and home_newest is not None and versions[-1] < home_newest:
            report.lagging.setdefault(region, {})[p] = versions[-1]
        for v in versions:
            key = store.layout.global_marker(p, v)
            try:
                marker = read_marker(bucket, key)
                write_ids[("version", v)][region] = marker.write_id
                verify_version(bucket, marker, key)
            except (CorruptVersion, FileNotFoundError) as exc:
                damaged[v].append(f"{region}: {exc}")
                continue
            report.objects += 1
            records.setdefault(v, marker.meta)
    ledger_sent: list[dict] = []
    for region in store.urls:
        try:
            entries = read_ledger(store.bucket(region), store.layout, p)
        except CorruptVersion as exc:
            report.fail("objects-verify", f"{region}: {exc}")
            continue
        for entry in entries:
            ledger_sent.extend(entry.get("contributions", []))
            for row in entry.get("versions", []):
                v = int(row["version"])
                records.setdefault(v, row)
                for where, wid in row.get("write_ids", {}).items():
                    write_ids[("version", v)].setdefault(f"{where} (ledger)", wid)
    return records, write_ids, ledger_sent, damaged


def _contributions(
    store: RunStore, p: int, learners: Mapping[str, str], ledger: list[dict],
    report: AuditReport,
) -> dict[tuple[str, int], Sent]:  # fmt: skip
    """Every committed contribution of fragment ``p``: held (verified) or in the ledger."""
    sent: dict[tuple[str, int], Sent] = {}
    for learner, region in learners.items():
        bucket = store.bucket(region)
        for seq in store.contributions.contribution_seqs(learner, p, region):
            key = store.layout.contribution_marker(learner, p, seq)
            try:
                marker = read_marker(bucket, key)
            except (CorruptVersion, FileNotFoundError) as exc:
                report.fail("objects-verify", f"{region}: {exc}")
                continue
            if marker.kind == REVOKED:  # a key a syncer held: no contribution was sent there
                continue
            c = sent[(learner, seq)] = sent_from_meta(learner, seq, marker.meta, marker.write_id)
            try:
                verify_version(bucket, marker, key)
                report.objects += 1
            except (CorruptVersion, FileNotFoundError) as exc:
                c.damage = f"{region}: {exc}"  # a violation unless a syncer rejected it
    for row in ledger:
        key = (str(row["learner"]), int(row["seq"]))
        deleted = sent_from_meta(key[0], key[1], row, str(row.get("write_id")))
        held = sent.setdefault(key, deleted)
        if held.write_id != deleted.write_id:
            report.fail("not-overwritten", f"contribution {key[0]}/{key[1]} of fragment {p} "
                        f"has write ids {held.write_id} and {deleted.write_id} (ledger)")  # fmt: skip
    return sent


def sent_from_meta(learner: str, seq: int, meta: Mapping[str, Any], write_id: str) -> Sent:
    """A committed contribution as its marker's meta (or a ledger row) describes it; with
    ``decide_outcomes``, what ``storage_layout.report`` shares with the audit, so both
    decide outcomes one way."""
    data = meta.get("data")  # absent in contributions written before it was recorded
    return Sent(learner, seq, int(meta.get("base_version", 0)), int(meta.get("anchor_seq", 0)),
                int(meta.get("tokens") or 0), write_id,
                data=(int(data[0]), int(data[1])) if data else None)  # fmt: skip


def _check_writes(p: int, write_ids: Mapping[tuple[str, int], dict[str, str]],
                  report: AuditReport) -> None:  # fmt: skip
    for (kind, n), where in sorted(write_ids.items()):
        if len(set(where.values())) > 1:
            copies = ", ".join(f"{r}: {w}" for r, w in sorted(where.items()))
            report.fail("not-overwritten", f"fragment {p} {kind} {n} was written twice ({copies})")


def decide_outcomes(
    p: int, records: Mapping[int, dict], sent: dict[tuple[str, int], Sent], report: AuditReport
) -> None:
    """Give every contribution its one outcome (see the module docstring)."""
    merged_in: dict[tuple[str, int], list[int]] = defaultdict(list)
    rejected: dict[tuple[str, int], str] = {}
    superseded: dict[tuple[str, int], tuple[str, int]] = {}  # as recorded: -> by whom
    for v, record in sorted(records.items()):
        for learner, seq in record.get("consumed") or []:
            merged_in[(learner, int(seq))].append(v)
        for learner, seq, reason in record.get("rejected") or []:
            rejected.setdefault((learner, int(seq)), str(reason))
        for learner, seq, by in record.get("superseded") or []:
            superseded.setdefault((learner, int(seq)), (learner, int(by)))
    for key, versions in sorted(merged_in.items()):
        if len(versions) > 1:
            report.fail("merged-once", f"fragment {p}: {key[0]}/{key[1]} merged into versions {versions}")  # fmt: skip
        if key not in sent:
            report.fail("merged-committed", f"fragment {p}: version {versions[0]} merged "
                        f"{key[0]}/{key[1]}, which its learner never committed")  # fmt: skip
    report.rejections += len(rejected)
    cursor = (records.get(max(records, default=0)) or {}).get("cursor") or {}
    for key, c in sorted(sent.items()):
        if not c.damage or key in rejected:  # sound, or a syncer found it and said so
            continue
        if key in superseded and key not in merged_in:
            report.unread_damage.append(f"{c.damage} (superseded unread)")
        elif key not in merged_in and c.seq > int(cursor.get(c.learner, 0)):
            report.unread_damage.append(f"{c.damage} (pending: no syncer has read it yet)")
        else:  # corrupt, and no syncer said so
            report.fail("objects-verify", c.damage)
    merged_anchors: dict[tuple[str, int, int], list[int]] = defaultdict(list)
    for key, c in sent.items():
        if key in merged_in:
            merged_anchors[c.anchor].append(c.seq)
    for key, c in sorted(sent.items()):
        later = [s for s in merged_anchors.get(c.anchor, []) if s > c.seq]
        by = _last_of_chain(key, superseded)
        if key in merged_in:
            c.outcome, c.where = "merged", f"v{merged_in[key][0]}"
        elif later:
            c.outcome, c.where = "superseded", f"{c.learner}/{min(later)}"
        elif by in merged_in:  # re-sent with nothing new since the merged ``by``
            c.outcome, c.where = "superseded", f"{by[0]}/{by[1]}"
        elif key in rejected or by in rejected:
            c.outcome = "rejected"
            c.where = rejected.get(key, f"superseded by {by}, rejected")
        elif c.seq > int(cursor.get(c.learner, 0)):
            c.outcome = "pending"
        else:
            c.outcome = "lost"
            report.fail("one-outcome", f"fragment {p}: {c.learner}/{c.seq} is below the cursor "
                        f"({cursor.get(c.learner)}) but was neither merged, superseded nor "
                        "rejected")  # fmt: skip
        report.outcomes[c.outcome] += 1
        report.outcome_of[(p, c.learner, c.seq)] = f"{c.outcome} {c.where}".strip()


def _last_of_chain(
    key: tuple[str, int], superseded: Mapping[tuple[str, int], tuple[str, int]]
) -> tuple[str, int] | None:
    """What ``key`` was finally superseded by: a chain of replacements (a pending send
    replaced by a newer one, itself replaced before the merge) ends at the one that was
    merged or rejected. None if ``key`` was never superseded."""
    by, seen = superseded.get(key), {key}
    while by is not None and by in superseded and by not in seen:
        seen.add(by)
        by = superseded[by]
    return by


def _balance(
    p: int, records: Mapping[int, dict], sent: Mapping[tuple[str, int], Sent], report: AuditReport
) -> None:
    """New tokens per outcome, against what the versions say they merged."""
    last: dict[tuple[str, int, int], int] = {}
    for _, c in sorted(sent.items(), key=lambda kv: kv[1].seq):
        c.new_tokens = c.tokens - last.get(c.anchor, 0)
        last[c.anchor] = c.tokens
        report.tokens["committed"] += c.new_tokens
        report.tokens[c.outcome] += c.new_tokens
    in_versions = sum(int(r.get("tokens") or 0) for r in records.values())
    report.tokens["versions"] += in_versions
    expected = sum(c.new_tokens for c in sent.values() if c.outcome in ("merged", "superseded"))
    if in_versions != expected:
        report.fail("tokens-balance", f"fragment {p}: the versions merged {in_versions} tokens, "
                    f"the contributions merged or superseded carry {expected}")  # fmt: skip


def _data_once(p: int, sent: Mapping[tuple[str, int], Sent], report: AuditReport) -> None:
    """Each anchor's merged data range (its merged sends are cumulative: the union) is
    apart from every other anchor's of the learner; all of them join ``report.data``."""
    anchors: dict[tuple[str, int, int], list[int]] = {}
    for c in sent.values():
        if c.outcome == "merged" and c.data is not None and c.data[1] > c.data[0]:
            lo, hi = anchors.get(c.anchor, [c.data[0], c.data[1]])
            anchors[c.anchor] = [min(lo, c.data[0]), max(hi, c.data[1])]
    by_learner: dict[str, list[list[int]]] = defaultdict(list)
    for (learner, _, _), span in anchors.items():
        by_learner[learner].append(span)
    for learner, spans in sorted(by_learner.items()):
        spans.sort()
        for a, b in pairwise(spans):
            if b[0] < a[1]:
                report.fail("data-once", f"fragment {p}: learner {learner} merged its data "
                            f"{a[0]}-{a[1]} and {b[0]}-{b[1]} (batches) from two anchors")  # fmt: skip
        report.data[learner] = merge_ranges(report.data.get(learner, []) + spans)


def merge_ranges(spans: list[list[int]]) -> list[list[int]]:
    """[from, to) ranges joined where they touch or overlap."""
    out: list[list[int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return out
