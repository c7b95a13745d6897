"""Strategies whose workers keep their own models: local SGD, DiLoCo, EASGD, gossip (Hitchhiker's
Guide, Chahal et al., arXiv 1810.11787, on model averaging, elastic averaging and decentralised SGD).

Each worker steps its own parameters with its own optimizer state (``TrainState.worker["strategy"]``,
one slice per worker); the strategies differ in when and how the workers' models meet. Registered
by name in :data:`dtx.strategies.STRATEGIES`, which holds the types they use.

**Only on the steps that say so.** A strategy here communicates parameters only where its paper
does: the averaging, outer or elastic step runs inside a ``lax.cond`` branch (the collectives
really run only on those steps), and gossip's step holds nothing but its neighbour exchanges.
``comm_bytes`` / ``comm_rounds`` count, on each step, exactly the collectives that step runs, in
the configured allreduce's schedule and bucketing (:func:`dtx.comm.allreduce_traffic`);
the tests read the compiled step (:mod:`dtx.comm.hlo`) to hold the program to it.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import optax
from jax import lax

from dtx.comm import costmodel
from dtx.comm import topology as topology_lib
from dtx.comm.context import Capabilities, allreduce_traffic, count_scalar, traffic_stats
from dtx.strategies.base import Strategy, StrategyError, global_params, integer_setting, number_setting
from dtx.comm.topology import TOPOLOGIES


# Workers step on their own models; the step reduces no gradient (so no loss scaling, no compression).
LOCAL = Capabilities(reduces_once=False, local_models=True, allreduce=False)

def local_init(params, opt_state):
    return {"params": params, "opt_state": opt_state}, {}


def local_params(state, ctx):
    return state.worker["strategy"]["params"]


def _workers_mean(state, comm):
    """The mean of the workers' own parameters (the configured allreduce)."""
    return comm.allreduce(state.worker["strategy"]["params"])


def local_step(state, grads, ctx):
    """One step of the inner optimizer on this worker's own parameters and optimizer state."""
    mine = state.worker["strategy"]
    updates, opt_state = ctx.tx.update(grads, mine["opt_state"], mine["params"])
    return optax.apply_updates(mine["params"], updates), opt_state


def with_local(state, params, opt_state):
    return state.replace(worker={**state.worker, "strategy": {"params": params, "opt_state": opt_state}})


def _every(step, period):
    """Whether the step that starts at ``step`` is the last of a period (counted from 1)."""
    return (step + 1) % period == 0


def _allreduce_stats(tree, comm, communicates):
    """``comm.allreduce(tree)`` (:func:`dtx.comm.allreduce_traffic`: its algorithm and buckets, a
    ``psum`` call as the one op XLA combines it into) on steps that communicate, nothing on the others."""
    stats = traffic_stats(allreduce_traffic(tree, comm))
    return {k: jnp.where(communicates, v, jnp.zeros_like(v)) for k, v in stats.items()}


def _added(*stats):
    return {k: sum(s[k] for s in stats) for k in ("comm_bytes", "comm_rounds")}


def local_sgd(period: int = 1, sync_steps: int = 0) -> Strategy:
    """Local SGD / periodic model averaging (Stich, *Local SGD converges fast and communicates
    little*, ICLR 2019; the Hitchhiker's Guide on model averaging), optionally post-local SGD (Lin et al.,
    *Don't use large mini-batches, use local SGD*, ICLR 2020): parameters averaged after
    every one of the first ``sync_steps`` steps, then ``H = period`` local steps between
    averagings.

    Each worker steps its own parameters with its own optimizer state; every ``H``-th
    step the parameters (not the optimizer states, as in Lin et al.) are averaged.
    ``state.params`` is the last average. With ``H = 1`` and an optimizer linear in the
    gradient (SGD, momentum) this is ``sync`` up to float rounding; Adam is not linear
    (it divides by ``√v_i``).
    """
    H = integer_setting("period", period, 1, "H local steps between averagings")
    K = integer_setting("sync_steps", sync_steps, 0, "post-local SGD: synchronous steps before local ones")

    def apply(state, grads, ctx):
        local, opt_state = local_step(state, grads, ctx)
        average = _every(state.step, H) | (state.step < K)

        def averaged():
            mean = ctx.comm.allreduce(local)
            return mean, mean

        # lax.cond, not a select: the allreduce really runs on averaging steps only.
        local, params = lax.cond(average, averaged, lambda: (local, state.params))
        return with_local(state, local, opt_state).replace(params=params), _allreduce_stats(local, ctx.comm, average)

    return Strategy("local_sgd", local_init, local_params, apply, _workers_mean, LOCAL)


