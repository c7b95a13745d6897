"""Synchronous, asynchronous and relaxed SGD: each strategy's special case is sync, and each
relaxation does what its paper says, on 8 workers.

Tolerances: as tests/test_step.py — float32 sums in another order differ in the last
bits, held to ``atol=1e-6, rtol=1e-5`` on parameters after a few SGD-momentum steps.
SGD-momentum, not Adam, wherever a strategy with local optimizer states is compared
with ``sync``: local steps followed by an average equal one step on the average only
for an optimizer linear in the gradient (Adam divides by each worker's own ``√v``).
Spectral and elastic contractions are held to ``rtol=1e-4`` (float32 arithmetic on
differences of parameters of size ~0.1–1).
"""

import inspect

import jax
import numpy as np
import optax
import pytest

from dtx import models
from dtx import config as config_lib
from dtx.comm import costmodel, hlo
from dtx.run import metrics
from dtx import optim, strategies
from dtx.data import eval_batches
from dtx.step.state import init_train_state
from dtx.step import StepSpec, make_eval_step, make_train_step
from dtx.data.tasks import cross_entropy
from dtx.comm.topology import mixing_matrix
from dtx.strategies import StrategyError, make_strategy
from dtx.run.trainer import evaluate, train

STEPS = 6
BATCH = 64
P = 8
PARAM_TOL = dict(atol=1e-6, rtol=1e-5)
CONTRACTION_TOL = dict(rtol=1e-4)
# Every step averages its loss and accuracy (one float32 vector of 2) for the records: a psum the
# accountant counts too, 2(p−1) messages of ⌈2/p⌉ = 1 entry. Bytes and rounds below are the strategy's plus it.
METRICS_BYTES, METRICS_ROUNDS = 2 * (P - 1) * 4, 2 * (P - 1)


@pytest.fixture(scope="module")
def setup(mlp16):
    return mlp16(BATCH, 10)


def momentum():
    return optim.make_optimizer("momentum", 0.1, momentum=0.9)


def _check_replicas(state):
    """Replicated leaves identical on every device; per-worker leaves one entry per worker."""
    for leaf in jax.tree.leaves(state.replace(worker={})):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert leaf.sharding.is_fully_replicated and all(np.array_equal(shards[0], s) for s in shards[1:])
    for leaf in jax.tree.leaves(state.worker):
        assert leaf.shape[0] == P and not leaf.sharding.is_fully_replicated


def run(setup, strategy, tx, steps=STEPS, state=None):
    """Train ``steps`` steps; the host states after each step, the host metrics, the device state."""
    model, mesh = setup["model"], setup["mesh"]
    if state is None:
        state = init_train_state(model, tx, setup["example"], seed=0, mesh=mesh, per_worker=StepSpec(strategy=strategy))
    step = make_train_step(model, tx, mesh, StepSpec(strategy=strategy))
    states, records = [], []
    for s in range(steps):
        state, m = step(state, setup["batches"][s])
        records.append(jax.device_get(m))  # waits on each step (DESIGN.md §2)
        _check_replicas(state)
        states.append(jax.device_get(state))
    return states, records, state


@pytest.fixture(scope="module")
def sync_run(setup):
    return run(setup, strategies.sync(), momentum())[:2]


def _close(tree, reference, tol=PARAM_TOL):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(reference)):
        np.testing.assert_allclose(a, b, **tol, err_msg=jax.tree_util.keystr(path))


def _each_worker(tree):
    return [jax.tree.map(lambda x: x[i], tree) for i in range(P)]


def test_every_strategy_builds_from_the_default_config_block():
    """Each strategy takes some keys of config.strategy, every key is some strategy's, and each builds from
    the default block's values of the keys it takes."""
    block = config_lib.base_config().strategy
    declared = strategies.strategy_settings()
    assert sorted({k for keys in declared.values() for k in keys}) == sorted(k for k in block if k != "name")
    for name in strategies.STRATEGIES:
        assert make_strategy(name, **{k: block[k] for k in declared[name]}).name == name


def test_each_strategy_declares_its_factorys_signature():
    """The settings a strategy takes are its factory's parameters, with no ``**kwargs`` to swallow others;
    ``stragglers`` is what make_strategy supplies, not a setting."""
    for name, factory in strategies.STRATEGIES.items():
        parameters = inspect.signature(factory).parameters.values()
        assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in parameters), name
        assert strategies.strategy_settings()[name] == tuple(p.name for p in parameters if p.name != "stragglers")
    assert [n for n, f in strategies.STRATEGIES.items() if "stragglers" in inspect.signature(f).parameters] == [
        "backup"]


@pytest.mark.parametrize("name, settings, match", [
    ("sync", dict(period=4), r"strategy.period=4 applies to strategy.name=local_sgd, diloco, easgd or "
                             r"streaming_diloco only, not sync \(strategy 'sync' takes none\)"),
    ("ssp", dict(period=4), r"not ssp \(strategy 'ssp' takes: staleness\)"),
    ("local_sgd", dict(staleness=2), r"strategy.staleness=2 applies to strategy.name=async or ssp only, not "
                                     r"local_sgd \(strategy 'local_sgd' takes: period, sync_steps\)"),
    ("backup", dict(warmup_steps=5), r"strategy.warmup_steps=5 .* \(strategy 'backup' takes: backup_workers\)"),
])
def test_a_setting_the_strategy_does_not_take_is_refused(name, settings, match):
    with pytest.raises(StrategyError, match=match):
        make_strategy(name, **settings)


