"""Data × pipeline plans: how many stages, how many micro-batches, per node count, under the device's memory.

Das et al.'s planner (:mod:`dtx.perf.model`, arXiv 1602.06709 §3) splits work *within* a layer; pipeline
parallelism (GPipe: Huang et al. 2019, arXiv 1811.06965; 1F1B: Narayanan et al. 2021, arXiv 2006.09503)
splits the layer stack *between* devices. On ``N`` nodes as ``P`` stages × ``D = N/P`` data shards, a
global batch ``B`` in ``M`` micro-batches of ``b = B/(D·M)`` examples costs (one device, one step):

* **compute with its bubble** — every tick costs the slowest stage's forward and backward of one
  micro-batch (the roofline of :func:`dtx.perf.model.compute_time`, times 4/3: dtx's step re-runs a stage's
  forward in its backward slot, :mod:`dtx.parallel.pipeline.step`), and a step has ``M + P − 1`` such ticks: the
  useful work times the bubble factor ``(M + P − 1)/M``. **Interleaved** (Narayanan et al. 2021, arXiv
  2104.04473, §2.2.2), ``V`` virtual stages per device: the layers are cut into ``P·V`` stages, a tick costs
  the slowest of them (about ``1/V`` of a device's work) and a step has ``V·M + P − 1`` ticks, so the busy
  share is ``V·M/(V·M + P − 1)``;
* **point-to-point** — the boundary activations forward and their gradients back: ``2·M`` messages of
  ``b × width × e`` per stage with neighbours on both sides (dtx's lock-step program sends ``2(M + P − 2)``,
  its bubble ticks included, of one buffer as wide as the widest boundary: :mod:`dtx.parallel.pipeline.costs`, the
  count the compiled program shows; interleaved, ``V`` times as many: the schedule's count), each
  ``α + n/β`` on the cluster's local link when the ``stage`` axis fits one machine, else on the network;
* **the batch** — dtx places every batch split over all devices, so a data shard's ``P`` stages gather its
  ``B/D`` examples once per step (a ring all-gather of ``example_bytes`` each);
* **gradient all-reduce** — the device's row, ``V`` times the largest (virtual) stage's ``W·e``, over its ``D``
  data replicas (ring, α-β);
* **memory** — :mod:`dtx.parallel.pipeline.costs`'s per-device model (the stage's parameter row, optimizer state,
  working rows, the schedule's kept inputs, the batch), against ``Cluster.device_memory``; for a pipeline of
  convolutions, the costliest stage's backward slot (its pools' index arrays, the largest pool's convolution output,
  the stage's kernels sliced and flipped: :func:`dtx.parallel.pipeline.costs.conv_slot_bytes`) in place of the row-sized
  temporaries where larger, and the program's small buffers.

The stages are cut to balance the roofline costs (:func:`dtx.parallel.pipeline.stages.balance`) and the schedule is
``1f1b`` (GPipe's time, fewer kept inputs) or, with ``V`` in :data:`CHUNKS` above 1, ``interleaved`` (dtx runs
it in GPipe's order: it keeps ``V·M`` inputs, the memory term that limits it). :func:`best` puts the fastest
pipeline that fits beside Das et al.'s plan of the same nodes and keeps the faster. Tensor (Megatron)
parallelism is not planned here: a third factor of the mesh would enter through :data:`FACTORS`.

A plan is ``runnable`` where the model's declared pipeline pieces (``pipeline_layers()``) are the planned layers
in order (the MLP, the speech DNN, VGG-A, whose plan adds ``--config.model.dropout_rate=0`` to its overrides:
``fixes``); otherwise it is printed as modelled, without overrides. A transformer is planned as one layer per block
(:func:`transformer_layers`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dtx.comm import costmodel
from dtx.parallel.pipeline.costs import (
    OPTIMIZER_SLOTS,
    SMALL_BUFFERS,
    WORK_MESSAGES,
    WORK_ROWS,
    WORK_STAGE_ROWS,
    conv_slot_bytes,
)
from dtx.parallel.pipeline.schedules import make_schedule
from dtx.parallel.pipeline.stages import balance
from dtx.perf import decoder
from dtx.perf import model as perfmodel
from dtx.perf.clusters import Cluster
from dtx.perf.layers import Layer

SCHEDULE = "1f1b"
CHUNKS = (1, 2, 4)  # V candidates: 1 plans 1F1B, more the interleaved schedule
RECOMPUTE = 4 / 3  # dtx re-runs a stage's forward in its backward slot: forward + (forward + 2·forward)
FACTORS = ("data", "stage")  # the mesh factors planned; "tensor" (parallel.name=tensor) would be a third
MICRO_PER_STAGE = (1, 2, 4, 8, 16)  # M = k·P candidates


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """``stages`` × ``data`` nodes, ``micro`` micro-batches of ``micro_batch`` examples; per device per step."""

    nodes: int
    global_batch: int
    stages: int
    data: int
    micro: int
    micro_batch: int
    boundaries: tuple[int, ...]  # the first layer of (virtual) stages 1..PV-1
    bubble: float  # (P - 1)/(VM + P - 1)
    compute_s: float
    p2p_s: float
    allreduce_s: float
    p2p_bytes: float  # dtx's 2(M + P - 2) messages of the padded buffer
    allreduce_bytes: float
    gather_bytes: float  # the batch's all-gather over the stages
    row_bytes: float  # the device's row: V times the largest (virtual) stage's parameters
    optimizer_bytes: float
    kept_bytes: float  # the schedule's kept stage inputs
    message_bytes: float  # one micro-batch's activation buffer
    batch_bytes: float  # the data shard's batch, gathered
    stage_flops: float  # the busiest stage's training FLOPs per step, recomputed forward included
    imbalance: float = 1.0  # the slowest stage's roofline time over the mean stage's
    runnable: bool = True
    chunks: int = 1  # V: virtual stages per device (the interleaved schedule when > 1)
    fixes: tuple[str, ...] = ()  # overrides the model needs to run as a pipeline (VGG-A: no dropout)
    conv_bytes: float = 0.0  # a convolutional stage's backward slot (dtx.parallel.pipeline.costs.conv_slot_bytes)
    order: str = SCHEDULE  # the schedule with V = 1 (the planner plans 1F1B; gpipe for the memory model's checks)

    @property
    def schedule(self) -> str:
        return "interleaved" if self.chunks > 1 else self.order

    @property
    def memory(self) -> dict[str, float]:
        """Per-device bytes by :mod:`dtx.perf.memory`'s categories (:mod:`dtx.parallel.pipeline.costs`'s model): the row as
        params, its accumulator as grads, the other working rows as buffers, kept inputs and batch as activations.
        A pipeline of convolutions (``conv_bytes``: :func:`dtx.parallel.pipeline.costs.conv_slot_bytes`) runs its costliest
        slot's pools and kernel copies where the row-sized buffers are not live (the larger of the two counts) and
        holds the program's small buffers (read from XLA:CPU's buffer assignments, docs/pipeline.md)."""
        conv = self.conv_bytes > 0
        return dict(params=self.row_bytes, grads=self.row_bytes, optimizer=self.optimizer_bytes,
                    activations=self.kept_bytes + self.batch_bytes + self.batch_bytes / self.stages,
                    buffers=max((WORK_ROWS[self.schedule] - 1) * self.row_bytes
                                + WORK_STAGE_ROWS * self.row_bytes / self.chunks, self.conv_bytes)
                    + WORK_MESSAGES * self.message_bytes + (SMALL_BUFFERS if conv else 0))

    @property
    def memory_bytes(self) -> float:
        return sum(self.memory.values())

    @property
    def time(self) -> float:
        return self.compute_s + self.p2p_s + self.allreduce_s

    @property
    def bytes_sent(self) -> float:
        """Everything one device sends per step (the loss's scalars aside)."""
        return self.p2p_bytes + self.allreduce_bytes + self.gather_bytes

    def overrides(self) -> list[str]:
        """The ``dtx train`` overrides that run this plan."""
        chunks = [f"--config.pipeline.virtual_stages={self.chunks}"] if self.chunks > 1 else []
        return [f"--config.mesh='((\"stage\", {self.stages}), (\"data\", {self.data}))'",
                "--config.parallel.name=pipeline", f"--config.pipeline.schedule={self.schedule}", *chunks,
                f"--config.pipeline.microbatches={self.micro}",
                f"--config.pipeline.boundaries='{tuple(self.boundaries)}'", *self.fixes]

    def text(self) -> str:
        return f"pipeline {self.stages}x{self.data} M={self.micro}" + (f" V={self.chunks}" if self.chunks > 1 else "")


def transformer_layers(num_layers: int, d_model: int, seq: int, vocab: int = 50257, heads: int = 12,
                       mlp_ratio: int = 4) -> tuple[Layer, ...]:
    """A GPT-2-style decoder as pipeline layers, as dtx cuts it (``Transformer.pipeline_layers``): the embedding with
    the positions, one layer per block (:class:`dtx.perf.decoder.Block`, the source :mod:`dtx.perf.lm_plan` reads
    too: its weights, and its products' multiply-adds per token, attention's ``2·S·d`` included), and the final
    LayerNorm with the (untied) output layer; an example is one sequence of ``seq`` tokens, and each boundary
    carries ``seq × d_model`` activations."""
    d, t, block = d_model, seq, decoder.Block(d_model, heads, seq, mlp_ratio)
    layers = [Layer("embed", "dense", 0, vocab * d + t * d, t, t * block.boundary, (vocab, d))]
    layers += [Layer(f"block{i}", "dense", t * block.macs, block.params, t * d, t * block.boundary,
                     (d, block.dense_macs // d)) for i in range(num_layers)]
    layers.append(Layer("head", "dense", t * decoder.head_macs(d, vocab), d * vocab + vocab + 2 * d, t * d,
                        t * vocab, (d, vocab)))
    return tuple(layers)


def _hop(cluster: Cluster, nbytes: float, stages: int) -> float:
    local = 1 < stages <= cluster.local_size
    return (cluster.local_latency + nbytes / cluster.local_bandwidth if local
            else cluster.latency + nbytes / cluster.bandwidth)


def plan(layers: Sequence[Layer], cluster: Cluster, nodes: int, global_batch: int, stages: int, micro: int, *,
         optimizer: str = "adam", algorithm: str = "ring", example_bytes: float | None = None,
         runnable: bool = True, chunks: int = 1, fixes: tuple[str, ...] = (), schedule: str = SCHEDULE) -> PipelinePlan:
    """The plan of ``stages`` × ``nodes/stages`` with ``micro`` micro-batches and ``chunks`` virtual stages per device
    (module docstring); ``example_bytes``: one example's inputs and label (default: the first layer's input in float32
    and an int32 label); ``schedule``: ``1f1b`` or ``gpipe`` where ``chunks`` is 1 (the same time, GPipe keeps ``M``
    inputs)."""
    data, e, v = nodes // stages, cluster.bytes_per_element, chunks
    example_bytes = 4 * layers[0].in_elements + 4 if example_bytes is None else example_bytes
    b = global_batch // (data * micro)
    costs = [perfmodel.compute_time(layer, cluster, b) for layer in layers]
    cuts = balance(costs, stages * v)
    bounds = (0, *cuts, len(layers))
    spans = [layers[bounds[s]:bounds[s + 1]] for s in range(stages * v)]
    stage_costs = [sum(costs[bounds[s]:bounds[s + 1]]) for s in range(stages * v)]
    tick = max(stage_costs) * RECOMPUTE
    # dtx's buffer: the widest boundary, as the next stage receives it (a convolution's output before its max pool
    # is the analysed layer's; what crosses is the pooled map, the next layer's input)
    width = max(span[0].in_elements for span in spans[1:]) if len(spans) > 1 else 0
    message = b * width * e
    order, schedule = schedule, make_schedule("interleaved" if v > 1 else schedule, stages, micro, v)
    row = v * max(sum(layer.weights for layer in span) for span in spans) * e
    allreduce_bytes = costmodel.cost_terms(algorithm, row, data).path_bytes if data > 1 else 0.0
    allreduce_s = cluster.allreduce_time(row, data, max(1, cluster.local_size // stages), algorithm)
    kept = schedule.slots * message
    batch = micro * b * example_bytes
    gather = costmodel.all_gather_traffic(batch / stages, stages).bytes_sent
    # Forward, re-run forward, and the two backward products of every layer of a device's V stages; the first stage's
    # first layer has no input gradient to compute.
    work = [4 * sum(layer.forward_flops for layer in span) - (span[0].forward_flops if s == 0 else 0)
            for s, span in enumerate(spans)]
    flops = max(sum(work[c * stages + d] for c in range(v)) for d in range(stages)) * b * micro
    p2p_s = schedule.messages * _hop(cluster, message, stages) + (stages - 1) * _hop(cluster, batch / stages, stages)
    ticks = schedule.slot_ticks("forward")  # M + P - 1, or VM + P - 1 interleaved
    return PipelinePlan(nodes, global_batch, stages, data, micro, b, cuts, schedule.bubble, ticks * tick, p2p_s,
                        allreduce_s, schedule.messages * message, allreduce_bytes, gather, row,
                        OPTIMIZER_SLOTS.get(optimizer, 2) * row, kept, message, batch, flops,
                        max(stage_costs) * len(spans) / sum(stage_costs), runnable, v, fixes,
                        conv_slot_bytes(layers, bounds, b, e), order)


def candidates(layers: Sequence[Layer], cluster: Cluster, nodes: int, global_batch: int, **kwargs) -> list[PipelinePlan]:
    """Every pipeline of ``nodes``: ``P`` from 2 to the layers dividing ``nodes``, ``M = k·P`` dividing each data
    shard's batch, ``V`` of :data:`CHUNKS` where the ``P·V`` stages have a layer each."""
    out = []
    for stages in range(2, min(nodes, len(layers)) + 1):
        if nodes % stages or global_batch % (nodes // stages):
            continue
        local = global_batch // (nodes // stages)
        for k in MICRO_PER_STAGE:
            for v in CHUNKS:
                if local % (k * stages) == 0 and stages * v <= len(layers):
                    out.append(plan(layers, cluster, nodes, global_batch, stages, k * stages, chunks=v,
                                    **kwargs))
    return out


def best(layers: Sequence[Layer], cluster: Cluster, nodes: int, global_batch: int, das: perfmodel.Plan | None,
         das_memory: float, overlap: str = "none", **kwargs) -> tuple[object, list[PipelinePlan]]:
    """The faster of Das et al.'s plan ``das`` (``das_memory`` bytes per device) and the fastest pipeline that fits
    the node's memory, and the pipelines that fit (fastest first). ``None`` when nothing fits."""
    fitting = sorted((p for p in candidates(layers, cluster, nodes, global_batch, **kwargs)
                      if p.memory_bytes <= cluster.device_memory), key=lambda p: (p.time, p.micro, p.chunks))
    options = ([(das.times[overlap], das)] if das is not None and das_memory <= cluster.device_memory else [])
    options += [(p.time, p) for p in fitting[:1]]
    chosen = min(options, key=lambda o: o[0] * (1 + 1e-12 * isinstance(o[1], PipelinePlan)))[1] if options else None
    return chosen, fitting


def why(chosen, das: perfmodel.Plan | None, das_memory: float, fitting: Sequence[PipelinePlan],
        cluster: Cluster, overlap: str = "none") -> str:
    """One sentence: why ``chosen`` won."""
    if chosen is None:
        return "nothing fits the node's memory"
    if isinstance(chosen, PipelinePlan):
        if das is None or das_memory > cluster.device_memory:
            return (f"data/hybrid needs {das_memory / 2**30:.1f} GiB per node, over the node's memory; the stages "
                    "split the weights")
        return (f"{das.times[overlap] / chosen.time:.2f}x faster than {perfmodel.plan_text(das)}: its gradient "
                f"all-reduce covers 1/{chosen.stages} of the weights over {chosen.data} nodes; bubble "
                f"{chosen.bubble:.0%}" + (f" ({chosen.chunks} virtual stages per device)" if chosen.chunks > 1 else ""))
    if not fitting:
        return "no pipeline fits or divides the batch"
    top = fitting[0]
    return (f"the best pipeline ({top.text()}) is {top.time / chosen.times[overlap]:.2f}x slower: its compute "
            f"{top.compute_s * 1e3:.3g} ms carries the bubble ({top.bubble:.0%}), the re-run forward (4/3) and the "
            f"slowest stage ({top.imbalance:.2f}x the mean); messages {top.p2p_s * 1e3:.2g} ms, all-reduce "
            f"{top.allreduce_s * 1e3:.2g} ms")


def text(p) -> str:
    """A plan of either kind in one line."""
    return p.text() if isinstance(p, PipelinePlan) else perfmodel.plan_text(p)
