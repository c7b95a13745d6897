"""ZeRO-1 over the data axes for a pipeline's stage rows (``pipeline.zero_stage=1``): the distributed optimizer.

ZeRO stage 1 (Rajbhandari et al. 2020, "ZeRO: memory optimizations toward training trillion parameter models",
arXiv 1910.02054, §5.1, P_os) partitions the optimizer state over the ``D`` data-parallel ranks: each rank keeps and
updates ``1/D`` of it. A pipeline device holds its stages' parameters as one flat row (:mod:`dtx.parallel.pipeline.stages`),
so the partition is a slice of that row, as Megatron-LM's distributed optimizer slices its contiguous gradient
buffer:

* the gradient row, accumulated whole over the ``M`` micro-batches, is **reduce-scattered** over the data axes once
  per step (in place of the all-reduce): data rank ``d`` receives the mean of slice ``d``;
* rank ``d`` updates its slice of the parameters with its slice of the optimizer state (Adam's moments, momentum's
  trace: ``(P, T·V·row)`` arrays split over ``stage``, ``model`` and the data axes, ``1/D`` per device);
* the updated slices are **all-gathered** back into the whole row, which every rank needs for the next forward.

A reduce-scatter and an all-gather of the row send what the ring all-reduce sends (``2(D−1)/D`` of the row), so the
step's bytes do not change; the optimizer state per device falls by ``D``. The row is padded to a multiple of ``D``
(:attr:`dtx.parallel.pipeline.stages.StagePlan.row_multiple`) so the slices are equal.

**Stage 3 (FSDP) keeps the parameter rows split too** (``pipeline.zero_stage=3``, or an ``fsdp`` mesh axis at
``fsdp.zero_stage=3``): between steps a device holds ``1/D`` of its row, its optimizer state's ``1/D`` beside it.
A step all-gathers the row once before its first tick and keeps it through the micro-batches — gathering it again in
every forward and backward slot would send the row ``2M`` times a step; this is PyTorch FSDP's
``reshard_after_forward=False``, torchtitan's choice for pipeline stages — then reduce-scatters the gradient row and
updates the slice in place: no all-gather after the update. The bytes are stage 1's (the all-gather moved from the
step's end to its start); what falls is the state a device keeps (and checkpoints) between steps: the parameters'
``(D−1)/D`` besides the optimizer state's.

Stage 2 is refused: the gradient is accumulated whole across the micro-batches of a step (the backward slots add
into it until the last tick) and reduced once, so partitioning it would save nothing beyond 1 — DeepSpeed and
Megatron allow only ZeRO-1 with pipelines for the same reason (:func:`dtx.parallel.pipeline.check.check_settings`).

**Which axes.** The row is split over the mesh's ``fsdp`` axes where it has any (:func:`dtx.mesh.state_axes`),
else over every data axis (``pipeline.zero_stage``); with both an ``fsdp`` and a ``data`` axis (hybrid sharding) the
reduce-scattered slice is then averaged over the ``data`` axes, ``1/D`` of the row crossing them.

**Weight decay on a slice.** :mod:`dtx.optim` masks weight decay by name (``optimizer.exclude``: biases and
LayerNorm scales are not decayed), a mask of booleans, one per leaf, that ``optax.masked`` applies leaf by leaf — but
a rank's slice is one leaf cutting across several tensors. The optimizer stays the one :mod:`dtx.optim` built (AdamW
with its mask, or L2 added before SGD/momentum/Adam); what changes is the ``params`` it is handed: the slice times
the **row mask** of the same flat layout and padding as the parameter row (1 on the entries of decayed leaves, 0 on
excluded leaves and padding), cut like the row. The optimizer's own mask sees the slice as one unnamed leaf and keeps
it (:func:`decay_tables` checks that it does), and optax's ``add_decayed_weights`` adds ``λ·(m⊙p) = m⊙(λ·p)``: each
rank decays exactly its slice's decayed entries, the rest updated as the tree's excluded leaves are (``u + 0``).
This holds because these optimizers read ``params`` only in the decay term; the mask is built by the plan's own
:meth:`~dtx.parallel.pipeline.stages.StagePlan.flatten` of the per-leaf mask, kept as its runs (a few integers per stage, not
a row) and expanded per step on the slice (:func:`decay_slice`). LARS's and LAMB's trust ratios (You et al. 2017,
arXiv 1708.03888; 2019, arXiv 1904.00962) read each tensor's whole norm from ``params``, which a slice does not
hold, so they stay refused (:func:`dtx.parallel.pipeline.check.zero_problems`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dtx import mesh as mesh_lib
from dtx.comm import costmodel
from dtx.mesh import MODEL_AXIS
from dtx.parallel.pipeline.stages import STAGE_AXIS, PipelineError

STAGES = (0, 1, 3)  # the pipeline.zero_stage values this module runs


def check(zero_stage: int, per_tensor: bool) -> None:
    """Refuse what :func:`dtx.parallel.pipeline.step.make_pipeline` cannot build (the config's keys are refused by name
    earlier, :func:`dtx.parallel.pipeline.check.zero_problems`): a stage but 0 and 1, and ZeRO-1 with an optimizer
    that updates each stage's tensors."""
    if zero_stage not in STAGES:
        raise PipelineError(f"zero_stage={zero_stage!r}: a pipeline takes ZeRO stage 0, 1 or 3 (its gradient row is "
                            "accumulated whole over the micro-batches and reduce-scattered once, so 2 saves nothing "
                            "more than 1)")
    if zero_stage and per_tensor:
        raise PipelineError(f"zero_stage={zero_stage} with per_tensor=True: each data rank updates a slice of the row, and an "
                            "optimizer that needs each tensor whole (LARS's and LAMB's trust ratios) cannot run on "
                            "it; weight decay runs with per_tensor=False and decay_mask= the optimizer's mask "
                            "(dtx.optim.path_mask(exclude)); or set zero_stage=0")


