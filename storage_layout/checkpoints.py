"""Learners' checkpoints (``store.checkpoints``): written a chunk at a time, whole or in
parts (one per host), committed once.

A part of a ``storage_layout.store.RunStore``, over its buckets and ``layout.py``."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from protocol.quantize import quantize
from storage_layout.chunks import ObjectSink
from storage_layout.codec import CHUNK, GroupWriter, root_objects, write_group
from storage_layout.commit import (
    CommitMarker,
    CorruptVersion,
    commit_marker,
    entry,
    new_write_id,
    patiently,
    put_patiently,
    read_marker,
)
from storage_layout.part import Part, fp32
from storage_layout.reading import read_decoded

log = logging.getLogger(__name__)


def _write_streamed(put: Callable[[str, bytes], None], gname: str, group: Any) -> None:
    """``write_group`` of float32 ``Tensors``, a chunk of values at a time (same objects)."""
    writer = GroupWriter(put, gname, "fp32", group.shapes)
    for name, shape in sorted(group.shapes.items()):
        size = int(np.prod(shape))
        for start in range(0, size, CHUNK):
            stop = min(size, start + CHUNK)
            writer.append(name, quantize(group.piece(name, start, stop), "fp32"))
    writer.close()


MAX_PART_BYTES = 16 << 20  # a part's manifest: its objects' records and its boxes


def checkpoint_part_group(part: int) -> str:
    """The group of a checkpoint that holds host ``part``'s shards (``opt.p0003``)."""
    if not 0 <= part < 10_000:
        raise ValueError(f"checkpoint part {part} is outside 0..9999")
    return f"opt.p{part:04d}"


def checkpoint_part_key(part: int) -> str:
    """Host ``part``'s manifest, relative to its checkpoint's data prefix."""
    return f"parts/{checkpoint_part_group(part)}.json"


def _checked_part(
    manifest: CommitMarker, key: str, prefix: str, write_id: str, part: int
) -> CommitMarker:
    """A part's manifest, taken only if it is this part of this write: its kind, write id,
    data prefix and part number, every object inside its own group, and boxes that are
    ``{tensor: {"leaf": str, "index": [[start, stop], ...]}}`` (the reader checks that
    they tile each leaf). ``CorruptVersion`` naming what is wrong otherwise."""
    gname = checkpoint_part_group(part)
    wrong = []
    if manifest.kind != "checkpoint-part":
        wrong.append(f"kind {manifest.kind!r}")
    if manifest.write_id != write_id or manifest.data_prefix != prefix:
        wrong.append(f"write {manifest.write_id!r} at {manifest.data_prefix!r}")
    if manifest.meta.get("part") != part:
        wrong.append(f"part {manifest.meta.get('part')!r}")
    outside = [rel for rel in manifest.objects if not rel.startswith(f"{gname}/")]
    if outside:
        wrong.append(f"objects outside {gname}/: {outside[:3]}")
    slices = manifest.meta.get("slices")
    try:
        for box in slices.values():
            if not isinstance(box["leaf"], str) or not all(
                len(pair) == 2 and all(type(x) is int and x >= 0 for x in pair)
                for pair in box["index"]
            ):
                raise TypeError(box)
    except (AttributeError, KeyError, TypeError) as exc:
        wrong.append(f"boxes that are not {{tensor: {{leaf, index}}}} ({exc!r:.80})")
    if wrong:
        raise CorruptVersion(f"{key} is not part {part} of write {write_id}: {'; '.join(wrong)}")
    return manifest


