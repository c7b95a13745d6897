"""Any optax optimizer on a pipeline's stage rows: each stage updated as its own parameter tree.

A pipeline device holds its stage's parameters as one flat row (:mod:`dtx.parallel.pipeline.stages`), but an optimizer may
need the tensors: LARS (You et al. 2017, arXiv 1708.03888) and LAMB (You et al. 2019, arXiv 1904.00962) scale
each tensor by its own trust ratio, and weight decay skips biases by name (``optimizer.exclude``). So the update
runs, on each device, the optimizer on its stage's tree — the row's static slices, one ``lax.switch`` branch per
(virtual) stage — and the results go back into rows. The optimizer state is kept the same way: every subtree of
a stage's optax state shaped like the stage's parameters is flattened into that stage's row (laid out as the
parameters: ``(P, V·row)``, split over ``stage``); scalars (Adam's count) are shared. A checkpoint's tree and rows
convert as the parameters do (:func:`dtx.parallel.pipeline.relayout.to_rows`). The step takes this path only for the
optimizers that need it (:func:`dtx.parallel.pipeline.check.per_tensor`): an element-wise one updates the rows
directly, with fewer temporaries, from the same state (:func:`init` lays it out for both).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax import lax

from dtx.parallel.pipeline.stages import StagePlan


def _stage_like(plan: StagePlan, stage: int):
    names = set(plan.stage_keys(stage))
    return lambda x: isinstance(x, dict) and bool(x) and set(x) == names


def _stage_tree(plan: StagePlan, stage: int, params) -> dict:
    return {key: params[key] for key in plan.stage_keys(stage)}


def to_row_state(plan: StagePlan, stage: int, state):
    """A stage's optax state with every subtree shaped like the stage's parameters flattened into its row."""
    like = _stage_like(plan, stage)
    return jax.tree.map(lambda x: plan.flatten(stage, x) if like(x) else x, state, is_leaf=like)


def from_row_state(plan: StagePlan, stage: int, rows, reference):
    """The inverse of :func:`to_row_state`, the stage's state structure read from ``reference`` (its optax state)."""
    like = _stage_like(plan, stage)
    return jax.tree.map(lambda ref, x: plan.stage_params(stage, x) if like(ref) else x, reference, rows, is_leaf=like)


def init(tx: optax.GradientTransformation, plan: StagePlan, params) -> optax.OptState:
    """The optimizer state of the model's parameter tree ``params`` in rows: each stage's ``tx.init`` on its tree,
    row-shaped leaves stacked as :meth:`StagePlan.pack` stacks the parameters, the rest (counts) from stage 0. Stages
    split over ``model`` (:mod:`dtx.parallel.pipeline.tensor_stages`): each ``model`` index's slices laid out so, side by side
    as the plan packs the parameters."""
    if getattr(plan, "tensor", 1) > 1:
        split = [_init(tx, plan, plan.local(params, t)) for t in range(plan.tensor)]
        rows = (plan.devices, plan.chunks * plan.row)
        return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1) if jnp.shape(xs[0]) == rows else xs[0], *split)
    return _init(tx, plan, params)


def _init(tx: optax.GradientTransformation, plan: StagePlan, params) -> optax.OptState:
    states = [to_row_state(plan, s, tx.init(_stage_tree(plan, s, params))) for s in range(plan.num_stages)]

    def stack(*leaves):
        if jnp.shape(leaves[0]) != (plan.row,):
            return leaves[0]
        by_chunk = jnp.stack(leaves).reshape(plan.chunks, plan.devices, plan.row)
        return jnp.swapaxes(by_chunk, 0, 1).reshape(plan.devices, plan.chunks * plan.row)
    return jax.tree.map(stack, *states)


def update(tx: optax.GradientTransformation, plan: StagePlan, grads, opt_state, params, stage):
    """``(updates, new state)`` on one device (inside ``shard_map``): ``grads``, ``params`` and the state's row
    leaves are this device's ``(1, V·row)`` rows, ``stage`` its index on the ``stage`` axis. Each of its ``V``
    chunks is updated as the tree of its (virtual) stage."""
    width = plan.chunks * plan.row
    row_leaf = lambda x: jnp.ndim(x) == 2 and jnp.shape(x)[1] == width  # noqa: E731
    references = [jax.eval_shape(tx.init, _stage_tree(plan, s, plan.stage_params(s, jnp.zeros(plan.row))))
                  for s in range(plan.num_stages)]

    def branch(s):
        def run(g, state, p):
            tree_state = from_row_state(plan, s, state, references[s])
            updates, new = tx.update(plan.stage_params(s, g), tree_state, plan.stage_params(s, p))
            return plan.flatten(s, updates), to_row_state(plan, s, new)
        return run

    branches = [branch(s) for s in range(plan.num_stages)]
    chunks = []
    for c in range(plan.chunks):  # static: device chunk c holds virtual stage c·P + stage
        part = lambda x, c=c: x[0, c * plan.row:(c + 1) * plan.row] if row_leaf(x) else x  # noqa: E731
        chunks.append(lax.switch(c * plan.devices + stage, branches, part(grads),
                                 jax.tree.map(part, opt_state), part(params)))
    updates = jnp.concatenate([u for u, _ in chunks])[None]
    # Row leaves: the chunks side by side; shared leaves (counts): every chunk advanced them alike, chunk 0's.
    new_state = jax.tree.map(lambda old, *new: jnp.concatenate(new)[None] if row_leaf(old) else new[0],
                             opt_state, *[state for _, state in chunks])
    return updates, new_state


def global_norm(plan: StagePlan, grads, sliced: tuple[str, ...] = ()):
    """The whole model's L2 norm from this device's reduced gradient row (or, ZeRO, its slice over ``sliced``):
    what clipping by the global norm and the ``grad_norm`` record need (:class:`dtx.step.body.Norms`), the same in
    every layout of the stages. The squares are summed over ``stage`` (each device's stages are others'), over
    ``sliced`` (each data rank holds its slice), and over ``model`` for the entries split over it — the replicated
    ones (LayerNorms, biases, the embedding) are equal on every device of a tensor group and counted once
    (:func:`dtx.parallel.pipeline.positions.replicated_spans`); a row's padding is zero. A ``context`` axis holds
    equal rows (averaged over it before this), so nothing is summed over it."""
    from dtx.parallel.pipeline.positions import MODEL, replicated_spans
    from dtx.parallel.pipeline.stages import STAGE_AXIS
    from dtx.parallel.pipeline.tensor_stages import split_stages

    squares = jnp.square(grads.astype(jnp.float32))
    total = jnp.sum(squares)
    if split_stages(plan):
        n = grads.shape[-1]
        index = (lax.axis_index(sliced) * n if sliced else 0) + jnp.arange(n)  # entries of the device's rows

        def replicated(stage):
            def run():
                mask = jnp.zeros(n, bool)
                for a, b in replicated_spans(plan, stage):
                    mask = mask | ((index >= a) & (index < b))
                return jnp.sum(jnp.where(mask, squares, 0.0))
            return run
        once = lax.switch(lax.axis_index(STAGE_AXIS), [replicated(s) for s in range(plan.devices)])
        total = lax.psum(total - once, MODEL) + once
    return jnp.sqrt(lax.psum(total, (STAGE_AXIS, *sliced)))
