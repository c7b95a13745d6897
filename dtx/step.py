"""Train and eval step factories: one per-device body, two drivers.

The body computes the loss and gradients of the batch it sees, passes the
gradients through a ``reduce`` function, and applies the optimizer. The drivers
differ only in what the body sees and what ``reduce`` is (one per-device body, two drivers, tested equal):

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
(each worker flags the gradients it is about to compress, before compression;
the flags of all workers travel in the all-reduce of the loss and accuracy, and
the reduced gradients must be finite too, so every replica skips the same steps
and no compressor can hide an overflow) and gradient accumulation over
micro-batches (one accumulator, one reduction per step).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dtx import collectives, compress, costmodel, strategies
from dtx import tasks as task_lib
from dtx import mesh as mesh_lib
from dtx import batchnorm
from dtx.compress import Compressor
from dtx.precision import LossScaler, Policy, all_finite, select_tree
from dtx.state import TrainState
from dtx.strategies import Strategy
from dtx.tasks import Task, cross_entropy  # noqa: F401  (cross_entropy: public here too)

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
    strategy: Strategy | None = None,
    compressor: Compressor | None = None,
    communicate: bool = True,
    grad_norm: bool = False,
    layout: Callable[[], Any] | None = None,
    gradient_shardings: Any = None,
    shard_accumulator: bool = False,
    task: Task | None = None,
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
      state_shardings: the state's ``NamedSharding`` tree (model, hybrid, FSDP, ZeRO
        partitionings; see :mod:`dtx.parallel`); default replicated. The ``shard_map``
        driver runs replicated parameters only (data parallelism, ZeRO).
      donate: donate the input state's buffers to the output state.
      strategy: how workers synchronise (:mod:`dtx.strategies`); default ``sync``.
        Others need the ``shard_map`` driver.
      compressor: gradient compression around the allreduce (:mod:`dtx.compress`);
        default none. Others need the ``shard_map`` driver.
      communicate: ``False`` builds the same step with every collective of the
        gradient path removed (each worker applies its own gradient): not training,
        a yardstick — ``dtx bench step`` times both to split compute from communication.
      grad_norm: also report ``grad_norm``, the global L2 norm of the reduced gradient
        (strategies that reduce gradients: sync, async, ssp). Opt-in: it costs ~30% on
        the jit driver of an emulated mesh (BENCHMARKS.md).
      layout: ``jit`` driver: where activations live, a context manager factory
        entered around the model's forward pass — :func:`dtx.parallel.activation_layout`
        of the state's parameter specs for model, hybrid and rules partitionings
        (model-parallel layers gather their input inside the ``model`` group).
      gradient_shardings: ZeRO: where the reduced gradients live, a tree of ``NamedSharding``
        like the parameters (:func:`dtx.parallel.gradient_shardings` of
        :func:`dtx.parallel.optimizer_rules`): split like the optimizer state. Under ``jit``
        XLA reduce-scatters the gradients to it; under ``shard_map`` :mod:`dtx.zero` writes
        the reduce-scatter and the parameters' all-gather out (strategy sync, no compression).
      shard_accumulator: with ``gradient_shardings``: also keep each micro-batch's gradient
        split while accumulating (ZeRO-2: a ``1/N`` accumulator, one reduce-scatter per
        micro-batch); otherwise the full accumulator is split once (ZeRO-1).
      task: the loss and metrics (:mod:`dtx.tasks`); default classification (cross-entropy,
        ``accuracy``). A task with padding (``valid``) averages over the valid elements of the
        global batch: one extra scalar all-reduce of their count under ``shard_map``.

    Returns:
      The step. Metrics are global-batch averages, replicated on every device:
      ``loss``, the task's metrics (``accuracy``), ``comm_bytes`` and ``comm_rounds`` (``shard_map`` driver: what
      each worker sent this step, :mod:`dtx.costmodel`'s accountant, the all-reduce of these
      averages included; under ``jit`` they are
      read from the compiled program, :func:`dtx.hlo.total`), the strategy's own metrics, and
      with loss scaling ``loss_scale`` (the scale this step used), ``skipped`` (1 when
      this step was skipped) and ``skipped_steps``.
    """
    if accum_steps < 1:
        raise StepError(f"accum_steps={accum_steps} must be >= 1")
    strategy = strategy or strategies.sync()
    compressor = compressor or compress.none()
    check_combination(driver, strategy, compressor, loss_scaler)
    axes = mesh_lib.batch_axes(mesh)
    shards = mesh_lib.data_parallel_size(mesh)
    donate_argnums = (0,) if donate else ()
    if layout is not None and driver != "jit":
        raise StepError("an activation layout (model-parallel layers) needs driver='jit'")
    if gradient_shardings is not None and driver == "shard_map":  # ZeRO's explicit collectives
        if strategy.name != "sync" or compressor.name != "none" or allreduce != "psum" or bucket_bytes \
                or not communicate:
            raise StepError("ZeRO (gradient_shardings) reduce-scatters and all-gathers by itself: it runs "
                            "strategy sync, no compression, allreduce 'psum', no buckets")
        from dtx import zero

        return zero.make_zero_step(model, tx, mesh, stage=2 if shard_accumulator else 1,
                                   state_shardings=state_shardings, gradient_shardings=gradient_shardings,
                                   policy=policy, loss_scaler=loss_scaler, accum_steps=accum_steps,
                                   task=task, grad_norm=grad_norm, donate=donate)
    if shard_accumulator and driver != "jit":
        raise StepError("shard_accumulator (ZeRO-2) needs gradient_shardings")
    split_grads = (functools.partial(lax.with_sharding_constraint, shardings=gradient_shardings)
                   if gradient_shardings is not None else _identity)
    common = dict(split_grads=split_grads, split_micro=split_grads if shard_accumulator else _identity,
                  tx=tx, policy=policy, scaler=loss_scaler, accum_steps=accum_steps, strategy=strategy,
                  compressor=compressor, grad_norm=grad_norm, layout=layout or contextlib.nullcontext,
                  task=task or task_lib.classification())
    if driver == "shard_map":
        if state_shardings is not None and not all(
                s.is_fully_replicated for s in jax.tree.leaves(state_shardings.replace(worker={}))):
            raise StepError("the shard_map driver runs data parallelism (replicated state; ZeRO needs "
                            "gradient_shardings); for model, hybrid, fsdp or rules partitioning use --config.driver=jit "
                            "(make_train_step(..., driver='jit'))")
        allreduce_fn = collectives.make_allreduce(allreduce, axes, mean=True, bucket_bytes=bucket_bytes)
        comm = compress.CommContext(axes, shards, allreduce_fn, allreduce, _inner_size(allreduce, axes, mesh),
                                    bucket_bytes)
        if not communicate:
            comm = _silent(comm)
        # Synchronous strategies normalise over the global batch; workers with their own
        # models normalise over their own batch (no collective inside the forward pass).
        norm_model = model if strategy.local_models else _synchronise_norm(model, axes)
        body = functools.partial(_train_body, model=norm_model, comm=comm, axes=axes, shards=1,
                                 constrain=lambda x: x, **common)
        # An allreduce built from ppermutes (and the compressed ones) leaves identical values
        # on every device, but JAX types them "varying" and has no free cast back to
        # replicated; such steps run without the replication checker (the tests assert
        # identical replicas instead).
        plain = allreduce == "psum" and strategy.name == "sync" and compressor.name == "none" and communicate
        specs = state_specs(axes)
        per_device = jax.shard_map(
            _per_worker(body), mesh=mesh, in_specs=(specs, PartitionSpec(axes)), out_specs=(specs, PartitionSpec()),
            check_vma=plain,
        )
        return jax.jit(per_device, donate_argnums=donate_argnums)
    if driver == "jit":
        if allreduce != "psum" or bucket_bytes:
            raise StepError(f"allreduce={allreduce!r} / bucket_bytes={bucket_bytes} need driver='shard_map'; "
                            "under 'jit' XLA chooses the collectives")
        if not communicate:
            raise StepError("communicate=False needs driver='shard_map' (under 'jit' XLA places the collectives)")
        micro_sharding = NamedSharding(mesh, PartitionSpec(None, axes))
        comm = compress.CommContext((), shards, lambda tree: tree, "psum")
        body = functools.partial(
            _train_body, model=model, comm=comm, axes=(), shards=shards,
            constrain=lambda x: lax.with_sharding_constraint(x, micro_sharding), **common,
        )
        replicated, sharded = mesh_lib.replicated(mesh), mesh_lib.batch_sharding(mesh)
        state_sharding = replicated if state_shardings is None else state_shardings
        return jax.jit(_without_comm(body), in_shardings=(state_sharding, sharded),
                       out_shardings=(state_sharding, replicated), donate_argnums=donate_argnums)
    raise StepError(f"unknown driver {driver!r}; choose one of {list(DRIVERS)}")


