import itertools

import pytest

from diloco.config import load_config
from diloco.fragments import due_fragment, fragment_sizes, plan_fragments, spacing
from diloco.model import ParamCodec


@pytest.fixture(scope="module")
def sizes():
    codec, _ = ParamCodec.create(load_config("tiny").model, 0)
    return codec.sizes


@pytest.mark.parametrize("strategy", ["balanced", "strided", "sequential"])
@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_plans_partition_every_tensor_once(sizes, strategy, count):
    plan = plan_fragments(sizes, count, strategy)
    assert len(plan) == count and all(plan)
    names = [n for frag in plan for n in frag]
    assert sorted(names) == sorted(sizes)


def test_balanced_is_greedy_largest_first(sizes):
    count = 3
    plan = plan_fragments(sizes, count, "balanced")
    # Reference: the greedy rule written out with plain lists.
    load, bins = [0] * count, [[] for _ in range(count)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        i = min(range(count), key=lambda j: (load[j], j))
        bins[i].append(name)
        load[i] += sizes[name]
    assert plan == tuple(tuple(sorted(b)) for b in bins)
    got = fragment_sizes(plan, sizes)
    # Greedy LPT bound: the heaviest bin exceeds the mean by at most the largest tensor.
    assert max(got) - sum(got) / count <= max(sizes.values())


def test_balanced_is_flatter_than_sequential(sizes):
    spread = lambda plan: max(fragment_sizes(plan, sizes)) - min(fragment_sizes(plan, sizes))  # noqa: E731
    assert spread(plan_fragments(sizes, 2, "balanced")) <= spread(
        plan_fragments(sizes, 2, "sequential")
    )


def test_strided_puts_layer_i_in_fragment_i_mod_p(sizes):
    plan = plan_fragments(sizes, 2, "strided")
    # layers: embeddings (-1), block 0, block 1, final norm -> positions 0..3 -> fragments 0,1,0,1
    assert "embed.embedding" in plan[0]
    assert "blocks.0.up.kernel" in plan[1]
    assert "blocks.1.up.kernel" in plan[0]
    assert "norm.scale" in plan[1]


def test_too_many_fragments_rejected(sizes):
    with pytest.raises(ValueError, match="at most one per tensor"):
        plan_fragments(sizes, len(sizes) + 1)


def test_schedule_is_staggered_and_periodic():
    h, p = 12, 4  # spacing 3
    assert spacing(h, p) == 3
    due = {t: due_fragment(t, h, p) for t in range(1, 25)}
    sends = [(t, f) for t, f in due.items() if f is not None]
    assert sends[:5] == [(3, 0), (6, 1), (9, 2), (12, 3), (15, 0)]
    for frag in range(p):  # each fragment every P * spacing = H steps
        times = [t for t, f in sends if f == frag]
        assert all(b - a == 12 for a, b in itertools.pairwise(times))
    assert due_fragment(0, h, p) is None
    assert spacing(3, 8) == 1  # never zero
