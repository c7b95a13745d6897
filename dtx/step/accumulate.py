"""Gradient accumulation under ``jit`` with one reduction per step: each shard's gradient summed apart.

Accumulating k micro-batches (Goyal et al. 2017, arXiv 1706.02677, §2; the Hitchhiker's Guide, arXiv
1810.11787, §3.1 on large batches) exists to send the gradient **once** for k micro-batches' worth of
examples. Under ``shard_map`` the body sums each device's own gradients and all-reduces after the loop.
Under ``jit`` a gradient taken on the global micro-batch is global: XLA's partitioner inserts its
all-reduce where each micro-batch's partial sums are produced, inside the loop — k all-reduces a step.

Here the loss is instead mapped over the shards (``jax.vmap`` with ``spmd_axis_name``: the mapped
dimension lies along the batch axes of the mesh, one shard per device, so no device computes another's
examples). Each shard's gradient is then its own, the accumulator holds ``(shards, ...)`` unreduced
sums — one parameter-sized buffer per device, as before — and the sum over the shard dimension after
the loop is the step's one reduction: an all-reduce, or under ZeRO-1 a reduce-scatter to the optimizer
state's layout. What must be global inside the loop stays global: batch normalisation averages its
statistics over the shards by name (``axis_name``), as synchronised batch norm does under ``shard_map``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

SHARD_AXIS = "shards"  # the vmapped shard dimension's name (batch norm's statistics are averaged over it)


class Apart(NamedTuple):
    """How a ``jit`` step lays out per-shard values (module docstring)."""

    axes: tuple[str, ...]  # the mesh axes the shard dimension lies along (vmap's ``spmd_axis_name``)
    place: Callable  # constrains a tree of leading-shard-dimension arrays to lie along ``axes``


def gradients(grad_fn, params, model_state, batch, rng, k: int, shards: int, constrain, apart: Apart):
    """``(grads, loss, metrics, model_state)`` of ``k`` micro-batches, every shard's gradients summed apart and
    reduced once after the loop (module docstring). ``grad_fn``: ``jax.value_and_grad`` of the body's loss.

    Micro-batch ``i`` is the ``i``-th ``1/k`` of every shard's slice, the micro-batches of
    :func:`dtx.step.body.gradients`. Each shard's loss is a mean over its own examples (or its sums over
    the global count per shard, see :func:`dtx.step.body.valid_denominator`), so the mean over shards is
    the micro-batch's.
    """
    per_shard = jax.vmap(grad_fn, in_axes=(None, 0, 0, 0), axis_name=SHARD_AXIS, spmd_axis_name=apart.axes)

    def split(x):  # (B, ...) -> (k, shards, B / (shards k), ...)
        x = x.reshape((shards, k, x.shape[0] // (shards * k)) + x.shape[1:])
        return constrain(jnp.swapaxes(x, 0, 1))

    def spread(tree):  # a copy per shard, on its own device
        return apart.place(jax.tree.map(lambda x: jnp.broadcast_to(x, (shards,) + x.shape), tree))

    micro_batches = jax.tree.map(split, batch)
    shard_ids = jnp.arange(shards)

    def one(carry, inputs):
        grads_sum, loss_sum, values_sum, states = carry
        micro, index = inputs
        # The keys shard_map's workers draw: the worker's, then the micro-batch's.
        keys = jax.vmap(lambda s: jax.random.fold_in(jax.random.fold_in(rng, s), index))(shard_ids)
        (_, (loss, values, states)), grads = per_shard(params, states, micro, keys)
        add = lambda a, b: a + b  # noqa: E731
        return (jax.tree.map(add, grads_sum, grads), loss_sum + loss, jax.tree.map(add, values_sum, values),
                states), None

    first = jax.tree.map(lambda x: x[0], micro_batches)
    names = jax.eval_shape(lambda: per_shard(params, spread(model_state), first, jax.random.split(rng, shards)))
    zero = apart.place(jnp.zeros((shards,), jnp.float32))
    init = (spread(jax.tree.map(jnp.zeros_like, params)), zero, {name: zero for name in names[0][1][1]},
            spread(model_state))
    (grads, loss, values, states), _ = lax.scan(one, init, (micro_batches, jnp.arange(k)))
    # The step's one reduction: the sum over the shard dimension (its mean over shards and micro-batches).
    scale = 1.0 / (shards * k)
    grads = jax.tree.map(lambda g: (g.sum(0) * scale).astype(g.dtype), grads)
    # Batch norm's statistics are averaged over the shards inside the loop: every copy is the same.
    model_state = jax.tree.map(lambda s: s.mean(0).astype(s.dtype), states)
    return grads, loss.sum() * scale, {n: v.sum() * scale for n, v in values.items()}, model_state
