"""Streaming DiLoCo (dtx/strategies/streaming.py) on 8 workers: one fragment is DiLoCo, fragments on staggered
schedules with overlap follow a reference written out in numpy, and the peak bytes per step are
``1/P`` of DiLoCo's at equal bytes over a period.

Tolerances: ``atol=1e-6, rtol=1e-5`` on parameters against the float64 reference, as
tests/test_strategies.py (float32 sums in another order differ in the last bits).
"""

import jax
import numpy as np
import optax
import pytest

from dtx.comm import costmodel, hlo
from dtx.compress import quantize
from dtx.step import StepSpec
from dtx.step.state import init_train_state
from dtx.strategies import StrategyError, make_strategy
from dtx.strategies.streaming import fragment_slices
from dtx.data.tasks import cross_entropy

P = 8
BATCH = 64
PARAM_TOL = dict(atol=1e-6, rtol=1e-5)
METRICS_BYTES = 2 * (P - 1) * 4  # every step's loss/accuracy pmean (two float32s), counted with the strategy's
LR, BETA = 0.05, 0.5  # inner SGD with momentum


@pytest.fixture(scope="module")
def setup(mlp16):
    return mlp16(BATCH, 8)


@pytest.fixture(scope="module")
def run(run_steps):
    """``run(setup, strategy, steps)``: inner SGD with momentum."""
    return lambda setup, strategy, steps: run_steps(setup, optax.sgd(LR, momentum=BETA), steps, strategy)


@pytest.fixture(scope="module")
def diloco_run(setup, run):
    return run(setup, make_strategy("diloco", period=2, outer_learning_rate=0.7, outer_momentum=0.9), 4)


STAGGERED = dict(period=4, fragments=2, overlap=1, merge_alpha=0.25, outer_learning_rate=0.7, outer_momentum=0.9)


@pytest.fixture(scope="module")
def staggered_run(setup, run):
    return run(setup, make_strategy("streaming_diloco", **STAGGERED), 8)


def test_one_fragment_without_overlap_is_diloco_exactly(setup, diloco_run, run):
    streaming = run(setup, make_strategy("streaming_diloco", period=2, fragments=1, outer_learning_rate=0.7,
                                         outer_momentum=0.9), 4)
    for a, b in zip(streaming["states"], diloco_run["states"]):
        for x, y in zip(jax.tree.leaves((a.params, a.worker["strategy"])),
                        jax.tree.leaves((b.params, b.worker["strategy"]))):
            np.testing.assert_array_equal(x, y)
        # The one fragment's outer momentum is DiLoCo's, flattened.
        np.testing.assert_array_equal(a.shared["outer_opt_state"][0][0].trace, np.concatenate(
            [x.reshape(-1) for x in jax.tree.leaves(b.shared["outer_opt_state"][0].trace)]))
    assert [int(r["comm_bytes"]) for r in streaming["records"]] == [int(r["comm_bytes"]) for r in diloco_run["records"]]


def _host_grads(setup):
    model = setup["model"]
    grad = jax.jit(jax.grad(lambda p, x, y: cross_entropy(model.apply({"params": p}, x, train=True), y).mean()))
    return grad


