"""Merge rules: how a syncer combines the accepted outer gradients of a fragment into
the one its outer optimizer steps with, a piece at a time (``diloco.tensors``), by the
contributions' weights (``diloco.outer.merge_weights``: summing to one, less for stale
work that brings less than it carries back). A rule may read the
outer optimizer's momentum (``reference``: its first state array, the direction the
globals have been moving in; None where the optimizer keeps none).

A rule is chosen by name (``outer.merge``) from ``MERGE_RULES`` (made from the outer
config: ``merge_rule``); a new rule is a class here with the two methods of
``MergeRule`` and an entry in ``MERGE_RULES`` and the config's ``MergeName``. The
arithmetic is float64 summed in piece order, then float32, so a fragment merged in pieces
of any size gives the bits of one merged whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from diloco.config import OuterConfig
from diloco.tensors import Tensors, pieces


class MergeRule(Protocol):
    def prepare(
        self,
        deltas: Sequence[Tensors],
        w: np.ndarray,
        shapes: Mapping[str, Sequence[int]],
        is_embedding: Callable[[str], bool],
        block_size: int,
        reference: Tensors | None = None,
    ) -> Any:
        """What the rule needs of whole tensors before their first piece is merged (a
        pass over the pieces of ``deltas``, and of the outer momentum ``reference``), or
        None."""

    def piece(self, name: str, values: Sequence[np.ndarray], w: np.ndarray, prepared: Any,
              reference: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
        """The merged piece of tensor ``name`` from each outer gradient's ``values`` (and
        the outer momentum's piece ``reference``)."""


def normalized(weights: Sequence[float]) -> np.ndarray:
    """Merge weights summing to one (float64); ``ValueError`` if they cannot."""
    w = np.asarray(weights, dtype=np.float64)
    total = w.sum()
    if not np.isfinite(total) or total <= 0:
        raise ValueError(f"merge weights must sum to a positive number, got {w.tolist()}")
    return w / total


def mean_piece(values: Sequence[np.ndarray], w: np.ndarray) -> np.ndarray:
    """``sum_m w_m delta_m`` of one piece (``weighted_sum``), in float32."""
    return weighted_sum(values, w).astype(np.float32)


def weighted_sum(values: Sequence[np.ndarray], w: np.ndarray) -> np.ndarray:
    """``sum_m w_m delta_m`` of one piece in float64 (products summed from zero in order),
    in two float64 buffers made once rather than two new arrays a term (five times faster
    for a syncer's pieces)."""
    if len(w) != len(values):
        raise ValueError(f"{len(values)} values for {len(w)} weights")
    total = np.zeros(np.shape(values[0]) if values else (), np.float64)
    term = np.empty_like(total)
    for wi, d in zip(w, values, strict=True):
        np.multiply(d, wi, out=term, dtype=np.float64)
        total += term
    return total


