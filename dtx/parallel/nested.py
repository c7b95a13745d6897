"""A ``shard_map`` region over one mesh axis nested inside a ``shard_map`` manual over others, differentiable.

Why not ``jax.shard_map(..., axis_names={axis})`` alone: when autodiff splits a nested region into its
forward and backward halves, JAX names each residual's layout by every axis the residual varies over, the outer
map's manual axes included (jax 0.10–0.11, ``ShapedArray.nospec``), and Shardy refuses the program ("manual
axis after free axis"). Here the region's VJP is written out: the forward region returns its outputs and its
residuals (the leaves of ``jax.vjp``'s closure, each stacked along a new leading dimension over ``axis`` only),
and the backward region takes them back and applies the closure. Nothing is recomputed: the residuals are
those autodiff would keep.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def region(per_device, in_specs: tuple, out_specs: Any, axis: str):
    """``jax.shard_map(per_device, in_specs, out_specs)`` manual over ``axis`` on the context's mesh (the caller
    is inside a ``shard_map`` manual over the other axes), with its VJP as two such regions. ``in_specs``: one
    spec per leaf of the arguments (a full tree, not a prefix). Integer, boolean and key arguments (masks,
    dropout keys) get no cotangent."""
    mesh = jax.sharding.get_abstract_mesh()

    def mapped(f, ins, outs):
        return jax.shard_map(f, mesh=mesh, in_specs=ins, out_specs=outs, axis_names={axis})

    def call(*args):
        leaves, tree = jax.tree.flatten(args)
        specs = jax.tree.leaves(tuple(in_specs), is_leaf=lambda s: isinstance(s, P))
        if len(specs) != len(leaves):
            raise ValueError(f"nested.region takes one spec per argument leaf: {len(specs)} specs, {len(leaves)} "
                             "leaves")
        floats = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.inexact)]
        rest = [i for i in range(len(leaves)) if i not in floats]

        def apply(differentiable, others):
            merged = [None] * len(leaves)
            for i, x in zip(floats, differentiable):
                merged[i] = x
            for i, x in zip(rest, others):
                merged[i] = x
            return per_device(*jax.tree.unflatten(tree, merged))

        specs_of = lambda idx: [specs[i] for i in idx]  # noqa: E731
        ins = (specs_of(floats), specs_of(rest))
        closure = {}  # the treedef of jax.vjp's closure, learnt while the forward region traces

        @jax.custom_vjp
        def run(differentiable, others):
            return mapped(apply, ins, out_specs)(differentiable, others)

        def forward_device(differentiable, others):
            out, vjp = jax.vjp(lambda d: apply(d, others), differentiable)
            residuals, closure["tree"] = jax.tree.flatten(vjp)
            closure["varying"] = [_varies(r, axis) for r in residuals]
            # A residual that differs between the devices of the axis travels stacked along it; one that does
            # not travels as it is, so that it is typed the same (invariant) in the backward region.
            return out, [r[None] if v else r for r, v in zip(residuals, closure["varying"])]

        def residual_specs():
            return [P(axis) if v else P() for v in closure["varying"]]

        def forward(differentiable, others):
            jax.eval_shape(mapped(forward_device, ins, (out_specs, P(axis))), differentiable, others)  # the kinds
            out, residuals = mapped(forward_device, ins, (out_specs, residual_specs()))(differentiable, others)
            return out, (residuals, others)

        def backward(saved, cotangent):
            residuals, others = saved

            def backward_device(residuals, cotangent):
                kept = [r[0] if v else r for r, v in zip(residuals, closure["varying"])]
                (grads,) = jax.tree.unflatten(closure["tree"], kept)(cotangent)
                return grads

            grads = mapped(backward_device, (residual_specs(), out_specs), ins[0])(residuals, cotangent)
            return grads, [None] * len(others)

        run.defvjp(forward, backward)
        return run([leaves[i] for i in floats], [leaves[i] for i in rest])

    return call


def _varies(x, axis: str) -> bool:
    """Whether ``x`` may differ between the devices of ``axis`` (JAX's varying-manual-axes type)."""
    aval = jax.typeof(x)
    varying = getattr(getattr(aval, "mat", None), "varying", None)
    return True if varying is None else axis in varying
