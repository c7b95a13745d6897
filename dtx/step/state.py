"""The train state: everything a step reads and writes, as one pytree.

``step`` and ``rng`` are explicit fields (as levanter does) so a run is a
pure function of its state and its data, and a checkpoint of the state is a
complete description of where training stands.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dtx import mesh as mesh_lib
from dtx.precision import LossScaler, LossScaleState
from dtx.step.spec import StepSpec


@flax.struct.dataclass
class TrainState:
    """Attributes:
      step: int32 scalar, number of optimizer updates applied so far.
      params: the model's trainable parameters (master weights).
      model_state: the model's other variable collections, e.g. ``{"batch_stats": ...}``
        for batch normalisation; ``{}`` for models without any, and for strategies whose workers
        keep their own (``worker["model_state"]``: local SGD, DiLoCo, EASGD, gossip).
      opt_state: the optax optimizer state; empty for strategies whose workers keep their own
        (``worker["strategy"]["opt_state"]``: local SGD, DiLoCo, EASGD, gossip).
      rng: raw uint32 PRNG key data; each step splits it, so dropout differs per step
        yet a run is reproducible from ``seed``.
      loss_scale: dynamic loss-scale state (scale 1 and inert unless float16 needs it).
      worker: per-worker state, ``{"compress": ..., "strategy": ...}``: every leaf has a
        leading axis of one entry per data-parallel worker, sharded over the batch axes
        (error-feedback residuals of :mod:`dtx.compress`, local models of
        :mod:`dtx.strategies`). Inside the shard_map step each worker sees its own entry.
      shared: strategy state common to all workers (delay buffers, outer optimizer), replicated.
    """

    step: jax.Array
    params: Any
    model_state: Any
    opt_state: Any
    rng: jax.Array
    loss_scale: LossScaleState
    worker: Any = flax.struct.field(default_factory=dict)
    shared: Any = flax.struct.field(default_factory=dict)


def init_train_state(
    model: nn.Module,
    tx: optax.GradientTransformation,
    example_inputs: jax.ShapeDtypeStruct,
    seed: int,
    mesh: Mesh,
    loss_scaler: LossScaler = LossScaler(),
    shardings: TrainState | None = None,
    per_worker: StepSpec | None = None,
) -> TrainState:
    """Create the state directly in its sharded layout.

    ``eval_shape`` gives the state's structure without computing it (see
    :func:`abstract_train_state`), the shardings are derived from that, then two
    jitted programs write every array straight into place — the model's random
    draw, then the rest of the state from it (the parameters donated through) — no
    host copy, no replicate-then-reshard, so a model too large for one device can be created.

    Args:
      model: a flax module called as ``model(inputs, train=...)``.
      tx: the optimizer.
      example_inputs: shape/dtype of one batch of inputs (its batch size is irrelevant).
      seed: the run's seed.
      mesh: the device mesh.
      loss_scaler: gives the initial loss-scale state.
      shardings: a ``NamedSharding`` per leaf (see :func:`dtx.parallel.state_shardings`);
        default: everything replicated (data parallelism) but ``worker``, split over workers.
      per_worker: the run's :class:`dtx.step.spec.StepSpec` (anything with a ``strategy`` and a
        ``compressor``), read for the state its workers keep: its ``strategy`` (a
        :class:`dtx.strategies.Strategy`; None: ``sync``, no state of its own), whose ``init`` gives
        ``worker["strategy"]`` and ``shared``, and its ``compressor`` (a :class:`dtx.compress.Compressor`;
        None: none), whose ``init`` gives ``worker["compress"]``. Default None: neither.

    Returns:
      The ``TrainState``, placed with ``shardings``.
    """
    strategy, compressor = getattr(per_worker, "strategy", None), getattr(per_worker, "compressor", None)
    draw, assemble = _init_parts(model, tx, example_inputs, loss_scaler, strategy, compressor,
                                 mesh_lib.data_parallel_size(mesh))
    if shardings is None:
        shardings = replicated_shardings(jax.eval_shape(lambda s: assemble(*draw(s)), seed), mesh)
    # Two programs (both bit for bit the one-program init: tests/test_state.py): the model's random draw, then
    # the rest of the state from it. The draw is nearly all of init's compile (threefry over every parameter:
    # a 2-block transformer's ~4.4 CPU-s, its AdamW state's 0.5) and depends on the model and the parameters'
    # layout only, so a run that changes the optimizer, strategy, compressor or loss scaling reads it back
    # from the persistent compilation cache (dtx.xla_cache) instead of compiling it again.
    params, others, rng = run_init(draw, _drawn_shardings(jax.eval_shape(draw, seed), shardings, mesh), seed)
    return jax.jit(assemble, out_shardings=shardings, donate_argnums=0).lower(params, others, rng).compile(
        INIT_COMPILER_OPTIONS)(params, others, rng)


# Init runs once, so its machine code need not be fast: LLVM's -O1 is enough. XLA:CPU's default -O2 spends
# seconds on each 4-D random kernel (threefry bits over a convolution's (h, w, in, out) shape: one 5x5x4x8
# normal draw compiles in ~8 s at -O2 and ~0.6 s at -O1 on the 2-core CPU machine; ResNet-18's whole init
# 59 s -> 17 s under load). The integer hash and the float ops are the same at either level, so are the values
# (bit for bit: tests/test_state.py).
INIT_COMPILER_OPTIONS = {"xla_backend_optimization_level": 1}


def run_init(init: Any, shardings: Any, seed: int) -> Any:
    """``init(seed)`` compiled once into ``shardings`` (every array written straight into place) at
    :data:`INIT_COMPILER_OPTIONS`."""
    return jax.jit(init, out_shardings=shardings).lower(seed).compile(INIT_COMPILER_OPTIONS)(seed)


def abstract_train_state(
    model: nn.Module, tx: optax.GradientTransformation, example_inputs: jax.ShapeDtypeStruct,
    loss_scaler: LossScaler = LossScaler(), strategy: Any = None,
    compressor: Any = None, workers: int = 1,
) -> TrainState:
    """The state's structure, shapes and dtypes, computed without allocating it.

    ``workers`` is the data-parallel size: the leading axis of ``worker``'s leaves.
    Bad compressor or strategy settings that depend on shapes (a PowerSGD rank
    larger than a matrix) raise here, before anything is compiled.
    """
    return jax.eval_shape(_init_fn(model, tx, example_inputs, loss_scaler, strategy, compressor, workers), 0)


def replicated_shardings(abstract_state: TrainState, mesh: Mesh) -> TrainState:
    """Every leaf replicated (data parallelism, Hitchhiker's §3.1) but the per-worker state."""
    replicated: NamedSharding = mesh_lib.replicated(mesh)
    return with_worker_shardings(jax.tree.map(lambda _: replicated, abstract_state), abstract_state, mesh)


def with_worker_shardings(shardings: TrainState, abstract_state: TrainState, mesh: Mesh) -> TrainState:
    """``shardings`` with every ``worker`` leaf split over the batch axes, one entry per worker."""
    split = NamedSharding(mesh, PartitionSpec(mesh_lib.batch_axes(mesh)))
    return shardings.replace(worker=jax.tree.map(lambda _: split, abstract_state.worker))


def num_params(state: TrainState) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(state.params))


