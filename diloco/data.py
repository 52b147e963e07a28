"""Byte-level data: a corpus of text files split by file into train and validation,
train files dealt to learners as disjoint shards, and a deterministic, resumable reader.

The default corpus is the Python standard library's ``.py`` files (tens of MB of real
text on every machine, nothing to download). A local file, a local folder or any fsspec
URL (file or folder) can be given instead. Text files are read as they are; JSON lines
(``.jsonl``, ``.jsonl.gz``) and Parquet (``.parquet``, needs ``pyarrow``) files hold one
document per record, its text in a named field or column (``data.text_field``). This is
the only I/O in ``diloco/``.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import sysconfig
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import fsspec
import numpy as np

DOC_SEPARATOR = b"\n\x00\n"  # between files, so no window silently joins two files
SKIPPED_FOLDERS = frozenset({"site-packages", "dist-packages", "__pycache__"})


class DataError(ValueError):
    """The corpus is missing, empty or too small; the message says which."""


def default_corpus() -> str:
    return sysconfig.get_paths()["stdlib"]


def is_held_out(relpath: str, val_percent: int) -> bool:
    # A hash of the path, not of a random draw: the split is the same on every machine
    # that has the same files, whatever order they are listed in.
    digest = hashlib.sha256(relpath.encode()).digest()
    return int.from_bytes(digest[:4], "little") % 100 < val_percent


def list_files(source: str | None) -> tuple[fsspec.AbstractFileSystem, list[tuple[str, str]]]:
    """Return the filesystem and sorted ``(path, relpath)`` pairs of the corpus's text files."""
    root = source or default_corpus()
    fs, path = fsspec.core.url_to_fs(root)
    if not fs.exists(path):
        raise DataError(f"data source {root!r} does not exist")
    if fs.isfile(path):
        return fs, [(path, Path(path).name)]
    found = []
    suffixes = (".py",) if source is None else tuple(FORMATS)
    base = fs._strip_protocol(path).rstrip("/")
    for folder, dirs, files in fs.walk(path, topdown=True):
        # Pruned, not filtered: the stdlib folder holds the installed packages (thousands
        # of folders; walking them took seconds of every learner's start).
        dirs[:] = [d for d in dirs if d not in SKIPPED_FOLDERS]
        for name in files:
            file = f"{folder.rstrip('/')}/{name}"
            if name.endswith(suffixes):
                found.append((file, file[len(base) :].lstrip("/")))
    found.sort()
    if not found:
        raise DataError(f"data source {root!r} holds no text files ({', '.join(FORMATS)})")
    return fs, found


@dataclass(frozen=True)
class Corpus:
    """Token arrays (uint8) for validation and for each learner's disjoint training shard."""

    train_shards: tuple[np.ndarray, ...]
    validation: np.ndarray

    @property
    def train_tokens(self) -> int:
        return sum(len(s) for s in self.train_shards)


def load_corpus(
    source: str | None, num_shards: int, val_percent: int = 5, text_field: str = "text"
) -> Corpus:
    """Read every file once; split by file; deal training files round-robin to shards.

    A single-file source is split by bytes instead (the last ``val_percent`` %). A
    JSON lines or Parquet file counts as one file (``read_file``).
    """
    fs, files = list_files(source)
    if len(files) == 1:
        data = np.frombuffer(read_file(fs, files[0][0], text_field), dtype=np.uint8)
        cut = len(data) * (100 - val_percent) // 100
        train, val = data[:cut], data[cut:]
        shards = tuple(np.array_split(train, num_shards))
        return _checked(Corpus(shards, val), source)
    train_parts: list[list[bytes]] = [[] for _ in range(num_shards)]
    val_parts: list[bytes] = []
    i = 0
    for path, rel in files:
        text = read_file(fs, path, text_field) + DOC_SEPARATOR
        if is_held_out(rel, val_percent):
            val_parts.append(text)
        else:
            train_parts[i % num_shards].append(text)
            i += 1
    if not val_parts:  # a tiny folder where the hash held nothing out: hold out the last file
        val_parts.append(train_parts[(i - 1) % num_shards].pop())
    shards = tuple(np.frombuffer(b"".join(p), dtype=np.uint8) for p in train_parts)
    return _checked(Corpus(shards, np.frombuffer(b"".join(val_parts), dtype=np.uint8)), source)