def test_a_config_setting_the_strategy_does_not_take_is_refused_at_load_time():
    base = config_lib.base_config()
    with pytest.raises(config_lib.ConfigError, match=r"strategy.period=4 applies to strategy.name=local_sgd.* not "
                                                     r"sync \(strategy 'sync' takes none\); leave strategy.period "
                                                     r"at its default 1"):
        config_lib.override(base, **{"strategy.period": 4})
    with pytest.raises(config_lib.ConfigError, match=r"strategy.mixing=\(0.5, 0.25, 0.25\) applies to "
                                                     r"strategy.name=gossip only, not ssp \(strategy 'ssp' takes: "
                                                     r"staleness\)"):
        config_lib.load("sync_strategies:ssp", ["--config.strategy.mixing=(0.5, 0.25, 0.25)"])
    with pytest.raises(config_lib.ConfigError, match=r"strategy.period=16 .* not sync"):
        config_lib.override(config_lib.load("sync_strategies:local_sgd"), **{"strategy.name": "sync"})
    # A key left at its default is no setting of anybody's; one the strategy takes is its own.
    assert config_lib.override(base, **{"strategy.name": "ssp", "strategy.period": 1}).strategy.name == "ssp"
    config_lib.load("sync_strategies:local_sgd", ["--config.strategy.period=64"])


def test_stragglers_go_only_to_a_factory_that_takes_them(monkeypatch):
    seen = {}

    def waits(stragglers=None):
        seen["stragglers"] = stragglers
        return strategies.sync()

    monkeypatch.setitem(strategies.STRATEGIES, "waits", waits)
    marker = strategies.stragglers.Stragglers()
    assert make_strategy("sync", stragglers=marker).name == "sync"  # sync() takes no stragglers
    make_strategy("waits", stragglers=marker)
    assert seen["stragglers"] is marker
    monkeypatch.setitem(strategies.STRATEGIES, "lazy", lambda **_: strategies.sync())
    with pytest.raises(TypeError, match=r"takes \*_: a plug-in's factory names each setting"):
        make_strategy("lazy")


@pytest.mark.parametrize("name", ["async", "ssp"])
def test_no_staleness_is_sync_bit_for_bit(setup, sync_run, name):
    states, records, _ = run(setup, make_strategy(name, staleness=0), momentum())
    reference, ref_records = sync_run
    for a, b in zip(jax.tree.leaves(states[-1].params), jax.tree.leaves(reference[-1].params)):
        np.testing.assert_array_equal(a, b)
    # And the same traffic: a sharded server's push + pull is the ring allreduce's bytes.
    assert [int(r["comm_bytes"]) for r in records] == [int(r["comm_bytes"]) for r in ref_records]


@pytest.mark.parametrize("name, settings", [
    ("local_sgd", dict(period=1)),
    ("gossip", dict(topology="complete", consensus_every=1)),
    ("diloco", dict(period=1, outer_learning_rate=1.0, outer_momentum=0.0)),
])
def test_special_case_is_sync(setup, sync_run, name, settings):
    states, records, _ = run(setup, make_strategy(name, **settings), momentum())
    reference = sync_run[0][-1]
    _close(states[-1].params, reference.params)
    for worker in _each_worker(states[-1].worker["strategy"]["params"]):
        _close(worker, reference.params)
    assert records[-1]["loss"] < records[0]["loss"]


def _reference(setup, tx, delay):
    """SGD on the host where worker ``i``'s gradient at step ``t`` is taken at ``θ_{t − delay(t, i)}``."""
    model = setup["model"]
    state = init_train_state(model, tx, setup["example"], seed=0, mesh=setup["mesh"])
    params = jax.device_get(state.params)
    opt_state = tx.init(params)
    grad = jax.jit(jax.grad(lambda p, x, y: cross_entropy(model.apply({"params": p}, x, train=True), y).mean()))
    history = [params]
    for t in range(STEPS):
        batch = jax.device_get(setup["batches"][t])
        xs, ys = np.split(batch["inputs"], P), np.split(batch["labels"], P)  # worker i holds block i
        grads = [grad(history[max(0, t - delay(t, i))], xs[i], ys[i]) for i in range(P)]
        mean = jax.tree.map(lambda *g: sum(g) / P, *grads)
        updates, opt_state = tx.update(mean, opt_state, params)
        params = optax.apply_updates(params, updates)
        history.append(params)
    return params


def test_async_with_fixed_delay_is_delayed_sgd(setup):
    tau = 2
    states, records, _ = run(setup, make_strategy("async", staleness=tau), momentum())
    _close(states[-1].params, _reference(setup, momentum(), lambda t, i: min(t, tau)))
    assert [float(r["staleness"]) for r in records] == [min(t, tau) for t in range(STEPS)]