class Checkpoints(Part):
    def checkpoint_steps(self, learner: str, region: str | None = None) -> list[int]:
        return self.store.numbers(
            self.bucket(region or self.store.client_region),
            self.layout.checkpoint_commits(learner),
            "s",
        )

    def put_checkpoint(
        self,
        learner: str,
        step: int,
        tensors: Mapping[str, Mapping[str, np.ndarray]],
        meta: Mapping[str, Any],
    ) -> CommitMarker:
        """Commit a learner checkpoint: named groups of float32 arrays plus JSON ``meta``,
        written a chunk at a time in one pass (``_put_streamed``): the objects ``encode``
        makes of them, never all held at once beside the arrays. A group that is
        ``Tensors`` (``shapes`` and ``piece``, like a learner's sharded optimizer state) is
        read a piece at a time, so not even its arrays are held whole. The write id is
        random, not the content's (a contribution's): naming the content takes a first
        pass over the whole state, 2.7 times the seconds of one at 1 B (``bench/hosts``),
        and a writer asked again finds the step committed (``checkpoint_steps``) or, if
        its lost answer races it, a ``CommitConflict`` that removes only its own copy."""

        def write(put: Callable[[str, bytes], None]) -> None:
            for rel, blob in root_objects({"kind": "checkpoint"}).items():
                put(rel, blob)
            for gname, group in tensors.items():
                if hasattr(group, "piece"):
                    _write_streamed(put, gname, group)
                else:
                    write_group(put, gname, fp32(group))

        write_id = new_write_id()
        return self.put_streamed(
            self.layout.checkpoint_marker(learner, step),
            self.layout.checkpoint_data(learner, step, write_id), write, "checkpoint",
            lambda: {"learner": learner, "step": step, **meta}, write_id,
        )  # fmt: skip

    # A checkpoint in parts: each host of a learner writes its own part (``put_checkpoint_
    # part``), the leader commits them as one checkpoint (``commit_checkpoint_parts``).
    def put_checkpoint_part(
        self,
        learner: str,
        step: int,
        write_id: str,
        part: int,
        tensors: Any,
        slices: Mapping[str, Mapping[str, Any]],
    ) -> None:
        """Write host ``part``'s share of checkpoint ``learner@step``: its float32
        ``tensors`` (``Tensors``: its shards of the optimizer state, a chunk at a time) as
        group ``opt.p{part}`` under the data prefix of write ``write_id``, then its
        manifest (``checkpoint_part_key``): an uncommitted marker listing the part's
        objects, with ``slices`` (each tensor's ``{"leaf", "index"}``: which leaf and which
        box of it) as meta. Nothing is committed: a part the leader never commits is an
        orphan, swept like any other."""
        prefix = self.layout.checkpoint_data(learner, step, write_id)
        gname = checkpoint_part_group(part)
        sink = ObjectSink(self.home, prefix)
        try:
            _write_streamed(sink.put, gname, tensors)
            entries = sink.finish()
        except BaseException:
            with contextlib.suppress(Exception):
                sink.finish()
            raise
        manifest = CommitMarker("checkpoint-part", prefix, entries, self.store.writer, write_id,
                                {"part": part, "slices": {k: dict(v) for k, v in slices.items()}})  # fmt: skip
        key = f"{prefix}/{checkpoint_part_key(part)}"
        patiently(lambda: self.home.put(key, manifest.to_json()), key)

    def commit_checkpoint_parts(
        self,
        learner: str,
        step: int,
        write_id: str,
        parts: int,
        meta: Mapping[str, Any],
        timeout: float = 600.0,
        poll: float = 0.1,
    ) -> CommitMarker:
        """Commit checkpoint ``learner@step`` made of ``parts`` hosts' parts of write
        ``write_id``, once every part's manifest is there (``TimeoutError`` after
        ``timeout`` seconds: a host that died takes its learner down with it). Each
        manifest is checked before it is taken: its write, part number and data prefix,
        its objects inside its own group. The marker lists every part's objects and
        manifest, so verifying and auditing read it like any checkpoint, and its meta
        maps each part's tensors to their leaf and box (``parts``)."""
        prefix = self.layout.checkpoint_data(learner, step, write_id)
        deadline = time.monotonic() + timeout
        entries: dict[str, dict[str, Any]] = {}
        boxes: dict[str, dict[str, Any]] = {}
        for part in range(parts):
            rel = checkpoint_part_key(part)
            key = f"{prefix}/{rel}"
            while True:
                try:
                    raw = patiently(lambda: self.home.get(key, MAX_PART_BYTES), key)  # noqa: B023
                    break
                except FileNotFoundError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"checkpoint {learner}@{step}: part {part} of {parts} was not "
                            f"written within {timeout:.0f} s ({key} is missing)"
                        ) from None
                    time.sleep(poll)
            got = _checked_part(CommitMarker.from_json(raw, key), key, prefix, write_id, part)
            entries.update(got.objects)
            entries[rel] = entry(raw)
            boxes[checkpoint_part_group(part)] = got.meta["slices"]
        root = root_objects({"kind": "checkpoint"})
        put_patiently(self.home, {f"{prefix}/{rel}": blob for rel, blob in root.items()}, prefix)
        entries.update({rel: entry(blob) for rel, blob in root.items()})
        body = {"learner": learner, "step": step, **meta, "parts": boxes}
        return commit_marker(self.home, self.layout.checkpoint_marker(learner, step), prefix,
                             entries, "checkpoint", body, self.store.writer, write_id)  # fmt: skip

    def get_checkpoint(
        self, learner: str, step: int
    ) -> tuple[dict[str, dict[str, np.ndarray]], dict]:
        key = self.layout.checkpoint_marker(learner, step)
        marker = read_marker(self.home, key)
        return read_decoded(self.home, marker, key), marker.meta
