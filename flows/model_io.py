"""Using a run's model: read the global model from the buckets, export it to a
safetensors file and load it back, read text to evaluate it on.

The global model is assembled the way the launcher evaluates it: every fragment's
version read through ``RunStore.versions.get_global`` and the tensors put together under the
run's ``ParamCodec`` names (``flows.run.Run``: its model). In
the syncers' home region that is the fp32 master copy; any other region holds only the
``wire`` copy learners download (``topology.global_dtype``, bf16 by default), which is
read instead and said so.

An export is a safetensors file of float32 tensors named as in ``FlatParams``
(``blocks.0.attn.qkv.kernel``), with string metadata: ``format`` (``diloco-model``),
``format_version``, ``model_config`` (the run's ``ModelConfig`` as JSON), ``versions``
(JSON, fragment -> version), ``run``, ``source`` (the bucket), ``params_dtype``
(``fp32`` for the master copy, else the wire dtype the values were rounded to) and what
its token ids mean: ``tokens`` is ``bytes`` (a run on text) or ``tokenizer``, with the
run's data set's tokenizer file in ``tokenizer_file`` (its name), ``tokenizer`` (its
bytes, base64) and ``tokenizer_sha256``. (An export written before ``tokens`` existed is
read as bytes.)
``load_exported`` returns ``(ModelConfig, params)``; the model is then
``ParamCodec.create(config, 0)`` and ``codec.model(codec.from_flat(params))``.

A Llama (``model.arch = "llama"``) is exported as a folder in the Hugging Face Llama
layout instead, which ``transformers.LlamaForCausalLM.from_pretrained(folder)`` loads:
``model.safetensors`` (Hugging Face's tensor names, Linear weights ``[out, in]``; its
metadata is ``format: pt``, which transformers requires, and ours under the same keys
with ``diloco_format`` for ``format``), ``config.json`` and, when the run trained on a
prepared data set, that data set's tokenizer file (``tokenizer.json``). Such a folder
reads back as the export file does (``open_exported``), tokenizer included.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import safetensors
import safetensors.numpy
from pydantic import ValidationError

from diloco.archs import ARCHS
from diloco.config import ConfigError, ModelConfig, RunConfig
from diloco.data import DOC_SEPARATOR, DataError, list_files, read_file
from diloco.model import FlatParams, ParamCodec
from diloco.run_data import RunData
from diloco.sample import Scorer, TextScore, Tokenizer
from flows.run import Run, build_model
from flows.spec import config_from_spec
from storage_layout.commit import CorruptVersion
from storage_layout.store import RegionDown, RunStore
from storage_layout.versions import GlobalState

log = logging.getLogger(__name__)

EXPORT_FORMAT = "diloco-model"
EXPORT_FORMAT_VERSION = "1"


class ModelFileError(ValueError):
    """An exported model file is missing, corrupt, not an export or of another shape."""


@dataclass(frozen=True)
class UsableModel:
    """A model ready to evaluate or sample: its shape, its codec and its parameters."""

    config: ModelConfig
    codec: ParamCodec
    params: FlatParams
    versions: dict[int, int]  # fragment -> global version
    source: str  # where it was read: "run NAME in URL" or the file
    dtype: str  # "fp32" (master copy) or the wire dtype the values were rounded to
    run: str = ""
    run_config: RunConfig | None = None  # the run's whole config (from a bucket only)
    tokenizer: Tokenizer | None = None  # the data set's; None: bytes (the byte model)

    @property
    def label(self) -> str:
        versions = " ".join(f"f{p}:v{v}" for p, v in sorted(self.versions.items()))
        return f"{self.source} ({versions}, {self.dtype})"


# --- from the buckets ----------------------------------------------------------------------


def open_run(url: str, run: str) -> Run:
    """The run as the bucket at ``url`` holds it, read-only. The bucket may be any of the
    run's regions (found by its URL in the spec) or a copy of one."""
    probe = RunStore(run, {"reader": url}, "reader", writer="reader")
    try:
        spec = probe.read_spec()  # names a missing run (FileNotFoundError)
    except RegionDown as exc:  # a missing bucket: said without the made-up region name
        raise RegionDown(str(exc).removeprefix("region reader: ")) from None
    regions = spec.get("regions", {})
    region = next((r for r, u in regions.items() if u.rstrip("/") == url.rstrip("/")), "reader")
    return Run(run, {region: url}, region, spec, config_from_spec(spec))


