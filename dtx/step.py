"""Train and eval step factories: one per-device body, two drivers.

The body computes the loss and gradients of the batch it sees, passes the
gradients through a ``reduce`` function, and applies the optimizer. The drivers
differ only in what the body sees and what ``reduce`` is (DESIGN.md §4.2):

* ``"shard_map"`` ("pmap-style"): ``jax.jit(jax.shard_map(body))``. Each device
  sees its slice of the batch; ``reduce`` is an explicit all-reduce over the
  batch axes (``lax.pmean`` by default) — the synchronous data-parallel SGD of
  Das et al. §2 and the Hitchhiker's Guide §3.1: average the workers' gradients,
  then every replica applies the same update. Allreduce algorithms, compression
  and relaxed synchronisation replace this ``reduce``.
* ``"jit"`` ("pjit-style"): ``jax.jit`` with ``NamedSharding``. The body sees the
  global batch, ``reduce`` is the identity and XLA inserts the collectives.

Both compute the same numbers as one device running the global batch; the tests
hold them to it. The body also applies the precision policy (compute dtype,
float32 loss, gradients communicated in the reduce dtype), dynamic loss scaling
(the finiteness verdict is taken on the *reduced* gradients, so every replica
skips the same steps) and gradient accumulation over micro-batches (one
accumulator, one reduction per step).
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dtx import collectives
from dtx import mesh as mesh_lib
from dtx.precision import LossScaler, Policy, all_finite, select_tree
from dtx.state import TrainState

Batch = dict[str, jax.Array]  # "inputs", "labels"; eval batches add "mask"
Metrics = dict[str, jax.Array]
TrainStep = Callable[[TrainState, Batch], tuple[TrainState, Metrics]]
EvalStep = Callable[[TrainState, Batch], Metrics]

DRIVERS = ("shard_map", "jit")


class StepError(ValueError):
    """A step configuration that cannot work (unknown driver, batch not splittable, ...)."""


def make_train_step(
    model: nn.Module,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    *,
    driver: str = "shard_map",
    policy: Policy = Policy(),
    loss_scaler: LossScaler = LossScaler(),
    accum_steps: int = 1,
    allreduce: str = "psum",
    bucket_bytes: int = 0,
    state_shardings: Any = None,
    donate: bool = True,
) -> TrainStep:
    """Build the jitted ``(state, batch) -> (state, metrics)`` training step.

    Args:
      model: flax module returning logits, called as ``model(inputs, train=True)``.
      tx: optax optimizer; its state is ``state.opt_state``.
      mesh: device mesh; the batch is split over :func:`dtx.mesh.batch_axes`.
      driver: ``"shard_map"`` or ``"jit"`` (see the module docstring).
      policy: dtypes for compute, output and gradient communication.
      loss_scaler: dynamic loss scaling (float16); disabled by default.
      accum_steps: micro-batches per step; gradients are summed into one
        accumulator and reduced once. The per-device batch must divide by it.
      allreduce: ``shard_map`` driver: the algorithm that averages gradients over
        the batch axes (:data:`dtx.collectives.ALGORITHMS`); ``psum`` is XLA's own.
      bucket_bytes: fuse gradients into buckets of this many bytes per allreduce
        (Horovod's fusion threshold); 0 reduces leaf by leaf.
      state_shardings: ``jit`` driver: the state's ``NamedSharding`` tree (model,
        hybrid, FSDP partitionings; see :mod:`dtx.parallel`); default replicated.
        The ``shard_map`` driver runs replicated (data-parallel) states only.
      donate: donate the input state's buffers to the output state.

    Returns:
      The step. Metrics are global-batch averages, replicated on every device:
      ``loss``, ``accuracy``, and with loss scaling ``loss_scale`` (the scale this
      step used), ``skipped`` (1 when this step was skipped) and ``skipped_steps``.
    """
    if accum_steps < 1:
        raise StepError(f"accum_steps={accum_steps} must be >= 1")
    axes = mesh_lib.batch_axes(mesh)
    shards = mesh_lib.data_parallel_size(mesh)
    donate_argnums = (0,) if donate else ()
    common = dict(tx=tx, policy=policy, scaler=loss_scaler, accum_steps=accum_steps)
    if driver == "shard_map":
        if state_shardings is not None and not all(
                s.is_fully_replicated for s in jax.tree.leaves(state_shardings)):
            raise StepError("the shard_map driver runs data parallelism (replicated parameters); for model, "
                            "hybrid or fsdp partitioning use --config.driver=jit")
        reduce = collectives.make_allreduce(allreduce, axes, mean=True, bucket_bytes=bucket_bytes)
        body = functools.partial(
            _train_body, model=_synchronise_norm(model, axes), reduce=reduce, axes=axes, shards=1,
            constrain=lambda x: x, **common,
        )
        # An allreduce built from ppermutes leaves identical values on every device, but
        # JAX types them "varying" and has no free cast back to replicated; such steps
        # run without the replication checker (the tests assert identical replicas).
        per_device = jax.shard_map(
            body, mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec(axes)), out_specs=PartitionSpec(),
            check_vma=allreduce == "psum",
        )
        return jax.jit(per_device, donate_argnums=donate_argnums)
    if driver == "jit":
        if allreduce != "psum" or bucket_bytes:
            raise StepError(f"allreduce={allreduce!r} / bucket_bytes={bucket_bytes} need driver='shard_map'; "
                            "under 'jit' XLA chooses the collectives")
        micro_sharding = NamedSharding(mesh, PartitionSpec(None, axes))
        body = functools.partial(
            _train_body, model=model, reduce=lambda tree: tree, axes=(), shards=shards,
            constrain=lambda x: lax.with_sharding_constraint(x, micro_sharding), **common,
        )
        replicated, sharded = mesh_lib.replicated(mesh), mesh_lib.batch_sharding(mesh)
        state_sharding = replicated if state_shardings is None else state_shardings
        return jax.jit(body, in_shardings=(state_sharding, sharded), out_shardings=(state_sharding, replicated),
                       donate_argnums=donate_argnums)
    raise StepError(f"unknown driver {driver!r}; choose one of {list(DRIVERS)}")


def make_eval_step(model: nn.Module, mesh: Mesh, *, driver: str = "shard_map", policy: Policy = Policy(),
                   state_shardings: Any = None) -> EvalStep:
    """Build the jitted ``(state, batch) -> sums`` evaluation step.

    It returns *sums* over the examples whose ``batch["mask"]`` is true —
    ``loss_sum`` (float32), ``correct`` and ``count`` (int32) — so a padded last
    batch contributes exactly its real examples and the host's totals are exact.
    """
    axes = mesh_lib.batch_axes(mesh)
    if driver == "shard_map":
        body = functools.partial(_eval_body, model, policy, functools.partial(lax.psum, axis_name=axes))
        per_device = jax.shard_map(
            body, mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec(axes)), out_specs=PartitionSpec()
        )
        return jax.jit(per_device)
    if driver == "jit":
        body = functools.partial(_eval_body, model, policy, lambda tree: tree)
        state_sharding = mesh_lib.replicated(mesh) if state_shardings is None else state_shardings
        return jax.jit(body, in_shardings=(state_sharding, mesh_lib.batch_sharding(mesh)),
                       out_shardings=mesh_lib.replicated(mesh))
    raise StepError(f"unknown driver {driver!r}; choose one of {list(DRIVERS)}")


def check_accumulation(global_batch_size: int, accum_steps: int, mesh: Mesh) -> None:
    """Fail early when the per-device batch does not split into ``accum_steps`` micro-batches."""
    local = global_batch_size // mesh_lib.data_parallel_size(mesh)
    if accum_steps < 1 or local % accum_steps:
        raise StepError(
            f"grad_accum_steps={accum_steps} must divide the per-device batch {local} "
            f"(global_batch_size={global_batch_size} over {mesh_lib.data_parallel_size(mesh)} devices); "
            f"choose one of {[d for d in range(1, local + 1) if local % d == 0]}"
        )


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-example softmax cross-entropy, computed in float32 whatever the compute dtype."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)


def _train_body(state: TrainState, batch: Batch, *, model, tx, policy, scaler, accum_steps, reduce, axes,
                shards, constrain) -> tuple[TrainState, Metrics]:
    rng, step_rng = jax.random.split(jax.random.wrap_key_data(state.rng))
    if axes:  # independent dropout per device; the carried rng stays replicated
        step_rng = jax.random.fold_in(step_rng, lax.axis_index(axes))
    mutable = list(state.model_state)

    def loss_fn(params, model_state, micro, micro_rng):
        variables = {"params": policy.cast_to_compute(params), **model_state}
        inputs = policy.cast_to_compute(micro["inputs"])
        out = model.apply(variables, inputs, train=True, mutable=mutable or False, rngs={"dropout": micro_rng})
        logits, model_state = out if mutable else (out, model_state)
        loss = cross_entropy(policy.cast_to_output(logits), micro["labels"]).mean()
        correct = jnp.mean(jnp.argmax(logits, -1) == micro["labels"])
        return scaler.scale_loss(state.loss_scale, loss), (loss, correct, model_state)

    # Differentiate per-device copies of the parameters: then each device's gradient is
    # its own batch's gradient, and *we* choose how to combine them (shard_map would
    # otherwise sum them implicitly when transposing the replicated-to-varying cast).
    params = lax.pcast(state.params, axes, to="varying") if axes else state.params
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if accum_steps == 1:
        (_, (loss, accuracy, model_state)), grads = grad_fn(params, state.model_state, batch, step_rng)
    else:
        grads, loss, accuracy, model_state = _accumulate(grad_fn, params, state.model_state, batch, step_rng,
                                                         accum_steps, shards, constrain, axes)

    # The synchronisation point of data-parallel SGD: one averaged gradient for all,
    # communicated in the policy's reduce dtype.
    grads = policy.cast_to_params(reduce(policy.cast_to_reduce(grads)))
    grads = scaler.unscale(state.loss_scale, grads)
    loss, accuracy, model_state = _pmean_if(axes, (loss, accuracy, model_state))

    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "accuracy": accuracy}
    loss_scale = state.loss_scale
    if scaler.enabled:
        # Decided on the reduced gradients: identical on every replica, so all skip together.
        finite = all_finite(grads)
        params, opt_state, model_state = select_tree(
            finite, (params, opt_state, model_state), (state.params, state.opt_state, state.model_state)
        )
        loss_scale = scaler.update(state.loss_scale, finite)
        metrics.update(loss_scale=state.loss_scale.scale, skipped=(~finite).astype(jnp.int32),
                       skipped_steps=loss_scale.skipped_steps)
    new_state = state.replace(step=state.step + 1, params=params, model_state=model_state, opt_state=opt_state,
                              rng=jax.random.key_data(rng), loss_scale=loss_scale)
    return new_state, metrics


def _accumulate(grad_fn, params, model_state, batch, rng, k, shards, constrain, axes):
    """Sum gradients over ``k`` micro-batches with one accumulator (no k-fold copies).

    Micro-batch ``i`` takes the ``i``-th ``1/k`` of *every device's* slice, so each
    micro-batch stays spread over all devices and both drivers see the same ones.
    """

    def split(x):
        if x.shape[0] % (shards * k):
            raise StepError(f"accum_steps={k} must divide the per-device batch {x.shape[0] // shards}; "
                            "see dtx.step.check_accumulation")
        x = x.reshape((shards, k, x.shape[0] // (shards * k)) + x.shape[1:])
        return constrain(jnp.swapaxes(x, 0, 1).reshape((k, -1) + x.shape[3:]))

    micro_batches = jax.tree.map(split, batch)

    def one(carry, inputs):
        grads_sum, loss_sum, accuracy_sum, model_state = carry
        micro, index = inputs
        (_, (loss, accuracy, model_state)), grads = grad_fn(params, model_state, micro, jax.random.fold_in(rng, index))
        grads_sum = jax.tree.map(jnp.add, grads_sum, grads)
        return (grads_sum, loss_sum + loss, accuracy_sum + accuracy, model_state), None

    zero = jnp.zeros((), jnp.float32)
    if axes:  # the running sums hold per-device values: type them so for shard_map's checker
        zero = lax.pcast(zero, axes, to="varying")
    init = (jax.tree.map(jnp.zeros_like, params), zero, zero, model_state)
    (grads, loss, accuracy, model_state), _ = lax.scan(one, init, (micro_batches, jnp.arange(k)))
    return jax.tree.map(lambda g: g / k, grads), loss / k, accuracy / k, model_state


def _pmean_if(axes, tree):
    return lax.pmean(tree, axes) if axes else tree


def _eval_body(model: nn.Module, policy: Policy, reduce_sum, state: TrainState, batch: Batch) -> Metrics:
    variables = {"params": policy.cast_to_compute(state.params), **state.model_state}
    logits = policy.cast_to_output(model.apply(variables, policy.cast_to_compute(batch["inputs"]), train=False))
    mask = batch["mask"]
    losses = jnp.where(mask, cross_entropy(logits, batch["labels"]), 0.0)
    correct = jnp.logical_and(mask, jnp.argmax(logits, -1) == batch["labels"])
    return reduce_sum({"loss_sum": losses.sum(), "correct": correct.sum(dtype=jnp.int32),
                       "count": mask.sum(dtype=jnp.int32)})


def _synchronise_norm(model: nn.Module, axes: tuple[str, ...]) -> nn.Module:
    """Give batch-norm layers the batch axes, so statistics cover the global batch."""
    if any(f.name == "norm_axis_name" for f in dataclasses.fields(model)):
        return model.clone(norm_axis_name=axes)
    return model
