"""A version's values kept in a local file instead of memory.

A learner holds the newest global version of every fragment until it applies it: 2 or 4
bytes a parameter of the model, too much for a host at billions of parameters. Each
version goes a piece of a tensor at a time into a file of a folder of its process
(``SpillFolder``), in the narrowest type that holds it exactly (a bf16 wire's values as
bfloat16, half the bytes of float32, and nothing decoded on the way in), and is read back
as float32, a tensor (or a piece) at a time, as the learner places it on its devices
(``SpilledParams``). Named arrays and local files only: no training type.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import math
import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import partial
from typing import Any

import ml_dtypes
import numpy as np

Items = Iterable[tuple[str, np.ndarray]]

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)


class SpilledParams(Mapping[str, np.ndarray]):
    """Named float32 tensors kept in one local file and read back a tensor (or a piece)
    at a time, so a process can hold a whole fragment without it in memory: a learner's
    newest global versions wait here until it applies them, tensor by tensor, onto its
    devices. Also ``diloco.tensors.Tensors`` (``shapes``, ``piece``). A tensor given as
    bfloat16 (a bf16 wire's values, ``Pieces.exact_pieces``) is kept so, in half the
    bytes, and read back decoded to float32 (exactly: a bf16 value is a float32 one with
    its low 16 bits zero); any other as float32. Written once (``write``); the file is
    deleted by ``close`` or when the object is garbage collected. A value is mapped from
    the file on every access (the page cache keeps a hot one cheap)."""

    def __init__(self, path: str, index: Mapping[str, tuple[int, tuple[int, ...], np.dtype]]):
        self.path = path
        self._index = dict(index)  # name -> (byte offset, shape, dtype kept)
        self._cleanup = weakref.finalize(self, _remove, path)

    @classmethod
    def write(cls, path: str, items: Items) -> SpilledParams:
        """Each ``(name, values)`` appended in the order given, one at a time (what is
        held is the one being written, or, for values read in pieces, such as
        ``store.TensorPieces``, with ``shape`` and ``exact_pieces()`` or ``pieces()``,
        the piece being written), as bfloat16 if it comes so, else as float32. On any
        failure the partial file is removed; a full disk is named, with what to do about
        it."""
        index, offset = {}, 0
        try:
            with open(path, "wb") as f:
                for name, values in items:
                    shape = tuple(np.shape(values))
                    pieces = _pieces(values)
                    kept, size = None, 0
                    for piece in pieces:
                        if kept is None:  # (a dtype's truth is its count of fields)
                            kept = BF16 if piece.dtype == BF16 else F32
                        elif piece.dtype != kept and kept == BF16:
                            raise ValueError(f"{name}: a {piece.dtype} piece after bfloat16 ones")
                        a = np.ascontiguousarray(piece, dtype=kept).reshape(-1)
                        f.write(memoryview(a.view(np.uint8)))
                        size += a.size
                        del a
                    if size != math.prod(shape):
                        raise ValueError(f"{name}: {size} values in its pieces, not {shape}")
                    kept = F32 if kept is None else kept
                    index[name] = (offset, shape, kept)
                    offset += size * kept.itemsize
        except BaseException as exc:
            _remove(path)
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                folder = os.path.dirname(path) or "."
                raise OSError(errno.ENOSPC, (
                    f"no space left in {folder} for a version held in a local file "
                    f"({offset:,} bytes of it written): a learner keeps each version it "
                    "holds there until it applies it, 2 bytes a parameter of a bf16 wire, "
                    "4 of a float32 one; free space there or set TMPDIR to a folder with room"
                )) from exc  # fmt: skip
            raise
        return cls(path, index)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: shape for n, (_, shape, _) in self._index.items()}

    @property
    def nbytes_kept(self) -> int:
        """The bytes of the file: what holding this version costs the local disk."""
        return sum(k.itemsize * math.prod(shape) for _, shape, k in self._index.values())

    def piece(self, name: str, start: int, stop: int) -> np.ndarray:
        """Float32 values ``[start, stop)`` of ``name``: mapped from the file (read-only;
        a copy of them, onto a device or into a sum, reads the file once, and the pages
        go with the array) where they are kept as float32, decoded into a new array
        where they are kept as bfloat16."""
        mapped = self._mapped(name, start, stop)
        return mapped if mapped.dtype == F32 else mapped.astype(np.float32)

    def exact(self, name: str) -> np.ndarray:
        """Tensor ``name`` as it is kept (bfloat16 or float32), mapped from the file: for
        a reader that widens it where it goes (a learner, on its devices:
        ``diloco.learner.Learner.apply_global``)."""
        _, shape, _ = self._index[name]
        return self._mapped(name, 0, math.prod(shape)).reshape(shape)

    def _mapped(self, name: str, start: int, stop: int) -> np.ndarray:
        offset, _, kept = self._index[name]
        if stop <= start:
            return np.empty(0, kept)
        try:
            return np.memmap(self.path, kept, "r", offset + kept.itemsize * start,
                             (stop - start,))  # fmt: skip
        except ValueError as exc:  # the file is shorter than the index says
            raise OSError(f"{self.path} ends before {name}[{start}:{stop}] (truncated?)") from exc

    def __getitem__(self, name: str) -> np.ndarray:
        _, shape, _ = self._index[name]
        return self.piece(name, 0, math.prod(shape)).reshape(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def close(self) -> None:
        self._cleanup()


def _pieces(values: Any) -> Iterable[np.ndarray]:
    """``values``' pieces, as exact as they come: ``exact_pieces()``, ``pieces()`` or the
    array itself."""
    if hasattr(values, "exact_pieces"):
        return values.exact_pieces()
    return values.pieces() if hasattr(values, "pieces") else [np.asarray(values)]


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


class SpillFolder:
    """Where a process keeps the versions it holds: called with a fragment and a version,
    the collector that writes that version's tensors into a new file of ``folder``
    (named apart from every earlier one, so a version read again never overwrites the
    file of one still held)."""

    def __init__(self, folder: str):
        self.folder = folder
        self._count = itertools.count()

    def __call__(self, fragment: int, version: int) -> Callable[[Items], SpilledParams]:
        name = f"f{fragment}-v{version}-{next(self._count)}.values"
        return partial(SpilledParams.write, os.path.join(self.folder, name))
