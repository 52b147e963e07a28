"""Optimizer states as named leaves, to the storage layer and back (``flows.bucket_io``):
the names a state's leaves are stored under (the outer optimizer's by parameter and slot,
the inner one's by its tree path), an optax state read a leaf or a piece at a time, a
stored state back into optax's structure, and a learner's checkpoint read from its
region (each process of a learner over several hosts reading only its own part)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import Any

import jax
import numpy as np
import optax

from diloco.config import OuterConfig
from diloco.inner import to_host
from diloco.outer import outer_optimizer
from diloco.tensors import Tensors
from flows.version_stream import ReaderTensors
from storage_layout.commit import CorruptVersion, read_marker
from storage_layout.store import RunStore
from storage_layout.stream import VersionReader

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


_POSITIONAL = re.compile(r"^\d{4,}$")  # how leaves were named before they had names


def leaf_names(tree: Any) -> list[str]:
    """Each leaf's path in ``tree``, in leaf order, as a storable name: the keys joined by
    ``/`` (``1/0/mu/blocks.0.up.kernel``: element 1 of the chain, its element 0, field
    ``mu``, dict key ``blocks.0.up.kernel``), any other character than ``[A-Za-z0-9._-]``
    in a key replaced by ``_``."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    names = [
        "/".join(
            _UNSAFE.sub("_", str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))))
            for k in path
        )
        for path, _ in flat
    ]
    if len(set(names)) != len(names):
        raise ValueError(f"two leaves of an optimizer state share a stored name: {names}")
    return names


class _OneHeld:
    """``read(key)``, keeping only the value last read: asked for again, it is not read
    again; asked for another, the one held goes before the next is read (a tensor read
    a piece at a time comes to the host once, and never two at a time)."""

    def __init__(self, read: Callable[[Any], np.ndarray]):
        self.read = read
        self.held: tuple[Any, np.ndarray] | None = None

    def __call__(self, key: Any) -> np.ndarray:
        if self.held is None or self.held[0] != key:
            self.held = None
            self.held = (key, self.read(key))
        return self.held[1]

    def clear(self) -> None:
        self.held = None


class OptimizerLeaves(Mapping[str, np.ndarray]):
    """An optimizer state's leaves as float32 host arrays named by their path in the tree
    (``leaf_names``), so a checkpoint reads without our code; also ``Tensors``, which
    ``RunStore.checkpoints.put_checkpoint`` streams. A leaf comes to the host (``inner.to_host``) only
    when it is read and one at a time, never the whole state: its sharded device arrays
    stay where they are. Each read transfers again; ``piece`` keeps the last leaf."""

    def __init__(self, state: optax.OptState):
        self._leaves = dict(zip(leaf_names(state), jax.tree_util.tree_leaves(state), strict=True))
        self._flat = _OneHeld(lambda name: self[name].reshape(-1))

    def __getitem__(self, name: str) -> np.ndarray:
        return np.asarray(to_host(self._leaves[name], held=True), dtype=np.float32)

    def __contains__(self, name: object) -> bool:  # (Mapping's own reads the value)
        return name in self._leaves

    def __iter__(self):
        return iter(self._leaves)

    def __len__(self) -> int:
        return len(self._leaves)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(np.shape(v)) for n, v in self._leaves.items()}

    def piece(self, name: str, start: int, stop: int) -> np.ndarray:
        return self._flat(name)[start:stop]


def optimizer_leaves(state: optax.OptState) -> OptimizerLeaves:
    """``OptimizerLeaves`` of ``state``: what a checkpoint stores."""
    return OptimizerLeaves(state)


def _positional(names: Sequence[str]) -> bool:
    return bool(names) and all(_POSITIONAL.match(n) for n in names)


@lru_cache(maxsize=64)
def _outer_names(cfg: OuterConfig, shapes: tuple[tuple[str, tuple[int, ...]], ...]) -> list[str]:
    """The stored names of the state's arrays, those of a parameter (its name a key of
    their path): a step count is not stored (the version's ``outer_steps`` holds it)."""
    structs = {n: jax.ShapeDtypeStruct(s, np.float32) for n, s in shapes}
    state = jax.eval_shape(outer_optimizer(cfg).init, structs)
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    return [name for name, path in zip(leaf_names(state), paths, strict=True)
            if any(getattr(k, "key", None) in structs for k in path)]  # fmt: skip


