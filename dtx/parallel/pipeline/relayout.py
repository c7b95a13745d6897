"""A pipeline's state as the model's own parameter tree and back: checkpoints restore across layouts.

A pipeline run (:mod:`dtx.parallel.pipeline.step`) keeps its parameters, and every optimizer subtree shaped like them, packed
into its plan's ``(P, V·row)`` rows; any other run keeps the model's tree. Resuming one as the other (pipeline
2×4 -> data ×8 -> 1 device, and back; another cut or chunk count) unpacks the saved rows by the saved run's plan and
packs them by this run's (:func:`relayout`, called by :meth:`dtx.ckpt.checkpoint.Checkpointer.resume`). Stages split
over a ``model`` axis (:mod:`dtx.parallel.pipeline.tensor_stages`, rows ``(P, T·V·row)``) convert the same way, by the saved
run's ``T``: a layout change moves bytes, it computes nothing.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dtx import mesh as mesh_lib
from dtx.mesh import MODEL_AXIS
from dtx.parallel.pipeline.stages import PipelineError, StagePlan, make_plan
from dtx.parallel.pipeline.step import abstract_state
from dtx.parallel.pipeline.tensor_stages import split_over
from dtx.step.state import TrainState


def _like_params(params):
    """Whether a subtree of the optimizer state has the parameters' structure (Adam's ``mu`` and ``nu``)."""
    structure = jax.tree.structure(params)
    return lambda x: isinstance(x, dict) and bool(x) and jax.tree.structure(x) == structure


def to_rows(state: TrainState, plan: StagePlan) -> TrainState:
    """A state holding the model's parameter tree as a pipeline's: the parameters, and every optimizer subtree shaped
    like them, packed into the plan's ``(P, V·row)`` rows (padding zeros, as a pipeline's own padding stays)."""
    like = _like_params(state.params)
    opt_state = jax.tree.map(lambda x: plan.pack(x) if like(x) else x, state.opt_state, is_leaf=like)
    return state.replace(params=plan.pack(state.params), opt_state=opt_state)


def to_tree(state: TrainState, plan: StagePlan) -> TrainState:
    """A pipeline state as one holding the model's parameter tree (the inverse of :func:`to_rows`): every leaf shaped
    like the rows unpacked (stages split over ``model``: each split leaf's ``T`` slices joined, the rest read from
    ``model`` index 0, whose copy every index of the group holds bit for bit)."""
    rows = plan.rows_shape
    opt_state = jax.tree.map(lambda x: plan.unpack(x) if tuple(x.shape) == rows else x, state.opt_state)
    return state.replace(params=plan.unpack(state.params), opt_state=opt_state)


def _split(plan: StagePlan, params, example, mesh, shape) -> StagePlan:
    """The saved run's plan with its stages split over its mesh's ``model`` axis, if it had one
    (:mod:`dtx.parallel.pipeline.tensor_stages`): ``T`` read from its ``mesh``, or, where that said -1 (the devices left), the
    ``T`` (up to 256) whose rows are the saved ``shape`` (each of the ``T`` holds the unsplit parameters whole, so the
    rows widen with ``T`` and at most one matches)."""
    sizes = [int(size) for name, size in (mesh or ()) if name == MODEL_AXIS]
    if not sizes or sizes[0] == 1:
        return plan
    for tensor in [sizes[0]] if sizes[0] > 1 else range(2, 257):
        try:
            split = split_over(plan, params, tensor, example)
        except ValueError:  # heads or widths this T does not divide
            continue
        if split.rows_shape == shape or sizes[0] > 1:
            return split
        if split.rows_shape[1] > shape[1]:  # wider with every T: none will fit
            break
    return plan


def _padded(saved: StagePlan, shape, plan: StagePlan | None) -> StagePlan:
    """The saved run's plan with its rows padded as its ZeRO-1 padded them (``pipeline.zero_stage=1``: to a multiple of
    its data ranks, :mod:`dtx.parallel.pipeline.zero`): this run's multiple where that lays them out as saved (the same
    data ranks), else the saved row's own length (a multiple of the saved ranks, whose count the config may leave
    to -1)."""
    width = getattr(saved, "tensor", 1) * saved.chunks
    for multiple in (getattr(plan, "row_multiple", 1), shape[1] // width if shape[1] % width == 0 else 1):
        candidate = dataclasses.replace(saved, row_multiple=max(1, multiple))
        if candidate.rows_shape == shape:
            return candidate
    return saved  # refused below: rows it does not lay out


def relayout(model, tx, example_inputs, tree_state, target, mesh: Mesh, plan: StagePlan | None,
             pipelined=lambda saved_config: False):
    """``(saved config, saved arrays) -> (the saved layout's target, convert) | None``: how a run whose state is
    ``target`` (its abstract state, each leaf a ``ShapeDtypeStruct`` carrying the ``sharding`` it is placed with, as
    :func:`dtx.ckpt.checkpoint.abstract_target` builds it, or the plain abstract state, left where ``jit`` puts it;
    its pipeline ``plan``, None for the model's own tree ``tree_state``) restores a checkpoint saved in the other
    layout, pipeline rows or tree (:meth:`dtx.ckpt.checkpoint.Checkpointer.resume`'s ``relayout``). The saved state
    is restored replicated on ``mesh`` as it was saved, then unpacked by the saved run's plan (its stage count read
    from the saved rows, its cut and chunks from its ``pipeline`` block, its ``model`` split from its ``mesh``) and
    packed by this run's; None when the checkpoint holds no other layout of this model.
    ``pipelined(saved config)``: whether it saved rows."""
    if jax.tree.leaves((tree_state.worker, tree_state.shared)):  # per-worker state: no pipeline ever had it
        return lambda saved_config, arrays: None
    # Where the converted state is placed: the target's shardings, or (a leaf without one) no out_shardings at all.
    shardings = jax.tree.map(lambda x: getattr(x, "sharding", None), target)
    if any(s is None for s in jax.tree.leaves(shardings, is_leaf=lambda s: s is None)):
        shardings = None

    def adapt(saved_config: dict, arrays: dict):
        parallel = saved_config.get("parallel") or {}
        saved_plan = None
        if pipelined(saved_config):
            shape = tuple(arrays.get("params", ((),))[0])
            if len(shape) != 2 or not shape[0]:
                return None
            try:
                # The cut is in the saved pipeline block (checkpoints of dtx before it: in the parallel block).
                cut = saved_config.get("pipeline") or parallel
                saved_plan = make_plan(model, tree_state.params, shape[0], tuple(cut.get("boundaries") or ()),
                                       int(cut.get("virtual_stages") or 1), example_inputs)
                saved_plan = _split(saved_plan, tree_state.params, example_inputs, saved_config.get("mesh"), shape)
                axes = [name for name, _ in saved_config.get("mesh") or ()]
                if int(cut.get("zero_stage") or 0) or mesh_lib.FSDP_AXIS in axes:  # ZeRO padded the rows
                    saved_plan = _padded(saved_plan, shape, plan)
            except ValueError:
                return None
        if saved_plan == plan:
            return None
        if saved_plan is not None and saved_plan.rows_shape != shape:  # refused before any array is read
            tensor = getattr(saved_plan, "tensor", 1)
            raise PipelineError(
                f"this checkpoint's run (parallel.name={parallel.get('name')!r}, mesh={saved_config.get('mesh')}) "
                f"saved parameter rows {list(shape)}, but this model cut as its config says ({shape[0]} stages, "
                f"pipeline.boundaries={list(saved_plan.bounds[1:-1])}, pipeline.virtual_stages={saved_plan.chunks}, "
                f"{f'split over model {tensor}' if tensor > 1 else 'not split over model'}) lays them out as "
                f"{list(saved_plan.rows_shape)}, so they cannot be converted; resume it in the layout it was saved "
                "in (its --config.mesh and pipeline block)")
        saved = tree_state if saved_plan is None else abstract_state(model, tx, example_inputs, saved_plan)
        whole = NamedSharding(mesh, PartitionSpec())
        saved_target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=whole), saved)

        def convert(restored):
            restored = restored if saved_plan is None else to_tree(restored, saved_plan)
            restored = restored if plan is None else to_rows(restored, plan)
            return restored.replace(worker=target.worker, shared=target.shared)  # both without leaves (above)
        return saved_target, jax.jit(convert, out_shardings=shardings)
    return adapt
