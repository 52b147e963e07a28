"""Fragments (Streaming DiLoCo): which tensors form fragment p, and when p is due.

A fragment plan is a tuple of P tuples of tensor names. With ``H`` inner steps between
two syncs of one fragment and spacing ``dh = max(1, round(H / P))``, a learner at inner
step ``t`` (1-based count of steps done) sends fragment
``(t // dh - 1) mod P`` when ``t mod dh == 0``: each fragment every ``P * dh`` (about H)
steps, the P fragments staggered by ``dh``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

FragmentPlan = tuple[tuple[str, ...], ...]


def _layer_index(name: str) -> int:
    """Block index of a tensor (``blocks.3.up.kernel``, the Llama's ``layers.3.mlp...``
    -> 3); -1 before, 1e9 after the blocks."""
    match = re.match(r"(?:blocks|layers)\.(\d+)\.", name)
    if match:
        return int(match.group(1))
    return -1 if "embed" in name else 10**9


def plan_fragments(
    sizes: Mapping[str, int], count: int, strategy: str = "balanced"
) -> FragmentPlan:
    """Split whole tensors into ``count`` fragments.

    - ``balanced``: greedy bin packing, largest tensor first into the lightest fragment
      (ties to the lower index), so per-sync bandwidth is as flat as it can be.
    - ``strided``: layer i goes to fragment i mod P; tensors outside blocks by name order.
    - ``sequential``: contiguous runs of layers, about equal in tensor count.
    """
    names = sorted(sizes)
    if count > len(names):
        raise ValueError(f"{count} fragments for {len(names)} tensors: at most one per tensor")
    bins: list[list[str]] = [[] for _ in range(count)]
    if strategy == "balanced":
        load = [0] * count
        for name in sorted(names, key=lambda n: (-sizes[n], n)):
            p = min(range(count), key=lambda i: (load[i], i))
            bins[p].append(name)
            load[p] += sizes[name]
    elif strategy == "strided":
        layers = sorted({_layer_index(n) for n in names})
        for name in names:
            bins[layers.index(_layer_index(name)) % count].append(name)
    elif strategy == "sequential":
        ordered = sorted(names, key=lambda n: (_layer_index(n), n))
        per = -(-len(ordered) // count)
        for i, name in enumerate(ordered):
            bins[min(i // per, count - 1)].append(name)
    else:
        raise ValueError(f"unknown fragment strategy {strategy!r}")
    if any(not b for b in bins):
        raise ValueError(f"fragment strategy {strategy!r} left a fragment empty with P={count}")
    return tuple(tuple(sorted(b)) for b in bins)


def spacing(inner_steps: int, fragments: int) -> int:
    """Steps between two consecutive sends (of different fragments): ``max(1, round(H/P))``."""
    return max(1, round(inner_steps / fragments))


def due_fragment(step: int, inner_steps: int, fragments: int) -> int | None:
    """The fragment due after ``step`` inner steps (1-based), or None."""
    dh = spacing(inner_steps, fragments)
    if step <= 0 or step % dh:
        return None
    return (step // dh - 1) % fragments


def fragment_sizes(plan: FragmentPlan, sizes: Mapping[str, int]) -> list[int]:
    return [sum(sizes[n] for n in frag) for frag in plan]
