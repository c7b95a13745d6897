"""ZeRO stages 1 and 2 under the ``shard_map`` driver: the one body, its update at ``jit`` level.

ZeRO (Rajbhandari et al. 2020, arXiv 1910.02054) replaces data parallelism's gradient all-reduce
by a reduce-scatter, an update of each worker's ``1/N`` of the parameters with its ``1/N`` of the
optimizer state, and an all-gather of the updated slices. The collectives are
:mod:`dtx.parallel.zero`'s; everything else is :mod:`dtx.step.body`'s, in its three parts:

1. inside ``shard_map``, :func:`dtx.step.body.worker_pass` — keys, loss, gradients with ZeRO's
   reduce-scatter as ``split_micro`` (stage 2: every micro-batch) or ``split_grads`` (stage 1: once),
   the finiteness verdict and the averages;
2. at ``jit`` level, the strategy's update (``sync``) on the parameters' slices in the optimizer
   state's layout, through the body's ``reduce`` (unscaling, the verdict on the applied gradient,
   ``grad_norm``) reporting what ZeRO sends; then the all-gather of the updated slices;
3. at ``jit`` level, :func:`dtx.step.body.finish` — the loss-scaling skip, the next key, the records.

The update stays outside ``shard_map`` so that an optimizer sees whole tensors: LAMB's and LARS's
trust ratios need a tensor's norm, not a slice's (:mod:`dtx.parallel.zero`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from dtx import compress
from dtx import mesh as mesh_lib
from dtx import strategies
from dtx.comm import context as comm_lib
from dtx.parallel import zero as zero_lib
from dtx.step import batchnorm, body
from dtx.step.spec import StepSpec


def make_zero_step(model, tx: optax.GradientTransformation, mesh: Mesh, spec: StepSpec):
    """The jitted ``(state, batch) -> (state, metrics)`` ZeRO step (module docstring) of ``spec``, whose placement
    holds the whole state's shardings and the optimizer state's layout per parameter (``gradients``); its
    stage is 2 where the placement splits the accumulator. The spec's strategy is an identity one (``sync``, the
    default), its compressor none. Metrics as every ``shard_map`` step's (:func:`dtx.step.body.finish`),
    ``comm_bytes``/``comm_rounds`` counted by :func:`dtx.parallel.zero.traffic` plus the averages'.
    """
    placement = spec.placement
    stage, state_shardings = 2 if placement.shard_accumulator else 1, placement.state
    policy, loss_scaler, accum_steps, norms = spec.policy, spec.loss_scaler, spec.accum_steps, body.Norms.of_spec(spec)
    zero = zero_lib.collectives(placement.gradients, mesh, stage=stage, policy=policy, accum_steps=accum_steps)
    # ZeRO's collectives are the gradient path; nothing compresses them
    worker = body.Worker.of(model, tx, spec.replace(compressor=compress.none()))
    strategy, compressor = worker.strategy, worker.compressor
    axes = mesh_lib.batch_axes(mesh)
    p = mesh_lib.data_parallel_size(mesh)
    synced = batchnorm.synchronise(model, axes)  # statistics over the global batch, as data parallelism's
    workers = comm_lib.CommContext(axes, p, lambda tree: lax.pmean(tree, axes))  # the pass's, inside shard_map
    placed = comm_lib.compiler(p)  # the update's: at jit level XLA places what the optimizer needs (LAMB's norms)

    def context(state, comm, key, index):
        """The strategy's context; its ``reduce`` is the body's on the already reduce-scattered gradient,
        with ZeRO's reduce-scatter and all-gather as what it sends."""
        reduce = body.make_reduce(compressor, policy, loss_scaler, state.loss_scale, placed, norms)
        sent = comm_lib.traffic_stats(zero.traffic(state.params))

        def zero_reduce(grads, compress_state, key):
            grads, compress_state, stats = reduce(grads, compress_state, key)
            return grads, compress_state, {**stats, **sent}

        return strategies.StepContext(tx=tx, comm=comm, reduce=zero_reduce, key=key, index=index)

    def worker_pass(state, batch):
        rng, step_rng, shared_key, index = body.step_keys(state, axes)
        params = strategy.grad_params(state, context(state, workers, shared_key, index))
        # The gradients travel by reduce-scatter: the averages ride only in the all-reduce of the tensors
        # kept whole, where there is one after the loop.
        route = body.Route(axes=axes, split_grads=zero.split_grads, split_micro=zero.split_micro,
                           accumulator=zero.accumulator)
        return body.worker_pass(state, batch, params, (rng, step_rng), dataclasses.replace(worker, model=synced),
                                route, zero.averages_ride)

    everywhere = PartitionSpec()
    out_specs = body.Pass(grads=zero.specs, loss=everywhere, values=everywhere,
                          finite=everywhere if loss_scaler.enabled else None, model_state=everywhere, rng=everywhere,
                          traffic=everywhere)
    # The pass reads no optimizer or per-worker state: they stay outside (the optimizer state split).
    front = jax.shard_map(worker_pass, mesh=mesh, in_specs=(everywhere, PartitionSpec(axes)), out_specs=out_specs,
                          check_vma=True)

    def step(state, batch):
        worked = front(state.replace(opt_state={}, worker={}), batch)
        _, _, shared_key, _ = body.step_keys(state, ())  # the pass's shared key (it is the same on every worker)
        ctx = context(state, placed, shared_key, jnp.zeros((), jnp.int32))
        # This worker's 1/p of the parameters: a slice of what it holds, no communication.
        sliced = state.replace(params=zero.slices(state.params))
        new_state, stats = strategy.apply(sliced, worked.grads, ctx)
        new_state = new_state.replace(params=zero.gather(new_state.params))
        return body.finish(state, new_state, stats, worked, loss_scaler, strategy)

    return jax.jit(step, in_shardings=(state_shardings, mesh_lib.batch_sharding(mesh)),
                   out_shardings=(state_shardings, mesh_lib.replicated(mesh)), donate_argnums=(0,) if spec.donate else ())