def outer_optimizer(outer_learning_rate: float, outer_momentum: float) -> optax.GradientTransformation:
    """DiLoCo's outer optimizer, SGD with Nesterov momentum (plain SGD for momentum 0), from the
    checked ``strategy.outer_learning_rate`` and ``strategy.outer_momentum`` (also Streaming DiLoCo's)."""
    rate = number_setting("outer_learning_rate", outer_learning_rate, 0.0, math.inf, "the outer SGD rate", open_low=True)
    mu = number_setting("outer_momentum", outer_momentum, 0.0, 1.0, "the outer Nesterov momentum", open_high=True)
    return optax.sgd(rate, momentum=mu or None, nesterov=bool(mu))


def diloco(period: int = 1, outer_learning_rate: float = 0.7, outer_momentum: float = 0.9) -> Strategy:
    """DiLoCo (Douillard et al., *Distributed low-communication training of language models*,
    arXiv 2311.08105, 2023, Algorithm 1): ``H`` inner steps of ``config.optimizer`` (AdamW in
    the paper) on each worker, then one outer step of SGD with Nesterov momentum on the outer
    gradient ``Δ = θ − mean_i θ_i`` (the pseudo-gradient):
    ``m ← μm + Δ; θ ← θ − η(Δ + μm)`` (optax's Nesterov form). The workers restart from the
    new ``θ`` and keep their inner optimizer states. The outer optimizer's state lives in
    ``state.shared["outer_opt_state"]``. ``H = 1``, outer rate 1, no momentum is
    ``sync`` with the inner optimizer (for one linear in the gradient).
    """
    H = integer_setting("period", period, 1, "H inner steps between outer steps")
    outer = outer_optimizer(outer_learning_rate, outer_momentum)

    def init(params, opt_state):
        return {"params": params, "opt_state": opt_state}, {"outer_opt_state": outer.init(params)}

    def apply(state, grads, ctx):
        local, opt_state = local_step(state, grads, ctx)
        outer_state = state.shared["outer_opt_state"]
        sync_now = _every(state.step, H)

        def outer_step():
            # Average the deltas, not the parameters: smaller numbers, as the paper communicates them.
            delta = ctx.comm.allreduce(jax.tree.map(jnp.subtract, state.params, local))
            updates, new_outer = outer.update(delta, outer_state, state.params)
            params = optax.apply_updates(state.params, updates)
            return params, params, new_outer

        local, params, outer_state = lax.cond(sync_now, outer_step, lambda: (local, state.params, outer_state))
        new = with_local(state, local, opt_state).replace(params=params, shared={"outer_opt_state": outer_state})
        return new, _allreduce_stats(local, ctx.comm, sync_now)

    return Strategy("diloco", init, local_params, apply, global_params, LOCAL)


def easgd(period: int = 1, rho: float = 0.1, moving_rate: float = 0.5) -> Strategy:
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
    tau = integer_setting("period", period, 1, "steps between elastic exchanges")
    alpha = number_setting("rho", rho, 0.0, 1.0, "alpha, how far each worker moves towards the center")
    beta = number_setting("moving_rate", moving_rate, 0.0, 1.0, "beta, how far the center moves towards the workers")

    def apply(state, grads, ctx):
        local, opt_state = local_step(state, grads, ctx)
        exchange = _every(state.step, tau)

        def elastic():
            diff = jax.tree.map(jnp.subtract, state.worker["strategy"]["params"], state.params)
            mean_diff = ctx.comm.allreduce(diff)
            return (jax.tree.map(lambda x, d: x - alpha * d, local, diff),
                    jax.tree.map(lambda c, d: c + beta * d, state.params, mean_diff))

        local, center = lax.cond(exchange, elastic, lambda: (local, state.params))
        return with_local(state, local, opt_state).replace(params=center), _allreduce_stats(local, ctx.comm,
                                                                                               exchange)

    return Strategy("easgd", local_init, local_params, apply, global_params, LOCAL)


