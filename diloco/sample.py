"""Using a trained model: sampling tokens and scoring text (pure JAX, no I/O).

Text meets the model through a ``Tokenizer`` (``encode``, ``decode``, ``vocab_size``,
``eos_id``): the byte model's is ``ByteTokenizer`` (a byte is a token), a Llama's the
run's data set's (``diloco.tokenizer.load_tokenizer``: a ``tokenizer.json`` or a
SentencePiece model). The sampler and the scorer work on token ids either way; below, "byte" reads "token" for a
model with a tokenizer of its own.

Both compile once per model shape and never again, whatever is asked of them:

- ``Sampler`` keeps a fixed window of ``context`` bytes and the count of bytes in it.
  One jitted function advances it ``count`` steps (at most ``chunk``, a dynamic loop
  bound): each step runs the model over the whole window, picks the next byte from the
  logits at the last filled position (causal attention: the empty slots after it change
  nothing) and appends it, sliding the window by one once it is full (the model has
  learned position embeddings for ``context`` positions only). The prompt, the
  temperature, top-k, the seed and the number of bytes are all arguments, not shapes,
  so a second call, of any length, runs the same compiled code. There is no KV cache:
  with absolute position embeddings a sliding window re-embeds every position anyway,
  and at byte-model contexts the recomputation is cheap.
- ``Scorer`` cuts text into windows of ``context + 1`` bytes that overlap by one byte
  (every byte but the first is predicted once, with up to ``context - 1`` bytes before
  it) and sums the masked cross-entropy over fixed ``[batch, context + 1]`` arrays; the
  last, partial window and batch are padded and weighted 0.

``traces`` on each counts how often JAX traced its function (tests check it stays 1).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax

from diloco.data import DOC_SEPARATOR
from diloco.model import ParamCodec

# What an empty prompt starts from: the separator every training document ends with, so
# the model begins a new document.
START = DOC_SEPARATOR


class Tokenizer(Protocol):
    """What eval and generate need of a tokenizer (the data set's, or bytes)."""

    vocab_size: int
    eos_id: int  # ends every training document: an empty prompt starts from it

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """A byte is a token: the byte model's tokenizer (``decode`` replaces what is not
    UTF-8; ``diloco generate`` writes a byte model's raw bytes instead)."""

    vocab_size = 256
    eos_id = DOC_SEPARATOR[-1]

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def _place(params: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    """Host arrays -> float32 device arrays (one dtype, so one compilation)."""
    return {n: jnp.asarray(v, dtype=jnp.float32) for n, v in params.items()}


def pick_token(
    logits: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array
) -> jax.Array:
    """One byte from ``logits`` [vocab]: the argmax if ``temperature`` is 0, else a draw
    from ``softmax(logits / temperature)`` over the ``top_k`` largest (0: all). Ties with
    the k-th largest logit are kept, so a tie can let more than k through."""
    vocab = logits.shape[-1]
    k = jnp.where((top_k <= 0) | (top_k > vocab), vocab, top_k)
    kth = jnp.sort(logits)[::-1][k - 1]
    kept = jnp.where(logits >= kth, logits, -jnp.inf)
    drawn = jax.random.categorical(key, kept / jnp.maximum(temperature, 1e-6))
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits)).astype(jnp.int32)