def outer_leaf_names(cfg: OuterConfig, params: Mapping[str, Any]) -> list[str]:
    """The names of a fragment's outer optimizer leaves (``0/trace/blocks.0.up.kernel``),
    in the order ``FragmentSyncer.opt_leaves`` lists them."""
    return list(
        _outer_names(cfg, tuple(sorted((n, tuple(np.shape(v))) for n, v in params.items())))
    )


def outer_names(cfg: OuterConfig, shapes: Mapping[str, Sequence[int]]) -> list[str]:
    """``outer_leaf_names`` from the parameters' shapes alone."""
    return list(_outer_names(cfg, tuple(sorted((n, tuple(int(x) for x in s))
                                               for n, s in shapes.items()))))  # fmt: skip


def named_outer_leaves(
    cfg: OuterConfig, params: Mapping[str, Any], leaves: Sequence[np.ndarray]
) -> dict[str, np.ndarray]:
    """``FragmentSyncer.opt_leaves`` (a list) -> the same leaves by name, as stored."""
    names = outer_leaf_names(cfg, params)
    if len(names) != len(leaves):
        raise ValueError(f"{len(leaves)} outer optimizer leaves, this optimizer has {len(names)}")
    return dict(zip(names, leaves, strict=True))


def ordered_outer_leaves(
    cfg: OuterConfig, params: Mapping[str, Any], names: Sequence[str], leaves: Sequence
) -> list[np.ndarray]:
    """Inverse of ``named_outer_leaves``: a stored version's leaves in the order
    ``FragmentSyncer`` restores them. Versions written before leaves had names (``0000``,
    ``0001``...) are in that order already."""
    if not names or _positional(names):
        return list(leaves)
    stored = dict(zip(names, leaves, strict=True))
    wanted = outer_leaf_names(cfg, params)
    missing = [n for n in wanted if n not in stored]
    if missing or len(stored) != len(wanted):
        raise CorruptVersion(
            f"outer optimizer state has leaves {sorted(stored)[:3]}..., this optimizer "
            f"{len(wanted)} (missing {missing[:3]})"
        )
    return [stored[n] for n in wanted]


