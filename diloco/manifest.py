"""A prepared data set's ``manifest.json`` (``diloco.dataset``), checked field by field as it
is read: the format and its version, the tokenizer, the token dtype, the chunk size and
every shard with one sha256 per chunk."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

# A file the manifest names: a plain name in the data set's folder (no path, no "..").
FileName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]


Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


Count = Annotated[int, Field(ge=0, lt=1 << 53)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True, strict=True)


class TokenizerEntry(_Strict):
    kind: str
    file: FileName
    sha256: Sha256
    vocab_size: Annotated[int, Field(ge=1, le=1 << 32)]
    eos_id: Count


class ShardEntry(_Strict):
    name: FileName
    split: Literal["train", "validation"]
    tokens: Count
    chunk_tokens: Annotated[int, Field(ge=1, le=1 << 40)]
    chunk_sha256: list[Sha256]

    @model_validator(mode="after")
    def _chunks_cover_the_tokens(self) -> ShardEntry:
        if len(self.chunk_sha256) != -(-self.tokens // self.chunk_tokens):
            raise ValueError(f"shard {self.name}: {len(self.chunk_sha256)} chunk checksums for "
                             f"{self.tokens} tokens in chunks of {self.chunk_tokens}")  # fmt: skip
        return self


class Manifest(_Strict):
    """What a reader takes from ``manifest.json``, bounded: plain file names, checksums
    of sha256's form, counts within what a data set can hold."""

    format: Literal["diloco-tokens"]
    version: Literal[1]
    tokenizer: TokenizerEntry
    dtype: Literal["uint16", "uint32"]
    chunk_tokens: Annotated[int, Field(ge=1, le=1 << 40)]
    shards: list[ShardEntry]

    @model_validator(mode="after")
    def _eos_in_vocabulary(self) -> Manifest:
        if self.tokenizer.eos_id >= self.tokenizer.vocab_size:
            raise ValueError(f"tokenizer.eos_id {self.tokenizer.eos_id} is not below "
                             f"vocab_size {self.tokenizer.vocab_size}")  # fmt: skip
        return self
