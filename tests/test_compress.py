"""Gradient compressors: ratio → 1 is the uncompressed path, decoded values against numpy references of the
papers' definitions, unbiasedness, error feedback, bytes.

Every compressor runs as in training: per worker inside a ``shard_map`` over 8 devices,
each worker with its own gradients. Each program below runs many compressors over
several steps at once (``lax.scan``), so the file compiles few programs.

Tolerances (fixed):

* ``FLOAT_TOL``: a compressor at ratio 1 against ``none``. The sums are the same
  float32 sums in another order (scatter-adds, P·Qᵀ products after a QR); measured
  gaps are <= 4.2e-7 on values of magnitude <= 4.
* ``EF_TOL``: error feedback's books (applied updates + residuals == sums of the true
  gradients) over 4 steps: float32 round-off of sums of ~10 terms of magnitude <= 4.
* ``VALUE_TOL``: decoded means and residuals against the float64 references of the papers' definitions
  (test_decoded_values_equal_a_numpy_reference), 4 steps: float32 sums of 8 workers' values of magnitude
  <= 6, carried by the residuals (measured gaps <= 5.6e-7); the stochastic roundings take the same draws,
  so no level differs.
* ``LOWRANK_TOL``: PowerSGD against a float64 reference over 4 steps. Its products sum up
  to 40 terms of magnitude <= 4, each rounded in float32: <= 40·4·2^-24 ≈ 1e-5 per product,
  carried from step to step by the residual (measured: 1.5e-5 after 4 steps).
* ``CAST_TOL``: a bfloat16 cast against the float64 mean of the bfloat16-rounded
  gradients: one bfloat16 rounding of the result (relative 2^-9, twice that allowed),
  plus float32 round-off of 8 terms.
* Unbiasedness: the mean of ``DRAWS`` fixed-seed draws must lie within ``Z_BOUND``
  standard errors of the true mean, coordinate by coordinate. For a sample mean that
  is nearly normal, |z| > 5 has probability 6e-7 per coordinate (~1e-4 over the ~190
  coordinates tested); the seeds are fixed, so the outcome is deterministic. A biased
  compressor (sign) must fail the same test by far (max |z| > 20).
"""

import functools
import inspect
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from dtx import models
from dtx.comm import collectives
from dtx import compress, optim, precision, strategies
from dtx.data import datasets
from dtx.compress import sparsify
from dtx import config as config_lib
from dtx import mesh as mesh_lib
from dtx.comm import CommContext
from dtx.compress import CompressionError
from dtx.data import TrainLoader
from dtx.step.state import abstract_train_state, init_train_state
from dtx.step import StepSpec, StepError, check_combination, make_train_step

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
W = 8  # workers
FLOAT_TOL = dict(rtol=1e-5, atol=1e-6)
VALUE_TOL = dict(rtol=1e-5, atol=1e-6)
EF_TOL = dict(rtol=1e-5, atol=1e-5)
LOWRANK_TOL = dict(rtol=1e-5, atol=5e-5)
CAST_TOL = dict(rtol=2**-8, atol=1e-6)
PARAM_TOL = dict(rtol=1e-5, atol=1e-6)
DRAWS = 1000
Z_BOUND = 5.0


@pytest.fixture(scope="module")
def mesh():
    return mesh_lib.make_mesh([("data", W)])


def _context(axes=("data",)):
    allreduce = collectives.make_allreduce("psum", axes, mean=True) if axes else (lambda tree: tree)
    return CommContext(axes, W, allreduce, "psum")


def _gradients(shapes, steps, seed):
    """Per step and worker: ``{name: (steps, W, *shape)}`` standard normals (numpy: no compiles)."""
    rng = np.random.default_rng(seed)
    return {name: rng.normal(size=(steps, W, *shape)).astype(np.float32) for name, shape in shapes.items()}


def _run(mesh, cases, silent=()):
    """Run ``{name: (compressor, grads (T, W, ...))}`` for T steps on 8 workers.

    Returns ``{name: (means (W, T, ...), final states (W, ...), stats (W, T))}``: every
    worker's outputs, so tests can check that all workers hold the same bits. Names in
    ``silent`` run with ``ctx.axes == ()`` (the no-communication yardstick).
    """
    states = {name: jax.tree.map(lambda x: jnp.broadcast_to(x, (W, *x.shape)),
                                 c.init(jax.tree.map(lambda g: g[0, 0], grads)))
              for name, (c, grads) in cases.items()}
    grads = {name: jax.tree.map(lambda g: np.swapaxes(g, 0, 1), grads) for name, (_, grads) in cases.items()}

    def body(grads, states):
        out = {}
        for name, (compressor, _) in cases.items():
            ctx = _context(() if name in silent else ("data",))

            def step(state, inputs, compressor=compressor, ctx=ctx):
                g, t = inputs
                mean, state, stats = compressor.update(g, state, jax.random.key(t), ctx)
                return state, (mean, stats)

            mine = jax.tree.map(lambda x: x[0], grads[name])
            state, (means, stats) = lax.scan(step, jax.tree.map(lambda x: x[0], states[name]),
                                             (mine, jnp.arange(len(jax.tree.leaves(mine)[0]))))
            out[name] = (means, state, stats)
        return jax.tree.map(lambda x: x[None], out)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"), check_vma=False)
    return jax.tree.map(np.asarray, jax.jit(mapped)(grads, states))


