"""The outer step: contributions, their weights, the anchored reference and outer Nesterov.

All functions are pure and work on ``FlatParams`` (``{name: float32 ndarray}``) of one
fragment. Conventions follow ALGORITHM.md:

- outer gradient ``delta = anchor - theta`` (a descent direction, like a gradient);
- weight ``w = c_tokens * (c_tokens / c_steps) * g(staleness)``;
- merged ``Delta``; outer step ``optax.sgd(lr, momentum, nesterov=True)``, so with
  optax's Nesterov ``v <- Delta + beta v``, ``Theta <- Theta - lr (Delta + beta v)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import optax

from diloco.config import OuterConfig
from diloco.merge import normalized
from diloco.tensors import as_tensors
from protocol.quantize import QuantizedTensor, dequantize

FlatParams = dict[str, np.ndarray]
StalenessFn = Callable[[int], float]


@dataclass(frozen=True)
class Contribution:
    """One learner's outer gradient for one fragment, as it travels (quantized)."""

    learner: str
    fragment: int
    seq: int  # per learner, strictly increasing
    base_version: int  # global version of the fragment the anchor came from
    tokens: int  # c_tokens since that version was applied
    steps: int  # c_steps since then
    seconds: float  # learner time those steps took (for step-time estimates and goodput)
    # None in a header: listed from its marker, its data not read yet (``SyncerLoop``
    # reads only the newest of each anchor).
    payload: Mapping[str, QuantizedTensor] | None = field(repr=False)
    step: int = 0  # the learner's inner step when it sent this (a rejoin resumes after it)
    # The learner's seq counter when it took the anchor. Every send from one anchor has a
    # higher seq and carries all the anchor's steps so far (a cumulative outer gradient),
    # so (base_version, anchor_seq) names one trajectory: a learner that rejoins on the
    # version it had anchored on before it failed starts a new one, not a continuation.
    anchor_seq: int = 0
    # The id of version ``base_version`` (``records.version_id``) as the learner read it
    # applying that version; None: it applied none (``FragmentSyncer.unanchored``).
    base_id: str | None = None
    # What a transport found scanning the payload as it read it (``validate.Scan``: its
    # norm, or a problem), so validation does not read it again; None: not scanned yet.
    scan: Any = field(default=None, repr=False, compare=False)

    @property
    def key(self) -> tuple[str, int]:
        return (self.learner, self.seq)

    @property
    def anchor(self) -> tuple[str, int, int]:
        """(learner, base version, anchor seq): sends with one anchor are cumulative."""
        return (self.learner, self.base_version, self.anchor_seq)

    @property
    def nbytes(self) -> int:
        if isinstance(self.payload, Mapping):
            return sum(q.nbytes for q in self.payload.values())
        return int(self.payload.nbytes)

    def outer_gradient(self) -> FlatParams:
        return {n: dequantize(q) for n, q in self.payload.items()}


# --- staleness functions g(s) -------------------------------------------------------


def constant_staleness() -> StalenessFn:
    return lambda s: 1.0


def polynomial_staleness(a: float = 0.5) -> StalenessFn:
    """``(1 + s)^-a``; a = 0.5 is FedBuff's choice."""
    return lambda s: float((1.0 + s) ** (-a))


def exponential_staleness(lam: float = 0.5) -> StalenessFn:
    return lambda s: float(math.exp(-lam * s))


def hinge_staleness(a: float = 0.5, b: float = 1.0) -> StalenessFn:
    """1 up to staleness ``b``, then ``1 / (a (s - b) + 1)``."""
    return lambda s: 1.0 if s <= b else float(1.0 / (a * (s - b) + 1.0))


def staleness_fn(cfg: OuterConfig) -> StalenessFn:
    return {
        "constant": lambda: constant_staleness(),
        "polynomial": lambda: polynomial_staleness(cfg.staleness_a),
        "exponential": lambda: exponential_staleness(cfg.staleness_lambda),
        "hinge": lambda: hinge_staleness(cfg.staleness_a, cfg.staleness_b),
    }[cfg.staleness]()


def token_weight(tokens: int, steps: int) -> float:
    """Quantity x quality: ``tokens * tokens / steps`` (tokens per step rewards full batches)."""
    return 0.0 if steps <= 0 else tokens * tokens / steps


def contribution_weight(c: Contribution, staleness: int, g: StalenessFn) -> float:
    return token_weight(c.tokens, c.steps) * g(staleness)


# --- the anchored reference (``outer.reference``; the merge rules: ``diloco.merge``) --