def _stage_mask(plan, stage: int, mask) -> np.ndarray:
    """Virtual stage ``stage``'s row mask: ``mask``'s per-leaf booleans on its tree, each leaf filled with its
    value and flattened by the plan (the parameters' layout; padding 0)."""
    tree = plan.stage_params(stage, jnp.zeros(plan.row))
    filled = jax.tree.map(lambda keep, x: jnp.full(x.shape, float(keep)), mask(tree), tree)
    return np.asarray(plan.flatten(stage, filled))


def decay_tables(plan, mask) -> tuple[np.ndarray, np.ndarray]:
    """The row mask of weight decay (module docstring) for each stage device's ``V·row`` entries, kept as its runs:
    ``ends`` ``(P, K)`` (where each run but the first starts; padded with ``V·row``) and ``flags`` ``(P, K + 1)``
    (each run's value). ``mask``: the optimizer's mask function (:func:`dtx.optim.path_mask`)."""
    if not all(jax.tree.leaves(mask(np.zeros(1)))):
        raise PipelineError("the weight-decay mask excludes an unnamed leaf (optimizer.exclude matches the empty "
                            "path), so the optimizer would skip the slice ZeRO-1 hands it whole: write "
                            "optimizer.exclude so that it names leaves, e.g. the default r'(^|/)(bias|scale)$'")
    width = plan.chunks * plan.row
    ends, flags = [], []
    for device in range(plan.devices):  # device chunk c holds virtual stage c·P + device
        row = np.concatenate([_stage_mask(plan, c * plan.devices + device, mask) for c in range(plan.chunks)])
        starts = np.flatnonzero(np.diff(row)) + 1
        ends.append(starts)
        flags.append(row[np.concatenate([[0], starts])])
    k = max(1, max(len(e) for e in ends))
    return (np.stack([np.pad(e, (0, k - len(e)), constant_values=width) for e in ends]).astype(np.int32),
            np.stack([np.pad(f, (0, k + 1 - len(f))) for f in flags]).astype(np.float32))


def decay_slice(tables, stage, rank, size: int):
    """Data rank ``rank``'s ``size`` entries of stage device ``stage``'s row mask (:func:`decay_tables`): each
    position's run found by binary search in its device's run ends (traced indices in the step)."""
    ends, flags = (jnp.asarray(t)[stage] for t in tables)
    return flags[jnp.searchsorted(ends, rank * size + jnp.arange(size), side="right")]


def zero_axes(mesh) -> tuple[str, ...]:
    """The axes a stage row is split over: the ``fsdp`` axes, or every data axis (module docstring)."""
    return mesh_lib.state_axes(mesh, over=mesh_lib.replica_axes(mesh))


def unsplit_axes(mesh) -> tuple[str, ...]:
    """The data axes the row is not split over (hybrid sharding's ``data`` beside ``fsdp``): its slices'
    replicas, averaged over after the reduce-scatter."""
    return tuple(a for a in mesh_lib.replica_axes(mesh) if a not in zero_axes(mesh))


def data_size(mesh) -> int:
    """``D``: the devices a stage row is split over (the product of :func:`zero_axes`)."""
    return math.prod(mesh.shape[a] for a in zero_axes(mesh))