def _same_on_every_worker(tree):
    for x in jax.tree.leaves(tree):
        np.testing.assert_array_equal(x, np.broadcast_to(x[:1], x.shape))


# ----------------------------------------------------------------------------- ratio -> 1
# Every matrix has a smaller side of 4, so rank 4 is full rank for all of them.
FULL_RANK_SHAPES = {"bias": (5,), "wide": (4, 7), "tall": (9, 4), "conv": (2, 2, 4)}
RATIO_ONE = {
    "cast_float32": compress.cast("float32"),
    "topk_k_equals_n": compress.topk(1.0),
    "randomk_k_equals_n": compress.randomk(1.0, error_feedback=False),
    "powersgd_full_rank": compress.powersgd(4),
}


@pytest.fixture(scope="module")
def ratio_one(mesh):
    grads = _gradients(FULL_RANK_SHAPES, steps=3, seed=0)
    return _run(mesh, {"none": (compress.none(), grads), **{n: (c, grads) for n, c in RATIO_ONE.items()}})


@pytest.mark.parametrize("name", sorted(RATIO_ONE))
def test_ratio_one_is_the_uncompressed_path(ratio_one, name):
    """Three steps, so PowerSGD's warm-started Q and any residual are exercised too."""
    means, state, _ = ratio_one[name]
    reference, _, _ = ratio_one["none"]
    _same_on_every_worker(means)
    for key in FULL_RANK_SHAPES:
        np.testing.assert_allclose(means[key], reference[key], **FLOAT_TOL, err_msg=key)
    for residual in jax.tree.leaves(state.get("residual", {})):
        np.testing.assert_allclose(residual, 0.0, atol=FLOAT_TOL["atol"])  # nothing was held back


# ----------------------------------------------------------------------------- error feedback, bytes
SHAPES = {"bias": (5,), "wide": (40, 7), "tall": (9, 4)}
BIG = {"big": (65537,)}  # for top-k: more entries than uint16 indices address, so int32 indices
MEMORY = {
    "topk": compress.topk(0.25),
    "randomk": compress.randomk(0.25),
    "sign": compress.sign(),
    "powersgd": compress.powersgd(1),
}
STEPS = 4
# The compressors without error feedback whose decoded values test_decoded_values_equal_a_numpy_reference checks
# (the ones with it are MEMORY's): rescaled random-k, TernGrad and QSGD on buckets of QUANT_BUCKET.
QUANT_BUCKET, QSGD_LEVELS = 16, 4
UNBIASED_VALUES = {
    "randomk_unbiased": compress.randomk(0.25, error_feedback=False),
    "terngrad": compress.terngrad(bucket_size=QUANT_BUCKET),
    "qsgd": compress.qsgd(levels=QSGD_LEVELS, bucket_size=QUANT_BUCKET),
}
DGC = dict(fraction=0.01, momentum=0.9, clip_norm=6.3, warmup_steps=4)  # clips local norms above 17.8


@pytest.fixture(scope="module")
def memory(mesh):
    """``{name: (grads, (means, state, stats))}`` after STEPS steps with error feedback."""
    grads = _gradients(SHAPES, STEPS, seed=1)
    cases = {name: (c, grads) for name, c in MEMORY.items()}
    cases["topk"] = (MEMORY["topk"], {**grads, **_gradients(BIG, STEPS, seed=5)})
    silent = {f"silent_{n}": (MEMORY[n], grads) for n in ("topk", "sign", "powersgd")}
    # Stages 25%, 6.25%, 1.5625%, 1%; local norms 16.5 ... 19.6, so clipping bites on about half.
    cases["dgc"] = (compress.topk(**DGC), _gradients(SHAPES, 5, seed=2))
    cases["cast"] = (compress.cast("bfloat16"), grads)
    cases.update({name: (c, grads) for name, c in UNBIASED_VALUES.items()})  # no residual: values only
    runs = _run(mesh, {**cases, **silent}, silent=set(silent))
    return {name: (case[1], runs[name]) for name, case in {**cases, **silent}.items()}


@pytest.mark.parametrize("name", sorted(MEMORY))
def test_error_feedback_keeps_the_books(memory, name):
    """Σ_t applied mean + mean_i residual_i (+ the servers' residuals) == Σ_t mean_i g_i."""
    grads, (means, state, _) = memory[name]
    _same_on_every_worker(means)
    most_held_back = 0.0
    for key in grads:
        applied = means[key][0].sum(0)
        held_back = state["residual"][key].mean(0)
        if "server" in state:  # each worker holds the server residual of its own chunk only
            held_back = held_back + state["server"][key].sum(0)
        np.testing.assert_allclose(applied + held_back, grads[key].sum(0).mean(0), **EF_TOL, err_msg=key)
        most_held_back = max(most_held_back, np.abs(held_back).max())
    assert most_held_back > 0.1  # compression did hold something back: the books are not trivially balanced


