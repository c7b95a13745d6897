"""Synchronous, asynchronous and relaxed-synchronous SGD (Hitchhiker's Guide, arXiv 1810.11787, §3).

A strategy decides what each worker differentiates and how the workers' gradients
become the next state: ``sync`` averages them every step (Das et al., arXiv
1602.06709, §2); the others relax that. Per-worker state (local parameters,
optimizer states, caches) lives in ``TrainState.worker``, one slice per worker;
state shared by all (delay buffers, outer optimizers) in ``TrainState.shared``.
Both are checkpointed with the rest of the state. Everything is simulated
deterministically on the mesh: a run is a pure function of its seed and data.

Strategies (:data:`STRATEGIES`; keys of ``config.strategy`` in each factory's signature):
``sync``; the parameter-server family ``async`` and ``ssp`` (stale gradients); and,
with local models, ``local_sgd``, ``diloco``, ``easgd`` and ``gossip``. The table of
what each does and sends is in docs/strategies.md.

``state.params`` is each strategy's *global* model: the synchronous parameters,
the parameter server's (async, ssp), the last average (local_sgd), the outer
parameters (diloco), the center variable (easgd), the workers' mean (gossip).
``state.opt_state`` is the optimizer state of that model where one exists (sync,
async, ssp); strategies with local models keep each worker's optimizer state in
its worker slice (``dtx.state`` then leaves ``state.opt_state`` empty), and DiLoCo
keeps its outer optimizer's state in ``state.shared``.

**Communication accounting** (:mod:`dtx.costmodel`'s accountant, as for compression):
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
Averaging strategies report the configured allreduce of the parameters on the
steps they average and nothing otherwise; gossip one ``ppermute`` of the
parameters per neighbour.

Selected by ``config.strategy.name``; see :data:`STRATEGIES`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from dtx import costmodel
from dtx import topology as topology_lib
from dtx.compress import CommContext, count_scalar, traffic_stats
from dtx.precision import select_tree
from dtx.topology import TOPOLOGIES, mixing_matrix  # noqa: F401  (mixing_matrix: public, for the tests)

PyTree = Any
Stats = dict[str, jax.Array]
# (grads, compressor state, key) -> (mean grads, compressor state, stats): the compressed,
# precision-cast allreduce of the step (identity plus accounting under the jit driver).
Reduce = Callable[[PyTree, PyTree, jax.Array], tuple[PyTree, PyTree, Stats]]

SETTINGS = ("staleness", "random_delay", "period", "sync_steps", "outer_learning_rate", "outer_momentum", "rho",
            "moving_rate", "topology", "mixing")  # the keys of config.strategy besides name
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
      local_models: whether workers hold their own parameters (then gradients
        are not reduced every step, and loss scaling is unavailable).
    """

    name: str
    init: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]]
    grad_params: Callable[[Any, StepContext], PyTree]
    apply: Callable[[Any, PyTree, StepContext], tuple[Any, Stats]]
    eval_params: Callable[[Any, CommContext], PyTree]
    local_models: bool = False


# ------------------------------------------------------------- gradient averaging
def _server_update(state, grads, ctx):
    """Average the workers' gradients (``ctx.reduce``: compression, precision) and apply them once."""
    grads, compress_state, stats = ctx.reduce(grads, state.worker["compress"], ctx.key)
    updates, opt_state = ctx.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return state.replace(params=params, opt_state=opt_state,
                         worker={**state.worker, "compress": compress_state}), stats


def _global(state, comm):
    return state.params


def sync() -> Strategy:
    """Synchronous data-parallel SGD: average every step, apply the same update everywhere."""
    return Strategy("sync", lambda params, opt_state: ({}, {}), lambda state, ctx: state.params, _server_update,
                    _global)


def async_sgd(staleness: int = 0, random_delay: bool = False, **_) -> Strategy:
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
    tau = _integer("staleness", staleness, 0, "tau, how many updates old the parameters of a gradient may be")
    if not isinstance(random_delay, (bool, np.bool_)):
        raise StrategyError(f"strategy.random_delay={random_delay!r} must be True or False")

    def delays(step, ctx):
        # Every worker draws all p delays from the shared key: the mean needs no message.
        bound = jnp.minimum(step, tau)
        if not random_delay:
            return jnp.full((ctx.comm.size,), bound)
        key = jax.random.fold_in(ctx.key, _DELAY_SALT)
        return jax.vmap(lambda i: jax.random.randint(jax.random.fold_in(key, i), (), 0, bound + 1))(
            jnp.arange(ctx.comm.size))

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

    return Strategy("async", init, grad_params, apply, _global)