def parse_versions(text: str | None, fragments: int) -> list[int | None]:
    """``--version``: none (the newest of each fragment), ``V`` (version V of every
    fragment) or ``V0,V1,...`` (one per fragment, in fragment order)."""
    if text is None or not text.strip():
        return [None] * fragments
    parts = [t.strip() for t in text.split(",")]
    try:
        values = [int(t) for t in parts]
    except ValueError:
        raise ConfigError(
            f"--version {text!r}: give a version number, or one per fragment separated by "
            "commas (e.g. 12,11)"
        ) from None
    if any(v < 0 for v in values):
        raise ConfigError(f"--version {text!r}: versions are numbers >= 0")
    if len(values) == 1:
        return [values[0]] * fragments
    if len(values) != fragments:
        raise ConfigError(
            f"--version {text!r} names {len(values)} versions; the run has {fragments} "
            "fragments (give one version for all, or one per fragment)"
        )
    return list(values)


def _held(versions: Sequence[int]) -> str:
    if len(versions) == versions[-1] - versions[0] + 1:
        return f"versions {versions[0]} to {versions[-1]}"
    shown = ", ".join(map(str, versions[-5:]))
    return f"{len(versions)} versions, the newest {shown}"


def read_fragment(
    store: RunStore, fragment: int, version: int | None = None
) -> tuple[GlobalState, bool]:
    """Version ``version`` of ``fragment`` (default: the newest that reads; an unreadable
    newer one is reported and skipped, as the launcher does), and whether it is the fp32
    master copy (the syncers' home region) rather than the wire copy."""
    run, where = store.run, store.home.url
    held = store.versions.global_versions(fragment)
    if not held:
        raise FileNotFoundError(
            f"run {run!r} has no global version of fragment {fragment} yet in {where} "
            "(version 0 is published when the run is started)"
        )
    if version is not None and version not in held:
        raise FileNotFoundError(
            f"run {run!r} has no version {version} of fragment {fragment} in {where}; "
            f"it holds {_held(held)}"
        )
    for v in [version] if version is not None else reversed(held):
        try:
            master = "params/zarr.json" in store.versions.global_marker(fragment, v).objects
            return store.versions.get_global(fragment, v, learner_view=not master), master
        except (CorruptVersion, OSError) as exc:
            if version is not None:
                raise CorruptVersion(
                    f"run {run!r} fragment {fragment} version {v} in {where} is unreadable: {exc}"
                ) from exc
            log.warning("fragment %d version %d is unreadable, reading an older one: %s",
                        fragment, v, exc)  # fmt: skip
    raise CorruptVersion(f"no version of fragment {fragment} of run {run!r} reads in {where}")


def read_global_model(url: str, run: str, versions: str | None = None) -> UsableModel:
    """The global model of ``run`` in the bucket at ``url``: the newest version of every
    fragment, or those ``versions`` names (``parse_versions``)."""
    opened = open_run(url, run)
    store, cfg, codec = opened.store("reader"), opened.cfg, opened.model.codec
    wanted = parse_versions(versions, len(opened.spec["fragments"]))
    params: FlatParams = {}
    held: dict[int, int] = {}
    masters = []
    for p, version in enumerate(wanted):
        state, master = read_fragment(store, p, version)
        params.update(state.params)
        held[p] = state.version
        masters.append(master)
    problems = shape_problems(codec, params)
    if problems:
        raise CorruptVersion(
            f"the global fragments of run {run!r} in {url} do not make up its model: "
            + "; ".join(problems)
        )
    dtype = "fp32" if all(masters) else cfg.topology.global_dtype
    return UsableModel(cfg.model, codec, params, held, f"run {run} in {url}", dtype, run, cfg,
                       run_tokenizer(cfg))  # fmt: skip


