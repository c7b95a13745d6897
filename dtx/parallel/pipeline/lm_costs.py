"""A transformer pipeline as dtx runs it: the ``D × T × P`` plans of :mod:`dtx.perf.lm_plan` with ``P > 1``.

dtx's pipeline (:mod:`dtx.parallel.pipeline.step`, 1F1B here) cuts the decoder into the embedding with ``L/P`` blocks on
the first stage, ``L/P`` blocks on each further stage, and the final LayerNorm with the output layer on the last
(``pipeline.boundaries``: block ``k·L/P`` starts stage ``k``). A ``model`` axis of ``T`` splits each stage's blocks
Megatron's way (:mod:`dtx.parallel.pipeline.tensor_stages`). What that costs per device and step, ``b`` sequences per
micro-batch, ``t = b·S`` tokens, ``M`` micro-batches, the last stage the busiest (its output layer):

* **the output layer is the model's own** (``model.tie_embeddings=False``: the embedding lives on the first
  stage, the output layer on the last), ``V·d + V`` more parameters than GPT-2's tied one, whole on every device
  of the last stage's tensor group (it runs unsplit there);
* **compute**: each micro-batch's forward slot, and its backward slot, which re-runs the stage's forward from the
  kept input (GPipe's re-materialisation) before the backward: per token ``8·MACs`` of the blocks (``/T``) and
  ``8·d·V`` of the output layer, and the element-wise work of :data:`STAGE_ELEMENTWISE` (the residual stream's
  LayerNorms and adds whole on each device of a tensor group, the rest of a block's ``/T``); on a stage but
  the last the re-run skips the last block's MLP down-projection (only the stage's output reads it);
* **messages**: the schedule's ``2(M + P − 2)`` boundary messages of ``t·d`` activation elements
  (:mod:`dtx.parallel.pipeline.schedules`);
* **tensor**: per block and micro-batch 6 all-reduces of ``t·d`` elements over ``model`` (Megatron's 2 forward
  and 2 backward, the re-run's 2: :func:`dtx.parallel.pipeline.tensor_stages.stage_all_reduces`);
* **gradients**: the device's stage row (the largest stage's parameters a device holds: its ``1/T`` of the split
  kernels, the rest whole) all-reduced over the ``D`` data shards, once per step;
* **the batch**: each device's ``1/(P·T)`` of its data shard's tokens and labels (int32) all-gathered over the
  stages and the tensor group (dtx places every batch split over all devices);
* **memory** (:func:`memory_terms`): the row with its gradient, AdamW's moments and a second gradient row (the
  reduced one), the row's compute copy, the kept stage inputs (1F1B: at most ``2P − 1``), one micro-batch's
  activations of the stage's blocks (Korthikanti et al.'s bytes under ``T``) and its logits; on XLA:CPU
  (``backend="xla_cpu"``) as its buffer assignment holds them at the peak, the head's backward: one gradient row,
  the copy, inputs and activations in float32, 14 B per logit;
* **sequence parallelism** (``sp``, :mod:`dtx.parallel.pipeline.positions`): the messages and kept inputs carry
  ``t·d/T``; the residual stream's element-wise work, the final LayerNorm, the output layer and the loss run on
  ``t/T`` tokens; each all-reduce's place is taken by a
  reduce-scatter and an all-gather of the same bytes (the last stage, which the plan models, has no dead one), twice
  the collectives' latency; the row's replicated entries (``6d`` per block, and the first stage's embedding and
  positions or the last's LayerNorm and output layer, the larger) all-reduced over ``model`` once per step in
  float32; the blocks' activations Korthikanti et al.'s under SP, the logits ``1/T``;
* **ZeRO-1 over the data axes** (``zero=1``, ``pipeline.zero_stage=1``: :mod:`dtx.parallel.pipeline.zero`, Rajbhandari
  et al. 2020's P_os): the row padded to a multiple of ``D``, reduce-scattered over the data shards in the reduce
  dtype and its updated float32 slices all-gathered — the ring all-reduce's bytes and rounds (its two halves, now
  two collectives) when the gradients reduce in float32; each device updates, and keeps AdamW's moments of, ``1/D``
  of the row (as :func:`dtx.parallel.pipeline.costs.memory_estimate` with ``zero_stage=1``: the optimizer ``/D``, the rest
  unchanged);
* **ZeRO-3 over the data axes** (``zero=3``, ``fsdp.zero_stage=3``): the same collectives, the all-gather moved
  from after the update to before the first tick (each device stores ``1/D`` of its row between steps and gathers
  the whole row once per step, :func:`dtx.parallel.pipeline.zero.gather_row`), so the same bytes and time; its
  memory holds the stored slice beside the gathered row all step, ``4·row/D`` more than ZeRO-1 at the peak (it
  saves memory only between steps, where a checkpoint or another job could use it): the planner never prefers it
  to ZeRO-1 on time or peak memory, and lists it among the candidates.

What is not planned: ZeRO-2 with stages (dtx refuses it: the gradient is accumulated whole and reduced once) and
remat policies (a stage re-runs its forward anyway): the candidates leave them out.
"""

