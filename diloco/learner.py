"""The learner unit: inner steps, contributions on the fragment schedule, and the
application of global fragments after the overlap delay tau.

The same ``Learner`` runs under the simulator's clock and inside the Prefect learner
flow; only who calls it, and how contributions and globals travel, differ.

A fragment's state (anchor, error-feedback carry and residual, values at the last send)
lives on the learner's devices with each parameter's sharding (``InnerTrainer.sharding``):
the outer gradient is computed and quantized there tensor by tensor
(``quantize_device``), and only each tensor's codes travel to the host (``to_host``); a
new global is placed and blended a tensor at a time. So the model is never gathered on
one device or held whole on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import optax

from diloco.config import TopologyConfig
from diloco.data import ShardReader
from diloco.fragments import FragmentPlan, due_fragment
from diloco.inner import InnerTrainer, to_host
from diloco.outer import Contribution, FlatParams
from diloco.quantize_device import outer_gradient
from diloco.tensors import KeptTensors
from protocol.quantize import QuantizedTensor

DeviceParams = dict[str, jax.Array]


@jax.jit
def _blend(local: jax.Array, global_: jax.Array, alpha: jax.Array, beta: jax.Array) -> jax.Array:
    """``outer.blend`` of one tensor on its devices, ``beta = 1 - alpha`` (traced
    weights: one program whatever alpha is)."""
    return alpha * local + beta * global_


@jax.jit
def _keep_unsent(anchor: jax.Array, current: jax.Array, sent: jax.Array) -> jax.Array:
    return anchor + (current - sent)


@jax.jit
def widen(value: jax.Array) -> jax.Array:
    """A global's bfloat16 tensor to float32 on its devices (exact: the same bits as
    widened on the host)."""
    return value.astype(jnp.float32)


def compile_apply(value: jax.Array) -> None:
    """Compile (or load from the JAX cache) what applying a global version runs on a
    tensor of ``value``'s shape and sharding (the widening of a bf16 wire's values, the
    blend, the re-base of ``keep_unsent``), so a learner's first versions do not wait on
    it (``flows.learner_runtime.compile_step``)."""
    widen(value.astype(jnp.bfloat16)).block_until_ready()
    _blend(value, value, np.float32(0.5), np.float32(0.5)).block_until_ready()
    _keep_unsent(value, value, value).block_until_ready()


@dataclass
class FragmentState:
    """What a learner knows of one fragment since it last received a global version."""

    anchor: DeviceParams  # the fragment's value right after that version was applied
    base_version: int
    anchor_seq: int = 0  # the learner's seq when the anchor was taken (Contribution.anchor_seq)
    base_id: str | None = None  # base_version's id as read (None: none applied yet)
    tokens: int = 0
    steps: int = 0
    seconds: float = 0.0
    sent_at_step: int | None = None  # inner step of the newest contribution still unanswered
    # Error feedback. ``carry``: the quantization residual this round started with (left by
    # the previous round's last send); ``residual``: what the newest send of this round
    # failed to carry. Every send of a round is measured from the same anchor and re-sends
    # everything, so each adds ``carry``, not its predecessor's residual: a superseded send
    # was never merged, and the syncer takes only the increment of a re-sent one. The
    # residual becomes the carry when a global version re-anchors the fragment.
    carry: DeviceParams = field(default_factory=dict)
    residual: DeviceParams = field(default_factory=dict)
    # With ``keep_unsent``: the fragment's values at the newest send.
    sent_values: DeviceParams = field(default_factory=dict)


@dataclass
class LearnerCheckpoint:
    """What a rejoining learner takes from its checkpoint (``LearnerLoop.start``): the
    inner optimizer state and its position. Parameters come from the newest global
    versions instead, and the data position is the step (one batch per step). JAX arrays
    are immutable: taking one costs no copy."""

    step: int
    seq: int
    opt_state: optax.OptState


class Learner:
    def __init__(
        self,
        learner_id: str,
        trainer: InnerTrainer,
        plan: FragmentPlan,
        topology: TopologyConfig,
        init: FlatParams,
        reader: ShardReader,
    ):
        self.id = learner_id
        self.trainer = trainer
        self.plan = plan
        self.topology = topology
        self.reader = reader
        self.params = trainer.place_params(init)
        self.opt_state = trainer.init_opt_state(self.params)
        self.step = 0
        self.seq = 0
        self.in_flight: jax.Array | None = None  # the loss of the step dispatched last
        self.fragments = [  # arrays are immutable: the anchor shares the placed values
            FragmentState(anchor={n: self.params[n] for n in names}, base_version=0)
            for names in plan
        ]

    @property
    def tokens_per_step(self) -> int:
        return self.reader.batch_size * self.reader.context

    def train_step(self, seconds: float = 0.0, position: float | None = None) -> jax.Array:
        """One inner step; ``seconds`` is the (measured or simulated) time it took,
        ``position`` where it stands on the decay schedule (its own step by default).

        Steps are dispatched asynchronously; each waits, once dispatched, for the one
        before it to finish, so one step is in flight while the host prepares the next
        (the device never idles) and no more. Without the wait a step returned in its
        dispatch time (3 % of its compute on CPU) and the compute was timed wherever
        something waited on it (a send, the end of a round), so the seconds a learner's
        contributions carry, which the syncer's grace window and the goodput read, were
        a fraction of the time trained and fell unevenly on the fragments."""
        batch = self.reader.next_batch()
        self.params, self.opt_state, loss = self.trainer.step(
            self.params, self.opt_state, batch, self.step if position is None else position
        )
        self.wait_in_flight()
        self.in_flight = loss
        self.step += 1
        for frag in self.fragments:
            frag.tokens += self.tokens_per_step
            frag.steps += 1
        self.add_seconds(seconds)
        return loss

    def wait_in_flight(self) -> None:
        """Wait for the step dispatched last to finish (nothing is in flight after)."""
        if self.in_flight is not None:
            self.in_flight.block_until_ready()
            self.in_flight = None

    def add_seconds(self, seconds: float) -> None:
        """``seconds`` of training on every fragment: each step's (``train_step``), and
        the device time of a call's last one (``LearnerLoop._settle``)."""
        for frag in self.fragments:
            frag.seconds += seconds

    def due(self) -> int | None:
        """The fragment to send after this step, if any (never one with no new steps: a
        global applied at the same step re-anchored it)."""
        p = due_fragment(self.step, self.topology.inner_steps, len(self.plan))
        return p if p is not None and self.fragments[p].steps > 0 else None

    def fragment_values(self, p: int) -> FlatParams:
        """Fragment ``p``'s current values on the host (for tests and tools; the learner's
        own fragment operations stay on the devices)."""
        return {n: to_host(self.params[n]).astype(np.float32) for n in self.plan[p]}

    def contribute(self, p: int) -> Contribution:
        """The outer gradient ``anchor - theta`` of fragment ``p``, quantized on the
        devices; each tensor's codes come to the host as soon as they are computed, so
        the host holds the payload and at most one tensor's device work is queued."""
        frag = self.fragments[p]
        kind, block = self.topology.quantization, self.topology.block_size
        feedback = self.topology.error_feedback
        payload = {}
        for name in self.plan[p]:
            theta = self.params[name]
            carry = frag.carry.get(name) if feedback else None
            data, scales, residual = outer_gradient(frag.anchor[name], theta, carry, kind, block)
            if feedback:
                frag.residual[name] = self.trainer.place(residual)
            payload[name] = QuantizedTensor(
                kind,
                tuple(theta.shape),
                to_host(data),
                None if scales is None else to_host(scales),
                block if scales is not None else 0,
            )
        self.seq += 1
        frag.sent_at_step = self.step
        if self.topology.keep_unsent:
            frag.sent_values = {n: self.params[n] for n in self.plan[p]}
        return Contribution(
            learner=self.id,
            fragment=p,
            seq=self.seq,
            base_version=frag.base_version,
            tokens=frag.tokens,
            steps=frag.steps,
            seconds=frag.seconds,
            payload=payload,
            step=self.step,
            anchor_seq=frag.anchor_seq,
            base_id=frag.base_id,
        )

    def may_apply(self, p: int) -> bool:
        """A new global of ``p`` lands only in answer to this learner's own send of ``p``, and
        no earlier than tau steps after it. Taking versions between sends would overwrite
        (alpha = 0) work on ``p`` that no contribution has carried to the syncer yet."""
        sent = self.fragments[p].sent_at_step
        return sent is not None and self.step >= sent + self.topology.tau

    def waiting_on(self) -> list[int]:
        """Fragments whose answer is overdue (tau steps passed): synchronous mode blocks on them."""
        return [
            p
            for p, f in enumerate(self.fragments)
            if f.sent_at_step is not None and self.step >= f.sent_at_step + self.topology.tau
        ]

    def apply_global(
        self, p: int, version: int, values: FlatParams, version_id: str | None = None
    ) -> None:
        """Take global version ``version`` (whose id is ``version_id``) of fragment ``p`` and
        re-anchor on it: blended with the local values (``alpha``), or, with
        ``keep_unsent``, plus the local steps taken since the send it answers, which then
        count towards the next contribution."""
        frag = self.fragments[p]
        if version <= frag.base_version:
            return
        names = self.plan[p]
        carry = frag.residual or frag.carry
        placed = {n: self._place_global(values, n) for n in names}
        if frag.sent_values and frag.sent_at_step is not None:  # only with keep_unsent
            kept = self.step - frag.sent_at_step
            anchor = placed
            new = {n: _keep_unsent(anchor[n], self.params[n], frag.sent_values[n]) for n in names}
            state = FragmentState(
                anchor=anchor,
                base_version=version,
                tokens=kept * self.tokens_per_step,
                steps=kept,
                seconds=frag.seconds * kept / frag.steps if frag.steps else 0.0,
                carry=carry,
                anchor_seq=self.seq,
                base_id=version_id,
            )
        else:
            alpha = self.topology.alpha
            new = (  # alpha = 0 overwrites (outer.blend)
                placed
                if alpha == 0.0
                else {
                    n: _blend(self.params[n], placed[n], np.float32(alpha), np.float32(1.0 - alpha))
                    for n in names
                }
            )
            state = FragmentState(anchor=new, base_version=version, carry=carry,
                                  anchor_seq=self.seq, base_id=version_id)  # fmt: skip
        self.params = {**self.params, **{n: self.trainer.place(v) for n, v in new.items()}}
        self.fragments[p] = state

    def _place_global(self, values: FlatParams, name: str) -> jax.Array:
        """A global's tensor onto the devices, a tensor at a time, each device receiving
        its slice: as ``values`` keep it where they can say (``exact``: a version held in
        a local file, ``storage_layout.spill``, keeps a bf16 wire's codes) and widened to
        float32 there, half the bytes moved and nothing decoded on the host; else as
        float32."""
        if not isinstance(values, KeptTensors):
            return self.trainer.place(np.asarray(values[name], dtype=np.float32))
        placed = self.trainer.place(values.exact(name))
        return placed if placed.dtype == jnp.float32 else widen(placed)

    def checkpoint(self) -> LearnerCheckpoint:
        return LearnerCheckpoint(step=self.step, seq=self.seq, opt_state=self.opt_state)

    def resume(self, step: int, seq: int, opt_state: optax.OptState | None) -> None:
        """Continue at inner step ``step`` (the data position follows it) with sequence
        numbers after ``seq``; keep a fresh optimizer state when ``opt_state`` is None."""
        self.step = step
        self.reader.position = step
        self.seq = seq
        if opt_state is not None:
            self.opt_state = opt_state
