"""``notebooks/train_run.ipynb`` and ``storage_layout.report``, on a tiny run's buckets.

The run is the simulator through two ``file://`` regions: the same loops, the same
bucket layout and the same commit markers as ``diloco train`` (tests/test_loops.py
checks the two publish identical versions), in seconds. A slow learner and
``outer.max_staleness=0`` make some contributions too stale, so there are rejections to
report. The notebook runs headless in a kernel of this venv, and must load no JAX."""

from __future__ import annotations

import json
import shutil
import sys
from collections import Counter
from pathlib import Path

import nbformat
import pytest

from diloco.config import load_config
from diloco.simulate import simulate
from flows.run import simulation_store
from protocol.topology import run_slots
from storage_layout import report
from storage_layout.notebook import execute, inject
from storage_layout.store import RunStore

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "train_run.ipynb"
OVER = ["budget.tokens=40000", "sim.eval_points=2", "topology.quorum=2",
        "sim.speeds=[1,1,1,3]", "outer.max_staleness=0"]  # fmt: skip
TRAINING = ("jax", "jaxlib", "optax", "flax")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """(regions, the simulator's records) of run ``r`` in ``ROOT/us`` and ``ROOT/eu``."""
    root = tmp_path_factory.mktemp("nb")
    regions = {r: f"file://{root / r}" for r in ("us", "eu")}
    for r in regions:
        (root / r).mkdir()
    result = simulate(load_config("tiny", overrides=OVER), store=simulation_store("r", regions))
    return regions, result.metrics


def _key(m) -> tuple[int, str, int]:
    return (int(m["fragment"]), str(m["learner"]), int(m["seq"]))


def test_report_matches_what_the_run_recorded(tiny_run):
    """Versions, contributions, outcomes, rejections and traffic read back from the
    buckets are the simulator's own records."""
    regions, metrics = tiny_run
    r = report.load(regions["us"])  # the spec names the other region
    assert r["run"] == "r" and r["regions"] == regions and r["problems"] == []
    assert r["clock"] == "simulated" and r["fragments"] == 2 and len(r["learners"]) == 4

    version_records = [m for m in metrics if m["event"] == "version"]
    got = {(v["fragment"], v["version"]): v for v in r["versions"]}
    assert len(got) == len(version_records) + 2  # and version 0 of each fragment
    for m in version_records:
        v = got[(m["fragment"], m["version"])]
        assert (v["consumed"], v["weights"], v["tokens_total"]) == (
            m["consumed"], m["weights"], m["tokens_total"])  # fmt: skip
        assert v["t"] == pytest.approx(m["time"])

    sent = {_key(m): m for m in metrics if m["event"] == "sent"}
    rows = {_key(c): c for c in r["contributions"]}
    assert rows.keys() == sent.keys()
    for key, c in rows.items():
        assert (c["base_version"], c["step"], c["tokens"], c["seconds"]) == (
            sent[key]["base_version"], sent[key]["step"], sent[key]["tokens"],
            sent[key]["seconds"])  # fmt: skip
    outcomes = Counter(c["outcome"] for c in rows.values())
    consumed = sum(len(m["consumed"]) for m in version_records)
    assert outcomes["merged"] == consumed > 10 and outcomes["lost"] == 0
    merged = [c for c in rows.values() if c["outcome"] == "merged"]
    assert all(c["weight"] > 0 and c["staleness"] is not None for c in merged)

    rejected = {_key(m): m["reason"] for m in metrics if m["event"] == "rejected"}
    assert len(rejected) >= 1
    assert {_key(x): x["reason"] for x in r["rejections"]} == rejected
    assert {k for k, c in rows.items() if c["outcome"] == "rejected"} == rejected.keys()
    assert r["rejection_reasons"] == {"staleness exceeds the maximum": len(rejected)}
    per = {row["learner"]: row for row in r["per_learner"]}
    assert per["learner-3"]["rejected"] == len(rejected)  # the slow one
    assert sum(row["sent"] for row in per.values()) == len(sent)

    simulator = RunStore("r", regions, "us").progress.read_metrics("simulator")
    assert r["traffic"] == dict(sorted(simulator["traffic"].items(),
                                       key=lambda kv: -kv[1]["bytes"]))  # fmt: skip
    assert r["traffic"]["eu->us"]["bytes"] > 0  # the syncer read eu's learners
    summary = r["summary"]  # the simulator's, from its status object
    assert summary["tokens"] >= 40000 and summary["source"] == f"{regions['us']}/r/metrics"
    assert r["learner_statuses"] == []  # the simulator writes none


