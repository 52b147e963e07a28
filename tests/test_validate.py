import numpy as np
import pytest

from diloco.outer import Contribution
from diloco.validate import ContributionRejected, check_contribution
from protocol.quantize import QuantizedTensor, quantize

SHAPES = {"a": (4, 3), "b": (5,)}


def make(payload=None, **kw):
    payload = payload or {
        n: quantize(np.full(s, 0.1, np.float32), "int4", 128) for n, s in SHAPES.items()
    }
    fields = dict(learner="us-east/2", fragment=3, seq=7, base_version=5, tokens=100, steps=10,
                  seconds=1.0, payload=payload)  # fmt: skip
    fields.update(kw)
    return Contribution(**fields)


def check(c, version=6, max_staleness=4, max_norm=10.0):
    return check_contribution(c, SHAPES, {"us-east/2"}, version, max_staleness, max_norm)


def test_valid_contribution_returns_its_norm():
    scan = check(make())
    assert scan.problem is None
    assert scan.norm == pytest.approx(0.1 * np.sqrt(12 + 5), rel=1e-6)


def rejected(c, **kw):
    with pytest.raises(ContributionRejected) as info:
        check(c, **kw)
    assert 'learner "us-east/2"' in str(info.value) and "fragment 3" in str(info.value)
    return info.value.reason


def test_wrong_shape():
    bad = {"a": quantize(np.zeros((3, 4), np.float32), "int4"), "b": quantize(np.zeros(5), "int4")}
    assert "tensor a has shape (3, 4), expected (4, 3)" in rejected(make(bad))


def test_missing_tensor():
    assert "missing ['b']" in rejected(make({"a": quantize(np.zeros((4, 3)), "int4")}))


def test_wrong_payload_dtype():
    good = quantize(np.zeros((4, 3)), "int8")
    bad = QuantizedTensor(
        "int8", (4, 3), good.data.astype(np.float32), good.scales, good.block_size
    )
    assert "payload dtype float32" in rejected(make({"a": bad, "b": quantize(np.zeros(5), "int8")}))


def test_truncated_payload():
    good = quantize(np.ones((4, 3)), "fp32")
    short = QuantizedTensor("fp32", (4, 3), good.data[:5])
    assert "expected a complete one" in rejected(
        make({"a": short, "b": quantize(np.zeros(5), "fp32")})
    )


def test_nan_values():
    x = np.zeros((4, 3), np.float32)
    x[1, 1] = np.nan
    assert "NaN or infinite" in rejected(
        make({"a": quantize(x, "fp32"), "b": quantize(np.zeros(5), "fp32")})
    )


def test_norm_bound():
    big = {n: quantize(np.full(s, 100.0, np.float32), "fp32") for n, s in SHAPES.items()}
    assert "exceeds the bound" in rejected(make(big))


def test_unknown_learner():
    with pytest.raises(ContributionRejected, match="not part of this run"):
        check_contribution(make(learner="eve"), SHAPES, {"us-east/2"}, 6, 4, 10.0)


def test_staleness_bound_and_future_base():
    assert "staleness 5 exceeds the maximum 4" in rejected(make(base_version=1))
    assert "newer than the current" in rejected(make(base_version=9))


def test_non_positive_counts():
    assert "counts must be positive" in rejected(make(steps=0))
