"""The pipeline's cost and memory per device per step, from the stages and the schedule alone.

The model of pipeline parallelism (GPipe: Huang et al. 2019; 1F1B: Narayanan et al. 2021, PipeDream-Flush;
interleaved: Narayanan et al. 2021, "Efficient large-scale language model training on GPU clusters using
Megatron-LM", §2.2) as :mod:`dtx.step.pipeline` runs it, each term one the compiled program shows
(``tests/test_pipeline_parallel.py`` holds them to it):

* **bubble** — ``(P - 1) / (VM + P - 1)`` of each slot's ticks (the schedule's tables);
* **point-to-point bytes** — ``2(VM + P - 2)`` messages of one micro-batch's ``(micro, width)`` buffer (the
  collective-permutes' bytes times their loops' trip counts);
* **gradient all-reduce** — one ring all-reduce of the device's parameter row over the data axes;
* **memory** — the device's parameter row and its optimizer state (``optimizer_slots`` row-sized buffers:
  0 for SGD, 1 for momentum, 2 for Adam), the gradient accumulator, and the kept stage inputs: ``slots``
  buffers of one micro-batch (``M`` under GPipe, ``min(M, 2P - 1)`` under 1F1B, ``VM`` interleaved) — the
  term that separates the schedules (XLA's memory analysis: temporaries grow by it); and the data shard's
  batch, gathered over the stages (``M`` micro-batches of ``example_bytes`` each example).
* **time** — each slot tick costs the slowest stage's work on one micro-batch (forward: its FLOPs; backward:
  the forward re-run and twice its FLOPs), at the cluster's node FLOP rate, plus the tick's message (α + n/β);
  then the all-reduce (ring, α-β). A modelled time, never measured on the emulated mesh.
"""

from __future__ import annotations

import dataclasses

from dtx.comm import costmodel
from dtx.parallel.pipeline_schedules import Schedule
from dtx.parallel.stages import StagePlan
from dtx.perf.clusters import Cluster

OPTIMIZER_SLOTS = {"sgd": 0, "momentum": 1, "nesterov": 1, "adam": 2}


@dataclasses.dataclass(frozen=True)
class PipelineEstimate:
    """One device's share of a pipeline step (module docstring); bytes and seconds."""

    bubble: float
    p2p_messages: int
    p2p_bytes: int
    allreduce_bytes: int
    params_bytes: int
    optimizer_bytes: int
    kept_bytes: int
    batch_bytes: int  # the data shard's batch, gathered over the stages
    step_s: float | None  # None without a cluster

    @property
    def memory_bytes(self) -> int:
        """Parameters, optimizer state, gradient accumulator, kept inputs and the gathered batch."""
        return 2 * self.params_bytes + self.optimizer_bytes + self.kept_bytes + self.batch_bytes


def estimate(plan: StagePlan, schedule: Schedule, micro: int, data: int, optimizer: str = "adam",
             cluster: Cluster | None = None, itemsize: int = 4, example_bytes: int = 0) -> PipelineEstimate:
    """The estimate for ``micro`` examples per micro-batch on ``data`` data shards (module docstring);
    ``example_bytes``: one example's inputs and labels."""
    if optimizer not in OPTIMIZER_SLOTS:
        raise ValueError(f"the pipeline model knows the optimizers {sorted(OPTIMIZER_SLOTS)}, not {optimizer!r}")
    row_bytes = plan.chunks * plan.row * itemsize
    message = plan.message_bytes(micro, itemsize)
    allreduce = costmodel.expected_traffic("ring", row_bytes, data, None, itemsize).bytes_sent if data > 1 else 0
    step_s = None
    if cluster is not None:
        flops = max(plan.stage_flops) * micro  # the slowest (virtual) stage sets every tick's pace
        hop = cluster.latency + message / cluster.bandwidth
        forward = flops / cluster.node_flops + hop
        backward = 3 * flops / cluster.node_flops + hop  # re-run the forward, then twice its FLOPs back
        ring = 2 * (data - 1) * (cluster.latency + row_bytes / data / cluster.bandwidth) if data > 1 else 0.0
        step_s = schedule.slot_ticks("forward") * forward + schedule.slot_ticks("backward") * backward + ring
    return PipelineEstimate(schedule.bubble, schedule.messages, schedule.messages * message, allreduce, row_bytes,
                            OPTIMIZER_SLOTS[optimizer] * row_bytes, schedule.slots * message,
                            schedule.micro * micro * example_bytes, step_s)