def _without_comm(body):
    """Under ``jit`` XLA places the collectives, so the step cannot count them while tracing:
    their bytes are read from the compiled program instead (:mod:`dtx.hlo`; ``dtx train`` records them)."""

    def step(state, batch):
        new_state, metrics = body(state, batch)
        return new_state, {k: v for k, v in metrics.items() if k not in ("comm_bytes", "comm_rounds")}

    return step


def check_combination(driver: str, strategy: Strategy, compressor: Compressor, loss_scaler: LossScaler) -> None:
    """Refuse strategy / compression / driver / loss-scaling combinations that cannot work."""
    if driver == "jit" and (strategy.name != "sync" or compressor.name != "none"):
        raise StepError(
            f"strategy.name={strategy.name!r} / compression.name={compressor.name!r} need "
            "--config.driver=shard_map: they place their own collectives, and under 'jit' XLA chooses them")
    if strategy.local_models and compressor.name != "none":
        raise StepError(
            f"compression.name={compressor.name!r} compresses the gradient allreduce, which strategy "
            f"{strategy.name!r} does not run every step; use strategy.name=sync, async or ssp with compression")
    if strategy.local_models and loss_scaler.enabled:
        raise StepError(
            f"dynamic loss scaling needs one verdict for all workers, but strategy {strategy.name!r} keeps "
            "local models; use compute=bfloat16 (no loss scaling) or strategy.name=sync")


