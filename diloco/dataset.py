"""Tokenized data sets in a folder or bucket, and the reader learners stream them with.

A prepared data set (``diloco data prepare``; docs/data.md) is a folder, local or any
fsspec URL, holding:

- ``manifest.json``, written last (a folder without it is no data set): the format
  version, the tokenizer (kind, file, sha256, vocab_size, eos_id), the token dtype, the
  chunk size and every shard (split, documents, tokens, one sha256 per chunk);
- token shards ``train-00000.bin``, ``validation-00000.bin``, ...: raw little-endian
  ``uint16`` tokens (``uint32`` above 65,536 tokens), each document followed by EOS;
- the tokenizer file beside them (``tokenizer.json`` or ``tokenizer.model``).

A chunk (``chunk_tokens``, 1 Mi tokens by default) is the unit of everything a learner
does: training chunks are dealt to learners, read one ranged request at a time, checked
against their sha256 and cut into windows. So a learner holds a few chunks, never the
data set, and reads a bucket in a few large requests rather than one per window.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import fsspec
import numpy as np
from pydantic import (
    ValidationError,
)

from diloco.data import Corpus, DataError
from diloco.manifest import Manifest
from diloco.tokenizer import HFTokenizer, SentencePieceTokenizer, load_tokenizer

FORMAT = "diloco-tokens"
VERSION = 1
MANIFEST = "manifest.json"
CHUNK_TOKENS = 1 << 20  # 2 MiB of uint16 tokens: one ranged read, one checksum
SHARD_CHUNKS = 64  # chunks per shard file (128 MiB of uint16 tokens)
SHUFFLE_CHUNKS = 4  # windows are shuffled within groups of this many chunks
TEXT_CHUNK_BYTES = 1 << 16  # a text corpus's chunks, taken in units (``TextChunks``)
VALIDATION_STREAM = 1_000_003
MANIFEST_BYTES = 256 << 20  # a manifest, at most (~70 bytes a chunk: 2 Mi chunks, 2 T tokens)
TOKENIZER_BYTES = 64 << 20  # a tokenizer file, at most (Llama 3's tokenizer.json: 9 MB)


def read_capped(fs: fsspec.AbstractFileSystem, path: str, limit: int, what: str) -> bytes:
    """``path``'s bytes, refused (``DataError``) when it is longer than ``limit``: at most
    ``limit + 1`` bytes are read."""
    data = fs.cat_file(path, start=0, end=limit + 1)
    if len(data) > limit:
        raise DataError(f"{what} is larger than {limit:,} bytes; refusing to read it")
    return data


def join_url(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


def is_prepared(url: str | None) -> bool:
    """Whether ``url`` is a prepared data set: a folder holding a manifest of this format
    (a text corpus may hold some other ``manifest.json``)."""
    if not url:
        return False
    fs, path = fsspec.core.url_to_fs(url)
    if not (fs.isdir(path) and fs.exists(join_url(path, MANIFEST))):
        return False
    try:
        data = read_capped(fs, join_url(path, MANIFEST), MANIFEST_BYTES, MANIFEST)
        return json.loads(data).get("format") == FORMAT
    except (ValueError, AttributeError):  # too large, not JSON, or not an object
        return False


@dataclass(frozen=True)
class Chunk:
    shard: str
    index: int  # within its shard
    start: int  # first token, within the shard
    tokens: int
    sha256: str

    @property
    def name(self) -> str:
        return f"{self.shard} chunk {self.index}"


class Dataset:
    """A prepared data set: its manifest, tokenizer and chunks."""

    def __init__(self, url: str):
        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url)
        path = join_url(self.root, MANIFEST)
        if not self.fs.exists(path):
            raise DataError(f"{url} is not a prepared data set (it has no {MANIFEST})")
        data = read_capped(self.fs, path, MANIFEST_BYTES, f"{url}/{MANIFEST}")
        try:
            self.manifest: dict[str, Any] = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DataError(f"{url}/{MANIFEST} is not valid JSON: {exc}") from None
        if not isinstance(self.manifest, dict) or (
            self.manifest.get("format"), self.manifest.get("version")) != (FORMAT, VERSION):  # fmt: skip
            got = self.manifest if isinstance(self.manifest, dict) else {}
            raise DataError(
                f"{url}/{MANIFEST} is not a {FORMAT} manifest of version {VERSION} "
                f"(format {got.get('format')!r}, version {got.get('version')!r})"
            )
        try:
            Manifest.model_validate(self.manifest)
        except ValidationError as exc:
            wrong = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                              for e in exc.errors()[:3])  # fmt: skip
            raise DataError(f"{url}/{MANIFEST} is malformed: {wrong[:400]}") from None
        self.dtype = np.dtype(self.manifest["dtype"]).newbyteorder("<")
        self.chunk_tokens = int(self.manifest["chunk_tokens"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.manifest["tokenizer"]["eos_id"])

    def tokens(self, split: str = "train") -> int:
        return sum(s["tokens"] for s in self.manifest["shards"] if s["split"] == split)

    def tokenizer_file(self) -> tuple[str, bytes]:
        """The tokenizer's file name and bytes, checked against the manifest's sha256."""
        entry = self.manifest["tokenizer"]
        where = f"tokenizer {self.url}/{entry['file']}"
        data = read_capped(self.fs, join_url(self.root, entry["file"]), TOKENIZER_BYTES, where)
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry["sha256"]:
            raise DataError(
                f"tokenizer {self.url}/{entry['file']} does not match the manifest (sha256 "
                f"{digest[:12]}..., manifest {entry['sha256'][:12]}...): the shards were "
                "tokenized with another tokenizer"
            )
        return entry["file"], data

    def tokenizer(self) -> HFTokenizer | SentencePieceTokenizer:
        name, data = self.tokenizer_file()
        return load_tokenizer(data, f"{self.url}/{name}")

    @cached_property
    def _chunks(self) -> dict[str, list[Chunk]]:
        out: dict[str, list[Chunk]] = {"train": [], "validation": []}
        for shard in self.manifest["shards"]:
            size = int(shard["chunk_tokens"])
            for i, sha in enumerate(shard["chunk_sha256"]):
                n = min(size, int(shard["tokens"]) - i * size)
                out[shard["split"]].append(Chunk(shard["name"], i, i * size, n, sha))
        return out

    def chunks(self, split: str = "train") -> list[Chunk]:
        return self._chunks[split]

    def read_chunk(self, chunk: Chunk) -> np.ndarray:
        """One chunk's tokens, by one ranged read, checked against the manifest."""
        size = self.dtype.itemsize
        path = join_url(self.root, chunk.shard)
        try:
            data = self.fs.cat_file(
                path, start=chunk.start * size, end=(chunk.start + chunk.tokens) * size
            )
        except FileNotFoundError:
            raise DataError(f"shard {self.url}/{chunk.shard} is missing") from None
        if len(data) != chunk.tokens * size:
            raise DataError(
                f"shard {self.url}/{chunk.shard} is truncated: chunk {chunk.index} has "
                f"{len(data)} bytes, the manifest says {chunk.tokens * size}"
            )
        if hashlib.sha256(data).hexdigest() != chunk.sha256:
            raise DataError(
                f"shard {self.url}/{chunk.shard}: chunk {chunk.index} (tokens {chunk.start:,} "
                f"to {chunk.start + chunk.tokens:,}) fails its sha256 checksum; the shard is "
                "corrupt"
            )
        return np.frombuffer(data, dtype=self.dtype)

    def check_shards(self) -> None:
        """Every shard's size against the manifest, from one listing of the folder (a
        request per thousand objects on a bucket, not one per shard)."""
        sizes = {
            str(e["name"]).rstrip("/").rsplit("/", 1)[-1]: e.get("size")
            for e in self.fs.ls(self.root, detail=True)
        }
        for shard in self.manifest["shards"]:
            name = shard["name"]
            if name not in sizes:
                raise DataError(f"shard {self.url}/{name} is missing")
            want = int(shard["tokens"]) * self.dtype.itemsize
            if sizes[name] != want:
                raise DataError(
                    f"shard {self.url}/{name} is truncated: {sizes[name]:,} bytes, the "
                    f"manifest says {want:,} ({shard['tokens']:,} tokens)"
                )

    def check(self, vocab_size: int, learners: int, context: int) -> None:
        """What a run needs of the data set, named when it is missing: a tokenizer that
        matches the manifest, a vocabulary the model has room for, training tokens, at
        least one chunk per learner, shards of the manifest's sizes and held-out tokens."""
        self.tokenizer_file()
        if self.vocab_size > vocab_size:
            raise DataError(
                f"data set {self.url} has a vocabulary of {self.vocab_size} tokens, larger "
                f"than model.vocab_size {vocab_size}; give --set "
                f"model.vocab_size={self.vocab_size}"
            )
        train = self.chunks("train")
        if not train or self.tokens("train") == 0:
            raise DataError(f"data set {self.url} holds no training tokens")
        if len(train) < learners:
            raise DataError(
                f"data set {self.url} has {len(train)} training chunks for {learners} "
                "learners; each learner needs one at least (prepare it again with a smaller "
                "--chunk-tokens, or run fewer learners)"
            )
        if max(c.tokens for c in train) < context + 1:
            raise DataError(
                f"data set {self.url}: no training chunk holds a window of model.context + 1 "
                f"= {context + 1} tokens"
            )
        val = self.chunks("validation")
        if not val or max(c.tokens for c in val) < context + 1:
            raise DataError(
                f"data set {self.url} holds no validation window of {context + 1} tokens "
                "(prepare it with a larger --val-percent or a larger corpus)"
            )
        self.check_shards()


