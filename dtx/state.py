"""The train state: everything a step reads and writes, as one pytree.

``step`` and ``rng`` are explicit fields (levanter, DESIGN.md §4.12) so a run is a
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
from jax.sharding import Mesh, NamedSharding

from dtx import mesh as mesh_lib
from dtx.precision import LossScaler, LossScaleState


@flax.struct.dataclass
class TrainState:
    """Attributes:
      step: int32 scalar, number of optimizer updates applied so far.
      params: the model's trainable parameters (master weights).
      model_state: the model's other variable collections, e.g. ``{"batch_stats": ...}``
        for batch normalisation; ``{}`` for models without any.
      opt_state: the optax optimizer state.
      rng: raw uint32 PRNG key data; each step splits it, so dropout differs per step
        yet a run is reproducible from ``seed``.
      loss_scale: dynamic loss-scale state (scale 1 and inert unless float16 needs it).
    """

    step: jax.Array
    params: Any
    model_state: Any
    opt_state: Any
    rng: jax.Array
    loss_scale: LossScaleState


def init_train_state(
    model: nn.Module,
    tx: optax.GradientTransformation,
    example_inputs: jax.ShapeDtypeStruct,
    seed: int,
    mesh: Mesh,
    loss_scaler: LossScaler = LossScaler(),
    shardings: TrainState | None = None,
) -> TrainState:
    """Create the state directly in its sharded layout.

    ``eval_shape`` gives the state's structure without computing it (see
    :func:`abstract_train_state`), the shardings are derived from that, then one
    jitted ``init`` writes every array straight into place — no host copy, no
    replicate-then-reshard, so a model too large for one device can be created.

    Args:
      model: a flax module called as ``model(inputs, train=...)``.
      tx: the optimizer.
      example_inputs: shape/dtype of one batch of inputs (its batch size is irrelevant).
      seed: the run's seed.
      mesh: the device mesh.
      loss_scaler: gives the initial loss-scale state.
      shardings: a ``NamedSharding`` per leaf (see :func:`dtx.parallel.state_shardings`);
        default: everything replicated (data parallelism).

    Returns:
      The ``TrainState``, placed with ``shardings``.
    """
    init = _init_fn(model, tx, example_inputs, loss_scaler)
    if shardings is None:
        shardings = replicated_shardings(jax.eval_shape(init, seed), mesh)
    return jax.jit(init, out_shardings=shardings)(seed)


def abstract_train_state(
    model: nn.Module, tx: optax.GradientTransformation, example_inputs: jax.ShapeDtypeStruct,
    loss_scaler: LossScaler = LossScaler(),
) -> TrainState:
    """The state's structure, shapes and dtypes, computed without allocating it."""
    return jax.eval_shape(_init_fn(model, tx, example_inputs, loss_scaler), 0)


def replicated_shardings(abstract_state: TrainState, mesh: Mesh) -> TrainState:
    """Every leaf replicated (data parallelism, Hitchhiker's §3.1)."""
    replicated: NamedSharding = mesh_lib.replicated(mesh)
    return jax.tree.map(lambda _: replicated, abstract_state)


def num_params(state: TrainState) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(state.params))


def _init_fn(model, tx, example_inputs, loss_scaler):
    def init(seed):
        init_rng, state_rng = jax.random.split(jax.random.key(seed))
        dummy = jnp.zeros((1,) + tuple(example_inputs.shape[1:]), example_inputs.dtype)
        variables = dict(model.init({"params": init_rng}, dummy, train=False))
        params = variables.pop("params")
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            model_state=variables,
            opt_state=tx.init(params),
            rng=jax.random.key_data(state_rng),
            loss_scale=loss_scaler.init(),
        )

    return init