def state_specs(axes: tuple[str, ...]) -> TrainState:
    """shard_map specs for a state: replicated, but ``worker`` split over the batch axes."""
    everything = PartitionSpec()
    return TrainState(step=everything, params=everything, model_state=everything, opt_state=everything,
                      rng=everything, loss_scale=everything, worker=PartitionSpec(axes), shared=everything)


def _per_worker(body):
    """Inside shard_map each worker sees its own ``worker`` slice, without the leading axis of 1."""

    def wrapped(state, batch, *rest):
        state = state.replace(worker=jax.tree.map(lambda x: x[0], state.worker))
        out = body(state, batch, *rest)
        if isinstance(out, tuple):  # train: (state, metrics)
            new_state, metrics = out
            return new_state.replace(worker=jax.tree.map(lambda x: x[None], new_state.worker)), metrics
        return out

    return wrapped


def _inner_size(algorithm: str, axes: tuple[str, ...], mesh: Mesh) -> int | None:
    return mesh.shape[axes[-1]] if algorithm == "hierarchical" and len(axes) == 2 else None


def _silent(comm: compress.CommContext) -> compress.CommContext:
    """The same workers with the collectives taken out: each keeps its own gradient."""
    return comm._replace(axes=(), allreduce=lambda tree: tree)


def make_eval_step(model: nn.Module, mesh: Mesh, *, driver: str = "shard_map", policy: Policy = Policy(),
                   state_shardings: Any = None, strategy: Strategy | None = None,
                   layout: Callable[[], Any] | None = None, task: Task | None = None) -> EvalStep:
    """Build the jitted ``(state, batch) -> sums`` evaluation step.

    It returns *sums* over the examples whose ``batch["mask"]`` is true and, within them, the
    elements the task scores (:func:`dtx.tasks.eval_sums`: ``loss_sum``, ``count``, ``examples``,
    ``<metric>_sum``, e.g. ``accuracy_sum``) — so a padded last batch contributes exactly its real
    examples, padded tokens nothing, and the host's totals are exact (:func:`dtx.tasks.summarize`).
    The parameters evaluated are the strategy's global model (``strategy.eval_params``:
    the synchronous parameters, the workers' average, the elastic center, ...).
    ``layout`` is the train step's (``jit`` driver).
    """
    strategy = strategy or strategies.sync()
    if layout is not None and driver != "jit":
        raise StepError("an activation layout (model-parallel layers) needs driver='jit'")
    layout = layout or contextlib.nullcontext
    task = task or task_lib.classification()
    axes = mesh_lib.batch_axes(mesh)
    if driver == "shard_map":
        comm = compress.CommContext(axes, mesh_lib.data_parallel_size(mesh),
                                    functools.partial(lax.pmean, axis_name=axes))
        body = functools.partial(_eval_body, model, policy, functools.partial(lax.psum, axis_name=axes),
                                 strategy, comm, layout, task=task)
        specs = state_specs(axes)
        per_device = jax.shard_map(
            _per_worker(body), mesh=mesh, in_specs=(specs, PartitionSpec(axes)), out_specs=PartitionSpec(),
            check_vma=not strategy.local_models,
        )
        return jax.jit(per_device)
    if driver == "jit":
        comm = compress.CommContext((), mesh_lib.data_parallel_size(mesh), lambda tree: tree)
        body = functools.partial(_eval_body, model, policy, lambda tree: tree, strategy, comm, layout, task=task)
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


