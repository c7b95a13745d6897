"""Sequence parallelism inside pipeline stages split over ``model`` (:mod:`dtx.parallel.pipeline.tensor_stages`).

``tensor.sequence_parallel=True`` with ``parallel.name=pipeline`` (Korthikanti et al. 2022, *Reducing Activation
Recomputation in Large Transformer Models*, arXiv 2205.05198, §4.2.2): the residual stream between the regions
is split over ``model`` by positions, so LayerNorms and the residual adds run on ``1/T`` of the tokens; ``f``
all-gathers the positions (its gradient reduce-scattered) and ``g`` reduce-scatters the row layer's partial sums
onto them (its gradient all-gathered): the same bytes as the all-reduces they replace. Then:

* **the boundary buffer** carries a device's ``1/T`` of the positions to the same ``model`` index of the next
  stage: Narayanan et al.'s scatter/gather at the boundary, for nothing (no collective is added);
* **the ends**: the model's first piece (the embedding, a lookup) runs on the whole sequence and each device keeps
  its own positions (as Megatron scatters the embedding's output); the last stage scores its own positions
  against their labels and adds ``1/T`` of their mean, the loss and metrics summed over ``model``
  (:mod:`dtx.parallel.pipeline.step`);
* **replicated parameters' gradients** come from each device's own positions: the row's replicated entries are
  all-reduced over ``model`` once per step (:func:`sum_replicated`), before the row's all-reduce over data.

Here: ``f`` and ``g`` over the positions (custom VJPs, as the tensor-parallel pair), a device's own positions, the
refusal of a stream ``T`` does not split, and the replicated gradients' sum. A plan without SP passes through
every function unchanged.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dtx import mesh as mesh_lib
from dtx.parallel.pipeline.stages import STAGE_AXIS, PipelineError, StagePlan

MODEL = mesh_lib.MODEL_AXIS


def _gather(x):
    return jax.lax.all_gather(x, MODEL, axis=1, tiled=True)


def _scatter(x):
    return jax.lax.psum_scatter(x, MODEL, scatter_dimension=1, tiled=True)


@jax.custom_vjp
def gather_from_model(x):
    """Sequence parallelism's ``f`` (Korthikanti et al., arXiv 2205.05198, §4.2.2): the region's input, split over
    ``model`` by positions, all-gathered; its gradient reduce-scattered back onto the positions."""
    return _gather(x)


gather_from_model.defvjp(lambda x: (_gather(x), None), lambda _, g: (_scatter(g),))


@jax.custom_vjp
def scatter_to_model(x):
    """Sequence parallelism's ``g``: the row layer's partial sums reduce-scattered onto the positions; its gradient
    all-gathered."""
    return _scatter(x)


scatter_to_model.defvjp(lambda x: (_scatter(x), None), lambda _, g: (_gather(g),))


def own_positions(x, tensor: int):
    """This device's ``1/T`` of ``x``'s positions (axis 1), by its ``model`` index: the stream's split under SP."""
    n = x.shape[1] // tensor
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(MODEL) * n, n, axis=1)


def positions_split(plan: StagePlan) -> int:
    """Over how many devices of ``model`` a pipeline's stream is split by positions (``T`` under SP, else 1)."""
    return getattr(plan, "positions_split", 1)  # a TensorStagePlan's


def arriving_shape(plan: StagePlan, layer) -> tuple[int, ...]:
    """The shape of one example's input to ``layer`` as a device receives it (under SP its ``1/T`` of the
    positions, over a ``context`` axis its ``1/C``: the plan's ``local_shape``)."""
    return plan.local_shape(layer.in_shape)


def check_positions(plan) -> None:
    """Under SP every piece after the first takes a ``(positions, features)`` stream that ``T`` splits."""
    size = plan.tensor
    for layer in plan.layers[1:]:
        length = layer.in_shape[0] if len(layer.in_shape) == 2 else None
        if length is None or length % size:
            fits = [n for n in range(size, 4 * size + 1, size)]
            what = (f"{length} positions" if length is not None else f"input shaped {layer.in_shape} (not "
                    "(positions, features))")
            raise PipelineError(f"tensor.sequence_parallel=True splits pipeline piece {layer.name!r}'s {what} over "
                                f"the {MODEL!r} axis of size {size}, which does not divide them; use a sequence "
                                f"length that {size} divides (dataset.seq_len, e.g. {fits}), or "
                                "tensor.sequence_parallel=False")


def replicated_spans(plan, device: int) -> tuple[tuple[int, int], ...]:
    """``(start, stop)`` of the entries of device ``device``'s ``V`` stage rows that hold leaves not split over
    ``model`` (adjacent ones merged)."""
    split, spans = {path for path, _ in plan.splits}, []
    for c in range(plan.chunks):
        offset = c * plan.row
        for layer in plan.stage_layers(c * plan.devices + device):
            for path, shape in layer.leaves:
                size = math.prod(plan.leaf_shape(path, shape))
                if tuple(path) not in split:
                    if spans and spans[-1][1] == offset:
                        spans[-1] = (spans[-1][0], offset + size)
                    else:
                        spans.append((offset, offset + size))
                offset += size
    return tuple(spans)


def replicated_size(plan) -> int:
    """The most replicated entries a device's rows hold (what :func:`sum_replicated` all-reduces)."""
    return max(sum(b - a for a, b in replicated_spans(plan, s)) for s in range(plan.devices))


def sum_replicated(plan: StagePlan, grads):
    """Under SP, the gradient row's replicated entries (LayerNorms, biases, the embedding, positions and the head,
    each used on this device's ``1/T`` of the positions) summed over ``model``, once per step: one all-reduce of
    :func:`replicated_size` entries (Korthikanti et al.'s reduction of the LayerNorms' gradients). The split
    kernels' gradients are whole already (their regions gather the positions)."""
    if positions_split(plan) == 1:
        return grads
    size = replicated_size(plan)
    spans = [replicated_spans(plan, s) for s in range(plan.devices)]

    def take(device):
        def run(g):
            flat = jnp.concatenate([g[a:b] for a, b in spans[device]])
            return jnp.pad(flat, (0, size - flat.shape[0]))
        return run

    def put(device):
        def run(g, summed):
            done = 0
            for a, b in spans[device]:
                g = jax.lax.dynamic_update_slice_in_dim(g, summed[done:done + b - a], a, 0)
                done += b - a
            return g
        return run

    stage = jax.lax.axis_index(STAGE_AXIS)
    summed = jax.lax.psum(jax.lax.switch(stage, [take(s) for s in range(plan.devices)], grads), MODEL)
    return jax.lax.switch(stage, [put(s) for s in range(plan.devices)], grads, summed)
