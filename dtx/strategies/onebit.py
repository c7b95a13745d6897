"""1-bit Adam and 1-bit LAMB: Adam's momentum, not the gradient, crosses the mesh in 1-bit codes.

1-bit Adam (Tang et al., *1-bit Adam: communication efficient large-scale training with Adam's
convergence speed*, ICML 2021, Algorithm 1) observes that Adam's variance ``v`` settles early in
training. It runs in two stages:

1. **Warm-up** (``warmup_steps = T_w`` steps): Adam on the gradient averaged in full precision
   (the step's configured allreduce and compressor, ``ctx.reduce``).
2. **Compression**: ``v`` is frozen at ``v_{T_w}``. Each worker folds its own gradient into the
   shared momentum, ``m_i = β₁m + (1 − β₁)g_i``, and the workers average ``m_i`` by the two-phase
   compressed allreduce of :func:`dtx.comm.compressed.compressed_allreduce` with the sign quantiser (1 bit
   per entry plus a float32 scale per chunk), with error feedback on both sides as the paper has it:
   each worker keeps what its codes lost (``residual``), and each worker, as the "server" of one
   chunk, what the re-quantised average lost (``server``). Every worker decodes the same ``m`` and
   steps with the frozen variance.

The direction is optax's Adam, bias corrections included — ``m / (1 − β₁ᵗ)`` over
``√(v / (1 − β₂^{T_w})) + ε`` — so that the warm-up is ``optax.adam`` exactly (the paper's
Algorithm 1 omits the corrections, whose factors tend to 1). The strategy *is* the Adam (or LAMB)
part: the step's optimizer (``config.optimizer``, ``optax.sgd(learning_rate)`` in Python) turns the
direction into the update, with its learning-rate schedule and, with ``optimizer.weight_decay``,
decoupled weight decay. Use ``optimizer.name=sgd``: Adam there would precondition twice (the factories declare it,
:func:`dtx.config.replaces_optimizer`, and the config refuses another optimizer).

1-bit LAMB (Li et al., *1-bit LAMB: communication efficient large-scale large-batch training with
LAMB's convergence speed*, 2021) adds LAMB's layer-wise trust ratio ``‖x‖ / ‖u‖`` (You et al., ICLR
2020; biases and normalisation parameters excluded, as :func:`dtx.optim.make_optimizer`'s lamb)
during the warm-up and freezes each layer's ratio at its last warm-up value. Simplification: the
paper freezes a running average of the warm-up's ratios and rescales it by the ratio of a fresh
variance estimate to the frozen one; dtx does neither.

Bytes (:mod:`dtx.comm.costmodel`'s accountant): the warm-up sends what ``ctx.reduce`` sends; after it,
each device sends ``2(p − 1)`` chunks of ``⌈w/8⌉`` bytes of signs plus 4 bytes of scale per leaf
(``w = ⌈n/p⌉``), against ``2(p − 1)·4w`` for the float32 ring: ~32× fewer for large leaves.

**Tiny variances.** A coordinate whose frozen ``v`` is tiny but not 0 (a rarely lit pixel's weights)
receives ``±scale`` of its chunk, not its own near-zero momentum, divided by ``√v``: one such step can
throw the model away. Measured on the compression task (digits MLP 256-256): with optax's ``ε = 1e-8``
the run diverges (a NaN loss by step 125, after a 100-step warm-up); with ``strategy.adam_eps = 1e-6`` or
``1e-4`` it trains (docs/strategies.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax import lax

from dtx.comm import compressed as compressed_lib, costmodel
from dtx.compress import quantize
from dtx.comm.context import Capabilities, count_scalar, worker_index
from dtx.optim import DEFAULT_EXCLUDE, path_mask
from dtx.strategies.base import Strategy, global_params, integer_setting, number_setting
from dtx.config import replaces_optimizer

# Workers share one model and apply one update, but reduce the gradient only during the warm-up.
ONEBIT = Capabilities(reduces_once=False, allreduce=False)
SIGN = quantize.sign_quantizer()


def trust_ratios(params, direction, mask):
    """LAMB's per-leaf ``‖x‖ / ‖u‖`` (1 where either norm is 0, as optax's, and for masked-out leaves)."""
    def one(x, u, use):
        xn, un = jnp.linalg.norm(x.reshape(-1)), jnp.linalg.norm(u.reshape(-1))
        ratio = jnp.where((xn == 0) | (un == 0), 1.0, xn / jnp.where(un == 0, 1.0, un))
        return ratio.astype(jnp.float32) if use else jnp.ones((), jnp.float32)

    return jax.tree.map(one, params, direction, mask(params))


def make_onebit(name: str, warmup_steps: int, lamb: bool, b1: float, b2: float, eps: float) -> Strategy:
    """1-bit Adam (``lamb=False``) or 1-bit LAMB (module docstring)."""
    W = integer_setting("warmup_steps", warmup_steps, 1, "full-precision Adam steps before the variance is frozen "
                 "and the momentum travels in 1-bit codes")
    adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)
    mask = path_mask(DEFAULT_EXCLUDE)

    def init(params, opt_state):
        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params)
        shared = {"adam": adam.init(params)}
        if lamb:
            shared["trust"] = jax.tree.map(lambda x: jnp.ones((), jnp.float32), params)
        return {"residual": zeros, "server": zeros}, shared

    def apply(state, grads, ctx):
        moments, mine = state.shared["adam"], state.worker["strategy"]
        count = optax.safe_increment(moments.count)

        def warmup(compress_state):
            mean, compress_state, stats = ctx.reduce(grads, compress_state, ctx.key)
            direction, new = adam.update(mean, moments)
            return direction, new, mine, compress_state, stats["comm_bytes"], stats["comm_rounds"]

        def compressed(compress_state):
            # Each worker's own momentum step (the paper's line 6), plus what its last codes lost.
            local = jax.tree.map(lambda g, m: (1 - b1) * g.astype(jnp.float32) + b1 * m, grads, moments.mu)
            leaves, treedef = jax.tree.flatten(local)
            v = [x + r for x, r in zip(leaves, jax.tree.leaves(mine["residual"]))]
            index = worker_index(ctx.comm)
            mean, sent, server = compressed_lib.compressed_allreduce(
                v, jax.tree.leaves(mine["server"]), SIGN, jax.random.fold_in(ctx.key, index), ctx.comm.axes,
                ctx.comm.size, index)
            mu = treedef.unflatten(mean)
            new = moments._replace(count=count, mu=mu)  # nu stays frozen at the warm-up's last value
            frozen = 1 - b2 ** jnp.minimum(count, W)
            # Where the frozen variance is 0 (a gradient that was 0 all through the warm-up, e.g. the weights of an
            # always-blank pixel) the direction is 0, as Adam's would be: a sign code cannot say 0, and its ±scale
            # over ε would throw the parameter away.
            direction = jax.tree.map(
                lambda m, n: jnp.where(n > 0, (m / (1 - b1 ** count)) / (jnp.sqrt(n / frozen) + eps), 0.0), mu,
                moments.nu)
            worker = {"residual": treedef.unflatten([x - s for x, s in zip(v, sent)]),
                      "server": treedef.unflatten(server)}
            t = traffic(leaves, ctx.comm)
            return direction, new, worker, compress_state, count_scalar(t.bytes_sent), count_scalar(t.messages)

        warm = state.step < W
        # lax.cond, not a select: each stage's collectives run only in its own steps.
        direction, moments, mine, compress_state, nbytes, rounds = lax.cond(
            warm, warmup, compressed, state.worker["compress"])
        shared = {"adam": moments}
        if lamb:
            ratios = lax.cond(warm, lambda: trust_ratios(state.params, direction, mask),
                              lambda: state.shared["trust"])
            direction = jax.tree.map(lambda u, r: r * u, direction, ratios)
            shared["trust"] = ratios
        updates, opt_state = ctx.tx.update(direction, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        worker = {**state.worker, "compress": compress_state, "strategy": mine}
        new = state.replace(params=params, opt_state=opt_state, worker=worker, shared=shared)
        return new, {"comm_bytes": nbytes.astype(jnp.int32), "comm_rounds": rounds.astype(jnp.int32),
                     "compressed": (~warm).astype(jnp.int32)}

    return Strategy(name, init, lambda state, ctx: state.params, apply, global_params, ONEBIT)


def traffic(leaves, comm) -> costmodel.Traffic:
    """What one device sends in the compressed stage: the sign-coded two-phase allreduce of every leaf."""
    if not comm.explicit:
        return costmodel.Traffic(0, 0)
    row = compressed_lib.chunk_bytes([x.shape for x in leaves], comm.size, SIGN)
    return costmodel.compressed_allreduce_traffic(row, comm.size)


def _eps(adam_eps: float, default: float) -> float:
    value = number_setting("adam_eps", adam_eps, 0.0, 1.0, "Adam's epsilon; 0: the optimizer's own")
    return value or default


@replaces_optimizer("Adam preconditioning")
def onebit_adam(warmup_steps: int = 100, adam_eps: float = 0.0) -> Strategy:
    """1-bit Adam (Tang et al., ICML 2021): ``warmup_steps`` of Adam, then sign-compressed momentum
    with error feedback and the variance frozen (module docstring); ``b1, b2`` are optax.adam's, and
    ``eps`` too unless ``adam_eps > 0``."""
    return make_onebit("onebit_adam", warmup_steps, lamb=False, b1=0.9, b2=0.999, eps=_eps(adam_eps, 1e-8))


@replaces_optimizer("LAMB preconditioning")
def onebit_lamb(warmup_steps: int = 100, adam_eps: float = 0.0) -> Strategy:
    """1-bit LAMB (Li et al. 2021): as 1-bit Adam with LAMB's trust ratios, frozen after the warm-up;
    ``b1, b2, eps`` as dtx's lamb (0.9, 0.999, 1e-6) unless ``adam_eps > 0``."""
    return make_onebit("onebit_lamb", warmup_steps, lamb=True, b1=0.9, b2=0.999, eps=_eps(adam_eps, 1e-6))