def _train_body(state: TrainState, batch: Batch, *, model, tx, policy, scaler, accum_steps, strategy, compressor,
                comm, axes, shards, constrain, layout, split_grads, split_micro, task,
                grad_norm=False) -> tuple[TrainState, Metrics]:
    rng, step_rng = jax.random.split(jax.random.wrap_key_data(state.rng))
    shared_key = jax.random.fold_in(step_rng, 1)  # the same on every worker (random-k's common indices)
    index = lax.axis_index(axes) if axes else jnp.zeros((), jnp.int32)
    if axes:  # independent dropout per device; the carried rng stays replicated
        step_rng = jax.random.fold_in(step_rng, index)
    denominator = _denominator(task, batch, axes, accum_steps, strategy)
    loss_fn = make_loss_fn(model, policy, task, layout, list(state.model_state), denominator,
                           functools.partial(scaler.scale_loss, state.loss_scale))

    verdicts = []  # finiteness of the applied (reduced) gradients, taken while tracing the strategy's reduce
    psums = []  # the gradient path's psum calls, logged while tracing the reduce (outside any branch)

    def reduce(grads, compress_state, key):
        # The synchronisation point of data-parallel SGD: one averaged gradient for all,
        # compressed as configured and communicated in the policy's reduce dtype.
        logged = comm
        if comm.algorithm == "psum" and comm.axes:
            logged = comm._replace(allreduce=lambda tree: psums.append(tree) or comm.allreduce(tree))
        grads, compress_state, stats = compressor.update(policy.cast_to_reduce(grads), compress_state, key, logged)
        grads = scaler.unscale(state.loss_scale, policy.cast_to_params(grads))
        if scaler.enabled:  # a float16 sum of finite gradients can itself overflow (reduce=float16, cast)
            verdicts.append(all_finite(grads))
        if grad_norm:  # of the gradient every replica applies (unscaled, after compression)
            stats = {**stats, "grad_norm": optax.tree.norm(grads)}
        return grads, compress_state, stats

    ctx = strategies.StepContext(tx=tx, comm=comm, reduce=reduce, key=shared_key, index=index)
    # Differentiate per-device copies of the parameters: then each device's gradient is
    # its own batch's gradient, and *we* choose how to combine them (shard_map would
    # otherwise sum them implicitly when transposing the replicated-to-varying cast).
    params = strategy.grad_params(state, ctx)
    if axes and not strategy.local_models:
        params = lax.pcast(params, axes, to="varying")
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if accum_steps == 1:
        (_, (loss, values, model_state)), grads = grad_fn(params, state.model_state, batch, step_rng)
    else:
        grads, loss, values, model_state = _accumulate(grad_fn, params, state.model_state, batch, step_rng,
                                                         accum_steps, shards, constrain, axes, split_micro)
    grads = split_grads(grads)  # ZeRO: reduce-scattered to the optimizer state's layout
    # Each worker's own verdict on what it is about to send, before any compressor sees it:
    # a compressor may leave the overflowing entries out of the average (random-k, top-k),
    # and the step must be skipped all the same (Micikevicius et al. 2018, §3.2).
    finite_here = all_finite(policy.cast_to_reduce(grads)) if scaler.enabled else None
    loss, values, finite_everywhere, model_state, averages = _averages(axes, loss, values, finite_here,
                                                                       model_state)

    new_state, stats = strategy.apply(state, grads, ctx)
    if axes:
        # XLA's all-reduce combiner merges independent all-reduces: where the gradients travel
        # by psum, the averages ride in that op (their bytes, no rounds of their own).
        counted = _count_traffic(task, axes, strategy)  # the valid-element count's all-reduce, if any
        stats = {**stats, "comm_bytes": stats["comm_bytes"] + averages.bytes_sent + counted.bytes_sent,
                 "comm_rounds": stats["comm_rounds"] + (0 if psums else averages.messages) + counted.messages}
    metrics = {"loss": loss, **values, **stats}
    loss_scale = state.loss_scale
    if scaler.enabled:
        # Every worker's own gradients and the average all apply: identical on every replica,
        # so all skip together.
        if len(verdicts) != 1:
            raise StepError(f"loss scaling needs strategy {strategy.name!r} to reduce gradients once per step")
        finite = jnp.logical_and(finite_everywhere, verdicts[0])
        # A skipped step leaves everything the update wrote as it was (delay buffers included).
        kept = select_tree(finite, (new_state.params, new_state.opt_state, model_state, new_state.worker,
                                    new_state.shared),
                           (state.params, state.opt_state, state.model_state, state.worker, state.shared))
        new_state = new_state.replace(params=kept[0], opt_state=kept[1], worker=kept[3], shared=kept[4])
        model_state = kept[2]
        loss_scale = scaler.update(state.loss_scale, finite)
        metrics.update(loss_scale=state.loss_scale.scale, skipped=(~finite).astype(jnp.int32),
                       skipped_steps=loss_scale.skipped_steps)
    new_state = new_state.replace(step=state.step + 1, model_state=model_state, rng=jax.random.key_data(rng),
                                  loss_scale=loss_scale)
    return new_state, metrics


