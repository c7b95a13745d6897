"""Synchronous, asynchronous and relaxed-synchronous SGD (Hitchhiker's Guide, arXiv 1810.11787, §3).

A strategy decides what each worker differentiates and how the workers' gradients
become the next state: ``sync`` averages them every step (Das et al., arXiv
1602.06709, §2); the others relax that. Per-worker state (local parameters,
optimizer states, caches) lives in ``TrainState.worker``, one slice per worker;
state shared by all (delay buffers, outer optimizers) in ``TrainState.shared``.
Both are checkpointed with the rest of the state. Everything is simulated
deterministically on the mesh: a run is a pure function of its seed and data.

Strategies (:data:`STRATEGIES`; keys of ``config.strategy`` in each factory's signature):
``sync``; the parameter-server family ``async`` and ``ssp`` (stale gradients), here;
and, with local models, ``local_sgd``, ``diloco``, ``easgd`` and ``gossip``, in
:mod:`dtx.strategies.local_models` (re-exported here). The table of what each does and sends is in
docs/strategies.md.

``state.params`` is each strategy's *global* model: the synchronous parameters,
the parameter server's (async, ssp), the last average (local_sgd), the outer
parameters (diloco), the center variable (easgd), the workers' mean at the last
consensus step (gossip; the model evaluated is always the current mean, ``eval_params``).
``state.opt_state`` is the optimizer state of that model where one exists (sync,
async, ssp); strategies with local models keep each worker's optimizer state in
its worker slice (``dtx.step.state`` then leaves ``state.opt_state`` empty), and DiLoCo
keeps its outer optimizer's state in ``state.shared``.

**Communication accounting** (:mod:`dtx.comm.costmodel`'s accountant, as for compression):
``comm_bytes`` / ``comm_rounds`` are what one worker sends in one step, the mean
over workers where they differ (ssp), so ``p × comm_bytes`` is the step's total.
Async and ssp model a parameter server *sharded over the workers* (Dean et al.,
*Large Scale Distributed Deep Networks*, NIPS 2012; Li et al., OSDI 2014): a push
sends ``(p−1)/p`` of the gradient to the other shards' servers (a reduce-scatter),
a pull fetches ``(p−1)/p`` of the parameters back (an all-gather). Push + pull is
byte for byte the ring allreduce the emulated mesh runs, so async reports the
gradient reduction's own statistics (compression, the reduce dtype and the
allreduce algorithm included — async saves no bytes: it saves waiting). Ssp pulls
only when a cache expires: it reports ``(1 + f)/2`` of those statistics, ``f`` the
fraction of workers pulling this step (exact halves for the ring; a model for the
other algorithms and for compressed payloads).
Averaging strategies report the configured allreduce of the parameters (its
buckets included) on the steps they average and nothing otherwise; gossip one
``ppermute`` of the parameters per neighbour, plus, on its consensus steps, the
allreduces of the mean and of the consensus distance.

Selected by ``config.strategy.name``; see :data:`STRATEGIES`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dtx.comm.context import Capabilities, CommContext
from dtx.precision import select_tree
from dtx.strategies.stragglers import Stragglers
from dtx.config import ConfigError, register_check

PyTree = Any
Stats = dict[str, jax.Array]
# (grads, compressor state, key) -> (mean grads, compressor state, stats): the compressed,
# precision-cast allreduce of the step (identity plus accounting under the jit driver).
Reduce = Callable[[PyTree, PyTree, jax.Array], tuple[PyTree, PyTree, Stats]]

_DELAY_SALT = 0x64656C61  # separates async's delay draws from other users of the step key


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
      caps: what it does (:class:`dtx.comm.Capabilities`): the step reads these, never the name.
    """

    name: str
    init: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]]
    grad_params: Callable[[Any, StepContext], PyTree]
    apply: Callable[[Any, PyTree, StepContext], tuple[Any, Stats]]
    eval_params: Callable[[Any, CommContext], PyTree]
    caps: Capabilities = Capabilities()


# ------------------------------------------------------------- gradient averaging
def _server_update(state, grads, ctx):
    """Average the workers' gradients (``ctx.reduce``: compression, precision) and apply them once."""
    grads, compress_state, stats = ctx.reduce(grads, state.worker["compress"], ctx.key)
    updates, opt_state = ctx.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return state.replace(params=params, opt_state=opt_state,
                         worker={**state.worker, "compress": compress_state}), stats


