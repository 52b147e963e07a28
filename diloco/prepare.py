"""``diloco data prepare``: text tokenized into a data set (``diloco.dataset`` reads it),
with a tokenizer given or a byte-level BPE trained on the corpus's start. Documents are
read, tokenized in batches and written shard by shard, a chunk's sha256 at a time; the
manifest is written last, so a folder without one is no data set."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np

from diloco.data import DataError, file_format, is_held_out, list_files, read_documents
from diloco.dataset import (
    CHUNK_TOKENS,
    FORMAT,
    MANIFEST,
    SHARD_CHUNKS,
    TOKENIZER_BYTES,
    VERSION,
    join_url,
    read_capped,
)
from diloco.tokenizer import Tokenizer, load_tokenizer, train_bpe

DEFAULT_VOCAB = 4096


TRAIN_TEXT_BYTES = 512 << 20  # text a BPE is trained on, at most (the corpus's start)


PIECE_CHARS = 1 << 18  # a longer document is tokenized in pieces of about this size


BATCH_CHARS = 4 << 20  # text tokenized at once, at most (the tokenizer's output: ~50x)


@dataclass
class _ShardWriter:
    """Writes one split's tokens to shard files, hashing each chunk as it goes."""

    fs: fsspec.AbstractFileSystem
    root: str
    split: str
    dtype: np.dtype
    chunk_tokens: int
    shard_chunks: int
    shards: list[dict[str, Any]] = field(default_factory=list)
    _file: Any = None
    _hash: Any = None
    _in_chunk: int = 0

    def _open(self) -> None:
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._file = self.fs.open(join_url(self.root, name), "wb")
        self.shards.append(
            {"name": name, "split": self.split, "documents": 0, "tokens": 0,
             "chunk_tokens": self.chunk_tokens, "chunk_sha256": []}
        )  # fmt: skip
        self._hash, self._in_chunk = hashlib.sha256(), 0

    def _end_chunk(self) -> None:
        if self._in_chunk:
            self.shards[-1]["chunk_sha256"].append(self._hash.hexdigest())
        self._hash, self._in_chunk = hashlib.sha256(), 0

    def write(self, ids: np.ndarray) -> None:
        """One document's tokens (EOS included); a document may span chunks and shards."""
        if self._file is None:
            self._open()
        self.shards[-1]["documents"] += 1
        ids = ids.astype(self.dtype)
        while len(ids):
            shard = self.shards[-1]
            if shard["tokens"] == self.chunk_tokens * self.shard_chunks:
                self._end_chunk()
                self._file.close()
                self._open()
                shard = self.shards[-1]
            room = self.chunk_tokens - self._in_chunk
            room = min(room, self.chunk_tokens * self.shard_chunks - shard["tokens"])
            part, ids = ids[:room], ids[room:]
            data = part.tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._in_chunk += len(part)
            shard["tokens"] += len(part)
            if self._in_chunk == self.chunk_tokens:
                self._end_chunk()

    def close(self) -> None:
        if self._file is not None:
            self._end_chunk()
            self._file.close()
            self._file = None


def prepare(
    source: str,
    out: str,
    tokenizer: str | None = None,
    vocab_size: int = DEFAULT_VOCAB,
    val_percent: int = 5,
    text_field: str = "text",
    workers: int | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
    shard_chunks: int = SHARD_CHUNKS,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, Any]:
    """Tokenize ``source`` into a data set at ``out``; return its manifest.

    Documents stream from the source (one source file in memory at a time) through the
    tokenizer in batches to the shard files; the manifest is written last. A document is
    held out for validation by a hash of its identity (its path, and its record number
    in a JSON lines or Parquet file), the same on every machine. ``progress(stage, done,
    total)`` is called with source bytes done.
    """
    if workers:
        os.environ.setdefault("RAYON_RS_NUM_CPUS", str(workers))
    src_fs, files = list_files(source)
    total = sum(src_fs.size(p) or 0 for p, _ in files)
    fs, root = fsspec.core.url_to_fs(out)
    _check_out(fs, root, out)

    if tokenizer:
        tfs, tpath = fsspec.core.url_to_fs(tokenizer)
        if not tfs.exists(tpath):
            raise DataError(f"--tokenizer {tokenizer} does not exist")
        tok_bytes = read_capped(tfs, tpath, TOKENIZER_BYTES, f"--tokenizer {tokenizer}")
        tok = load_tokenizer(tok_bytes, tokenizer, workers or 1)
    else:
        stage = "training tokenizer"
        texts = _identified(src_fs, files, text_field, progress, total, stage, TRAIN_TEXT_BYTES)
        tok = train_bpe((text for _, text in texts), vocab_size)
        tok_bytes = tok.data
    source_info = {"url": source, "files": len(files), "bytes": total,
                   "val_percent": val_percent, "text_field": text_field}  # fmt: skip
    texts = _identified(src_fs, files, text_field, progress, total, "tokenizing")
    documents = _tokenized(texts, tok, val_percent, source)
    return write_dataset(out, tok, tok_bytes, documents, chunk_tokens, shard_chunks, source_info)


def _pieces(text: str, size: int) -> Iterator[str]:
    """``text`` in pieces of at most ``size`` characters, each cut just before a space that
    follows a non-space where there is one: where a byte-level BPE's pre-tokenizer cuts
    too, so the pieces' tokens are the whole text's (docs/data.md)."""
    start = 0
    while len(text) - start > size:
        cut = text.rfind(" ", start + 1, start + size + 1)
        while cut > start and text[cut - 1].isspace():
            cut = text.rfind(" ", start + 1, cut)
        cut = cut if cut > start else start + size  # no such space: cut anywhere
        yield text[start:cut]
        start = cut
    yield text[start:]