def optimizer_spec(mesh) -> PartitionSpec:
    """Where ZeRO-1's optimizer rows live: over ``stage``, and the row over ``model`` (where the mesh has one: each
    index its own slices, :mod:`dtx.parallel.pipeline.tensor_stages`) then the data axes, so device ``(s, t, d)`` holds slice
    ``d`` of its own row — the order :func:`reduce_scatter`, :func:`local_slice` and :func:`update` number the data
    ranks in."""
    within = tuple(a for a in (MODEL_AXIS,) if a in mesh.axis_names) + zero_axes(mesh)
    return PartitionSpec(STAGE_AXIS, within or None)


def state_shardings(abstract_state, mesh: Mesh, rows: tuple[int, int], row_sharding, zero_stage: int = 1):
    """The pipeline state's shardings under ZeRO: the parameter rows ``row_sharding`` (stage 1: whole on every data
    rank) or, stage 3, split as the optimizer's row-shaped leaves are (:func:`optimizer_spec`); everything else
    replicated."""
    whole, sliced = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, optimizer_spec(mesh))
    pick = lambda split: lambda x: split if tuple(x.shape) == rows else whole  # noqa: E731
    shardings = jax.tree.map(pick(row_sharding), abstract_state)
    shardings = shardings.replace(opt_state=jax.tree.map(pick(sliced), abstract_state.opt_state))
    return shardings.replace(params=sliced) if zero_stage == 3 else shardings


def gather_row(params, axes: tuple[str, ...]):
    """Stage 3: a device's whole ``(1, V·row)`` rows from its slices, one all-gather over ``axes`` per step."""
    return lax.all_gather(params, axes, axis=1, tiled=True)


def reduce_scatter(grads, axes: tuple[str, ...], policy, replicas: tuple[str, ...] = ()):
    """This rank's slice of the data replicas' mean gradient row: one reduce-scatter over ``axes`` (in the
    policy's reduce dtype, as the all-reduce it replaces), then ``1/D``; under hybrid sharding the slice then
    averaged over its ``replicas`` axes."""
    d = math.prod(lax.axis_size(a) for a in axes)
    summed = lax.psum_scatter(policy.cast_to_reduce(grads), axes, scatter_dimension=0, tiled=True)
    if replicas:
        summed = lax.pmean(summed, replicas)
    return policy.cast_to_params(summed) * (1.0 / d)


def local_slice(rows, axes: tuple[str, ...]):
    """This data rank's slice of a device's ``(1, V·row)`` rows (static length, offset by its index)."""
    d = math.prod(lax.axis_size(a) for a in axes)
    size = rows.shape[-1] // d
    return lax.dynamic_slice_in_dim(rows, lax.axis_index(axes) * size, size, axis=rows.ndim - 1)


def update(tx: optax.GradientTransformation, grads, opt_state, params, axes: tuple[str, ...], decay=None,
           split: bool = False):
    """``(new parameter rows, new optimizer state)`` on one device: ``grads`` its slice of the reduced row
    (:func:`reduce_scatter`), ``opt_state`` its slice of the state, ``params`` its whole ``(1, V·row)`` rows (stage
    1; ``split``, stage 3: its slice of them). An element-wise optimizer on the slice is the same arithmetic as on
    the row; stage 1 all-gathers the updated slices, stage 3 keeps them. ``decay``: :func:`decay_tables` where the
    optimizer decays by name — it is handed the slice times its mask."""
    mine = params if split else local_slice(params, axes)
    shown = mine if decay is None else mine * decay_slice(decay, lax.axis_index(STAGE_AXIS), lax.axis_index(axes),
                                                          mine.shape[-1])
    updates, opt_state = tx.update(grads[None], opt_state, shown)
    new = optax.apply_updates(mine, updates)
    return (new if split else lax.all_gather(new, axes, axis=1, tiled=True)), opt_state


def traffic(row: jax.ShapeDtypeStruct, params_itemsize: int, data: int, replicas: int = 1) -> costmodel.Traffic:
    """What one device sends for ZeRO's reduction (:mod:`dtx.comm.costmodel`): the ring reduce-scatter of its
    row (``D − 1`` blocks of ``1/D``, in ``row``'s dtype), under hybrid sharding the slice's ring all-reduce over its
    ``replicas``, and the ring all-gather of a slice (in the parameters' dtype: stage 1's updated slices after the
    update, stage 3's stored slices before the first tick)."""
    if data <= 1:
        return costmodel.Traffic(0, 0)
    block = row.shape[0] // data
    sent = costmodel.add_traffic(costmodel.Traffic(data - 1, (data - 1) * block * row.dtype.itemsize),
                                 costmodel.all_gather_traffic(block * params_itemsize, data))
    if replicas > 1:
        sent = costmodel.add_traffic(sent, costmodel.expected_traffic(
            "ring", block * row.dtype.itemsize, replicas, None, row.dtype.itemsize))
    return sent