def global_params(state, comm):
    return state.params


def sync() -> Strategy:
    """Synchronous data-parallel SGD: average every step, apply the same update everywhere."""
    return Strategy("sync", lambda params, opt_state: ({}, {}), lambda state, ctx: state.params, _server_update,
                    global_params, Capabilities(identity=True))


def async_sgd(staleness: int = 0, random_delay: bool = False) -> Strategy:
    """Asynchronous parameter-server SGD with stale gradients (Downpour SGD, Dean et al., NIPS 2012).

    Step ``t`` applies, once, the mean of every worker's gradient taken at the server's
    parameters of ``d_i`` updates ago, ``θ_{t+1} = θ_t − η·mean_i ∇f_i(θ_{t−d_i})`` —
    the delayed-gradient model of asynchronous SGD (the Hitchhiker's Guide on Downpour and
    asynchronous parameter servers; Lian et al., *Asynchronous parallel stochastic gradient
    for nonconvex optimization*, NeurIPS 2015). ``d_i = min(τ, t)`` for every worker, or
    with ``random_delay`` drawn uniformly from ``[0, min(τ, t)]`` per worker and step from
    the run's seed. The
    server's last ``τ`` parameters live in ``state.shared["history"]`` (a ring buffer,
    slot ``t mod τ``; ``τ`` replicated copies of the parameters). ``τ = 0`` is ``sync``.
    Reports ``staleness``, the mean delay over the workers.
    """
    tau = integer_setting("staleness", staleness, 0, "tau, how many updates old the parameters of a gradient may be")
    if not isinstance(random_delay, (bool, np.bool_)):
        raise StrategyError(f"strategy.random_delay={random_delay!r} must be True or False")

    def delays(step, ctx):
        # Every worker draws all p delays from the shared key: the mean needs no message.
        return draw_delays(ctx.key, step, tau, ctx.comm.size, random_delay)

    def init(params, opt_state):
        return {}, ({"history": jax.tree.map(lambda x: jnp.broadcast_to(x, (tau, *x.shape)), params)} if tau else {})

    def grad_params(state, ctx):
        if not tau:
            return state.params
        delay = delays(state.step, ctx)[ctx.index]
        slot = (state.step - delay) % tau
        return jax.tree.map(lambda now, past: jnp.where(delay == 0, now, past[slot]), state.params,
                            state.shared["history"])

    def apply(state, grads, ctx):
        new, stats = _server_update(state, grads, ctx)
        if tau:  # θ_t goes where θ_{t−τ} was: no later step reads further back than τ
            history = jax.tree.map(lambda past, now: past.at[state.step % tau].set(now), state.shared["history"],
                                   state.params)
            new = new.replace(shared={"history": history})
        return new, {**stats, "staleness": jnp.mean(delays(state.step, ctx).astype(jnp.float32))}

    # The clock lets a worker run up to tau steps ahead (dtx.perf.simclock); the math uses its own delays.
    return Strategy("async", init, grad_params, apply, global_params, Capabilities(runs_ahead=tau))


def draw_delays(key: jax.Array, step: jax.Array, tau: int, p: int, random_delay: bool) -> jax.Array:
    """Async's delays of step ``step`` for the ``p`` workers: ``min(τ, t)``, or with ``random_delay``
    each uniform in ``[0, min(τ, t)]``, drawn from ``key`` (the step's shared key) and the worker index."""
    bound = jnp.minimum(step, tau)
    if not random_delay:
        return jnp.full((p,), bound)
    key = jax.random.fold_in(key, _DELAY_SALT)
    return jax.vmap(lambda i: jax.random.randint(jax.random.fold_in(key, i), (), 0, bound + 1))(jnp.arange(p))


