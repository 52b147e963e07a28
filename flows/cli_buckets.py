"""``diloco inspect``, ``gc`` and ``data``: what the buckets hold, a run's audit, what no
worker can still need, and token data sets."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from diloco.config import ConfigError, CostConfig
from diloco.cost import bill
from diloco.data import DataError
from diloco.dataset import CHUNK_TOKENS
from diloco.prepare import DEFAULT_VOCAB
from diloco.rate import duration_text, rate_text
from flows.cli_args import bucket_url
from flows.observe import dollar, human_bytes
from flows.train import console, stdout_console

INSPECT_LEGEND = """\
columns:
  fragments  newest: newest global version in the bucket given; per region: each
             region's newest; kept: versions held there; size: bytes of the newest
             version; consumed, tokens: contributions and tokens it merged;
             quorum / members: the quorum it merged under, of the learners the
             syncer counted as members then
  learners   state: what its status object says, and how long ago (never started:
             none yet); joins: times the slot was taken by `diloco join`;
             (added by HOST, DEVICES, speed X): a slot a joiner on HOST added beyond
             the run's (`members/`), with the devices and `--speed` hint it recorded;
             newest seq: the learner's newest committed contribution to the fragment;
             stored: its contributions still held; base: the global version that one
             started from; staleness: newest version - base; size: its payload bytes;
             checkpoint: inner step of its newest checkpoint
  speed      tokens merged per second over each fragment's last versions (their
             mean), the tokens merged, the time left at that pace to the budget
  traffic    bytes and requests per source -> destination region, over every writer,
             and what they cost at docs/cost.md's default prices"""