def test_staggered_fragments_with_overlap_match_a_numpy_reference(setup, staggered_run):
    """Per-worker SGD with momentum; fragment f (offset ⌊fH/P⌋) sends Δ_f = θ_f − mean_i θ_{i,f} at the end
    of the steps with (t+1−off_f) mod H = 0, the outer Nesterov step updates θ_f at once, and τ = 1 step
    later each worker merges θ_{i,f} ← αθ_{i,f} + (1−α)θ_f. Replacing instead of mixing, merging at send
    time, or one shared schedule each move the workers by far more than the tolerance."""
    H, F, tau, alpha, rate, mu = (STAGGERED[k] for k in ("period", "fragments", "overlap", "merge_alpha",
                                                           "outer_learning_rate", "outer_momentum"))
    grad = _host_grads(setup)
    init = jax.device_get(staggered_run["states"][0].params)  # structure only
    treedef = jax.tree.structure(init)
    shapes = [x.shape for x in jax.tree.leaves(init)]
    sizes = [int(np.prod(s)) for s in shapes]
    first = init_train_state(setup["model"], optax.sgd(LR), setup["example"], seed=0, mesh=setup["mesh"]).params
    theta = np.concatenate([np.asarray(x, np.float64).reshape(-1) for x in jax.tree.leaves(jax.device_get(first))])
    n = theta.size
    bounds = [f * n // F for f in range(F + 1)]
    offsets = [f * H // F for f in range(F)]
    workers = np.tile(theta, (P, 1))
    velocity = np.zeros_like(workers)
    outer = np.zeros_like(theta)

    def unflat(v):
        leaves, start = [], 0
        for s, k in zip(shapes, sizes):
            leaves.append(v[start:start + k].reshape(s).astype(np.float32))
            start += k
        return jax.tree.unflatten(treedef, leaves)

    for t in range(8):
        batch = jax.device_get(setup["batches"][t])
        xs, ys = np.split(batch["inputs"], P), np.split(batch["labels"], P)
        for i in range(P):
            g = np.concatenate([np.asarray(x, np.float64).reshape(-1)
                                for x in jax.tree.leaves(grad(unflat(workers[i]), xs[i], ys[i]))])
            velocity[i] = BETA * velocity[i] + g
            workers[i] -= LR * velocity[i]
        done = t + 1
        for f in range(F):
            lo, hi = bounds[f], bounds[f + 1]
            if (done - offsets[f]) % H == 0 and done >= offsets[f]:
                delta = theta[lo:hi] - workers[:, lo:hi].mean(0)
                outer[lo:hi] = mu * outer[lo:hi] + delta
                theta[lo:hi] -= rate * (delta + mu * outer[lo:hi])
            first_sync = offsets[f] or H
            if (done - first_sync - tau) % H == 0 and done >= first_sync + tau:
                workers[:, lo:hi] = alpha * workers[:, lo:hi] + (1 - alpha) * theta[lo:hi]
        got = staggered_run["states"][t]
        for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(unflat(theta))):
            np.testing.assert_allclose(a, b, **PARAM_TOL, err_msg=f"global, step {t}")
        for i in range(P):
            mine = jax.tree.map(lambda x: x[i], got.worker["strategy"]["params"])
            for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(unflat(workers[i]))):
                np.testing.assert_allclose(a, b, **PARAM_TOL, err_msg=f"worker {i}, step {t}")


def _ring(n):
    return costmodel.dense_allreduce_traffic(jax.ShapeDtypeStruct((n,), np.float32), P, "ring").bytes_sent


def test_peak_bytes_are_a_pth_of_diloco_at_equal_total_over_a_period(setup, diloco_run, staggered_run):
    params = staggered_run["states"][0].params
    sizes = [x.size for x in jax.tree.leaves(params)]
    fragment_sizes = [sum(hi - lo for _, lo, hi in pieces) for pieces in fragment_slices(sizes, 2)]
    diloco = [int(r["comm_bytes"]) - METRICS_BYTES for r in diloco_run["records"]]
    streaming = [int(r["comm_bytes"]) - METRICS_BYTES for r in staggered_run["records"]]
    whole = sum(_ring(k) for k in sizes)  # DiLoCo: every leaf's ring, on outer steps only
    assert diloco == [0, whole, 0, whole]
    # H = 4, P = 2: fragment 1 at steps 2, 6 (t+1), fragment 0 at 4, 8, one fragment's ring each.
    assert streaming == [0, _ring(fragment_sizes[1]), 0, _ring(fragment_sizes[0])] * 2
    # Equal bytes over a period and a peak of 1/P, up to the ring's rounding of ⌈e/p⌉ per message.
    rounding = 2 * (P - 1) * 4 * (len(sizes) + 2)
    assert abs(sum(streaming[:4]) - whole) <= rounding
    assert abs(2 * max(streaming) - whole) <= rounding and max(streaming) / whole < 0.5 + 0.01


