"""Admission of a contribution before it is merged.

``check_contribution`` either returns the dequantized outer gradient or raises
``ContributionRejected`` with a reason that names the learner, fragment and what is
wrong. A rejected contribution is reported and never merged.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np

from diloco.outer import Contribution, FlatParams, global_norm
from diloco.quantize import STORAGE_DTYPE, dequantize, payload_bytes


class ContributionRejected(ValueError):
    def __init__(self, contribution: Contribution, reason: str):
        self.contribution = contribution
        self.reason = reason
        c = contribution
        super().__init__(
            f'fragment {c.fragment} seq {c.seq} of learner "{c.learner}": {reason}; '
            "contribution rejected"
        )


def check_contribution(
    c: Contribution,
    shapes: Mapping[str, tuple[int, ...]],
    known_learners: Collection[str],
    current_version: int,
    max_staleness: int,
    max_norm: float,
    typical: float | None = None,
    max_ratio: float = 0.0,
) -> FlatParams:
    """Validate ``c`` against its fragment; return its outer gradient (float32).
    ``typical``: the median norm per inner step of the fragment's recent contributions;
    one above ``max_ratio`` times it is rejected (``max_ratio`` 0: no such check)."""

    def reject(reason: str) -> ContributionRejected:
        return ContributionRejected(c, reason)

    if c.learner not in known_learners:
        raise reject("learner is not part of this run")
    if c.base_version > current_version:
        raise reject(f"base version {c.base_version} is newer than the current {current_version}")
    staleness = current_version - c.base_version
    if staleness > max_staleness:
        raise reject(f"staleness {staleness} exceeds the maximum {max_staleness}")
    if c.steps <= 0 or c.tokens <= 0:
        raise reject(f"counts must be positive (tokens {c.tokens}, steps {c.steps})")
    missing = sorted(set(shapes) - set(c.payload))
    extra = sorted(set(c.payload) - set(shapes))
    if missing or extra:
        raise reject(f"tensors do not match the fragment (missing {missing}, unexpected {extra})")
    for name, q in c.payload.items():
        if tuple(q.shape) != tuple(shapes[name]):
            raise reject(
                f"tensor {name} has shape {tuple(q.shape)}, expected {tuple(shapes[name])}"
            )
        expected_dtype = STORAGE_DTYPE.get(q.kind)
        if expected_dtype is None or q.data.dtype != expected_dtype:
            raise reject(f"tensor {name} has payload dtype {q.data.dtype} for kind {q.kind!r}")
        if q.nbytes != payload_bytes(q.size, q.kind, q.block_size or 128):
            raise reject(f"tensor {name} payload has {q.nbytes} bytes, expected a complete one")
    delta = {n: dequantize(q) for n, q in c.payload.items()}
    for name, value in delta.items():
        if not np.all(np.isfinite(value)):
            raise reject(f"tensor {name} holds NaN or infinite values")
    norm = global_norm(delta)
    if norm > max_norm:
        raise reject(f"outer-gradient norm {norm:.4g} exceeds the bound {max_norm:.4g}")
    per_step = norm / c.steps
    if typical and max_ratio and per_step > max_ratio * typical:
        raise reject(
            f"outer-gradient norm per step {per_step:.4g} is {per_step / typical:.0f}x the "
            f"median {typical:.4g} of the fragment's recent contributions (bound {max_ratio:g}x)"
        )
    return delta
