"""Prepared token data sets (``diloco.dataset``): ``diloco data prepare``, the manifest,
the tokenizers, the streaming ``TokenReader`` and the errors that name bad input."""

import hashlib
import io
import itertools
import json
import sysconfig
import tracemalloc
from pathlib import Path

import fsspec
import numpy as np
import pytest

from diloco import dataset
from diloco import prepare as prepare_module
from diloco.data import DataError, is_held_out
from diloco.dataset import TokenReader, open_dataset
from diloco.prepare import prepare, write_dataset
from diloco.tokenizer import HFTokenizer
from flows.cli import main

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory) -> Path:
    """About 300 KB of real text: some standard library modules, in two folders."""
    root = tmp_path_factory.mktemp("text")
    for name in ("json", "email", "logging"):
        for f in sorted((STDLIB / name).glob("*.py")):
            (root / name).mkdir(exist_ok=True)
            (root / name / f.name).write_text(f.read_text())
    return root


@pytest.fixture(scope="module")
def prepared(text_folder, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("ds") / "tokens")
    prepare(str(text_folder), out, vocab_size=512, chunk_tokens=2048, shard_chunks=8)
    return out


def _documents(ds: dataset.Dataset, split: str) -> list[list[int]]:
    """Every document of ``split``, read back from the shards (split at EOS)."""
    tokens = np.concatenate([ds.read_chunk(c) for c in ds.chunks(split)])
    cuts = np.flatnonzero(tokens == ds.eos_id)
    return [t.tolist() for t in np.split(tokens, cuts + 1)[:-1]]