def _tokenized(
    texts: Iterator[tuple[str, str]], tok: Tokenizer, val_percent: int, source: str
) -> Iterator[tuple[str, np.ndarray]]:
    """(split, tokens with EOS) of each document, tokenized in batches (in parallel) of
    about ``BATCH_CHARS`` of text; a long document in pieces (``_pieces``), so that the tokenizer's
    output, many times its text's size, stays bounded however long a document is."""
    batch: list[tuple[str, str, bool]] = []  # (identity, piece, whether the document's last)
    parts: list[np.ndarray] = []  # the tokens of the document the batch ends in, so far
    size = text_tokens = held_out = 0

    def flush(last: bool) -> Iterator[tuple[str, np.ndarray]]:
        nonlocal text_tokens, held_out
        ids = tok.encode_batch([t for _, t, _ in batch])
        for n, ((ident, _, ends), seq) in enumerate(zip(batch, ids, strict=True)):
            text_tokens += len(seq)
            parts.append(np.asarray(seq, dtype=np.uint32))
            if not ends:
                continue
            split = "validation" if is_held_out(ident, val_percent) else "train"
            if last and n == len(batch) - 1 and not held_out:
                split = "validation"  # a small corpus where the hash held nothing out
            held_out += split == "validation"
            yield split, np.concatenate([*parts, [tok.eos_id]])
            parts.clear()
        batch.clear()

    for ident, text in texts:
        pieces = list(_pieces(text, PIECE_CHARS))
        for i, piece in enumerate(pieces):
            if size >= BATCH_CHARS or len(batch) >= 4096:  # never the last: flush(True)'s
                yield from flush(False)
                size = 0
            batch.append((ident, piece, i == len(pieces) - 1))
            size += len(piece)
    yield from flush(True)
    if text_tokens == 0:
        raise DataError(f"data source {source} holds no text to tokenize (its documents are empty)")


def write_dataset(
    out: str,
    tok: Tokenizer,
    tok_bytes: bytes,
    documents: Iterable[tuple[str, np.ndarray]],
    chunk_tokens: int = CHUNK_TOKENS,
    shard_chunks: int = SHARD_CHUNKS,
    source: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``documents`` ((split, tokens) each, EOS included) as a data set at ``out``:
    shards as they come, then the tokenizer, then the manifest."""
    fs, root = fsspec.core.url_to_fs(out)
    fs.makedirs(root, exist_ok=True)
    dtype = np.dtype("<u2") if tok.vocab_size <= 1 << 16 else np.dtype("<u4")
    writers = {
        split: _ShardWriter(fs, root, split, dtype, chunk_tokens, shard_chunks)
        for split in ("train", "validation")
    }
    docs = {"train": 0, "validation": 0}
    try:
        for split, ids in documents:
            writers[split].write(ids)
            docs[split] += 1
        for w in writers.values():
            w.close()
        if not writers["train"].shards:
            raise DataError(
                f"every document of {(source or {}).get('url', out)} was held out for "
                "validation; give a smaller --val-percent or more documents"
            )
    except BaseException:  # a refused source (or an interrupt) leaves no shard behind
        for w in writers.values():
            with contextlib.suppress(Exception):
                w.close()
        written = [join_url(root, s["name"]) for w in writers.values() for s in w.shards]
        with contextlib.suppress(Exception):
            fs.rm([p for p in written if fs.exists(p)])
        raise
    fs.pipe_file(join_url(root, tok.file), tok_bytes)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": {
            "kind": tok.kind, "file": tok.file, "sha256": hashlib.sha256(tok_bytes).hexdigest(),
            "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
        },
        "dtype": dtype.name,
        "chunk_tokens": chunk_tokens,
        "shards": writers["train"].shards + writers["validation"].shards,
        "totals": {
            split: {"documents": docs[split], "tokens": sum(s["tokens"] for s in w.shards)}
            for split, w in writers.items()
        },
        "source": source or {},
    }  # fmt: skip
    fs.pipe_file(join_url(root, MANIFEST), json.dumps(manifest, indent=1).encode())
    return manifest


def _identified(
    fs: fsspec.AbstractFileSystem,
    files: list[tuple[str, str]],
    text_field: str,
    progress: Callable[[str, int, int], None] | None,
    total: int,
    stage: str,
    limit: int | None = None,
) -> Iterator[tuple[str, str]]:
    """(identity, text) of every document, one source file in memory at a time; its
    identity is its path, and its record number in a JSON lines or Parquet file."""
    done = 0
    for path, rel in files:
        docs = read_documents(fs, path, text_field)
        records = file_format(path).records
        for i, doc in enumerate(docs):
            try:
                text = doc.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{path} is not UTF-8 text: {exc}") from None
            yield (f"{rel}#{i}" if records else rel), text
        done += fs.size(path) or 0
        if progress:
            progress(stage, min(done, total), total)
        if limit is not None and done >= limit:
            return


def _check_out(fs: fsspec.AbstractFileSystem, root: str, out: str) -> None:
    """Refuse an output that holds a data set, or files that are not a data set's."""
    if fs.exists(join_url(root, MANIFEST)):
        raise DataError(
            f"{out} already holds a data set (it has a {MANIFEST}); give another --out or remove it"
        )
    if fs.exists(root) and fs.isdir(root):
        others = [
            p for p in fs.ls(root, detail=False)
            if not p.rstrip("/").rsplit("/", 1)[-1].startswith(("train-", "validation-", "tokenizer."))
        ]  # fmt: skip
        if others:
            raise DataError(
                f"{out} holds files that are not a data set's ({others[0]}, ...); give an "
                "empty or new folder as --out"
            )
