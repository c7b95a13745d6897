"""1-bit Adam and 1-bit LAMB (dtx/strategies/onebit.py) on 8 workers: the warm-up is optax.adam, each
compressed step is the paper's update written out in numpy (sign codes with a mean-magnitude
scale per chunk, worker and server error feedback, frozen variance), and a compressed step
sends >= 5x fewer bytes than the float32 ring, by the accountant and in the compiled program.

Tolerances: ``atol=1e-6, rtol=1e-5`` as tests/test_strategies.py; the compressed steps start each
reference step from the device's state, so only one step's rounding separates them.
"""

import jax
import numpy as np
import optax
import pytest

from dtx import config as config_lib
from dtx.comm import costmodel, hlo
from dtx.compress import quantize
from dtx.strategies import StrategyError, make_strategy

P = 8
BATCH = 64
LR, W, STEPS = 1e-2, 2, 4
B1, B2 = 0.9, 0.999
TOL = dict(atol=1e-6, rtol=1e-5)
METRICS_BYTES = 2 * (P - 1) * 4


def _correction(beta, count):
    """``1 − βᵗ`` in float32, as optax computes it (it cancels: ~1e-5 relative error for β = 0.999, t = 2)."""
    return float(np.float32(1) - np.float32(beta) ** np.float32(count))


@pytest.fixture(scope="module")
def setup(mlp16):
    setup = mlp16(BATCH, STEPS)
    # Dense random inputs: blank pixels would leave momentum entries at rounding level, whose sign the host
    # reference and the device may then decide differently (1 of 8 codes flipped moves its chunk's scale).
    rng = np.random.default_rng(0)
    batches = []
    for batch in setup["batches"]:
        noise = rng.normal(size=batch["inputs"].shape).astype(np.float32)
        batches.append({**batch, "inputs": jax.device_put(noise, batch["inputs"].sharding)})
    return {**setup, "batches": batches}


@pytest.fixture(scope="module")
def adam_run(setup, run_steps):
    return run_steps(setup, optax.sgd(LR), STEPS, make_strategy("onebit_adam", warmup_steps=W))


@pytest.fixture(scope="module")
def sync_adam(setup, run_steps):
    return run_steps(setup, optax.adam(LR), W)


def test_warmup_is_optax_adam_under_sync(adam_run, sync_adam):
    for t in range(W):
        for a, b in zip(jax.tree.leaves(adam_run["states"][t].params), jax.tree.leaves(sync_adam["states"][t].params)):
            np.testing.assert_allclose(a, b, **TOL)
        assert int(adam_run["records"][t]["compressed"]) == 0
    assert [int(r["compressed"]) for r in adam_run["records"][W:]] == [1] * (STEPS - W)