def optimizer_state(
    leaves: Mapping[str, np.ndarray], template: optax.OptState, place: Callable[[dict], dict]
) -> optax.OptState:
    """Inverse of ``optimizer_leaves`` into the structure of ``template`` (a freshly
    initialized state: the optimizer's code defines the layout)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    names = leaf_names(template)
    if _positional(list(leaves)) and len(leaves) == len(names):  # written before names
        leaves = {n: leaves[k] for n, k in zip(names, sorted(leaves), strict=True)}
    missing = [n for n in names if n not in leaves]
    if missing or len(leaves) != len(names):
        raise CorruptVersion(
            f"optimizer state has {len(leaves)} leaves, this model's optimizer "
            f"{len(names)} (missing {missing[:3]})"
        )
    placed = []
    for n, (_, t) in zip(names, flat, strict=True):
        # a leaf at a time: ``place`` shards it over this learner's mesh, whatever mesh
        # wrote it (a checkpoint stores the logical arrays, whole or in boxes)
        leaf = _as_leaf(leaves[n], tuple(t.shape), t.dtype)
        placed.append(place({n: leaf})[n])
        if isinstance(leaf, _LeafBoxes):
            leaf.release()
    return jax.tree_util.tree_unflatten(treedef, placed)


def _as_leaf(value: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    if isinstance(value, _LeafBoxes):
        return value.checked(shape, dtype)
    return np.asarray(value, dtype=dtype).reshape(shape)


class _LeafBoxes:
    """One optimizer-state leaf of a checkpoint: the boxes of it that its parts hold (one
    per host of the learner that wrote it; a checkpoint written whole is one box, the
    leaf), read only where they are asked for (``inner.Boxes``): placed on this learner's
    mesh, each device's slice reads the rows of the boxes it overlaps, so no host gathers
    a leaf its devices do not hold."""

    def __init__(self, name: str, key: str):
        self.name, self.key = name, key
        # (box or None: the whole leaf, the tensors holding it, its name there)
        self.boxes: list[tuple[tuple[tuple[int, int], ...] | None, Tensors, str]] = []
        self.shape: tuple[int, ...] = ()
        self.dtype: Any = np.float32
        # the rows of a box last read are kept (a process's devices that replicate a
        # slice ask for the same rows in turn); read again when asked for other rows
        self._rows = _OneHeld(lambda at: at[0].piece(at[1], at[2], at[3]))

    def checked(self, shape: tuple[int, ...], dtype: Any) -> _LeafBoxes:
        """These boxes as a leaf of ``shape``: each inside it, of its stored size, and
        together covering it exactly once (``CorruptVersion`` naming the leaf if not)."""
        whole = tuple((0, n) for n in shape)
        self.boxes = [(whole if box is None else box, t, n) for box, t, n in self.boxes]
        total = 0
        for box, tensors, tname in self.boxes:
            extent = tuple(b - a for a, b in box)
            if len(box) != len(shape) or any(not 0 <= a < b <= n for (a, b), n in
                                              zip(box, shape, strict=False)):  # fmt: skip
                raise CorruptVersion(f"{self.key}: a box {box} of {self.name} is outside {shape}")
            if int(np.prod(tensors.shapes[tname])) != int(np.prod(extent)):
                raise CorruptVersion(f"{self.key}: box {box} of {self.name} holds "
                                     f"{tensors.shapes[tname]} values")  # fmt: skip
            total += int(np.prod(extent))
        overlap = any(_overlap(a[0], b[0]) for i, a in enumerate(self.boxes)
                      for b in self.boxes[i + 1:])  # fmt: skip
        if overlap or total != int(np.prod(shape)):
            raise CorruptVersion(f"{self.key}: the parts' boxes of {self.name} do not tile "
                                 f"its shape {shape} ({len(self.boxes)} boxes)")  # fmt: skip
        self.shape, self.dtype = shape, dtype
        return self

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        want = [sl.indices(n)[:2] for sl, n in zip(index, self.shape, strict=True)]
        out = None
        for box, tensors, tname in self.boxes:
            cut = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(want, box, strict=True)]
            if any(a >= b for a, b in cut):
                continue
            values, src = self._read(box, tensors, tname, cut)
            if cut == want:  # one box holds the slice (a leaf whole, or the writer's mesh)
                return np.asarray(values[src]).astype(self.dtype, copy=False)
            if out is None:
                out = np.empty([b - a for a, b in want], dtype=self.dtype)
            out[tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(cut, want, strict=True))] = (
                values[src]
            )
        return np.empty([b - a for a, b in want], self.dtype) if out is None else out

    def _read(
        self, box: tuple[tuple[int, int], ...], tensors: Tensors, tname: str, cut: list
    ) -> tuple[np.ndarray, tuple[slice, ...]]:
        """The rows of ``box`` that ``cut`` spans (all of them for a scalar), shaped as the
        box's, and where ``cut`` lies in them: a slice split along the leaf's rows reads
        its own rows, one split along another axis the rows it crosses."""
        extent = [b - a for a, b in box]
        if not extent:
            return self._rows((tensors, tname, 0, 1)).reshape(()), ()
        first, last = cut[0][0] - box[0][0], cut[0][1] - box[0][0]
        row = math.prod(extent[1:])
        values = self._rows((tensors, tname, first * row, last * row))
        rest = [slice(a - c, b - c) for (a, b), (c, _) in zip(cut[1:], box[1:], strict=True)]
        src = (slice(0, last - first), *rest)
        return values.reshape([last - first, *extent[1:]]), src

    def release(self) -> None:
        """Drop the rows kept: the leaf is placed."""
        self._rows.clear()


def _overlap(a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]) -> bool:
    return all(max(x0, y0) < min(x1, y1) for (x0, x1), (y0, y1) in zip(a, b, strict=True))


def _stored_parts(reader: VersionReader, parts: Any, key: str) -> dict[str, _LeafBoxes]:
    """A parted checkpoint's leaves (``RunStore.checkpoints.commit_checkpoint_parts``: its meta maps
    each part's group to ``{tensor: {"leaf", "index"}}``), as boxes to read."""
    leaves: dict[str, _LeafBoxes] = {}
    if not isinstance(parts, Mapping):
        raise CorruptVersion(f"{key}: its parts are not a mapping of groups")
    try:
        for gname, boxes in parts.items():
            tensors = ReaderTensors(reader, str(gname))
            for tname, box in boxes.items():
                if tname not in tensors.shapes:
                    raise CorruptVersion(f"{key}: part {gname} lacks tensor {tname!r}")
                name = str(box["leaf"])
                index = tuple((int(a), int(b)) for a, b in box["index"])
                leaves.setdefault(name, _LeafBoxes(name, key)).boxes.append((index, tensors, tname))
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise CorruptVersion(f"{key}: its parts' boxes are malformed: {exc!r}") from exc
    return leaves