class Anchored:
    """``anchored_delta`` a piece at a time: ``current - base + delta``."""

    def __init__(self, current: Any, base: Any, delta: Any):
        self.current, self.base, self.delta = as_tensors(current), as_tensors(base), delta

    @property
    def shapes(self) -> Mapping[str, tuple[int, ...]]:
        return self.delta.shapes

    def parts(self, name: str, start: int, stop: int) -> tuple[np.ndarray, ...]:
        r"""The three pieces ``piece`` combines, only read (a syncer reads them on one
        thread and ``combine``\ s them on another)."""
        return (self.current.piece(name, start, stop), self.base.piece(name, start, stop),
                self.delta.piece(name, start, stop))  # fmt: skip

    @staticmethod
    def combine(parts: tuple[np.ndarray, ...]) -> np.ndarray:
        current, base, delta = parts
        return current - base + delta

    def piece(self, name: str, start: int, stop: int) -> np.ndarray:
        return self.combine(self.parts(name, start, stop))


# --- outer optimizer and learner blend -------------------------------------------------


def cgad_scale(alpha: float, cutoff: int) -> StalenessFn:
    """CGAD's age scale (arXiv 2605.09126): ``sigma(s) = gamma(s) exp(-alpha s)``, the
    cosine gate ``gamma(s) = (1 + cos(pi s / cutoff)) / 2`` below ``cutoff`` and 0 from
    it: 1 for fresh work, falling smoothly to nothing at the cutoff."""

    def sigma(s: int) -> float:
        gate = 0.5 * (1.0 + math.cos(math.pi * s / cutoff)) if s < cutoff else 0.0
        return gate * math.exp(-alpha * s)

    return sigma


@dataclass(frozen=True)
class OuterOptimizer:
    """An outer optimizer: its optax transform, and how much of a contribution ``s``
    versions old reaches it (``age_scale``: a factor on the contribution's share of the
    merge, which the staleness weights only share out; 1 at any age but for CGAD)."""

    transform: Callable[[OuterConfig], optax.GradientTransformation]
    age_scale: Callable[[OuterConfig], StalenessFn] = lambda cfg: constant_staleness()


def _adam(cfg: OuterConfig) -> optax.GradientTransformation:
    return optax.adam(cfg.lr, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps)


# The outer optimizers by name (``outer.optimizer``): any optax transform whose state is
# arrays of each parameter's shape and step counts (``tensors.state_slots``), which the
# syncer steps a piece at a time. A new one is an entry here and in the config's names.
OUTER_OPTIMIZERS: dict[str, OuterOptimizer] = {
    "sgd": OuterOptimizer(
        lambda cfg: optax.sgd(cfg.lr, momentum=cfg.momentum or None, nesterov=cfg.nesterov)
    ),
    "adam": OuterOptimizer(_adam),
    # Cosine-Gated Adam-Decay: Adam on outer gradients scaled by their age.
    "cgad": OuterOptimizer(
        _adam, lambda cfg: cgad_scale(cfg.cgad_alpha, cfg.cgad_cutoff or cfg.max_staleness + 1)
    ),
}


def outer_optimizer(cfg: OuterConfig) -> optax.GradientTransformation:
    return OUTER_OPTIMIZERS[cfg.optimizer].transform(cfg)


def merge_weights(
    contributions: Sequence[Contribution],
    staleness: Sequence[int],
    cfg: OuterConfig,
    since: Sequence[int] | None = None,
) -> np.ndarray:
    """Each contribution's factor in the merged outer gradient: its token weight times
    ``g(staleness)`` (``staleness_fn``), normalized to sum to one, times the optimizer's
    age scale (``OuterOptimizer.age_scale``), times ``min(1, T / since)``: ``T`` the
    merge's tokens, ``since`` the tokens merged after the contribution's base version
    that its learner did not train (the anchored reference's; 0 for work made on the
    newest version).

    An anchored outer gradient, ``current - base + delta``, carries the globals back from
    ``current`` towards its base as well: merged alone and whole (a straggler's last send,
    merged below the quorum at a run's end), it set the fragment to that learner's
    parameters, a few steps past an old version. With the factor, a merge carries the
    globals back by no more tokens than it brings (``bench/quality/share.md``)."""
    g, scale = staleness_fn(cfg), OUTER_OPTIMIZERS[cfg.optimizer].age_scale(cfg)
    w = normalized(
        [contribution_weight(c, s, g) for c, s in zip(contributions, staleness, strict=True)]
    )
    tokens = sum(c.tokens for c in contributions)
    share = [min(1.0, tokens / t) if t else 1.0 for t in since or [0] * len(staleness)]
    return w * np.array([scale(s) * f for s, f in zip(staleness, share, strict=True)], np.float64)


def blend(local: FlatParams, global_: FlatParams, alpha: float) -> FlatParams:
    """Learner side: ``theta <- alpha theta + (1 - alpha) Theta`` (alpha = 0 overwrites)."""
    if alpha == 0.0:
        return {n: np.array(v, dtype=np.float32) for n, v in global_.items()}
    return {n: (alpha * local[n] + (1.0 - alpha) * global_[n]).astype(np.float32) for n in global_}