def ssp(staleness: int = 0) -> Strategy:
    """Stale-synchronous parallel SGD (Ho et al., *More effective distributed ML via a stale
    synchronous parallel parameter server*, NIPS 2013; the Hitchhiker's Guide on bounded staleness).

    Each worker differentiates a cached copy of the server's parameters and pulls a
    fresh one only when the copy would be more than ``s`` steps old: worker ``i``
    refreshes at steps with ``(t + o_i) mod (s+1) = 0``, its phase ``o_i = ⌊i(s+1)/p⌋``
    spreading the pulls evenly over the workers. The server applies the mean gradient
    every step. ``s = 0`` is ``sync``. Reports ``staleness``, the mean cache age.
    """
    s = integer_setting("staleness", staleness, 0, "s, the staleness bound in steps")

    def ages(step, p):
        return (step + (np.arange(p) * (s + 1)) // p) % (s + 1)

    def grad_params(state, ctx):
        fresh = ages(state.step, ctx.comm.size)[ctx.index] == 0
        return select_tree(fresh, state.params, state.worker["strategy"]["cache"])

    def apply(state, grads, ctx):
        all_ages = ages(state.step, ctx.comm.size)
        cache = select_tree(all_ages[ctx.index] == 0, state.params, state.worker["strategy"]["cache"])
        new, stats = _server_update(state, grads, ctx)
        new = new.replace(worker={**new.worker, "strategy": {"cache": cache}})
        # The push (half of push + pull, see the module docstring) every step; the pull
        # only for the workers whose cache expired.
        pulling = jnp.mean((all_ages == 0).astype(jnp.float32))
        stats = {k: v * (1 + pulling) / 2 if k in ("comm_bytes", "comm_rounds") else v for k, v in stats.items()}
        return new, {**stats, "staleness": jnp.mean(all_ages.astype(jnp.float32))}

    return Strategy("ssp", lambda params, opt_state: ({"cache": params}, {}), grad_params, apply, global_params,
                    Capabilities(runs_ahead=s))


def backup(backup_workers: int = 0, stragglers: Stragglers | None = None) -> Strategy:
    """Synchronous SGD with backup workers (Chen et al., *Revisiting Distributed Synchronous SGD*,
    arXiv 1604.00981, 2016): of ``p = N + b`` workers, each step applies the mean of the first ``N``
    gradients to arrive and drops the ``b`` late ones, so no step waits for its ``b`` slowest workers.

    Who arrives first is :mod:`dtx.strategies.stragglers`' draw for the run's seed and the step, the same one the
    simulated clock (:mod:`dtx.perf.simclock`) times, so the gradients applied and the time charged agree.
    The masked mean is one allreduce (``ctx.reduce``, compression and precision included) of
    ``w_i·g_i·p/N`` with ``w_i`` 1 for the first ``N`` arrivals, 0 otherwise: its mean over the ``p``
    workers is ``Σ_chosen g_i / N``. ``N`` needs no message: every worker computes all ``p`` weights
    from the same draw. Bytes are the allreduce's (dropped workers' zeros travel too: one collective).
    Reports ``dropped``, the workers left out.
    """
    b = integer_setting("backup_workers", backup_workers, 0, "b, workers whose late gradients each step drops")
    stragglers = stragglers or Stragglers()

    def apply(state, grads, ctx):
        p = ctx.comm.size
        if b >= p:
            raise StrategyError(f"strategy.backup_workers={b} leaves no gradient of the {p} workers; use at most "
                                f"{p - 1} (N = p - b >= 1)")
        keys = stragglers.arrival_keys(state.step, p, jnp)
        rank = jnp.argsort(jnp.argsort(keys))  # this worker's place in the arrival order
        chosen = rank[ctx.index] < p - b
        # where, not a product: a dropped worker's non-finite gradient must not reach the mean
        masked = jax.tree.map(lambda g: jnp.where(chosen, g * jnp.asarray(p / (p - b), g.dtype), 0), grads)
        new, stats = _server_update(state, masked, ctx)
        return new, {**stats, "dropped": jnp.asarray(b, jnp.float32)}

    return Strategy("backup", lambda params, opt_state: ({}, {}), lambda state, ctx: state.params, apply, global_params,
                    Capabilities(drops=b))


# ---------------------------------------------------------------- settings
def integer_setting(key: str, value: Any, low: int, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise StrategyError(f"strategy.{key}={value!r} must be an integer >= {low} ({meaning})")
    return int(value)


def number_setting(key: str, value: Any, low: float, high: float, meaning: str, open_low: bool = False,
            open_high: bool = False) -> float:
    value = float(value)
    if not (low < value if open_low else low <= value) or not (value < high if open_high else value <= high):
        interval = f"{'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}"
        raise StrategyError(f"strategy.{key}={value!r} must be in {interval} ({meaning})")
    return value


@register_check
def check_config(config) -> None:
    """Backup workers are a count."""
    if config.strategy.backup_workers < 0:
        raise ConfigError(f"strategy.backup_workers={config.strategy.backup_workers} must be >= 0")