def open_dataset(url: str) -> Dataset:
    return Dataset(url)


class TextChunks:
    """A text corpus, as the byte reader reads it (``diloco.data.load_corpus`` into one
    shard: its training files in their sorted order), cut into training chunks of
    ``chunk_bytes`` bytes as a prepared data set's are, so that a run on text can take
    its data in units (``data.assign = "units"``; ``diloco.units``) and grow. It is held
    in memory, as the byte reader holds it; a chunk is a view of it, not a copy. Every
    machine must hold the same corpus (the reader's rule), its split decided by each
    file's path."""

    def __init__(self, corpus: Corpus, url: str, chunk_bytes: int | None = None):
        if len(corpus.train_shards) != 1:
            raise ValueError("a text corpus is cut into chunks from one shard")
        self.url, self.train = url, corpus.train_shards[0]
        n, chunk_bytes = len(self.train), chunk_bytes or TEXT_CHUNK_BYTES
        self._chunks = [Chunk("text", i, start, min(chunk_bytes, n - start), "")
                       for i, start in enumerate(range(0, n, chunk_bytes))]  # fmt: skip

    def chunks(self, split: str = "train") -> list[Chunk]:
        if split != "train":  # (validation: the byte reader's batches, as with slots)
            raise ValueError(f"a text corpus's chunks are its training split, not {split!r}")
        return self._chunks

    def read_chunk(self, chunk: Chunk) -> np.ndarray:
        return self.train[chunk.start : chunk.start + chunk.tokens]


