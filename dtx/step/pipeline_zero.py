"""ZeRO-1 over the data axes for a pipeline's stage rows (``pipeline.zero_stage=1``): the distributed optimizer.

ZeRO stage 1 (Rajbhandari et al. 2020, "ZeRO: memory optimizations toward training trillion parameter models",
arXiv 1910.02054, §5.1, P_os) partitions the optimizer state over the ``D`` data-parallel ranks: each rank keeps and
updates ``1/D`` of it. A pipeline device holds its stages' parameters as one flat row (:mod:`dtx.parallel.stages`),
so the partition is a slice of that row, as Megatron-LM's distributed optimizer slices its contiguous gradient
buffer:

* the gradient row, accumulated whole over the ``M`` micro-batches, is **reduce-scattered** over the data axes once
  per step (in place of the all-reduce): data rank ``d`` receives the mean of slice ``d``;
* rank ``d`` updates its slice of the parameters with its slice of the optimizer state (Adam's moments, momentum's
  trace: ``(P, T·V·row)`` arrays split over ``stage``, ``model`` and the data axes, ``1/D`` per device);
* the updated slices are **all-gathered** back into the whole row, which every rank needs for the next forward.

A reduce-scatter and an all-gather of the row send what the ring all-reduce sends (``2(D−1)/D`` of the row), so the
step's bytes do not change; the optimizer state per device falls by ``D``. The row is padded to a multiple of ``D``
(:attr:`dtx.parallel.stages.StagePlan.row_multiple`) so the slices are equal.

Only stage 1: the gradient is accumulated whole across the micro-batches of a step (the backward slots add into it
until the last tick) and reduced once, so partitioning it (ZeRO-2) would save nothing beyond 1 — DeepSpeed and
Megatron allow only ZeRO-1 with pipelines for the same reason — and partitioning the parameters (ZeRO-3) would
gather every stage's row in every slot (:func:`dtx.step.pipeline_check.check_settings` refuses both). An optimizer
that needs each tensor whole (LARS's and LAMB's trust ratios, weight decay's mask by name:
:mod:`dtx.step.pipeline_optim`) sees only a slice of the row, so it is refused too.
"""

from __future__ import annotations

import math

import jax
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dtx.comm import costmodel
from dtx.mesh import MODEL_AXIS
from dtx.parallel.stages import STAGE_AXIS, PipelineError

STAGES = (0, 1)  # the pipeline.zero_stage values this module runs


def check(zero_stage: int, per_tensor: bool) -> None:
    """Refuse what :func:`dtx.step.pipeline.make_pipeline` cannot build (the config's keys are refused by name
    earlier, :func:`dtx.step.pipeline_check.zero_problems`): a stage but 0 and 1, and ZeRO-1 with an optimizer
    that updates each stage's tensors."""
    if zero_stage not in STAGES:
        raise PipelineError(f"zero_stage={zero_stage!r}: a pipeline takes ZeRO stage 0 or 1 (its gradient row is "
                            "accumulated whole over the micro-batches and reduce-scattered once, so 2 saves nothing "
                            "more; 3 would gather every stage row in every slot)")
    if zero_stage and per_tensor:
        raise PipelineError("zero_stage=1 with per_tensor=True: each data rank updates a slice of the row, and an "
                            "optimizer that needs each tensor whole (LARS, LAMB, weight decay by name) cannot run on "
                            "it; use SGD, momentum, Nesterov or Adam without weight decay, or zero_stage=0")


def _data_axes(mesh) -> tuple[str, ...]:
    return tuple(name for name in mesh.axis_names if name not in (STAGE_AXIS, MODEL_AXIS))


def data_size(mesh) -> int:
    """``D``: the devices a stage row's data replicas span (the product of the data axes)."""
    return math.prod(mesh.shape[a] for a in _data_axes(mesh))


def optimizer_spec(mesh) -> PartitionSpec:
    """Where ZeRO-1's optimizer rows live: over ``stage``, and the row over ``model`` (where the mesh has one: each
    index its own slices, :mod:`dtx.parallel.tensor_stages`) then the data axes, so device ``(s, t, d)`` holds slice
    ``d`` of its own row — the order :func:`reduce_scatter`, :func:`local_slice` and :func:`update` number the data
    ranks in."""
    within = tuple(a for a in (MODEL_AXIS,) if a in mesh.axis_names) + _data_axes(mesh)
    return PartitionSpec(STAGE_AXIS, within or None)


def state_shardings(abstract_state, mesh: Mesh, rows: tuple[int, int], row_sharding):
    """The pipeline state's shardings under ZeRO-1: the parameter rows ``row_sharding`` (whole on every data
    rank), the optimizer's row-shaped leaves :func:`optimizer_spec`, everything else replicated."""
    whole, sliced = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, optimizer_spec(mesh))
    pick = lambda split: lambda x: split if tuple(x.shape) == rows else whole  # noqa: E731
    shardings = jax.tree.map(pick(row_sharding), abstract_state)
    return shardings.replace(opt_state=jax.tree.map(pick(sliced), abstract_state.opt_state))


def reduce_scatter(grads, axes: tuple[str, ...], policy):
    """This rank's slice of the data replicas' mean gradient row: one reduce-scatter over ``axes`` (in the
    policy's reduce dtype, as the all-reduce it replaces), then ``1/D``."""
    d = math.prod(lax.axis_size(a) for a in axes)
    summed = lax.psum_scatter(policy.cast_to_reduce(grads), axes, scatter_dimension=0, tiled=True)
    return policy.cast_to_params(summed) * (1.0 / d)


def local_slice(rows, axes: tuple[str, ...]):
    """This data rank's slice of a device's ``(1, V·row)`` rows (static length, offset by its index)."""
    d = math.prod(lax.axis_size(a) for a in axes)
    size = rows.shape[-1] // d
    return lax.dynamic_slice_in_dim(rows, lax.axis_index(axes) * size, size, axis=rows.ndim - 1)


def update(tx: optax.GradientTransformation, grads, opt_state, params, axes: tuple[str, ...]):
    """``(new parameter rows, new optimizer state)`` on one device: ``grads`` its slice of the reduced row
    (:func:`reduce_scatter`), ``opt_state`` its slice of the state, ``params`` its whole ``(1, V·row)`` rows. An
    element-wise optimizer on the slice is the same arithmetic as on the row; the updated slices are all-gathered."""
    mine = local_slice(params, axes)
    updates, opt_state = tx.update(grads[None], opt_state, mine)
    return lax.all_gather(optax.apply_updates(mine, updates), axes, axis=1, tiled=True), opt_state


def traffic(row: jax.ShapeDtypeStruct, params_itemsize: int, data: int) -> costmodel.Traffic:
    """What one device sends for ZeRO-1's reduction (:mod:`dtx.comm.costmodel`): the ring reduce-scatter of its
    row (``D − 1`` blocks of ``1/D``, in ``row``'s dtype) and the ring all-gather of the updated slice (in the
    parameters' dtype)."""
    if data <= 1:
        return costmodel.Traffic(0, 0)
    block = row.shape[0] // data
    return costmodel.add_traffic(costmodel.Traffic(data - 1, (data - 1) * block * row.dtype.itemsize),
                                 costmodel.all_gather_traffic(block * params_itemsize, data))
