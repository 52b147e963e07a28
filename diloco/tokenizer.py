"""Tokenizers from a file's bytes (a Hugging Face ``tokenizer.json`` or a SentencePiece
model), one interface for both, and a byte-level BPE trained on a corpus."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Protocol

from diloco.data import DataError

EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>")


class Tokenizer(Protocol):
    kind: str
    file: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer (``tokenizer.json``)."""

    kind = "hf"
    file = "tokenizer.json"

    def __init__(self, data: bytes, name: str = "tokenizer.json"):
        from tokenizers import Tokenizer as _Tokenizer

        self.data = data  # the file's bytes, stored beside the shards
        self._tok = _Tokenizer.from_str(data.decode())
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eos = [self._tok.token_to_id(n) for n in EOS_NAMES]
        eos = [i for i in eos if i is not None]
        if not eos:
            raise DataError(
                f"tokenizer {name} has no end-of-text token (one of {', '.join(EOS_NAMES)}); "
                "documents are separated by it"
            )
        self.eos_id = eos[0]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # Parallel in Rust (RAYON_RS_NUM_CPUS threads).
        # (``_fast``: no offsets kept, which a data set never needs: less memory and time)
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


class SentencePieceTokenizer:
    """A SentencePiece model (``tokenizer.model``)."""

    kind = "sentencepiece"
    file = "tokenizer.model"

    def __init__(self, data: bytes, name: str = "tokenizer.model", threads: int = 1):
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor(model_proto=data)
        self.vocab_size = int(self._sp.get_piece_size())
        self.eos_id = int(self._sp.eos_id())
        self.threads = threads
        if self.eos_id < 0:
            raise DataError(f"SentencePiece model {name} has no end-of-sentence token (eos_id)")

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self._sp.encode(texts, num_threads=self.threads)]

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


def load_tokenizer(
    data: bytes, name: str, threads: int = 1
) -> HFTokenizer | SentencePieceTokenizer:
    """A tokenizer from a file's bytes: a ``tokenizer.json`` or a SentencePiece model."""
    try:
        json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        pass
    else:
        try:
            return HFTokenizer(data, name)
        except DataError:
            raise
        except Exception as exc:
            raise DataError(f"{name} is JSON but not a Hugging Face tokenizer: {exc}") from None
    try:
        return SentencePieceTokenizer(data, name, threads)
    except DataError:
        raise
    except Exception:
        raise DataError(
            f"{name} is neither a Hugging Face tokenizer.json nor a SentencePiece model"
        ) from None


def train_bpe(texts: Iterator[str], vocab_size: int) -> HFTokenizer:
    """A byte-level BPE trained on ``texts``: every string encodes (no unknown token) and
    decodes back to itself; ``<|endoftext|>`` (id 0) ends each document."""
    from tokenizers import Tokenizer as _Tokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 + 1:
        raise DataError(f"--vocab-size {vocab_size} is too small: a byte-level BPE needs >= 258")
    tok = _Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_NAMES[0]],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tok.to_str().encode())
