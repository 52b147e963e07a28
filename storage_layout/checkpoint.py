"""A learner's checkpoint in its bucket: ``LearnerCheckpoint`` <-> tensor groups + meta.

Groups (all float32, committed through ``RunStore.put_checkpoint``):

- ``params``: the learner's parameters by flat name;
- ``opt``: the inner optimizer state's leaves, ``0000``, ``0001``, ... in tree order
  (restored into the structure of a freshly initialized state, so the optimizer's code
  defines the layout and nothing here needs to know optax's types);
- ``anchor``: each fragment's anchor (names are unique across fragments);
- ``carry`` and ``residual``: each fragment's error-feedback residuals, when error
  feedback is on (see ``FragmentState``);
- ``sent_values``: each fragment's values at its newest send, with ``keep_unsent``.

The marker's meta holds the counters (step, seq, data position, per-fragment base
version, tokens, steps, seconds) and ``base_versions``, which retention reads to keep
the global versions a checkpoint depends on.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
import optax

from diloco.fragments import FragmentPlan
from diloco.inner import JaxParams
from diloco.learner import FragmentState, LearnerCheckpoint
from storage_layout.commit import CommitMarker, CorruptVersion
from storage_layout.store import RunStore


def save_learner_checkpoint(store: RunStore, learner: str, ckpt: LearnerCheckpoint) -> CommitMarker:
    params = {n: np.asarray(v, dtype=np.float32) for n, v in jax.device_get(ckpt.params).items()}
    leaves = jax.device_get(jax.tree_util.tree_leaves(ckpt.opt_state))
    opt = {f"{i:04d}": np.asarray(x, dtype=np.float32) for i, x in enumerate(leaves)}
    tensors = {"params": params, "opt": opt}
    for group in ("anchor", "carry", "residual", "sent_values"):  # per-fragment tensors
        values = {n: v for f in ckpt.fragments for n, v in getattr(f, group).items()}
        if values:
            tensors[group] = values
    meta = {
        "data_position": ckpt.data_position,
        "seq": ckpt.seq,
        "fragments": [
            {
                "base_version": f.base_version,
                "tokens": f.tokens,
                "steps": f.steps,
                "seconds": f.seconds,
                "sent_at_step": f.sent_at_step,
            }
            for f in ckpt.fragments
        ],
        "base_versions": {str(p): f.base_version for p, f in enumerate(ckpt.fragments)},
    }
    return store.put_checkpoint(learner, ckpt.step, tensors, meta)


def load_learner_checkpoint(
    store: RunStore,
    learner: str,
    step: int,
    plan: FragmentPlan,
    place: Callable[[dict[str, np.ndarray]], JaxParams],
    init_opt_state: Callable[[JaxParams], optax.OptState],
) -> LearnerCheckpoint:
    """Read checkpoint ``step``; ``place`` and ``init_opt_state`` come from the trainer."""
    groups, meta = store.get_checkpoint(learner, step)
    try:
        params = place(groups["params"])
        template = init_opt_state(params)
        treedef = jax.tree_util.tree_structure(template)
        kinds = jax.tree_util.tree_leaves(template)
        stored = [groups["opt"][k] for k in sorted(groups["opt"])]
        if len(stored) != len(kinds):
            raise CorruptVersion(
                f"checkpoint {learner}@{step}: {len(stored)} optimizer leaves, "
                f"this model's optimizer has {len(kinds)}"
            )
        # ``place`` puts every leaf where the parameters are (replicated over the mesh).
        host = {
            f"{i:04d}": np.asarray(x, dtype=t.dtype).reshape(t.shape)
            for i, (x, t) in enumerate(zip(stored, kinds, strict=True))
        }
        placed = place(host)
        opt_state = jax.tree_util.tree_unflatten(treedef, [placed[k] for k in sorted(placed)])
        fragments = [
            FragmentState(
                anchor={n: groups["anchor"][n] for n in names},
                base_version=int(f["base_version"]),
                tokens=int(f["tokens"]),
                steps=int(f["steps"]),
                seconds=float(f["seconds"]),
                sent_at_step=f.get("sent_at_step"),
                carry=pick(groups.get("carry", {}), names),
                residual=pick(groups.get("residual", {}), names),
                sent_values=pick(groups.get("sent_values", {}), names),
            )
            for names, f in zip(plan, meta["fragments"], strict=True)
        ]
    except (KeyError, ValueError) as exc:
        raise CorruptVersion(f"checkpoint {learner}@{step} does not fit this run: {exc}") from exc
    return LearnerCheckpoint(
        params=params,
        opt_state=opt_state,
        data_position=int(meta["data_position"]),
        step=int(meta["step"]),
        seq=int(meta["seq"]),
        fragments=fragments,
    )


def pick(group: dict[str, np.ndarray], names: tuple[str, ...]) -> dict[str, np.ndarray]:
    return {n: group[n] for n in names if n in group}