def test_compiled_step_sends_one_fragment_per_branch(setup, staggered_run):
    compiled = staggered_run["step"].lower(staggered_run["state"], setup["batches"][0]).compile()
    found = hlo.collectives(compiled)
    assert [(c.kind, c.operand_bytes) for c in found if c.context != "conditional"] == [("all-reduce", 8)]
    sizes = [x.size for x in jax.tree.leaves(staggered_run["states"][0].params)]
    fragments = sorted(4 * sum(hi - lo for _, lo, hi in p) for p in fragment_slices(sizes, 2))
    assert sorted(c.operand_bytes for c in found if c.context == "conditional") == fragments


def test_quantised_outer_gradients_send_4_bit_codes(setup, run):
    # One fragment, an outer step every step: the smallest program that sends the codes.
    out = run(setup, make_strategy("streaming_diloco", period=1, outer_bits=4), 2)
    n = sum(x.size for x in jax.tree.leaves(out["states"][0].params))
    q = quantize.qsgd_quantizer(7, 512)
    expected = costmodel.compressed_allreduce_traffic(quantize.chunk_bytes([(n,)], P, q), P).bytes_sent
    assert [int(r["comm_bytes"]) - METRICS_BYTES for r in out["records"]] == [expected, expected]
    assert expected * 7 < _ring(n)  # 4 bits + a scale per 512 entries vs 32 bits
    # Every worker decoded the same mean: the global model stays replicated, workers restart from it.
    for leaf, mine in zip(jax.tree.leaves(out["states"][-1].params),
                          jax.tree.leaves(out["states"][-1].worker["strategy"]["params"])):
        assert all(np.array_equal(leaf, worker) for worker in mine)  # H = 1: every worker restarts from θ
    for leaf in jax.tree.leaves(out["state"].params):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert all(np.array_equal(shards[0], s) for s in shards[1:])


QUANTISED = dict(STAGGERED, outer_bits=4)
LEVELS, BUCKET = 2 ** (4 - 1) - 1, 512  # QSGD levels 2^(b-1) - 1 for b = 4; the module's buckets


def _flat(tree, workers=False):
    """The parameter vector of a (host) tree, leaves in tree order; ``workers``: one row per worker."""
    leaves = [np.asarray(x) for x in jax.tree.leaves(tree)]
    return np.concatenate([x.reshape(P, -1) if workers else x.reshape(-1) for x in leaves], axis=-1)


def _qsgd(v, u):
    """QSGD (Alistarh et al. 2017) of rows ``v`` (R, w), one bucket per row (w <= BUCKET), with the uniform
    draws ``u`` (R, BUCKET): ‖v‖₂ · sign(v) · l / L, l = ⌊L|v|/‖v‖₂ + u⌋ clipped to [0, L]. Float64."""
    v = np.asarray(v, np.float64)
    norm = np.sqrt((v * v).sum(-1, keepdims=True))
    level = np.clip(np.floor(np.abs(v) / np.where(norm > 0, norm, 1.0) * LEVELS + u[:, : v.shape[1]]), 0, LEVELS)
    return np.sign(v) * level * norm / LEVELS


