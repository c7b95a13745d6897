"""What the memory model (:mod:`dtx.perf.memory`) reads of a flax model: per layer, what its backward pass keeps.

Korthikanti et al. 2022 (arXiv 2205.05198) account activations per layer: what the backward pass needs
of the forward pass, per example. Here JAX's own VJP says it (:func:`activation_profile`: the residuals
``jax.vjp`` saves, attributed to the Dense/Conv layer that produced them), plus what XLA:CPU adds around
a max pool (read from the compiled buffer assignment), and :func:`model_terms` gathers what
:func:`dtx.perf.memory.estimate` needs beyond the layers: norm parameters, batch-norm state, the batch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from dtx.paths import path_str
from dtx.perf import remat
from dtx.perf.layers import abstract_variables, analyze, per_model

POOL_INDEX_ARRAYS = 4  # XLA:CPU max pool: one int32 window index per input dimension (NHWC)


@dataclasses.dataclass(frozen=True)
class Stash:
    """Bytes per example after a layer: ``kept`` by autodiff; XLA:CPU's max-pool arrays ``pool_kept``, ``pool_in``."""

    kept: float
    pool_kept: float = 0.0  # int32 argmax indices, kept to the pool's backward
    pool_in: float = 0.0  # int32 window-index iotas and a broadcast, built before the forward pass


def activation_profile(model: Any, input_shape: Sequence[int], dtype: Any = np.float32,
                       fused: bool = False) -> dict[str, Stash]:
    """Per Dense/Conv layer, the bytes per example the backward pass keeps (:class:`Stash`).

    Traces ``jax.vjp`` of the model's training forward pass at batch 1 and 2
    (``make_jaxpr``: nothing runs) and gives each residual JAX saves to the last
    Dense/Conv layer at or before the equation that produced it (by its flax name
    stack); per example = batch 2 − batch 1, so parameters, the input batch and
    per-channel statistics drop out. Each max pool adds XLA:CPU's arrays: ``4·out``
    int32 argmax indices to ``kept``, ``4·in`` int32 index iotas and one float32
    broadcast of ``in`` to ``pool_in`` (read from the compiled buffer assignment). ``fused``: count what XLA
    keeps of them instead, the roots of their cheap element-wise chains (:func:`dtx.perf.remat.fused_roots`).
    """
    import jax
    import jax.extend.core as jex
    import jax.numpy as jnp

    names = [layer.name for layer in analyze(model, input_shape, dtype=dtype)]
    variables = abstract_variables(model, input_shape, dtype=dtype)
    state = {key: value for key, value in variables.items() if key != "params"}

    def loss(params, state, x):
        out = model.apply({"params": params, **state}, x, train=True, mutable=list(state) or False,
                          rngs={"dropout": jax.random.key(0)})
        return (out[0] if state else out).astype(jnp.float32).sum()

    def per_layer(batch: int) -> dict[str, list[float]]:
        x = jax.ShapeDtypeStruct((batch, *input_shape), dtype)
        closed, shapes = jax.make_jaxpr(lambda p, s, x: jax.vjp(lambda p, x: loss(p, s, x), p, x),
                                        return_shape=True)(variables["params"], state, x)
        jaxpr = closed.jaxpr
        count = len(jax.tree.leaves(shapes[1]))  # the VJP closure's leaves are the residuals
        residuals = {v for v in jaxpr.outvars[len(jaxpr.outvars) - count:] if not isinstance(v, jex.Literal)}
        if fused:  # what XLA stores of them (their inputs are no equation's output: parameters, the batch)
            residuals = remat.fused_roots(jaxpr, residuals)
        found, current = {name: [0.0, 0.0, 0.0] for name in names}, names[0]
        for eqn in jaxpr.eqns:
            stack = str(eqn.source_info.name_stack)
            if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
                current = next((name for name in names if stack == name or stack.endswith("/" + name)), current)
            for var in eqn.outvars:
                if var in residuals:
                    residuals.discard(var)  # saved once, however often it is used
                    found[current][0] += var.aval.size * var.aval.dtype.itemsize
            if eqn.primitive.name == "reduce_window_max":
                found[current][1] += POOL_INDEX_ARRAYS * 4 * eqn.outvars[0].aval.size
                found[current][2] += (POOL_INDEX_ARRAYS + 1) * 4 * eqn.invars[0].aval.size
        return found

    one, two = per_layer(1), per_layer(2)
    return {name: Stash(*(b - a for a, b in zip(one[name], two[name]))) for name in names}


def model_terms(model: Any, input_shape: Sequence[int], dtype: Any = np.float32) -> dict[str, Any]:
    """What :func:`estimate` needs of a flax model beyond its layers: residuals, other parameters, state, batch
    (``dtype``: of the inputs; an integer one is token ids, each with an int32 label, :mod:`dtx.data.tasks`'s
    ``next_token``), and a model's rematerialisation (:func:`dtx.perf.remat.recompute_bytes`). Traced once per
    model, example shape and dtype (a run refused by ``memory_limit`` weighs every layout of the same model)."""
    terms = _model_terms(model, input_shape, dtype)
    return dict(terms, other_params=list(terms["other_params"]))


@per_model
def _model_terms(model: Any, input_shape: tuple[int, ...], dtype: Any) -> dict[str, Any]:
    import jax

    variables = abstract_variables(model, input_shape, dtype=dtype)
    layers = {layer.name for layer in analyze(model, input_shape, dtype=dtype)}
    other = [tuple(leaf.shape) for path, leaf in jax.tree_util.tree_leaves_with_path(variables["params"])
             if path_str(path[:-1]) not in layers]
    state = sum(math.prod(v.shape) * v.dtype.itemsize for key, tree in variables.items() if key != "params"
                for v in jax.tree.leaves(tree))
    tokens = np.issubdtype(dtype, np.integer)
    return dict(stash=activation_profile(model, input_shape, dtype, fused=remat.takes_policy(model)),
                input_bytes=math.prod(input_shape) * 4 * (2 if tokens else 1) + (0 if tokens else 4),
                other_params=other, model_state_bytes=state, recompute=remat.recompute_bytes(model, input_shape, dtype))