def _identity(tree):
    return tree


def make_loss_fn(model, policy: Policy, task: Task, layout, mutable: list, denominator, scale=_identity):
    """``(params, model_state, micro_batch, rng) -> (scaled loss, (loss, metrics, model_state))``: the
    forward pass in the policy's compute dtype inside the activation ``layout``, scored by the task."""

    def loss_fn(params, model_state, micro, micro_rng):
        variables = {"params": policy.cast_to_compute(params), **model_state}
        inputs = policy.cast_to_compute(micro["inputs"])
        with layout():
            out = model.apply(variables, inputs, train=True, mutable=mutable or False, rngs={"dropout": micro_rng})
        logits, model_state = out if mutable else (out, model_state)
        loss, values = task_lib.batch_mean_terms(task, policy.cast_to_output(logits), micro["labels"], denominator)
        return scale(loss), (loss, values, model_state)

    return loss_fn


def _accumulate(grad_fn, params, model_state, batch, rng, k, shards, constrain, axes, split_micro=None,
                init_grads=None):
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
        grads_sum, loss_sum, values_sum, model_state = carry
        micro, index = inputs
        (_, (loss, values, model_state)), grads = grad_fn(params, model_state, micro, jax.random.fold_in(rng, index))
        grads_sum = jax.tree.map(jnp.add, grads_sum, split_micro(grads))
        return (grads_sum, loss_sum + loss, jax.tree.map(jnp.add, values_sum, values), model_state), None

    zero = jnp.zeros((), jnp.float32)
    if axes:  # the running sums hold per-device values: type them so for shard_map's checker
        zero = lax.pcast(zero, axes, to="varying")
    split_micro = split_micro or _identity
    # The metrics' names, from the first micro-batch's shapes (tracing only, nothing runs).
    first = jax.tree.map(lambda x: x[0], micro_batches)
    names = jax.eval_shape(lambda: grad_fn(params, model_state, first, rng)[0][1][1])
    if init_grads is None:
        init_grads = split_micro(jax.tree.map(jnp.zeros_like, params))
    init = (init_grads, zero, {name: zero for name in names}, model_state)
    (grads, loss, values, model_state), _ = lax.scan(one, init, (micro_batches, jnp.arange(k)))
    return jax.tree.map(lambda g: g / k, grads), loss / k, {n: v / k for n, v in values.items()}, model_state


