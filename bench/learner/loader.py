"""Data loader throughput and memory against data set size (issue 29, bench/learner).

Synthesizes token data sets of 10 MB, 100 MB and 1 GB (random uint16 tokens, the
format of ``diloco data prepare``, on ``file://``), then, in a fresh process for each,
serves the same number of batches from a learner's ``TokenReader`` (chunks read by
ranged reads, checked against their sha256, prefetched by a thread) and records tokens
per second and the process's peak RSS above what it held before reading. Flat memory is
the point: the reader holds a few chunks, never the data set.

    .venv/bin/python bench/learner/loader.py [--sizes-mb 10 100 1000] [--batches 2000]
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.machine import machine  # noqa: E402
from diloco import dataset  # noqa: E402
from diloco.prepare import write_dataset  # noqa: E402
from diloco.tokenizer import HFTokenizer  # noqa: E402


def synthesize(out: Path, megabytes: int, vocab: int = 4096) -> str:
    """A data set of ``megabytes`` MB of uint16 tokens, written as it is drawn."""
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.BPE(vocab={f"t{i}": i for i in range(vocab)}, merges=[]))
    tok.add_special_tokens(["<|endoftext|>"])
    data = tok.to_str().encode()
    rng = np.random.default_rng(0)
    doc = 50_000  # tokens a document
    docs = (("train", rng.integers(0, vocab, doc)) for _ in range(megabytes * 10**6 // 2 // doc))
    val = [("validation", rng.integers(0, vocab, doc))]
    write_dataset(str(out), HFTokenizer(data), data, itertools.chain(docs, val))
    return str(out)


def _status_mb(field: str) -> float:
    """A field of /proc/self/status (VmRSS, VmHWM: the peak since exec or reset), in MB.
    Not getrusage: Linux carries ru_maxrss over exec, so a child would report its
    parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def measure(url: str, batches: int, batch_size: int, context: int, learners: int) -> dict:
    """One learner's reader: ``batches`` batches, tokens/s and peak RSS growth (MB)."""
    ds = dataset.open_dataset(url)
    reader = dataset.TokenReader(ds, 0, learners, batch_size, context, seed=0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)
    before = _status_mb("VmRSS")
    reader.next_batch()  # the first group's read: start-up, not throughput
    start = time.perf_counter()
    for _ in range(batches):
        reader.next_batch()
    seconds = time.perf_counter() - start
    peak = _status_mb("VmHWM")
    reader.close()
    return {
        "tokens_per_s": batches * batch_size * context / seconds,
        "rss_before_mb": before,
        "rss_peak_mb": peak,
        "rss_growth_mb": peak - before,
        "epoch_windows": reader.epoch_windows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--learners", type=int, default=1)
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # a child: one data set
    args = parser.parse_args()
    if args.measure:
        out = measure(args.measure, args.batches, args.batch_size, args.context, args.learners)
        print(json.dumps(out))
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="loader-bench-") as tmp:
        for mb in args.sizes_mb:
            url = synthesize(Path(tmp) / f"d{mb}", mb)
            child = [sys.executable, __file__, "--measure", url, "--batches", str(args.batches),
                     "--batch-size", str(args.batch_size), "--context", str(args.context),
                     "--learners", str(args.learners)]  # fmt: skip
            result = json.loads(subprocess.run(child, check=True, capture_output=True).stdout)
            rows.append({"data_mb": mb, **result})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{machine()}; batch {args.batch_size} x context {args.context}, "
          f"{args.batches} batches, {args.learners} learner(s)\n")  # fmt: skip
    print("| data set | tokens/s | peak RSS | RSS growth while reading |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['data_mb']:,} MB | {r['tokens_per_s'] / 1e6:.1f} M | "
              f"{r['rss_peak_mb']:.0f} MB | {r['rss_growth_mb']:.1f} MB |")  # fmt: skip
    Path(__file__).with_name("loader.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