def ssp(staleness: int = 0, **_) -> Strategy:
    """Stale-synchronous parallel SGD (Ho et al., *More effective distributed ML via a stale
    synchronous parallel parameter server*, NIPS 2013; the Hitchhiker's Guide on bounded staleness).

    Each worker differentiates a cached copy of the server's parameters and pulls a
    fresh one only when the copy would be more than ``s`` steps old: worker ``i``
    refreshes at steps with ``(t + o_i) mod (s+1) = 0``, its phase ``o_i = ⌊i(s+1)/p⌋``
    spreading the pulls evenly over the workers. The server applies the mean gradient
    every step. ``s = 0`` is ``sync``. Reports ``staleness``, the mean cache age.
    """
    s = _integer("staleness", staleness, 0, "s, the staleness bound in steps")

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

    return Strategy("ssp", lambda params, opt_state: ({"cache": params}, {}), grad_params, apply, _global)


# ---------------------------------------------------------------- local models
def _local_init(params, opt_state):
    return {"params": params, "opt_state": opt_state}, {}


def _local_params(state, ctx):
    return state.worker["strategy"]["params"]


def _workers_mean(state, comm):
    """The mean of the workers' own parameters (the configured allreduce)."""
    return comm.allreduce(state.worker["strategy"]["params"])


def _local_step(state, grads, ctx):
    """One step of the inner optimizer on this worker's own parameters and optimizer state."""
    mine = state.worker["strategy"]
    updates, opt_state = ctx.tx.update(grads, mine["opt_state"], mine["params"])
    return optax.apply_updates(mine["params"], updates), opt_state


def _with_local(state, params, opt_state):
    return state.replace(worker={**state.worker, "strategy": {"params": params, "opt_state": opt_state}})


def _every(step, period):
    """Whether the step that starts at ``step`` is the last of a period (counted from 1)."""
    return (step + 1) % period == 0


def _allreduce_stats(tree, comm, communicates):
    """The configured allreduce of ``tree`` on steps that communicate, nothing on the others."""
    algorithm = "ring" if comm.algorithm == "psum" else comm.algorithm
    stats = traffic_stats(costmodel.dense_allreduce_traffic(tree, comm.size, algorithm, inner=comm.inner))
    return {k: jnp.where(communicates, v, jnp.zeros_like(v)) for k, v in stats.items()}


def local_sgd(period: int = 1, sync_steps: int = 0, **_) -> Strategy:
    """Local SGD / periodic model averaging (Stich, *Local SGD converges fast and communicates
    little*, ICLR 2019; the Hitchhiker's Guide on model averaging), optionally post-local SGD (Lin et al.,
    *Don't use large mini-batches, use local SGD*, ICLR 2020): parameters averaged after
    every one of the first ``sync_steps`` steps, then ``H = period`` local steps between
    averagings.

    Each worker steps its own parameters with its own optimizer state; every ``H``-th
    step the parameters (not the optimizer states, as in Lin et al.) are averaged.
    With ``H = 1`` and an optimizer linear in the gradient (SGD, momentum) this is
    ``sync`` up to float rounding; Adam is not linear (it divides by ``√v_i``).
    """
    H = _integer("period", period, 1, "H local steps between averagings")
    K = _integer("sync_steps", sync_steps, 0, "post-local SGD: synchronous steps before local ones")

    def apply(state, grads, ctx):
        local, opt_state = _local_step(state, grads, ctx)
        average = _every(state.step, H) | (state.step < K)

        def averaged():
            mean = ctx.comm.allreduce(local)
            return mean, mean

        # lax.cond, not a select: the allreduce really runs on averaging steps only.
        local, params = lax.cond(average, averaged, lambda: (local, state.params))
        return _with_local(state, local, opt_state).replace(params=params), _allreduce_stats(local, ctx.comm, average)

    return Strategy("local_sgd", _local_init, _local_params, apply, _workers_mean, local_models=True)