def add_bucket_parsers(sub: argparse._SubParsersAction) -> None:
    """``diloco inspect`` and ``diloco gc``."""
    ins = sub.add_parser("inspect", help="show what a bucket holds", epilog=INSPECT_LEGEND,
                         formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ins.add_argument("url", nargs="+", metavar="[REGION=]URL",
                     help="a region's bucket URL (file://, s3://, gs://, or a folder)")  # fmt: skip
    ins.add_argument("--run", help="only this run")
    ins.add_argument("--verify", action="store_true", help="re-check every object's sha256")
    ins.add_argument("--audit", action="store_true",
                     help="check the run's invariants in the buckets given (needs --run): "
                     "every contribution accounted for once, versions complete and intact")  # fmt: skip
    ins.add_argument("--json", action="store_true", help="machine-readable output")
    ins.set_defaults(func=cmd_inspect)
    gc = sub.add_parser("gc", help="delete what no learner or syncer of a run can still need")
    gc.add_argument("url", help="the run's home bucket (the syncers' region)")
    gc.add_argument("--run", required=True, help="the run")
    gc.add_argument("--keep", type=int, default=None,
                    help="global versions kept per fragment (at least max_staleness + 2; "
                         "default: what the run keeps, its launch's pipeline.keep_versions "
                         "or max_staleness + 2)")  # fmt: skip
    gc.add_argument("--orphan-age", type=float, default=3600.0,
                    help="delete uncommitted data and temporaries older than this many "
                         "seconds")  # fmt: skip
    gc.set_defaults(func=cmd_gc)


def run_store(url: str, run: str, writer: str) -> Any:
    """A ``RunStore`` of every region of ``run``, from one region's bucket ``url`` (its
    spec's), that region as its client's."""
    from storage_layout.auth import Keys
    from storage_layout.bucket import same_bucket
    from storage_layout.faults import Injector
    from storage_layout.store import RunStore

    url = bucket_url(url)
    faults = Injector.from_env()  # a command's storage faults: its environment's (tests)
    regions = RunStore(run, {"given": url}, "given", faults=faults).read_spec().get("regions") or {}
    region = next((r for r, u in regions.items() if same_bucket(str(u), url)), None)
    if region is None:
        raise ConfigError(f"{url} is none of run {run!r}'s regions: {regions}")
    # with DILOCO_RUN_SECRET set, the run's claims are checked (``storage_layout.auth``)
    return RunStore(run, regions, region, writer=writer, claims_key=Keys.from_env(run).claims_key,
                    faults=faults)  # fmt: skip


def cmd_gc(args: argparse.Namespace) -> int:
    """Retention by hand (the syncers run it as they go): processed contributions, old
    versions, abandoned writes. Reads the spec only: no training code is loaded."""
    from storage_layout.auth import Keys
    from storage_layout.retention import collect_garbage

    if args.keep is not None and args.keep < 1:
        raise ConfigError(f"--keep must be at least 1, got {args.keep}")
    store = run_store(args.url, args.run, "gc")
    spec = store.read_spec()
    keep = args.keep if args.keep is not None else _launched_keep(store)
    window = max(keep or 0, int(spec["config"]["outer"]["max_staleness"]) + 2)
    learners = store.members.run_learners(spec, Keys.from_env(args.run).verifying_key).regions
    report = collect_garbage(store, len(spec["fragments"]), learners, window,
                             orphan_age=args.orphan_age, keys=Keys.from_env(args.run))  # fmt: skip
    stdout_console().print(
        f"run {args.run}: deleted {report.contributions_deleted} contributions, "
        f"{report.globals_deleted} global versions, {report.orphans_deleted} abandoned writes "
        f"and {report.temporaries_deleted} temporaries "
        f"({human_bytes(report.bytes_freed)}); kept {window} versions per fragment"
    )
    for problem in report.problems:
        console.print(f"[yellow]kept:[/] {problem}")
    return 0


def _launched_keep(store: Any) -> int | None:
    """``pipeline.keep_versions`` of the run's newest launch (None: what the run needs)."""
    from pydantic import ValidationError

    from diloco.config import PipelineConfig
    from flows.spec import launched_pipeline

    settings = launched_pipeline(store)
    try:
        return PipelineConfig.model_validate(settings).keep_versions
    except ValidationError as exc:
        raise ConfigError(f"run {store.run!r}: the pipeline settings of its newest launch "
                          f"({store.layout.pipeline}) do not read: {exc}") from None  # fmt: skip


def audited_regions(run: str, items: list[str]) -> dict[str, str]:
    """``[REGION=]URL`` arguments -> region -> URL. A bare URL must be one the run's spec
    names (a copy of a bucket elsewhere is given with its region: ``us=/backup/us``)."""
    from storage_layout.store import RunStore

    out: dict[str, str] = {}
    for item in items:
        named = "=" in item.split("://", 1)[0]
        name, url = item.split("=", 1) if named else ("", item)
        url = bucket_url(url)
        if not name:
            regions = RunStore(run, {"given": url}, "given").read_spec().get("regions", {})
            name = next((r for r, u in regions.items() if u.rstrip("/") == url.rstrip("/")), "")
            if not name:
                raise ConfigError(f"{url} is none of run {run!r}'s regions ({regions}); "
                                  f"name the region it holds: REGION={url}")  # fmt: skip
        if name in out:
            raise ConfigError(f"region {name!r} given twice")
        out[name] = url
    return out


def cmd_audit(args: argparse.Namespace) -> int:
    from flows.ledger_audit import audit_units
    from storage_layout.audit import audit_run
    from storage_layout.audit_report import INVARIANTS

    if not args.run:
        raise ConfigError("--audit needs --run NAME (the run whose invariants to check)")
    report = audit_run(args.run, audited_regions(args.run, args.url))
    audit_units(report)
    if args.json:
        print(json.dumps(report.as_dict(), indent=1, sort_keys=True))
        return 0 if report.ok else 1
    out = stdout_console()
    spec_note = (
        f" (read at the spec's URL: {', '.join(report.from_spec)})" if report.from_spec else ""
    )
    out.print(f"[bold]audit of run {report.run}[/]{spec_note}")
    for region, url in report.regions.items():
        out.print(f"  {region}: {url}")
    table = Table("invariant", "result", "objects")
    for name in INVARIANTS:
        bad = report.violations.get(name, [])
        shown = "\n".join(bad[:10]) + (f"\n... and {len(bad) - 10} more" if len(bad) > 10 else "")
        table.add_row(name, "[red]FAILED[/]" if bad else "[green]ok[/]", shown)
    out.print(table)
    out.print("contributions: " + ", ".join(f"{k} {v}" for k, v in report.outcomes.items()))
    out.print("tokens: " + ", ".join(f"{k} {v:,}" for k, v in report.tokens.items()))
    out.print(f"{report.versions} versions accounted for, {report.objects} markers verified")
    for learner, spans in sorted(report.data.items()):
        ranges = ", ".join(f"{lo}-{hi}" for lo, hi in spans)
        out.print(f"data merged from {learner} (its batches, [from, to)): {ranges}")
    for region, pool in sorted(report.units.items()):
        back = pool["given_back_waiting"]
        windows = sum(end - start for _, _, start, end in back)
        orphans = ", ".join(pool["orphan_claims"]) or "none"
        lost = ", ".join(pool.get("moved_not_offered", [])) or "none"
        out.print(f"data units of {region}'s pool: {pool['units_handed_out']} handed out, "
                  f"{len(back)} spans ({windows} windows) given back or offered and not "
                  f"taken yet, claims no learner recorded: {orphans}, {pool['moved_out']} "
                  f"spans offered to other regions (not offered where they went: {lost})")  # fmt: skip
    for learner, acc in sorted(report.learners.items()):
        tokens = ", ".join(f"{k} {v:,}" for k, v in acc["tokens"].items() if v)
        unsent = "" if acc.get("unsent") is None else f", unsent {acc['unsent']}"
        if acc.get("joins"):
            unsent += f", joined {len(acc['joins'])}x (last from {acc['joins'][-1]['host']})"
        where = f"{acc.get('region')}, added" if acc.get("added") else acc.get("region")
        out.print(f"learner {learner} ({where}): {acc.get('state') or 'no status'}; "
                  f"batches trained {acc.get('trained')}, sent {acc.get('sent')}{unsent}; "
                  f"tokens {tokens or 'none'}")  # fmt: skip
    for damage in report.unread_damage:
        out.print(f"[yellow]damaged, never read:[/] {damage}")
    for region, frags in report.lagging.items():
        out.print(f"[yellow]lagging:[/] {region} holds newest versions {frags}")
    return 0 if report.ok else 1


def cmd_inspect(args: argparse.Namespace) -> int:
    from storage_layout.inspect import inspect_bucket

    if args.audit:
        return cmd_audit(args)
    named = any("=" in item.split("://", 1)[0] for item in args.url)
    if (len(args.url) > 1 or named) and not args.run:
        raise ConfigError("several buckets, or REGION=URL, need --run NAME")
    # Verification reads the buckets given, each in its region, never the spec's URLs.
    given = audited_regions(args.run, args.url) if named or (args.verify and args.run) else None
    url = next(iter(given.values())) if given else bucket_url(args.url[0])
    report = inspect_bucket(url, run=args.run, verify=args.verify, given=given)
    problems = [p for r in report["runs"] for p in r["problems"]]
    if args.json:
        print(json.dumps(report, indent=1, sort_keys=True, default=str))
    else:
        _print_report(report, url)
    return 1 if problems else 0


def _print_report(report: dict[str, Any], url: str) -> None:
    """``diloco inspect``'s report as tables, for people."""
    out = stdout_console()
    if not report["runs"]:
        out.print(f"no runs in {url}")
    for run in report["runs"]:
        out.print(
            f"[bold]run {run['run']}[/]  regions: "
            + ", ".join(f"{k}={v}" for k, v in run["regions"].items())
        )
        frag = Table("fragment", "newest", "per region", "kept", "size", "consumed", "tokens",
                     "quorum / members")  # fmt: skip
        for f in run["fragments"]:
            regions = " ".join(f"{r}:{v}" for r, v in f["versions"].items())
            quorum = "-" if f.get("quorum") is None else f"{f['quorum']} / {len(f['members'])}"
            frag.add_row(str(f["fragment"]), str(f.get("newest", "-")), regions, str(f.get("kept", 0)),
                         human_bytes(f.get("bytes", 0)), str(f.get("consumed", "-")), str(f.get("tokens", "-")),
                         quorum)  # fmt: skip
        out.print(frag)
        if run.get("speed"):
            out.print(speed_line(run["speed"]))
        out.print(_learner_table(run))
        for region, pool in sorted(run.get("units", {}).items()):
            out.print(f"data units of {region}'s pool: {pool['handed_out']} handed out, "
                      f"{pool['offered_here']} spans offered from other regions' pools, "
                      f"{pool['returns_taken']} spans given back or offered and taken "
                      "(--audit checks the ledger)")  # fmt: skip
        if run["traffic"]:
            spent = bill(run["traffic"], CostConfig())
            tr = Table("source -> destination", "bytes", "requests", "cost (docs/cost.md)")
            for pair, t in run["traffic"].items():
                tr.add_row(pair, human_bytes(t["bytes"]), str(t["requests"]),
                           dollar(spent.pairs[pair]))  # fmt: skip
            tr.add_row("all", "", "", dollar(spent.total))
            out.print(tr)
        out.print(INSPECT_LEGEND, style="dim", markup=False, highlight=False)
        if "verified_versions" in run:
            where = ", ".join(f"{r}={u}" for r, u in run["verified"].items())
            out.print(f"verified {run['verified_versions']} committed versions in {where}")
        for problem in run["problems"]:
            out.print(f"[red]problem:[/] {problem}")


def speed_line(speed: dict[str, Any]) -> str:
    """The run's pace as ``inspect`` measured it (``storage_layout.inspect.run_speed``)."""
    of = f" of {speed['budget']:,}" if speed.get("budget") else ""
    left = speed["seconds_left"]
    return (f"speed: {rate_text(speed['tokens_per_second'])} tokens merged over the last "
            f"versions · {speed['tokens']:,.0f}{of} tokens · "
            f"{'done' if left == 0 else duration_text(left) + ' left'} · newest version "
            f"{duration_text(speed['newest_age_s'])} ago")  # fmt: skip


def _learner_table(run: dict[str, Any]) -> Table:
    """One row per learner and fragment it sent (a row for a slot that sent nothing)."""
    lrn = Table("learner", "region", "state", "joins", "fragment", "newest seq", "stored",
                "base", "staleness", "size", "checkpoint")  # fmt: skip
    for row in run["learners"]:
        state = row.get("state") or ("never started" if "joins" in row else "-")
        if row.get("status_age_s") is not None:
            state += f", {row['status_age_s']:.0f} s ago"
        if row.get("beat"):  # (alive: its heartbeat, apart from its status)
            beat = row["beat"]
            state += f"; heartbeat {beat['age_s']:.0f} s ago ({beat['state']})"
        machine = [row.get("host"), row.get("devices") and f"devices {row['devices']}"]
        if row.get("speed") is not None:
            machine.append(f"speed {row['speed']:g}")
        added = f" (added by {', '.join(m for m in machine if m)})" if row.get("added") else ""
        name = row["learner"] + added
        head = [name, row["region"], state, str(row.get("joins", "-"))]
        step = row.get("checkpoint_step")
        ckpt = "-" if step is None else str(step)
        for p, info in sorted(row["fragments"].items()) or [(None, None)]:
            if info is None:  # nothing sent: the slot still shows
                lrn.add_row(*head, *["-"] * 6, ckpt)
                continue
            lrn.add_row(*head, str(p), str(info["newest_seq"]), str(info["stored"]),
                        str(info["base_version"]), str(info["staleness"]), human_bytes(info["bytes"]),
                        ckpt)  # fmt: skip
    return lrn


def add_data_parser(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="tokenize text into a data set in a bucket")
    dsub = data.add_subparsers(dest="data_command", required=True)
    prep = dsub.add_parser("prepare", help="tokenize SOURCE into token shards at --out")
    prep.add_argument("source", help="text file, JSON lines or Parquet file, folder of them, "
                      "or fsspec URL")  # fmt: skip
    prep.add_argument("--out", required=True, help="the data set's folder or bucket URL")
    prep.add_argument("--tokenizer", help="a tokenizer.json or SentencePiece .model to use "
                      "(default: train a byte-level BPE on SOURCE)")  # fmt: skip
    prep.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB,
                      help=f"the trained BPE's vocabulary (default {DEFAULT_VOCAB})")  # fmt: skip
    prep.add_argument("--val-percent", type=int, default=5,
                      help="percent of documents held out for validation (default 5)")  # fmt: skip
    prep.add_argument("--text-field", default="text",
                      help="the JSON lines field or Parquet column holding the text")  # fmt: skip
    prep.add_argument("--workers", type=int, help="tokenizer threads (default: all cores)")
    prep.add_argument("--chunk-tokens", type=int, default=CHUNK_TOKENS,
                      help="tokens per chunk: what a learner reads and checks at a time, and "
                      f"the unit dealt to learners (default {CHUNK_TOKENS:,})")  # fmt: skip
    prep.add_argument("--quiet", action="store_true", help="no progress bar")
    prep.set_defaults(func=cmd_data_prepare)
    show = dsub.add_parser("show", help="print a data set's manifest summary")
    show.add_argument("url", help="the data set's folder or bucket URL")
    show.set_defaults(func=cmd_data_show)


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from diloco.prepare import prepare

    if not 0 <= args.val_percent <= 50:
        raise DataError(f"--val-percent {args.val_percent} is not between 0 and 50")
    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
               TimeElapsedColumn()]  # fmt: skip
    with Progress(*columns, console=console, disable=args.quiet) as bar:
        tasks: dict[str, Any] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done)

        prepare(args.source, args.out, args.tokenizer, args.vocab_size, args.val_percent,
                args.text_field, args.workers, args.chunk_tokens, progress=progress)  # fmt: skip
    return cmd_data_show(argparse.Namespace(url=args.out))