def read_file(fs: fsspec.AbstractFileSystem, path: str, text_field: str = "text") -> bytes:
    """One listed file as corpus bytes. A text file: its bytes (``_text``). A JSON lines
    or Parquet file: the UTF-8 text of each record's ``text_field``, in file order,
    joined by ``DOC_SEPARATOR`` (as files of a folder are). A record whose field is
    missing, is not a string or holds a NUL character is an error naming the file and
    the line (JSON lines, from 1) or row (Parquet, from 0); so is a file with no records.
    """
    return DOC_SEPARATOR.join(read_documents(fs, path, text_field))


def read_documents(
    fs: fsspec.AbstractFileSystem, path: str, text_field: str = "text"
) -> list[bytes]:
    """One listed file's documents, as ``read_file`` finds them: a text file is one
    document, a JSON lines or Parquet file one per record (the same errors)."""
    form = file_format(path)
    docs = form.read(fs, path, text_field)
    if form.records and not docs:
        raise DataError(f"{path} holds no records")
    return docs


def _record_text(value: object, path: str, where: str, field: str) -> bytes:
    """A record's text as UTF-8; ``where`` is its line or row, ``field`` "field 'text'"."""
    if not isinstance(value, str):
        kind = "null" if value is None else type(value).__name__
        raise DataError(f"{path} {where}: {field} is {kind}, not a string")
    if "\0" in value:
        raise DataError(
            f"{path} {where}: {field} holds a NUL character, which marks document "
            "boundaries in the corpus"
        )
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate, such as "\ud800" in JSON
        raise DataError(f"{path} {where}: {field} is not valid Unicode: {exc}") from None


def _jsonl_texts(fs: fsspec.AbstractFileSystem, path: str, field: str) -> list[bytes]:
    data = fs.cat_file(path)
    if path.lower().endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as exc:
            raise DataError(f"{path} is not a readable gzip file: {exc}") from None
    docs = []
    for number, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():  # blank lines (the last newline's, say) hold no record
            continue
        where = f"line {number}"
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DataError(f"{path} {where} is not valid JSON: {exc}") from None
        if not isinstance(record, dict):
            raise DataError(
                f"{path} {where} is a JSON {type(record).__name__}, not an object with a "
                f"{field!r} field"
            )
        if field not in record:
            raise DataError(
                f"{path} {where}: no field {field!r} (it has "
                f"{', '.join(map(repr, record)) or 'no fields'}); set data.text_field to the "
                "field that holds the text"
            )
        docs.append(_record_text(record[field], path, where, f"field {field!r}"))
    return docs


def _parquet_texts(fs: fsspec.AbstractFileSystem, path: str, column: str) -> list[bytes]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{path} is a Parquet file; reading Parquet needs pyarrow "
            "(pip install pyarrow, or pip install 'decoupled-diloco[parquet]')"
        ) from None
    try:
        with fs.open(path, "rb") as f:
            table = pq.ParquetFile(f)
            names = table.schema_arrow.names
            if column not in names:
                raise DataError(
                    f"{path}: no column {column!r} (it has {', '.join(map(repr, names))}); "
                    "set data.text_field to the column that holds the text"
                )
            values = table.read(columns=[column]).column(column).to_pylist()
    except DataError:
        raise
    except Exception as exc:  # pyarrow's errors: not Parquet, truncated, ...
        raise DataError(f"{path} is not a readable Parquet file: {exc}") from None
    return [_record_text(v, path, f"row {i}", f"column {column!r}") for i, v in enumerate(values)]