from __future__ import annotations

from dtx.parallel.pipeline.schedules import make_schedule
from dtx.parallel.tensor import costs as tensor_model
from dtx.perf import decoder
from dtx.perf.clusters import Cluster

SCHEDULE = "1f1b"
# Element-wise FLOPs per token XLA counts in the last stage's slots (its forward, the backward slot's re-run of it
# and the backward), apart from dtx.perf.lm_plan.ELEMENTWISE (one step's, fitted at MLP ratio 4: its "width" lumps
# the MLP's work, ∝ f, with the stream's, and a stage runs its forward twice). Per block: ``stream`` per width and
# ``stream_token`` (the two LayerNorms and residual adds: whole on each device of a tensor group, on its 1/T of the
# positions under SP), ``mlp`` per MLP width (GELU), ``width`` per width (the rest) and ``score`` per head and
# position (the softmax), split by T; the final LayerNorm (``head_width`` per width) and the output's bias, softmax
# and loss (``logit`` per class), whole but under SP. Read from the float32 slots compiled over model (T = 2,
# 1 and 2 blocks per stage, 4 sequences: one block's terms the difference, the stream's twice the TP run's excess
# over the SP run's) of transformers with 2 heads: width 16, MLP 2·16, 8 positions, vocabulary 32 (stream
# 1450 = 86·16 + 74, the rest 2786); MLP 4·16 (5057: 71 per f); 16 positions (3278: 30.8 per head and position);
# width 32 (stream 2826; the rest 5081: 1.5 per width); vocabulary 64 (head 22 per class; 34.9 per width from
# width 32's). Held out, chosen before measuring: width 32, 4 heads, MLP 4·32, 16 positions, vocabulary 64 at T=4
# TP (0.9985 of the compiled slots) and SP (1.0007), and --verify's D2xT2+SPxP2 twin (docs/pipeline.md).
STAGE_ELEMENTWISE = dict(stream=86.0, stream_token=74.0, mlp=71.0, width=1.5, score=30.8, head_width=34.9,
                         logit=22.0)


def boundaries(layers: int, stages: int) -> tuple[int, ...]:
    """``pipeline.boundaries`` of ``L/P`` blocks per stage (layer 0 the embedding, 1..L the blocks)."""
    per = layers // stages
    return tuple(1 + k * per for k in range(1, stages))