def _init_fn(model, tx, example_inputs, loss_scaler, strategy=None, compressor=None, workers=1):
    """``init(seed) -> TrainState``: the two parts of :func:`_init_parts` as one function."""
    draw, assemble = _init_parts(model, tx, example_inputs, loss_scaler, strategy, compressor, workers)
    return lambda seed: assemble(*draw(seed))


def _init_parts(model, tx, example_inputs, loss_scaler, strategy=None, compressor=None, workers=1):
    """``draw(seed) -> (params, other variables, rng)``, the model's random initialisation, and
    ``assemble(params, other variables, rng) -> TrainState``, the rest of the state from it."""

    def draw(seed):
        init_rng, state_rng = jax.random.split(jax.random.key(seed))
        dummy = jnp.zeros((1,) + tuple(example_inputs.shape[1:]), example_inputs.dtype)
        variables = dict(model.init({"params": init_rng}, dummy, train=False))
        params = variables.pop("params")
        return params, variables, jax.random.key_data(state_rng)

    def assemble(params, variables, rng):
        opt_state = tx.init(params)
        # (This floor knows strategies and compressors only by their ``init``.)
        strategy_worker, shared = strategy.init(params, opt_state) if strategy else ({}, {})
        one_worker = {"compress": compressor.init(params) if compressor else {}, "strategy": strategy_worker}
        if strategy is not None and strategy.caps.local_models:
            opt_state = ()  # every worker keeps its own in ``worker``; a global copy would be dead weight
            one_worker["model_state"], variables = variables, {}  # each worker's own statistics (dtx.step.body)
        # Every worker starts from the same state; the leading axis gives each its own copy.
        worker = jax.tree.map(lambda x: jnp.broadcast_to(x, (workers, *jnp.shape(x))), one_worker)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            model_state=variables,
            opt_state=opt_state,
            rng=rng,
            loss_scale=loss_scaler.init(),
            worker=worker,
            shared=shared,
        )

    return draw, assemble


def _drawn_shardings(drawn: Any, shardings: TrainState, mesh: Mesh) -> tuple:
    """Where :func:`_init_parts`' draw writes its arrays: the parameters and the rng where the state keeps them,
    the other variables where ``model_state`` does (replicated when the workers keep their own)."""
    params, variables, _ = drawn
    same = jax.tree.structure(variables) == jax.tree.structure(shardings.model_state)
    return (shardings.params, shardings.model_state if same else jax.tree.map(lambda _: mesh_lib.replicated(mesh),
                                                                               variables), shardings.rng)