def _text(data: bytes, path: str) -> bytes:
    """``data`` unless it looks binary: a NUL byte in its first 8000 bytes (git's rule)."""
    if b"\0" in data[:8000]:
        raise DataError(
            f"{path} looks binary (it has NUL bytes), not text; a language model's corpus "
            "must be text files"
        )
    return data


def _text_file(fs: fsspec.AbstractFileSystem, path: str, field: str) -> list[bytes]:
    return [_text(fs.cat_file(path), path)]


@dataclass(frozen=True)
class Format:
    """How a corpus file's documents are read (``read(fs, path, text_field)``), and
    whether it holds one per record (a data set names those ``path#i``)."""

    read: Callable[[fsspec.AbstractFileSystem, str, str], list[bytes]]
    records: bool


# The files a corpus folder's walk takes, by suffix: a new format is a reader above and
# an entry here.
FORMATS: dict[str, Format] = {
    **dict.fromkeys((".py", ".txt", ".md", ".rst", ".json", ".toml", ".c", ".h"),
                    Format(_text_file, records=False)),
    ".jsonl": Format(_jsonl_texts, records=True),
    ".jsonl.gz": Format(_jsonl_texts, records=True),
    ".parquet": Format(_parquet_texts, records=True),
}  # fmt: skip


def file_format(path: str) -> Format:
    """The format of the file at ``path`` by its longest known suffix (any case); text
    for a file given by name whose suffix is none of them."""
    name = path.lower()
    known = [s for s in FORMATS if name.endswith(s)]
    return FORMATS[max(known, key=len)] if known else FORMATS[".txt"]


def _checked(corpus: Corpus, source: str | None, min_tokens: int = 4096) -> Corpus:
    name = source or "the Python standard library"
    for m, shard in enumerate(corpus.train_shards):
        if len(shard) < min_tokens and len(corpus.train_shards) == 1:
            raise DataError(
                f"the training split of {name} has {len(shard)} bytes; need >= {min_tokens} "
                "(use a larger corpus)"
            )
        if len(shard) < min_tokens:
            raise DataError(
                f"training shard {m} of {name} has {len(shard)} bytes; need >= {min_tokens} "
                f"per learner (use a larger corpus or fewer learners)"
            )
    if len(corpus.validation) < min_tokens // 4:
        raise DataError(f"validation split of {name} has only {len(corpus.validation)} bytes")
    return corpus


def sample_windows(
    tokens: np.ndarray, batch: int, length: int, seed: int, stream: int, index: int
) -> np.ndarray:
    """Batch ``index`` of stream ``stream``: ``batch`` windows of ``length + 1`` tokens.

    Pure function of its arguments, so a reader resumes from its position alone.
    Returns int32 ``[batch, length + 1]`` (inputs are ``[:, :-1]``, targets ``[:, 1:]``).
    """
    rng = np.random.default_rng((seed, stream, index))
    starts = rng.integers(0, len(tokens) - length - 1, size=batch)
    return np.stack([tokens[s : s + length + 1] for s in starts]).astype(np.int32)


@dataclass
class ShardReader:
    """A learner's reader over its own shard; ``position`` (batches served) is its whole state."""

    tokens: np.ndarray
    batch_size: int
    context: int
    seed: int
    stream: int
    position: int = 0

    def next_batch(self) -> np.ndarray:
        out = sample_windows(
            self.tokens, self.batch_size, self.context, self.seed, self.stream, self.position
        )
        self.position += 1
        return out


VALIDATION_STREAM = 1_000_003


def validation_batches(
    corpus: Corpus, batch_size: int, context: int, count: int, seed: int
) -> list[np.ndarray]:
    """The fixed held-out batches every mode evaluates on (same seed -> same batches)."""
    return [
        sample_windows(corpus.validation, batch_size, context, seed, VALIDATION_STREAM, i)
        for i in range(count)
    ]
