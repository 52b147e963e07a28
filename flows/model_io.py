"""Using a run's model: read the global model from the buckets, read text to evaluate it
on, evaluate it.

The global model is assembled the way the launcher evaluates it: every fragment's
version read through ``RunStore.versions.get_global`` and the tensors put together under the
run's ``ParamCodec`` names (``flows.run.Run``: its model). In
the syncers' home region that is the fp32 master copy; any other region holds only the
``wire`` copy learners download (``topology.global_dtype``, bf16 by default), which is
read instead and said so.

The export (``diloco export``) and the files it writes: ``flows.model_export``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

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