def diloco(period: int = 1, outer_learning_rate: float = 0.7, outer_momentum: float = 0.9, **_) -> Strategy:
    """DiLoCo (Douillard et al., *Distributed low-communication training of language models*,
    arXiv 2311.08105, 2023): ``H`` inner steps of ``config.optimizer`` (AdamW in the paper)
    on each worker, then one outer step of SGD with Nesterov momentum on the outer
    gradient ``Δ = θ − mean_i θ_i`` (the pseudo-gradient). The workers restart from the
    new ``θ`` and keep their inner optimizer states. The outer optimizer's state lives in
    ``state.shared["outer_opt_state"]``. ``H = 1``, outer rate 1, no momentum is
    ``sync`` with the inner optimizer (for one linear in the gradient).
    """
    H = _integer("period", period, 1, "H inner steps between outer steps")
    rate = _number("outer_learning_rate", outer_learning_rate, 0.0, math.inf, "the outer SGD rate", open_low=True)
    mu = _number("outer_momentum", outer_momentum, 0.0, 1.0, "the outer Nesterov momentum", open_high=True)
    outer = optax.sgd(rate, momentum=mu or None, nesterov=bool(mu))

    def init(params, opt_state):
        return {"params": params, "opt_state": opt_state}, {"outer_opt_state": outer.init(params)}

    def apply(state, grads, ctx):
        local, opt_state = _local_step(state, grads, ctx)
        outer_state = state.shared["outer_opt_state"]
        sync_now = _every(state.step, H)

        def outer_step():
            # Average the deltas, not the parameters: smaller numbers, as the paper communicates them.
            delta = ctx.comm.allreduce(jax.tree.map(jnp.subtract, state.params, local))
            updates, new_outer = outer.update(delta, outer_state, state.params)
            params = optax.apply_updates(state.params, updates)
            return params, params, new_outer

        local, params, outer_state = lax.cond(sync_now, outer_step, lambda: (local, state.params, outer_state))
        new = _with_local(state, local, opt_state).replace(params=params, shared={"outer_opt_state": outer_state})
        return new, _allreduce_stats(local, ctx.comm, sync_now)

    return Strategy("diloco", init, _local_params, apply, _global, local_models=True)


def easgd(period: int = 1, rho: float = 0.1, moving_rate: float = 0.5, **_) -> Strategy:
    """Elastic averaging SGD, synchronous (Zhang, Choromanska & LeCun, *Deep learning with
    elastic averaging SGD*, NIPS 2015, eqs. 5–6; the Hitchhiker's Guide on EASGD).

    Workers take local steps; every ``τ = period`` steps each is pulled towards the
    center variable ``x̃`` (``state.params``, the model evaluated) and the center towards
    the workers, both from the values before this step's update:
    ``x_i ← x_i − η∇f_i(x_i) − α(x_i − x̃)`` and ``x̃ ← x̃ + β·mean_i(x_i − x̃)``,
    with ``α = rho`` (the paper's ``α = ηρ``) and ``β = moving_rate``. The paper's
    symmetric choice is ``β = pα`` (its center moves by ``α·Σ_i``); it recommends
    ``β ≈ 0.9``. ``mean_i(x_i) − x̃`` shrinks by ``|1 − α − β|`` per exchange.
    """
    tau = _integer("period", period, 1, "steps between elastic exchanges")
    alpha = _number("rho", rho, 0.0, 1.0, "alpha, how far each worker moves towards the center")
    beta = _number("moving_rate", moving_rate, 0.0, 1.0, "beta, how far the center moves towards the workers")

    def apply(state, grads, ctx):
        local, opt_state = _local_step(state, grads, ctx)
        exchange = _every(state.step, tau)

        def elastic():
            diff = jax.tree.map(jnp.subtract, state.worker["strategy"]["params"], state.params)
            mean_diff = ctx.comm.allreduce(diff)
            return (jax.tree.map(lambda x, d: x - alpha * d, local, diff),
                    jax.tree.map(lambda c, d: c + beta * d, state.params, mean_diff))

        local, center = lax.cond(exchange, elastic, lambda: (local, state.params))
        return _with_local(state, local, opt_state).replace(params=center), _allreduce_stats(local, ctx.comm,
                                                                                               exchange)

    return Strategy("easgd", _local_init, _local_params, apply, _global, local_models=True)


