"""The pipeline's cost and memory per device per step, from the stages and the schedule alone.

The model of pipeline parallelism (GPipe: Huang et al. 2019; 1F1B: Narayanan et al. 2021, PipeDream-Flush;
interleaved: Narayanan et al. 2021, "Efficient large-scale language model training on GPU clusters using
Megatron-LM", §2.2) as :mod:`dtx.step.pipeline` runs it, each term one the compiled program shows
(``tests/test_pipeline_parallel.py`` holds them to it):

* **bubble** — ``(P - 1) / (VM + P - 1)`` of each slot's ticks (the schedule's tables);
* **point-to-point bytes** — ``2(VM + P - 2)`` messages of one micro-batch's ``(micro, width)`` buffer (the
  collective-permutes' bytes times their loops' trip counts);
* **gradient all-reduce** — one ring all-reduce of the device's parameter row over the data axes;
* **memory** — the step's arguments: the device's parameter row and its optimizer state (``optimizer_slots``
  row-sized buffers: 0 for SGD, 1 for momentum, 2 for Adam) and its ``1/P`` of the data shard's batch; and its
  temporaries: :data:`WORK_ROWS` device rows (the gradient accumulator, the all-reduce's out-of-place result) and
  :data:`WORK_STAGE_ROWS` stage row (the backward slot's gradient) — read from XLA:CPU's buffer assignment — and
  :data:`WORK_MESSAGES` buffers of one micro-batch's message; the kept stage inputs: ``slots`` buffers of one
  micro-batch (``M`` under GPipe, ``min(M, 2P - 1)`` under 1F1B, ``VM`` interleaved) — the term that separates
  the schedules — and the data shard's batch, gathered over the stages (``M`` micro-batches of ``example_bytes`` each example).
  ``memory_bytes`` is the step's peak as :func:`dtx.perf.memory.compiled_peak` reads it, held to 15 %.
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
# Row-sized temporaries of the compiled step (XLA:CPU, read from programs of widths 256-512 with SGD, momentum and
# Adam): the accumulator and the all-reduce's out-of-place result, each the device's V stage rows, and the backward
# slot's gradient, one stage's row; every schedule.
WORK_ROWS = {"gpipe": 2, "1f1b": 2, "interleaved": 2}
WORK_STAGE_ROWS = 1
# Buffers of one message (micro-batch x width) the slots keep apart: received, sent, their gradients, the stage's
# activations and ReLU masks (read from a 4-stage MLP of widths 16-64, where they are a sixth of the peak).
WORK_MESSAGES = 20


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
    work_bytes: int = 0  # the working buffers (WORK_ROWS rows, WORK_MESSAGES messages)
    stages: int = 1  # P: a device's argument is 1/P of the gathered batch

    @property
    def memory_bytes(self) -> int:
        """The step's peak per device: parameters, optimizer state, the device's batch, the working rows, the kept
        inputs and the gathered batch (module docstring)."""
        return (self.params_bytes + self.optimizer_bytes + self.batch_bytes // self.stages + self.work_bytes
                + self.kept_bytes + self.batch_bytes)


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
                            schedule.micro * micro * example_bytes, step_s,
                            WORK_ROWS[schedule.name] * row_bytes + WORK_STAGE_ROWS * plan.row * itemsize
                            + WORK_MESSAGES * message, plan.devices)