@pytest.fixture(scope="module")
def with_status(tiny_run, tmp_path_factory):
    """A copy of the run laid out as ``diloco train`` leaves a local one
    (``runs/r/buckets/REGION``, ``runs/r/summary.json``), to which each learner, through
    its own store, adds what the pipeline's learners write and the simulator does not: a
    status object and three rounds of history. Returns (region -> copy, runs/r)."""
    regions, _ = tiny_run
    root = tmp_path_factory.mktemp("train") / "runs" / "r"
    copy = {}
    for region, url in regions.items():
        shutil.copytree(url.removeprefix("file://"), root / "buckets" / region)
        copy[region] = str(root / "buckets" / region)
    spec = RunStore("r", copy, "us").read_spec()
    for lid, region in run_slots(spec).items():
        store = RunStore("r", {region: copy[region]}, region, writer=lid)
        store.read_spec()  # a real request: counted as traffic inside the region
        store.progress.write_metrics(lid, {"state": "done", "step": 20, "total_steps": 20,
                                  "tokens": 10240, "region": region},
                            totals={"startup_seconds": 1.5, "train_seconds": 4.0})  # fmt: skip
        for n in (1, 2, 3):
            assert store.progress.put_round(lid, n, {"step": 7 * n, "steps": 7, "loss": 5.0 - n,
                                            "tokens_per_s": 500.0, "staleness": 1,
                                            "merge_weight": 0.25, "bytes_up": 1000,
                                            "bytes_down": 2000, "time": 1.0e9 + n})  # fmt: skip
    curve = [{"tokens": 0, "loss": 5.5, "seconds": 1.0}, {"tokens": 40960, "loss": 3.6,
                                                          "seconds": 9.0}]  # fmt: skip
    (root / "summary.json").write_text(json.dumps({"run": "r", "curve": curve}))
    return copy, root


def test_report_reads_status_objects_rounds_copies_and_summary_json(with_status):
    """Learners' status objects and their traffic, their rounds, a copy of the buckets
    read where it is given (REGION=URL), and the summary.json next to local buckets."""
    copy, root = with_status
    r = report.load([f"eu={copy['eu']}", f"us={copy['us']}"], run="r")
    assert r["regions"] == copy and r["problems"] == []  # the copies, not the spec's URLs
    statuses = {s["learner"]: s for s in r["learner_statuses"]}
    assert sorted(statuses) == [f"learner-{i}" for i in range(4)]
    assert (statuses["learner-1"]["state"], statuses["learner-1"]["region"]) == ("done", "eu")
    assert statuses["learner-1"]["train_seconds"] == 4.0
    assert statuses["learner-1"]["bytes_down"] > 0
    simulator = RunStore("r", copy, "us").progress.read_metrics("simulator")["traffic"]
    assert r["traffic"]["eu->eu"]["bytes"] > simulator["eu->eu"]["bytes"]
    assert [x["loss"] for x in r["rounds"]["learner-2"]] == [4.0, 3.0, 2.0]
    assert r["summary"]["source"] == str(root / "summary.json")

    with pytest.raises(ValueError, match="not one of run 'r'"):
        report.load(copy["us"])  # a copy given without its region
    with pytest.raises(ValueError, match="no region 'ap'"):
        report.load([f"ap={copy['us']}"], run="r")


def test_a_report_on_a_spec_whose_slot_count_is_damaged_names_it_and_goes_on(tiny_run, tmp_path):
    """A spec counts the slots a run starts with (``topology.learners``); a damaged count
    gives no slots: the report names that and shows what else it reads."""
    regions, _ = tiny_run
    copy = {r: tmp_path / r for r in regions}
    for region, url in regions.items():
        shutil.copytree(url.removeprefix("file://"), copy[region])
        spec_file = copy[region] / "r" / "spec.json"
        spec = json.loads(spec_file.read_text())
        spec["config"]["topology"]["learners"] = 0
        spec_file.chmod(0o644)
        spec_file.write_text(json.dumps(spec))
    r = report.load([f"{region}={path}" for region, path in copy.items()], run="r")
    assert r["learners"] == {} and r["fragments"] == 2 and r["versions"], r["problems"]
    assert r["problems"] == ["cannot read the run's learner slots: the run spec's "
                             "config.topology.learners 0 and deal ['us', 'eu'] give the run "
                             "no learner slots"]  # fmt: skip