class Mean:
    """The weighted mean of the outer gradients, tensor by tensor."""

    def prepare(self, *args: Any) -> None:
        return None

    def piece(self, name: str, values: Sequence[np.ndarray], w: np.ndarray, prepared: Any,
              reference: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
        return mean_piece(values, w)


def _unit_sum(values: Sequence[np.ndarray], w: np.ndarray, norms: Sequence[float]) -> np.ndarray:
    return sum(
        wi * (x.astype(np.float64) / r if r > 0 else np.zeros(x.shape))
        for wi, x, r in zip(w, values, norms, strict=True)
    )


class Rda:
    """Radial-directional average (ALGORITHM.md, merge rule): per tensor, the weighted
    mean of the outer gradients' norms times the unit vector of the weighted sum of their
    unit vectors, so orthogonal updates keep their size where a mean shrinks it; the
    embeddings by weighted mean."""

    def prepare(
        self,
        deltas: Sequence[Tensors],
        w: np.ndarray,
        shapes: Mapping[str, Sequence[int]],
        is_embedding: Callable[[str], bool],
        block_size: int,
        reference: Tensors | None = None,
    ) -> dict[str, tuple[list[float], float]]:
        """Per non-embedding tensor, the norm of each outer gradient and the norm of
        their weighted sum of unit vectors (two passes over the pieces)."""
        kept = {n: s for n, s in shapes.items() if not is_embedding(n)}
        sums = {n: [0.0] * len(deltas) for n in kept}
        for name, a, b in pieces(kept, block_size):
            for i, d in enumerate(deltas):
                sums[name][i] += float(np.sum(np.square(d.piece(name, a, b), dtype=np.float64)))
        norms = {n: [math.sqrt(x) for x in v] for n, v in sums.items()}
        direction = dict.fromkeys(kept, 0.0)
        for name, a, b in pieces(kept, block_size):
            s = _unit_sum([d.piece(name, a, b) for d in deltas], w, norms[name])
            direction[name] += float(np.sum(np.square(s)))
        return {n: (norms[n], math.sqrt(direction[n])) for n in kept}

    def piece(
        self,
        name: str,
        values: Sequence[np.ndarray],
        w: np.ndarray,
        prepared: dict[str, tuple[list[float], float]],
        reference: np.ndarray | None = None,
    ) -> np.ndarray:
        if name not in prepared:  # an embedding
            return mean_piece(values, w)
        norms, direction = prepared[name]
        if direction <= 0:
            return np.zeros(values[0].shape, np.float32)
        radius = sum(wi * r for wi, r in zip(w, norms, strict=True))
        return (radius * (_unit_sum(values, w, norms) / direction)).astype(np.float32)


class HeLoCo:
    """HeLoCo's correction (arXiv 2606.00271): each outer gradient ``D`` is set against the
    outer momentum ``m`` (``reference``), tensor by tensor (a block ``b``), before the
    weighted mean. With ``u = D / |D|``, ``v = m / |m|``, the cosine ``c = u . v`` and the
    confidence ``conf = |D| / (|D| + kappa |m| + eps)``:

    - aligned, ``c >= c_ok``: kept;
    - opposed, ``c < 0``: its part against the momentum shrunk,
      ``D - beta c |D| v`` with ``beta = min(k_s (-c) conf, beta_max)``;
    - weakly aligned, ``0 <= c < c_ok``: turned towards the momentum at its own length,
      ``|D| t / |t|`` with ``t = (1 - lam) u + lam v``, ``lam = min(k_d (1 - c) conf, 1)``.

    Each case is ``a D + b m`` for scalars of the tensor (``prepare``: one pass for the
    dot products and norms), so a piece merges as ``sum_i w_i a_i D_i + (sum_i w_i b_i) m``.
    Before the optimizer has any momentum (its first step, or none kept) nothing is
    corrected."""

    def __init__(self, c_ok: float, k_s: float, beta_max: float, k_d: float, kappa: float):
        self.c_ok, self.k_s, self.beta_max = c_ok, k_s, beta_max
        self.k_d, self.kappa = k_d, kappa

    def prepare(
        self,
        deltas: Sequence[Tensors],
        w: np.ndarray,
        shapes: Mapping[str, Sequence[int]],
        is_embedding: Callable[[str], bool],
        block_size: int,
        reference: Tensors | None = None,
    ) -> dict[str, tuple[np.ndarray, float]]:
        """Per tensor: each outer gradient's factor ``w_i a_i`` and the momentum's
        ``sum_i w_i b_i``."""
        if reference is None:
            return {}
        dots = {n: np.zeros(len(deltas)) for n in shapes}
        sq = {n: np.zeros(len(deltas)) for n in shapes}
        msq = dict.fromkeys(shapes, 0.0)
        for name, a, b in pieces(shapes, block_size):
            m = reference.piece(name, a, b).astype(np.float64)
            msq[name] += float(np.dot(m, m))
            for i, d in enumerate(deltas):
                x = d.piece(name, a, b).astype(np.float64)
                dots[name][i] += float(np.dot(x, m))
                sq[name][i] += float(np.dot(x, x))
        out = {}
        for name in shapes:
            ab = [self.coefficients(math.sqrt(n2), dot, math.sqrt(msq[name]))
                  for dot, n2 in zip(dots[name], sq[name], strict=True)]  # fmt: skip
            out[name] = (w * np.array([a for a, _ in ab]), float(np.dot(w, [b for _, b in ab])))
        return out

    def coefficients(self, norm: float, dot: float, m_norm: float) -> tuple[float, float]:
        """``(a, b)`` of one outer gradient of norm ``norm`` whose dot product with the
        momentum (of norm ``m_norm``) is ``dot``: its corrected form is ``a D + b m``."""
        eps = 1e-12
        if norm <= 0 or m_norm <= 0:
            return 1.0, 0.0
        c = dot / (norm * m_norm)
        conf = norm / (norm + self.kappa * m_norm + eps)
        if c >= self.c_ok:
            return 1.0, 0.0
        if c < 0:
            beta = min(self.k_s * -c * conf, self.beta_max)
            return 1.0, -beta * c * norm / m_norm
        lam = min(self.k_d * (1 - c) * conf, 1.0)
        length = max(math.sqrt(max((1 - lam) ** 2 + lam**2 + 2 * lam * (1 - lam) * c, 0.0)), eps)
        return (1 - lam) / length, norm * lam / (m_norm * length)

    def piece(self, name: str, values: Sequence[np.ndarray], w: np.ndarray,
              prepared: dict[str, tuple[np.ndarray, float]],
              reference: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
        if name not in prepared or reference is None:
            return mean_piece(values, w)
        factors, towards = prepared[name]
        merged = weighted_sum(values, factors) + towards * reference.astype(np.float64)
        return merged.astype(np.float32)


MERGE_RULES: dict[str, Callable[[OuterConfig], MergeRule]] = {
    "mean": lambda cfg: Mean(),
    "rda": lambda cfg: Rda(),
    "heloco": lambda cfg: HeLoCo(
        cfg.heloco_c_ok, cfg.heloco_k_s, cfg.heloco_beta_max, cfg.heloco_k_d, cfg.heloco_kappa
    ),
}


def merge_rule(cfg: OuterConfig) -> MergeRule:
    """The merge rule ``outer.merge`` names, with its parameters."""
    return MERGE_RULES[cfg.merge](cfg)
