"""Reading a committed version's groups: whole, decoded tensor by tensor, or a piece at a time,
every object checked against its marker as it is read."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from protocol.quantize import Pieces, QuantizedTensor, dequantize, exact_values, piece_step
from storage_layout.bucket import Bucket
from storage_layout.codec import FormatError
from storage_layout.commit import CommitMarker, CorruptVersion
from storage_layout.stream import PARALLEL, VersionReader

log = logging.getLogger(__name__)


def read_groups(
    bucket: Bucket, marker: CommitMarker, key: str, groups: Sequence[str] | None = None
) -> dict[str, dict[str, QuantizedTensor]]:
    """The named groups (default: all) of the version ``marker`` commits, tensor by
    tensor: each chunk object fetched and checked as it is read (``stream.VersionReader``),
    so what is held is the tensors themselves, never the objects besides them.
    ``CorruptVersion`` names what does not read."""
    try:
        reader = VersionReader(bucket, marker, key)
        return {g: reader.tensors(g) for g in (reader.groups() if groups is None else groups)}
    except (FormatError, KeyError, ValueError) as exc:
        if isinstance(exc, CorruptVersion):
            raise
        raise CorruptVersion(f"{key}: {exc}") from exc


def read_decoded(
    bucket: Bucket, marker: CommitMarker, key: str, groups: Sequence[str] | None = None
) -> dict[str, dict[str, np.ndarray]]:
    """``read_groups``, each tensor decoded to float32 as it arrives (while the next ones
    are fetched), its stored form dropped at once: what is held is the float32 values."""
    with named_damage(key):
        reader = VersionReader(bucket, marker, key)
        names = reader.groups() if groups is None else groups
        out = {}
        for g in names:
            got = dict(decoded_each(bucket, marker, key, g, reader))
            out[g] = {n: got[n] for n in reader.index(g)}  # in the group's own order
        return out


def decoded_each(
    bucket: Bucket, marker: CommitMarker, key: str, group: str, reader: VersionReader | None = None
) -> Iterator[tuple[str, np.ndarray]]:
    """Group ``group``'s tensors, each decoded to float32 as it arrives, in the order they
    lie in the group (``VersionReader.each``): the caller holds one at a time."""
    with named_damage(key):
        for name, q in (reader or VersionReader(bucket, marker, key)).each(group):
            yield name, dequantize(q, owned=True)  # (read here: ours to give away)


class TensorPieces(Pieces):
    """Tensor ``name`` of group ``group`` of a version, read and decoded to float32 a
    piece of at most ``PIECE_VALUES`` at a time (``protocol.quantize.Pieces``; or kept as
    bfloat16 where it is stored so: ``exact_pieces``). A damaged object is
    ``CorruptVersion`` naming the version's key."""

    def __init__(self, reader: VersionReader, key: str, group: str, name: str,
                 shape: tuple[int, ...], block: int):  # fmt: skip
        self.reader, self.key, self.group, self.name = reader, key, group, name
        self.shape, self.step = shape, piece_step(block)

    def pieces(self) -> Iterator[np.ndarray]:
        return self._pieces(dequantize)

    def exact_pieces(self) -> Iterator[np.ndarray]:
        return self._pieces(exact_values)

    def _pieces(self, decode: Callable[..., np.ndarray]) -> Iterator[np.ndarray]:
        n = math.prod(self.shape)
        with named_damage(self.key):
            for start in range(0, n, self.step):
                q = self.reader.read(self.group, self.name, start, min(n, start + self.step))
                yield decode(q, owned=True).reshape(-1)  # (read here: ours)


def decoded_pieces(
    bucket: Bucket, marker: CommitMarker, key: str, group: str
) -> Iterator[tuple[str, TensorPieces]]:
    """Group ``group``'s tensors in the order they lie in it, each as ``TensorPieces``
    (read when its pieces are asked for, the next chunks read ahead meanwhile)."""
    with named_damage(key):
        reader = VersionReader(bucket, marker, key, ahead=PARALLEL)  # read in order
        index = reader.index(group)
        for name in reader.in_order(group):
            info = index[name]
            yield name, TensorPieces(reader, key, group, name, tuple(info.shape), info.block_size)


@contextlib.contextmanager
def named_damage(key: str) -> Iterator[None]:
    """A malformed stored object read under ``key`` raised as ``CorruptVersion`` naming it."""
    try:
        yield
    except (FormatError, KeyError, ValueError) as exc:
        if isinstance(exc, CorruptVersion):
            raise
        raise CorruptVersion(f"{key}: {exc}") from exc
