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
The same map with ``k = 1`` sums the gradients of a parameter's several uses (a tied embedding) before the
reduction, which a global gradient reduces apart (:mod:`dtx.step.jit`).

Except under FSDP, the map is in fact one ``shard_map`` manual over the mapped axes (:func:`manual_gradients`):
under the vmap, XLA gathered a convolutional network's activations and computed them again (a trip of VGG-A at
1/16 width, k = 2: 43.6 MFLOP against 12.9, data parallel and hybrid alike; LeNet 2.9x). Whole gradients (data
parallelism, ZeRO-1) leave that map unreduced, one row per shard, and are summed outside it as the vmap's are,
so ZeRO's reduction still goes straight to its shards. Activation layouts (Das et al.'s model-parallel layers,
Megatron's regions) declare ``manual``: their constraints leave the map's axes out and their regions nest in it
over ``model`` (:mod:`dtx.parallel.nested`). FSDP reducing once keeps the vmap, and with it the recomputation on
conv nets: in the map its parameters were whole through each micro-batch beside the whole accumulator (a
256-1024-16 MLP: 2.39 -> 3.46 MB compiled), and FSDP exists to save memory.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dtx import mesh as mesh_lib

SHARD_AXIS = "shards"  # the vmapped shard dimension's name (batch norm's statistics are averaged over it)


class Apart(NamedTuple):
    """How a ``jit`` step lays out per-shard values (module docstring).

    A shard is one device (data parallelism, ZeRO-1), or with a ``model`` axis one model group: its
    devices share the shard's examples at a model-parallel layer, so only the other axes are mapped, and
    inside a shard the activation layout (:meth:`dtx.parallel.activations.ActivationLayout.inside_map`)
    places the examples and features on the group's devices as it does without the map.
    """

    mesh: Mesh
    axes: tuple[str, ...]  # the mesh axes the shard dimension lies along (vmap's ``spmd_axis_name``)
    params: Any = None  # the parameters' PartitionSpecs (how each shard's gradient is split); None: whole
    manual: bool = False  # a shard_map manual over ``axes`` instead of the vmap (:func:`manual_gradients`)

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The names the shards are reduced over inside the map (batch norm's statistics)."""
        return self.axes if self.manual else (SHARD_AXIS,)

    @property
    def shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.axes)

    @property
    def within(self) -> int:
        """Devices per shard (a model group's size; 1 without one): they share the shard's examples."""
        return math.prod(self.mesh.shape[a] for a in mesh_lib.batch_axes(self.mesh) if a not in self.axes)

    def place(self, tree, specs=None):
        """Constrain a tree of ``(shards, ...)`` arrays: the shard dimension along ``axes``, the rest as
        ``specs`` (a matching tree of PartitionSpecs; default: whole)."""
        specs = specs if specs is not None else jax.tree.map(lambda _: PartitionSpec(), tree)
        return jax.tree.map(lambda x, spec: lax.with_sharding_constraint(
            x, NamedSharding(self.mesh, PartitionSpec(self.axes, *spec))), tree, specs)

    def micro(self, x):
        """Constrain a ``(k, shards, rows, ...)`` stack of micro-batches: each shard's rows on its devices."""
        rest = tuple(a for a in mesh_lib.batch_axes(self.mesh) if a not in self.axes)
        return lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec(None, self.axes, rest or None)))


def gradients(grad_fn, params, model_state, batch, rng, k: int, apart: Apart):
    """``(grads, loss, metrics, model_state)`` of ``k`` micro-batches, every shard's gradients summed apart and
    reduced once after the loop (module docstring). ``grad_fn``: ``jax.value_and_grad`` of the body's loss.

    Micro-batch ``i`` is the ``i``-th ``1/k`` of every device's slice, the micro-batches of
    :func:`dtx.step.body.gradients`; a shard of a model group's ``within`` devices takes their slices' ``i``-th
    ``1/k`` together (nothing moves). Each shard's loss is a mean over its own examples (or its sums over
    the global count per shard, see :func:`dtx.step.body.valid_denominator`), so the mean over shards is
    the micro-batch's.
    """
    if apart.manual:
        return manual_gradients(grad_fn, params, model_state, batch, rng, k, apart)
    per_shard = jax.vmap(grad_fn, in_axes=(None, 0, 0, 0), axis_name=SHARD_AXIS, spmd_axis_name=apart.axes)

    shards, within = apart.shards, apart.within

    def split(x):  # (B, ...) -> (k, shards, B / (shards k), ...), device-major within a shard
        x = x.reshape((shards, within, k, x.shape[0] // (shards * within * k)) + x.shape[1:])
        x = jnp.moveaxis(x, 2, 0)
        return apart.micro(x.reshape((k, shards, -1) + x.shape[4:]))

    def spread(tree):  # a copy per shard, on its own devices
        return apart.place(_copies(tree, shards))

    micro_batches = jax.tree.map(split, batch)
    shard_ids = jnp.arange(shards)

    def one(carry, inputs):
        grads_sum, loss_sum, values_sum, states = carry
        micro, index = inputs
        # The keys shard_map's workers draw: the worker's, then the micro-batch's.
        keys = jax.vmap(lambda s: _key(rng, s, index, k))(shard_ids)
        (_, (loss, values, states)), grads = per_shard(params, states, micro, keys)
        add = lambda a, b: a + b  # noqa: E731
        return (jax.tree.map(add, grads_sum, grads), loss_sum + loss, jax.tree.map(add, values_sum, values),
                states), None

    first = jax.tree.map(lambda x: x[0], micro_batches)
    names = jax.eval_shape(lambda: per_shard(params, spread(model_state), first, jax.random.split(rng, shards)))
    zero = apart.place(jnp.zeros((shards,), jnp.float32))
    accumulator = apart.place(_copies(jax.tree.map(jnp.zeros_like, params), shards), apart.params)
    init = (accumulator, zero, {name: zero for name in names[0][1][1]}, spread(model_state))
    (grads, loss, values, states), _ = lax.scan(one, init, (micro_batches, jnp.arange(k)))
    # The step's one reduction: the sum over the shard dimension (its mean over shards and micro-batches).
    scale = 1.0 / (shards * k)
    grads = jax.tree.map(lambda g: (g.sum(0) * scale).astype(g.dtype), grads)
    # Batch norm's statistics are averaged over the shards inside the loop: every copy is the same.
    model_state = jax.tree.map(lambda s: s.mean(0).astype(s.dtype), states)
    return grads, loss.sum() * scale, {n: v.sum() * scale for n, v in values.items()}, model_state


def _copies(tree, shards: int):
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (shards,) + x.shape), tree)


