"""A run's model as a file: exported (``diloco export``) and read back, checked
(``open_exported``), wherever a user takes it.

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
``ParamCodec.abstract(config)`` and ``codec.model(codec.from_flat(params))``.

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
import os
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import safetensors
import safetensors.numpy
from pydantic import ValidationError

from diloco.archs import ARCHS
from diloco.config import ConfigError, ModelConfig
from diloco.model import FlatParams, ParamCodec
from diloco.sample import Tokenizer
from flows.model_io import (
    ModelFileError,
    UsableModel,
    read_global_model,
    run_tokenizer_file,
    shape_problems,
)

EXPORT_FORMAT = "diloco-model"


EXPORT_FORMAT_VERSION = "1"


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
    from diloco.tokenizer import load_tokenizer

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
    codec = ParamCodec.abstract(config)
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
    codec = ParamCodec.abstract(config)
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
            from diloco.tokenizer import load_tokenizer

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
