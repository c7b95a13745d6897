"""The pipeline's cost and memory per device per step, from the stages and the schedule alone.

The model of pipeline parallelism (GPipe: Huang et al. 2019; 1F1B: Narayanan et al. 2021, PipeDream-Flush;
interleaved: Narayanan et al. 2021, "Efficient large-scale language model training on GPU clusters using
Megatron-LM", §2.2) as :mod:`dtx.parallel.pipeline.step` runs it, each term one the compiled program shows
(``tests/test_pipeline_parallel.py`` holds them to it):

* **bubble** — ``(P - 1) / (VM + P - 1)`` of each slot's ticks (the schedule's tables);
* **point-to-point bytes** — ``2(VM + P - 2)`` messages of one micro-batch's ``(micro, width)`` buffer (the
  collective-permutes' bytes times their loops' trip counts);
* **gradient all-reduce** — one ring all-reduce of the device's parameter row over the data axes;
* **memory** — the step's arguments: the device's parameter row and its optimizer state (``optimizer_slots``
  row-sized buffers: 0 for SGD, 1 for momentum, 2 for Adam; ``1/D`` of them under ZeRO-1, whose reduce-scatter's
  slice and all-gather's row take the all-reduce's place among the temporaries, the compiled temp unchanged)
  and its ``1/P`` of the data shard's batch; and its
  temporaries: :data:`WORK_ROWS` device rows (the gradient accumulator, the all-reduce's out-of-place result) and
  :data:`WORK_STAGE_ROWS` stage row (the backward slot's gradient) — read from XLA:CPU's buffer assignment — and
  :data:`WORK_MESSAGES` buffers of one micro-batch's message; where a stage max-pools, the costliest stage's
  backward slot on one micro-batch in place of the row-sized temporaries but the accumulator, where larger (its
  pools' index arrays, the largest pool's convolution output, its kernels sliced and flipped:
  :func:`stage_conv_slot_bytes`, :func:`conv_slot_bytes` from the planner's layers), and :data:`SMALL_BUFFERS`;
  the kept stage inputs: ``slots`` buffers of one
  micro-batch (``M`` under GPipe, ``min(M, 2P - 1)`` under 1F1B, ``VM`` interleaved) — the term that separates
  the schedules — and the data shard's batch, gathered over the stages (``M`` micro-batches of ``example_bytes`` each example).
  ``memory_bytes`` is the step's peak as :func:`dtx.perf.memory.compiled_peak` reads it, held to 15 %.
* **time** — each slot tick costs the slowest stage's work on one micro-batch (forward: its FLOPs; backward:
  the forward re-run and twice its FLOPs), at the cluster's node FLOP rate, plus the tick's message (α + n/β);
  then the all-reduce (ring, α-β). A modelled time, never measured on the emulated mesh;
* **the simulated clock** (``--config.cluster``) — :class:`PipelineClock` times the schedule tick by tick,
  each slot the slowest busy device's work with its straggler multiplier (:func:`clock_model`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dtx.comm import costmodel
from dtx.optim import DECLARED
from dtx.parallel.pipeline.schedules import IDLE, Schedule
from dtx.parallel.pipeline.stages import StagePlan
from dtx.perf.clusters import Cluster
from dtx.perf.memory import MemoryEstimate

OPTIMIZER_SLOTS = {name: optimizer.slots for name, optimizer in DECLARED.items()}  # dtx.optim's declarations
# Row-sized temporaries of the compiled step (XLA:CPU, read from programs of widths 256-512 with SGD, momentum and
# Adam): the accumulator and the all-reduce's out-of-place result, each the device's V stage rows, and the backward
# slot's gradient, one stage's row; every schedule.
WORK_ROWS = {"gpipe": 2, "1f1b": 2, "interleaved": 2}
WORK_STAGE_ROWS = 1
# Buffers of one message (micro-batch x width) the slots keep apart: received, sent, their gradients, the stage's
# activations and ReLU masks (read from a 4-stage MLP of widths 16-64, where they are a sixth of the peak).
WORK_MESSAGES = 20
# The program's scalars and tuple tables (each 64-byte aligned: loop counters, predicates, the branches' tuples), read
# from the top of XLA:CPU's temporary arena in four LeNet pipelines: 2.6-4.8 KB whatever the model's size. Counted
# beside a convolutional stage's slot (conv_slot_bytes); the Dense stacks' WORK_MESSAGES, read from programs of the
# same small size, already hold them.
SMALL_BUFFERS = 4096


def conv_slot_bytes(layers, bounds, micro: int, itemsize: int = 4) -> int:
    """The working buffers of the costliest convolutional stage's backward slot, from the planner's analysed layers
    (:class:`dtx.perf.layers.Layer`, which describe no pooling) cut at ``bounds`` (``(0, ..., len(layers))``).

    A convolution whose next layer takes fewer elements than it gives is pooled, the pool's input its output
    (``out_elements``, of the kernel's rank: a 2-d convolution's ``(H, W, C)`` map, rank 4 with the batch). Read
    from XLA:CPU's buffer assignments of LeNet and VGG-A stages (dtx.parallel.pipeline.step's slot, one micro-batch):

    * each max pool's backward (select-and-scatter, expanded) needs one int32 index array per dimension of its
      input and the zeros its scatter fills; XLA makes them for *every* pool of the stage when the slot starts, so
      ``rank + 1`` buffers of each pool's input are live together;
    * the largest pool's convolution output and its ReLU, re-run in the slot: 2 more of its input (its
      concatenated indices, scatter and select then reuse the index arrays' and the output's buffers);
    * each kernel of the stage sliced out of the row, and flipped for its input gradient (the model's first
      convolution, which has none, is only sliced).

    The costliest stage's count on each device (every device's program holds every stage's code, the stages being
    branches sharing one temporary arena). The slot runs while the row-sized temporaries (the gradient row the slot
    returns, the all-reduce's result) are not live: the caller counts the larger of the two."""
    stages = []
    for start, stop in zip(bounds, bounds[1:]):
        pools, kernels = [], 0
        for i in range(start, stop):
            layer = layers[i]
            if layer.kind != "conv":
                continue
            kernels += (1 if i == 0 else 2) * (layer.weights - layer.kernel_shape[-1])
            if i + 1 < len(layers) and layers[i + 1].in_elements < layer.out_elements:
                pools.append((len(layer.kernel_shape), layer.out_elements))
        stages.append((pools, kernels))
    return _slot_bytes(stages, micro, itemsize)


def stage_conv_slot_bytes(plan: StagePlan, micro: int, itemsize: int = 4) -> int:
    """:func:`conv_slot_bytes` of the built stages (``memory_limit``'s estimate): each piece's max pools traced
    (``reduce_window_max``, their inputs' shapes), its kernels the leaves of three or more dimensions (the first
    piece's sliced only)."""
    stages = []
    for s in range(plan.num_stages):
        pools, kernels = [], 0
        for layer in plan.stage_layers(s):
            pools += [(len(shape) + 1, math.prod(shape)) for shape in _pool_inputs(layer)]
            first = layer is plan.layers[0]
            kernels += sum((1 if first else 2) * math.prod(shape) for _, shape in layer.leaves if len(shape) >= 3)
        stages.append((pools, kernels))
    return _slot_bytes(stages, micro, itemsize)


def _slot_bytes(stages, micro: int, itemsize: int) -> int:
    """The largest stage's slot (:func:`conv_slot_bytes`): ``stages`` of ``(pools, kernel elements)``, each pool a
    ``(rank, elements of one example's input)``; 0 where no stage pools."""
    worst = 0
    for pools, kernels in stages:
        if pools:
            largest = max(n for _, n in pools)
            worst = max(worst, (sum((rank + 1) * n for rank, n in pools) + 2 * largest) * micro + kernels)
    return worst * itemsize


INPUT_SHARE = 0.15
PLANNER_INPUTS = ("a pipeline of convolutions whose inputs (the data shard's batch, gathered over the stages) are over "
                  "15 % of the planner's memory: XLA:CPU keeps two or three copies of them (gathered, re-laid out as "
                  "micro-batches, a stage's slice), which meet the peak or not by schedule; measured 0.96-1.48x the "
                  "estimate (VGG-A at 1/32 width and LeNet on 32x32 images)")


def planner_outside(plan) -> str:
    """Why the planner's memory of ``plan`` (a :class:`dtx.parallel.pipeline.plan.PipelinePlan`) may miss by more than
    15 % (:data:`PLANNER_INPUTS` where a pipeline of convolutions holds inputs over :data:`INPUT_SHARE` of it), or
    ``""``."""
    return PLANNER_INPUTS if plan.conv_bytes and plan.batch_bytes > INPUT_SHARE * plan.memory_bytes else ""


def _pool_inputs(layer) -> list[tuple[int, ...]]:
    """One example's input shape of each max pool (``reduce_window_max``) of a traced piece (no Dense layer pools)."""
    if layer.fn is None:
        return []
    params: dict = {}
    for path, shape in layer.leaves:
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = jax.ShapeDtypeStruct(shape, jnp.float32)
    for dtype in (jnp.float32, jnp.int32):  # the stages pass float32; only the first piece may take tokens
        try:
            jaxpr = jax.make_jaxpr(layer.fn)(params, jax.ShapeDtypeStruct((1,) + layer.in_shape, dtype))
            break
        except (TypeError, ValueError):
            continue
    else:
        return []
    return [tuple(eqn.invars[0].aval.shape[1:]) for eqn in _equations(jaxpr.jaxpr)
            if eqn.primitive.name == "reduce_window_max"]


def _equations(jaxpr):
    """A jaxpr's equations, its inner jaxprs' included."""
    import jax.extend.core as jex

    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, (jex.ClosedJaxpr, jex.Jaxpr)):
                    yield from _equations(getattr(sub, "jaxpr", sub))


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
    work_bytes: int = 0  # the working buffers (WORK_ROWS rows, WORK_MESSAGES messages, a max pool's backward)
    stages: int = 1  # P: a device's argument is 1/P of the gathered batch

    @property
    def memory_bytes(self) -> int:
        """The step's peak per device: parameters, optimizer state, the device's batch, the working rows, the kept
        inputs and the gathered batch (module docstring)."""
        return (self.params_bytes + self.optimizer_bytes + self.batch_bytes // self.stages + self.work_bytes
                + self.kept_bytes + self.batch_bytes)


