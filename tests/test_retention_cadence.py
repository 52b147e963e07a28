"""A syncer shard runs retention on a cadence of its own (``pipeline.retention_seconds``):
at most once per that many seconds, after a publish, whatever ``keep_versions`` is; not
after every publish (each pass lists every learner's markers), and not never."""

from __future__ import annotations

import logging

import numpy as np

from diloco.config import RunConfig
from diloco.syncer import GlobalVersion
from flows.bucket_io import BucketStore
from flows.syncer_transport import PipelineSyncerTransport
from storage_layout.store import RunStore

SHAPES = {"w": (8, 16), "b": (16,)}


def _params(version: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(version)
    return {n: rng.normal(0, 0.05, s).astype(np.float32) for n, s in SHAPES.items()}


def test_retention_runs_once_per_its_cadence_after_a_publish(tmp_path):
    regions = {"us": f"file://{tmp_path}/us", "eu": f"file://{tmp_path}/eu"}
    for region in regions:
        (tmp_path / region).mkdir()
    main = RunStore("run", regions, "us", writer="syncer")
    main.ensure_spec({"learners": {"learner-0": "eu"}, "fragments": [list(SHAPES)]})
    main.versions.publish_global(0, 0, _params(0), [], {"weights": {}}, "bf16")
    store = BucketStore("run", regions, "us", {"learner-0": "eu"}, "bf16", "syncer")
    now = [0.0]
    transport = PipelineSyncerTransport(
        store, [0], keep_versions=2, window=0, log=logging.getLogger("test"),
        retention_seconds=30.0, clock=lambda: now[0],
    )  # fmt: skip

    def publish(version: int) -> None:
        gv = GlobalVersion(0, version, _params(version), None, (), {}, {}, {}, 0, 0.0)
        assert transport.publish(gv, [], {"weights": {}})
        transport.tend()  # what the loop does after every look

    for version in range(1, 6):  # five publishes within the cadence: no pass
        now[0] += 5.0
        publish(version)
    assert transport.retention_passes == 0
    assert main.versions.global_versions(0) == [0, 1, 2, 3, 4, 5]
    now[0] = 30.0
    publish(6)  # the cadence is up: one pass, the versions past keep_versions go
    assert transport.retention_passes == 1
    kept = main.versions.global_versions(0)
    assert kept[0] > 0 and kept[-1] == 6 and len(kept) < 7, kept
    publish(7)  # the next publish, straight after: no pass
    assert transport.retention_passes == 1
    assert main.versions.global_versions(0) == [*kept, 7]
    now[0] = 100.0
    transport.tend()  # a later look, the cadence up: the pass that waited
    assert transport.retention_passes == 2
    assert main.versions.global_versions(0) == [v + 1 for v in kept]
    now[0] = 200.0
    transport.tend()  # time is up again, but nothing was published since: no pass
    assert transport.retention_passes == 2


def test_a_cadence_of_zero_runs_retention_after_every_publish_and_a_negative_one_is_refused():
    import pytest
    from pydantic import ValidationError

    assert RunConfig(pipeline={"retention_seconds": 0}).pipeline.retention_seconds == 0
    with pytest.raises(ValidationError, match="retention_seconds"):
        RunConfig(pipeline={"retention_seconds": -1})
