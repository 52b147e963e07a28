"""A non-IID corpus for the simulator: each of 4 learners reads one kind of text of its own.

    python bench/quality/noniid.py OUT_DIR [--kb 400]

Kinds, all on the machine: Python (the standard library), C headers (``/usr/include``),
Perl modules (``/usr/share/perl``) and Markdown (``/usr/share/doc``, the Rust docs). Each
kind's text is cut into files of 20 kB; their names are chosen so that the loader
(``diloco.data.load_corpus``: files sorted, dealt round-robin, a hash of the path holding
some out) deals every training file of kind ``k`` to learner ``k`` and holds out an equal
share of each kind for validation. Prints the folder, for ``--common data.source=...``.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from diloco.data import is_held_out

KINDS = {
    "a": (Path(sysconfig.get_paths()["stdlib"]), "*.py"),
    "b": (Path("/usr/include"), "*.h"),
    "c": (Path("/usr/share/perl"), "*.pm"),
    "d": (Path("/usr/share/doc"), "*.md"),
}
FILE_BYTES = 20_000
VAL_FILES = 2  # per kind
VAL_PERCENT = 5  # data.val_percent's default


def _text(root: Path, pattern: str, size: int) -> bytes:
    out, total = [], 0
    for path in sorted(root.rglob(pattern)):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        out.append(data)
        total += len(data)
        if total >= size:
            break
    return b"".join(out)[:size]


def _name(prefix: str, held_out: bool) -> str:
    """``prefix-N.txt`` with the smallest N whose hash holds it out (or not) as asked."""
    n = 0
    while is_held_out(f"{prefix}-{n}.txt", VAL_PERCENT) != held_out:
        n += 1
    return f"{prefix}-{n}.txt"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--kb", type=int, default=400, help="training text per kind, kB")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    files = args.kb * 1000 // FILE_BYTES
    for kind, (root, pattern) in KINDS.items():
        text = _text(root, pattern, (files + VAL_FILES) * FILE_BYTES)
        if len(text) < (files + VAL_FILES) * FILE_BYTES:
            raise SystemExit(f"too little {pattern} text under {root}: {len(text)} bytes")
        for i in range(files + VAL_FILES):
            chunk = text[i * FILE_BYTES:(i + 1) * FILE_BYTES]  # fmt: skip
            # "t0003b" sorts between "t0003a" and "t0003c": training file i of each kind
            # takes index 4 i + k among the training files, so learner k gets kind k.
            name = (_name(f"t{i:04d}{kind}", False) if i < files
                    else _name(f"v{i:04d}{kind}", True))  # fmt: skip
            (args.out / name).write_bytes(chunk)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
