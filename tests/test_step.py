"""The data-parallel contract: both drivers on 8 devices == 1 device with the same global batch.

Tolerances: float32 sums in a different order (per-device partial sums, then an
all-reduce) differ from one device's sum in the last bits; over 10 SGD-momentum
steps the measured gap is <= 1.2e-7 absolute on parameters. We hold parameters
to ``atol=1e-6, rtol=1e-5`` and batch statistics to ``atol=rtol=1e-5``.
SGD-momentum, not Adam: Adam divides by sqrt(v), which turns last-bit noise on
gradients that are zero in exact arithmetic (a conv bias before batch norm)
into full-size updates, so Adam runs are not comparable bit-wise by design.
"""

import jax
import numpy as np
import pytest

from dtx import models
from dtx import optim
from dtx import mesh as mesh_lib
from dtx.data import TrainLoader, eval_batches
from dtx.step.state import init_train_state
from dtx.step import StepSpec, make_eval_step, make_train_step
from dtx.run.trainer import evaluate

STEPS = 10
BATCH = 64
PARAM_TOL = dict(atol=1e-6, rtol=1e-5)
STATS_TOL = dict(atol=1e-5, rtol=1e-5)

MODELS = {
    "mlp": lambda: models.build_model("mlp", features=(64, 64)),
    "lenet": lambda: models.build_model("lenet", conv_features=(4, 8), dense_features=(32,)),
}


@pytest.fixture(scope="session")
def meshes():
    return {
        "1": mesh_lib.make_mesh([("data", 1)], devices=jax.devices()[:1]),
        "8": mesh_lib.make_mesh([("data", -1)]),
        "2x4": mesh_lib.make_mesh([("node", 2), ("local", 4)]),
    }


def _train(model, mesh, driver, dataset, steps=STEPS):
    tx = optim.make_optimizer("momentum", 0.1, momentum=0.9)
    example = jax.ShapeDtypeStruct(dataset.train.inputs.shape, dataset.train.inputs.dtype)
    state = init_train_state(model, tx, example, seed=0, mesh=mesh)
    step = make_train_step(model, tx, mesh, StepSpec(driver=driver))
    loader = TrainLoader(dataset.train, BATCH, mesh, seed=0)
    losses = []
    for s in range(steps):
        state, metrics = step(state, loader.batch(s))
        losses.append(float(metrics["loss"]))  # waits on each step (DESIGN.md §2)
    return jax.device_get(state), losses


@pytest.fixture(scope="session")
def runs(digits, meshes):
    """(model, mesh, driver) -> (final state, per-step losses); shared by the tests below."""
    cache = {}

    def get(model_name, mesh_name, driver):
        key = (model_name, mesh_name, driver)
        if key not in cache:
            cache[key] = _train(MODELS[model_name](), meshes[mesh_name], driver, digits)
        return cache[key]

    return get


def _assert_close(tree, reference, tol):
    for path, a, b in zip(
        jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(tree), jax.tree.leaves(reference)
    ):
        np.testing.assert_allclose(a, b, **tol, err_msg=jax.tree_util.keystr(path[0]))


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("driver", ["shard_map", "jit"])
def test_eight_devices_equal_one_device(runs, model_name, driver):
    reference, ref_losses = runs(model_name, "1", "jit")
    state, losses = runs(model_name, "8", driver)
    assert int(state.step) == STEPS
    _assert_close(state.params, reference.params, PARAM_TOL)
    _assert_close(state.model_state, reference.model_state, STATS_TOL)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # Training did something: a stale or zero gradient would also "agree".
    assert losses[-1] < losses[0] - 0.1


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_drivers_agree(runs, model_name):
    a, _ = runs(model_name, "8", "shard_map")
    b, _ = runs(model_name, "8", "jit")
    _assert_close(a.params, b.params, PARAM_TOL)
    _assert_close(a.model_state, b.model_state, STATS_TOL)


def test_one_device_shard_map_equals_jit(runs):
    a, _ = runs("mlp", "1", "shard_map")
    b, _ = runs("mlp", "1", "jit")
    _assert_close(a.params, b.params, PARAM_TOL)


def test_two_level_data_mesh_equals_one_device(runs):
    """A ("node", "local") mesh splits the batch over both axes and averages over both."""
    reference, _ = runs("mlp", "1", "jit")
    state, _ = runs("mlp", "2x4", "shard_map")
    _assert_close(state.params, reference.params, PARAM_TOL)


def test_gradient_is_averaged_not_summed(digits, meshes):
    """One plain-SGD step moves the parameters by the 1-device gradient, not 8 times it."""
    model = MODELS["mlp"]()
    tx = optim.make_optimizer("sgd", 1.0)
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    moves = {}
    for name in ("1", "8"):
        mesh = meshes[name]
        state = init_train_state(model, tx, example, seed=0, mesh=mesh)
        before = jax.device_get(state.params)
        state, _ = make_train_step(model, tx, mesh, StepSpec(driver="shard_map"))(
            state, TrainLoader(digits.train, BATCH, mesh, seed=0).batch(0)
        )
        moves[name] = jax.tree.map(lambda a, b: np.asarray(a) - b, jax.device_get(state.params), before)
    _assert_close(moves["8"], moves["1"], PARAM_TOL)


def test_state_stays_replicated_and_step_counts(runs, meshes, digits):
    model = MODELS["mlp"]()
    tx = optim.make_optimizer("momentum", 0.1)
    mesh = meshes["8"]
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    state = init_train_state(model, tx, example, seed=0, mesh=mesh)
    state, _ = make_train_step(model, tx, mesh, StepSpec(driver="shard_map"))(
        state, TrainLoader(digits.train, BATCH, mesh, seed=0).batch(0)
    )
    for leaf in jax.tree.leaves(state):
        assert leaf.sharding.is_fully_replicated
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert all(np.array_equal(shards[0], s) for s in shards[1:])  # identical replicas
    assert int(state.step) == 1


