"""The ``shard_map`` driver ("pmap-style"): ``jax.jit(jax.shard_map(body))`` with explicit collectives.

Each device runs the one per-worker body (:mod:`dtx.step.body`) on its slice of the batch; the
gradients go through an explicit all-reduce over the batch axes — ``lax.pmean`` by default, or an
algorithm of :mod:`dtx.comm.algorithms` — which strategies and compressors replace: the synchronous
data-parallel SGD of Das et al. (arXiv 1602.06709, §2) and the Hitchhiker's Guide (arXiv 1810.11787,
§3.1), average the workers' gradients, then every replica applies the same update. Every message is
the plug-ins' own, so every byte is counted while tracing (:mod:`dtx.comm.costmodel`'s accountant).
Under ZeRO 1/2 the reduce-scatter and all-gather are :mod:`dtx.parallel.zero`'s
(:mod:`dtx.step.zero_step`); a placement whose parallelism runs its own step (a pipeline's schedule) brings it
as its ``runner``.
"""

from __future__ import annotations

import contextlib
import functools

import jax
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from dtx import compress, strategies
from dtx import mesh as mesh_lib
from dtx.comm import collectives
from dtx.comm import context as comm_lib
from dtx.comm.algorithms import get_algorithm
from dtx.step import batchnorm, body, zero_step
from dtx.step.spec import StepError, StepSpec
from dtx.step.state import TrainState


class ShardMapDriver:
    """Explicit collectives inside ``jax.shard_map`` (module docstring)."""

    name = "shard_map"
    explicit = True  # it places the collectives: strategies, compressors and algorithms run under it

    def comm(self, mesh: Mesh, spec: StepSpec) -> comm_lib.CommContext:
        """The workers' context: the batch axes, the spec's allreduce algorithm and buckets (silent when
        ``spec.communicate`` is off)."""
        axes = mesh_lib.batch_axes(mesh)
        algorithm = get_algorithm(spec.allreduce)
        reduce = collectives.make_allreduce(algorithm.name, axes, mean=True, bucket_bytes=spec.bucket_bytes)
        ctx = comm_lib.CommContext(axes, mesh_lib.data_parallel_size(mesh), reduce, algorithm.name,
                                   algorithm.inner_size(mesh.shape, axes), spec.bucket_bytes)
        return ctx if spec.communicate else comm_lib.silent(ctx)

    def train_step(self, model, tx, mesh: Mesh, spec: StepSpec):
        strategy, compressor = spec.strategy or strategies.sync(), spec.compressor or compress.none()
        placement = spec.placement
        if placement is not None and placement.runner is not None:  # a parallelism that runs its own step
            return placement.runner.train_step(tx, mesh, spec)
        if placement is not None and placement.gradients is not None:  # ZeRO 1/2: its own collectives
            if not (strategy.caps.identity and compressor.caps.identity) or not get_algorithm(spec.allreduce).native \
                    or spec.bucket_bytes or not spec.communicate:
                raise StepError("ZeRO (gradient_shardings) reduce-scatters and all-gathers by itself: it runs "
                                "strategy sync, no compression, allreduce 'psum', no buckets (--config.strategy.name=sync "
                                "--config.compression.name=none --config.allreduce=psum --config.bucket_bytes=0)")
            return zero_step.make_zero_step(model, tx, mesh, spec)
        _check_replicated(placement)
        axes = mesh_lib.batch_axes(mesh)
        comm = self.comm(mesh, spec)
        # Synchronous strategies normalise over the global batch; workers with their own
        # models normalise over their own batch (no collective inside the forward pass).
        norm_model = model if strategy.caps.local_models else batchnorm.synchronise(model, axes)
        train = functools.partial(body.train_body, worker=body.Worker.of(norm_model, tx, spec),
                                  route=body.Route(axes=axes), comm=comm, record=spec.record)
        # An allreduce built from ppermutes (and the compressed ones) leaves identical values
        # on every device, but JAX types them "varying" and has no free cast back to
        # replicated; such steps run without the replication checker (the tests assert
        # identical replicas instead).
        plain = (get_algorithm(spec.allreduce).native and strategy.caps.identity and compressor.caps.identity
                 and spec.communicate)
        specs = state_specs(axes)
        per_device = jax.shard_map(_per_worker(train), mesh=mesh, in_specs=(specs, PartitionSpec(axes)),
                                   out_specs=(specs, PartitionSpec()), check_vma=plain)
        return jax.jit(per_device, donate_argnums=(0,) if spec.donate else ())

    def eval_step(self, model, mesh: Mesh, spec: StepSpec):
        if spec.placement is not None and spec.placement.runner is not None:  # over the model's own tree
            return spec.placement.runner.eval_step(self.eval_step(model, mesh, spec.replace(placement=None)))
        strategy = spec.strategy or strategies.sync()
        axes = mesh_lib.batch_axes(mesh)
        comm = comm_lib.CommContext(axes, mesh_lib.data_parallel_size(mesh), functools.partial(lax.pmean, axis_name=axes))
        evaluate = functools.partial(body.eval_body, body.Worker.of(model, None, spec), comm,
                                     functools.partial(lax.psum, axis_name=axes), contextlib.nullcontext)
        specs = state_specs(axes)
        per_device = jax.shard_map(_per_worker(evaluate), mesh=mesh, in_specs=(specs, PartitionSpec(axes)),
                                   out_specs=PartitionSpec(), check_vma=not strategy.caps.local_models)
        return jax.jit(per_device)


def state_specs(axes: tuple[str, ...]) -> TrainState:
    """shard_map specs for a state: replicated, but ``worker`` split over the batch axes (with local
    models it holds each worker's own batch-norm statistics too, :func:`dtx.step.body.model_state_of`)."""
    everything = PartitionSpec()
    return TrainState(step=everything, params=everything, model_state=everything, opt_state=everything,
                      rng=everything, loss_scale=everything, worker=PartitionSpec(axes), shared=everything)


def _check_replicated(placement) -> None:
    if placement is not None and not all(
            s.is_fully_replicated for s in jax.tree.leaves(placement.state.replace(worker={}))):
        raise StepError("the shard_map driver runs data parallelism (replicated state; ZeRO needs "
                        "gradient_shardings); for model, hybrid, fsdp or rules partitioning use --config.driver=jit "
                        "(StepSpec(driver='jit'))")


def _per_worker(fn):
    """Inside shard_map each worker sees its own ``worker`` slice, without the leading axis of 1."""

    def wrapped(state, batch, *rest):
        state = state.replace(worker=jax.tree.map(lambda x: x[0], state.worker))
        out = fn(state, batch, *rest)
        if isinstance(out, tuple):  # train: (state, metrics)
            new_state, metrics = out
            return new_state.replace(worker=jax.tree.map(lambda x: x[None], new_state.worker)), metrics
        return out

    return wrapped


def _identity(tree):
    return tree
