"""Planning at datacenter scale: goodput under chip failures, bandwidth and time per step.

Two models, both pure (numpy only: no JAX, no storage, no Prefect), behind
``diloco plan goodput`` (here) and ``diloco plan bandwidth`` (``diloco.bandwidth``).

Goodput (``goodput_table``)
---------------------------
An event-driven failure simulation of N chips, no training. Every chip fails
independently (Poisson) with a mean time between interruptions ``mtbi_hours``; a
failure takes the slice that holds the chip down for ``recovery_seconds`` (its chips
are replaced and it restarts). A failure that hits a slice already down is absorbed by
that restart, so each slice alternates between exponential up times and fixed down
times: for one slice this gives uptime ``1 / (1 + lambda * R)`` exactly.

- ``dp`` (non-elastic data-parallel): the whole job is one slice. Every failure stops
  everyone for R and then ``restart_seconds`` while the whole job restarts; failures
  during the stop are absorbed by it. The job resumes from its last checkpoint
  (``checkpoint_seconds`` of progress apart; 0, the default: from the surviving
  replicas' state, nothing rolled back).
- ``dp_elastic``: the job is cut into slices of ``elastic_slice_chips``. A failure
  stops everyone for ``downscale_seconds`` while the job re-forms without the slice
  (survivors hold the state: no rollback); the slice is back R after its failure and
  is re-added with an ``upscale_seconds`` stop. A failure or return during a stop joins
  it (the job re-forms once with every change so far). In between, the job trains at
  the share of slices up.
- ``decoupled`` (Decoupled DiLoCo): M learners of N / M chips, each its own slice. A
  failure stops only its learner, which loses the work it had neither sent nor
  checkpointed: its fragments' progress since each one's last send (the repository's
  rejoin policy, ``LearnerLoop.start``: new anchors, so unsent work is gone whatever the
  checkpoint). Fragment p of P is sent every ``H * step_seconds`` at staggered offsets,
  so a learner loses about half a sync period. The syncer publishes while at least K
  learners are up; below K the run stalls and nobody's work counts.

Goodput = useful chip-time / allocated chip-time (all N chips for the whole run, down
ones included); uptime = the share of time the run makes progress (the job is not
stopped; for decoupled: at least K learners up, so global versions advance). Useful
work is work that ends in the model: work later rolled back or never sent is not.

Calibration (``FailureModel`` defaults; ``docs/algorithm.md``, "Goodput at datacenter
scale", has the table against every published point). The paper's setting fixes
MTBI = 1 year per chip (one failure every 26 s at 1.2 M chips), H = P = 24 and K = 1.
Fixed a priori: one inner step per second (``diloco simulate``'s clock), elastic slices
of 9216 chips (a pod), no dp rollback, 7 simulated days. Fitted, one constant to one
published point (``calibrate``): ``recovery_seconds`` = 15 s to 88 % for M = 8 at 1.2 M
chips (with K = 1 nothing else enters it); ``restart_seconds`` = 56 s to 27 % for dp at
1.2 M chips; downscale = upscale = 10 s to 40 % for elastic dp at 2.4 M chips. Predicted,
against the 2.4 M points secondary sources report: dp 15.6 % (18), M = 8 78 % (80),
M = 16 88 % (86). With Poisson failures and a stop per failure that does not grow with
the job, dp's odds of losing, (1 - goodput) / goodput = N lambda S, double with the chip
count: 27 % at 1.2 M gives 15.6 % at 2.4 M. A rollback to periodic checkpoints (with the
restart refitted) only lowers it: the old fit, a checkpoint every 40 s and no restart,
gave 6.6 %. The reported 18 % would need a loss that does not grow with the chips.
Not modelled: chip-speed variance, failures of the syncer, a learner's rejoin with
stale optimizer state.

Bandwidth: ``diloco.bandwidth``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

HOURS_PER_YEAR = 365 * 24
CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
LEARNERS = (2, 4, 8, 16)


@dataclass(frozen=True)
class FailureModel:
    """Every time constant of the goodput simulation (seconds unless named otherwise)."""

    mtbi_hours: float = HOURS_PER_YEAR  # per chip (paper); math.inf: no failures
    recovery_seconds: float = 15.0  # a failed slice is back after this (fitted: 88 %)
    restart_seconds: float = 56.0  # dp: then the whole job restarts (fitted: 27 %)
    checkpoint_seconds: float = 0.0  # dp's rollback; 0: survivors hold the state
    downscale_seconds: float = 10.0  # elastic dp: everyone stops while the job shrinks
    upscale_seconds: float = 10.0  # (and while it grows back; both fitted: 40 % at 2.4 M)
    elastic_slice_chips: int = 9216  # elastic dp: the unit dropped on a failure
    step_seconds: float = 1.0  # one inner step (sets decoupled's sync period)
    inner_steps: int = 24  # H: inner steps between two sends of one fragment
    fragments: int = 24  # P
    duration_hours: float = 168.0  # simulated time per cell

    @property
    def chip_rate(self) -> float:
        """Failures per second of one chip."""
        return 1.0 / (self.mtbi_hours * 3600.0)

    @property
    def duration(self) -> float:
        return self.duration_hours * 3600.0

    @property
    def sync_seconds(self) -> float:
        """Time between two sends of one fragment by one learner."""
        return self.inner_steps * self.step_seconds


@dataclass(frozen=True)
class GoodputCell:
    """One cell of the table: fractions of allocated chip-time and of wall time."""

    mode: str
    learners: int
    chips: int
    goodput: float
    uptime: float

    def __post_init__(self) -> None:  # plain floats in [0, 1], whatever numpy rounded
        for name in ("goodput", "uptime"):
            object.__setattr__(self, name, min(1.0, max(0.0, float(getattr(self, name)))))

    def as_dict(self) -> dict:
        return asdict(self)


# --- the failure process -------------------------------------------------------------


@dataclass(frozen=True)
class Outages:
    """Failures of ``slices`` independent slices over [0, duration): when each failed,
    which slice, how long it had been up, and when it is back (may exceed duration)."""

    slices: int
    duration: float
    fail: np.ndarray  # seconds, sorted
    slice: np.ndarray  # slice index of each failure
    up: np.ndarray  # seconds the slice had been up when it failed
    back: np.ndarray  # fail + recovery


def outages(
    rng: np.random.Generator, slices: int, rate: float, recovery: float, duration: float
) -> Outages:
    """Each slice alternates exponential up times (mean ``1 / rate``) and ``recovery``
    down times; failures during a recovery are absorbed by it. Vectorised: a matrix of
    up times per slice, widened until every row passes ``duration``."""
    empty = np.zeros(0)
    if rate <= 0 or duration <= 0:
        return Outages(slices, duration, empty, empty.astype(int), empty, empty)
    mean_cycle = 1.0 / rate + recovery
    width = int(duration / mean_cycle * 1.2 + 6 * math.sqrt(duration / mean_cycle) + 8)
    while True:
        ups = rng.exponential(1.0 / rate, size=(slices, width))
        fails = np.cumsum(ups, axis=1) + recovery * np.arange(width)
        if fails[:, -1].min() >= duration:
            break
        width *= 2  # rare: draw again, wider
    row, col = np.nonzero(fails < duration)
    order = np.argsort(fails[row, col], kind="stable")
    row, col = row[order], col[order]
    fail = fails[row, col]
    return Outages(slices, duration, fail, row, ups[row, col], fail + recovery)


@dataclass(frozen=True)
class Profile:
    """How many slices are up, piecewise constant on [0, duration)."""

    start: np.ndarray  # segment starts (seconds)
    length: np.ndarray  # segment lengths
    up: np.ndarray  # slices up in each segment


def up_profile(o: Outages) -> Profile:
    back = o.back[o.back < o.duration]
    times = np.concatenate([o.fail, back])
    delta = np.concatenate([-np.ones(len(o.fail)), np.ones(len(back))])
    order = np.argsort(times, kind="stable")
    times, delta = times[order], delta[order]
    edges = np.concatenate([[0.0], times, [o.duration]])
    up = o.slices + np.concatenate([[0.0], np.cumsum(delta)])
    return Profile(edges[:-1], np.diff(edges), up)


def checkpoint_loss(up: np.ndarray, interval: float) -> np.ndarray:
    """Progress since the last checkpoint when a job fails after ``up`` seconds of
    progress (checkpoints every ``interval``, and one at every restart)."""
    return np.mod(up, interval) if interval > 0 else np.zeros_like(up)


def unsent_loss(up: np.ndarray, sync_seconds: float, fragments: int) -> np.ndarray:
    """Learner time lost when a learner fails ``up`` seconds after it (re)started: per
    fragment, the time since its last send (or the start), averaged over the P equal
    fragments. Fragment p is first sent at ``(p + 1) * sync / P``, then every ``sync``."""
    if sync_seconds <= 0:
        return np.zeros_like(up)
    offsets = (np.arange(fragments) + 1) * sync_seconds / fragments
    u = up[:, None]
    since = np.where(u < offsets, u, np.mod(u - offsets, sync_seconds))
    return since.mean(axis=1)


# --- the three modes -----------------------------------------------------------------


def simulate_dp(chips: int, fm: FailureModel, rng: np.random.Generator) -> GoodputCell:
    """Non-elastic data-parallel: one slice of all chips, down for the failed slice's
    recovery and the job's restart, then rolled back to its checkpoint."""
    stop = fm.recovery_seconds + fm.restart_seconds
    o = outages(rng, 1, chips * fm.chip_rate, stop, fm.duration)
    down = np.minimum(o.back, o.duration) - o.fail
    lost = checkpoint_loss(o.up, fm.checkpoint_seconds).sum()
    uptime = 1.0 - down.sum() / o.duration
    return GoodputCell("dp", 1, chips, uptime - lost / o.duration, uptime)