@pytest.mark.parametrize("driver", ["shard_map", "jit"])
def test_eval_is_exact_with_ragged_last_batch(runs, meshes, digits, driver):
    state, _ = runs("lenet", "8", "shard_map")
    model = MODELS["lenet"]()
    mesh = meshes["8"]
    test = digits.test
    batch_size = 64
    assert len(test) % batch_size, "the test split must not be a multiple of the batch"
    batches = eval_batches(test, batch_size, mesh)
    placed = jax.device_put(state, mesh_lib.replicated(mesh))
    result = evaluate(make_eval_step(model, mesh, StepSpec(driver=driver)), placed, batches)
    # Reference: the whole split at once, on the host's default device.
    logits = np.asarray(
        model.apply({"params": state.params, **state.model_state}, test.inputs, train=False), np.float64
    )
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    expected_loss = -log_probs[np.arange(len(test)), test.labels].mean()
    assert result["test_examples"] == len(test)
    assert result["test_accuracy"] == np.mean(logits.argmax(-1) == test.labels)
    assert result["test_loss"] == pytest.approx(expected_loss, rel=1e-5)


def test_unknown_driver(meshes):
    model = MODELS["mlp"]()
    with pytest.raises(ValueError, match="driver 'pmap'"):
        make_train_step(model, optim.make_optimizer("sgd", 0.1), meshes["8"], StepSpec(driver="pmap"))


@pytest.mark.parametrize("allreduce,reduce_dtype", [("psum", "float32"), ("ring", "float32"), ("psum", "bfloat16")])
def test_step_reports_the_bytes_its_allreduce_sends(digits, meshes, allreduce, reduce_dtype):
    """comm_bytes / comm_rounds: the accountant's count of the gradients' allreduce (psum: XLA's one
    combined op; ring: one ring per leaf) and of the step's averages (loss and accuracy, one float32
    vector), which ride in the psum or run as an all-reduce of their own."""
    from dtx.comm import costmodel
    from dtx import precision

    model = MODELS["mlp"]()
    tx = optim.make_optimizer("sgd", 0.1)
    mesh = meshes["8"]
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    state = init_train_state(model, tx, example, seed=0, mesh=mesh)
    policy = precision.parse_policy(f"params=float32,compute=float32,output=float32,reduce={reduce_dtype}")
    step = make_train_step(model, tx, mesh, StepSpec(driver="shard_map", allreduce=allreduce, policy=policy))
    _, metrics = step(state, TrainLoader(digits.train, BATCH, mesh, seed=0).batch(0))
    itemsize = 4 if reduce_dtype == "float32" else 2
    leaves = jax.tree.leaves(state.params)
    # Ring: 2(p-1) messages of ceil(n/p) elements per leaf; the averages: a ring of one float32 chunk.
    expected = sum(2 * 7 * -(-leaf.size // 8) * itemsize for leaf in leaves)
    averages = 2 * 7 * 4
    assert int(metrics["comm_bytes"]) == expected + averages
    assert int(metrics["comm_rounds"]) == (2 * 7 if allreduce == "psum" else 2 * 7 * len(leaves) + 2 * 7)
    assert expected == costmodel.dense_allreduce_traffic(state.params, 8, "ring", reduce_dtype).bytes_sent


def test_without_communication_each_worker_applies_its_own_gradient(digits, meshes):
    """The yardstick of `dtx bench step`: same step, no gradient collectives."""
    model = MODELS["mlp"]()
    tx = optim.make_optimizer("sgd", 1.0)
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    mesh, one = meshes["8"], meshes["1"]
    batch = TrainLoader(digits.train, BATCH, mesh, seed=0).batch(0)
    state = init_train_state(model, tx, example, seed=0, mesh=mesh)
    silent, _ = make_train_step(model, tx, mesh, StepSpec(driver="shard_map", communicate=False, donate=False))(state, batch)
    host_batch = jax.device_get(batch)
    rows = BATCH // 8
    single = make_train_step(model, tx, one, StepSpec(driver="shard_map", donate=False))
    for worker in (0, 5):
        local = {k: v[worker * rows:(worker + 1) * rows] for k, v in host_batch.items()}
        expected, _ = single(init_train_state(model, tx, example, seed=0, mesh=one),
                             jax.device_put(local, mesh_lib.batch_sharding(one)))
        mine = jax.tree.map(lambda x: np.asarray(x.addressable_shards[worker].data), silent.params)
        _assert_close(mine, jax.device_get(expected.params), PARAM_TOL)


def test_relaxed_strategies_and_compression_refuse_the_jit_driver(meshes):
    from dtx import compress, precision, strategies
    from dtx.step import StepError, check_combination

    local, topk = strategies.make_strategy("local_sgd", period=2), compress.make_compressor("topk")
    with pytest.raises(StepError, match=r"need driver='shard_map' \(--config.driver=shard_map"):
        check_combination("jit", local, compress.none(), precision.LossScaler())
    with pytest.raises(StepError, match=r"need driver='shard_map' \(--config.driver=shard_map"):
        check_combination("jit", strategies.sync(), topk, precision.LossScaler())
    with pytest.raises(StepError, match="compresses the gradient allreduce"):
        check_combination("shard_map", local, topk, precision.LossScaler())
    with pytest.raises(StepError, match="loss scaling"):
        check_combination("shard_map", local, compress.none(), precision.LossScaler(enabled=True))