def _ring(entries, itemsize=4):
    """Hand count of a float ring allreduce: 2(p-1) messages of ceil(n/p) entries."""
    return 2 * (W - 1) * -(-entries // W) * itemsize


def test_bytes_are_the_hand_count(memory):
    stats = {name: run[2] for name, (_, run) in memory.items()}
    # top-k 25%: k = ceil(n/4) per leaf; uint16 indices up to 65,536 entries, int32 beyond;
    # one all-gather: every device forwards p-1 payloads.
    k = {"bias": 2, "wide": 70, "tall": 9, "big": 16385}
    payload = 6 * (k["bias"] + k["wide"] + k["tall"]) + 8 * k["big"]
    assert stats["topk"]["comm_bytes"][0].tolist() == [7 * payload] * STEPS
    assert stats["topk"]["comm_rounds"][0, 0] == 7
    # sign: each leaf in 8 chunks of w = ceil(n/8); a chunk is ceil(w/8) bytes of bits + a float32
    # scale; an all-to-all and an all-gather of one chunk of every leaf per peer.
    chunk = sum(-(-w // 8) + 4 for w in (1, 35, 5))
    assert stats["sign"]["comm_bytes"][0, 0] == 2 * 7 * chunk
    assert stats["sign"]["comm_rounds"][0, 0] == 14
    # PowerSGD rank 1: all P's (shorter side x 1) with the vector in one buffer, then all Q's (longer
    # side x 1) in another: two allreduces (psum: one op each, 2(p-1) rounds).
    first = _ring(7 + 4 + 5)  # P of wide (as 7x40), P of tall (as 4x9), bias
    second = _ring(40 + 9)
    assert stats["powersgd"]["comm_bytes"][0, 0] == first + second
    assert stats["powersgd"]["comm_rounds"][0, 0] == 2 * 14
    # random-k 25%: the k values of all leaves in one allreduce, no indices.
    assert stats["randomk"]["comm_bytes"][0, 0] == _ring(2 + 70 + 9)
    # The payload ratio: dense float32 bytes over one worker's encoded gradient.
    dense = 4 * (5 + 280 + 36)
    np.testing.assert_allclose(stats["topk"]["payload_ratio"][0, 0], (dense + 4 * 65537) / payload, rtol=1e-6)
    np.testing.assert_allclose(stats["sign"]["payload_ratio"][0, 0], dense / (8 * chunk), rtol=1e-6)


@pytest.mark.parametrize("name,sent", [
    ("topk", 7 * 6 * (2 + 70 + 9)),
    ("sign", 2 * 7 * (5 + 9 + 5)),
    ("powersgd", _ring(7 + 4 + 5) + _ring(40 + 9)),
])
def test_without_communication_the_bytes_are_still_counted(memory, name, sent):
    """The yardstick (ctx.axes == ()) compresses locally and reports what p workers would send."""
    means, _, stats = memory[f"silent_{name}"][1]
    assert stats["comm_bytes"][0].tolist() == [sent] * STEPS  # the hand counts above, without "big"
    # Each worker decodes its own gradient only: the workers now differ.
    assert not np.array_equal(means["wide"][0], means["wide"][1])


def _dgc_reference(grads, fraction, momentum, clip_norm, warmup_steps):
    """DGC (Lin et al. 2018, Alg. 1 + momentum correction, masking, clipping, warm-up) in numpy."""
    names = list(grads)
    steps = grads[names[0]].shape[0]
    schedule = sparsify.dgc_fractions(fraction, warmup_steps)
    assert schedule == [0.25, 0.0625, 0.015625, 0.01]
    u = {n: np.zeros(grads[n].shape[1:], np.float64) for n in names}
    v = {n: np.zeros(grads[n].shape[1:], np.float64) for n in names}
    means, sent_counts = [], []
    for t in range(steps):
        stage = min(t * (len(schedule) - 1) // warmup_steps, len(schedule) - 1)
        mean = {n: np.zeros(grads[n].shape[2:]) for n in names}
        for i in range(W):
            g = {n: grads[n][t, i].astype(np.float64) for n in names}
            norm = math.sqrt(sum((x ** 2).sum() for x in g.values()))
            scale = min(1.0, clip_norm * math.sqrt(W) / norm)  # mean-convention gradients: threshold x sqrt(p)
            for n in names:
                u[n][i] = momentum * u[n][i] + g[n] * scale
                v[n][i] = v[n][i] + u[n][i]
                k = math.ceil(schedule[stage] * v[n][i].size)
                flat = v[n][i].reshape(-1)
                top = np.argsort(-np.abs(flat), kind="stable")[:k]
                sent = np.zeros_like(flat)
                sent[top] = flat[top]
                mean[n] += sent.reshape(mean[n].shape) / W
                v[n][i].reshape(-1)[top] = 0.0  # error feedback keeps the rest
                u[n][i].reshape(-1)[top] = 0.0  # momentum factor masking
        means.append(mean)
        sent_counts.append(sum(math.ceil(schedule[stage] * grads[n][0, 0].size) for n in names))
    return means, u, v, sent_counts


def test_dgc_equals_a_numpy_reference(memory):
    """Momentum correction, local clipping, momentum factor masking and sparsity warm-up, step by step."""
    grads, (means, state, stats) = memory["dgc"]
    _same_on_every_worker(means)
    ref_means, u, v, counts = _dgc_reference(grads, **DGC)
    for t, ref in enumerate(ref_means):
        for n in SHAPES:
            np.testing.assert_allclose(means[n][0, t], ref[n], **FLOAT_TOL, err_msg=f"step {t} {n}")
    for n in SHAPES:
        np.testing.assert_allclose(state["momentum"][n], u[n], **FLOAT_TOL)
        np.testing.assert_allclose(state["residual"][n], v[n], **FLOAT_TOL)
    # Warm-up: k falls stage by stage (25%, 25%, 6.25%, 1.5625%, 1%); 6 bytes per entry, 7 peers.
    assert stats["comm_bytes"][0].tolist() == [7 * 6 * c for c in counts]
    assert counts[0] > counts[2] > counts[3] > counts[4]
    clipped = [i for i in range(W)
               if np.sqrt(sum((grads[n][0, i] ** 2).sum() for n in SHAPES)) > DGC["clip_norm"] * math.sqrt(W)]
    assert 0 < len(clipped) < W, "the test data must clip some workers and not others"


def test_cast_sends_and_applies_bfloat16(memory):
    """cast(bfloat16): the mean every worker applies is a bfloat16 (what crossed the mesh), within
    bfloat16's rounding of the mean of the bfloat16-rounded gradients; a ring of 2-byte entries."""
    grads, (means, _, stats) = memory["cast"]
    _same_on_every_worker(means)
    for key in grads:
        got = means[key][0]  # (steps, ...)
        np.testing.assert_array_equal(got, got.astype(jnp.bfloat16).astype(np.float32), err_msg=key)
        sent = grads[key].astype(jnp.bfloat16).astype(np.float64).mean(1)
        np.testing.assert_allclose(got, sent, **CAST_TOL, err_msg=key)
    assert stats["comm_bytes"][0].tolist() == [_ring(5, 2) + _ring(280, 2) + _ring(36, 2)] * STEPS
    assert stats["comm_rounds"][0, 0] == 14  # psum: one combined op


def _quantised_rows(name, v, count, u):
    """Rows ``v`` (R, w) decoded as each paper codes them, in float64; entries past a row's ``count`` are padding
    (dropped). sign: ±mean|v| over the row's real entries (EF-signSGD); TernGrad: s·sign(v)·[u < |v|/s],
    s = max|v| per bucket; QSGD: ‖v‖₂·sign(v)·l/L, l = ⌊L|v|/‖v‖₂ + u⌋ clipped to [0, L], per bucket.
    ``u``: the uniform draws (R, buckets, QUANT_BUCKET)."""
    rows, w = v.shape
    if name == "sign":
        scale = np.abs(v).sum(1, keepdims=True) / np.maximum(count, 1)[:, None]
        out = np.where(v >= 0, scale, -scale)
    else:
        buckets = -(-w // QUANT_BUCKET)
        b = np.zeros((rows, buckets * QUANT_BUCKET))
        b[:, :w] = v
        b = b.reshape(rows, buckets, QUANT_BUCKET)
        if name == "terngrad":
            s = np.abs(b).max(-1, keepdims=True)
            out = s * np.sign(b) * (u < np.abs(b) / np.where(s > 0, s, 1.0))
        else:
            norm = np.sqrt((b * b).sum(-1, keepdims=True))
            level = np.clip(np.floor(np.abs(b) / np.where(norm > 0, norm, 1.0) * QSGD_LEVELS + u), 0, QSGD_LEVELS)
            out = np.sign(b) * level * norm / QSGD_LEVELS
        out = out.reshape(rows, -1)[:, :w]
    return np.where(np.arange(w) < count[:, None], out, 0.0)


def _two_phase_reference(name, values, server, key, leaf):
    """The compressed allreduce of one leaf (1-bit Adam's two phases, Tang et al. 2021) in numpy: ``values``
    (W, n) float64, ``server`` (W, n) the server residuals or None. Worker i cuts its values into W chunks of
    ⌈n/W⌉ (zero-padded) and codes them; worker j decodes chunk j from everyone, averages, adds its server
    residual, re-codes and shares. Only the uniform draws are jax's: worker i's key ``fold_in(key, i)``,
    split into the two phases, then the leaf. Returns (mean, what each worker's codes decode to, server)."""
    n = values.shape[1]
    w = max(1, -(-n // W))
    counts = np.clip(n - w * np.arange(W), 0, w)
    padded = np.zeros((W, W * w))
    padded[:, :n] = values
    chunks = padded.reshape(W, W, w)  # [worker, chunk, entry]
    keys = [jax.random.split(jax.random.fold_in(key, i)) for i in range(W)]

    def draws(k, rows):
        if name == "sign":
            return None
        shape = (rows, -(-w // QUANT_BUCKET), QUANT_BUCKET)
        return np.asarray(jax.random.uniform(jax.random.fold_in(k, leaf), shape), np.float64)

    decoded = np.stack([_quantised_rows(name, chunks[i], counts, draws(keys[i][0], W)) for i in range(W)])
    y = decoded.mean(0)  # row j: worker j's average of chunk j
    if server is not None:
        held = np.zeros((W, W * w))
        held[:, :n] = server
        held = held.reshape(W, W, w)
        y = y + held[np.arange(W), np.arange(W)]
    shared = np.concatenate([_quantised_rows(name, y[j: j + 1], counts[j: j + 1], draws(keys[j][1], 1))
                             for j in range(W)])
    if server is not None:
        held[np.arange(W), np.arange(W)] = y - shared
        server = held.reshape(W, -1)[:, :n]
    return shared.reshape(-1)[:n], decoded.reshape(W, -1)[:, :n], server


def _compressor_reference(name, grads):
    """Per step the decoded mean of every leaf and, at the end, the residuals of ``name`` in float64, from the
    papers: top-k (each worker's k = ⌈n/4⌉ largest |v|, the rest kept), random-k (k indices drawn alike by every
    worker from the step's key, values rescaled by n/k without error feedback), and the quantisers through
    :func:`_two_phase_reference`; error feedback adds the residual first (and keeps the server's, sign)."""
    names = sorted(grads)  # the leaves' tree order
    feedback = name in MEMORY
    residual = {n: np.zeros((W, grads[n][0, 0].size)) for n in names}
    server = {n: np.zeros((W, grads[n][0, 0].size)) for n in names} if name == "sign" else None
    means = []
    for t in range(grads[names[0]].shape[0]):
        key = jax.random.key(t)
        step = {}
        for leaf, n in enumerate(names):
            v = grads[n][t].reshape(W, -1).astype(np.float64) + residual[n]
            size = v.shape[1]
            if name in ("topk", "randomk", "randomk_unbiased"):
                k = math.ceil(0.25 * size)
                if name == "topk":
                    chosen = [np.argsort(-np.abs(v[i]), kind="stable")[:k] for i in range(W)]
                else:
                    draw = np.asarray(jax.random.uniform(jax.random.fold_in(key, leaf), (size,)))
                    chosen = [np.argsort(-draw, kind="stable")[:k]] * W
                scale = size / k if name == "randomk_unbiased" else 1.0
                mean = np.zeros(size)
                for i in range(W):
                    mean[chosen[i]] += v[i, chosen[i]] * scale / W
                sent = np.zeros_like(v)
                for i in range(W):
                    sent[i, chosen[i]] = v[i, chosen[i]]
            else:
                mean, sent, new_server = _two_phase_reference(name, v, server[n] if server else None, key, leaf)
                if server:
                    server[n] = new_server
            if feedback:
                residual[n] = v - sent
            step[n] = mean.reshape(grads[n].shape[2:])
        means.append(step)
    shaped = lambda tree: {n: x.reshape(grads[n].shape[1:]) for n, x in tree.items()}  # noqa: E731
    return means, shaped(residual) if feedback else None, shaped(server) if server else None


@pytest.mark.parametrize("name", ["topk", "randomk", "randomk_unbiased", "sign", "terngrad", "qsgd"])
def test_decoded_values_equal_a_numpy_reference(memory, name):
    """Every worker's decoded mean at each of 4 steps, and the residuals error feedback keeps, against the
    papers' definitions in float64 (:func:`_compressor_reference`); the stochastic ones (random-k's indices,
    TernGrad's and QSGD's roundings) with jax's uniform draws from the keys the compressors derive, everything
    else in numpy. A decoded value scaled by 0, a dropped scale or rescale, or a residual that keeps the wrong
    entries fails here; the books and the unbiasedness tests above cannot see all of these."""
    grads, (means, state, _) = memory[name]
    _same_on_every_worker(means)
    ref_means, residual, server = _compressor_reference(name, grads)
    for t, ref in enumerate(ref_means):
        for n in grads:
            np.testing.assert_allclose(means[n][0, t], ref[n], **VALUE_TOL, err_msg=f"step {t} {n}")
    moved = max(np.abs(ref[n]).max() for ref in ref_means for n in grads)
    assert moved > 0.1  # far above the tolerance: a zeroed mean cannot pass
    if residual is None:
        assert state == {}  # unbiased quantisers and rescaled random-k keep nothing
        return
    for n in grads:
        np.testing.assert_allclose(state["residual"][n], residual[n], **VALUE_TOL, err_msg=f"residual {n}")
        if server is not None:
            np.testing.assert_allclose(state["server"][n], server[n], **VALUE_TOL, err_msg=f"server {n}")


def _matrix(x):
    """dtx.compress.lowrank's view of a leaf: rows x last axis, transposed so that the shorter side comes first."""
    x = x.reshape(-1, x.shape[-1])
    return x.T if x.shape[0] > x.shape[1] else x


def test_powersgd_equals_a_numpy_reference(memory):
    """PowerSGD (Vogels et al. 2019, Alg. 1 with error feedback), rank 1, step by step in float64:
    P = mean MQ; P̂ = QR(P); Q = mean MᵀP̂ (kept for the next step); update P̂Qᵀ; residual M − P̂(MᵀP̂)ᵀ.
    QR's column signs may differ between LAPACK calls: they cancel in P̂Qᵀ, so Q is compared up to sign."""
    grads, (means, state, _) = memory["powersgd"]
    names = sorted(SHAPES)  # the leaves' tree order
    q0 = MEMORY["powersgd"].init({n: np.zeros(SHAPES[n], np.float32) for n in names})["q"]
    q = {n: np.asarray(q0[str(i)], np.float64) for i, n in enumerate(names) if len(SHAPES[n]) >= 2}
    residual = {n: np.zeros((W, *SHAPES[n])) for n in names}
    for t in range(STEPS):
        for n in names:
            m = grads[n][t].astype(np.float64) + residual[n]
            if n not in q:  # vectors travel exactly and leave nothing behind
                expected, residual[n] = m.mean(0), np.zeros_like(m)
            else:
                mats = [_matrix(x) for x in m]
                p_hat = np.linalg.qr(np.mean([x @ q[n] for x in mats], 0))[0]
                q[n] = np.mean([x.T @ p_hat for x in mats], 0)
                transposed = mats[0].shape != m.shape[1:]
                back = (lambda a: a.T) if transposed else (lambda a: a)  # noqa: E731
                expected = back(p_hat @ q[n].T)
                residual[n] = np.stack([x - back(p_hat @ (y.T @ p_hat).T) for x, y in zip(m, mats)])
            np.testing.assert_allclose(means[n][0, t], expected, **LOWRANK_TOL, err_msg=f"step {t} {n}")
    for i, n in enumerate(names):
        np.testing.assert_allclose(state["residual"][n], residual[n], **LOWRANK_TOL, err_msg=n)
        if n in q:
            got = state["q"][str(i)][0]
            np.testing.assert_allclose(got * np.sign(got[:1] * q[n][:1]), q[n], **LOWRANK_TOL, err_msg=n)


# ----------------------------------------------------------------------------- unbiasedness
UNBIASED = {
    "randomk": compress.randomk(0.25, error_feedback=False),
    "terngrad": compress.terngrad(bucket_size=16),
    "qsgd": compress.qsgd(levels=2, bucket_size=16),
}


@pytest.fixture(scope="module")
def draws(mesh):
    """DRAWS outputs of each compressor on the same gradients (63 entries per worker), keys 0..DRAWS-1."""
    grads = _gradients({"g": (63,)}, 1, seed=3)
    repeated = {"g": np.repeat(grads["g"], DRAWS, axis=0)}
    cases = {name: (c, repeated) for name, c in UNBIASED.items()}
    cases["sign"] = (compress.sign(error_feedback=False), repeated)
    return grads["g"][0].mean(0), _run(mesh, cases)


@pytest.mark.parametrize("name", sorted(UNBIASED))
def test_unbiased_compressors_are_unbiased(draws, name):
    truth, runs = draws
    samples = runs[name][0]["g"][0].astype(np.float64)  # (DRAWS, 63), worker 0 (all agree)
    _same_on_every_worker(runs[name][0])
    z = _z_scores(samples, truth)
    assert np.abs(z).max() <= Z_BOUND, f"max |z| = {np.abs(z).max():.2f}"
    assert samples.std(0).max() > 0  # the draws do differ: randomness is exercised


def test_the_unbiasedness_test_catches_a_biased_compressor(draws):
    truth, runs = draws
    z = _z_scores(runs["sign"][0]["g"][0].astype(np.float64), truth)
    assert np.abs(z).max() > 20


def _z_scores(samples, truth):
    standard_error = samples.std(0, ddof=1) / math.sqrt(len(samples))
    # Coordinates rounded without randomness (|v| exactly on a level) have no spread: hold them to 1e-6.
    return (samples.mean(0) - truth) / np.maximum(standard_error, 1e-6)


# ----------------------------------------------------------------------------- training steps
TRAIN_STEPS = 3
BATCH = 64
# Hidden width 10 = the number of classes: rank 10 is full rank for both kernels (64x10, 10x10).
TRAINED = {
    "topk_k_equals_n": compress.topk(1.0),
    "powersgd_full_rank": compress.powersgd(10),
    "topk_dgc": compress.topk(0.05, momentum=0.9, clip_norm=1.0, warmup_steps=2),
    "randomk": compress.randomk(0.1),
    "sign": compress.sign(),
    "terngrad": compress.terngrad(),
    "qsgd": compress.qsgd(),
    "powersgd": compress.powersgd(2),
    "cast": compress.cast("bfloat16"),
}


@pytest.fixture(scope="module")
def trained(mesh):
    digits = datasets.load_dataset("digits")
    model = models.build_model("mlp", features=(10,))
    tx = optim.make_optimizer("sgd", 0.1)
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    loader = TrainLoader(digits.train, BATCH, mesh, seed=0)

    @functools.cache
    def run(name, mesh_spec=(("data", W),)):
        on = mesh_lib.make_mesh(mesh_spec)
        compressor = compress.none() if name == "none" else TRAINED[name]
        state = init_train_state(model, tx, example, seed=0, mesh=on, per_worker=StepSpec(compressor=compressor))
        initial = jax.device_get(state.params)
        step = make_train_step(model, tx, on, StepSpec(driver="shard_map", compressor=compressor))
        records = []
        for s in range(TRAIN_STEPS):
            state, metrics = step(state, jax.device_put(loader.batch(s), mesh_lib.batch_sharding(on)))
            records.append({k: float(v) for k, v in metrics.items()})  # waits on each step (DESIGN.md §2)
        final = jax.tree.leaves(jax.device_get(state.params))
        moved = np.concatenate([(a - b).ravel() for a, b in zip(final, jax.tree.leaves(initial))])
        return state, records, moved

    return run


def _replicas(state):
    """Every device's copy of the parameters: (devices, ...) per leaf."""
    return jax.tree.map(lambda x: np.stack([np.asarray(s.data) for s in x.addressable_shards]), state.params)


@pytest.mark.parametrize("name", ["topk_k_equals_n", "powersgd_full_rank"])
def test_train_step_at_ratio_one_equals_uncompressed(trained, name):
    reference, _, _ = trained("none")
    state, _, _ = trained(name)
    replicas = _replicas(state)
    _same_on_every_worker(replicas)
    for got, want in zip(jax.tree.leaves(replicas), jax.tree.leaves(_replicas(reference))):
        np.testing.assert_allclose(got, want, **PARAM_TOL)


@pytest.mark.parametrize("name", sorted(set(TRAINED) - {"topk_k_equals_n", "powersgd_full_rank"}))
def test_compressed_training_keeps_replicas_identical(trained, name):
    state, records, moved = trained(name)
    _same_on_every_worker(_replicas(state))
    assert all(np.isfinite(r["loss"]) for r in records)
    assert records[-1]["comm_bytes"] > 0 and records[-1]["payload_ratio"] > 1
    assert int(state.step) == TRAIN_STEPS
    # The compressed updates go where the uncompressed ones go (measured cosines: 0.36 for random-k
    # at 10% after 3 steps, 0.71 ... 1.0 for the others).
    uncompressed = trained("none")[2]
    assert moved @ uncompressed / (np.linalg.norm(moved) * np.linalg.norm(uncompressed)) > 0.25


def test_two_axis_mesh_equals_one_axis(trained):
    """all_to_all / all_gather / axis_index over ("node", "local") number workers as one axis does."""
    flat = trained("sign")[0]
    two = trained("sign", (("node", 2), ("local", 4)))[0]
    for a, b in zip(jax.tree.leaves(_replicas(two)), jax.tree.leaves(_replicas(flat))):
        np.testing.assert_allclose(a, b, **PARAM_TOL)


def test_resume_with_error_feedback_equals_an_uninterrupted_run(tmp_path):
    """The residuals are per-worker state in the checkpoint: resuming at step 3 changes nothing."""
    from dtx.run.trainer import train

    config = config_lib.load(
        os.path.join(REPO, "experiments", "digits_mlp.py"),
        ["--config.model.features=(16,)", "--config.num_steps=6", "--config.progress=False", "--config.log_every=3",
         "--config.compression.name=topk", "--config.compression.fraction=0.05",
         "--config.checkpoint.async_save=False"])
    whole = train(config, tmp_path / "whole")
    first = config_lib.override(config, **{"num_steps": 3, "checkpoint.every_steps": 3})
    train(first, tmp_path / "parts")
    second = config_lib.override(config, **{"checkpoint.resume": "must"})
    resumed = train(second, tmp_path / "parts")
    assert int(resumed.state.step) == 6
    residual = jax.tree.leaves(resumed.state.worker["compress"]["residual"])
    assert any(np.abs(np.asarray(x)).max() > 0 for x in residual)
    for a, b in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(whole.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert resumed.metrics == whole.metrics


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("name,settings,message", [
    ("gzip", {}, r"compression.name='gzip' is unknown; choose one of \['cast', 'none', 'powersgd', 'qsgd'"),
    ("topk", {"fraction": 0.0}, r"compression.fraction=0.0 must be in \(0, 1\]"),
    ("topk", {"fraction": 1.5}, r"compression.fraction=1.5 must be in \(0, 1\]"),
    ("randomk", {"fraction": -0.1}, r"compression.fraction=-0.1 must be in \(0, 1\]"),
    ("qsgd", {"levels": 0}, r"compression.levels=0 must be in \[1, 127\]"),
    ("cast", {"dtype": "int8"}, r"compression.dtype='int8' is unknown; choose one of \['bfloat16'"),
    ("topk", {"momentum": 0.9, "error_feedback": False}, r"set compression.error_feedback=True or momentum=0"),
    ("powersgd", {"rank": 0}, r"compression.rank=0 must be >= 1"),
])
def test_bad_settings_are_refused_by_name(name, settings, message):
    with pytest.raises(CompressionError, match=message):
        compress.make_compressor(name, **settings)


def test_settings_of_other_compressors_are_refused_not_checked():
    """The config block is shared: a setting sign does not take is refused as such (naming what it takes), not
    range-checked; a misspelt one is no compressor's."""
    with pytest.raises(CompressionError, match=r"compression.fraction=0.0 applies to compression.name=topk or "
                                               r"randomk only, not sign \(compression 'sign' takes: error_feedback\)"):
        compress.make_compressor("sign", fraction=0.0)
    with pytest.raises(CompressionError, match=r"compression.rank=2 applies to compression.name=powersgd only, not "
                                               r"none \(compression 'none' takes none\)"):
        compress.make_compressor("none", rank=2)
    with pytest.raises(CompressionError, match=r"unknown compression setting\(s\) \['fractoin'\] \(compression "
                                               r"'topk' takes: fraction, error_feedback, momentum, clip_norm, "
                                               r"warmup_steps;"):
        compress.make_compressor("topk", fractoin=0.1)
    # The unbiased quantisers keep no residual (not contractive): error feedback is no setting of theirs.
    params = {"w": jnp.zeros((4, 3))}
    for name in ("terngrad", "qsgd"):
        assert compress.make_compressor(name).init(params) == {}
        with pytest.raises(CompressionError, match=rf"compression.error_feedback=True .* not {name} "):
            compress.make_compressor(name, error_feedback=True)


def test_each_compressor_declares_its_factorys_signature():
    """The settings a compressor takes are its factory's parameters, no ``**kwargs``; together they are the
    keys of config.compression, each built from the default block."""
    block = config_lib.base_config().compression
    declared = compress.compressor_settings()
    for name, factory in compress.COMPRESSORS.items():
        parameters = inspect.signature(factory).parameters.values()
        assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in parameters), name
        assert declared[name] == tuple(p.name for p in parameters)
        assert compress.make_compressor(name, **{k: block[k] for k in declared[name]}).name == name
    assert sorted({k for keys in declared.values() for k in keys}) == sorted(k for k in block if k != "name")


def test_a_config_setting_the_compressor_does_not_take_is_refused_at_load_time():
    base = config_lib.base_config()
    with pytest.raises(config_lib.ConfigError, match=r"compression.fraction=0.1 applies to compression.name=topk "
                                                     r"or randomk only, not powersgd \(compression 'powersgd' takes: "
                                                     r"rank, error_feedback\); leave compression.fraction at its "
                                                     r"default 0.01"):
        config_lib.load("compression_sweep:powersgd", ["--config.compression.fraction=0.1"])
    with pytest.raises(config_lib.ConfigError, match=r"compression.levels=7 .* not topk"):
        config_lib.override(config_lib.load("compression_sweep:qsgd"), **{"compression.name": "topk"})
    # DGC's momentum is declared by topk (replaces_optimizer), not found by name.
    assert compress.COMPRESSORS["topk"].replaces_optimizer == ("momentum", "momentum")
    assert config_lib.override(base, **{"compression.name": "qsgd", "compression.levels": 7}).compression.levels == 7


def test_rank_larger_than_a_matrix_is_refused_before_compiling():
    model = models.build_model("mlp", features=(16,))
    example = jax.ShapeDtypeStruct((1, 64), jnp.float32)
    compressor = compress.make_compressor("powersgd", rank=12)  # the last kernel is 16 x 10
    with pytest.raises(CompressionError, match=r"compression.rank=12 is larger than parameter 'Dense_1/kernel' "
                                               r"of shape \(16, 10\).*choose compression.rank <= 10"):
        abstract_train_state(model, optim.make_optimizer("sgd", 0.1), example, compressor=compressor, workers=W)


def test_the_jit_driver_refuses_compression():
    with pytest.raises(StepError, match=r"compression.name='topk' need driver='shard_map' \(--config.driver=shard_map"):
        check_combination("jit", strategies.sync(), compress.make_compressor("topk"), precision.LossScaler())
