"""The audit's ``data-once`` across learners for a run that takes its data in units
(``audit_units``): each window a learner merged was read by no other, through the ledgers of
the regions, and each region's pool as the report counts it (docs/data.md "Units")."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import astuple
from typing import Any

from diloco.data import DataError
from diloco.units import Span, cut
from flows.ledger import offer_claim, region_ledger, region_pools
from storage_layout.audit_report import AuditReport
from storage_layout.auth import Keys
from storage_layout.store import RunStore


def audit_units(report: AuditReport) -> None:
    """The audit's ``data-once`` across learners when the run takes its data in units
    (``storage_layout.audit`` checks each learner's own): the windows that each
    learner's merged batches (``report.data``, positions of its stream) read, through
    its region's ledger, are read by no other learner's; and each region's pool goes
    into ``report.units``. A ledger record that does not check (a forged span, a release
    that gives back what its learner did not hold) fails the invariant by its key."""
    from diloco.config import validate_config
    from diloco.run_data import RunData

    urls, run = report.regions, report.run
    # with DILOCO_RUN_SECRET set, only the run's own claims count (``storage_layout.auth``)
    key = Keys.from_env(run).claims_key
    first = RunStore(run, urls, next(iter(urls)), writer="audit", claims_key=key)
    spec = first.read_spec()
    cfg = validate_config({**spec["config"], "pipeline": {}})
    if cfg.data.assign != "units":
        return
    # the run's slots and the learners joiners added (a refused one is the audit's stranger)
    plan, learners, batch = (
        RunData(cfg).units,
        first.members.run_learners(spec).regions,
        cfg.data.batch_size,
    )
    merged: dict[tuple[int, int], list[tuple[int, int, str]]] = {}
    offers: dict[tuple[str, str], tuple[str, Span]] = {}  # (to, offer claim) -> (from, span)
    pools = region_pools(spec)
    for region in pools:
        store = RunStore(run, urls, region, writer="audit", claims_key=key)
        ledger = region_ledger(store, plan, learners, region, pools=pools)
        try:
            _audit_region(report, store, ledger, learners, batch, merged, offers)
        except DataError as exc:
            report.fail("data-once", f"{region}: {exc}")
    for to in sorted({to for to, _ in offers}):  # a span moved out is offered where it went: one
        try:  # that is not is trained by no one (a syncer died between claim and offer)
            there = dict(region_ledger(RunStore(run, urls, to, writer="audit", claims_key=key),
                                       plan, learners, to, pools=pools)._offered())  # fmt: skip
        except DataError as exc:
            report.fail("data-once", f"{to}: {exc}")
            continue
        for (dest, claim), (region, span) in offers.items():
            if dest == to and there.get(claim) != span:
                report.units[region].setdefault("moved_not_offered", []).append(claim)
    _check_overlaps(report, merged)


def _audit_region(report: AuditReport, store: RunStore, ledger: Any, learners: Mapping[str, str],
                  batch: int, merged: dict, offers: dict) -> None:  # fmt: skip
    """One region's part of ``audit_units``: each learner's merged batches read through
    its ledger (into ``merged``), the region's pool (into ``report.units``), its claims
    by strangers, and the spans it moved out (into ``offers``)."""
    region = store.client_region
    for lid in ledger.learners:
        stream = ledger.spans(lid)
        for lo, hi in report.data.get(lid, []):
            read = cut(cut(stream, hi * batch)[0], lo * batch)[1]
            if sum(s.windows for s in read) < (hi - lo) * batch:
                report.fail("data-once", f"{lid} merged batches {lo}-{hi}, past the "
                            f"{sum(s.windows for s in stream)} windows its data "
                            f"ledger holds")  # fmt: skip
            for s in read:
                merged.setdefault((s.epoch, s.unit), []).append((s.start, s.end, lid))
    moved = ledger.moved()
    orphans = ledger.orphans()
    report.units[region] = {
        "units_handed_out": store.units.fresh_frontier(),
        "given_back_waiting": [list(astuple(s)) for s in ledger.given_back()],
        "orphan_claims": orphans,
        "moved_out": len(moved),  # offered to the learners of other regions
        "passed_over": sorted(store.passed_over),  # no claims of the run's
    }
    # A claim no learner took, made in the name of none of the run's learners: its
    # span is trained by no one (a forged claim, or one of another run's).
    for claim, record in zip(orphans, store.units.unit_claims(orphans), strict=True):
        who = record.get("learner") if isinstance(record, dict) else None
        if who not in learners:
            report.fail("no-strangers", f"{region}: unit claim {claim} was made by "
                        f"{who!r}, no learner of the run: its data is trained by no "
                        "one")  # fmt: skip
    for claim, (to, span) in moved.items():
        offers[(to, offer_claim(region, claim))] = (region, span)


def _check_overlaps(report: AuditReport, merged: dict[tuple[int, int], list]) -> None:
    """No window of a unit merged from two learners."""
    for (epoch, unit), parts in sorted(merged.items()):
        end, by = -1, ""
        for start, stop, lid in sorted(parts):
            if start < end:
                report.fail("data-once", f"epoch {epoch} unit {unit}: windows {start}-"
                            f"{min(end, stop)} merged from {by} and from {lid}")  # fmt: skip
            if stop > end:
                end, by = stop, lid