def absorbing_stops(arrive: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of the stops that sorted events cause when an event while the job
    runs starts a stop of its own length and one while it is stopped joins that stop
    (the job re-forms once with every change so far). A jump per stop, not per event."""
    starts, ends, i = [], [], 0
    while i < len(arrive):
        start, end = arrive[i], arrive[i] + length[i]
        starts.append(start)
        ends.append(end)
        i = max(i + 1, int(np.searchsorted(arrive, end, side="left")))
    return np.array(starts, dtype=float), np.array(ends, dtype=float)


def simulate_dp_elastic(chips: int, fm: FailureModel, rng: np.random.Generator) -> GoodputCell:
    """Elastic data-parallel: drop the failed slice, re-add it when it is back; the
    whole job stops for every downscale and upscale, but one stop takes in every failure
    and return that happens during it."""
    n = max(1, round(chips / fm.elastic_slice_chips))
    o = outages(rng, n, chips / n * fm.chip_rate, fm.recovery_seconds, fm.duration)
    back = o.back[o.back < o.duration]
    arrive = np.concatenate([o.fail, back])
    length = np.concatenate(
        [np.full(len(o.fail), fm.downscale_seconds), np.full(len(back), fm.upscale_seconds)]
    )
    order = np.argsort(arrive, kind="stable")
    start, end = absorbing_stops(arrive[order], length[order])
    end = np.minimum(end, o.duration)
    # Work = integral of (slices up / n) outside the stops; the integral of the up count
    # is piecewise linear in time, so np.interp evaluates it at the stops' edges exactly.
    # (Between stops no event happens, so the job holds exactly the slices that are up.)
    prof = up_profile(o)
    edges = np.concatenate([prof.start, [o.duration]])
    work = np.concatenate([[0.0], np.cumsum(prof.up * prof.length)])
    stopped = np.interp(end, edges, work) - np.interp(start, edges, work)
    useful = (work[-1] - stopped.sum()) / n
    uptime = 1.0 - (end - start).sum() / o.duration
    return GoodputCell("dp_elastic", 1, chips, useful / o.duration, uptime)


def simulate_decoupled(
    chips: int, learners: int, quorum: int, fm: FailureModel, rng: np.random.Generator
) -> GoodputCell:
    """Decoupled DiLoCo: M independent learners; progress while at least K are up."""
    if not 1 <= quorum <= learners:
        raise ValueError(f"quorum {quorum} must be between 1 and learners {learners}")
    o = outages(rng, learners, chips / learners * fm.chip_rate, fm.recovery_seconds, fm.duration)
    return decoupled_cell(o, chips, quorum, fm)


def decoupled_cell(o: Outages, chips: int, quorum: int, fm: FailureModel) -> GoodputCell:
    """Goodput and uptime of Decoupled DiLoCo under given outages (one slice per learner;
    a test replays the same outages through ``diloco simulate``)."""
    learners = o.slices
    prof = up_profile(o)
    live = prof.up >= quorum
    useful = (prof.up * prof.length)[live].sum()
    # A failure while the run is stalled loses nothing that was counted (approximate for
    # K > 1: unsent work done during a stall is not told apart).
    seg = np.searchsorted(prof.start, o.fail, side="right") - 2  # the segment before it
    counted = live[np.maximum(seg, 0)]
    useful -= unsent_loss(o.up, fm.sync_seconds, fm.fragments)[counted].sum()
    uptime = prof.length[live].sum() / o.duration
    return GoodputCell("decoupled", learners, chips, useful / (learners * o.duration), uptime)


def goodput_table(
    chips: tuple[int, ...] = CHIPS,
    learners: tuple[int, ...] = LEARNERS,
    quorum: int = 1,
    fm: FailureModel = FailureModel(),
    seed: int = 0,
) -> list[GoodputCell]:
    """Every cell: dp and dp_elastic, then decoupled for each M, per chip count. Each
    cell has its own stream, seeded by (seed, chips, mode, M), so a cell's numbers do not
    depend on which other rows and columns the table has."""
    cells = []
    for n in chips:
        cells.append(simulate_dp(n, fm, np.random.default_rng([seed, n, 0])))
        cells.append(simulate_dp_elastic(n, fm, np.random.default_rng([seed, n, 1])))
        for m in learners:
            rng = np.random.default_rng([seed, n, 2, m])
            cells.append(simulate_decoupled(n, m, min(quorum, m), fm, rng))
    return cells


# --- closed forms and the calibration -------------------------------------------------


def dp_stop_seconds(fm: FailureModel) -> float:
    """How long one failure stops non-elastic data-parallel: the slice, then the job."""
    return fm.recovery_seconds + fm.restart_seconds


def dp_uptime_closed_form(chips: int, fm: FailureModel) -> float:
    """Alternating renewal: exponential up (rate N lambda), fixed down S = R + restart."""
    return 1.0 / (1.0 + chips * fm.chip_rate * dp_stop_seconds(fm))


def dp_kept_seconds(chips: int, fm: FailureModel) -> float:
    """Mean progress an up period keeps: ``C * floor(U / C)``, whose mean is
    ``C q / (1 - q)`` with ``q = exp(-Lambda C)``; all of ``E[U]`` when C = 0."""
    lam, c = chips * fm.chip_rate, fm.checkpoint_seconds
    return 1.0 / lam if c <= 0 else c * math.exp(-lam * c) / -math.expm1(-lam * c)


def dp_goodput_closed_form(chips: int, fm: FailureModel) -> float:
    """Renewal reward: progress kept per cycle over a mean cycle ``1 / Lambda + S``."""
    lam = chips * fm.chip_rate
    return dp_kept_seconds(chips, fm) / (1.0 / lam + dp_stop_seconds(fm))


def elastic_uptime_closed_form(chips: int, fm: FailureModel) -> float:
    """Approximate: failures and returns taken as one Poisson stream of rate 2 Lambda
    whose stops absorb what arrives during them, of mean length (D + U) / 2. (Returns
    trail failures by R, so the stream is not quite Poisson: within a point of the
    simulation from 150 k to 2.4 M chips with the defaults.)"""
    busy = chips * fm.chip_rate * (fm.downscale_seconds + fm.upscale_seconds)
    return 1.0 / (1.0 + busy)


def expected_unsent(rate: float, fm: FailureModel) -> float:
    """E[unsent_loss(U)] for U ~ Exp(rate), by quadrature on a grid of a twentieth of
    the spacing between two sends (the loss is piecewise linear on that spacing)."""
    h = fm.sync_seconds / max(fm.fragments, 1) / 20 if fm.sync_seconds > 0 else 1.0
    u = np.arange(0.5, 40.0 / (rate * h)) * h
    density = rate * np.exp(-rate * u) * h
    return float((unsent_loss(u, fm.sync_seconds, fm.fragments) * density).sum())


def learner_goodput_closed_form(chips_per_learner: float, fm: FailureModel) -> float:
    """One learner (K = 1, no stalls), renewal reward: (E[U] - E[unsent(U)]) / (E[U] + R)."""
    rate = chips_per_learner * fm.chip_rate
    return (1.0 / rate - expected_unsent(rate, fm)) / (1.0 / rate + fm.recovery_seconds)


@dataclass(frozen=True)
class Calibration:
    """The three fitted constants of ``FailureModel``, each from one published point."""

    recovery_seconds: float  # Decoupled DiLoCo M = 8 at 1.2 M chips: 88 %
    restart_seconds: float  # non-elastic dp at 1.2 M chips: 27 %
    reconfigure_seconds: float  # elastic dp's downscale = upscale, at 2.4 M chips: 40 %


def calibrate(
    dp_goodput: float = 0.27,
    decoupled_goodput: float = 0.88,
    elastic_goodput: float = 0.40,
    chips: int = 1_200_000,
    elastic_chips: int = 2_400_000,
    learners: int = 8,
    fm: FailureModel = FailureModel(),
) -> Calibration:
    """The constants that put the closed forms on the published points: R from Decoupled
    DiLoCo (K = 1, where neither dp's restart nor checkpoints play a part), then dp's
    restart with that R and ``fm``'s checkpoint interval, then elastic dp's stops."""
    rate = chips / learners * fm.chip_rate
    # (1 / rate - unsent) / (1 / rate + R) = target, solved for R.
    r = (1.0 / rate - expected_unsent(rate, fm)) / decoupled_goodput - 1.0 / rate
    if r < 0:
        raise ValueError(
            f"no recovery time gives {decoupled_goodput:.0%}: lost work alone costs more"
        )
    # kept / (1 / Lambda + R + restart) = target, solved for the restart.
    lam = chips * fm.chip_rate
    restart = dp_kept_seconds(chips, fm) / dp_goodput - 1.0 / lam - r
    if restart < 0:
        raise ValueError(
            f"no restart time gives {dp_goodput:.0%} with recovery {r:.1f} s and a "
            f"checkpoint every {fm.checkpoint_seconds:g} s"
        )
    # 1 / (1 + Lambda (D + U)) = target with D = U.
    stops = (1.0 / elastic_goodput - 1.0) / (elastic_chips * fm.chip_rate)
    return Calibration(r, restart, stops / 2)


# --- bandwidth -----------------------------------------------------------------------
