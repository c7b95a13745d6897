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
