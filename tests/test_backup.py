"""Backup workers (Chen et al. 2016): each step applies the mean of the first N = p − b gradients to
arrive, the arrival order the straggler model's, the same one the simulated clock times.

Tolerances: as tests/test_strategies.py, float32 sums in another order: ``atol=1e-6, rtol=1e-5``.
"""

import jax
import numpy as np
import optax
import pytest

from dtx.perf import clusters, simclock
from dtx.perf import layers as layers_lib
from dtx import comm, models
from dtx.step.state import init_train_state
from dtx.step import StepSpec, make_train_step
from dtx.strategies import StepContext, StrategyError, make_strategy
from dtx.strategies.stragglers import Stragglers

P, BATCH, STEPS, LR = 8, 64, 3, 0.1
PARAM_TOL = dict(atol=1e-6, rtol=1e-5)
NOISE = Stragglers("lognormal", 3, 0.5)


@pytest.fixture(scope="module")
def setup(mlp16):
    setup = mlp16(BATCH, STEPS)
    state = init_train_state(setup["model"], optax.sgd(LR), setup["example"], seed=0, mesh=setup["mesh"])
    return {**setup, "initial": jax.device_get(state.params)}


def _run(setup, strategy):
    model, mesh, tx = setup["model"], setup["mesh"], optax.sgd(LR)
    state = init_train_state(model, tx, setup["example"], seed=0, mesh=mesh, per_worker=StepSpec(strategy=strategy))
    step = make_train_step(model, tx, mesh, StepSpec(strategy=strategy))
    records = []
    for batch in setup["batches"]:
        state, metrics = step(state, batch)
        records.append(jax.device_get(metrics))
    return jax.device_get(state), records


def _reference(setup, chosen):
    """SGD on the host: each worker's gradient on its block of the batch, the mean over ``chosen(t)``."""
    grad = setup["grad"]
    theta = jax.tree.map(lambda x: np.asarray(x, np.float64), setup["initial"])
    for t, batch in enumerate(setup["batches"]):
        batch = jax.device_get(batch)
        xs, ys = np.split(batch["inputs"], P), np.split(batch["labels"], P)
        at = jax.tree.map(lambda x: x.astype(np.float32), theta)
        grads = [jax.tree.map(lambda g: np.asarray(g, np.float64), grad(at, xs[i], ys[i])) for i in chosen(t)]
        theta = jax.tree.map(lambda th, *g: th - LR * np.mean(g, 0), theta, *grads)
    return theta


def _close(tree, reference):
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(reference)):
        np.testing.assert_allclose(a, b, **PARAM_TOL)


def test_backup_workers_apply_the_mean_of_the_first_n_to_arrive(setup):
    """b = 3 of 8: three SGD steps equal a host reference that averages, per step, the gradients of the
    workers the straggler model says arrive first (NOISE.arrival_order(t)[:5]); the mean over all eight,
    or over the last five, is far from it. The bytes are sync's: one allreduce of the masked gradient."""
    b = 3
    state, records = _run(setup, make_strategy("backup", backup_workers=b, stragglers=NOISE))
    _close(state.params, _reference(setup, lambda t: NOISE.arrival_order(t, P)[:P - b]))
    for wrong in (lambda t: range(P), lambda t: NOISE.arrival_order(t, P)[b:]):
        with pytest.raises(AssertionError):
            _close(state.params, _reference(setup, wrong))
    # sync's bytes: the psum of the gradients plus the step's metric averages (2 floats, 1 entry per chunk)
    sync = comm.allreduce_traffic(setup["initial"], comm.CommContext(("data",), P, lambda t: t)).bytes_sent
    assert [r["comm_bytes"] for r in records] == [sync + 2 * (P - 1) * 4] * STEPS
    assert records[0]["dropped"] == b


def test_the_clock_charges_the_nth_arrival_of_the_gradients_the_step_applied():
    """The clock's step time is the N-th smallest worker time, and the N workers within it are exactly the
    ones the strategy averaged (the arrival order the strategy uses)."""
    model = models.build_model("mlp", features=(16,))
    layers = layers_lib.analyze(model, (64,))
    b = 3
    clock_model = simclock.make_model(clusters.get_cluster("cloud_10gbe"), layers, workers=P, global_batch=BATCH,
                                      stragglers=NOISE, drops=b)
    clock = simclock.SimClock(clock_model)
    for t in range(5):
        times = clock_model.worker_times(t, 2e-4)
        nth = np.sort(times)[P - b - 1]
        assert clock.step_time(t, *(2e-4 / (1 / clock_model.bandwidth + clock_model.reduce_s_per_byte), 0)) \
            == pytest.approx(nth, rel=1e-12)
        assert set(np.flatnonzero(times <= nth)) == set(NOISE.arrival_order(t, P)[:P - b])


def test_backup_workers_must_leave_a_gradient():
    ctx = StepContext(tx=None, comm=comm.CommContext(("data",), P, lambda t: t), reduce=None, key=None, index=0)
    with pytest.raises(StrategyError, match=r"strategy.backup_workers=8 leaves no gradient of the 8 workers"):
        make_strategy("backup", backup_workers=8).apply(None, None, ctx)
    with pytest.raises(StrategyError, match=r"strategy.backup_workers=-1 must be an integer >= 0"):
        make_strategy("backup", backup_workers=-1)


def test_backup_workers_are_backups_setting_only():
    """The factory and the config refuse backup_workers for another strategy, naming what that one takes; the
    straggler model goes to backup, which declares it, and to no other."""
    from dtx import config as config_lib

    with pytest.raises(StrategyError, match=r"strategy.backup_workers=2 applies to strategy.name=backup only, not "
                                            r"sync \(strategy 'sync' takes none\)"):
        make_strategy("sync", backup_workers=2, stragglers=NOISE)
    with pytest.raises(config_lib.ConfigError, match=r"strategy.backup_workers=2 applies to strategy.name=backup "
                                                     r"only, not ssp \(strategy 'ssp' takes: staleness\)"):
        config_lib.load("digits_mlp", ["--config.strategy.name=ssp", "--config.strategy.backup_workers=2"])
    assert make_strategy("sync", stragglers=NOISE).name == "sync"
    assert make_strategy("backup", backup_workers=2, stragglers=NOISE).caps.drops == 2