def test_prepare_a_text_folder_round_trips_every_document(text_folder, prepared):
    ds = open_dataset(prepared)
    m = ds.manifest
    files = sorted(text_folder.rglob("*.py"))
    assert m["tokenizer"]["kind"] == "hf" and m["tokenizer"]["vocab_size"] == 512
    assert m["dtype"] == "uint16" and m["source"]["files"] == len(files)
    assert m["totals"]["train"]["documents"] + m["totals"]["validation"]["documents"] == len(files)
    assert m["totals"]["validation"]["documents"] >= 1
    assert len(m["shards"]) > 2  # the training split rolled over shard files
    for shard in m["shards"]:  # each shard's size and chunk count match its tokens
        size = Path(prepared, shard["name"]).stat().st_size
        assert size == 2 * shard["tokens"]
        assert len(shard["chunk_sha256"]) == -(-shard["tokens"] // 2048)
    tok = ds.tokenizer()
    texts = sorted(f.read_text() for f in files)
    decoded = sorted(
        tok.decode(d[:-1]) for split in ("train", "validation") for d in _documents(ds, split)
    )
    assert decoded == texts  # every document, whole, each once, EOS after each
    weird = "  tabs\tand ünïcode ☃ \x01 and\n\nblank lines  "
    assert tok.decode(tok.encode(weird)) == weird
    assert dataset.is_prepared(prepared) and not dataset.is_prepared(str(text_folder))
    name, data = ds.tokenizer_file()
    assert name == "tokenizer.json" and json.loads(data)["model"]["type"] == "BPE"


def test_prepare_jsonl_holds_out_records_by_identity_the_same_every_time(tmp_path):
    src = tmp_path / "docs.jsonl"
    texts = [
        f"record {i}: " + " ".join(f"word{j * i % 97}" for j in range(200)) for i in range(300)
    ]
    src.write_text("\n".join(json.dumps({"body": t}) for t in texts) + "\n")
    a = prepare(str(src), str(tmp_path / "a"), vocab_size=400, text_field="body",
                val_percent=10, chunk_tokens=4096)  # fmt: skip
    b = prepare(str(src), str(tmp_path / "b"), vocab_size=400, text_field="body",
                val_percent=10, chunk_tokens=4096)  # fmt: skip
    assert a["shards"] == b["shards"] and a["tokenizer"] == b["tokenizer"]  # deterministic
    held = [t for i, t in enumerate(texts) if is_held_out(f"docs.jsonl#{i}", 10)]
    assert a["totals"]["validation"]["documents"] == len(held) > 0
    ds = open_dataset(str(tmp_path / "a"))
    tok = ds.tokenizer()
    assert sorted(tok.decode(d[:-1]) for d in _documents(ds, "validation")) == sorted(held)


def test_a_given_tokenizer_json_or_sentencepiece_model_is_used(prepared, text_folder, tmp_path):
    import sentencepiece as spm

    own = Path(prepared, "tokenizer.json")
    m = prepare(str(text_folder), str(tmp_path / "hf"), tokenizer=str(own), chunk_tokens=4096)
    assert m["tokenizer"]["sha256"] == hashlib.sha256(own.read_bytes()).hexdigest()
    model = io.BytesIO()
    lines = (line for f in sorted(text_folder.rglob("*.py")) for line in f.read_text().split("\n"))
    spm.SentencePieceTrainer.train(sentence_iterator=lines, model_writer=model, vocab_size=300,
                                   model_type="bpe", eos_id=2, minloglevel=2)  # fmt: skip
    (tmp_path / "sp.model").write_bytes(model.getvalue())
    m = prepare(str(text_folder), str(tmp_path / "sp"), tokenizer=str(tmp_path / "sp.model"),
                chunk_tokens=4096)  # fmt: skip
    assert m["tokenizer"] == {**m["tokenizer"], "kind": "sentencepiece", "vocab_size": 300,
                              "eos_id": 2, "file": "tokenizer.model"}  # fmt: skip
    tok = open_dataset(str(tmp_path / "sp")).tokenizer()
    # (SentencePiece normalizes whitespace: a model's own rule, so one-space text here)
    assert tok.decode(tok.encode("def f(x): return x")) == "def f(x): return x"


def test_reader_is_a_pure_function_of_seed_assignment_and_position(prepared):
    ds = open_dataset(prepared)
    first = TokenReader(ds, 1, 3, batch_size=4, context=32, seed=7)
    batches = [first.next_batch() for _ in range(60)]
    assert batches[0].shape == (4, 33) and batches[0].dtype == np.int32
    again = TokenReader(ds, 1, 3, batch_size=4, context=32, seed=7, position=41)
    assert all((again.next_batch() == b).all() for b in batches[41:])  # resumes from position
    other_seed = TokenReader(ds, 1, 3, batch_size=4, context=32, seed=8)
    assert not (other_seed.next_batch() == batches[0]).all()


def test_one_epoch_serves_each_window_of_the_learners_own_chunks_once(prepared):
    ds = open_dataset(prepared)
    context, learners = 32, 3
    seen = []
    for index in range(learners):
        reader = TokenReader(ds, index, learners, batch_size=1, context=context, seed=0)
        mine = dataset.assignment(ds.chunks("train"), index, learners)
        expect = sorted(
            tuple(w)
            for c in mine
            for t in [ds.read_chunk(c)]
            for w in (t[s : s + context + 1] for s in range(0, len(t) - context, context))
        )
        got = sorted(tuple(reader.next_batch()[0]) for _ in range(reader.epoch_windows))
        assert got == expect
        seen.append({c.name for c in mine})
    assert set.union(*seen) == {c.name for c in ds.chunks("train")}
    assert sum(map(len, seen)) == len(ds.chunks("train"))  # dealt, disjoint


def _synthetic(out: Path, tokenizer: Path, tokens: int, chunk_tokens: int = 1 << 14) -> str:
    """A data set of ``tokens`` random tokens, written as they are drawn."""
    rng = np.random.default_rng(0)
    data = tokenizer.read_bytes()
    docs = (("train", rng.integers(1, 500, 5000)) for _ in range(tokens // 5000))
    val = [("validation", rng.integers(1, 500, 5000))]
    documents = itertools.chain(docs, val)
    write_dataset(str(out), HFTokenizer(data), data, documents, chunk_tokens)
    return str(out)


def test_reading_memory_does_not_grow_with_the_data_set(prepared, tmp_path):
    peaks = {}
    for scale in (1, 8):
        tok = Path(prepared, "tokenizer.json")
        ds = open_dataset(_synthetic(tmp_path / f"x{scale}", tok, scale * 400_000))
        reader = TokenReader(ds, 0, 2, batch_size=8, context=64, seed=0)
        tracemalloc.start()
        for _ in range(200):
            reader.next_batch()
        peaks[scale] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        reader.close(wait=True)  # its read ahead ends before the next one is measured
    # A few chunks (16 Ki tokens, 32 KB each) at a time, whatever the data set's size
    # (1.6 MB or 12.8 MB of tokens here): a reader whose memory followed the data set
    # would hold 8 times more at scale 8. How many of its groups overlap at the peak
    # (the one served, the next read ahead, its read's temporaries) depends on the two
    # threads' timing: 1.56x apart once on a loaded machine, so not a tighter ratio.
    assert peaks[8] < 2 * peaks[1] + 64_000, peaks
    assert peaks[8] < 1_000_000, peaks


def _damage(path: Path, at: int, data: bytes | None = None) -> None:
    raw = bytearray(path.read_bytes())
    if data is None:
        path.write_bytes(bytes(raw[:at]))
    else:
        raw[at : at + len(data)] = data
        path.write_bytes(bytes(raw))


def _copy(prepared: str, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    fsspec.filesystem("file").copy(prepared, str(out), recursive=True)
    return out


def test_a_truncated_shard_is_named(prepared, tmp_path):
    out = _copy(prepared, tmp_path)
    _damage(out / "train-00001.bin", 100)
    ds = open_dataset(str(out))
    with pytest.raises(DataError, match=r"train-00001.bin is truncated: 100 bytes"):
        ds.check(512, 2, 32)
    chunk = next(c for c in ds.chunks("train") if c.shard == "train-00001.bin")
    with pytest.raises(DataError, match=r"train-00001.bin is truncated: chunk 0 has 100 bytes"):
        ds.read_chunk(chunk)


def test_a_chunk_that_fails_its_checksum_is_named_in_next_batch(prepared, tmp_path):
    """The prefetch thread's error reaches the learner's next_batch."""
    out = _copy(prepared, tmp_path)
    _damage(out / "train-00000.bin", 2048 * 2 * 3 + 10, b"\xff\xff")  # in chunk 3
    ds = open_dataset(str(out))
    reader = TokenReader(ds, 0, 1, batch_size=16, context=32, seed=0)
    with pytest.raises(DataError, match=r"train-00000.bin: chunk 3 \(tokens 6,144 to 8,192\) "
                       "fails its sha256"):  # fmt: skip
        for _ in range(10 * reader.epoch_windows // 16):
            reader.next_batch()


def test_a_tokenizer_that_does_not_match_the_manifest_is_named(prepared, tmp_path):
    out = _copy(prepared, tmp_path)
    data = json.loads((out / "tokenizer.json").read_text())
    data["added_tokens"][0]["content"] = "<|other|>"
    (out / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(DataError, match=r"tokenizer .*tokenizer.json does not match the manifest"):
        open_dataset(str(out)).tokenizer()
    with pytest.raises(DataError, match="does not match the manifest"):
        open_dataset(str(out)).check(512, 1, 32)


def test_the_data_sets_needs_are_named(prepared, tmp_path):
    ds = open_dataset(prepared)
    with pytest.raises(DataError, match=r"vocabulary of 512 tokens, larger than "
                       r"model.vocab_size 256; give --set model.vocab_size=512"):  # fmt: skip
        ds.check(256, 1, 32)
    chunks = len(ds.chunks("train"))
    with pytest.raises(DataError, match=f"has {chunks} training chunks for {chunks + 1} learners"):
        ds.check(512, chunks + 1, 32)
    with pytest.raises(DataError, match="not a prepared data set"):
        open_dataset(str(tmp_path))


def test_bad_sources_and_outputs_are_named(prepared, text_folder, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no text files"):
        prepare(str(tmp_path / "empty"), str(tmp_path / "o1"))
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    with pytest.raises(DataError, match="holds no text to tokenize"):
        prepare(str(tmp_path / "blank"), str(tmp_path / "o2"))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "a.txt").write_bytes(b"ELF\x00\x01\x02" * 100)
    with pytest.raises(DataError, match="looks binary"):
        prepare(str(tmp_path / "bin"), str(tmp_path / "o3"))
    (tmp_path / "latin.txt").write_bytes("caf\xe9 ".encode("latin-1") * 100)
    with pytest.raises(DataError, match=r"latin.txt is not UTF-8 text"):
        prepare(str(tmp_path / "latin.txt"), str(tmp_path / "o4"))
    (tmp_path / "tok.bin").write_bytes(b"\x00\x01 not a tokenizer")
    with pytest.raises(DataError, match=r"tok.bin is neither a Hugging Face tokenizer.json nor "
                       "a SentencePiece model"):  # fmt: skip
        prepare(str(text_folder), str(tmp_path / "o5"), tokenizer=str(tmp_path / "tok.bin"))
    with pytest.raises(DataError, match="already holds a data set"):
        prepare(str(text_folder), prepared)
    assert not (tmp_path / "o3" / "manifest.json").exists()
    # "holds no text" is found after the (empty) documents' shard was written: the
    # refusal leaves no shard behind.
    assert not list((tmp_path / "o2").glob("*"))


def test_a_hostile_manifest_or_tokenizer_is_refused_by_name(prepared, tmp_path, monkeypatch):
    """A manifest names files inside its data set only, and nothing is read unbounded: a
    tokenizer named by a path out of the folder, a device or an absolute path is refused
    before it is opened, as are wrong types and a manifest or tokenizer over its cap."""
    out = _copy(prepared, tmp_path)
    good = json.loads((out / "manifest.json").read_text())

    def refused(change, match: str) -> None:
        manifest = json.loads(json.dumps(good))
        change(manifest)
        (out / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(DataError, match=match):
            open_dataset(str(out)).check(512, 1, 32)

    for name in ("../../../../dev/zero", "/etc/hostname", "..", "sub/tokenizer.json"):
        refused(lambda m, name=name: m["tokenizer"].update(file=name),
                r"manifest.json is malformed: tokenizer.file: String should match")  # fmt: skip
    refused(lambda m: m["shards"][0].update(name="../train-00000.bin"), r"shards.0.name")
    refused(lambda m: m["shards"][0].update(tokens="many"), r"shards.0.tokens")
    refused(lambda m: m["shards"][0].update(tokens=10**30), r"shards.0.tokens")
    refused(lambda m: m["shards"][0]["chunk_sha256"].pop(), r"chunk checksums for")
    refused(lambda m: m["tokenizer"].update(eos_id=512), r"eos_id 512 is not below")
    refused(lambda m: m.update(dtype="float64"), r"dtype")
    (out / "manifest.json").write_text("[1, 2]")
    with pytest.raises(DataError, match="is not a diloco-tokens manifest"):
        open_dataset(str(out))
    (out / "manifest.json").write_text(json.dumps(good))
    monkeypatch.setattr(dataset, "TOKENIZER_BYTES", 1000)
    with pytest.raises(DataError, match=r"tokenizer .*tokenizer.json is larger than 1,000 bytes"):
        open_dataset(str(out)).tokenizer()
    monkeypatch.setattr(dataset, "MANIFEST_BYTES", 1000)
    with pytest.raises(DataError, match=r"manifest.json is larger than 1,000 bytes"):
        open_dataset(str(out))


def test_a_long_document_is_tokenized_in_pieces_to_its_whole_tokens(prepared, monkeypatch):
    """A document longer than ``PIECE_CHARS`` goes through the tokenizer in pieces cut
    before a space, so its encoding is never held whole; its tokens are the whole's."""
    tok = open_dataset(prepared).tokenizer()
    text = ("def f(x):\n    return  x  +  1   # a   comment\n\n" * 400) + "z" * 3000
    monkeypatch.setattr(prepare_module, "PIECE_CHARS", 1000)
    assert len(list(prepare_module._pieces(text, 1000))) > len(text) // 1000
    (_, ids), (_, short) = prepare_module._tokenized(
        iter([("a", text), ("b", "x y")]), tok, 0, "src"
    )
    assert ids.tolist() == [*tok.encode(text), tok.eos_id]
    assert short.tolist() == [*tok.encode("x y"), tok.eos_id]


def test_data_prepare_and_show_on_the_command_line(text_folder, tmp_path, capsys):
    out = tmp_path / "cli"
    code = main(["data", "prepare", str(text_folder / "json"), "--out", str(out),
                 "--vocab-size", "300", "--chunk-tokens", "1024"])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0 and "--set model.vocab_size=300" in text and "validation" in text
    corpus = tmp_path / "corpus"  # text with a manifest.json of its own: not a data set
    corpus.mkdir()
    (corpus / "manifest.json").write_text('{"files": ["a.txt"]}')
    assert not dataset.is_prepared(str(corpus)) and dataset.is_prepared(str(out))
    assert main(["data", "prepare", str(text_folder), "--out", str(out), "--quiet"]) == 2
    assert "already holds a data set" in capsys.readouterr().err


def test_a_bad_data_set_fails_initialize_run_before_any_commit(prepared, tmp_path):
    from diloco.config import load_config
    from flows.run import initialize_run
    from storage_layout.store import RunStore

    (tmp_path / "us").mkdir()
    store = RunStore("r", {"us": str(tmp_path / "us")}, "us", writer="launcher")
    cfg = load_config("tiny", overrides=[f"data.source={prepared}"])  # vocab 256 < 512
    with pytest.raises(DataError, match=r"give --set model.vocab_size=512"):
        initialize_run(store, cfg)
    assert list((tmp_path / "us").iterdir()) == []


def test_a_run_on_a_prepared_data_set_learns_and_merges_each_batch_once(prepared, tmp_path):
    """The simulated run goes through real buckets: every contribution records the data
    positions it carries, and the audit finds no batch merged twice into a fragment and no
    learner's data skipped beyond the steps between a send and its answer (tau and the
    wait for the answer, blended into the next anchor)."""
    from diloco.config import load_config
    from diloco.simulate import simulate
    from flows.run import simulation_store
    from storage_layout.audit import audit_run

    cfg = load_config("tiny", overrides=[
        f"data.source={prepared}", "model.vocab_size=512", "topology.learners=2",
        "budget.tokens=81920", "sim.eval_points=2", "topology.keep_unsent=true",
        'sim.failures=[{"learner": 1, "at": 0.45, "duration": 0.1}]',
    ])  # fmt: skip
    regions = {"us": str(tmp_path / "us")}
    (tmp_path / "us").mkdir()
    result = simulate(cfg, store=simulation_store("tok", regions))
    s = result.summary
    assert s["final_loss"] < s["initial_loss"] - 0.5, s  # from about ln 512 = 6.2
    report = audit_run("tok", {"us": "file://" + str(tmp_path / "us")})
    assert report.ok, report.violations
    failed = [e for e in result.metrics if e["event"] == "failure"]
    rejoined = [e for e in result.metrics if e["event"] == "rejoin"]
    assert [e["learner"] for e in failed + rejoined] == ["learner-1", "learner-1"], failed
    assert failed[0]["step"] > 0  # killed mid-run, after it had trained
    # keep_unsent: the steps after a send count towards the next one, and a rejoined
    # learner resumes at its newest send: each learner's merged data is one run of its
    # batches from 0, without a gap, up to the last step it trained (its final sends
    # carry the steps since the ones before), and together at least the run's budget.
    assert sorted(report.data) == ["learner-0", "learner-1"], report.data
    assert all(len(spans) == 1 and spans[0][0] == 0 for spans in report.data.values())
    trained = {}
    for e in result.metrics:
        if e["event"] == "sent":
            trained[e["learner"]] = max(trained.get(e["learner"], 0), e["step"])
    assert {lid: spans[0][1] for lid, spans in report.data.items()} == trained
    assert sum(trained.values()) >= cfg.budget_steps


def test_the_audit_names_a_batch_merged_twice_into_a_fragment():
    from storage_layout.audit import _data_once
    from storage_layout.audit_report import AuditReport, Sent

    def sent(seq, anchor_seq, data):
        return Sent("l0", seq, 1, anchor_seq, 10, "w", outcome="merged", data=data)

    report = AuditReport("r", {}, [])
    cumulative = {("l0", 1): sent(1, 0, (0, 10)), ("l0", 2): sent(2, 0, (0, 20)),
                  ("l0", 3): sent(3, 2, (20, 30))}  # fmt: skip
    _data_once(0, cumulative, report)
    assert report.ok and report.data == {"l0": [[0, 30]]}
    _data_once(1, {("l0", 4): sent(4, 3, (0, 12)), ("l0", 5): sent(5, 4, (10, 30))}, report)
    assert report.violations["data-once"] == [
        "fragment 1: learner l0 merged its data 0-12 and 10-30 (batches) from two anchors"
    ]


def test_a_missing_shard_is_named(prepared, tmp_path):
    out = _copy(prepared, tmp_path)
    (out / "validation-00000.bin").unlink()
    with pytest.raises(DataError, match=r"shard .*validation-00000.bin is missing"):
        open_dataset(str(out)).check(512, 1, 32)


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_a_data_set_in_a_bucket_reads_as_the_same_one_on_disk(backend, make_bucket, text_folder,
                                                              tmp_path):  # fmt: skip
    """Prepared into a bucket (moto S3, fake GCS) and read back with ranged reads: the
    same manifest and the same batches as on disk."""
    url = make_bucket(backend) + "/tokens"
    source = str(text_folder / "json")
    a = prepare(source, url, vocab_size=300, chunk_tokens=1024)
    b = prepare(source, str(tmp_path / "local"), vocab_size=300, chunk_tokens=1024)
    assert dataset.is_prepared(url) and a["shards"] == b["shards"]
    remote, local = (TokenReader(open_dataset(u), 1, 2, 4, 32, seed=3)
                     for u in (url, str(tmp_path / "local")))  # fmt: skip
    for _ in range(3 * remote.epoch_windows // 4):
        assert (remote.next_batch() == local.next_batch()).all()
    open_dataset(url).check(300, 2, 32)


def test_a_vocabulary_above_65536_is_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.BPE(vocab={f"t{i}": i for i in range(70_000)}, merges=[]))
    tok.add_special_tokens(["<|endoftext|>"])
    data = tok.to_str().encode()
    rng = np.random.default_rng(1)
    docs = [("train", rng.integers(60_000, 70_000, 3000)) for _ in range(4)]
    docs.append(("validation", rng.integers(0, 70_000, 500)))
    m = write_dataset(str(tmp_path / "big"), HFTokenizer(data), data, docs, 2048)
    assert m["dtype"] == "uint32" and m["tokenizer"]["vocab_size"] == 70_001
    ds = open_dataset(str(tmp_path / "big"))
    ds.check(70_001, 2, 32)
    batch = TokenReader(ds, 0, 2, 4, 32, seed=0).next_batch()
    assert batch.max() >= 60_000 and set(np.unique(batch)) <= set(range(60_000, 70_001))
