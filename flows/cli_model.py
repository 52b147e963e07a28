"""``diloco export``, ``eval`` and ``generate``: a run's global model, read from its
buckets or from an exported file (``flows.model_io``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from flows.cli_args import bucket_url, count
from flows.observe import human_bytes
from flows.train import console, stdout_console


def _model_source(parser: argparse.ArgumentParser, file_too: bool) -> None:
    """The global model's arguments: a bucket URL, ``--run`` and ``--version`` (and, for
    ``eval`` and ``generate``, ``--model FILE``, an export, instead)."""
    parser.add_argument("url", nargs=None if not file_too else "?", metavar="URL",
                        help="a bucket of the run (any region; the syncers' home holds the "
                        "fp32 master copy, the others the wire copy)")  # fmt: skip
    parser.add_argument("--run", required=not file_too, help="the run")
    parser.add_argument("--version", metavar="V|V0,V1,...",
                        help="global version of every fragment, or one per fragment "
                        "(default: the newest of each)")  # fmt: skip
    if file_too:
        parser.add_argument("--model", metavar="FILE",
                            help="a file (a Llama: the folder) `diloco export` wrote, instead "
                            "of URL and --run")  # fmt: skip


def add_model_parsers(sub: argparse._SubParsersAction) -> None:
    """``diloco export``, ``diloco eval`` and ``diloco generate``: use a run's model."""
    ex = sub.add_parser("export", help="write a run's global model to a safetensors file "
                        "(a Llama: a Hugging Face Llama folder for transformers)")  # fmt: skip
    _model_source(ex, file_too=False)
    ex.add_argument("--out", required=True, metavar="FILE|FOLDER",
                    help="the file to write (a Llama: the folder)")  # fmt: skip
    ex.set_defaults(func=cmd_export)
    ev = sub.add_parser("eval", help="validation loss and bits per byte of a run's model")
    _model_source(ev, file_too=True)
    ev.add_argument("--data", metavar="PATH",
                    help="a text file, a folder of text files or an fsspec URL (default: the "
                    "run's validation batches, as the launcher evaluates)")  # fmt: skip
    ev.add_argument("--max-bytes", type=count, default=1_000_000,
                    help="evaluate on at most this many bytes of --data (default 1e6)")  # fmt: skip
    ev.add_argument("--batch-size", type=int, help="windows per batch (default the run's)")
    ev.add_argument("--json", action="store_true", help="machine-readable output")
    ev.set_defaults(func=cmd_eval)
    gen = sub.add_parser("generate", help="sample bytes from a run's model")
    _model_source(gen, file_too=True)
    gen.add_argument("--prompt", default="", help="text the sample continues (default: none)")
    gen.add_argument("--max-bytes", "--max-tokens", type=count, default=256,
                     help="bytes (a model with a tokenizer: tokens) to sample (default 256)")  # fmt: skip
    gen.add_argument("--temperature", type=float, default=1.0,
                     help="softmax temperature; 0 is greedy (default 1)")  # fmt: skip
    gen.add_argument("--top-k", type=int, default=0,
                     help="sample among the k likeliest bytes (default 0: all)")  # fmt: skip
    gen.add_argument("--seed", type=int, default=0, help="same seed, same sample (default 0)")
    gen.set_defaults(func=cmd_generate)


def _open_model(args: argparse.Namespace) -> Any:
    from flows.model_export import open_model

    url = None if args.url is None else bucket_url(args.url)
    return open_model(url, args.run, getattr(args, "model", None), args.version)


def cmd_export(args: argparse.Namespace) -> int:
    from diloco.archs import ARCHS
    from flows.model_export import export_model

    model = _open_model(args)
    size = export_model(model, args.out)
    family = ARCHS[model.config.arch].hugging_face
    layout = f" (a Hugging Face {family} folder)" if family else ""
    stdout_console().print(
        f"exported {model.label}: {model.codec.num_params:,} parameters, "
        f"{human_bytes(size)} -> {args.out}{layout}"
    )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from flows.model_io import evaluate

    model = _open_model(args)
    score, what = evaluate(model, args.data, args.max_bytes, args.batch_size)
    if args.json:
        print(json.dumps({"model": model.source, "versions": model.versions,
                          "params_dtype": model.dtype, "data": what, "bytes": score.bytes,
                          "tokens": score.tokens or score.bytes, "loss": score.loss,
                          "bits_per_byte": score.bits_per_byte}))  # fmt: skip
        return 0
    out = stdout_console()
    unit = "token" if model.tokenizer is not None else "byte"
    out.print(f"model: {model.label}")
    count = (f"{score.tokens:,} tokens, {score.bytes:,} bytes" if score.tokens
             else f"{score.bytes:,} {unit}s")  # fmt: skip
    out.print(f"data:  {what} ({count} predicted)")
    out.print(f"validation loss {score.loss:.4f} nats/{unit}, {score.bits_per_byte:.4f} bits/byte")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from diloco.sample import Sampler

    model = _open_model(args)
    console.print(f"model: {model.label}")
    sampler = Sampler(model.codec, model.config.context)
    if model.tokenizer is not None:  # text in, text out; --max-bytes counts tokens
        text = sampler.generate_text(model.params, model.tokenizer, args.prompt,
                                     args.max_bytes, args.temperature, args.top_k,
                                     args.seed).encode()  # fmt: skip
    else:  # the byte model: its raw bytes
        text = sampler.generate(model.params, args.prompt.encode(), args.max_bytes,
                                args.temperature, args.top_k, args.seed)  # fmt: skip
    sys.stdout.buffer.write(text)
    if sys.stdout.isatty() and not text.endswith(b"\n"):
        sys.stdout.buffer.write(b"\n")
    sys.stdout.buffer.flush()
    return 0
