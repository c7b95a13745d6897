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
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dtx import body as body_lib
from dtx import collectives, compress, strategies
from dtx import comm as comm_lib
from dtx import tasks as task_lib
from dtx import mesh as mesh_lib
from dtx import batchnorm
from dtx.compress import Compressor
from dtx.config import DRIVERS
from dtx.data import Batch
from dtx.precision import LossScaler, Policy
from dtx.state import TrainState
from dtx.strategies import Strategy
from dtx.tasks import Task, cross_entropy  # noqa: F401  (cross_entropy: public here too)

Metrics = dict[str, jax.Array]
TrainStep = Callable[[TrainState, Batch], tuple[TrainState, Metrics]]
EvalStep = Callable[[TrainState, Batch], Metrics]



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
        raise StepError(f"accum_steps={accum_steps} must be >= 1 (config: --config.grad_accum_steps)")
    strategy = strategy or strategies.sync()
    compressor = compressor or compress.none()
    check_combination(driver, strategy, compressor, loss_scaler)
    axes = mesh_lib.batch_axes(mesh)
    shards = mesh_lib.data_parallel_size(mesh)
    donate_argnums = (0,) if donate else ()
    if layout is not None and driver != "jit":
        raise StepError("an activation layout (model-parallel layers) needs driver='jit' (--config.driver=jit)")
    if gradient_shardings is not None and driver == "shard_map":  # ZeRO's explicit collectives
        if not (strategy.caps.identity and compressor.caps.identity) or allreduce != "psum" or bucket_bytes \
                or not communicate:
            raise StepError("ZeRO (gradient_shardings) reduce-scatters and all-gathers by itself: it runs "
                            "strategy sync, no compression, allreduce 'psum', no buckets (--config.strategy.name=sync "
                            "--config.compression.name=none --config.allreduce=psum --config.bucket_bytes=0)")
        from dtx import zero

        return zero.make_zero_step(model, tx, mesh, stage=2 if shard_accumulator else 1,
                                   state_shardings=state_shardings, gradient_shardings=gradient_shardings,
                                   policy=policy, loss_scaler=loss_scaler, accum_steps=accum_steps,
                                   task=task, grad_norm=grad_norm, donate=donate)
    if shard_accumulator and driver != "jit":
        raise StepError("shard_accumulator=True (ZeRO-2, --config.parallel.name=zero2) needs driver='jit' "
                        "(--config.driver=jit) and gradient_shardings")
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
        comm = comm_lib.CommContext(axes, shards, allreduce_fn, allreduce, _inner_size(allreduce, axes, mesh),
                                    bucket_bytes)
        if not communicate:
            comm = comm_lib.silent(comm)
        # Synchronous strategies normalise over the global batch; workers with their own
        # models normalise over their own batch (no collective inside the forward pass).
        norm_model = model if strategy.local_models else _synchronise_norm(model, axes)
        body = functools.partial(body_lib.train_body, model=norm_model, comm=comm, axes=axes, shards=1,
                                 constrain=lambda x: x, **common)
        # An allreduce built from ppermutes (and the compressed ones) leaves identical values
        # on every device, but JAX types them "varying" and has no free cast back to
        # replicated; such steps run without the replication checker (the tests assert
        # identical replicas instead).
        plain = allreduce == "psum" and strategy.caps.identity and compressor.caps.identity and communicate
        specs = state_specs(axes)
        per_device = jax.shard_map(
            _per_worker(body), mesh=mesh, in_specs=(specs, PartitionSpec(axes)), out_specs=(specs, PartitionSpec()),
            check_vma=plain,
        )
        return jax.jit(per_device, donate_argnums=donate_argnums)
    if driver == "jit":
        if allreduce != "psum" or bucket_bytes:
            raise StepError(f"allreduce={allreduce!r} / bucket_bytes={bucket_bytes} need driver='shard_map' "
                            "(--config.driver=shard_map); "
                            "under 'jit' XLA chooses the collectives")
        if not communicate:
            raise StepError("communicate=False needs driver='shard_map' (under 'jit' XLA places the collectives)")
        micro_sharding = NamedSharding(mesh, PartitionSpec(None, axes))
        comm = comm_lib.compiler(shards)
        body = functools.partial(
            body_lib.train_body, model=model, comm=comm, axes=(), shards=shards,
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
    if driver == "jit" and not (strategy.caps.identity and compressor.caps.identity):
        raise StepError(
            f"strategy.name={strategy.name!r} / compression.name={compressor.name!r} need "
            "driver='shard_map' (--config.driver=shard_map; make_train_step(..., driver='shard_map')): they place "
            "their own collectives, and under 'jit' XLA chooses them")
    if strategy.caps.local_models and not compressor.caps.identity:
        raise StepError(
            f"compression.name={compressor.name!r} compresses the gradient allreduce, which strategy "
            f"{strategy.name!r} does not run every step; use strategy.name=sync, async or ssp with compression")
    if not strategy.caps.reduces_once and loss_scaler.enabled:
        raise StepError(
            f"dynamic loss scaling needs one verdict for all workers, but strategy {strategy.name!r} does not "
            "reduce the gradients once per step; use compute=bfloat16 (no loss scaling) or strategy.name=sync")


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
        raise StepError("an activation layout (model-parallel layers) needs driver='jit' (--config.driver=jit)")
    layout = layout or contextlib.nullcontext
    task = task or task_lib.classification()
    axes = mesh_lib.batch_axes(mesh)
    if driver == "shard_map":
        comm = comm_lib.CommContext(axes, mesh_lib.data_parallel_size(mesh),
                                    functools.partial(lax.pmean, axis_name=axes))
        body = functools.partial(body_lib.eval_body, model, policy, functools.partial(lax.psum, axis_name=axes),
                                 strategy, comm, layout, task=task)
        specs = state_specs(axes)
        per_device = jax.shard_map(
            _per_worker(body), mesh=mesh, in_specs=(specs, PartitionSpec(axes)), out_specs=PartitionSpec(),
            check_vma=not strategy.local_models,
        )
        return jax.jit(per_device)
    if driver == "jit":
        comm = comm_lib.compiler(mesh_lib.data_parallel_size(mesh))
        body = functools.partial(body_lib.eval_body, model, policy, lambda tree: tree, strategy, comm, layout, task=task)
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


def _identity(tree):
    return tree


def _synchronise_norm(model: nn.Module, axes: tuple[str, ...]):
    """Give batch-norm layers the batch axes, so statistics cover the global batch — dtx's models through
    their ``norm_axis_name``, any other module's ``nn.BatchNorm`` through a flax interceptor (:mod:`dtx.batchnorm`)."""
    return batchnorm.synchronise(model, axes)