def gossip(topology: str = "ring", mixing: tuple[float, ...] = (1 / 3, 1 / 3, 1 / 3), **_) -> Strategy:
    """Decentralised SGD (D-PSGD, Lian et al., NeurIPS 2017; Koloskova et al., ICML 2020;
    the Hitchhiker's Guide on decentralised SGD): a local step, then ``x_i ← Σ_j W_ij x_j`` with the
    neighbours of :mod:`dtx.topology` (``ring`` with weights ``mixing = (self, left,
    right)``, ``complete``, ``exponential``), by ``lax.ppermute``; no global barrier.

    Reports ``consensus_distance``, ``sqrt(mean_i ‖x_i − x̄‖²)`` after mixing — monitoring,
    not training traffic (it costs an allreduce of the parameters on the mesh, which a
    deployment would run rarely). ``state.params`` is the workers' mean ``x̄``.
    """
    if topology not in TOPOLOGIES:
        raise StrategyError(f"strategy.topology={topology!r} is unknown; choose one of {list(TOPOLOGIES)}")
    weights = tuple(float(w) for w in mixing)
    if topology == "ring" and (len(weights) != 3 or min(weights) < 0 or abs(sum(weights) - 1) > 1e-6):
        raise StrategyError(
            f"strategy.mixing={tuple(mixing)!r} must be 3 weights (self, left, right), each >= 0, summing to 1 "
            "(a doubly stochastic ring keeps the workers' mean), e.g. (1/3, 1/3, 1/3) or (0.5, 0.25, 0.25)")

    def apply(state, grads, ctx):
        local, opt_state = _local_step(state, grads, ctx)
        axes, p = ctx.comm.axes, ctx.comm.size
        rounds = [topology_lib.mixing_terms(topology, weights, p, r)
                  for r in range(topology_lib.num_rounds(topology, p))]
        mixers = [functools.partial(topology_lib.mix, terms=terms, axes=axes, p=p) for terms in rounds]
        round_ = state.step % len(rounds)
        local = mixers[0](local) if len(mixers) == 1 else lax.switch(round_, mixers, local)
        mean = lax.pmean(local, axes) if axes else local
        spread = sum(jnp.sum(jnp.square((x - m).astype(jnp.float32))) for x, m in
                     zip(jax.tree.leaves(local), jax.tree.leaves(mean)))
        distance = jnp.sqrt(lax.pmean(spread, axes) if axes else spread)
        # One ppermute per leaf and neighbour, as the allreduces count one collective per leaf.
        per_round = [costmodel.add_traffic(*(costmodel.neighbour_traffic(costmodel.tree_nbytes(x),
                                                                         topology_lib.neighbours(terms))
                                             for x in jax.tree.leaves(local))) for terms in rounds]
        stats = {"comm_bytes": jnp.stack([count_scalar(t.bytes_sent) for t in per_round])[round_],
                 "comm_rounds": jnp.stack([count_scalar(t.messages) for t in per_round])[round_],
                 "consensus_distance": distance}
        return _with_local(state, local, opt_state).replace(params=mean), stats

    return Strategy("gossip", _local_init, _local_params, apply, _workers_mean, local_models=True)


# ---------------------------------------------------------------- registry
STRATEGIES: dict[str, Callable[..., Strategy]] = {
    "sync": lambda **_: sync(), "async": async_sgd, "ssp": ssp, "local_sgd": local_sgd, "diloco": diloco,
    "easgd": easgd, "gossip": gossip,
}


def make_strategy(name: str, **settings) -> Strategy:
    """The strategy ``name`` built from ``config.strategy``'s other keys (:data:`SETTINGS`).

    Keys a strategy does not use are ignored (the config block is shared); keys that
    are no strategy's, and settings out of range, raise :class:`StrategyError`.
    """
    if name not in STRATEGIES:
        raise StrategyError(f"strategy.name={name!r} is unknown; choose one of {sorted(STRATEGIES)}")
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise StrategyError(f"unknown strategy setting(s) {unknown}; strategy settings are {list(SETTINGS)}")
    return STRATEGIES[name](**settings)


def _integer(key: str, value: Any, low: int, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise StrategyError(f"strategy.{key}={value!r} must be an integer >= {low} ({meaning})")
    return int(value)


def _number(key: str, value: Any, low: float, high: float, meaning: str, open_low: bool = False,
            open_high: bool = False) -> float:
    value = float(value)
    if not (low < value if open_low else low <= value) or not (value < high if open_high else value <= high):
        interval = f"{'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}"
        raise StrategyError(f"strategy.{key}={value!r} must be in {interval} ({meaning})")
    return value
