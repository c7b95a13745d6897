"""ZeRO stages 1 and 2 with explicit collectives: the ``shard_map`` driver's ZeRO collaborators.

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

This module writes steps 2 and 4 and nothing else: :func:`collectives` hands them, with what
they send, to the step's one body (:mod:`dtx.step.zero_step` composes them around
:func:`dtx.step.body.worker_pass`). Step 2 runs inside ``shard_map``; step 3 runs at ``jit``
level on arrays split like the optimizer state (:attr:`Collectives.slices`), so any optax
optimizer works unchanged: its elementwise arithmetic stays on each device's slice, and where
it needs a whole tensor — LAMB's and LARS's trust ratio ``‖w‖/‖u‖`` (You et al. 2019) — XLA
sums the slices' squares with a scalar all-reduce. A per-slice norm, what an update inside
``shard_map`` would compute, would be wrong by up to ``√N`` (tests/test_zero.py holds the result
to data parallelism's).

The ``jit`` driver's ZeRO (:func:`dtx.step.make_train_step` with ``gradient_shardings``)
leaves all of this to XLA's partitioner; both drivers train the same parameters.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dtx import mesh as mesh_lib
from dtx.comm import costmodel
from dtx.precision import Policy


class ZeroError(ValueError):
    """A ZeRO layout or stage the ``shard_map`` driver cannot run."""


class Collectives(NamedTuple):
    """ZeRO's collectives for one step, as the body's collaborators (module docstring).

    Attributes:
      averages_ride: whether the tensors kept whole are all-reduced after the micro-batch loop: the step's
        averages (loss, metrics), independent of them, then ride in that op (XLA's all-reduce combiner).
      split_micro: inside ``shard_map``, per micro-batch: stage 2's reduce-scatter of each
        micro-batch's gradient into the ``1/N`` accumulator (stage 1: the identity).
      split_grads: inside ``shard_map``, once per step: stage 1's reduce-scatter of the summed
        gradient (stage 2 with accumulation: the identity, its gradient is already scattered).
      accumulator: stage 2 with accumulation: ``params -> zeros`` shaped like the scattered gradient,
        made without a collective; otherwise ``None`` (the body's full-size zeros).
      specs: the scattered gradient's ``PartitionSpec`` per leaf (``shard_map``'s ``out_specs``).
      slices: at ``jit`` level: whole parameters -> their slices in the optimizer state's layout
        (no communication: each device already holds the whole).
      gather: at ``jit`` level: updated slices -> whole parameters (a ``shard_map`` all-gather).
      traffic: ``params -> Traffic``: what one worker sends per step for the gradients and the
        parameters (:func:`traffic`), from their shapes.
    """

    averages_ride: bool
    split_micro: Callable[[Any], Any]
    split_grads: Callable[[Any], Any]
    accumulator: Callable[[Any], Any] | None
    specs: Any
    slices: Callable[[Any], Any]
    gather: Callable[[Any], Any]
    traffic: Callable[[Any], costmodel.Traffic]


def collectives(gradient_shardings: Any, mesh: Mesh, *, stage: int, policy: Policy = Policy(),
                accum_steps: int = 1) -> Collectives:
    """ZeRO stage ``stage``'s collaborators for parameters laid out as ``gradient_shardings``, the
    optimizer state's layout per parameter (:func:`dtx.parallel.gradient_shardings` of
    :func:`dtx.parallel.optimizer_rules`), under ``accum_steps``-step accumulation.
    """
    if stage not in (1, 2):
        raise ZeroError(f"ZeRO stage {stage} is not 1 or 2 (stage 3 is parallel.name=fsdp)")
    axes = mesh_lib.batch_axes(mesh)
    # Hybrid sharding (an "fsdp" and a "data" axis): the slices are reduce-scattered over the state axes, then
    # averaged over the replicas of each slice (the other batch axes): 1/S of the gradient crosses them.
    split_axes = mesh_lib.state_axes(mesh)
    rest = tuple(a for a in axes if a not in split_axes)
    p = math.prod(mesh.shape[a] for a in split_axes)
    replicas = mesh_lib.data_parallel_size(mesh) // p
    dims = split_dims(gradient_shardings, mesh)
    specs = jax.tree.map(lambda s: s.spec, gradient_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    per_dim = functools.partial(jax.tree.map, is_leaf=lambda d: d is None)

    def scatter(grads):
        # Each worker keeps the *mean* of its 1/p of every tensor (divided by p, as data parallelism's
        # pmean), summed on the wire in the reduce dtype; the tensors no dimension of which divides are
        # averaged whole, all in one pmean (one op, as XLA's combiner would run them anyway).
        grads = policy.cast_to_reduce(grads)
        leaves, tree = jax.tree.flatten(grads)
        splits = jax.tree.leaves(dims, is_leaf=lambda d: d is None)
        whole = iter(lax.pmean([g for d, g in zip(splits, leaves) if d is None], axes))
        out = [next(whole) if d is None else lax.psum_scatter(g, split_axes, scatter_dimension=d, tiled=True) / p
               for d, g in zip(splits, leaves)]
        if rest:  # every slice averaged over its replicas in one op
            averaged = iter(lax.pmean([g for d, g in zip(splits, out) if d is not None], rest))
            out = [g if d is None else next(averaged) for d, g in zip(splits, out)]
        return policy.cast_to_params(jax.tree.unflatten(tree, out))

    def accumulator(params):  # shapes only: zeros need no collective
        return jax.tree.map(jnp.zeros_like, jax.eval_shape(scatter, params))

    gather = jax.shard_map(
        lambda slices: per_dim(lambda d, x: x if d is None else lax.all_gather(x, split_axes, axis=d, tiled=True),
                               dims, slices),
        # all_gather's result is the same on every worker, but this jax types it "varying"
        # (its invariant form is private): the replication checker cannot see it.
        mesh=mesh, in_specs=(specs,), out_specs=PartitionSpec(), check_vma=False)
    per_micro = stage == 2 and accum_steps > 1  # stage 2 without accumulation is stage 1
    kept_whole = any(d is None for d in jax.tree.leaves(dims, is_leaf=lambda d: d is None))
    return Collectives(averages_ride=kept_whole and not per_micro,
        split_micro=scatter if per_micro else _identity, split_grads=_identity if per_micro else scatter,
        accumulator=accumulator if per_micro else None, specs=specs,
        slices=lambda params: jax.tree.map(lax.with_sharding_constraint, params, gradient_shardings),
        gather=gather, traffic=lambda params: traffic(params, dims, p, accum_steps, stage, policy.reduce, replicas))


def split_dims(gradient_shardings: Any, mesh: Mesh) -> Any:
    """Per gradient leaf, the dimension split over the state axes (``None``: kept whole).

    ZeRO's layouts (:func:`dtx.parallel.optimizer_rules`) split one dimension of a tensor
    over the state axes together (:func:`dtx.mesh.state_axes`: an ``fsdp`` axis, or every batch
    axis), or leave it whole when no dimension divides.
    """
    axes = mesh_lib.state_axes(mesh)

    def dim(sharding: NamedSharding):
        split = [(i, entry) for i, entry in enumerate(sharding.spec) if entry is not None]
        if not split:
            return None
        (i, entry), = split  # one dimension: the rules' fsdp split
        if tuple(entry if isinstance(entry, tuple) else (entry,)) != axes:
            raise ZeroError(f"ZeRO under shard_map splits over the state axes {axes}; got {sharding.spec}")
        return i

    return jax.tree.map(dim, gradient_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))


def traffic(abstract_params: Any, dims: Any, p: int, accum_steps: int, stage: int,
            reduce_dtype: Any = None, replicas: int = 1) -> costmodel.Traffic:
    """What one worker sends per step, in :mod:`dtx.comm.hlo`'s conventions: ``(p−1)`` times the
    slice's bytes and ``p−1`` rounds per reduce-scatter over the ``p`` state devices (``k`` of them under
    stage 2) and per all-gather; under hybrid sharding each reduced slice's ring all-reduce over its
    ``replicas``; the tensors kept whole are averaged in one ring all-reduce over all ``p·replicas`` workers
    (per micro-batch under stage 2): each leaf's ring bytes, one ring's rounds."""
    messages = sent = 0
    sliced = False
    passes = accum_steps if stage == 2 else 1
    whole = False
    for leaf, dim in zip(jax.tree.leaves(abstract_params), jax.tree.leaves(dims, is_leaf=lambda d: d is None)):
        wire = jnp.dtype(reduce_dtype or leaf.dtype).itemsize
        n = math.prod(leaf.shape)
        if dim is None:  # averaged whole, as often as the others are scattered: one ring op for all of them
            ring = costmodel.expected_traffic("ring", n * wire, p * replicas, None, wire)
            messages += 0 if whole else passes * ring.messages
            sent, whole = sent + passes * ring.bytes_sent, True
            continue
        messages += (passes + 1) * (p - 1)
        sent += (p - 1) * n // p * (passes * wire + jnp.dtype(leaf.dtype).itemsize)
        if replicas > 1:  # the slice averaged over its replicas, one ring all-reduce per pass
            ring = costmodel.expected_traffic("ring", n // p * wire, replicas, None, wire)
            messages += 0 if sliced else passes * ring.messages
            sent, sliced = sent + passes * ring.bytes_sent, True
    return costmodel.Traffic(messages, sent)


def _identity(tree: Any) -> Any:
    return tree
