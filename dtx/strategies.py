"""Synchronous, asynchronous and relaxed-synchronous SGD (Hitchhiker's Guide, arXiv 1810.11787, §3).

A strategy decides what each worker differentiates and how the workers' gradients
become the next state: ``sync`` averages them every step (Das et al., arXiv
1602.06709, §2); the others relax that. Per-worker state (local parameters,
optimizer states, caches) lives in ``TrainState.worker``, one slice per worker;
state shared by all (delay buffers, outer optimizers) in ``TrainState.shared``.
Both are checkpointed with the rest of the state.

Selected by ``config.strategy.name``; see :data:`STRATEGIES`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax

from dtx.compress import CommContext

PyTree = Any
Stats = dict[str, jax.Array]
# (grads, compressor state, key) -> (mean grads, compressor state, stats): the compressed,
# precision-cast allreduce of the step (identity plus accounting under the jit driver).
Reduce = Callable[[PyTree, PyTree, jax.Array], tuple[PyTree, PyTree, Stats]]


class StrategyError(ValueError):
    """An unknown strategy or a setting out of range; the message says how to fix it."""


class StepContext(NamedTuple):
    """What a strategy's ``apply`` may use besides the state and the gradients.

    Attributes:
      tx: the (inner) optimizer built from ``config.optimizer``.
      comm: the workers and their collectives.
      reduce: the gradient allreduce, with compression and precision casts.
      key: a fresh PRNG key each step, the same on every worker.
      index: this worker's index in ``[0, comm.size)`` (0 under the jit driver).
    """

    tx: optax.GradientTransformation
    comm: CommContext
    reduce: Reduce
    key: jax.Array
    index: jax.Array


class Strategy(NamedTuple):
    """A synchronisation strategy.

    Attributes:
      name: its registry name.
      init: ``(params, opt_state) -> (worker, shared)``: one worker's state (every
        worker starts from the same) and the state all workers share.
      grad_params: ``(state, ctx) -> params`` this worker differentiates at;
        ``state.worker`` is this worker's slice.
      apply: ``(state, grads, ctx) -> (state, stats)``: the new state (step, rng
        and model state are the step's business) and metrics, at least
        ``comm_bytes`` and ``comm_rounds`` for this worker this step.
      eval_params: ``(state, comm) -> params`` to evaluate (inside the eval step).
      local_models: whether workers hold their own parameters (then gradients
        are not reduced every step, and loss scaling is unavailable).
    """

    name: str
    init: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]]
    grad_params: Callable[[Any, StepContext], PyTree]
    apply: Callable[[Any, PyTree, StepContext], tuple[Any, Stats]]
    eval_params: Callable[[Any, CommContext], PyTree]
    local_models: bool = False


def sync() -> Strategy:
    """Synchronous data-parallel SGD: average every step, apply the same update everywhere."""

    def apply(state, grads, ctx):
        grads, compress_state, stats = ctx.reduce(grads, state.worker["compress"], ctx.key)
        updates, opt_state = ctx.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return state.replace(params=params, opt_state=opt_state,
                             worker={**state.worker, "compress": compress_state}), stats

    return Strategy("sync", lambda params, opt_state: ({}, {}), lambda state, ctx: state.params, apply,
                    lambda state, comm: state.params)


STRATEGIES: dict[str, Callable[..., Strategy]] = {"sync": sync}


def make_strategy(name: str, **settings) -> Strategy:
    """The strategy ``name`` built from ``config.strategy``'s other keys.

    Keys a strategy does not use are ignored (the config block is shared).
    """
    if name not in STRATEGIES:
        raise StrategyError(f"strategy.name={name!r} is unknown; choose one of {sorted(STRATEGIES)}")
    return STRATEGIES[name]()
