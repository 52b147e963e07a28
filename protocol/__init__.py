"""What the math (``diloco``) and the buckets (``storage_layout``) both speak, a leaf
that imports nothing of the project: how a tensor goes on the wire (``quantize``: the
codes, blockwise int8 and int4, bf16, fp32) and which learners a run has (``topology``:
learner ids, the deal of learners to regions, the home region, shard ownership).
(``protocol.quantize`` is the module: its function of that name is not re-exported.)"""

from protocol.quantize import QuantizedTensor, dequantize
from protocol.topology import home_region, learner_id, learner_index, run_slots, syncer_id

__all__ = ["QuantizedTensor", "dequantize", "home_region", "learner_id", "learner_index",
           "run_slots", "syncer_id"]  # fmt: skip