class HostPart:
    """This host's part of a learner's optimizer state, for a checkpoint written in parts
    (a learner over several processes whose state is sharded over them): of each leaf,
    the shards this process holds that no other writes (``replica_id`` 0), as
    ``Tensors`` named ``{leaf}#{k}`` (a shard comes to the host when it is read, one at a
    time), and each one's box in its leaf. ``write_id`` is the checkpoint's write, the
    same in every process; ``index`` and ``count`` this process's place among them."""

    def __init__(self, state: optax.OptState, write_id: str, index: int, count: int):
        self.write_id, self.index, self.count = write_id, index, count
        self._shards: dict[str, jax.Array] = {}
        self.slices: dict[str, dict[str, Any]] = {}
        for name, leaf in zip(leaf_names(state), jax.tree_util.tree_leaves(state), strict=True):
            own = [s for s in leaf.addressable_shards if s.replica_id == 0]
            for k, shard in enumerate(own):
                tname = f"{name}#{k}"
                self._shards[tname] = shard.data
                box = [sl.indices(n)[:2] for sl, n in zip(shard.index, leaf.shape, strict=True)]
                self.slices[tname] = {"leaf": name, "index": [list(b) for b in box]}
        self._flat = _OneHeld(
            lambda name: np.asarray(to_host(self._shards[name], held=True), np.float32).ravel()
        )

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(v.shape) for n, v in self._shards.items()}

    def piece(self, name: str, start: int, stop: int) -> np.ndarray:
        return self._flat(name)[start:stop]


def _whole_leaves(tensors: Tensors, key: str) -> dict[str, _LeafBoxes]:
    """A checkpoint written whole (its ``opt`` group: a tensor a leaf), each leaf as one
    box, read where it is placed as a parted checkpoint's are."""
    leaves = {name: _LeafBoxes(name, key) for name in tensors.shapes}
    for name, leaf in leaves.items():
        leaf.boxes.append((None, tensors, name))
    return leaves


def read_checkpoint(
    store: RunStore,
    learner: str,
    step: int,
    template: optax.OptState,
    place: Callable[[dict], dict],
) -> tuple[optax.OptState, dict[str, Any]]:
    """Checkpoint ``learner@step`` into the structure of ``template``, with its meta: the
    stored leaves are the logical arrays, so any mesh reads them; each is read, checked
    and placed (``place``: onto this learner's shardings) before the next, each device's
    slice read on its own (``_LeafBoxes``), so the host holds a slice of one leaf at a
    time, never the whole state, nor a whole leaf its devices split."""
    key = store.layout.checkpoint_marker(learner, step)
    marker = read_marker(store.home, key)
    reader = VersionReader(store.home, marker, key, cache=1)
    if "parts" in marker.meta:  # written in parts, one per host (``HostPart``)
        leaves: Mapping[str, Any] = _stored_parts(reader, marker.meta["parts"], key)
    else:
        leaves = _whole_leaves(ReaderTensors(reader, "opt"), key)
    return optimizer_state(leaves, template, place), dict(marker.meta)
