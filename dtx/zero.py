"""ZeRO stages 1 and 2 with explicit collectives: the ``shard_map`` driver's ZeRO step.

ZeRO (Rajbhandari et al. 2020, arXiv 1910.02054) keeps the parameters whole on every
device but splits what the optimizer needs: stage 1 its state, stage 2 the gradients
too. Per step, for ``N`` workers and a tensor of ``n`` bytes:

1. each worker differentiates its own examples (data parallelism, Das et al. §2);
2. **reduce-scatter** (``lax.psum_scatter``): worker ``i`` receives the sum of everyone's
   ``i``-th ``1/N`` of the gradient — ``(N−1)·n/N`` bytes sent, half a ring all-reduce;
3. each worker updates its ``1/N`` of the parameters with its ``1/N`` of the optimizer state;
4. **all-gather** (``lax.all_gather``): the new slices become whole parameters again —
   the other half of the ring's bytes.

So ZeRO sends what a ring all-reduce sends, and keeps ``1/N`` of the optimizer state.
Stage 2 reduce-scatters every micro-batch's gradient into a ``1/N`` accumulator (``k``
reduce-scatters under ``k``-step accumulation, no full-size accumulator); stage 1 sums
full gradients locally and reduce-scatters once.

Steps 2 and 4 are ``shard_map`` collectives written here; step 3 runs at ``jit`` level
on arrays split like the optimizer state, so any optax optimizer works unchanged: its
elementwise arithmetic stays on each device's slice, and where it needs a whole tensor
— LAMB's and LARS's trust ratio ``‖w‖/‖u‖`` (You et al. 2019) — XLA sums the slices'
squares with a scalar all-reduce. A per-slice norm would be wrong by up to ``√N``
(tests/test_zero.py holds the result to data parallelism's).

The ``jit`` driver's ZeRO (:func:`dtx.step.make_train_step` with ``gradient_shardings``)
leaves all of this to XLA's partitioner; both drivers train the same parameters.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dtx import batchnorm, body, costmodel
from dtx import mesh as mesh_lib
from dtx import step as step_lib
from dtx import strategies
from dtx import tasks as task_lib
from dtx.precision import LossScaler, Policy, all_finite, select_tree


def split_dims(gradient_shardings: Any, mesh: Mesh) -> Any:
    """Per gradient leaf, the dimension split over every batch axis (``None``: kept whole).

    ZeRO's layouts (:func:`dtx.parallel.optimizer_rules`) split one dimension of a tensor
    over all batch axes together, or leave it whole when no dimension divides.
    """
    axes = mesh_lib.batch_axes(mesh)

    def dim(sharding: NamedSharding):
        split = [(i, entry) for i, entry in enumerate(sharding.spec) if entry is not None]
        if not split:
            return None
        (i, entry), = split  # one dimension: the rules' fsdp split
        if tuple(entry if isinstance(entry, tuple) else (entry,)) != axes:
            raise step_lib.StepError(f"ZeRO under shard_map splits over every batch axis {axes}; got {sharding.spec}")
        return i

    return jax.tree.map(dim, gradient_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))


def traffic(abstract_params: Any, dims: Any, p: int, accum_steps: int, stage: int,
            reduce_dtype: Any = None) -> costmodel.Traffic:
    """What one worker sends per step, in :mod:`dtx.hlo`'s conventions: ``(p−1)`` times the
    slice's bytes and ``p−1`` rounds per reduce-scatter (``k`` of them under stage 2) and per
    all-gather; a tensor kept whole is averaged by a ring all-reduce."""
    messages = sent = 0
    passes = accum_steps if stage == 2 else 1
    for leaf, dim in zip(jax.tree.leaves(abstract_params), jax.tree.leaves(dims, is_leaf=lambda d: d is None)):
        wire = jnp.dtype(reduce_dtype or leaf.dtype).itemsize
        n = math.prod(leaf.shape)
        if dim is None:
            ring = costmodel.expected_traffic("ring", n * wire, p, None, wire)
            messages, sent = messages + ring.messages, sent + ring.bytes_sent
            continue
        messages += (passes + 1) * (p - 1)
        sent += (p - 1) * n // p * (passes * wire + jnp.dtype(leaf.dtype).itemsize)
    return costmodel.Traffic(messages, sent)


def make_zero_step(model, tx: optax.GradientTransformation, mesh: Mesh, *, stage: int, state_shardings: Any,
                   gradient_shardings: Any, policy: Policy = Policy(), loss_scaler: LossScaler = LossScaler(),
                   accum_steps: int = 1, task: task_lib.Task | None = None, grad_norm: bool = False,
                   donate: bool = True):
    """The jitted ``(state, batch) -> (state, metrics)`` ZeRO step (module docstring).

    ``gradient_shardings`` is the optimizer state's layout per parameter
    (:func:`dtx.parallel.gradient_shardings` of :func:`dtx.parallel.optimizer_rules`);
    ``state_shardings`` the whole state's. Metrics as :func:`dtx.step.make_train_step`'s,
    ``comm_bytes``/``comm_rounds`` counted by :func:`traffic` plus the metrics' average.
    """
    if stage not in (1, 2):
        raise step_lib.StepError(f"ZeRO stage {stage} is not 1 or 2 (stage 3 is parallel.name=fsdp)")
    task = task or task_lib.classification()
    axes = mesh_lib.batch_axes(mesh)
    model = batchnorm.synchronise(model, axes)  # statistics over the global batch, as data parallelism's
    p = mesh_lib.data_parallel_size(mesh)
    dims = split_dims(gradient_shardings, mesh)
    grad_specs = jax.tree.map(lambda s: s.spec, gradient_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    is_dim = functools.partial(jax.tree.map, is_leaf=lambda d: d is None)

    def scatter(grads):  # each worker keeps the mean of its 1/p of every tensor, summed in the params' dtype
        grads = policy.cast_to_reduce(grads)
        return policy.cast_to_params(is_dim(lambda d, g: lax.pmean(g, axes) if d is None else
                                            lax.psum_scatter(g, axes, scatter_dimension=d, tiled=True) / p,
                                            dims, grads))

    def gradients(params, model_state, loss_scale, step_rng, batch):
        rng = jax.random.fold_in(step_rng, lax.axis_index(axes))  # independent dropout per worker
        denominator = body.valid_denominator(task, batch, axes, accum_steps, strategies.sync())
        loss_fn = body.make_loss_fn(model, policy, task, contextlib.nullcontext, list(model_state), denominator,
                                    functools.partial(loss_scaler.scale_loss, loss_scale))
        params = lax.pcast(params, axes, to="varying")  # this worker's own gradient, reduced by us
        per_micro = init = None
        if stage == 2 and accum_steps > 1:  # each micro-batch scattered into a 1/p accumulator, zero without a collective
            per_micro, init = scatter, jax.tree.map(jnp.zeros_like, jax.eval_shape(scatter, params))
        grads, loss, values, model_state = body.gradients(loss_fn, params, model_state, batch, rng, accum_steps, 1,
                                                          lambda x: x, axes, per_micro, init)
        finite_here = all_finite(policy.cast_to_reduce(grads)) if loss_scaler.enabled else None
        if per_micro is None:
            grads = scatter(grads)
        mean = body.averages(axes, loss, values, finite_here, model_state)
        return grads, mean.loss, mean.values, mean.finite, mean.model_state

    def out_specs():
        flag = PartitionSpec() if loss_scaler.enabled else None
        return grad_specs, PartitionSpec(), PartitionSpec(), flag, PartitionSpec()

    reduced = jax.shard_map(gradients, mesh=mesh, out_specs=out_specs(), check_vma=True,
                            in_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec(), PartitionSpec(),
                                      PartitionSpec(axes)))
    gather = jax.shard_map(
        lambda slices: is_dim(lambda d, x: x if d is None else lax.all_gather(x, axes, axis=d, tiled=True),
                              dims, slices),
        # all_gather's result is the same on every worker, but this jax types it "varying"
        # (its invariant form is private): the replication checker cannot see it.
        mesh=mesh, in_specs=(grad_specs,), out_specs=PartitionSpec(), check_vma=False)

    def step(state, batch):
        rng, step_rng = jax.random.split(jax.random.wrap_key_data(state.rng))
        grads, loss, values, finite_everywhere, model_state = reduced(
            state.params, state.model_state, state.loss_scale, step_rng, batch)
        grads = loss_scaler.unscale(state.loss_scale, grads)
        # This worker's 1/p of the parameters: a slice of what it holds, no communication.
        slices = jax.tree.map(lax.with_sharding_constraint, state.params, gradient_shardings)
        updates, opt_state = tx.update(grads, state.opt_state, slices)
        params = gather(optax.apply_updates(slices, updates))
        sent = costmodel.add_traffic(traffic(state.params, dims, p, accum_steps, stage, policy.reduce),
                                     _averages_traffic(values, model_state, p, loss_scaler, task))
        metrics = {"loss": loss, **values, "comm_bytes": jnp.float32(sent.bytes_sent),
                   "comm_rounds": jnp.float32(sent.messages)}
        if grad_norm:
            metrics["grad_norm"] = optax.tree.norm(grads)
        loss_scale = state.loss_scale
        if loss_scaler.enabled:  # every worker's gradients and their reduced sum must be finite
            finite = jnp.logical_and(finite_everywhere, all_finite(grads))
            params, opt_state, model_state = select_tree(
                finite, (params, opt_state, model_state), (state.params, state.opt_state, state.model_state))
            loss_scale = loss_scaler.update(state.loss_scale, finite)
            metrics.update(loss_scale=state.loss_scale.scale, skipped=(~finite).astype(jnp.int32),
                           skipped_steps=loss_scale.skipped_steps)
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state, model_state=model_state,
                             rng=jax.random.key_data(rng), loss_scale=loss_scale), metrics

    replicated = mesh_lib.replicated(mesh)
    return jax.jit(step, in_shardings=(state_shardings, mesh_lib.batch_sharding(mesh)),
                   out_shardings=(state_shardings, replicated), donate_argnums=(0,) if donate else ())


def _averages_traffic(values: dict, model_state: Any, p: int, loss_scaler: LossScaler,
                      task: task_lib.Task) -> costmodel.Traffic:
    """The one all-reduce that averages loss, metrics (and the overflow flag) and the batch-norm
    statistics (:func:`dtx.body.averages`), and with padding the valid-element count's."""
    vector = jnp.zeros((1 + len(values) + int(loss_scaler.enabled),), jnp.float32)
    ring = costmodel.dense_allreduce_traffic((vector, model_state), p, "ring")
    parts = [costmodel.Traffic(2 * (p - 1), ring.bytes_sent)]
    if task.valid is not None:
        parts.append(costmodel.expected_traffic("ring", 4, p, None, 4))
    return costmodel.add_traffic(*parts)