def gossip(topology: str = "ring", mixing: tuple[float, ...] = (1 / 3, 1 / 3, 1 / 3),
           consensus_every: int = 0) -> Strategy:
    """Decentralised SGD (D-PSGD, Lian et al., *Can decentralized algorithms outperform centralized
    algorithms?*, NeurIPS 2017, Algorithm 1; Koloskova et al., ICML 2020; the Hitchhiker's Guide on
    decentralised SGD): a local step, then ``x_i ← Σ_j W_ij x_j`` with the neighbours of
    :mod:`dtx.comm.topology` (``ring`` with weights ``mixing = (self, left, right)``, ``complete``,
    ``exponential``), by ``lax.ppermute``. No global barrier: the train step holds only the
    neighbour exchanges.

    The global average ``x̄ = mean_i x_i`` is not part of the algorithm; it is needed to
    evaluate (``eval_params``, in the separate eval program) and to monitor. With
    ``consensus_every = k > 0`` every ``k``-th step also computes it, in a ``lax.cond``
    branch, and ``consensus_distance = sqrt(mean_i ‖x_i − x̄‖²)`` after mixing (two
    allreduces: ``x̄``, then the distance's scalar), counted in ``comm_bytes`` /
    ``comm_rounds`` on those steps. The workers keep their own models either way: the
    consensus observes, it does not mix. ``state.params`` is ``x̄`` of the last consensus
    step (the initial parameters before one, and always with ``k = 0``);
    ``state.shared["consensus_distance"]`` (``k > 0`` only) keeps that step's distance, which
    every step reports. Checkpoints hold every worker's model, so a run resumes bit for bit.
    """
    if topology not in TOPOLOGIES:
        raise StrategyError(f"strategy.topology={topology!r} is unknown; choose one of {list(TOPOLOGIES)}")
    weights = tuple(float(w) for w in mixing)
    if topology == "ring" and (len(weights) != 3 or min(weights) < 0 or abs(sum(weights) - 1) > 1e-6):
        raise StrategyError(
            f"strategy.mixing={tuple(mixing)!r} must be 3 weights (self, left, right), each >= 0, summing to 1 "
            "(a doubly stochastic ring keeps the workers' mean), e.g. (1/3, 1/3, 1/3) or (0.5, 0.25, 0.25)")
    every = integer_setting("consensus_every", consensus_every, 0,
                     "steps between global averages of the workers' models; 0: never inside the train step")

    def init(params, opt_state):
        shared = {"consensus_distance": jnp.zeros((), jnp.float32)} if every else {}  # workers start equal
        return {"params": params, "opt_state": opt_state}, shared

    def apply(state, grads, ctx):
        local, opt_state = local_step(state, grads, ctx)
        axes, p = ctx.comm.axes, ctx.comm.size
        rounds = [topology_lib.mixing_terms(topology, weights, p, r)
                  for r in range(topology_lib.num_rounds(topology, p))]
        mixers = [functools.partial(topology_lib.mix, terms=terms, axes=axes, p=p) for terms in rounds]
        round_ = state.step % len(rounds)
        local = mixers[0](local) if len(mixers) == 1 else lax.switch(round_, mixers, local)
        # One ppermute per neighbour and dtype: the leaves travel packed (topology.mix).
        per_round = [costmodel.add_traffic(*(costmodel.neighbour_traffic(nbytes, topology_lib.neighbours(terms))
                                             for nbytes in topology_lib.packed_nbytes(local))) for terms in rounds]
        stats = {"comm_bytes": jnp.stack([count_scalar(t.bytes_sent) for t in per_round])[round_],
                 "comm_rounds": jnp.stack([count_scalar(t.messages) for t in per_round])[round_]}
        new = with_local(state, local, opt_state)
        if not every:
            return new, stats
        now = _every(state.step, every)
        scalar = jax.ShapeDtypeStruct((), jnp.float32)  # what the distance's allreduce carries, for the accountant

        def consensus():
            mean = ctx.comm.allreduce(local)
            mine = sum(jnp.sum(jnp.square((x - m).astype(jnp.float32)))
                       for x, m in zip(jax.tree.leaves(local), jax.tree.leaves(mean)))
            return mean, jnp.sqrt(ctx.comm.allreduce(mine))

        # lax.cond, not a select: the allreduces run on consensus steps only.
        params, distance = lax.cond(now, consensus, lambda: (state.params, state.shared["consensus_distance"]))
        stats = _added(stats, _allreduce_stats(local, ctx.comm, now), _allreduce_stats(scalar, ctx.comm, now))
        return (new.replace(params=params, shared={"consensus_distance": distance}),
                {**stats, "consensus_distance": distance})

    return Strategy("gossip", init, local_params, apply, _workers_mean, LOCAL)
