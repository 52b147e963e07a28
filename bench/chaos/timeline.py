"""Where a learner kill's time goes, from a `diloco train` run's logs.

    python bench/chaos/timeline.py RUN_DIR    # the run's folder: train.log and logs/

For every learner restarted after a kill (the launcher's "was killed ... restarting it"
and "started (pid N[, a spare])" lines), the phases up to its first round, read from
its own log: kill to replacement started, started to its flow run begun (a spare still
importing, then Prefect creating the flow run), flow run to resumed (the runtime built:
a spare still compiling, the checkpoint and the newest versions read), resumed to the
first round done (a round is about 2.5 s on `tiny`). Median and p90 of each, in seconds.
Log timestamps are the machine's clock, so the phases are as the processes saw them.
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

STAMP = re.compile(r"^(\d\d):(\d\d):(\d\d\.\d+) \|")
PHASES = ("kill to started", "started to flow run", "flow run to resumed",
          "resumed to first round", "kill to resumed")  # fmt: skip


def _seconds(line: str) -> float | None:
    m = STAMP.match(line)
    return None if m is None else int(m[1]) * 3600 + int(m[2]) * 60 + float(m[3])


def restarts(run_dir: Path) -> list[dict[str, float]]:
    """One row per restarted learner: each phase's seconds, and whether a spare took over."""
    kills: dict[str, list[float]] = {}
    starts: list[tuple[str, float, bool]] = []
    for line in (run_dir / "train.log").read_text(errors="replace").splitlines():
        at = _seconds(line)
        if at is None:
            continue
        if m := re.search(r"- (learner \S+) was killed .*restarting it", line):
            kills.setdefault(m[1], []).append(at)
        elif m := re.search(r"- (learner \S+) started \(pid \d+(, a spare)?", line):
            starts.append((m[1], at, bool(m[2])))
    rows = []
    for name, started, spare in starts:
        before = [k for k in kills.get(name, []) if started - 60 < k <= started]
        if not before:
            continue  # a first start, not a restart
        region, index = name.split()[1].split("/")
        log = run_dir / "logs" / f"learner-{region}-{index}.log"
        flow = resumed = first = None
        for line in log.read_text(errors="replace").splitlines():
            at = _seconds(line)
            if at is None or at < started:
                continue
            if flow is None and "Beginning subflow" in line:
                flow = at
            elif resumed is None and " resumes from " in line:
                resumed = at
            elif resumed is not None and re.search(r"round \d+' - step", line):
                first = at
                break
        if flow is None or resumed is None or first is None:
            continue  # killed again before its first round
        kill = before[-1]
        rows.append({"spare": spare, PHASES[0]: started - kill, PHASES[1]: flow - started,
                     PHASES[2]: resumed - flow, PHASES[3]: first - resumed,
                     PHASES[4]: resumed - kill})  # fmt: skip
    return rows


def main() -> None:
    rows = restarts(Path(sys.argv[1]))
    print(f"{len(rows)} restarts up to a first round, {sum(r['spare'] for r in rows)} by spares")
    for phase in PHASES:
        values = sorted(r[phase] for r in rows)
        if values:
            p90 = values[int(0.9 * (len(values) - 1))]
            print(f"{phase:24s} median {statistics.median(values):5.1f} s, p90 {p90:5.1f} s")


if __name__ == "__main__":
    main()