def test_ssp_differentiates_a_cache_at_most_s_steps_old(setup):
    s = 2
    states, records, _ = run(setup, make_strategy("ssp", staleness=s), momentum())
    phase = [(i * (s + 1)) // P for i in range(P)]  # documented in dtx.strategies.ssp
    _close(states[-1].params, _reference(setup, momentum(), lambda t, i: (t + phase[i]) % (s + 1)))
    # Push every step, pull when the cache expires: (1 + fraction pulling) / 2 of push + pull.
    full = costmodel.dense_allreduce_traffic(states[0].params, P, "ring").bytes_sent
    for t, r in enumerate(records):
        pulling = sum((t + o) % (s + 1) == 0 for o in phase) / P
        assert float(r["comm_bytes"]) == pytest.approx(full * (1 + pulling) / 2 + METRICS_BYTES, rel=1e-6)
        assert 0 <= float(r["staleness"]) <= s


def test_async_random_delays_are_bounded_seeded_and_reproducible(setup):
    tau = 3
    strategy = make_strategy("async", staleness=tau, random_delay=True)
    first, records, _ = run(setup, strategy, momentum())
    again, _, _ = run(setup, strategy, momentum())
    stale = [float(r["staleness"]) for r in records]
    assert stale[0] == 0 and all(0 <= d <= min(t, tau) for t, d in enumerate(stale))
    assert any(d != min(t, tau) for t, d in enumerate(stale))  # drawn per worker, not the fixed bound
    for a, b in zip(jax.tree.leaves(first[-1]), jax.tree.leaves(again[-1])):
        np.testing.assert_array_equal(a, b)


def test_async_random_delays_are_uniform_over_the_whole_range():
    """Drawn per worker: every delay in ``[0, min(τ, t)]`` appears, the bound included, and none outside."""
    tau = 3
    draw = jax.jit(jax.vmap(lambda key, t: strategies.draw_delays(key, t, tau, P, True), in_axes=(0, None)))
    keys = jax.random.split(jax.random.key(0), 64)  # 64 steps' keys × 8 workers: 512 draws per step
    for t in (0, 1, 2, 5):
        drawn = np.asarray(draw(keys, t)).ravel()
        counts = np.bincount(drawn, minlength=min(t, tau) + 1)
        assert len(counts) == min(t, tau) + 1 and counts.min() > 0, (t, counts)
    np.testing.assert_array_equal(strategies.draw_delays(keys[0], 5, tau, P, False), [tau] * P)


def _allreduce_bytes(params):
    """``psum`` of every float32 leaf, by hand: the ring's 2(p−1) messages of ⌈e/p⌉ elements per leaf,
    in one op of 2(p−1) rounds (XLA combines the psums of one call)."""
    leaves = jax.tree.leaves(params)
    return (sum(2 * (P - 1) * -(-leaf.size // P) * 4 for leaf in leaves), 2 * (P - 1))


def test_post_local_sgd_averages_every_h_steps_and_pays_only_then(setup):
    strategy = make_strategy("local_sgd", period=3, sync_steps=2)
    states, records, device_state = run(setup, strategy, momentum())
    nbytes, rounds = _allreduce_bytes(states[0].params)
    averaged = [True, True, True, False, False, True]  # steps 1-2 synchronous, then every 3rd
    assert [int(r["comm_bytes"]) for r in records] == [nbytes * a + METRICS_BYTES for a in averaged]
    assert [int(r["comm_rounds"]) for r in records] == [rounds * a + METRICS_ROUNDS for a in averaged]
    for state, a in zip(states, averaged):
        workers = _each_worker(state.worker["strategy"]["params"])
        spread = max(float(np.max(np.abs(x - y))) for w in workers[1:]
                     for x, y in zip(jax.tree.leaves(w), jax.tree.leaves(workers[0])))
        assert (spread == 0) == a  # identical right after an average, apart in between
        if a:
            _close(workers[0], state.params, dict(atol=0, rtol=0))
    # The model evaluated is the workers' mean, also between averagings.
    mid = states[4]
    placed = lambda state: jax.device_put(state, jax.tree.map(lambda x: x.sharding, device_state))  # noqa: E731
    batches = eval_batches(setup["digits"].test, 120, setup["mesh"])
    local = evaluate(make_eval_step(setup["model"], setup["mesh"], StepSpec(strategy=strategy)), placed(mid), batches)
    mean = jax.tree.map(lambda x: x.mean(0), mid.worker["strategy"]["params"])
    expected = evaluate(make_eval_step(setup["model"], setup["mesh"]), placed(mid.replace(params=mean)), batches)
    assert local["test_loss"] == pytest.approx(expected["test_loss"], rel=1e-5)


def _with_workers(state, worker_params):
    """``state`` with each worker's local parameters replaced (host arrays, leading axis P)."""
    placed = jax.device_put(worker_params, jax.tree.map(lambda x: x.sharding, state.worker["strategy"]["params"]))
    return state.replace(worker={**state.worker, "strategy": {**state.worker["strategy"], "params": placed}})


def _consensus(worker_params):
    x = np.concatenate([np.asarray(leaf, np.float64).reshape(P, -1) for leaf in jax.tree.leaves(worker_params)], 1)
    return float(np.sqrt(np.mean(np.sum((x - x.mean(0)) ** 2, 1))))


def test_gossip_ring_sends_to_two_neighbours_every_step(setup):
    """No global average in the step: two neighbour messages, each every leaf packed in one buffer, and
    ``state.params`` stays the last consensus (here, with ``consensus_every = 0``, the initial parameters)."""
    states, records, device_state = run(setup, make_strategy("gossip", topology="ring"), momentum())
    leaves = jax.tree.leaves(states[0].params)
    mixing = 2 * sum(leaf.size * 4 for leaf in leaves)  # each leaf to both neighbours
    assert [int(r["comm_bytes"]) for r in records] == [mixing + METRICS_BYTES] * STEPS
    assert [int(r["comm_rounds"]) for r in records] == [2 + METRICS_ROUNDS] * STEPS
    assert "consensus_distance" not in records[0] and not jax.tree.leaves(states[-1].shared)
    assert records[-1]["loss"] < records[0]["loss"]
    initial = init_train_state(setup["model"], momentum(), setup["example"], seed=0, mesh=setup["mesh"]).params
    _close(states[-1].params, jax.device_get(initial), dict(atol=0, rtol=0))
    # The model evaluated is the workers' current mean, computed by the eval program.
    batches = eval_batches(setup["digits"].test, 120, setup["mesh"])
    strategy = make_strategy("gossip", topology="ring")
    got = evaluate(make_eval_step(setup["model"], setup["mesh"], StepSpec(strategy=strategy)), device_state, batches)
    mean = jax.tree.map(lambda x: x.mean(0), states[-1].worker["strategy"]["params"])
    placed = jax.device_put(states[-1].replace(params=mean), jax.tree.map(lambda x: x.sharding, device_state))
    expected = evaluate(make_eval_step(setup["model"], setup["mesh"]), placed, batches)
    assert got["test_loss"] == pytest.approx(expected["test_loss"], rel=1e-5)


def test_gossip_consensus_every_k_steps_averages_measures_and_pays_only_then(setup):
    k = 3
    states, records, _ = run(setup, make_strategy("gossip", topology="ring", consensus_every=k), momentum())
    leaves = jax.tree.leaves(states[0].params)
    mixing = 2 * sum(leaf.size * 4 for leaf in leaves) + METRICS_BYTES, 2 + METRICS_ROUNDS  # leaves packed
    average = _allreduce_bytes(states[0].params)
    distance = 2 * (P - 1) * 4, 2 * (P - 1)  # the ring allreduce of one float32 per worker
    # Before the first consensus: the initial parameters, and distance 0 (the workers start equal).
    last = jax.device_get(init_train_state(setup["model"], momentum(), setup["example"], seed=0,
                                           mesh=setup["mesh"]).params)
    measured = 0.0
    for t, (state, r) in enumerate(zip(states, records)):
        now = (t + 1) % k == 0
        assert int(r["comm_bytes"]) == mixing[0] + now * (average[0] + distance[0])
        assert int(r["comm_rounds"]) == mixing[1] + now * (average[1] + distance[1])
        workers = state.worker["strategy"]["params"]
        if now:  # x̄ after this step's mixing, and sqrt(mean_i ‖x_i − x̄‖²) of the same models
            _close(state.params, jax.tree.map(lambda x: x.mean(0), workers))
            assert float(r["consensus_distance"]) == pytest.approx(_consensus(workers), rel=1e-4)
            assert float(r["consensus_distance"]) > 0
            last, measured = state.params, float(r["consensus_distance"])
        else:  # in between: the last consensus, kept bit for bit
            _close(state.params, last, dict(atol=0, rtol=0))
            assert float(r["consensus_distance"]) == measured


@pytest.mark.parametrize("topology, weights", [
    ("ring", (1 / 3, 1 / 3, 1 / 3)), ("ring", (0.5, 0.3, 0.2)), ("exponential", ()), ("complete", ()),
])
def test_gossip_consensus_shrinks_by_the_spectral_gap(setup, topology, weights):
    """Zero gradients: one mixing step is ``X ← W X``; the disagreement shrinks by at most
    ``|λ₂(W)|``, and by exactly that along ``λ₂``'s eigenvector."""
    tx = optax.sgd(0.0)
    strategy = make_strategy("gossip", topology=topology, consensus_every=1,
                             **({"mixing": weights} if weights else {}))
    state = init_train_state(setup["model"], tx, setup["example"], seed=0, mesh=setup["mesh"],
                             per_worker=StepSpec(strategy=strategy))
    W = mixing_matrix(topology, weights, P)
    eigenvalues, eigenvectors = np.linalg.eig(W)
    order = np.argsort(-np.abs(eigenvalues))  # λ₁ = 1 (consensus) first
    lambda2 = np.abs(eigenvalues[order[1]])
    v = eigenvectors[:, order[1]]
    v = (v.real if np.linalg.norm(v.real) > 1e-3 else v.imag).astype(np.float32)
    rng = np.random.default_rng(0)
    base = jax.device_get(state.params)
    # Not donated: both disagreements start from ``state`` (jax 0.10 segfaults on a donated buffer here).
    step = make_train_step(setup["model"], tx, setup["mesh"], StepSpec(strategy=strategy, donate=False))
    for disagreement in ("random", "eigenvector"):
        offsets = jax.tree.map(lambda x: rng.normal(size=(P, *x.shape)).astype(np.float32), base)
        if disagreement == "eigenvector":
            offsets = jax.tree.map(lambda o: v.reshape(-1, *[1] * (o.ndim - 1)) * o[0], offsets)
        workers = jax.tree.map(lambda b, o: b + 0.1 * o, base, offsets)
        new, m = step(_with_workers(state, workers), setup["batches"][0])
        new = jax.device_get(new)
        mixed = jax.tree.map(lambda x: np.einsum("ij,j...->i...", W, np.asarray(x, np.float64)), workers)
        _close(new.worker["strategy"]["params"], mixed, dict(atol=1e-6, rtol=1e-5))  # W is what runs
        before, after = _consensus(workers), float(m["consensus_distance"])
        assert after == pytest.approx(_consensus(new.worker["strategy"]["params"]), rel=1e-4, abs=1e-6)
        if disagreement == "random":
            assert after <= lambda2 * before * (1 + 1e-4) + 1e-6
        else:
            assert after == pytest.approx(lambda2 * before, rel=CONTRACTION_TOL["rtol"], abs=1e-6)
    neighbours = {"ring": 2, "exponential": 1, "complete": P - 1}[topology]
    consensus = _allreduce_bytes(base)[0] + 2 * (P - 1) * 4  # the mean's and the distance's ring allreduces
    assert int(m["comm_bytes"]) == neighbours * costmodel.tree_nbytes(base) + consensus + METRICS_BYTES


METRICS_OPERAND = 8  # bytes: the loss and accuracy pmean (two float32 scalars), the only all-reduce a step must run


def _compiled_collectives(setup, strategy, allreduce="psum"):
    model, mesh, tx = setup["model"], setup["mesh"], momentum()
    state = init_train_state(model, tx, setup["example"], seed=0, mesh=mesh, per_worker=StepSpec(strategy=strategy))
    step = make_train_step(model, tx, mesh, StepSpec(strategy=strategy, allreduce=allreduce, donate=False))
    return hlo.collectives(step.lower(state, setup["batches"][0]).compile()), jax.tree.leaves(state.params)


@pytest.mark.parametrize("topology", ["ring", "exponential"])
def test_compiled_gossip_step_holds_only_the_neighbour_exchanges(setup, topology):
    found, leaves = _compiled_collectives(setup, make_strategy("gossip", topology=topology))
    # No all-reduce over parameters, anywhere in the program: only the metrics' few bytes.
    assert [c.operand_bytes for c in found if c.kind != "collective-permute"] == [METRICS_OPERAND]
    # Every ppermute carries all the parameters, packed, to a neighbour (ring: 2; exponential: 1 in each of
    # the ⌈lg p⌉ = 3 branches of its round switch): one latency per message, not per leaf.
    permutes = [c.operand_bytes for c in found if c.kind == "collective-permute"]
    assert permutes == [4 * sum(leaf.size for leaf in leaves)] * (2 if topology == "ring" else 3)


@pytest.mark.parametrize("allreduce", ["psum", "ring"])
def test_compiled_gossip_consensus_runs_in_a_branch(setup, allreduce):
    found, leaves = _compiled_collectives(setup, make_strategy("gossip", consensus_every=4), allreduce)
    entry = [c for c in found if c.context == "entry"]
    assert [c.operand_bytes for c in entry if c.kind == "all-reduce"] == [METRICS_OPERAND]
    assert [c.operand_bytes for c in entry if c.kind == "collective-permute"] == [
        4 * sum(leaf.size for leaf in leaves)] * 2  # the ring's two neighbours, every step, leaves packed
    consensus = [c for c in found if c.context == "conditional"]
    # The average of every parameter (and the distance's scalar) sits in the lax.cond branch.
    if allreduce == "psum":
        assert sum(c.operand_bytes for c in consensus if c.kind == "all-reduce") == 4 * sum(l.size for l in leaves) + 4
    else:  # dtx's ring: 2(p−1) ppermutes per leaf and for the scalar
        assert len(consensus) == 2 * (P - 1) * (len(leaves) + 1)
        assert {c.kind for c in consensus} == {"collective-permute"}


@pytest.mark.parametrize("name, allreduce", [("local_sgd", "psum"), ("local_sgd", "ring"), ("diloco", "psum"),
                                             ("easgd", "psum"), ("easgd", "halving_doubling")])
def test_compiled_averaging_strategies_communicate_parameters_only_in_their_branch(setup, name, allreduce):
    found, leaves = _compiled_collectives(setup, make_strategy(name, period=3), allreduce)
    outside = [(c.kind, c.operand_bytes) for c in found if c.context != "conditional"]
    assert outside == [("all-reduce", METRICS_OPERAND)]  # every step: the metrics, nothing else
    assert len(found) > 1  # and the parameters' allreduce is there, in the lax.cond branch


def test_easgd_center_converges_to_the_workers_mean_with_zero_gradients(setup):
    alpha, beta, period = 0.1, 0.5, 2
    tx = optax.sgd(0.0)
    strategy = make_strategy("easgd", period=period, rho=alpha, moving_rate=beta)
    state = init_train_state(setup["model"], tx, setup["example"], seed=0, mesh=setup["mesh"],
                             per_worker=StepSpec(strategy=strategy))
    base = jax.device_get(state.params)
    rng = np.random.default_rng(1)
    workers = jax.tree.map(lambda b: b + 0.1 * rng.normal(size=(P, *b.shape)).astype(np.float32), base)
    gap0 = jax.tree.map(lambda w, c: w.mean(0) - c, workers, base)
    fixed_point = jax.tree.map(lambda w, c: (beta * w.mean(0) + alpha * c) / (alpha + beta), workers, base)
    states, records, _ = run(setup, strategy, tx, steps=8, state=_with_workers(state, workers))
    nbytes, _ = _allreduce_bytes(base)
    for t, (s, r) in enumerate(zip(states, records)):
        exchanges = (t + 1) // period
        gap = jax.tree.map(lambda w, c: w.mean(0) - c, s.worker["strategy"]["params"], s.params)
        expected = jax.tree.map(lambda g: g * (1 - alpha - beta) ** exchanges, gap0)
        _close(gap, expected, dict(**CONTRACTION_TOL, atol=1e-6))
        assert int(r["comm_bytes"]) == nbytes * ((t + 1) % period == 0) + METRICS_BYTES
    # β·mean + α·center is conserved, so the center tends to the point it fixes.
    k = len(states) // period
    _close(states[-1].params, jax.tree.map(lambda f, g: f - beta / (alpha + beta) * (1 - alpha - beta) ** k * g,
                                           fixed_point, gap0), dict(rtol=1e-5, atol=1e-6))


def _host_sgd_parts(setup, tx):
    """For references computed on the host: the loss gradient (jax, one device), the parameters'
    tree structure and their initial values as float64 numpy leaves."""
    model = setup["model"]
    grad = jax.jit(jax.grad(lambda p, x, y: cross_entropy(model.apply({"params": p}, x, train=True), y).mean()))
    initial = init_train_state(model, tx, setup["example"], seed=0, mesh=setup["mesh"]).params
    return grad, jax.tree.structure(initial), [np.asarray(x, np.float64) for x in jax.tree.leaves(
        jax.device_get(initial))]


def _worker_grads(setup, grad, treedef, workers, t):
    """Each worker's gradient at its own parameters on its block of step ``t``'s batch (float64 leaves)."""
    batch = jax.device_get(setup["batches"][t])
    xs, ys = np.split(batch["inputs"], P), np.split(batch["labels"], P)
    return [[np.asarray(x, np.float64) for x in jax.tree.leaves(
        grad(jax.tree.unflatten(treedef, [x.astype(np.float32) for x in w]), xs[i], ys[i]))]
        for i, w in enumerate(workers)]


def test_diloco_outer_nesterov_step_matches_a_numpy_reference(setup):
    """Four outer rounds of DiLoCo against Algorithm 1 of Douillard et al. written out in numpy:
    inner SGD with momentum per worker on its own block of the batch, then the pseudo-gradient
    ``Δ = θ − mean_i θ_i``, Nesterov momentum ``m ← μm + Δ``, ``θ ← θ − η(Δ + μm)``, with
    ``η = 0.7 ≠ 1`` and ``μ = 0.9``; the workers restart from ``θ`` and keep their inner momentum.
    Plain momentum, no momentum or ``−Δ`` each move θ by far more than the tolerance."""
    H, rate, mu, lr, beta, steps = 2, 0.7, 0.9, 0.05, 0.5, 8
    tx = optax.sgd(lr, momentum=beta)
    strategy = make_strategy("diloco", period=H, outer_learning_rate=rate, outer_momentum=mu)
    states, _, _ = run(setup, strategy, tx, steps=steps)
    grad, treedef, theta = _host_sgd_parts(setup, tx)
    workers = [list(theta) for _ in range(P)]
    inner = [[np.zeros_like(x) for x in theta] for _ in range(P)]
    outer = [np.zeros_like(x) for x in theta]
    for t in range(steps):
        for i, g in enumerate(_worker_grads(setup, grad, treedef, workers, t)):
            inner[i] = [beta * v + gi for v, gi in zip(inner[i], g)]
            workers[i] = [x - lr * v for x, v in zip(workers[i], inner[i])]
        if (t + 1) % H == 0:
            delta = [th - np.mean([w[j] for w in workers], 0) for j, th in enumerate(theta)]
            outer = [mu * m + d for m, d in zip(outer, delta)]
            theta = [th - rate * (d + mu * m) for th, d, m in zip(theta, delta, outer)]
            workers = [list(theta) for _ in range(P)]
    _close(states[-1].params, jax.tree.unflatten(treedef, theta))
    for worker in _each_worker(states[-1].worker["strategy"]["params"]):
        _close(worker, jax.tree.unflatten(treedef, theta))
    _close(states[-1].shared["outer_opt_state"][0].trace, jax.tree.unflatten(treedef, outer))


def test_easgd_with_gradients_matches_a_numpy_reference(setup):
    """Three elastic exchanges with real gradients against eqs. 5–6 of Zhang et al. in numpy: both
    moves use the values *before* this step's update, ``x_i ← x_i − η∇f_i(x_i) − α(x_i − x̃)`` and
    ``x̃ ← x̃ + β·mean_i(x_i − x̃)`` (with zero gradients, before and after are the same)."""
    period, alpha, beta, lr, steps = 2, 0.2, 0.6, 0.5, 6
    tx = optax.sgd(lr)
    strategy = make_strategy("easgd", period=period, rho=alpha, moving_rate=beta)
    states, _, _ = run(setup, strategy, tx, steps=steps)
    grad, treedef, center = _host_sgd_parts(setup, tx)
    workers = [list(center) for _ in range(P)]
    for t in range(steps):
        g = _worker_grads(setup, grad, treedef, workers, t)
        if (t + 1) % period == 0:
            diffs = [[x - c for x, c in zip(w, center)] for w in workers]
            workers = [[x - lr * gi - alpha * d for x, gi, d in zip(w, gw, dw)] for w, gw, dw in zip(workers, g, diffs)]
            center = [c + beta * np.mean([dw[j] for dw in diffs], 0) for j, c in enumerate(center)]
        else:
            workers = [[x - lr * gi for x, gi in zip(w, gw)] for w, gw in zip(workers, g)]
    _close(states[-1].params, jax.tree.unflatten(treedef, center))
    for got, want in zip(_each_worker(states[-1].worker["strategy"]["params"]), workers):
        _close(got, jax.tree.unflatten(treedef, want))


def test_gossip_exponential_graph_reaches_exact_consensus_in_lg_p_steps(setup):
    """One peer ``2^(t mod 3)`` away per step, weights ½: after steps 0, 1, 2 every worker holds the
    mean of the 8 starting models (Assran et al. 2019), which no repetition of one round gives."""
    tx = optax.sgd(0.0)
    strategy = make_strategy("gossip", topology="exponential")
    state = init_train_state(setup["model"], tx, setup["example"], seed=0, mesh=setup["mesh"],
                             per_worker=StepSpec(strategy=strategy))
    base = jax.device_get(state.params)
    rng = np.random.default_rng(2)
    workers = jax.tree.map(lambda b: b + 0.1 * rng.normal(size=(P, *b.shape)).astype(np.float32), base)
    states, _, _ = run(setup, strategy, tx, steps=3, state=_with_workers(state, workers))
    mean = jax.tree.map(lambda w: np.broadcast_to(w.mean(0), w.shape), workers)
    assert _consensus(states[1].worker["strategy"]["params"]) > 0.1 * _consensus(workers)  # not yet after 2
    _close(states[-1].worker["strategy"]["params"], mean)


@pytest.mark.parametrize("name, settings, match", [
    ("hogwild", {}, r"strategy.name='hogwild' is unknown; choose one of \['async'"),
    ("local_sgd", dict(period=0), r"strategy.period=0 must be an integer >= 1 \(H local steps"),
    ("diloco", dict(period=-2), r"strategy.period=-2 must be an integer >= 1"),
    ("easgd", dict(period=1.5), r"strategy.period=1.5 must be an integer"),
    ("async", dict(staleness=-1), r"strategy.staleness=-1 must be an integer >= 0 \(tau"),
    ("ssp", dict(staleness=-3), r"strategy.staleness=-3 must be an integer >= 0 \(s, the staleness bound"),
    ("async", dict(random_delay="yes"), r"strategy.random_delay='yes' must be True or False"),
    ("local_sgd", dict(sync_steps=-1), r"strategy.sync_steps=-1 must be an integer >= 0"),
    ("gossip", dict(mixing=(0.5, 0.5, 0.5)), r"strategy.mixing=\(0.5, 0.5, 0.5\) must be 3 weights .* summing to 1"),
    ("gossip", dict(mixing=(1.2, -0.1, -0.1)), r"each >= 0"),
    ("gossip", dict(mixing=(0.5, 0.5)), r"must be 3 weights"),
    ("gossip", dict(topology="torus"), r"strategy.topology='torus' is unknown; choose one of \['ring'"),
    ("easgd", dict(rho=1.5), r"strategy.rho=1.5 must be in \[0, 1\]"),
    ("easgd", dict(moving_rate=-0.1), r"strategy.moving_rate=-0.1 must be in \[0, 1\]"),
    ("diloco", dict(outer_learning_rate=0.0), r"strategy.outer_learning_rate=0.0 must be in \(0, inf\]"),
    ("diloco", dict(outer_momentum=1.0), r"strategy.outer_momentum=1.0 must be in \[0, 1\)"),
    ("gossip", dict(consensus_every=-1), r"strategy.consensus_every=-1 must be an integer >= 0 \(steps between"),
    ("sync", dict(perod=2), r"unknown strategy setting\(s\) \['perod'\]"),
])
def test_bad_settings_are_refused_with_the_key_and_the_fix(name, settings, match):
    with pytest.raises(StrategyError, match=match):
        make_strategy(name, **settings)


def test_settings_of_other_strategies_are_refused_not_checked():
    """The block is shared: sync takes none of them, so they are refused as such, not range-checked."""
    with pytest.raises(StrategyError, match=r"strategy.mixing=\(2.0,\) applies to strategy.name=gossip only"):
        make_strategy("sync", period=0, mixing=(2.0,))


def test_train_refuses_a_bad_strategy_before_any_work(tmp_path):
    config = config_lib.override(config_lib.base_config(), **{"strategy.name": "local_sgd", "strategy.period": 0,
                                                               "num_steps": 2, "progress": False})
    with pytest.raises(StrategyError, match="strategy.period=0"):
        train(config, tmp_path)
    assert not (tmp_path / metrics.METRICS_FILE).exists()


@pytest.mark.parametrize("name, settings", [("diloco", {"strategy.period": 4}),
                                            ("gossip", {"strategy.consensus_every": 4})])
def test_local_models_resume_exactly_from_a_checkpoint(tmp_path, name, settings):
    """Local models, inner AdamW states, the outer momentum (diloco), the last consensus and its
    distance (gossip) are in the checkpoint: stopping mid-period and resuming equals the
    uninterrupted run bit for bit."""
    config = config_lib.override(config_lib.base_config(), **{
        "strategy.name": name, **settings, "optimizer.name": "adamw", "model.features": (16,),
        "global_batch_size": 64, "num_steps": 9, "log_every": 1, "progress": False})
    whole = train(config, tmp_path / "whole")
    first = config_lib.override(config, **{"num_steps": 6, "checkpoint.every_steps": 6})
    train(first, tmp_path / "resumed")  # stops at 6: mid-period, one outer step / consensus done, the next at 8
    resumed = train(config, tmp_path / "resumed")
    for a, b in zip(jax.tree.leaves(jax.device_get(whole.state)), jax.tree.leaves(jax.device_get(resumed.state))):
        np.testing.assert_array_equal(a, b)
    assert resumed.metrics == whole.metrics
    last = [metrics.read_metrics(tmp_path / d)[-2] for d in ("whole", "resumed")]
    assert last[0]["comm_bytes_per_step"] == last[1]["comm_bytes_per_step"] > 0


def _record_and_quiet(setup, strategy, model=None):
    """The step built with and without records (StepSpec.record), their compiled programs and a fresh state."""
    model, mesh, tx = model or setup["model"], setup["mesh"], momentum()
    state = init_train_state(model, tx, setup["example"], seed=0, mesh=mesh, per_worker=StepSpec(strategy=strategy))
    steps = [make_train_step(model, tx, mesh, StepSpec(strategy=strategy, donate=False, record=r)) for r in (True, False)]
    return steps, [step.lower(state, setup["batches"][0]).compile() for step in steps], state


def test_gossip_between_records_runs_only_its_neighbour_exchanges_and_counts_what_runs(setup):
    """No global barrier between records (Lian et al. 2017): the step built without records holds the ring's two
    ppermutes and nothing else, the record step adds the averages' one all-reduce. Each step's comm_bytes and
    comm_rounds are exactly what its compiled program runs (dtx.comm.hlo), so the clock charges what runs."""
    (loud, quiet), (loud_program, quiet_program), state = _record_and_quiet(setup, make_strategy("gossip"))
    assert {c.kind for c in hlo.collectives(quiet_program)} == {"collective-permute"}
    assert [c.operand_bytes for c in hlo.collectives(loud_program) if c.kind != "collective-permute"] == [
        METRICS_OPERAND]
    figures = []
    for step, program in ((loud, loud_program), (quiet, quiet_program)):
        _, m = jax.device_get(step(state, setup["batches"][0]))
        sent = hlo.total(program)
        assert (int(m["comm_bytes"]), int(m["comm_rounds"])) == (sent.bytes_sent, sent.rounds)
        figures.append((int(m["comm_bytes"]), int(m["comm_rounds"]), "loss" in m, "accuracy" in m))
    mixing = 2 * sum(leaf.size * 4 for leaf in jax.tree.leaves(state.params))
    assert figures == [(mixing + METRICS_BYTES, 2 + METRICS_ROUNDS, True, True), (mixing, 2, False, False)]


@pytest.mark.parametrize("name", ["local_sgd", "diloco", "easgd", "streaming_diloco"])
def test_averaging_strategies_between_records_communicate_only_in_their_branches(setup, name):
    (_, quiet), (loud_program, quiet_program), _ = _record_and_quiet(setup, make_strategy(name, period=3))
    assert [c for c in hlo.collectives(quiet_program) if c.context != "conditional"] == []
    assert [(c.kind, c.operand_bytes) for c in hlo.collectives(loud_program) if c.context != "conditional"] == [
        ("all-reduce", METRICS_OPERAND)]


def test_local_models_keep_their_own_batch_norm_statistics_and_evaluate_their_mean(setup):
    """With batch norm, a local-model worker normalises over its own batch and keeps its own running statistics
    (state.worker["model_state"]; the replicated model_state is empty, so nothing claims a replication that
    is not there): no train step, record or not, all-reduces them, and both give the same state bit for bit.
    The model evaluated uses the workers' mean statistics, what averaging them every step gave (running averages
    are linear in the batch statistics)."""
    model = models.build_model("lenet", conv_features=(4, 8), dense_features=(16,))
    mesh, strategy = setup["mesh"], make_strategy("local_sgd", period=2)
    (loud, quiet), programs, state = _record_and_quiet(setup, strategy, model)
    assert state.model_state == {} and all(leaf.shape[0] == P for leaf in jax.tree.leaves(state.worker["model_state"]))
    for program in programs:  # the statistics never travel: outside the averaging branch, the loss/accuracy only
        assert [c.operand_bytes for c in hlo.collectives(program) if c.context != "conditional"] in (
            [METRICS_OPERAND], [])
    first = jax.device_get(state)
    a = b = state
    for t in range(3):
        a, record = loud(a, setup["batches"][t])
        b, _ = quiet(b, setup["batches"][t])
        if t == 0:  # worker 0's statistics: one device's update on worker 0's rows alone (local normalisation)
            rows = jax.device_get(setup["batches"][0])["inputs"][:BATCH // P]
            own = jax.tree.map(lambda x: x[0], first.worker["model_state"])
            _, want = model.apply({"params": first.params, **own}, rows, train=True, mutable=["batch_stats"])
            _close(jax.tree.map(lambda x: x[0], jax.device_get(a.worker["model_state"])), want)
    for x, y in zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))):
        np.testing.assert_array_equal(x, y)
    stats = jax.device_get(a.worker["model_state"])
    assert not np.array_equal(*(jax.tree.leaves(stats)[0][:2]))  # two workers, two batches, two statistics
    batches = eval_batches(setup["digits"].test, 120, mesh)
    got = evaluate(make_eval_step(model, mesh, StepSpec(strategy=strategy)), a, batches)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    mean = jax.device_put(jax.tree.map(lambda x: x.mean(0), (stats, jax.device_get(a.worker["strategy"]["params"]))),
                          replicated)  # local SGD evaluates the workers' mean parameters too
    expected = evaluate(make_eval_step(model, mesh), a.replace(model_state=mean[0], params=mean[1]), batches)
    assert got["test_loss"] == pytest.approx(expected["test_loss"], rel=1e-5)
