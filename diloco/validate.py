"""Admission of a contribution before it is merged.

``check_contribution`` either returns the dequantized outer gradient or raises
``ContributionRejected`` with a reason that names the learner, fragment and what is
wrong. A rejected contribution is reported and never merged.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from diloco.outer import Contribution
from diloco.tensors import (
    Payload,
    TensorMeta,
    loop_beside,
    overlapped,
    payload_view,
    piece_size,
    pieces,
)
from protocol.quantize import STORAGE_DTYPE, dequantize, payload_bytes


class ContributionRejected(ValueError):
    def __init__(self, contribution: Contribution, reason: str):
        self.contribution = contribution
        self.reason = reason
        c = contribution
        super().__init__(
            f'fragment {c.fragment} seq {c.seq} of learner "{c.learner}": {reason}; '
            "contribution rejected"
        )


@dataclass(frozen=True)
class Scan:
    """What one pass over a payload's values found: its global L2 norm, or the first
    problem (a value that is NaN or infinite, a piece of the wrong dtype)."""

    norm: float = 0.0
    problem: str | None = None


class _Found(Exception):
    """A problem ``scan_payload``'s check found: the scan stops there."""


def scan_payload(payload: Payload, block: int) -> Scan:
    """One pass over ``payload``, a piece at a time: dtypes, finiteness and the norm
    (sums of squares in float64, in piece order, so every transport gets the same
    number). Each piece is read and decoded on this thread while the one before is
    checked beside it (``tensors.overlapped``). A storage-backed payload verifies each
    chunk it reads; its errors (``OSError``, a damaged chunk) propagate to the caller."""
    index = payload.index()
    if piece_size(block) % block:
        return Scan(problem=f"block size {block} does not divide the piece size")
    total, found = [0.0], []
    shapes = {n: m.shape for n, m in index.items()}

    def read() -> Iterator[tuple[str, np.ndarray | str]]:
        for name, start, stop in pieces(shapes, block):
            q = payload.read(name, start, stop)
            if q.data.dtype != STORAGE_DTYPE[q.kind] or q.kind != index[name].kind:
                yield name, (f"tensor {name} has payload dtype {q.data.dtype} for kind "
                             f"{index[name].kind!r}")  # fmt: skip
                return
            values = dequantize(q)
            if values.size != stop - start:
                yield name, (f"tensor {name} holds {values.size} values at {start}, "
                             f"expected {stop - start}")  # fmt: skip
                return
            yield name, values

    def check(item: tuple[str, np.ndarray | str]) -> None:
        name, values = item
        if isinstance(values, str):
            found.append(values)
        elif not np.all(np.isfinite(values)):
            found.append(f"tensor {name} holds NaN or infinite values")
        else:
            total[0] += float(np.sum(np.square(values, dtype=np.float64)))
        if found:
            raise _Found

    try:
        overlapped(read(), check, beside=loop_beside(shapes, block))
    except _Found:
        return Scan(problem=found[0])
    return Scan(math.sqrt(total[0]))


def _tensor_problem(name: str, meta: TensorMeta, shape: tuple[int, ...]) -> str | None:
    """What is wrong with tensor ``name`` of a payload, as its index describes it."""
    if tuple(meta.shape) != shape:
        return f"tensor {name} has shape {tuple(meta.shape)}, expected {shape}"
    if meta.kind not in STORAGE_DTYPE:
        return f"tensor {name} has an unknown payload kind {meta.kind!r}"
    if meta.dtype is not None and meta.dtype != np.dtype(STORAGE_DTYPE[meta.kind]).name:
        return f"tensor {name} has payload dtype {meta.dtype} for kind {meta.kind!r}"
    if meta.nbytes is not None and meta.nbytes != payload_bytes(
        meta.size, meta.kind, meta.block_size or 128
    ):
        return f"tensor {name} payload has {meta.nbytes} bytes, expected a complete one"
    return None


def check_contribution(
    c: Contribution,
    shapes: Mapping[str, tuple[int, ...]],
    known_learners: Collection[str],
    current_version: int,
    max_staleness: int,
    max_norm: float,
    typical: float | None = None,
    max_ratio: float = 0.0,
    expected_block: int = 128,
) -> Scan:
    """Validate ``c`` against its fragment; return its ``Scan`` (its norm). The values
    are read a piece at a time (``c.scan``, when the transport has scanned them while
    reading, is used instead), so no contribution is ever held whole.
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
    payload = payload_view(c.payload)
    index = payload.index()
    missing = sorted(set(shapes) - set(index))
    extra = sorted(set(index) - set(shapes))
    if missing or extra:
        raise reject(f"tensors do not match the fragment (missing {missing}, unexpected {extra})")
    for name, meta in index.items():
        problem = _tensor_problem(name, meta, tuple(shapes[name]))
        if problem:
            raise reject(problem)
    blocks = {m.block_size for m in index.values() if m.kind in ("int8", "int4")}
    if blocks - {expected_block}:
        raise reject(f"quantization block size {sorted(blocks)}, expected {expected_block}")
    scan = c.scan or scan_payload(payload, expected_block)
    if scan.problem:
        raise reject(scan.problem)
    norm = scan.norm
    if norm > max_norm:
        raise reject(f"outer-gradient norm {norm:.4g} exceeds the bound {max_norm:.4g}")
    per_step = norm / c.steps
    if typical and max_ratio and per_step > max_ratio * typical:
        raise reject(
            f"outer-gradient norm per step {per_step:.4g} is {per_step / typical:.0f}x the "
            f"median {typical:.4g} of the fragment's recent contributions (bound {max_ratio:g}x)"
        )
    return scan
