"""Gradient compression with error feedback (Hitchhiker's Guide, Chahal et al., arXiv 1810.11787, §5).

A compressor replaces the data-parallel step's allreduce: each worker compresses
its local gradient, the *compressed payload* crosses the mesh, and every worker
decodes the same average. Compressors have the optax shape — a pair of pure
functions with explicit state — and the state (error-feedback residuals, PowerSGD's
warm-started factors, ...) is per worker: it lives in ``TrainState.worker`` and so
in checkpoints.

Selected by ``config.compression.name``; see :data:`COMPRESSORS`. Each leaf (parameter
tensor) is compressed on its own, as the papers do; all leaves travel in one message.

=========  ===============================================  ============================  ======  ========
name       what crosses the mesh                            collective                    biased  residual
=========  ===============================================  ============================  ======  ========
none       the float32 (reduce-dtype) gradient              configured allreduce          no      —
cast       the gradient in ``dtype`` (bf16/fp16)            configured allreduce          ~no     —
topk       k largest values + uint16/int32 indices          all-gather                    yes     yes
randomk    k values at indices drawn from a shared key      configured allreduce          no*     yes
sign       1 bit per entry + a float32 scale per chunk      all-to-all, then all-gather   yes     yes
terngrad   2 bits per entry + a float32 scale per bucket    all-to-all, then all-gather   no      never
qsgd       ⌈lg(2L+1)⌉ bits + a float32 norm per bucket      all-to-all, then all-gather   no      never
powersgd   rank-r factors P and Q of each matrix            configured allreduce (×2)     yes     yes
=========  ===============================================  ============================  ======  ========

**Error feedback** (Seide et al. 2014; Stich et al., *Sparsified SGD with Memory*,
NeurIPS 2018; Karimireddy et al. 2019): with ``error_feedback=True`` (the default)
the compressors marked "yes" keep what they did not send in a per-worker float32
residual and add it to the next gradient, so that, summed over steps, applied
updates + residuals == true gradients. (*) Random-k is unbiased per step only with
``error_feedback=False`` (it then rescales by ``n/k``). TernGrad and QSGD are unbiased
and never keep a residual, as in their papers: error feedback's guarantee needs a
*contractive* compressor, ``‖C(v) − v‖ < ‖v‖``, and theirs are not in general (their
variance can exceed ``‖v‖²``, e.g. QSGD with 7 levels on buckets of 512); fed back, the
residual then grows step after step (measured: QSGD L=7 with a residual diverged on the
reference task, without it matches the uncompressed run; docs/compression.md).

**Bytes.** ``stats`` reports ``comm_bytes``, what this device *sends* in the step
(:mod:`dtx.comm.costmodel`'s accountant), and ``payload_ratio``: dense float32 bytes of the
gradient ÷ the bytes of one worker's encoded gradient (the "gradient compression
ratio" of the DGC paper). The trainer's ``comm_ratio`` compares ``comm_bytes`` with a
float32 ring allreduce; for an all-gather of sparse payloads it is about ``2/p`` of
the payload ratio, because each device forwards every other device's payload.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from dtx.comm import compressed as compressed_lib, costmodel
from dtx.compress import lowrank, quantize, sparsify
from dtx.comm.context import Capabilities, CommContext, allreduce_traffic, traffic_stats, worker_index
from dtx.config import (
    check_block, check_plain_sgd, declared_settings, refuse_foreign, register_check, replaces_optimizer,
)

PyTree = Any
Stats = dict[str, jax.Array]


class CompressionError(ValueError):
    """An unknown compressor or a setting out of range; the message says how to fix it."""


class Compressor(NamedTuple):
    """A gradient compressor, optax-shaped.

    Attributes:
      name: its registry name.
      init: ``params -> state`` for one worker (unbatched shapes).
      update: ``(grads, state, key, ctx) -> (mean_grads, state, stats)``. Runs per
        worker; ``grads`` are this worker's, ``key`` is the same on every worker
        (fold in the worker index for private randomness), the result is the
        decoded average over workers, identical on every worker. ``stats`` holds
        ``comm_bytes`` (what this worker sent this step) and ``comm_rounds``
        (message rounds), as scalars; every compressor but ``none`` adds
        ``payload_ratio`` (see the module docstring).
      caps: what it does (:class:`dtx.comm.Capabilities`): ``identity`` for ``none``,
        ``allreduce`` when the payload travels by ``ctx.allreduce``.
    """

    name: str
    init: Callable[[PyTree], PyTree]
    update: Callable[[PyTree, PyTree, jax.Array, CommContext], tuple[PyTree, PyTree, Stats]]
    caps: Capabilities = Capabilities()


def _stats(traffic: costmodel.Traffic, payload_bytes: int, grads: PyTree) -> Stats:
    dense = costmodel.tree_nbytes(grads, "float32")
    return {**traffic_stats(traffic), "payload_ratio": jnp.asarray(dense / payload_bytes, jnp.float32)}


def _zeros32(params: PyTree) -> PyTree:
    return jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.float32), params)


_GATHERED = Capabilities(allreduce=False)  # payloads that all-gather / all-to-all, not allreduce

# ----------------------------------------------------------------------------- dense
def none() -> Compressor:
    """No compression: the configured allreduce of the dense gradient."""

    def update(grads, state, key, ctx):
        del key
        return ctx.allreduce(grads), state, traffic_stats(allreduce_traffic(grads, ctx))

    return Compressor("none", lambda params: {}, update, Capabilities(identity=True))


WIRE_DTYPES = ("bfloat16", "float16", "float32")


def cast(dtype: str = "bfloat16") -> Compressor:
    """The configured allreduce in a narrower float: ``dtype`` on the wire (the Guide's fp16/bf16).

    The sums themselves run in ``dtype`` (that is what crossing the wire in it means for
    a ring). Under ``driver=jit`` the same effect is the precision policy's ``reduce=``.
    """
    if dtype not in WIRE_DTYPES:
        raise CompressionError(f"compression.dtype={dtype!r} is unknown; choose one of {list(WIRE_DTYPES)}")

    def update(grads, state, key, ctx):
        del key
        wire = jax.tree.map(lambda g: g.astype(dtype), grads)
        mean = jax.tree.map(lambda m, g: m.astype(g.dtype), ctx.allreduce(wire), grads)
        traffic = allreduce_traffic(grads, ctx, dtype)
        return mean, state, _stats(traffic, costmodel.tree_nbytes(grads, dtype), grads)

    return Compressor("cast", lambda params: {}, update)


# ----------------------------------------------------------------------------- sparsification
def _check_sparse(fraction: float, error_feedback: bool, momentum: float, clip_norm: float) -> None:
    _check_fraction(fraction)
    if not 0 <= momentum < 1:
        raise CompressionError(f"compression.momentum={momentum} must be in [0, 1) (0: no momentum correction)")
    if momentum and not error_feedback:
        raise CompressionError(f"compression.momentum={momentum} (DGC momentum correction) accumulates into the "
                               "error-feedback residual; set compression.error_feedback=True or momentum=0")
    if clip_norm < 0:
        raise CompressionError(f"compression.clip_norm={clip_norm} must be >= 0 (0: off)")


@replaces_optimizer("momentum", when="momentum")  # DGC's momentum correction, applied before sparsification
def topk(fraction: float = 0.01, error_feedback: bool = True, momentum: float = 0.0, clip_norm: float = 0.0,
         warmup_steps: int = 0) -> Compressor:
    """Top-k sparsification with Deep Gradient Compression's fixes (Lin et al., ICLR 2018).

    Each worker sends the ``k = ⌈fraction·n⌉`` entries of largest magnitude of each
    leaf, as float32 values and uint16 (leaves up to 65,536 entries) or int32 indices,
    all leaves in one all-gather; every worker scatter-adds all payloads and divides
    by ``p``. With ``error_feedback`` the rest accumulates locally (Stich et al. 2018).
    DGC's fixes, each off by default:

    * momentum correction (``momentum = m > 0``): ``u ← m·u + g; v ← v + u``; send
      top-k of ``v``. The momentum is applied *here*, before sparsification, so use
      ``optimizer.name=sgd`` (plain SGD) with it, not a momentum optimizer.
    * local gradient clipping (``clip_norm > 0``): the local gradient is clipped before
      it is accumulated, to the norm it would have if the *averaged* gradient had norm
      ``clip_norm`` and the workers' gradients were i.i.d. DGC's ``N^{-1/2}`` threshold
      applies to local gradients that *sum* to the global one (each carries a ``1/N``);
      dtx's local gradients are means that *average* to it, so the threshold is ``clip_norm·√p``.
    * momentum factor masking: ``u`` is zeroed where ``v`` was sent (with momentum).
    * sparsity warm-up (``warmup_steps > 0``): the fraction falls ÷4 per stage from
      25% to ``fraction`` over ``warmup_steps`` steps (:func:`dtx.compress.sparsify.dgc_fractions`).

    An all-gather makes each device send ``(p−1)·k·(4 + index bytes)``; it beats the
    float32 ring allreduce's ``2(p−1)/p·4n`` only while ``fraction < 8 / (p·(4 + index
    bytes))`` (16.7% at p = 8 with uint16 indices), so warm-up stages above that cost
    more than dense: the accountant counts them as they are.
    """
    _check_sparse(fraction, error_feedback, momentum, clip_norm)
    if warmup_steps < 0:
        raise CompressionError(f"compression.warmup_steps={warmup_steps} must be >= 0 (0: no sparsity warm-up)")
    schedule = sparsify.dgc_fractions(fraction, warmup_steps)

    def init(params):
        state = sparsify.sparse_state(params, error_feedback, momentum)
        if len(schedule) > 1:
            state["step"] = jnp.zeros((), jnp.int32)
        return state

    def update(grads, state, key, ctx):
        del key
        u, v = sparsify.accumulate(grads, state, ctx.size, momentum, clip_norm)
        sizes = [x.size for x in v]
        plans = [[math.ceil(f * n) for n in sizes] for f in schedule]
        layouts = [sparsify.payload_layout(sizes, ks) for ks in plans]
        if len(schedule) == 1:
            stage = 0
            means, masks = sparsify.topk_exchange(v, plans[0], ctx.axes)
        else:  # one branch per stage: a static k each, so every collective has a static size
            stage = jnp.minimum(state["step"] * (len(schedule) - 1) // warmup_steps, len(schedule) - 1)
            means, masks = lax.switch(stage, [lambda v, ks=ks: sparsify.topk_exchange(v, ks, ctx.axes)
                                                for ks in plans], v)
        new_state = sparsify.after_sending(grads, masks, u, v, error_feedback, momentum)
        if len(schedule) > 1:
            new_state["step"] = state["step"] + 1
        traffics = [costmodel.all_gather_traffic(lay.nbytes, ctx.size) for lay in layouts]
        dense = costmodel.tree_nbytes(grads, "float32")
        stats = {"comm_bytes": jnp.asarray([t.bytes_sent for t in traffics], jnp.int32)[stage],
                 "comm_rounds": jnp.asarray([t.messages for t in traffics], jnp.int32)[stage],
                 "payload_ratio": jnp.asarray([dense / lay.nbytes for lay in layouts], jnp.float32)[stage]}
        leaves, treedef = jax.tree.flatten(grads)
        mean = treedef.unflatten([m.reshape(l.shape).astype(l.dtype) for m, l in zip(means, leaves)])
        return mean, new_state, stats

    return Compressor("topk", init, update, _GATHERED)


def randomk(fraction: float = 0.01, error_feedback: bool = True) -> Compressor:
    """Random-k sparsification (Stich et al. 2018): k entries per leaf at indices all workers draw alike.

    The indices come from the step's shared key, so only the ``k`` values cross the
    mesh (one allreduce of all leaves' values, no indices). Without error feedback the
    values are rescaled by ``n/k``, which makes the step's update unbiased; with it they
    are not (the residual keeps the rest for later steps). A coordinate then waits
    ``n/k`` steps on average and arrives as one burst: use plain SGD (a momentum
    optimizer, or DGC's momentum correction, amplifies the bursts; measured in
    docs/compression.md).
    """
    _check_fraction(fraction)

    def update(grads, state, key, ctx):
        _, v = sparsify.accumulate(grads, state, ctx.size, 0.0, 0.0)
        ks = [math.ceil(fraction * x.size) for x in v]
        means, masks = sparsify.randomk_exchange(v, ks, key, not error_feedback, ctx.allreduce)
        leaves, treedef = jax.tree.flatten(grads)
        mean = treedef.unflatten([m.reshape(l.shape).astype(l.dtype) for m, l in zip(means, leaves)])
        new_state = sparsify.after_sending(grads, masks, v, v, error_feedback, 0.0)
        traffic = allreduce_traffic(jax.ShapeDtypeStruct((sum(ks),), jnp.float32), ctx)
        return mean, new_state, _stats(traffic, 4 * sum(ks), grads)

    return Compressor("randomk", lambda params: sparsify.sparse_state(params, error_feedback, 0.0), update)


# ----------------------------------------------------------------------------- quantisation
def _quantized(name: str, quantizer: quantize.Quantizer, error_feedback: bool) -> Compressor:
    """A quantiser of :mod:`dtx.compress.quantize` run as a two-phase compressed allreduce.

    With error feedback (sign), both sides keep residuals: each worker what its phase-1
    codes lost, and each worker as the "server" of its chunk what the phase-2
    re-quantisation lost (as in 1-bit Adam). Without (TernGrad, QSGD), phase 2
    re-quantises stochastically with fresh randomness, so the mean stays unbiased.
    """

    def init(params):
        return {"residual": _zeros32(params), "server": _zeros32(params)} if error_feedback else {}

    def update(grads, state, key, ctx):
        leaves, treedef = jax.tree.flatten(grads)
        v = [x.astype(jnp.float32) for x in leaves]
        if error_feedback:
            v = [r + x for r, x in zip(jax.tree.leaves(state["residual"]), v)]
        index = worker_index(ctx)
        server = jax.tree.leaves(state["server"]) if error_feedback else None
        mean, sent, server = compressed_lib.compressed_allreduce(v, server, quantizer, jax.random.fold_in(key, index),
                                                           ctx.axes, ctx.size, index)
        new_state = {}
        if error_feedback:
            new_state = {"residual": treedef.unflatten([x - s for x, s in zip(v, sent)]),
                         "server": treedef.unflatten(server)}
        row = compressed_lib.chunk_bytes([x.shape for x in leaves], ctx.size, quantizer)
        traffic = costmodel.compressed_allreduce_traffic(row, ctx.size)
        mean = treedef.unflatten([m.astype(l.dtype) for m, l in zip(mean, leaves)])
        return mean, new_state, _stats(traffic, ctx.size * row, grads)

    return Compressor(name, init, update, _GATHERED)


def sign(error_feedback: bool = True) -> Compressor:
    """1 bit per entry scaled by the chunk's mean magnitude: EF-signSGD (Karimireddy et al.,
    ICML 2019) / 1-bit SGD (Seide et al. 2014). Biased: use it with error feedback."""
    return _quantized("sign", quantize.sign_quantizer(), error_feedback)


def terngrad(bucket_size: int = 512) -> Compressor:
    """TernGrad (Wen et al., NeurIPS 2017): {−s, 0, +s} per entry, ``s = max |v|`` per bucket.

    Unbiased; no error feedback (see the module docstring). TernGrad's layer-wise scalar
    sharing and gradient clipping are not implemented; the bucket plays the scale's part.
    """
    _check_bucket(bucket_size)
    return _quantized("terngrad", quantize.ternary_quantizer(bucket_size), error_feedback=False)


def qsgd(levels: int = 16, bucket_size: int = 512) -> Compressor:
    """QSGD (Alistarh et al., NeurIPS 2017): ``levels`` stochastic levels of ``|v| / ‖v‖₂`` per bucket.

    Unbiased; no error feedback (see the module docstring). Codes are fixed-width
    (``⌈lg(2L+1)⌉`` bits), without the paper's Elias coding of the levels.
    """
    if not 1 <= levels <= 127:
        raise CompressionError(f"compression.levels={levels} must be in [1, 127] (codes of 2·levels+1 values "
                               "are packed into at most 8 bits)")
    _check_bucket(bucket_size)
    return _quantized("qsgd", quantize.qsgd_quantizer(levels, bucket_size), error_feedback=False)


# ----------------------------------------------------------------------------- low rank
def powersgd(rank: int = 4, error_feedback: bool = True) -> Compressor:
    """PowerSGD (Vogels et al., NeurIPS 2019): one step of subspace iteration per step, rank ``r``.

    Each leaf with two or more dimensions, as an ``n × m`` matrix M (plus its residual):
    ``P = M Q``; allreduce P; orthogonalise P (QR); ``Q = Mᵀ P̂``; allreduce Q; the
    update is ``P̂ Qᵀ`` and Q is kept to warm-start the next step (initialised from a
    fixed-seed normal, the same on every worker); :func:`dtx.compress.lowrank.power_step`.
    Vectors (biases, norms) are allreduced uncompressed with P; each phase is one
    allreduce of one packed buffer. A rank larger than a matrix's smaller side is an error.
    """
    if rank < 1:
        raise CompressionError(f"compression.rank={rank} must be >= 1")

    def init(params):
        q = {}
        for i, name, shape, n, m in lowrank.matrices(params):
            if rank > n:
                raise CompressionError(
                    f"compression.rank={rank} is larger than parameter {name!r} of shape {shape} "
                    f"allows (a {n}×{m} matrix has rank <= {n}); choose compression.rank <= {n}")
            q[str(i)] = lowrank.initial_q(i, m, rank)
        return {"q": q, "residual": _zeros32(params)} if error_feedback else {"q": q}

    def update(grads, state, key, ctx):
        del key
        leaves, treedef = jax.tree.flatten(grads)
        v = [x.astype(jnp.float32) for x in leaves]
        if error_feedback:
            v = [r + x for r, x in zip(jax.tree.leaves(state["residual"]), v)]
        mean, q, mine, messages = lowrank.power_step(v, state["q"], ctx.allreduce)
        new_state = {"q": q}
        if error_feedback:
            # What this worker's own message lost (Vogels et al., Alg. 2). Its mean over
            # workers is mean M − the update, so the books balance; vectors are sent
            # exactly and leave nothing.
            new_state["residual"] = treedef.unflatten([x - mine[str(i)] if str(i) in mine else jnp.zeros_like(x)
                                                       for i, x in enumerate(v)])
        traffic = costmodel.add_traffic(*(allreduce_traffic(m, ctx) for m in messages))
        mean = treedef.unflatten([m.astype(l.dtype) for m, l in zip(mean, leaves)])
        return mean, new_state, _stats(traffic, sum(costmodel.tree_nbytes(m) for m in messages), grads)

    return Compressor("powersgd", init, update)


# ----------------------------------------------------------------------------- registry
def _check_fraction(fraction: float) -> None:
    if not 0 < fraction <= 1:
        raise CompressionError(f"compression.fraction={fraction} must be in (0, 1] (the fraction of each "
                               "gradient's entries sent; 1 sends everything)")


def _check_bucket(bucket_size: int) -> None:
    if bucket_size < 0:
        raise CompressionError(f"compression.bucket_size={bucket_size} must be >= 0 (0: one scale per chunk)")


COMPRESSORS: dict[str, Callable[..., Compressor]] = {
    "none": none, "cast": cast, "topk": topk, "randomk": randomk, "sign": sign, "terngrad": terngrad,
    "qsgd": qsgd, "powersgd": powersgd,
}


def compressor_settings() -> dict[str, tuple[str, ...]]:
    """Each compressor's settings (keys of ``config.compression``): its factory's parameters."""
    return {name: declared_settings(factory) for name, factory in COMPRESSORS.items()}


def make_compressor(name: str, **settings) -> Compressor:
    """The compressor ``name`` built from ``settings``, keys of ``config.compression`` that it takes
    (:func:`compressor_settings`); a setting it does not take raises :class:`CompressionError`."""
    if name not in COMPRESSORS:
        raise CompressionError(f"compression.name={name!r} is unknown; choose one of {sorted(COMPRESSORS)}")
    refuse_foreign("compression", name, settings, compressor_settings(), CompressionError)
    return COMPRESSORS[name](**settings)


@register_check
def check_config(config) -> None:
    """``config.compression`` sets only what its compressor takes; DGC's momentum (topk) runs over plain SGD."""
    check_block(config, "compression", compressor_settings())
    check_plain_sgd(config, "compression", COMPRESSORS.get(config.compression.name))