def _quantised_mean(deltas, key):
    """The workers' mean of ``deltas`` (P, n) as the two-phase compressed allreduce computes it, in numpy:
    each worker i cuts its Δ into P chunks of w = ⌈n/P⌉ (zero-padded) and QSGD-codes them with its own draws;
    worker j decodes chunk j from every worker, averages, re-codes the average with fresh draws and shares it.
    Only the uniform draws come from jax (the keys the strategy derives: the step's shared key, the fragment,
    the worker; then phase 1 and phase 2 halves, leaf 0)."""
    n = deltas.shape[1]
    w = -(-n // P)
    assert w <= BUCKET  # one bucket (one norm) per chunk
    chunks = np.zeros((P, P * w), np.float32)
    chunks[:, :n] = deltas
    chunks = chunks.reshape(P, P, w)  # [worker, chunk, entry]
    halves = [jax.random.split(jax.random.fold_in(key, i)) for i in range(P)]

    def draw(half, rows):  # leaf 0's draws, one bucket per row
        return np.asarray(jax.random.uniform(jax.random.fold_in(half, 0), (rows, 1, BUCKET)))[:, 0]

    decoded = np.stack([_qsgd(chunks[i], draw(halves[i][0], P)) for i in range(P)])  # [worker, chunk, entry]
    averaged = decoded.mean(0)  # row j: worker j's average of chunk j
    shared = np.concatenate([_qsgd(averaged[j: j + 1], draw(halves[j][1], 1)) for j in range(P)], axis=0)
    return shared.reshape(-1)[:n]


def test_quantised_outer_steps_match_a_numpy_reference(setup, run):
    """Streaming DiLoCo with 4-bit outer gradients (Douillard et al. 2025), every step of 8 against numpy,
    each step from the device's state before it: per-worker SGD with momentum; at fragment f's outer step
    (offset ⌊fH/P⌋) Δ_{i,f} = θ_f − θ_{i,f}, QSGD-coded per worker (L = 7, one norm per chunk) in the
    two-phase compressed allreduce, averaged, the outer Nesterov step on θ_f; τ = 1 step later each worker
    merges θ_{i,f} ← αθ_{i,f} + (1−α)θ_f. The quantiser's uniform draws are jax's (same keys); the codes,
    norms, averages and steps are numpy's. A decoded mean scaled by 0, or left unquantised, moves θ by far
    more than the tolerance (checked: the outer steps and the quantisation errors are both far above it)."""
    H, F, tau, alpha, rate, mu = (QUANTISED[k] for k in ("period", "fragments", "overlap", "merge_alpha",
                                                           "outer_learning_rate", "outer_momentum"))
    strategy = make_strategy("streaming_diloco", **QUANTISED)
    out = run(setup, strategy, 8)
    tx = optax.sgd(LR, momentum=BETA)
    states = [jax.device_get(init_train_state(setup["model"], tx, setup["example"], seed=0, mesh=setup["mesh"],
                                              per_worker=StepSpec(strategy=strategy)))] + out["states"]
    grad = _host_grads(setup)
    n = _flat(states[0].params).size
    bounds = [f * n // F for f in range(F + 1)]
    offsets = [f * H // F for f in range(F)]
    moved, quantisation_error, outer_steps, merges = 0.0, 0.0, 0, 0
    for t in range(8):
        before, after = states[t], states[t + 1]
        theta = _flat(before.params).astype(np.float64)
        mine = before.worker["strategy"]
        local = _flat(mine["params"], workers=True)
        velocity = _flat(mine["opt_state"][0].trace, workers=True).astype(np.float64)
        batch = jax.device_get(setup["batches"][t])
        xs, ys = np.split(batch["inputs"], P), np.split(batch["labels"], P)
        one = lambda i: jax.tree.map(lambda x: x[i], mine["params"])  # noqa: E731
        g = np.stack([_flat(grad(one(i), xs[i], ys[i])) for i in range(P)]).astype(np.float64)
        velocity = BETA * velocity + g
        workers = local.astype(np.float64) - LR * velocity
        outer = [_flat(before.shared["outer_opt_state"][f][0].trace).astype(np.float64) for f in range(F)]
        done = t + 1
        # The strategy's key: this step's key shared by the workers (dtx.step.body.step_keys), then the fragment.
        _, step_rng = jax.random.split(jax.random.wrap_key_data(before.rng))
        shared_key = jax.random.fold_in(step_rng, 1)
        for f in range(F):
            lo, hi = bounds[f], bounds[f + 1]
            if (done - offsets[f]) % H == 0:
                # The workers' θ_{i,f} that were sent: the device's own (not merged this step), so the codes are
                # taken of the same float32 Δ; they are checked against the numpy inner step below.
                sent = _flat(after.worker["strategy"]["params"], workers=True)[:, lo:hi]
                np.testing.assert_allclose(sent, workers[:, lo:hi], **PARAM_TOL, err_msg=f"sent, step {t}")
                delta = _flat(before.params)[lo:hi][None] - sent  # float32, as the device subtracts
                mean = _quantised_mean(delta, jax.random.fold_in(shared_key, f))
                moved = max(moved, np.abs(rate * mean).max())
                quantisation_error = max(quantisation_error, np.abs(mean - delta.astype(np.float64).mean(0)).max())
                outer[f] = mu * outer[f] + mean
                theta[lo:hi] -= rate * (mean + mu * outer[f])
                outer_steps += 1
            first = offsets[f] or H
            if done >= first + tau and (done - first - tau) % H == 0:
                workers[:, lo:hi] = alpha * workers[:, lo:hi] + (1 - alpha) * theta[lo:hi]
                merges += 1
        np.testing.assert_allclose(_flat(after.params), theta, **PARAM_TOL, err_msg=f"global, step {t}")
        np.testing.assert_allclose(_flat(after.worker["strategy"]["params"], workers=True), workers, **PARAM_TOL,
                                   err_msg=f"workers, step {t}")
        np.testing.assert_allclose(_flat(after.worker["strategy"]["opt_state"][0].trace, workers=True), velocity,
                                   **PARAM_TOL, err_msg=f"inner momentum, step {t}")
        for f in range(F):
            np.testing.assert_allclose(_flat(after.shared["outer_opt_state"][f][0].trace), outer[f], **PARAM_TOL,
                                       err_msg=f"outer momentum {f}, step {t}")
    assert (outer_steps, merges) == (4, 3)
    assert min(moved, quantisation_error) > 1000 * PARAM_TOL["atol"], (moved, quantisation_error)


@pytest.mark.parametrize("settings, match", [
    (dict(period=2, fragments=3), "strategy.fragments=3 must be <= strategy.period=2"),
    (dict(period=4, overlap=4), "strategy.overlap=4 must be < strategy.period=4"),
    (dict(outer_bits=1), r"strategy.outer_bits=1 must be 0 \(float32\) or in \[2, 8\]"),
    (dict(outer_bits=9), "strategy.outer_bits=9"),
    (dict(merge_alpha=1.5), r"strategy.merge_alpha=1.5 must be in \[0, 1\]"),
    (dict(fragments=0), "strategy.fragments=0 must be an integer >= 1"),
])
def test_bad_settings_name_the_key_and_the_range(settings, match):
    with pytest.raises(StrategyError, match=match):
        make_strategy("streaming_diloco", **settings)


def test_a_setting_streaming_diloco_does_not_take_is_refused():
    """Its fragments, overlap and bits are its own (diloco refuses them); gossip's topology is not its."""
    with pytest.raises(StrategyError, match=r"strategy.topology='complete' applies to strategy.name=gossip only, not "
                                            r"streaming_diloco \(strategy 'streaming_diloco' takes: period, "
                                            r"fragments, overlap, outer_bits, merge_alpha, outer_learning_rate, "
                                            r"outer_momentum\)"):
        make_strategy("streaming_diloco", topology="complete")
    with pytest.raises(StrategyError, match=r"strategy.fragments=2 applies to strategy.name=streaming_diloco only, "
                                            r"not diloco"):
        make_strategy("diloco", period=4, fragments=2)
    from dtx import config as config_lib

    with pytest.raises(config_lib.ConfigError, match=r"strategy.overlap=1 .* not diloco .*; leave strategy.overlap "
                                                     r"at its default 0"):
        config_lib.load("sync_strategies:diloco", ["--config.strategy.overlap=1"])
    loaded = config_lib.load("sync_strategies:diloco", ["--config.strategy.name=streaming_diloco",
                                                        "--config.strategy.overlap=1"])
    assert (loaded.strategy.period, loaded.strategy.overlap) == (16, 1)