def estimate(plan: StagePlan, schedule: Schedule, micro: int, data: int, optimizer: str = "adam",
             cluster: Cluster | None = None, itemsize: int = 4, example_bytes: int = 0,
             zero_stage: int = 0) -> PipelineEstimate:
    """The estimate for ``micro`` examples per micro-batch on ``data`` data shards (module docstring);
    ``example_bytes``: one example's inputs and labels; ``zero_stage=1``: ZeRO-1 (:mod:`dtx.parallel.pipeline.zero`),
    the optimizer state ``1/D`` of the (padded) row per device, the bytes unchanged (reduce-scatter + all-gather)."""
    if optimizer not in OPTIMIZER_SLOTS:
        raise ValueError(f"the pipeline model knows the optimizers {sorted(OPTIMIZER_SLOTS)}, not {optimizer!r}")
    row_bytes = plan.chunks * plan.row * itemsize
    message = plan.message_bytes(micro, itemsize)
    allreduce = costmodel.expected_traffic("ring", row_bytes, data, None, itemsize).bytes_sent if data > 1 else 0
    conv = stage_conv_slot_bytes(plan, micro, itemsize)
    step_s = None
    if cluster is not None:
        flops = max(plan.stage_flops) * micro  # the slowest (virtual) stage sets every tick's pace
        hop = cluster.latency + message / cluster.bandwidth
        forward = flops / cluster.node_flops + hop
        backward = 3 * flops / cluster.node_flops + hop  # re-run the forward, then twice its FLOPs back
        ring = 2 * (data - 1) * (cluster.latency + row_bytes / data / cluster.bandwidth) if data > 1 else 0.0
        step_s = schedule.slot_ticks("forward") * forward + schedule.slot_ticks("backward") * backward + ring
    return PipelineEstimate(schedule.bubble, schedule.messages, schedule.messages * message, allreduce, row_bytes,
                            OPTIMIZER_SLOTS[optimizer] * row_bytes // (data if zero_stage else 1),
                            schedule.slots * message,
                            schedule.micro * micro * example_bytes, step_s,
                            row_bytes + max((WORK_ROWS[schedule.name] - 1) * row_bytes
                                            + WORK_STAGE_ROWS * plan.row * itemsize, conv)
                            + WORK_MESSAGES * message + (SMALL_BUFFERS if conv else 0), plan.devices)


