"""A transformer pipeline as dtx runs it: the ``D × T × P`` plans of :mod:`dtx.perf.lm_plan` with ``P > 1``.

dtx's pipeline (:mod:`dtx.step.pipeline`, 1F1B here) cuts the decoder into the embedding with ``L/P`` blocks on
the first stage, ``L/P`` blocks on each further stage, and the final LayerNorm with the output layer on the last
(``pipeline.boundaries``: block ``k·L/P`` starts stage ``k``). A ``model`` axis of ``T`` splits each stage's blocks
Megatron's way (:mod:`dtx.parallel.tensor_stages`). What that costs per device and step, ``b`` sequences per
micro-batch, ``t = b·S`` tokens, ``M`` micro-batches, the last stage the busiest (its output layer):

* **the output layer is the model's own** (``model.tie_embeddings=False``: the embedding lives on the first
  stage, the output layer on the last), ``V·d + V`` more parameters than GPT-2's tied one, whole on every device
  of the last stage's tensor group (it runs unsplit there);
* **compute**: each micro-batch's forward slot, and its backward slot, which re-runs the stage's forward from the
  kept input (GPipe's re-materialisation) before the backward: per token ``8·MACs`` of the blocks (``/T``) and
  ``8·d·V`` of the output layer, the element-wise work :data:`dtx.perf.lm_plan.ELEMENTWISE` counts; on a stage but
  the last the re-run skips the last block's MLP down-projection (only the stage's output reads it);
* **messages**: the schedule's ``2(M + P − 2)`` boundary messages of ``t·d`` activation elements
  (:mod:`dtx.parallel.pipeline_schedules`);
* **tensor**: per block and micro-batch 6 all-reduces of ``t·d`` elements over ``model`` (Megatron's 2 forward
  and 2 backward, the re-run's 2: :func:`dtx.parallel.tensor_stages.stage_all_reduces`);
* **gradients**: the device's stage row (the largest stage's parameters a device holds: its ``1/T`` of the split
  kernels, the rest whole) all-reduced over the ``D`` data shards, once per step;
* **the batch**: each device's ``1/(P·T)`` of its data shard's tokens and labels (int32) all-gathered over the
  stages and the tensor group (dtx places every batch split over all devices);
* **memory**: the row with its gradient, AdamW's moments and a second gradient row (the reduced one), the kept
  stage inputs (1F1B: at most ``2P − 1``), one micro-batch's activations of the stage's blocks (Korthikanti et
  al.'s bytes under ``T``) and its logits.

What is not modelled: ZeRO, sequence parallelism and remat policies with stages (dtx's pipeline does not combine
them: the candidates leave them out).
"""

from __future__ import annotations

from dtx.parallel.pipeline_schedules import make_schedule
from dtx.perf import tensor as tensor_model
from dtx.perf.clusters import Cluster

SCHEDULE = "1f1b"


def boundaries(layers: int, stages: int) -> tuple[int, ...]:
    """``pipeline.boundaries`` of ``L/P`` blocks per stage (layer 0 the embedding, 1..L the blocks)."""
    per = layers // stages
    return tuple(1 + k * per for k in range(1, stages))


def stage_row(shape, tensor: int, stages: int) -> int:
    """Parameters in a device's stage row: the largest stage's (the first: the embedding and positions; the last:
    the final LayerNorm and the output layer), each block's split kernels ``/T`` and the rest whole."""
    d, f = shape.width, shape.mlp_ratio * shape.width
    split, whole = 4 * d * d + 3 * d + 2 * f * d + f, 6 * d
    blocks = shape.layers // stages * (split // tensor + whole)
    first = blocks + shape.vocab * d + shape.seq * d
    last = blocks + 2 * d + shape.vocab * d + shape.vocab
    return max(first, last)


def costs(shape, cluster: Cluster, nodes: int, global_batch: int, tensor: int, stages: int, micro: int,
          elementwise: dict, *, reduce_bytes: int = 4, element: int = 2) -> dict:
    """The plan's figures (module docstring) as :class:`dtx.perf.lm_plan.LMPlan`'s fields; ``element``: bytes of an
    activation element in the messages and the tensor collectives (bf16 on a GPU; XLA:CPU moves float32)."""
    data = nodes // (tensor * stages)
    d, s, v = shape.width, shape.seq, shape.vocab
    per = shape.layers // stages
    b = global_batch // (data * micro)
    tokens = b * s
    block = shape.block
    # The last stage: its blocks (forward, re-run, backward: 8 MACs; element-wise as one device's) split over T,
    # and the output layer (8·d·V) with the loss's element-wise work, whole.
    blocks = per * (8 * block.macs + elementwise["width"] * d + elementwise["score"] * shape.heads * s)
    head = 8 * d * v + elementwise["logit"] * v
    slots = micro * tokens * (blocks / tensor + head)
    row = stage_row(shape, tensor, stages)
    update = elementwise["update"] * row
    rate = cluster.node_flops * cluster.efficiency["dense"]
    compute_s = (slots + update) / rate * (micro + stages - 1) / micro
    schedule = make_schedule(SCHEDULE, stages, micro)
    message = tokens * d * element
    p2p_bytes = schedule.messages * message
    local = 1 < stages <= cluster.local_size
    hop = (cluster.local_latency + message / cluster.local_bandwidth if local
           else cluster.latency + message / cluster.bandwidth)
    count = micro * 6 * per if tensor > 1 else 0
    tensor_bytes = count * tensor_model.bytes_sent("all-reduce", message, tensor)
    tensor_s = tensor_bytes / cluster.local_bandwidth + count * cluster.local_latency
    batch = global_batch // (data * stages * tensor) * s * 4  # a device's tokens (and as many labels), int32
    grad_bytes = (tensor_model.bytes_sent("all-reduce", row * reduce_bytes, data)
                  + 2 * tensor_model.bytes_sent("all-gather", batch, stages * tensor))
    grad_s = cluster.allreduce_time(row * reduce_bytes, data, max(1, cluster.local_size // (tensor * stages)))
    kept = min(2 * stages - 1, micro) * tokens * d * element
    act = per * tokens * block.activation_bytes(tensor, False, "none") + tokens * v * (element + 4)
    memory = dict(params=4 * row, grads=8 * row, optimizer=8 * row, compute_copy=0.0, activations=kept + act)
    return dict(flops=slots + update, update_flops=update, compute_s=compute_s, tensor_s=tensor_s,
                p2p_s=schedule.messages * hop, grad_s=grad_s, tensor_bytes=tensor_bytes, p2p_bytes=p2p_bytes,
                grad_bytes=grad_bytes, memory=memory)
