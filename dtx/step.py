"""Train and eval step factories: one per-device body, two drivers.

The body computes the loss and gradients of the batch it sees, passes them
through a ``reduce`` function, and applies the optimizer. The drivers differ
only in what the body sees and what ``reduce`` is (DESIGN.md §4.2):

* ``"shard_map"`` ("pmap-style"): ``jax.jit(jax.shard_map(body))``. Each device
  sees its slice of the batch; ``reduce`` is an explicit ``lax.pmean`` over the
  batch axes — the synchronous data-parallel SGD of Das et al. §2 and the
  Hitchhiker's Guide §3.1 (average the workers' gradients, then every replica
  applies the same update). Later techniques (allreduce algorithms, compression,
  relaxed synchronisation) replace this ``reduce``.
* ``"jit"`` ("pjit-style"): ``jax.jit`` with ``NamedSharding``. The body sees the
  global batch, ``reduce`` is the identity and XLA inserts the collectives.

Both compute the same numbers as one device running the global batch; the tests
hold them to it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from dtx import mesh as mesh_lib
from dtx.state import TrainState

Batch = dict[str, jax.Array]  # "inputs", "labels"; eval batches add "mask"
Metrics = dict[str, jax.Array]
TrainStep = Callable[[TrainState, Batch], tuple[TrainState, Metrics]]
EvalStep = Callable[[TrainState, Batch], Metrics]


def make_train_step(
    model: nn.Module,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    *,
    driver: str = "shard_map",
    donate: bool = True,
) -> TrainStep:
    """Build the jitted ``(state, batch) -> (state, metrics)`` training step.

    Args:
      model: flax module returning logits, called as ``model(inputs, train=True)``.
      tx: optax optimizer; its state is ``state.opt_state``.
      mesh: device mesh; the batch is split over :func:`dtx.mesh.batch_axes`.
      driver: ``"shard_map"`` or ``"jit"`` (see the module docstring).
      donate: donate the input state's buffers to the output state.

    Returns:
      The step. Metrics (``loss``, ``accuracy``) are global-batch
      averages, replicated on every device.
    """
    axes = mesh_lib.batch_axes(mesh)
    donate_argnums = (0,) if donate else ()
    if driver == "shard_map":
        model = _synchronise_norm(model, axes)
        body = functools.partial(_train_body, model, tx, functools.partial(lax.pmean, axis_name=axes), axes)
        per_device = jax.shard_map(
            body, mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec(axes)), out_specs=PartitionSpec()
        )
        return jax.jit(per_device, donate_argnums=donate_argnums)
    if driver == "jit":
        body = functools.partial(_train_body, model, tx, lambda tree: tree, ())
        replicated, sharded = mesh_lib.replicated(mesh), mesh_lib.batch_sharding(mesh)
        return jax.jit(
            body,
            in_shardings=(replicated, sharded),
            out_shardings=(replicated, replicated),
            donate_argnums=donate_argnums,
        )
    raise ValueError(f"unknown driver {driver!r}; choose 'shard_map' or 'jit'")


def make_eval_step(model: nn.Module, mesh: Mesh, *, driver: str = "shard_map") -> EvalStep:
    """Build the jitted ``(state, batch) -> sums`` evaluation step.

    It returns *sums* over the examples whose ``batch["mask"]`` is true —
    ``loss_sum`` (float32), ``correct`` and ``count`` (int32) — so a padded last
    batch contributes exactly its real examples and the host's totals are exact.
    """
    axes = mesh_lib.batch_axes(mesh)
    if driver == "shard_map":
        body = functools.partial(_eval_body, model, functools.partial(lax.psum, axis_name=axes))
        per_device = jax.shard_map(
            body, mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec(axes)), out_specs=PartitionSpec()
        )
        return jax.jit(per_device)
    if driver == "jit":
        body = functools.partial(_eval_body, model, lambda tree: tree)
        return jax.jit(
            body,
            in_shardings=(mesh_lib.replicated(mesh), mesh_lib.batch_sharding(mesh)),
            out_shardings=mesh_lib.replicated(mesh),
        )
    raise ValueError(f"unknown driver {driver!r}; choose 'shard_map' or 'jit'")


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-example softmax cross-entropy, computed in float32 whatever the compute dtype."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)


def _train_body(
    model: nn.Module,
    tx: optax.GradientTransformation,
    reduce: Callable[[Any], Any],
    axes: tuple[str, ...],
    state: TrainState,
    batch: Batch,
) -> tuple[TrainState, Metrics]:
    rng, step_rng = jax.random.split(jax.random.wrap_key_data(state.rng))
    if axes:  # independent dropout per device; the carried rng stays replicated
        step_rng = jax.random.fold_in(step_rng, lax.axis_index(axes))
    mutable = list(state.model_state)

    def loss_fn(params):
        variables = {"params": params, **state.model_state}
        out = model.apply(variables, batch["inputs"], train=True, mutable=mutable or False, rngs={"dropout": step_rng})
        logits, model_state = out if mutable else (out, state.model_state)
        return cross_entropy(logits, batch["labels"]).mean(), (logits, model_state)

    # Differentiate per-device copies of the parameters: then each device's gradient is
    # its own batch's gradient, and *we* choose how to combine them (shard_map would
    # otherwise sum them implicitly when transposing the replicated-to-varying cast).
    params = lax.pcast(state.params, axes, to="varying") if axes else state.params
    (loss, (logits, model_state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["labels"])
    # The synchronisation point of data-parallel SGD: one averaged gradient for all.
    grads, loss, accuracy, model_state = reduce((grads, loss, accuracy, model_state))
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    new_state = state.replace(
        step=state.step + 1,
        params=optax.apply_updates(state.params, updates),
        model_state=model_state,
        opt_state=opt_state,
        rng=jax.random.key_data(rng),
    )
    # No gradient norm here: on the emulated mesh every device recomputes it, which
    # measured +30% step time for the jit driver (BENCHMARKS.md, step overhead).
    return new_state, {"loss": loss, "accuracy": accuracy}


def _eval_body(model: nn.Module, reduce_sum: Callable[[Any], Any], state: TrainState, batch: Batch) -> Metrics:
    logits = model.apply({"params": state.params, **state.model_state}, batch["inputs"], train=False)
    mask = batch["mask"]
    losses = jnp.where(mask, cross_entropy(logits, batch["labels"]), 0.0)
    correct = jnp.logical_and(mask, jnp.argmax(logits, -1) == batch["labels"])
    return reduce_sum(
        {
            "loss_sum": losses.sum(),
            "correct": correct.sum(dtype=jnp.int32),
            "count": mask.sum(dtype=jnp.int32),
        }
    )


def _synchronise_norm(model: nn.Module, axes: tuple[str, ...]) -> nn.Module:
    """Give batch-norm layers the batch axes, so statistics cover the global batch."""
    if any(f.name == "norm_axis_name" for f in dataclasses.fields(model)):
        return model.clone(norm_axis_name=axes)
    return model