def push(window: jax.Array, length: jax.Array, token: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Append ``token`` after the ``length`` bytes of ``window``; once it is full, drop
    the oldest byte first."""
    size = window.shape[0]
    window = jnp.where(length >= size, jnp.roll(window, -1), window)
    window = window.at[jnp.minimum(length, size - 1)].set(token)
    return window, jnp.minimum(length + 1, size)


class Sampler:
    """Samples bytes from a byte-level ``Transformer`` (see the module docstring)."""

    def __init__(self, codec: ParamCodec, context: int, chunk: int = 32):
        if chunk < 1:
            raise ValueError(f"chunk must be at least 1, got {chunk}")
        self.codec, self.context, self.chunk = codec, context, chunk
        self.traces = 0
        self._steps = jax.jit(self._steps_fn)

    def _steps_fn(self, params, window, length, key, start, count, temperature, top_k):
        self.traces += 1  # runs only while JAX traces

        def step(i, carry):
            window, length, out = carry
            model = self.codec.model(self.codec.from_flat(params))
            logits = model(window[None])[0, length - 1]
            token = pick_token(logits, jax.random.fold_in(key, start + i), temperature, top_k)
            window, length = push(window, length, token)
            return window, length, out.at[i].set(token)

        out = jnp.zeros(self.chunk, jnp.int32)
        return jax.lax.fori_loop(0, count, step, (window, length, out))

    def generate(
        self,
        params: Mapping[str, np.ndarray],
        prompt: bytes,
        max_bytes: int,
        temperature: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
    ) -> bytes:
        """``max_bytes`` bytes that follow ``prompt`` (its last ``context`` bytes are what
        the model sees; an empty prompt starts a new document). Temperature 0 is greedy.
        The same arguments give the same bytes."""
        seen = np.frombuffer(prompt or START, dtype=np.uint8)
        tokens = self.generate_ids(params, seen, max_bytes, temperature, top_k, seed)
        return np.asarray(tokens, np.int32).astype(np.uint8).tobytes()

    def generate_ids(
        self,
        params: Mapping[str, np.ndarray],
        prompt: Sequence[int] | np.ndarray,
        max_tokens: int,
        temperature: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
    ) -> list[int]:
        """``max_tokens`` token ids that follow ``prompt`` (at least one id; the last
        ``context`` are what the model sees)."""
        if max_tokens < 0:
            raise ValueError(f"--max-bytes must be at least 0, got {max_tokens}")
        if not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"--temperature must be a finite number >= 0, got {temperature}")
        if top_k < 0:
            raise ValueError(f"--top-k must be at least 0 (0: no limit), got {top_k}")
        seen = np.asarray(prompt, dtype=np.int32)[-self.context :]
        if not len(seen):
            raise ValueError("the prompt must hold at least one token")
        window = np.zeros(self.context, np.int32)
        window[: len(seen)] = seen
        state = (jnp.asarray(window), jnp.asarray(len(seen), jnp.int32))
        placed, key = _place(params), jax.random.key(seed)
        temp, k = jnp.asarray(temperature, jnp.float32), jnp.asarray(top_k, jnp.int32)
        chunks = []
        for start in range(0, max_tokens, self.chunk):
            count = min(self.chunk, max_tokens - start)
            *state, out = self._steps(placed, *state, key, jnp.asarray(start, jnp.int32),
                                      jnp.asarray(count, jnp.int32), temp, k)  # fmt: skip
            chunks.append(out)
        if not chunks:
            return []
        return np.concatenate([np.asarray(c) for c in chunks])[:max_tokens].tolist()

    def generate_text(
        self,
        params: Mapping[str, np.ndarray],
        tokenizer: Tokenizer,
        prompt: str,
        max_tokens: int,
        temperature: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
    ) -> str:
        """Text in, text out: ``max_tokens`` tokens after ``prompt`` (an empty prompt
        starts a new document, from ``tokenizer.eos_id``), decoded."""
        ids = tokenizer.encode(prompt) if prompt else [tokenizer.eos_id]
        return tokenizer.decode(self.generate_ids(params, ids, max_tokens, temperature,
                                                  top_k, seed))  # fmt: skip


@dataclass(frozen=True)
class TextScore:
    loss: float  # mean next-token cross-entropy, nats per token (a byte model's: per byte)
    bytes: int  # bytes predicted (every byte of the text but the first)
    tokens: int | None = None  # tokens predicted, for a model with a tokenizer (else bytes)

    @property
    def bits_per_byte(self) -> float:
        """Bits per byte of text: comparable across tokenizers."""
        per_byte = self.loss * (self.tokens or self.bytes) / max(self.bytes, 1)
        return per_byte / math.log(2)


def text_windows(tokens: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray]:
    """``tokens`` as windows of ``context + 1`` bytes overlapping by one, and per window
    the weights of its ``context`` targets (0 for the padding of the last window).
    Returns int32 ``[n, context + 1]`` and float32 ``[n, context]``."""
    starts = range(0, max(len(tokens) - 1, 0), context)
    windows = np.zeros((len(starts), context + 1), np.int32)
    weights = np.zeros((len(starts), context), np.float32)
    for i, s in enumerate(starts):
        piece = tokens[s : s + context + 1]
        windows[i, : len(piece)] = piece
        weights[i, : len(piece) - 1] = 1.0
    return windows, weights


class Scorer:
    """Cross-entropy of a byte model on a text (see the module docstring)."""

    def __init__(self, codec: ParamCodec, context: int, batch_size: int = 8):
        if batch_size < 1:
            raise ValueError(f"batch size must be at least 1, got {batch_size}")
        self.codec, self.context, self.batch_size = codec, context, batch_size
        self.traces = 0
        self._nll = jax.jit(self._nll_fn)

    def _nll_fn(self, params, windows, weights):
        self.traces += 1  # runs only while JAX traces
        logits = self.codec.model(self.codec.from_flat(params))(windows[:, :-1])
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:])
        return jnp.sum(nll * weights)

    def score(self, params: Mapping[str, np.ndarray], tokens: np.ndarray) -> TextScore:
        """Mean cross-entropy over every byte of ``tokens`` but the first."""
        if len(tokens) < 2:
            raise ValueError(f"need at least 2 bytes of text to score, got {len(tokens)}")
        windows, weights = text_windows(np.asarray(tokens), self.context)
        pad = -len(windows) % self.batch_size
        windows = np.concatenate([windows, np.zeros((pad, windows.shape[1]), np.int32)])
        weights = np.concatenate([weights, np.zeros((pad, weights.shape[1]), np.float32)])
        placed = _place(params)
        sums = [
            self._nll(placed, windows[i : i + self.batch_size], weights[i : i + self.batch_size])
            for i in range(0, len(windows), self.batch_size)
        ]
        total = float(np.sum(np.asarray(jax.device_get(sums), dtype=np.float64)))
        count = len(tokens) - 1
        return TextScore(total / count, count)

    def score_text(
        self, params: Mapping[str, np.ndarray], tokenizer: Tokenizer, text: str
    ) -> TextScore:
        """Mean cross-entropy per token of ``text`` under ``tokenizer``, with the bytes
        those tokens cover (every byte but the first token's), for bits per byte."""
        ids = tokenizer.encode(text)
        per_token = self.score(params, np.asarray(ids, np.int32))
        covered = len(text.encode()) - len(tokenizer.decode(ids[:1]).encode())
        return TextScore(per_token.loss, max(covered, 1), per_token.bytes)
