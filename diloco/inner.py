"""Inner optimization of one learner: AdamW (or Muon) with warm-up, cosine decay and
clipping.

The learning rate is an argument of the step, not a count inside the optimizer state: its
warm-up follows the state's own age (Adam's moments need it whoever the learner is), its
decay a *position* the caller gives, the run's progress when learners share the budget
(``LearnerLoop.position``), so fast and slow learners stand at the same point of the
schedule at the same time.

Parameters travel as a flat ``{name: jax.Array}`` dict (see ``model.ParamCodec``), so
the step, the optimizer state and every fragment operation share one naming.

The learner's devices form a ``(data, fsdp)`` mesh (``pipeline.fsdp``, docs/architecture.md
"A sharded learner"): each parameter and each of its AdamW moments is split over the
``fsdp`` axis along its largest dimension that the axis divides (replicated where none
does), and the batch over all devices. The sharding of a tensor depends on its shape
alone, so an optimizer leaf lands where its parameter is, and a tensor read from storage
(a global version, a checkpoint's leaf) is placed without knowing whose it is. Every
transfer of the learner's arrays to the host goes through ``to_host``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from diloco.config import InnerConfig
from diloco.model import ParamCodec, is_embedding

JaxParams = dict[str, jax.Array]


def to_host(array: jax.Array, *, held: bool = False) -> np.ndarray:
    """The one way the learner's device arrays reach the host (a contribution's codes, a
    fragment's values, a checkpoint's leaf): a single tensor at a time, never a tree.
    One that spans several processes (a learner over several hosts) is put together from
    this process's own shards when every process holds all of it (sharded within a host,
    replicated across hosts: the ``(data, fsdp)`` mesh with ``pipeline.fsdp`` no larger
    than a host's devices), with no traffic between hosts; else (FSDP across hosts) it
    is gathered from all of them. Every process calls it at the same point (the gather
    is a collective), and every process takes the same path: it is decided by the
    array's sharding alone (``held_by_every_process``).

    ``held``: the array outlives the call (a leaf of the state a checkpoint holds while
    it is written). A ``jax.Array`` keeps the host copy it makes for as long as it lives
    (on a GPU; on CPUs when it is sharded), so a state read leaf by leaf would end with
    all of it on the host (9.5 GB for a 1 B learner, measured: ``bench/hosts``). Such an
    array is copied on its devices first (one tensor, for a moment) and the host copy
    goes with that copy, once the caller drops what it was given."""
    if getattr(array, "is_fully_addressable", True) or array.is_fully_replicated:
        if held and isinstance(array, jax.Array):
            array = jnp.copy(array)
        return np.asarray(jax.device_get(array))
    if held_by_every_process(array):
        if held:  # (its shards' host copies would stay with it)
            array = jnp.copy(array)
        out = np.empty(array.shape, array.dtype)
        done = set()
        for shard in array.addressable_shards:  # each part once (the others: replicas)
            if (key := _box(shard.index)) not in done:
                done.add(key)
                out[shard.index] = np.asarray(shard.data)
        return out
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def _box(index: tuple[slice, ...]) -> tuple[tuple[int | None, ...], ...]:
    return tuple((s.start, s.stop, s.step) for s in index)


def held_by_every_process(array: jax.Array) -> bool:
    """Whether each process's own devices hold every part of ``array`` (sharded within
    processes, replicated across them). From the sharding alone, which every process
    knows whole: all of them answer alike."""
    where = array.sharding.devices_indices_map(tuple(array.shape))
    parts = {_box(index) for index in where.values()}
    held: dict[int, set] = {}
    for device, index in where.items():
        held.setdefault(device.process_index, set()).add(_box(index))
    return all(mine == parts for mine in held.values())


class Boxes(Protocol):
    """A tensor kept elsewhere in parts (a checkpoint's leaf, written by several hosts):
    its ``shape`` and ``dtype``, and ``box[index]`` (a tuple of slices) reads only the
    parts that overlap ``index``."""

    shape: tuple[int, ...]
    dtype: np.dtype

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray: ...


def _is_boxes(value: object) -> bool:
    """Whether ``value`` is a ``Boxes`` (array-like, read by slice), not host values."""
    if isinstance(value, np.ndarray | np.generic):
        return False
    return hasattr(value, "shape") and hasattr(value, "__getitem__")


def to_device(host: np.ndarray | Boxes, sharding: NamedSharding) -> jax.Array:
    """A host array onto ``sharding``: each device receives only its own slice. A
    ``Boxes`` is read a device's slice at a time, each put on its device before the next
    is read (``make_array_from_callback`` would hold every local device's slice on the
    host at once: the whole tensor, for a learner sharded over one host's devices)."""
    if not _is_boxes(host):
        host = np.asarray(host)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    shards = [jax.device_put(host[index], device).block_until_ready()
              for device, index in sharding.addressable_devices_indices_map(host.shape).items()]  # fmt: skip
    return jax.make_array_from_single_device_arrays(host.shape, sharding, shards)


def fsdp_spec(shape: Sequence[int], fsdp: int) -> PartitionSpec:
    """Split along the largest dimension that ``fsdp`` divides (the first of equals);
    replicated when none does (scalars, norms' scales of odd width) or ``fsdp`` is 1."""
    if fsdp == 1:
        return PartitionSpec()
    fits = [d for d, size in enumerate(shape) if size % fsdp == 0]
    if not fits:
        return PartitionSpec()
    axis = max(fits, key=lambda d: (shape[d], -d))
    return PartitionSpec(*[("fsdp" if d == axis else None) for d in range(len(shape))])


def learner_mesh(devices: Sequence[jax.Device], fsdp: int = 1) -> Mesh:
    """The ``(data, fsdp)`` mesh of a learner's devices; ``fsdp=-1`` shards over all."""
    n = len(devices)
    size = n if fsdp == -1 else fsdp
    if size < 1 or n % size:
        raise ValueError(
            f"pipeline.fsdp={fsdp} does not divide the learner's {n} devices; give a "
            f"divisor of {n} (1: replicated parameters, -1: sharded over all {n})"
        )
    return Mesh(np.array(devices).reshape(n // size, size), ("data", "fsdp"))


def _decayed(params: JaxParams) -> JaxParams:
    """Weight decay applies to matrices only (not to norms' scales or biases)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def _adamw(cfg: InnerConfig) -> optax.GradientTransformation:
    return optax.adamw(1.0, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=_decayed)


def _muon(cfg: InnerConfig) -> optax.GradientTransformation:
    """Muon (optax's) on the hidden matrices, AdamW on the rest: the embedding tables and
    the output head (``model.is_embedding``: vocabulary-sized, where Muon is not used),
    norms' scales and biases. ``consistent_rms``: each orthogonalized update is scaled to
    AdamW's typical RMS (0.2), so the run's ``lr`` and its schedule apply unchanged."""
    from optax.contrib import MuonDimensionNumbers, muon

    def matrices(params: JaxParams) -> dict[str, MuonDimensionNumbers | None]:
        return {name: MuonDimensionNumbers() if getattr(p, "ndim", 0) == 2
                and not is_embedding(name) else None for name, p in params.items()}  # fmt: skip

    return muon(1.0, beta=cfg.b1, weight_decay=cfg.weight_decay, weight_decay_mask=_decayed,
                adam_b1=cfg.b1, adam_b2=cfg.b2, adam_weight_decay=cfg.weight_decay,
                muon_weight_dimension_numbers=matrices, consistent_rms=0.2)  # fmt: skip


# The inner optimizers by name (``inner.optimizer``): a new one is a function here and its
# name in the config's ``Literal``; its state is stored leaf by leaf whatever its structure.
INNER_OPTIMIZERS = {"adamw": _adamw, "muon": _muon}


def inner_optimizer(cfg: InnerConfig) -> optax.GradientTransformation:
    """Clip by global norm, then the optimizer ``inner.optimizer`` names at rate 1: the
    step scales the update by ``inner_lr`` (a schedule inside the state could follow only
    the state's own count)."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm), INNER_OPTIMIZERS[cfg.optimizer](cfg)
    )


def state_age(opt_state: optax.OptState) -> jax.Array:
    """How many updates the state has taken (its first ``count``: AdamW has one, Muon one
    for its matrices and one for the rest, always equal)."""
    return optax.tree_utils.tree_get_all_with_path(opt_state, "count")[0][1]


def lr_schedule(cfg: InnerConfig, total_steps: int) -> np.ndarray:
    """The inner rate's schedule as the compiled step takes it: an argument (peak rate,
    decay steps, warm-up steps, final ratio), not constants in the program, so that one
    compiled step serves every budget and rate (a run resumed with a larger budget loads
    its step from the cache instead of compiling it again: minutes of a large model's
    start). float32 holds step counts exactly up to 2^24."""
    warmup = cfg.warmup_steps
    decay_steps = max(total_steps, warmup + 1) - warmup
    return np.array([cfg.lr, decay_steps, warmup, cfg.min_lr_ratio], np.float32)


def inner_lr(schedule: jax.Array, age: jax.Array, position: jax.Array) -> jax.Array:
    """The rate of an update (``schedule`` from ``lr_schedule``): a linear warm-up from 0
    over the optimizer state's first warm-up updates (``age``), times a cosine decay from
    the peak rate to its final ratio of it that follows ``position``. Where age and
    position agree (one learner alone, or each on its own share), it is optax's
    ``warmup_cosine_decay_schedule``."""
    lr, decay_steps, warmup, alpha = (schedule[i] for i in range(4))
    done = jnp.clip(position - warmup, 0.0, decay_steps) / decay_steps
    decay = lr * ((1.0 - alpha) * 0.5 * (1.0 + jnp.cos(jnp.pi * done)) + alpha)
    return decay * jnp.where(warmup > 0, jnp.minimum(age / jnp.maximum(warmup, 1.0), 1.0), 1.0)


class InnerTrainer:
    """Compiled train and eval steps for one model shape, shared by all learners of a process."""

    def __init__(
        self,
        codec: ParamCodec,
        cfg: InnerConfig,
        total_steps: int,
        devices: Sequence[jax.Device] | None = None,
        fsdp: int = 1,
    ):
        self.codec = codec
        self.tx = inner_optimizer(cfg)
        self.devices = list(devices or jax.devices())
        self.mesh = learner_mesh(self.devices, fsdp)
        self.fsdp = self.mesh.shape["fsdp"]
        self.batch_sharding = NamedSharding(self.mesh, PartitionSpec(("data", "fsdp")))
        self.replicated = NamedSharding(self.mesh, PartitionSpec())

        def loss_fn(params: JaxParams, batch: jax.Array) -> jax.Array:
            model = codec.model(codec.from_flat(params))
            logits = model(batch[:, :-1])
            labels = batch[:, 1:]
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        self.schedule = jax.device_put(lr_schedule(cfg, total_steps), self.replicated)
        # One program (a handful of scalar operations run one by one would each be
        # dispatched, and compiled on first use, in every process).
        self._lr = jax.jit(inner_lr)

        def train_step(params, opt_state, batch, position, schedule):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            lr = inner_lr(schedule, state_age(opt_state), position)
            updates, opt_state = self.tx.update(grads, opt_state, params)
            updates = jax.tree.map(lambda u: lr * u, updates)
            keep = lambda x: jax.lax.with_sharding_constraint(x, self.sharding(x.shape))  # noqa: E731
            params = jax.tree.map(keep, optax.apply_updates(params, updates))
            return params, jax.tree.map(keep, opt_state), loss

        self._train_step = jax.jit(train_step)
        self._loss = jax.jit(loss_fn)

    def sharding(self, shape: Sequence[int]) -> NamedSharding:
        """Where a tensor of ``shape`` lives on this learner's mesh (``fsdp_spec``)."""
        return NamedSharding(self.mesh, fsdp_spec(tuple(shape), self.fsdp))

    def place(self, value: np.ndarray | jax.Array) -> jax.Array:
        """One tensor onto its sharding: from the host slice by slice, or resharded on
        the devices (a no-op when it is there already)."""
        sharding = self.sharding(np.shape(value))
        if isinstance(value, jax.Array):
            return jax.device_put(value, sharding)
        if _is_boxes(value):
            return to_device(value, sharding)  # ``Boxes``: read where it is placed
        host = np.asarray(value)  # (a copy only where JAX's dtype differs: float64)
        dtype = jax.dtypes.canonicalize_dtype(host.dtype)
        return to_device(host.astype(dtype, copy=False), sharding)

    def place_params(self, flat: Mapping[str, np.ndarray]) -> JaxParams:
        """Host arrays -> sharded device arrays (all tensors, or a fragment's subset; any
        tensors, as optimizer leaves too), a tensor at a time."""
        return {n: self.place(v) for n, v in flat.items()}

    def init_opt_state(self, params: JaxParams) -> optax.OptState:
        """A fresh state, sharded like the parameters: so placed, it is what a train step
        returns and what a restored checkpoint is, and the step compiles once per process
        (left uncommitted, the first step and every later one would each compile their
        own version: seconds of a restarted learner's first round)."""
        state = jax.jit(self.tx.init)(params)
        return jax.tree.map(lambda x: jax.device_put(x, self.sharding(x.shape)), state)

    def place_batch(self, batch: np.ndarray) -> jax.Array:
        if batch.shape[0] % len(self.devices):
            raise ValueError(
                f"batch of {batch.shape[0]} sequences does not split over "
                f"{len(self.devices)} devices; use a batch size divisible by the device count"
            )
        # Each process places only its devices' rows: over several processes (hosts)
        # the array is one global batch, every process holding the same host batch.
        return jax.make_array_from_callback(batch.shape, self.batch_sharding, lambda i: batch[i])

    def step(
        self, params: JaxParams, opt_state: optax.OptState, batch: np.ndarray, position: float
    ) -> tuple[JaxParams, optax.OptState, float]:
        """One inner step at ``position`` on the decay schedule (in inner steps: the
        learner's own step, or the run's steps per learner). Returns new params, new
        optimizer state and the batch loss."""
        params, opt_state, loss = self._train_step(
            params, opt_state, self.place_batch(batch), np.float32(position), self.schedule
        )
        return params, opt_state, loss

    def lr(self, opt_state: optax.OptState, position: float) -> float:
        """The rate of the next step from ``opt_state`` at ``position`` (for logs)."""
        return float(self._lr(self.schedule, state_age(opt_state), np.float32(position)))

    def evaluate(self, params: JaxParams, batches: Sequence[np.ndarray]) -> float:
        """Mean next-byte cross-entropy (nats per byte) over ``batches``."""
        losses = [self._loss(params, self.place_batch(b)) for b in batches]
        return float(np.mean(to_host(jnp.stack(losses))))
