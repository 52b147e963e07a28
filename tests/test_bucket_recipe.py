"""The recipe in docs/storage-layout.md ("Reading the newest global model without this
code") runs as written, with zarr, fsspec and numpy only, on a bucket this project
wrote, and reads what the project reads."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from storage_layout.store import RunStore

DOC = Path(__file__).resolve().parents[1] / "docs" / "storage-layout.md"
PLACEHOLDER = 'url, run = "file:///data/us", "r1"'
PROJECT = ("diloco", "storage_layout", "flows", "infra")

# Run before the recipe: the project's packages cannot be imported (the virtualenv's
# editable install would otherwise find them from any folder).
PREAMBLE = f"""
import sys

class _NoProject:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {PROJECT!r}:
            raise ImportError(f"the recipe must not need {{name}}")

sys.meta_path.insert(0, _NoProject())
"""
EPILOGUE = f"""
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {PROJECT!r})
assert not loaded, loaded
np.savez(sys.argv[1], **model)
"""


def recipe() -> str:
    text = DOC.read_text()
    section = text.split("### Reading the newest global model without this code", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block and PLACEHOLDER in block.group(1), "the recipe or its placeholder moved"
    return block.group(1)


def test_the_docs_recipe_reads_the_newest_globals_without_the_project(tmp_path):
    url = f"file://{tmp_path / 'bucket'}"
    (tmp_path / "bucket").mkdir()
    store = RunStore("r1", {"us": url}, "us", writer="syncer")
    store.ensure_spec({"fragments": [["a.w", "a.b"], ["c"]], "regions": {"us": url}})
    rng = np.random.default_rng(0)
    shapes = [{"a.w": (5, 3), "a.b": (3,)}, {"c": (7,)}]
    for version in (0, 1):
        for p, tensors in enumerate(shapes):
            params = {n: rng.normal(size=s).astype(np.float32) for n, s in tensors.items()}
            store.versions.publish_global(p, version, params, [], {}, "bf16")
    store.versions.publish_global(1, 2, {"c": np.arange(7, dtype=np.float32)}, [], {}, "bf16")
    expected = {}
    for p in range(len(shapes)):
        expected.update(
            store.versions.get_global(p, store.versions.latest_global(p), learner_view=True).params
        )

    script = tmp_path / "outside" / "recipe.py"
    script.parent.mkdir()
    code = recipe().replace(PLACEHOLDER, f"url, run = {url!r}, 'r1'")
    script.write_text(PREAMBLE + code + EPILOGUE)
    out = tmp_path / "model.npz"
    done = subprocess.run(
        [sys.executable, "-I", str(script), str(out)],
        cwd=script.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, textwrap.shorten(done.stderr, 3000)
    with np.load(out) as got:
        assert sorted(got.files) == sorted(expected)
        for name, value in expected.items():
            assert got[name].dtype == np.float32
            np.testing.assert_array_equal(got[name], value)
    assert np.array_equal(expected["c"], np.arange(7, dtype=np.float32))  # fragment 1's v2
