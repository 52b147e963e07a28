"""The named presets (``--preset``): config fields over the defaults."""

from __future__ import annotations

from typing import Any

# Presets: model size and a token budget that suits it. Everything else keeps its default.
PRESETS: dict[str, dict[str, Any]] = {
    # < 1 M parameters: tests, CI and the README's quick start (seconds on 2 CPU cores).
    "tiny": {
        "model": {"width": 64, "depth": 2, "heads": 4, "context": 64},
        "data": {"batch_size": 8, "eval_batches": 4},
        "inner": {"warmup_steps": 10},
        "topology": {"inner_steps": 10},
        "budget": {"tokens": 160_000},
        "sim": {"eval_points": 5},
    },
    # ~2 M parameters: the benchmark default on CPU.
    "small": {
        "model": {"width": 192, "depth": 4, "heads": 6, "context": 128},
        "data": {"batch_size": 8, "eval_batches": 16},
        "topology": {"inner_steps": 40, "fragments": 4},
        "budget": {"tokens": 1_200_000},
        "sim": {"eval_points": 12},
    },
    # GPU-sized presets, for long runs: hundreds of outer steps per fragment, where outer
    # Nesterov momentum beats the plain averaging that wins short runs
    # (bench/quality/results.md, "At a budget where dp flattens").
    "base": {
        "model": {"width": 512, "depth": 8, "heads": 8, "context": 512},
        "data": {"batch_size": 32},
        "outer": {"lr": 0.9, "momentum": 0.5},
        "topology": {"inner_steps": 100, "fragments": 4},
        "budget": {"tokens": 500_000_000},
    },
    "large": {
        "model": {"width": 1024, "depth": 16, "heads": 16, "context": 1024},
        "data": {"batch_size": 32},
        "outer": {"lr": 0.9, "momentum": 0.5},
        "topology": {"inner_steps": 250, "fragments": 8},
        "budget": {"tokens": 5_000_000_000},
    },
    # Llama-class decoders (diloco/llama.py) over subword tokens. llama-tiny trains in
    # minutes on 2 CPU cores; its vocabulary is `diloco data prepare`'s default (4096).
    "llama-tiny": {
        "model": {
            "arch": "llama",
            "vocab_size": 4096,
            "width": 128,
            "depth": 4,
            "heads": 4,
            "kv_heads": 2,
            "hidden": 352,
            "context": 128,
        },
        "data": {"batch_size": 8, "eval_batches": 8},
        "inner": {"warmup_steps": 20},
        "topology": {"inner_steps": 20, "fragments": 2},
        "budget": {"tokens": 2_000_000},
        "sim": {"eval_points": 8},
    },
    # GPU presets: bf16 compute, fp32 master weights; about 20 tokens per parameter.
    "llama-150m": {
        "model": {
            "arch": "llama",
            "vocab_size": 32768,
            "width": 1024,
            "depth": 12,
            "heads": 16,
            "kv_heads": 4,
            "hidden": 2560,
            "context": 2048,
            "compute_dtype": "bfloat16",
        },
        "data": {"batch_size": 16},
        "inner": {"lr": 1e-3, "warmup_steps": 500},
        "outer": {"lr": 0.9, "momentum": 0.5},
        "topology": {"inner_steps": 100, "fragments": 4},
        "budget": {"tokens": 3_000_000_000},
    },
    # Llama-3.2-1B's shapes (1.24 B parameters, tied head), trained at context 2048.
    "llama-1b": {
        "model": {
            "arch": "llama",
            "vocab_size": 128256,
            "width": 2048,
            "depth": 16,
            "heads": 32,
            "kv_heads": 8,
            "hidden": 8192,
            "context": 2048,
            "rope_theta": 500000.0,
            "compute_dtype": "bfloat16",
            "remat": True,
        },
        "data": {"batch_size": 8},
        "inner": {"lr": 4e-4, "warmup_steps": 1000},
        "outer": {"lr": 0.9, "momentum": 0.5},
        "topology": {"inner_steps": 250, "fragments": 8},
        "budget": {"tokens": 25_000_000_000},
    },
    # Llama-3-8B's shapes (8.0 B parameters, untied head): shard it over a learner's
    # devices (`diloco plan memory --preset llama-8b --devices 8`).
    "llama-8b": {
        "model": {
            "arch": "llama",
            "vocab_size": 128256,
            "width": 4096,
            "depth": 32,
            "heads": 32,
            "kv_heads": 8,
            "hidden": 14336,
            "context": 2048,
            "rope_theta": 500000.0,
            "compute_dtype": "bfloat16",
            "remat": True,
            "tie_embeddings": False,
        },
        "data": {"batch_size": 8},
        "inner": {"lr": 3e-4, "warmup_steps": 2000},
        "outer": {"lr": 0.9, "momentum": 0.5},
        "topology": {"inner_steps": 500, "fragments": 16},
        "budget": {"tokens": 160_000_000_000},
    },
}