def _prepared_dataset(cfg: RunConfig | None) -> Any:
    """The run's tokenized data set (``diloco data prepare``), or None: no source, or a
    source of text (the byte reader's)."""
    source = cfg.data.source if cfg is not None else None
    if source is None:
        return None
    from diloco.dataset import is_prepared, open_dataset

    return open_dataset(source) if is_prepared(source) else None


def run_tokenizer(cfg: RunConfig | None) -> Tokenizer | None:
    """The tokenizer of the run's data set (None: the run trains on bytes)."""
    dataset = _prepared_dataset(cfg)
    return None if dataset is None else dataset.tokenizer()


def run_tokenizer_file(cfg: RunConfig | None) -> tuple[str, bytes] | None:
    """The run's data set's tokenizer file, ``(name, contents)`` (e.g. ``tokenizer.json``)."""
    dataset = _prepared_dataset(cfg)
    return None if dataset is None else dataset.tokenizer_file()


def shape_problems(codec: ParamCodec, params: FlatParams, limit: int = 5) -> list[str]:
    """How ``params`` differ from the tensors ``codec``'s model has (empty: they match)."""
    expected = dict(zip(codec.names, codec.shapes, strict=True))
    out = [f"missing tensor {n}" for n in expected if n not in params]
    out += [f"unexpected tensor {n}" for n in params if n not in expected]
    out += [
        f"{n} has shape {tuple(params[n].shape)}, the model needs {shape}"
        for n, shape in expected.items()
        if n in params and tuple(params[n].shape) != shape
    ]
    return out[:limit] + ([f"and {len(out) - limit} more"] if len(out) > limit else [])


# --- the exported file ---------------------------------------------------------------------


def _export_metadata(
    model: UsableModel, tokenizer_file: tuple[str, bytes] | None = None
) -> dict[str, str]:
    meta = {
        "format": EXPORT_FORMAT,
        "format_version": EXPORT_FORMAT_VERSION,
        "model_config": model.config.model_dump_json(),
        "versions": json.dumps({str(p): v for p, v in sorted(model.versions.items())}),
        "run": model.run,
        "source": model.source,
        "params_dtype": model.dtype,
        "tokens": "bytes" if tokenizer_file is None else "tokenizer",
    }
    if tokenizer_file is not None:
        name, data = tokenizer_file
        meta.update(tokenizer_file=name, tokenizer=base64.b64encode(data).decode("ascii"),
                     tokenizer_sha256=hashlib.sha256(data).hexdigest())  # fmt: skip
    return meta


def _embedded_tokenizer(meta: dict[str, Any], path: str) -> Tokenizer | None:
    """The tokenizer an export file carries (``_export_metadata``), checked against its
    sha256; None for a model of bytes."""
    if meta.get("tokens", "bytes") == "bytes":
        return None
    name = str(meta.get("tokenizer_file", "tokenizer"))
    try:
        data = base64.b64decode(meta["tokenizer"], validate=True)
    except (KeyError, ValueError) as exc:
        raise ModelFileError(f"{path}: its tokenizer ({name}) is missing or damaged: "
                             f"{exc!r}") from None  # fmt: skip
    if hashlib.sha256(data).hexdigest() != meta.get("tokenizer_sha256"):
        raise ModelFileError(f"{path}: its tokenizer ({name}) does not match its sha256 "
                             "(the file is damaged)")  # fmt: skip
    from diloco.dataset import load_tokenizer

    return load_tokenizer(data, f"{path}:{name}")


