"""Streaming DiLoCo: DiLoCo whose outer steps synchronise one fragment of the model at a time
(Douillard et al., *Streaming DiLoCo with overlapping communication: towards a distributed free
lunch*, arXiv 2501.18512, 2025).

DiLoCo (:func:`dtx.strategies.local_models.diloco`) exchanges every parameter once per ``H`` inner steps, so
its network sits idle for ``H − 1`` steps and then carries the whole model at once. Streaming
DiLoCo splits the parameters into ``P`` fragments on staggered schedules: fragment ``f`` has its
outer step at the end of the steps where ``(t + 1 − ⌊fH/P⌋) mod H = 0`` (``t`` counted from 0, as
DiLoCo's ``(t + 1) mod H = 0``). Each fragment still meets every ``H`` steps, so the bytes over
``H`` steps are DiLoCo's, but the peak per step is ``1/P`` of them.

An outer step of fragment ``f``: the fragment's pseudo-gradient ``Δ_f = θ_f − mean_i θ_{i,f}``
(global minus the workers' mean) is averaged, in float32 or — ``outer_bits = b`` — in ``b``-bit
codes through :func:`dtx.comm.compressed.compressed_allreduce` (QSGD levels ``2^(b−1) − 1``, buckets of
:data:`BUCKET`; unbiased, no error feedback; the paper sends 4-bit floats), and DiLoCo's outer
optimizer (:func:`dtx.strategies.local_models.outer_optimizer`, Nesterov SGD) steps ``θ_f``, one optimizer
state per fragment.

**Overlap** (``overlap = τ``, the paper's §2.3): the workers do not wait for the exchange. They
keep training for ``τ`` more steps and then merge the new global fragment into their own:
``θ_{i,f} ← α·θ_{i,f} + (1 − α)·θ_f`` with ``α = merge_alpha`` (the paper's mixing factor; 0
replaces). Without overlap the fragment is replaced (DiLoCo's reset), whatever ``α``. The lock-step
mesh computes the outer step when the fragment is sent and holds it back ``τ`` steps; since
``τ < H`` the fragment's global value cannot change in between, so this is the paper's algorithm.

**Fragments** are contiguous slices of the parameter vector (leaves in tree order, each cut at
``⌊fN/P⌋``): equal sizes to one entry, whatever the layers. The paper groups whole transformer
blocks (strided); a model of equal blocks gives the same sizes either way.

``P = 1`` without overlap or quantisation is DiLoCo, step for step (tests/test_streaming.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from dtx.comm import compressed as compressed_lib, costmodel
from dtx.compress import quantize
from dtx.comm.context import allreduce_traffic, count_scalar, worker_index
from dtx.strategies.local_models import LOCAL, local_params, local_step, with_local, outer_optimizer
from dtx.strategies.base import Strategy, StrategyError, global_params, integer_setting, number_setting

BUCKET = 512  # entries per float32 scale of the quantised outer gradients


def fragment_slices(sizes: list[int], fragments: int) -> list[list[tuple[int, int, int]]]:
    """For leaves of ``sizes`` entries, per fragment the ``(leaf, start, stop)`` pieces it holds:
    fragment ``f`` is entries ``[⌊fN/P⌋, ⌊(f+1)N/P⌋)`` of the concatenated parameter vector."""
    total = sum(sizes)
    bounds = [f * total // fragments for f in range(fragments + 1)]
    offsets = np.cumsum([0, *sizes])
    plan = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        plan.append([(i, max(lo, offsets[i]) - offsets[i], min(hi, offsets[i + 1]) - offsets[i])
                     for i in range(len(sizes)) if max(lo, offsets[i]) < min(hi, offsets[i + 1])])
    return plan


def schedule_tables(period: int, fragments: int, overlap: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Which fragment has its outer step, and which merges, at the end of a step with ``(t+1) mod H = k``:
    two tables indexed by ``k`` (``P``: none), and each fragment's offset ``⌊fH/P⌋``."""
    offsets = [f * period // fragments for f in range(fragments)]
    sync, merge = np.full(period, fragments, np.int32), np.full(period, fragments, np.int32)
    for f, off in enumerate(offsets):
        sync[off % period] = f
        merge[(off + overlap) % period] = f
    return sync, merge, offsets


def streaming_diloco(period: int = 1, fragments: int = 1, overlap: int = 0, outer_bits: int = 0,
                     merge_alpha: float = 0.5, outer_learning_rate: float = 0.7,
                     outer_momentum: float = 0.9) -> Strategy:
    """Streaming DiLoCo (module docstring): ``P = fragments`` fragments, each with an outer step every
    ``H = period`` inner steps at offset ``⌊fH/P⌋``; its outer gradient averaged in float32
    (``outer_bits = 0``) or ``outer_bits``-bit codes; with ``overlap = τ`` merged ``τ`` steps later
    with mixing factor ``merge_alpha``. ``state.shared["outer_opt_state"]`` holds one outer optimizer
    state per fragment (over the fragment's flat vector)."""
    H = integer_setting("period", period, 1, "H inner steps between a fragment's outer steps")
    P = integer_setting("fragments", fragments, 1, "P fragments synchronised on staggered schedules")
    if P > H:
        raise StrategyError(f"strategy.fragments={P} must be <= strategy.period={H}: each of the H steps "
                            "of a period starts at most one fragment's outer step")
    tau = integer_setting("overlap", overlap, 0, "tau inner steps between sending a fragment and merging its update")
    if tau >= H:
        raise StrategyError(f"strategy.overlap={tau} must be < strategy.period={H} (a fragment's update must "
                            "arrive before its next outer step)")
    bits = integer_setting("outer_bits", outer_bits, 0, "bits per entry of the outer gradients; 0: float32")
    if bits == 1 or bits > 8:
        raise StrategyError(f"strategy.outer_bits={bits} must be 0 (float32) or in [2, 8] (QSGD codes of "
                            "2^(b-1)-1 levels; e.g. 4)")
    alpha = number_setting("merge_alpha", merge_alpha, 0.0, 1.0, "alpha, the share of its own fragment a worker keeps "
                    "when an overlapped update arrives; 0 replaces")
    outer = outer_optimizer(outer_learning_rate, outer_momentum)
    quantizer = quantize.qsgd_quantizer(2 ** (bits - 1) - 1, BUCKET) if bits else None
    sync_table, merge_table, offsets = schedule_tables(H, P, tau)

    def plan_of(tree):
        return fragment_slices([x.size for x in jax.tree.leaves(tree)], P)

    def gather(tree, pieces):
        leaves = jax.tree.leaves(tree)
        return jnp.concatenate([leaves[i].reshape(-1)[lo:hi] for i, lo, hi in pieces])

    def scatter(tree, pieces, vector):
        leaves, treedef = jax.tree.flatten(tree)
        start = 0
        for i, lo, hi in pieces:
            piece = vector[start: start + hi - lo].astype(leaves[i].dtype)
            # An update of a static window, not ``.at[lo:hi].set``: that is a scatter with an empty index
            # array, which XLA:CPU's conditional canonicaliser crashes on (jaxlib 0.11) inside lax.cond.
            flat = lax.dynamic_update_slice(leaves[i].reshape(-1), piece, (lo,))
            leaves[i], start = flat.reshape(leaves[i].shape), start + hi - lo
        return treedef.unflatten(leaves)

    def init(params, opt_state):
        states = tuple(outer.init(jnp.zeros((sum(hi - lo for _, lo, hi in pieces),), jnp.float32))
                       for pieces in plan_of(params))
        return {"params": params, "opt_state": opt_state}, {"outer_opt_state": states}

    def mean_delta(delta, ctx, f):
        if quantizer is None:
            return ctx.comm.allreduce(delta)
        key = jax.random.fold_in(jax.random.fold_in(ctx.key, f), worker_index(ctx.comm))
        mean, _, _ = compressed_lib.compressed_allreduce([delta], None, quantizer, key, ctx.comm.axes, ctx.comm.size,
                                                   worker_index(ctx.comm))
        return mean[0]

    def traffic(n, comm):
        if not comm.explicit:
            return costmodel.Traffic(0, 0)
        if quantizer is None:
            return allreduce_traffic(jax.ShapeDtypeStruct((n,), jnp.float32), comm)
        return costmodel.compressed_allreduce_traffic(compressed_lib.chunk_bytes([(n,)], comm.size, quantizer), comm.size)

    def apply(state, grads, ctx):
        local, opt_state = local_step(state, grads, ctx)
        plan = plan_of(local)
        k = (state.step + 1) % H
        done = state.step + 1  # inner steps completed, this one included

        def outer_step(f):
            def run(local, params, states):
                theta = gather(params, plan[f])
                # The workers' mean of Δ_f, not of θ_f: the paper communicates outer gradients.
                delta = mean_delta(theta - gather(local, plan[f]), ctx, f)
                updates, new = outer.update(delta, states[f], theta)
                theta = optax.apply_updates(theta, updates)
                params = scatter(params, plan[f], theta)
                if not tau:  # no overlap: restart the fragment from the new global value (DiLoCo's reset)
                    local = scatter(local, plan[f], theta)
                return local, params, states[:f] + (new,) + states[f + 1:]
            return run

        sync = jnp.asarray(sync_table)[k]
        # lax.switch, not a select: only the fragment whose turn it is crosses the mesh.
        local, params, states = lax.switch(sync, [outer_step(f) for f in range(P)] + [lambda *a: a], local,
                                           state.params, state.shared["outer_opt_state"])
        if tau:
            def merge(f):
                def run(local):
                    mixed = alpha * gather(local, plan[f]) + (1 - alpha) * gather(params, plan[f])
                    return scatter(local, plan[f], mixed)
                return run

            arriving = jnp.asarray(merge_table)[k]
            # Nothing arrives before a fragment's first outer step (at step off_f, or H for off_f = 0) plus τ.
            arrived = done >= jnp.asarray([off or H for off in offsets] + [0])[arriving] + tau
            local = lax.switch(jnp.where(arrived, arriving, P), [merge(f) for f in range(P)] + [lambda x: x], local)
        sent = [traffic(sum(hi - lo for _, lo, hi in pieces), ctx.comm) for pieces in plan] + [costmodel.Traffic(0, 0)]
        stats = {"comm_bytes": jnp.stack([count_scalar(t.bytes_sent) for t in sent])[sync],
                 "comm_rounds": jnp.stack([count_scalar(t.messages) for t in sent])[sync]}
        new = with_local(state, local, opt_state).replace(params=params, shared={"outer_opt_state": states})
        return new, stats

    # overlaps: the simulated clock lets the workers compute through the τ steps the exchange has
    return Strategy("streaming_diloco", init, local_params, apply, global_params, LOCAL._replace(overlaps=tau))

