"""A run's data, made once from its config: what every process of the run reads.

``RunData(cfg)`` answers, for a config whose ``data.assign`` is settled
(``settle_assign``): whether the data can be trained on (``check``), its fingerprint (the
spec's ``data.sha256``), learner ``i``'s reader, the units (``data.assign = "units"``)
and the fixed validation batches. The corpus behind them is read once per process
(the caches below): a simulator, a learner and its warm-up share it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

import numpy as np

from diloco import dataset
from diloco.config import RunConfig, validate_config
from diloco.data import Corpus, DataError, ShardReader, load_corpus, validation_batches
from diloco.units import UnitLedger, UnitPlan, UnitReader
from protocol.topology import learner_id


@lru_cache(maxsize=4)
def cached_corpus(
    source: str | None, shards: int, val_percent: int, text_field: str = "text"
) -> Corpus:
    return load_corpus(source, shards, val_percent, text_field)


@lru_cache(maxsize=4)
def cached_dataset(source: str) -> dataset.Dataset | None:
    """The prepared data set at ``source``; None: ``source`` is text (the byte reader's)."""
    return dataset.open_dataset(source) if dataset.is_prepared(source) else None


@lru_cache(maxsize=4)
def cached_text_chunks(
    source: str | None, val_percent: int, text_field: str = "text"
) -> dataset.TextChunks:
    """The text corpus at ``source`` cut into chunks (``data.assign = "units"``)."""
    corpus = cached_corpus(source, 1, val_percent, text_field)
    return dataset.TextChunks(corpus, source or "the Python standard library")


def settle_assign(cfg: RunConfig, stored: str | None = None, buckets: bool = False) -> RunConfig:
    """``cfg`` with ``data.assign = "auto"`` made what it means: for a run already
    started, what its spec records (``stored``); else units for a run through buckets
    (``buckets``: the pipeline's, and the simulator's over a bucket store), so that
    learners come, go and join beyond the slots whatever the data, and for a run in
    memory units on a prepared data set and slots on text (the simulator's reference
    runs: one process holds one pool of units where a run through buckets holds one per
    region, so text in units would not be the same run in memory and through buckets).
    Checked again as a whole (a join beyond the slots of a run on slots is refused by
    name)."""
    if cfg.data.assign != "auto":
        return cfg
    prepared = cfg.data.source and cached_dataset(cfg.data.source)
    assign = stored or ("units" if buckets or prepared else "slots")
    raw = cfg.model_dump()
    raw["data"]["assign"] = assign
    return validate_config(raw)


@dataclass(frozen=True)
class RunData:
    """The data of a run of ``cfg``, its ``data.assign`` settled (``settle_assign``; left
    at "auto", it is read as slots are)."""

    cfg: RunConfig

    @cached_property
    def prepared(self) -> dataset.Dataset | None:
        """The prepared data set the run reads; None: text (the byte reader's)."""
        return cached_dataset(self.cfg.data.source) if self.cfg.data.source else None

    @property
    def _text(self) -> Corpus:
        """The byte reader's corpus: one shard per slot, or, taken in units, one shard
        cut into chunks (its validation split is the same either way)."""
        d = self.cfg.data
        shards = 1 if d.assign == "units" else self.cfg.topology.learners
        return cached_corpus(d.source, shards, d.val_percent, d.text_field)

    def check(self) -> None:
        """Fail, naming what is wrong, on data a run cannot train on: a missing, empty
        or binary source, or a prepared data set that does not fit the model and
        learners."""
        cfg = self.cfg
        if self.prepared:
            self.prepared.check(cfg.model.vocab_size, cfg.topology.learners, cfg.model.context)
        elif cfg.data.assign == "units":
            _ = self.units  # (it names a corpus that holds no window)
        else:
            _ = self._text

    @cached_property
    def fingerprint(self) -> str:
        """The sha256 of the data, as this machine reads it: a prepared data set's
        manifest (which holds every chunk's sha256; the same wherever the data set is
        copied), or the text corpus as the byte reader splits it (its training shards and
        validation split). A run's spec records it (``data.sha256``)."""
        digest = hashlib.sha256()
        if self.prepared:
            digest.update(json.dumps(self.prepared.manifest, sort_keys=True).encode())
        else:
            corpus = self._text
            for part in (*corpus.train_shards, corpus.validation):
                digest.update(len(part).to_bytes(8, "little"))
                digest.update(np.ascontiguousarray(part).data)  # (no copy: the arrays are)
        return digest.hexdigest()

    def check_same(self, spec: dict[str, Any], who: str) -> None:
        """Refuse, by name, a learner or joiner (``who``) whose data is not the data the
        run's spec recorded (another corpus at ``data.source`` on this machine, or
        another Python's standard library): it would train windows no one else's ledger
        or share describes. A spec written before the data was recorded checks nothing."""
        want = (spec.get("data") or {}).get("sha256")
        if want is None or self.fingerprint == want:
            return
        got, source = self.fingerprint, self.cfg.data.source
        hint = ("; it differs between Python versions: give every machine one data.source"
                if source is None else "")  # fmt: skip
        raise DataError(
            f"{who}: the data at {source or 'the Python standard library (the default corpus)'}"
            f" is not the data the run started on (sha256 {got[:12]}..., the run's "
            f"{want[:12]}...): every machine of a run must read the same data{hint}"
        )

    def reader(
        self, index: int, ledger: UnitLedger | None = None
    ) -> ShardReader | dataset.TokenReader | UnitReader:
        """Learner ``index``'s reader: its chunks of a prepared data set (with
        ``data.assign = "units"``, the spans it takes from ``ledger``), or its shard of
        the byte corpus."""
        cfg = self.cfg
        d, m = cfg.data, cfg.topology.learners
        if d.assign == "units":
            if ledger is None:
                raise ValueError("data.assign = 'units' reads through a ledger; none was given")
            return UnitReader(ledger.plan, learner_id(index), ledger, d.batch_size)
        if self.prepared:
            return dataset.TokenReader(self.prepared, index, m, d.batch_size, cfg.model.context,
                                       cfg.seed)  # fmt: skip
        return ShardReader(self._text.train_shards[index], d.batch_size, cfg.model.context,
                           cfg.seed, index)  # fmt: skip

    @cached_property
    def units(self) -> UnitPlan:
        """The units of the data (``data.assign = "units"``): a prepared data set's
        chunks, or a text corpus cut into chunks (``dataset.TextChunks``)."""
        d = self.cfg.data
        chunks = self.prepared or cached_text_chunks(d.source, d.val_percent, d.text_field)
        return UnitPlan(chunks, self.cfg.model.context, self.cfg.seed)

    @cached_property
    def validation(self) -> list[np.ndarray]:
        """The fixed held-out batches, the same for every learner and syncer."""
        d, context, seed = self.cfg.data, self.cfg.model.context, self.cfg.seed
        if self.prepared:
            return dataset.validation_batches(self.prepared, d.batch_size, context,
                                              d.eval_batches, seed)  # fmt: skip
        return validation_batches(self._text, d.batch_size, context, d.eval_batches, seed)