def export_model(
    model: UsableModel, out: str, tokenizer_file: tuple[str, bytes] | None = None
) -> int:
    """Write ``model`` to ``out`` (a path or an fsspec URL) as safetensors with its config
    and versions in the metadata; returns the bytes written. A local file is written
    under a temporary name and renamed, so a failed export leaves no partial file. A
    Llama goes to a folder in the Hugging Face layout (``export_hf``)."""
    if ARCHS[model.config.arch].hugging_face:
        return export_hf(model, out, tokenizer_file)
    metadata = _export_metadata(model, _tokenizer_file(model, tokenizer_file))
    tensors = {
        n: np.ascontiguousarray(model.params[n], dtype=np.float32) for n in model.codec.names
    }
    data = safetensors.numpy.save(tensors, metadata=metadata)
    if "://" in out and not out.startswith("file://"):
        with fsspec.open(out, "wb") as f:
            f.write(data)
        return len(data)
    path = Path(out.removeprefix("file://"))
    if path.is_dir():
        raise IsADirectoryError(
            f"--out {out} is a folder; give a file name (e.g. model.safetensors)"
        )
    if not path.parent.exists():
        raise FileNotFoundError(f"--out {out}: folder {path.parent} does not exist")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return len(data)


def _tokenizer_file(
    model: UsableModel, given: tuple[str, bytes] | None
) -> tuple[str, bytes] | None:
    """What an export of ``model`` carries as its tokenizer: ``given``, else its run's data
    set's (None for a model of bytes). A model with a tokenizer but neither (one read
    from an export, which keeps no run config) is refused: its export would read as bytes."""
    found = given if given is not None else run_tokenizer_file(model.run_config)
    if found is None and model.tokenizer is not None:
        raise ConfigError(f"{model.source} has a tokenizer: give its file to export it with")
    return found


def export_hf(model: UsableModel, out: str, tokenizer_file: tuple[str, bytes] | None = None) -> int:
    """Write a Llama to the folder ``out`` in the Hugging Face Llama layout (the module
    docstring); returns the bytes written. ``tokenizer_file`` (name, contents) defaults
    to the run's data set's; ``config.json``'s eos and bos ids are its ``eos_id``."""
    from diloco.llama import hf_config, to_hf

    if out.rstrip("/").endswith(".safetensors"):
        raise ConfigError(
            f"--out {out}: a Llama exports to a folder in the Hugging Face layout (it writes "
            "model.safetensors, config.json and tokenizer.json in it); give a folder name"
        )
    tokenizer_file = _tokenizer_file(model, tokenizer_file)
    eos = None if model.tokenizer is None else int(model.tokenizer.eos_id)
    if tokenizer_file is not None and eos is None:
        raise ConfigError(
            f"exporting {tokenizer_file[0]} needs its end-of-document token id: give the "
            "model's tokenizer (UsableModel.tokenizer) too"
        )
    metadata = {**_export_metadata(model), "format": "pt", "diloco_format": EXPORT_FORMAT}
    if tokenizer_file is not None:  # beside the weights, as transformers reads it
        metadata["tokens"] = "tokenizer"
    files = {
        "model.safetensors": safetensors.numpy.save(
            to_hf(model.config, model.params), metadata=metadata
        ),
        "config.json": (json.dumps(hf_config(model.config, eos, eos), indent=2) + "\n").encode(),
    }
    if tokenizer_file is not None:
        name, data = tokenizer_file
        files[name] = data
    if "://" in out and not out.startswith("file://"):
        for name, data in files.items():
            with fsspec.open(f"{out.rstrip('/')}/{name}", "wb") as f:
                f.write(data)
        return sum(map(len, files.values()))
    folder = Path(out.removeprefix("file://"))
    if folder.is_file():
        raise FileExistsError(f"--out {out} is a file; a Llama exports to a folder")
    if not folder.parent.exists():
        raise FileNotFoundError(f"--out {out}: folder {folder.parent} does not exist")
    folder.mkdir(exist_ok=True)
    for name, data in files.items():
        tmp = folder / f".{name}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, folder / name)
    return sum(map(len, files.values()))


def _hf_folder(path: str) -> str | None:
    """``path`` as a folder export (holding ``model.safetensors``), or None."""
    fs, root = fsspec.core.url_to_fs(path)
    if fs.isdir(root) and fs.exists(f"{root.rstrip('/')}/model.safetensors"):
        return path.rstrip("/")
    return None


def _read_bytes(path: str) -> bytes:
    try:
        with fsspec.open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise ModelFileError(f"no exported model at {path} (file not found)") from None
    except IsADirectoryError:
        raise ModelFileError(f"{path} is a folder, not an exported model file") from None