def cmd_data_show(args: argparse.Namespace) -> int:
    from diloco.dataset import open_dataset

    ds = open_dataset(args.url)
    m = ds.manifest
    table = Table(title=f"data set {args.url}")
    for col in ("split", "shards", "chunks", "documents", "tokens", "bytes"):
        table.add_column(col, justify="left" if col == "split" else "right")
    for split, totals in m["totals"].items():
        shards = [s for s in m["shards"] if s["split"] == split]
        table.add_row(split, str(len(shards)), str(sum(len(s["chunk_sha256"]) for s in shards)),
                      f"{totals['documents']:,}", f"{totals['tokens']:,}",
                      human_bytes(totals["tokens"] * ds.dtype.itemsize))  # fmt: skip
    stdout_console().print(table)
    tok = m["tokenizer"]
    stdout_console().print(
        f"tokenizer {tok['file']} ({tok['kind']}), vocabulary {tok['vocab_size']:,}, eos "
        f"{tok['eos_id']}, tokens {m['dtype']}, chunks of {m['chunk_tokens']:,} tokens; "
        f"source {m['source']['url']} ({m['source']['files']:,} files, "
        f"{human_bytes(m['source']['bytes'])}); train with "
        f"--set data.source={args.url} --set model.vocab_size={tok['vocab_size']}",
        soft_wrap=True,
    )
    return 0
