"""Storage benchmark: the commit protocol against raw fsspec, and multi-region publish.

    python bench/storage/run.py [--sizes 16 128] [--repeats 3]

For a float32 fragment of each size, on the local filesystem and on S3 (moto's server on
loopback), in the same run:
- write-and-commit (Zarr encode, sha256 of every object, upload, exclusive marker) vs a
  raw ``fs.pipe_file`` of the same bytes;
- read-and-verify (marker, fetch, size + sha256 check, Zarr decode) vs a raw ``fs.cat_file``.
Then the time to publish one 16 MB global version to 1, 2 and 4 regions (S3 buckets).
Writes ``results.md`` beside this file. Target: protocol throughput >= 0.8 x raw.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from machine import machine

from infra.local_servers import LocalS3
from protocol.quantize import quantize
from storage_layout.bucket import Bucket
from storage_layout.codec import decode, encode
from storage_layout.commit import commit_version, read_version
from storage_layout.store import RunStore


def best(fn, repeats: int) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def new_bucket(backend: str, tmp: Path) -> str:
    name = f"bench-{uuid.uuid4().hex[:10]}"
    if backend == "file":
        (tmp / name).mkdir()
        return f"file://{tmp / name}"
    import fsspec

    fsspec.filesystem("s3").mkdir(name)
    return f"s3://{name}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 128], help="MB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = parser.parse_args()
    server = LocalS3().start()
    tmp = Path(tempfile.mkdtemp(prefix="bench-storage-"))
    rng = np.random.default_rng(0)
    rows = []
    for backend in ("file", "s3"):
        for mb in args.sizes:
            values = rng.normal(size=mb * (1 << 20) // 4).astype(np.float32)
            raw = values.tobytes()
            bucket = Bucket(new_bucket(backend, tmp), region="bench")
            if backend == "file":
                bucket.fs.makedirs(bucket.path("raw"), exist_ok=True)
            counter = iter(range(1, 10**6))

            def commit(bucket=bucket, values=values, counter=counter):
                n = next(counter)
                objects = encode({"params": {"w": quantize(values, "fp32")}}, {"kind": "global"})
                commit_version(
                    bucket, f"commits/v{n:012d}.json", f"data/v{n}", objects, "global", {}, "bench"
                )

            def raw_write(bucket=bucket, raw=raw):
                bucket.fs.pipe_file(bucket.path(f"raw/{uuid.uuid4().hex}"), raw)

            t_commit = best(commit, args.repeats)
            t_raw_w = best(raw_write, args.repeats)
            bucket.fs.pipe_file(bucket.path("raw/fixed"), raw)

            def read_verify(bucket=bucket, raw=raw):
                _, objects = read_version(bucket, "commits/v000000000001.json")
                groups, _ = decode(objects)
                assert groups["params"]["w"].data.nbytes == len(raw)

            def raw_read(bucket=bucket, raw=raw):
                assert len(bucket.fs.cat_file(bucket.path("raw/fixed"))) == len(raw)

            t_read = best(read_verify, args.repeats)
            t_raw_r = best(raw_read, args.repeats)
            rows.append((backend, mb, mb / t_commit, mb / t_raw_w, mb / t_read, mb / t_raw_r))
            print(rows[-1], flush=True)

    publish_rows = []
    values = {"w": rng.normal(size=4 * (1 << 20)).astype(np.float32)}  # 16 MB
    for n in (1, 2, 4):
        regions = {f"r{i}": new_bucket("s3", tmp) for i in range(n)}
        store = RunStore("bench", regions, "r0", writer="bench")
        version = iter(range(1, 10**6))
        t = best(
            lambda store=store, version=version: store.versions.publish_global(
                0, next(version), values, [], {}
            ),
            args.repeats,
        )
        publish_rows.append((n, t))
        print(n, t, flush=True)
    server.stop()

    lines = [
        "# bench/storage results",
        "",
        f"Command: `python bench/storage/run.py {' '.join(sys.argv[1:])}`".rstrip(),
        f"Machine: {machine()}; S3 is moto's server on loopback (in the same process).",
        f"Median of {args.repeats} runs after a warm-up; MB = 2^20 bytes of float32 values.",
        "",
        "| backend | fragment | write+commit MB/s | raw write MB/s | ratio | read+verify MB/s | raw read MB/s | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for backend, mb, wc, ww, rv, rr in rows:
        lines.append(
            f"| {backend} | {mb} MB | {wc:.0f} | {ww:.0f} | {wc / ww:.2f} | {rv:.0f} | {rr:.0f} | {rv / rr:.2f} |"
        )
    lines += [
        "",
        "Publishing one 16 MB global version (params fp32 + wire fp32, no momentum) to N regions (S3 buckets):",
        "",
        "| regions | seconds | per region |",
        "|---|---|---|",
    ]
    lines += [f"| {n} | {t:.2f} | {t / n:.2f} |" for n, t in publish_rows]
    lines.append("")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