def _metadata(data: bytes, path: str) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes, checked to be one of our exports."""
    size = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if size < 0 or size > len(data) - 8:
        raise ModelFileError(
            f"{path} is not a safetensors file or is truncated ({len(data)} bytes; its "
            f"header claims {max(size, 0)})"
        )
    try:
        header = json.loads(data[8 : 8 + size])
        meta = header.get("__metadata__") or {}
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise ModelFileError(f"{path} is not a safetensors file (header: {exc})") from None
    if EXPORT_FORMAT not in (meta.get("format"), meta.get("diloco_format")):
        raise ModelFileError(
            f"{path} is a safetensors file but not a model exported by `diloco export` "
            f"(its metadata has no format {EXPORT_FORMAT!r})"
        )
    if meta.get("format_version") != EXPORT_FORMAT_VERSION:
        raise ModelFileError(
            f"{path} has export format version {meta.get('format_version')!r}; this code "
            f"reads {EXPORT_FORMAT_VERSION!r}"
        )
    return meta


def read_export_metadata(path: str) -> dict[str, Any]:
    """An export's metadata, decoded: ``model_config`` (a ``ModelConfig``), ``versions``
    (fragment -> version), ``run``, ``source``, ``params_dtype``."""
    return _decoded(_metadata(_read_bytes(path), path), path)


def _decoded(meta: dict[str, str], path: str) -> dict[str, Any]:
    try:
        config = ModelConfig.model_validate_json(meta["model_config"])
        versions = {int(p): int(v) for p, v in json.loads(meta.get("versions", "{}")).items()}
    except (KeyError, ValueError, ValidationError) as exc:
        raise ModelFileError(f"{path} has a damaged model config or versions: {exc}") from None
    return {**meta, "model_config": config, "versions": versions}


def load_exported(path: str) -> tuple[ModelConfig, FlatParams]:
    """The model config and float32 parameters of a file ``diloco export`` wrote; the
    tensors are checked against the model the config describes."""
    config, params, _ = _load(path)
    return config, params


def _load(path: str) -> tuple[ModelConfig, FlatParams, dict[str, Any]]:
    folder = _hf_folder(path)
    if folder is not None:
        path = f"{folder}/model.safetensors"
    data = _read_bytes(path)
    meta = _decoded(_metadata(data, path), path)
    try:
        params = safetensors.numpy.load(data)
    except (safetensors.SafetensorError, ValueError) as exc:
        raise ModelFileError(f"{path} is corrupt: {exc}") from None
    config: ModelConfig = meta["model_config"]
    if meta.get("diloco_format") == EXPORT_FORMAT:  # the Hugging Face layout
        from diloco.llama import from_hf

        try:
            params = from_hf(config, params)
        except KeyError as exc:
            raise ModelFileError(f"{path} does not hold the model its config says: {exc}") from None
    codec, _ = ParamCodec.create(config, 0)
    problems = shape_problems(codec, params)
    if problems:
        raise ModelFileError(
            f"{path} holds a model of another shape than its config says ({_shape(config)}): "
            + "; ".join(problems)
        )
    # The model's own tensor order (safetensors orders by name).
    return config, {n: np.asarray(params[n], dtype=np.float32) for n in codec.names}, meta


def _shape(config: ModelConfig) -> str:
    return ", ".join(f"{k} {v}" for k, v in config.model_dump().items())


def open_exported(path: str) -> UsableModel:
    """An exported file (or a Llama's folder, with its tokenizer) as a ``UsableModel``."""
    config, params, meta = _load(path)
    codec, _ = ParamCodec.create(config, 0)
    if _hf_folder(path) is not None:
        tokenizer = _folder_tokenizer(path)
        if tokenizer is None and meta.get("tokens") == "tokenizer":
            raise ModelFileError(f"{path}: the model was trained with a tokenizer and the "
                                 "folder holds none (tokenizer.json)")  # fmt: skip
    else:
        tokenizer = _embedded_tokenizer(meta, path)
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise ModelFileError(
            f"{path}: its tokenizer has {tokenizer.vocab_size} tokens, more than the "
            f"model's vocabulary ({config.vocab_size}): not the tokenizer it was trained with"
        )
    return UsableModel(config, codec, params, meta["versions"], path,
                       meta.get("params_dtype", "?"), meta.get("run", ""),
                       tokenizer=tokenizer)  # fmt: skip


def _folder_tokenizer(path: str) -> Tokenizer | None:
    """The tokenizer file of a folder export (``tokenizer.json``, or a SentencePiece
    ``tokenizer.model``), read as the data sets read theirs."""
    folder = _hf_folder(path)
    if folder is None:
        return None
    fs, root = fsspec.core.url_to_fs(folder)
    for name in ("tokenizer.json", "tokenizer.model"):
        if fs.exists(f"{root}/{name}"):
            from diloco.dataset import load_tokenizer

            return load_tokenizer(fs.cat_file(f"{root}/{name}"), f"{folder}/{name}")
    return None


def open_model(
    url: str | None, run: str | None, model_file: str | None, versions: str | None = None
) -> UsableModel:
    """The model the CLI's ``eval`` and ``generate`` use: a run's global model in a bucket
    (``url`` and ``run``), or an exported file (``model_file``)."""
    if model_file is not None:
        if url is not None or versions is not None:
            raise ConfigError("give either a bucket URL with --run (and --version) or --model FILE")
        return open_exported(model_file)
    if url is None:
        raise ConfigError("give a bucket URL with --run NAME, or --model FILE (an export)")
    if not run:
        raise ConfigError(f"--run NAME is needed to read a model from {url}")
    return read_global_model(url, run, versions)


# --- text to evaluate on -------------------------------------------------------------------


def read_text(source: str, max_bytes: int, text_field: str = "text") -> np.ndarray:
    """The first ``max_bytes`` bytes of a text file, or of a folder's text files (sorted by
    path, joined with the separator training puts between documents), as uint8 tokens.
    JSON lines and Parquet files are read as in training (``diloco.data.read_file``)."""
    if max_bytes < 2:
        raise ConfigError(f"--max-bytes must be at least 2, got {max_bytes}")
    fs, files = list_files(source)
    parts, size = [], 0
    for i, (path, _) in enumerate(files):
        text = read_file(fs, path, text_field)
        parts.append(text if i == len(files) - 1 else text + DOC_SEPARATOR)
        size += len(parts[-1])
        if size >= max_bytes:
            break
    tokens = np.frombuffer(b"".join(parts)[:max_bytes], dtype=np.uint8)
    if len(tokens) < 2:
        raise DataError(f"data source {source!r} holds {len(tokens)} bytes; need at least 2")
    return tokens


def evaluate(
    model: UsableModel, data: str | None, max_bytes: int, batch_size: int | None = None
) -> tuple[TextScore, str]:
    """Validation loss of ``model`` and what it was measured on: on ``data`` (a file, a
    folder or an fsspec URL of text), every byte of its first ``max_bytes``; without
    ``data``, the run's own validation batches (the number the launcher reports)."""
    if data is None:
        if model.run_config is None:
            raise ConfigError("an exported model has no validation set of its own; give --data")
        cfg = model.run_config
        trainer = build_model(cfg).trainer
        batches = RunData(cfg).validation
        loss = trainer.evaluate(trainer.place_params(model.params), batches)
        count = sum(b.shape[0] * (b.shape[1] - 1) for b in batches)
        where = cfg.data.source or "the Python standard library"
        return TextScore(loss, count), f"the run's validation batches of {where}"
    field = model.run_config.data.text_field if model.run_config else "text"
    tokens = read_text(data, max_bytes, field)
    default = model.run_config.data.batch_size if model.run_config else 8
    scorer = Scorer(model.codec, model.config.context, batch_size or default)
    if model.tokenizer is not None:  # text through the model's own tokenizer
        text = tokens.tobytes().decode("utf-8", errors="replace")
        return scorer.score_text(model.params, model.tokenizer, text), data
    return scorer.score(model.params, tokens), data