@dataclasses.dataclass(frozen=True)
class PipelineClock:
    """The simulated clock's model of a pipeline step (:class:`dtx.perf.simclock.SimClock` takes it in place of a
    data-parallel :class:`~dtx.perf.simclock.ClockModel`): the schedule timed tick by tick.

    The step is lock-step SPMD: every slot ends in a ``ppermute`` its neighbours wait for, so a slot lasts as long
    as the slowest device at work in it — device ``s`` of data shard ``d`` runs its stage's forward
    (``forward_s``) or backward (``backward_s``: the re-run forward and the two products) on one micro-batch,
    times its straggler multiplier of the step (:mod:`dtx.strategies.stragglers`, one per device) — and an idle
    device adds nothing. The data shards' pipelines run apart until the gradient all-reduce, so the step's
    compute is the slowest shard's; its bytes (point-to-point, the batch's gather, the all-reduce: the
    accountant's) are added at the link's α-β as every step's are. Without stragglers the busy share of a
    device's slots is the schedule's ``M/(M + P − 1)`` (``VM/(VM + P − 1)`` interleaved)."""

    schedule: Schedule
    forward_s: tuple[float, ...]  # per (virtual) stage, one micro-batch
    backward_s: tuple[float, ...]
    data: int
    latency: float
    bandwidth: float
    reduce_s_per_byte: float = 0.0
    stragglers: Any = None  # dtx.strategies.stragglers.Stragglers
    workers: int = 1  # SimClock's view: one step time per step
    drops: int = 0
    runs_ahead: int = 0
    local_models: bool = False
    overlaps: int = 0

    def compute(self, step: int) -> float:
        """The step's compute: its slots, each the slowest busy device's work, on the slowest data shard."""
        p, micro = self.schedule.stages, self.schedule.micro
        devices = p * self.data
        slow = (np.ones(devices) if self.stragglers is None
                else np.asarray(self.stragglers.multipliers(step, devices))).reshape(self.data, p)
        total = np.zeros(self.data)
        for kind, cost in (("forward", self.forward_s), ("backward", self.backward_s)):
            for phase in self.schedule.phases:
                table = getattr(phase, kind)
                if table is None:
                    continue
                virtual = (np.maximum(table, 0) // micro) * p + np.arange(p)  # the (virtual) stage of each slot
                work = np.where(table != IDLE, np.asarray(cost)[virtual], 0.0)  # (ticks, P)
                total += (work[None] * slow[:, None, :]).max(axis=2).sum(axis=1)
        return float(total.max())

    def busy(self) -> float:
        """Useful work over the devices' slot time, on the clock without stragglers: ``1 −`` the bubble."""
        useful = self.schedule.micro * (sum(self.forward_s) + sum(self.backward_s)) / self.schedule.stages
        return useful / dataclasses.replace(self, stragglers=None).compute(0)

    def comm(self, comm_bytes: float, comm_rounds: float):
        from dtx.perf.simclock import CommTime  # the clock's own accounting of a step's bytes

        return CommTime(self.latency * comm_rounds, comm_bytes / self.bandwidth, comm_bytes * self.reduce_s_per_byte)

    def worker_times(self, step: int, comm_s: float) -> np.ndarray:
        return np.array([self.compute(step) + comm_s])


def memory_estimate(stage_plan: StagePlan, schedule: Schedule, *, micro: int, data: int, optimizer: str = "adam",
                    example_bytes: int = 0, zero_stage: int = 0) -> MemoryEstimate:
    """A pipeline step's memory (:func:`estimate`'s model of :mod:`dtx.parallel.pipeline.step`; within 15 % of the
    compiled peak per schedule, ``tests/test_pipeline_parallel.py``) in :class:`dtx.perf.memory.MemoryEstimate`'s
    categories, as ``memory_limit``, the host check and ``dtx simulate --memory`` read it: the stage row as params,
    its accumulator as grads, the kept inputs and the batch as activations, the other working rows as buffers;
    ``zero_stage=1``: ZeRO-1's optimizer state, ``1/data`` of it (``tests/test_pipeline_zero.py``)."""
    e = estimate(stage_plan, schedule, micro, data, optimizer, example_bytes=example_bytes, zero_stage=zero_stage)
    activations = e.kept_bytes + e.batch_bytes + e.batch_bytes // e.stages
    return MemoryEstimate(f"pipeline ({schedule.name})", e.params_bytes, e.params_bytes, e.optimizer_bytes,
                          activations, e.work_bytes - e.params_bytes, e.memory_bytes, {}, {})


def clock_model(plan: StagePlan, schedule: Schedule, micro: int, data: int, cluster: Cluster,
                stragglers=None) -> PipelineClock:
    """The :class:`PipelineClock` of a pipeline of ``micro``-example micro-batches on ``cluster``: each stage's work
    by :func:`dtx.perf.model.compute_time`'s roofline of its pieces (their products' FLOPs, at the convolution
    efficiency where a piece holds a 4-d kernel) (forward 1/3 of it, the backward slot's
    re-run forward and two products 3/3), the link :func:`dtx.perf.simclock.link` of the ``stage`` x data devices."""
    from dtx.perf import model as perfmodel
    from dtx.perf.layers import Layer
    from dtx.perf.simclock import link

    seconds = []
    for s in range(plan.num_stages):
        layers = [Layer(x.name, "conv" if any(len(shape) == 4 for _, shape in x.leaves) else "dense", x.flops // 2,
                        x.size, x.in_width, x.out_width, (x.in_width, x.out_width)) for x in plan.stage_layers(s)]
        seconds.append(sum(perfmodel.compute_time(layer, cluster, micro) for layer in layers))
    alpha, bandwidth = link(cluster, plan.devices * data)
    terms = costmodel.cost_terms("ring", 1.0, max(data, 2))
    gamma = 3.0 / cluster.memory_bandwidth * terms.reduced_bytes / terms.path_bytes
    return PipelineClock(schedule, tuple(c / 3 for c in seconds), tuple(seconds), data, alpha, bandwidth, gamma,
                         stragglers)