def _averages(axes, loss, values, finite, model_state):
    """The step's averages over the workers, in one all-reduce: loss and the task's metrics (the
    records), whether every worker's gradients are finite (with loss scaling) and the model state
    (batch-norm statistics). Returns them and the all-reduce's :class:`dtx.costmodel.Traffic`.

    The scalars travel as one float32 vector: one ring of 3 entries, not three.
    """
    names = list(values)
    scalars = [loss.astype(jnp.float32), *(values[n].astype(jnp.float32) for n in names)]
    if finite is not None:  # 1 where this worker overflowed: the mean is 0 only if no worker did
        scalars.append(jnp.where(finite, 0.0, 1.0).astype(jnp.float32))
    vector = jnp.stack(scalars)
    traffic = costmodel.Traffic(0, 0)
    if axes:
        vector, model_state = lax.pmean((vector, model_state), axes)
        p = math.prod(lax.axis_size(a) for a in axes)
        traffic = compress.psum_traffic(costmodel.dense_allreduce_traffic((vector, model_state), p, "ring"), p)
    everywhere = None if finite is None else vector[-1] == 0
    return vector[0], {n: vector[1 + i] for i, n in enumerate(names)}, everywhere, model_state, traffic


def _denominator(task: Task, batch: Batch, axes, accum_steps: int, strategy: Strategy):
    """What each (micro-)batch's sums are divided by so that averaging over micro-batches and workers
    gives the mean over the *global* batch's valid elements (``None``: every element counts, a plain mean).

    With padding the workers hold different numbers of valid tokens, so a mean of per-worker means is not
    the global mean; sum / (global count / (workers · micro-batches)) is. Workers with their own models
    (local SGD, ...) average over their own batch: no collective enters their local steps.
    """
    if task.valid is None:
        return None
    count = task_lib.valid_count(task, batch["labels"])
    workers = 1
    if axes and not strategy.local_models:
        count = lax.psum(count, axes)
        workers = math.prod(lax.axis_size(a) for a in axes)
    return jnp.maximum(count, 1).astype(jnp.float32) / (workers * accum_steps)


def _count_traffic(task: Task, axes, strategy: Strategy) -> costmodel.Traffic:
    """The all-reduce of the valid-element count (:func:`_denominator`): an int32 scalar, on its own
    (the gradients depend on it, so XLA cannot merge it into their all-reduce)."""
    if task.valid is None or not axes or strategy.local_models:
        return costmodel.Traffic(0, 0)
    p = math.prod(lax.axis_size(a) for a in axes)
    return compress.psum_traffic(costmodel.dense_allreduce_traffic(jnp.zeros((), jnp.int32), p, "ring"), p)


def _eval_body(model: nn.Module, policy: Policy, reduce_sum, strategy: Strategy, comm: compress.CommContext,
               layout, state: TrainState, batch: Batch, *, task: Task) -> Metrics:
    params = strategy.eval_params(state, comm)
    variables = {"params": policy.cast_to_compute(params), **state.model_state}
    with layout():
        logits = model.apply(variables, policy.cast_to_compute(batch["inputs"]), train=False)
    return reduce_sum(task_lib.eval_sums(task, policy.cast_to_output(logits), batch["labels"], batch["mask"]))


def _synchronise_norm(model: nn.Module, axes: tuple[str, ...]):
    """Give batch-norm layers the batch axes, so statistics cover the global batch — dtx's models through
    their ``norm_axis_name``, any other module's ``nn.BatchNorm`` through a flax interceptor (:mod:`dtx.batchnorm`)."""
    return batchnorm.synchronise(model, axes)