def _key(rng, shard, index, k: int):
    """The key shard_map's worker ``shard`` draws for micro-batch ``index`` (its own key when ``k = 1``)."""
    key = jax.random.fold_in(rng, shard)
    return key if k == 1 else jax.random.fold_in(key, index)


def manual_gradients(grad_fn, params, model_state, batch, rng, k: int, apart: Apart):
    """:func:`gradients` with the micro-batch loop inside one ``shard_map`` manual over ``apart.axes`` (the data
    axes; ``model`` stays the compiler's): each device computes its own examples only (module docstring), and an
    activation layout's own regions nest in it (a vmap of Megatron's fails JAX's replication typing). The
    parameters enter typed as varying over the map, so each shard's gradient stays its own (unreduced) through
    the loop; the step's one reduction is the sum of the shard rows outside the map (whole gradients) or one
    ``psum`` inside it (gradients split over ``model``)."""
    axes, shards, within = apart.axes, apart.shards, apart.within
    spec = PartitionSpec(axes)

    def per_shard(params, model_state, batch, rng):
        shard = lax.axis_index(axes)
        params, model_state = lax.pcast((params, model_state), axes, to="varying")

        def split(x):  # this shard's rows -> (k, rows / k, ...): the i-th 1/k of each of its devices' slices
            x = x.reshape((within, k, x.shape[0] // (within * k)) + x.shape[1:])
            return jnp.moveaxis(x, 1, 0).reshape((k, -1) + x.shape[3:])

        micro_batches = jax.tree.map(split, batch)

        def one(carry, inputs):
            grads_sum, loss_sum, values_sum, states = carry
            micro, index = inputs
            (_, (loss, values, states)), grads = grad_fn(params, states, micro, _key(rng, shard, index, k))
            return (jax.tree.map(jnp.add, grads_sum, grads), loss_sum + loss,
                    jax.tree.map(jnp.add, values_sum, values), states), None

        first = jax.tree.map(lambda x: x[0], micro_batches)
        names = jax.eval_shape(lambda: grad_fn(params, model_state, first, rng))[0][1][1]
        zero = lax.pcast(jnp.zeros((), jnp.float32), axes, to="varying")
        init = (jax.tree.map(jnp.zeros_like, params), zero, {name: zero for name in names}, model_state)
        (grads, loss, values, states), _ = lax.scan(one, init, (micro_batches, jnp.arange(k)))
        states = jax.tree.map(lambda s: lax.pmean(s, axes).astype(s.dtype), states)
        if stacked:  # each shard's sums leave the map unreduced, one row per shard
            return jax.tree.map(lambda x: x[None], (grads, loss, values)) + (states,)
        scale = 1.0 / (shards * k)  # the step's one reduction: the sum over the shards (their mean)
        grads, loss, values = jax.tree.map(lambda x: (lax.psum(x, axes) * scale).astype(x.dtype),
                                           (grads, loss, values))
        return grads, loss, values, states

    # Whole gradients (apart.params None: data, ZeRO-1) are reduced outside the map, by the sum over
    # its shard rows, as the vmap form does: the partitioner then sends them straight to the layout the step
    # asks for (a reduce-scatter to ZeRO's shards) where a psum inside would all-reduce them first.
    stacked = apart.params is None
    whole = PartitionSpec()
    out = (spec, spec, spec, whole) if stacked else whole
    mapped = jax.shard_map(per_shard, mesh=apart.mesh, in_specs=(whole, whole, spec, whole), out_specs=out,
                           axis_names=set(axes))
    grads, loss, values, model_state = mapped(params, model_state, batch, rng)
    if stacked:
        scale = 1.0 / (shards * k)
        grads, loss, values = jax.tree.map(lambda x: (x.sum(0) * scale).astype(x.dtype), (grads, loss, values))
    return grads, loss, values, model_state