def assignment(chunks: list[Chunk], index: int, learners: int) -> list[Chunk]:
    """Learner ``index``'s training chunks: every ``learners``-th, from its index on."""
    if len(chunks) < learners:
        raise DataError(f"{len(chunks)} training chunks for {learners} learners")
    return chunks[index::learners]


@dataclass
class Group:
    """Some chunks, read, with their windows in shuffled order."""

    arrays: list[np.ndarray]
    windows: np.ndarray  # [n, 2]: (array, start) in shuffled order

    def window(self, i: int, context: int) -> np.ndarray:
        a, s = self.windows[i]
        return self.arrays[a][s : s + context + 1]


def chunk_windows(chunks: list[Chunk], context: int) -> np.ndarray:
    """How many windows of ``context + 1`` tokens (stride ``context``) each chunk holds."""
    return np.array([max(0, (c.tokens - 1) // context) for c in chunks])


def read_group(
    dataset: Dataset, chunks: list[Chunk], per_chunk: np.ndarray, picked: np.ndarray,
    context: int, shuffle: tuple[int, ...],
) -> Group:  # fmt: skip
    """Chunks ``picked`` (indices into ``chunks``, each holding ``per_chunk`` windows)
    read and cut into windows of ``context + 1`` tokens (stride ``context``, so every
    token but a chunk's first is a target once; none crosses a chunk's end), in an order
    shuffled by the seed ``shuffle``."""
    arrays = [dataset.read_chunk(chunks[i]) for i in picked]
    windows = np.concatenate(
        [
            np.stack([np.full(n, a), np.arange(n) * context], axis=1)
            for a, n in enumerate(per_chunk[picked])
        ]
    )
    rng = np.random.default_rng(shuffle)
    return Group(arrays, windows[rng.permutation(len(windows))])


class WindowReader:
    """What the readers of a prepared data set share: a stream of windows (``window``,
    the subclass's), served ``batch_size`` at a time (batch ``b`` is windows
    ``b * batch_size ...``), ``position`` (batches served) its state; and groups read
    ahead by one background thread (at most two held, a few chunks), whose read errors
    are raised in the learner's thread, by the ``next_batch`` that needs the group."""

    batch_size: int
    context: int

    def __init__(self, read: Callable[..., Group], name: str, position: int):
        self._read = read
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._groups: OrderedDict[tuple[int, int], Future[Group]] = OrderedDict()
        self._lock = threading.Lock()
        self.position = position

    @property
    def position(self) -> int:
        return self._position

    @position.setter
    def position(self, value: int) -> None:  # a resume: the subclass may look again
        self._position = value
        self._moved()

    def _moved(self) -> None:
        pass

    def window(self, w: int) -> np.ndarray:
        raise NotImplementedError

    def group(self, key: tuple[int, int]) -> Group:
        with self._lock:
            if key not in self._groups:
                self._groups[key] = self._pool.submit(self._read, *key)
            future = self._groups[key]
            self._groups.move_to_end(key)
            while len(self._groups) > 2:
                self._groups.popitem(last=False)
        return future.result()  # a read's error is raised here, in the learner's thread

    def prefetch(self, key: tuple[int, int]) -> None:
        with self._lock:
            if key not in self._groups:
                self._groups[key] = self._pool.submit(self._read, *key)

    def next_batch(self) -> np.ndarray:
        first = self._position * self.batch_size
        out = np.stack([self.window(first + i) for i in range(self.batch_size)])
        self._position += 1
        return out.astype(np.int32)

    def close(self, wait: bool = False) -> None:
        """Stop reading ahead (a read under way ends on its own; ``wait``: for it)."""
        self._pool.shutdown(wait=wait, cancel_futures=True)


class TokenReader(WindowReader):
    """A learner's reader over its chunks of a prepared data set (the ``ShardReader``
    interface); ``position`` (batches served) is its whole state.

    The learner's window stream is a pure function of the seed, its assignment and the
    window's index: epoch ``e`` visits the learner's chunks in an order shuffled by
    ``(seed, index, e)``; each group of ``shuffle_chunks`` consecutive chunks of that
    order is cut into windows, shuffled within the group (``read_group``). Batch ``b`` is
    windows ``b * batch_size`` to ``(b + 1) * batch_size`` of the stream. A background
    thread reads the next group while this one is served (``WindowReader``).
    """

    def __init__(
        self,
        dataset: Dataset,
        index: int,
        learners: int,
        batch_size: int,
        context: int,
        seed: int,
        position: int = 0,
        shuffle_chunks: int = SHUFFLE_CHUNKS,
    ):
        self.dataset = dataset
        self.index, self.learners = index, learners
        self.batch_size, self.context, self.seed = batch_size, context, seed
        self.shuffle_chunks = shuffle_chunks
        self.chunks = assignment(dataset.chunks("train"), index, learners)
        self.per_chunk = chunk_windows(self.chunks, context)
        self.epoch_windows = int(self.per_chunk.sum())
        if self.epoch_windows == 0:
            raise DataError(
                f"learner {index}'s chunks of {dataset.url} hold no window of {context + 1} tokens"
            )
        self._epoch_order: tuple[int, Any] = (-1, None)
        super().__init__(self._read_group, f"token-reader-{index}", position)

    def _order(self, epoch: int) -> tuple[np.ndarray, list[int]]:
        """The epoch's chunk order and each group's first window in the epoch (the last
        epoch's kept: computing it is linear in the learner's chunks)."""
        if self._epoch_order[0] != epoch:
            rng = np.random.default_rng((self.seed, self.index, epoch))
            order = rng.permutation(len(self.chunks))
            sums = np.add.reduceat(
                self.per_chunk[order], np.arange(0, len(order), self.shuffle_chunks)
            )
            self._epoch_order = (epoch, (order, [0, *np.cumsum(sums).tolist()]))
        return self._epoch_order[1]

    def _read_group(self, epoch: int, group: int) -> Group:
        order, _ = self._order(epoch)
        picked = order[group * self.shuffle_chunks : (group + 1) * self.shuffle_chunks]
        return read_group(self.dataset, self.chunks, self.per_chunk, picked, self.context,
                          (self.seed, self.index, epoch, group))  # fmt: skip

    def window(self, w: int) -> np.ndarray:
        """Window ``w`` of this learner's stream: ``context + 1`` tokens."""
        epoch, offset = divmod(w, self.epoch_windows)
        _, starts = self._order(epoch)
        g = bisect.bisect_right(starts, offset) - 1
        group = self.group((epoch, g))
        after = (epoch, g + 1) if g + 2 < len(starts) else (epoch + 1, 0)
        self.prefetch(after)
        return group.window(offset - starts[g], self.context)


def validation_batches(
    dataset: Dataset, batch_size: int, context: int, count: int, seed: int
) -> list[np.ndarray]:
    """The fixed held-out batches every learner evaluates on: windows of the validation
    chunks in order (stride ``context``), read a chunk at a time until ``count`` batches
    are filled, then shuffled by ``seed``; a small split is cycled."""
    need = count * batch_size
    windows: list[np.ndarray] = []
    for chunk in dataset.chunks("validation"):
        tokens = dataset.read_chunk(chunk)
        for s in range(0, len(tokens) - context, context):
            windows.append(tokens[s : s + context + 1].copy())
            if len(windows) == need:
                break
        if len(windows) == need:
            break
    if not windows:
        raise DataError(f"data set {dataset.url} holds no validation window of {context + 1}")
    picked = np.random.default_rng((seed, VALIDATION_STREAM)).permutation(len(windows))
    cycled = [windows[picked[i % len(windows)]] for i in range(need)]
    return [
        np.stack(cycled[i * batch_size : (i + 1) * batch_size]).astype(np.int32)
        for i in range(count)
    ]


# --- prepare -------------------------------------------------------------------------