def _sign_allreduce(values, server):
    """The paper's compressed allreduce of one leaf in numpy: ``values`` (P, n) with the workers' error
    feedback added, ``server`` (P, n) the server residuals. Returns (mean, what each worker's codes
    decode to, new server residuals)."""
    n = values.shape[1]
    w = max(1, -(-n // P))
    padded = np.zeros((P, P * w))
    padded[:, :n] = values
    real = (np.arange(P * w) < n).reshape(P, w)  # [chunk, entry]
    chunks = padded.reshape(P, P, w)  # [worker, chunk, entry]
    scales = np.abs(chunks).sum(-1) / np.maximum(real.sum(-1), 1)
    decoded = np.where(real, scales[..., None] * np.where(chunks >= 0, 1.0, -1.0), 0.0)
    sent = decoded.reshape(P, -1)[:, :n]
    server_chunks = np.zeros((P, P * w))
    server_chunks[:, :n] = server
    mine = server_chunks.reshape(P, P, w)[np.arange(P), np.arange(P)]  # server j's residual on its chunk j
    y = decoded.mean(0) + mine  # [chunk j, entry], averaged by worker j
    scale2 = np.abs(y).sum(-1) / np.maximum(real.sum(-1), 1)
    mean_chunks = np.where(real, scale2[:, None] * np.where(y >= 0, 1.0, -1.0), 0.0)
    new_server = server_chunks.reshape(P, P, w).copy()
    new_server[np.arange(P), np.arange(P)] = y - mean_chunks
    return mean_chunks.reshape(-1)[:n], sent, new_server.reshape(P, -1)[:, :n]


def _reference_step(setup, before, t, eps, ratios=None):
    """One compressed step (Tang et al., Algorithm 1, with optax's bias corrections) from the host state
    ``before``: per-worker momenta, the sign allreduce with both residuals, the frozen variance."""
    params, adam = before.params, before.shared["adam"]
    batch = jax.device_get(setup["batches"][t])
    xs, ys = np.split(batch["inputs"], P), np.split(batch["labels"], P)
    grads = [jax.tree.leaves(setup["grad"](params, xs[i], ys[i])) for i in range(P)]
    count = int(adam.count) + 1
    out = {"params": [], "mu": [], "residual": [], "server": []}
    leaves = jax.tree.leaves(params)
    for j, (x, m, v) in enumerate(zip(leaves, jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu))):
        momentum = np.asarray(m, np.float64).reshape(-1)
        local = np.stack([(1 - B1) * np.asarray(g[j], np.float64).reshape(-1) + B1 * momentum for g in grads])
        residual = np.asarray(jax.tree.leaves(before.worker["strategy"]["residual"])[j], np.float64).reshape(P, -1)
        server = np.asarray(jax.tree.leaves(before.worker["strategy"]["server"])[j], np.float64).reshape(P, -1)
        mean, sent, server = _sign_allreduce(local + residual, server)
        v = np.asarray(v, np.float64).reshape(-1)
        u = np.where(v > 0, (mean / _correction(B1, count)) / (np.sqrt(v / _correction(B2, W)) + eps), 0.0)
        if ratios is not None:
            u = u * ratios[j]
        out["params"].append((np.asarray(x, np.float64).reshape(-1) - LR * u).reshape(x.shape))
        out["mu"].append(mean.reshape(x.shape))
        out["residual"].append((local + residual - sent).reshape((P,) + x.shape))
        out["server"].append(server.reshape((P,) + x.shape))
    return out


def _check_against_reference(setup, states, eps, ratios=None):
    for t in range(W, STEPS):
        want = _reference_step(setup, states[t - 1], t, eps, ratios)
        got = states[t]
        mine = got.worker["strategy"]
        for name, tree in [("params", got.params), ("mu", got.shared["adam"].mu), ("residual", mine["residual"]),
                           ("server", mine["server"])]:
            for a, b in zip(jax.tree.leaves(tree), want[name]):
                np.testing.assert_allclose(a, b, **TOL, err_msg=f"{name}, step {t}")
        for a, b in zip(jax.tree.leaves(got.shared["adam"].nu), jax.tree.leaves(states[W - 1].shared["adam"].nu)):
            np.testing.assert_array_equal(a, b)  # frozen


def test_compressed_steps_match_the_papers_update_in_numpy(setup, adam_run):
    """Two compressed steps, the second with the residuals the first left: dropping either residual,
    averaging the gradient instead of the momentum, or letting the variance move fails here."""
    _check_against_reference(setup, adam_run["states"], eps=1e-8)
    assert np.abs(jax.tree.leaves(adam_run["states"][-1].worker["strategy"]["server"])[1]).max() > 0


def test_onebit_lamb_freezes_the_warmup_trust_ratios(setup, run_steps):
    states = run_steps(setup, optax.sgd(LR), STEPS, make_strategy("onebit_lamb", warmup_steps=W))["states"]
    last, adam = states[W - 2].params, states[W - 1].shared["adam"]
    ratios = []
    for (path, x), m, v in zip(jax.tree_util.tree_leaves_with_path(last), jax.tree.leaves(adam.mu),
                               jax.tree.leaves(adam.nu)):
        v_hat = np.asarray(v, np.float64) / _correction(B2, W)
        u = (np.asarray(m, np.float64) / _correction(B1, W)) / (np.sqrt(v_hat) + 1e-6)
        excluded = jax.tree_util.keystr(path).endswith("['bias']")  # biases: no trust ratio, as dtx's lamb
        ratios.append(1.0 if excluded else float(np.linalg.norm(x) / np.linalg.norm(u)))
    np.testing.assert_allclose(jax.tree.leaves(states[W - 1].shared["trust"]), ratios, rtol=1e-5)
    assert min(ratios) != max(ratios)
    _check_against_reference(setup, states, eps=1e-6, ratios=ratios)


def test_compressed_steps_send_over_5x_fewer_bytes_than_the_float32_ring(setup, adam_run, sync_adam):
    params = adam_run["states"][0].params
    ring = costmodel.dense_allreduce_traffic(params, P, "ring", "float32").bytes_sent
    row = quantize.chunk_bytes([x.shape for x in jax.tree.leaves(params)], P, quantize.sign_quantizer())
    sent = [int(r["comm_bytes"]) - METRICS_BYTES for r in adam_run["records"]]
    assert sent == [ring] * W + [2 * (P - 1) * row] * (STEPS - W)
    assert int(sync_adam["records"][0]["comm_bytes"]) >= 5 * int(adam_run["records"][-1]["comm_bytes"])
    # The compiled program: gradients all-reduced in the warm-up branch, the momentum's codes all-to-all
    # and all-gathered in the other, nothing at every step but the metrics.
    found = hlo.collectives(adam_run["step"].lower(adam_run["state"], setup["batches"][0]).compile())
    assert [(c.kind, c.operand_bytes) for c in found if c.context != "conditional"] == [("all-reduce", 8)]
    codes = [c for c in found if c.kind in ("all-to-all", "all-gather")]
    assert {c.context for c in codes} == {"conditional"} and len(codes) == 2
    assert sum(c.bytes_sent for c in codes) == 2 * (P - 1) * row and ring >= 5 * 2 * (P - 1) * row
    warmup = [c for c in found if c.kind == "all-reduce" and c.context == "conditional"]
    assert sum(c.bytes_sent for c in warmup) == ring


def test_bad_settings_name_the_key_and_the_fix():
    with pytest.raises(StrategyError, match=r"strategy.warmup_steps=0 must be an integer >= 1"):
        make_strategy("onebit_adam", warmup_steps=0)
    with pytest.raises(StrategyError, match=r"strategy.adam_eps=-1.0 must be in \[0, 1\]"):
        make_strategy("onebit_lamb", adam_eps=-1.0)
    with pytest.raises(config_lib.ConfigError, match=r"set --config.optimizer.name=sgd"):
        config_lib.override(config_lib.base_config(), **{"strategy.name": "onebit_lamb"})


def test_the_sgd_rule_is_declared_by_the_strategies_and_other_settings_are_refused():
    """1-bit Adam/LAMB declare that they do the optimizer's preconditioning (dtx.config.replaces_optimizer):
    the config refuses Adam under them, and a setting they do not take, by what they declare, not by name."""
    from dtx import strategies

    assert strategies.STRATEGIES["onebit_adam"].replaces_optimizer == ("Adam preconditioning", "")
    assert [n for n, f in strategies.STRATEGIES.items() if hasattr(f, "replaces_optimizer")] == [
        "onebit_adam", "onebit_lamb"]
    with pytest.raises(config_lib.ConfigError, match=r"strategy.name='onebit_adam' does the optimizer's Adam "
                                                     r"preconditioning itself, so optimizer.name='lamb' would"):
        config_lib.override(config_lib.base_config(), **{"strategy.name": "onebit_adam", "optimizer.name": "lamb"})
    sgd = {"strategy.name": "onebit_adam", "optimizer.name": "sgd"}
    assert config_lib.override(config_lib.base_config(), **sgd, **{"strategy.warmup_steps": 7}).strategy.name
    with pytest.raises(config_lib.ConfigError, match=r"strategy.period=2 .* not onebit_adam \(strategy 'onebit_adam' "
                                                     r"takes: warmup_steps, adam_eps\)"):
        config_lib.override(config_lib.base_config(), **sgd, **{"strategy.period": 2})
    with pytest.raises(StrategyError, match=r"strategy.staleness=1 applies to strategy.name=async or ssp only, not "
                                            r"onebit_lamb \(strategy 'onebit_lamb' takes: warmup_steps, adam_eps\)"):
        make_strategy("onebit_lamb", staleness=1)


def test_coordinates_whose_frozen_variance_is_zero_do_not_move(setup, adam_run):
    """A gradient that was 0 all through the warm-up (a blank pixel's weights) leaves v = 0: its sign code
    still says ±scale, which over ε would throw the parameter away; the direction there is 0, as Adam's."""
    before = adam_run["states"][W - 1]
    nu = [np.asarray(v).copy() for v in jax.tree.leaves(before.shared["adam"].nu)]
    kernel = int(np.argmax([v.size for v in nu]))
    nu[kernel][0] = 0.0  # the first input's row
    host = before.replace(shared={"adam": before.shared["adam"]._replace(
        nu=jax.tree.unflatten(jax.tree.structure(before.shared["adam"].nu), nu))})
    state = jax.device_put(host, jax.tree.map(lambda x: x.sharding, adam_run["state"]))
    after, _ = adam_run["step"](state, setup["batches"][W])
    old, new = jax.tree.leaves(before.params)[kernel], jax.tree.leaves(jax.device_get(after.params))[kernel]
    np.testing.assert_array_equal(new[0], old[0])
    assert np.all(new[1:] != old[1:])