def test_parameters_are_injected_after_the_parameters_cell():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    tags = [c.metadata.get("tags", []) for c in nb.cells]
    at = tags.index(["parameters"])
    inject(nb, {"run": "r", "buckets": ["us=file:///x"]})
    inject(nb, {"run": "s"})  # a second injection replaces the first
    assert nb.cells[at + 1].metadata["tags"] == ["injected-parameters"]
    assert nb.cells[at + 1].source == "# Injected parameters\nrun = 's'\n"
    assert sum("injected-parameters" in c.metadata.get("tags", []) for c in nb.cells) == 1


def _outputs(nb, kind: str) -> list:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == kind or kind in o.get("data", {})]  # fmt: skip


def _run_notebook(parameters: dict, cwd: Path):
    """The notebook executed with ``parameters``, after a check that it ran in this venv
    and loaded no training code; returns (notebook, its markdown tables as one text)."""
    import matplotlib.font_manager  # noqa: F401  a first import builds the font cache, and
    # says so on stderr when that is slow: here, not in the kernel's cells

    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(
        "import json, sys\n"
        f"print(json.dumps({{'prefix': sys.prefix, 'loaded': sorted(m for m in sys.modules "
        f"if m.split('.')[0] in {TRAINING!r})}}))"
    ))  # fmt: skip
    execute(nb, parameters, cwd=cwd, timeout=300)
    assert _outputs(nb, "error") == []
    streams = _outputs(nb, "stream")
    assert [s.text for s in streams if s.name == "stderr"] == []  # no warnings
    kernel = json.loads(streams[-1].text)
    assert kernel == {"prefix": sys.prefix, "loaded": []}  # this venv, no training code
    assert "training code loaded: none" in streams[-2].text
    return nb, "\n".join(o.data["text/markdown"] for o in _outputs(nb, "text/markdown"))


def test_the_notebook_runs_headless_on_the_run_without_training_code(tiny_run, tmp_path):
    regions, metrics = tiny_run
    # What `diloco simulate --out DIR` writes next to the buckets: its validation curve.
    jsonl = tmp_path / "out" / "metrics.jsonl"
    jsonl.parent.mkdir()
    jsonl.write_text("".join(json.dumps(m, sort_keys=True) + "\n" for m in metrics))
    parameters = {
        "buckets": regions["us"],
        "run": "r",
        "metrics_jsonl": "out/metrics.jsonl",
    }  # relative to the kernel's folder
    nb, tables = _run_notebook(parameters, tmp_path)

    # versions, weights and staleness, learners, bytes per region pair, validation loss
    assert len(_outputs(nb, "image/png")) == 5
    assert "| run | r |" in tables and "| problems | none |" in tables
    for lid in ("learner-0", "learner-1", "learner-2", "learner-3"):
        assert f"| {lid} | " in tables
    for pair in ("| us->us |", "| eu->us |", "| cross-region |"):
        assert pair in tables
    rejected = [m for m in metrics if m["event"] == "rejected"]
    assert f"| staleness exceeds the maximum | {len(rejected)} |" in tables
    assert all(m["reason"] in tables for m in rejected)
    assert "No learner status objects" in tables  # a simulator run writes none
    assert "per-round learner history is not available" in tables
    assert "| embed.embedding | (256, 64) | float32 |" in tables  # the newest version


def test_the_notebook_shows_status_objects_rounds_and_the_loss_curve(with_status, tmp_path):
    copy, _ = with_status
    parameters = {"buckets": [f"{r}={path}" for r, path in copy.items()], "run": "r"}
    nb, tables = _run_notebook(parameters, tmp_path)
    # the five above, with the summary's curve, and the learners' loss per round
    assert len(_outputs(nb, "image/png")) == 6
    assert "| learner-1 | eu | done | 20 | 20 | 10,240 | 1.5 | 4 |" in tables
    assert "not available" not in tables and "No learner status objects" not in tables