def stage_row(shape, tensor: int, stages: int, multiple: int = 1) -> int:
    """Parameters in a device's stage row: the largest stage's (the first: the embedding and positions; the last:
    the final LayerNorm and the output layer), each block's split kernels ``/T`` and the rest whole; padded to a
    multiple of ``multiple`` (ZeRO-1's ``D``: :attr:`dtx.parallel.pipeline.stages.StagePlan.row_multiple`)."""
    d, f = shape.width, shape.mlp_ratio * shape.width
    split, whole = 4 * d * d + 3 * d + 2 * f * d + f, 6 * d
    blocks = shape.layers // stages * (split // tensor + whole)
    first = blocks + shape.vocab * d + shape.seq * d
    last = blocks + 2 * d + shape.vocab * d + shape.vocab
    return -(-max(first, last) // multiple) * multiple


def costs(shape, cluster: Cluster, nodes: int, global_batch: int, tensor: int, stages: int, micro: int,
          elementwise: dict, *, reduce_bytes: int = 4, element: int = 2, sp: bool = False, zero: int = 0,
          backend: str = "gpu") -> dict:
    """The plan's figures (module docstring) as :class:`dtx.perf.lm_plan.LMPlan`'s fields; ``element``: bytes of an
    activation element in the messages and the tensor collectives (bf16 on a GPU; XLA:CPU moves float32); ``sp``:
    sequence parallelism inside the stages; ``zero``: ZeRO-1 or ZeRO-3 over the data axes (module docstring); ``backend``:
    whose memory, ``"gpu"`` or ``"xla_cpu"`` (:func:`memory_terms`)."""
    data = nodes // (tensor * stages)
    d, s, v = shape.width, shape.seq, shape.vocab
    per = shape.layers // stages
    b = global_batch // (data * micro)
    tokens = b * s
    block = shape.block
    # The last stage: its blocks' products (forward, re-run, backward: 8 MACs) and their inner element-wise work
    # split over T, the residual stream's whole but under SP, and the output layer (8·d·V) with the final LayerNorm
    # and the loss whole but under SP (each device's own positions): STAGE_ELEMENTWISE.
    e, f = STAGE_ELEMENTWISE, shape.mlp_ratio * d
    split = tensor if sp else 1
    inner = per * (8 * block.macs + e["mlp"] * f + e["width"] * d + e["score"] * shape.heads * s) / tensor
    stream = per * (e["stream"] * d + e["stream_token"]) / split
    head = (8 * d * v + e["logit"] * v + e["head_width"] * d) / split
    slots = micro * tokens * (inner + stream + head)
    row = stage_row(shape, tensor, stages, data if zero else 1)
    update = elementwise["update"] * row / (data if zero else 1)  # ZeRO-1/3: each data rank updates its slice
    rate = cluster.node_flops * cluster.efficiency["dense"]
    compute_s = (slots + update) / rate * (micro + stages - 1) / micro
    schedule = make_schedule(SCHEDULE, stages, micro)
    message = tokens * d * element // split
    p2p_bytes = schedule.messages * message
    local = 1 < stages <= cluster.local_size
    hop = (cluster.local_latency + message / cluster.local_bandwidth if local
           else cluster.latency + message / cluster.bandwidth)
    count = micro * 6 * per if tensor > 1 else 0
    tensor_bytes = count * tensor_model.bytes_sent("all-reduce", tokens * d * element, tensor)
    tensor_s = tensor_bytes / cluster.local_bandwidth + count * (2 if sp else 1) * cluster.local_latency
    batch = global_batch // (data * stages * tensor) * s * 4  # a device's tokens (and as many labels), int32
    per_machine = max(1, cluster.local_size // (tensor * stages))  # data shards on one machine
    if zero:  # the ring all-reduce's two halves as collectives of their own: the gradient row reduce-scattered
        # (reduce dtype), the updated float32 slices all-gathered (dtx.parallel.pipeline.zero.traffic)
        grad_bytes = (tensor_model.bytes_sent("reduce-scatter", row * reduce_bytes, data)
                      + tensor_model.bytes_sent("all-gather", row // data * 4, data))
        grad_s = (cluster.allreduce_time(row * reduce_bytes, data, per_machine)
                  + cluster.allreduce_time(row * 4, data, per_machine)) / 2
    else:
        grad_bytes = tensor_model.bytes_sent("all-reduce", row * reduce_bytes, data)
        grad_s = cluster.allreduce_time(row * reduce_bytes, data, per_machine)
    grad_bytes += 2 * tensor_model.bytes_sent("all-gather", batch, stages * tensor)
    if sp:  # the replicated entries of the row, float32, summed over model once per step
        replicated = 4 * (per * 6 * d + max(v * d + s * d, 2 * d + v * d + v))
        grad_bytes += tensor_model.bytes_sent("all-reduce", replicated, tensor)
        grad_s += cluster.allreduce_time(replicated, tensor, tensor)
    memory = memory_terms(shape, row, data, tensor, stages, micro, tokens, sp, zero, backend)
    return dict(flops=slots + update, update_flops=update, compute_s=compute_s, tensor_s=tensor_s,
                p2p_s=schedule.messages * hop, grad_s=grad_s, tensor_bytes=tensor_bytes, p2p_bytes=p2p_bytes,
                grad_bytes=grad_bytes, memory=memory)


# Bytes per logit at the last stage's head backward: the bf16 logits' gradient and the loss's float32 softmax (GPU);
# on XLA:CPU the bf16 gradient and three float32 copies of it, one for each of the output layer's two products and
# one for its bias's sum over the tokens (the untied layer has a bias): read from D2xT2xP2's buffer assignment.
LOGIT_BYTES = dict(gpu=2 + 4, xla_cpu=2 + 3 * 4)


def memory_terms(shape, row: int, data: int, tensor: int, stages: int, micro: int, tokens: int, sp: bool, zero: int,
                 backend: str = "gpu") -> dict:
    """Bytes per device of the last stage (module docstring, **memory**), ``tokens`` per micro-batch; their sum is the
    modelled peak. ``"gpu"``: the row with its gradient, AdamW's moments, a second gradient row (the reduced one) and
    the row's bf16 compute copy, the kept stage inputs (bf16), one micro-batch's activations and logits, all at once.
    ``"xla_cpu"``: what XLA:CPU's buffer assignment holds at the peak, the head's backward in a backward slot (read
    from D2xT2xP2, D2xT2+SPxP2 and D2xT2xP2 ZeRO-1 at --verify's twin): the parameter row and the moments, the
    accumulated gradient row (one: the reduced one comes after), a float32 compute copy of the row, the kept inputs
    and the activations in float32, the logits at :data:`LOGIT_BYTES`. (Its update, AdamW on the rows: six rows at
    D2xT2xP2, 0.67 of the head's backward there; not modelled.)"""
    d, v = shape.width, shape.vocab
    cpu = backend == "xla_cpu"
    split = tensor if sp else 1
    element = 4 if cpu else decoder.COMPUTE
    kept = min(2 * stages - 1, micro) * tokens * d * element // split
    act = shape.layers // stages * tokens * shape.block.activation_bytes(tensor, sp, "none")
    stored = 4 * row // data if zero == 3 else 0  # ZeRO-3: the slice kept between steps, beside the gathered row
    return dict(params=4 * row + stored, grads=(4 if cpu else 8) * row, optimizer=8 * row // (data if zero else 1),
                compute_copy=decoder.COMPUTE_COPY[backend] * row,
                activations=kept + decoder.ACTIVATION_WIDENING[backend] * act,
                logits=tokens * v * LOGIT_BYTES[backend] / split)
