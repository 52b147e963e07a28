"""A version's values kept in a local file instead of memory.

A learner holds the newest global version of every fragment until it applies it: 4 bytes
a parameter of the model, too much for a host at billions of parameters. Each version is
decoded a tensor at a time into a file of a folder of its process (``SpillFolder``), and
read back mapped, a tensor (or a piece) at a time, as the learner places it on its
devices (``SpilledParams``). Named float32 arrays and local files only: no training type.
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

import numpy as np

Items = Iterable[tuple[str, np.ndarray]]


class SpilledParams(Mapping[str, np.ndarray]):
    """Named float32 tensors kept in one local file and read back a tensor (or a piece)
    at a time, so a process can hold a whole fragment without it in memory: a learner's
    newest global versions wait here until it applies them, tensor by tensor, onto its
    devices. Also ``diloco.tensors.Tensors`` (``shapes``, ``piece``). Written once
    (``write``); the file is deleted by ``close`` or when the object is garbage
    collected. A value is mapped from the file on every access (the page cache keeps a
    hot one cheap)."""

    def __init__(self, path: str, index: Mapping[str, tuple[int, tuple[int, ...]]]):
        self.path = path
        self._index = dict(index)  # name -> (offset in values, shape)
        self._cleanup = weakref.finalize(self, _remove, path)

    @classmethod
    def write(cls, path: str, items: Items) -> SpilledParams:
        """Each ``(name, values)`` appended as float32 in the order given, one at a time
        (what is held is the one being written, or, for values read in pieces, such as
        ``store.TensorPieces``, with ``shape`` and ``pieces()``, the piece being written).
        On any failure the partial file is removed; a full disk is named, with what to do
        about it."""
        index, offset = {}, 0
        try:
            with open(path, "wb") as f:
                for name, values in items:
                    shape = tuple(np.shape(values))
                    pieces = values.pieces() if hasattr(values, "pieces") else [values]
                    size = 0
                    for piece in pieces:
                        a = np.ascontiguousarray(piece, dtype=np.float32).reshape(-1)
                        f.write(memoryview(a).cast("B"))
                        size += a.size
                        del a
                    if size != math.prod(shape):
                        raise ValueError(f"{name}: {size} values in its pieces, not {shape}")
                    index[name] = (offset, shape)
                    offset += size
        except BaseException as exc:
            _remove(path)
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                folder = os.path.dirname(path) or "."
                raise OSError(errno.ENOSPC, (
                    f"no space left in {folder} for a version held in a local file "
                    f"({4 * offset:,} bytes of it written): a learner keeps each version it "
                    "holds there until it applies it, 4 bytes a parameter; free space there "
                    "or set TMPDIR to a folder with room"
                )) from exc  # fmt: skip
            raise
        return cls(path, index)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: shape for n, (_, shape) in self._index.items()}

    def piece(self, name: str, start: int, stop: int) -> np.ndarray:
        """Values ``[start, stop)`` of ``name``, mapped from the file (read-only): a copy
        of them (onto a device, into a sum) reads the file once, and the pages go with
        the array."""
        offset, _ = self._index[name]
        if stop <= start:
            return np.empty(0, np.float32)
        try:
            return np.memmap(self.path, np.float32, "r", 4 * (offset + start), (stop - start,))
        except ValueError as exc:  # the file is shorter than the index says
            raise OSError(f"{self.path} ends before {name}[{start}:{stop}] (truncated?)") from exc

    def __getitem__(self, name: str) -> np.ndarray:
        _, shape = self._index[name]
        return self.piece(name, 0, math.prod(shape)).reshape(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def close(self) -> None:
        self._cleanup()


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
        name = f"f{fragment}-v{version}-{next(self._count)}.f32"
        return partial(SpilledParams.write, os.path.join(self.folder, name))
