"""Every partitioning computes what the unsharded model computes (Hitchhiker's §3, Das et al. §3).

Tolerance: a sharded matmul sums its contraction in per-device partial sums plus
an all-reduce, so float32 results differ from one device's in the last bits; the
measured gap is < 1e-6 relative; we hold losses and gradients to rtol=1e-5,
atol=1e-6.
"""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from dtx import models
from dtx import mesh as mesh_lib
from dtx.data import TrainLoader
from dtx.parallel import PartitionError, get_layout, make_rules, param_specs, state_shardings
from dtx.step.state import abstract_train_state, init_train_state
from dtx.step import StepError, StepSpec, make_train_step
from dtx.data.tasks import cross_entropy
from numerics import sum_atol

TOL = dict(rtol=1e-5, atol=1e-6)
MESHES = {"8": [("data", 8)], "4x2": [("data", 4), ("model", 2)], "2x4": [("data", 2), ("model", 4)]}
CASES = [("data", "8"), ("fsdp", "8"), ("data", "4x2"), ("model", "4x2"), ("hybrid", "4x2"), ("fsdp", "4x2"),
         ("model", "2x4"), ("hybrid", "2x4"), ("fsdp", "2x4")]


@pytest.fixture(scope="module")
def lenet():
    # Widths divisible by 2 and 4 so every kernel can be split on both model meshes.
    return models.build_model("lenet", conv_features=(4, 8), dense_features=(32,), num_classes=12)


def _loss_and_grads(model, params, model_state, batch):
    def loss_fn(p):
        logits, _ = model.apply({"params": p, **model_state}, batch["inputs"], train=True, mutable=["batch_stats"])
        return cross_entropy(logits, batch["labels"]).mean()

    return jax.value_and_grad(loss_fn)(params)


@pytest.fixture(scope="module")
def reference(digits, lenet):
    mesh = mesh_lib.make_mesh([("data", 1)], devices=jax.devices()[:1])
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    state = jax.device_get(init_train_state(lenet, optax.sgd(0.1), example, 0, mesh))
    batch = jax.device_get(TrainLoader(digits.train, 64, mesh, seed=0).batch(0))
    return state, batch, jax.device_get(jax.jit(lambda p: _loss_and_grads(lenet, p, state.model_state, batch))(
        state.params))


@pytest.mark.parametrize("name,mesh_name", CASES)
def test_partitioned_loss_and_gradients_equal_unsharded(reference, lenet, name, mesh_name):
    state, batch, (ref_loss, ref_grads) = reference
    mesh = mesh_lib.make_mesh(MESHES[mesh_name])
    rules = make_rules(name, mesh, state.params)
    specs = param_specs(rules, state.params, mesh)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    params = jax.device_put(state.params, shardings)
    placed_batch = jax.device_put(batch, mesh_lib.batch_sharding(mesh))
    loss, grads = jax.jit(lambda p, b: _loss_and_grads(lenet, p, state.model_state, b),
                          out_shardings=(mesh_lib.replicated(mesh), shardings))(params, placed_batch)
    np.testing.assert_allclose(loss, ref_loss, **TOL)
    for path, g, r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads),
                          jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, **TOL, err_msg=jax.tree_util.keystr(path[0]))
    # The layout is what the partitioning says it is.
    kernels = {jax.tree_util.keystr(p, simple=True, separator="/"): leaf.sharding.spec
               for p, leaf in jax.tree_util.tree_leaves_with_path(params)}
    if name == "hybrid":
        assert kernels["Conv_0/kernel"] == PartitionSpec()  # convolutions data-parallel
        assert kernels["Dense_0/kernel"] == PartitionSpec(None, "model")  # FC model-parallel in the group
    if name == "model":
        assert kernels["Conv_0/kernel"] == PartitionSpec(None, None, None, "model")


@pytest.mark.parametrize("name,mesh_name", [("fsdp", "8"), ("hybrid", "4x2"), ("model", "2x4")])
def test_partitioned_training_step_equals_one_device(digits, lenet, name, mesh_name):
    """A whole jit-driver step (optimizer state sharded alike) == the 1-device step."""
    # SGD-momentum: its param-shaped trace exercises the optimizer-state sharding. (Adam would turn
    # last-bit noise on the conv biases, whose exact gradient under batch norm is 0, into full steps.)
    tx = optax.sgd(0.1, momentum=0.9)
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    results = {}
    for key, mesh in (("one", mesh_lib.make_mesh([("data", 1)], devices=jax.devices()[:1])),
                      ("sharded", mesh_lib.make_mesh(MESHES[mesh_name]))):
        abstract = abstract_train_state(lenet, tx, example)
        placement = get_layout(name if key == "sharded" else "data").place(abstract, mesh)
        state = init_train_state(lenet, tx, example, 0, mesh, shardings=placement.state)
        step = make_train_step(lenet, tx, mesh, StepSpec(driver="jit", placement=placement))
        loader = TrainLoader(digits.train, 64, mesh, seed=0)
        for s in range(3):
            state, metrics = step(state, loader.batch(s))
            jax.block_until_ready(metrics)
        results[key] = state
    for a, b in zip(jax.tree.leaves(results["sharded"].params), jax.tree.leaves(results["one"].params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # Optimizer moments live where their parameter lives.
    trace = results["sharded"].opt_state[0].trace
    for p, t in zip(jax.tree.leaves(results["sharded"].params), jax.tree.leaves(trace)):
        assert t.sharding.is_equivalent_to(p.sharding, p.ndim)


def test_fsdp_holds_one_eighth_of_the_parameters_per_device(digits):
    # Every leaf of this LeNet has a dimension divisible by 8, so each is split 8 ways.
    model = models.build_model("lenet", conv_features=(8, 16), dense_features=(64,), num_classes=16)
    mesh = mesh_lib.make_mesh(MESHES["8"])
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    tx = optax.adam(1e-3)
    abstract = abstract_train_state(model, tx, example)
    shardings = state_shardings(abstract, make_rules("fsdp", mesh, abstract.params), mesh)
    state = init_train_state(model, tx, example, 0, mesh, shardings=shardings)
    total = sum(p.size for p in jax.tree.leaves(state.params))
    for device in range(8):
        held = sum(p.addressable_shards[device].data.size for p in jax.tree.leaves(state.params))
        assert held * 8 == total
    for leaf in jax.tree.leaves(state.opt_state[0].mu):  # Adam's moments are split alike (ZeRO)
        assert {s.data.size for s in leaf.addressable_shards} == {leaf.size // 8}


def test_clear_errors(digits, lenet):
    mesh8 = mesh_lib.make_mesh(MESHES["8"])
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    params = abstract_train_state(lenet, optax.sgd(0.1), example).params
    for name in ("model", "hybrid"):
        with pytest.raises(PartitionError, match="needs a 'model' mesh axis"):
            make_rules(name, mesh8, params)
    with pytest.raises(PartitionError, match="unknown parallel.name 'megatron'"):
        make_rules("megatron", mesh8, params)
    with pytest.raises(PartitionError, match=r"Dense_1/kernel .* does not divide"):
        param_specs(make_rules("rules", mesh8, params, [("Dense_1/kernel", (None, "data"))]), params, mesh8)
    with pytest.raises(PartitionError, match="names axis 'model'"):
        param_specs(make_rules("rules", mesh8, params, [("kernel", (None, "model"))]), params, mesh8)
    # A layer whose width does not split over the group is refused, naming the layer and the fix.
    odd = abstract_train_state(models.build_model("lenet", conv_features=(4, 8), dense_features=(32,),
                                                  num_classes=10), optax.sgd(0.1), example).params
    with pytest.raises(PartitionError, match=r"layer 'Dense_1'.* 10 output features .* size 4.*\[1, 2\]"):
        make_rules("hybrid", mesh_lib.make_mesh(MESHES["2x4"]), odd)
    # A rule that names no parameter would silently run data parallel.
    with pytest.raises(PartitionError, match=r"'fc6/kernel'.* names no parameter"):
        make_rules("rules", mesh8, params, [("fc6/kernel", (None, "model"))])
    abstract = abstract_train_state(lenet, optax.sgd(0.1), example)
    placement = get_layout("fsdp").place(abstract, mesh8)
    with pytest.raises(StepError, match="driver=jit"):
        make_train_step(lenet, optax.sgd(0.1), mesh8, StepSpec(driver="shard_map", placement=placement))
    # A placement whose layout claims data parallelism but whose state is split is refused all the same.
    with pytest.raises(StepError, match="driver=jit"):
        make_train_step(lenet, optax.sgd(0.1), mesh8,
                        StepSpec(driver="shard_map", placement=placement._replace(layout=get_layout("data"))))


def test_explicit_rules_from_config_tuples(digits, lenet):
    mesh = mesh_lib.make_mesh(MESHES["4x2"])
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    params = abstract_train_state(lenet, optax.sgd(0.1), example).params
    rules = make_rules("rules", mesh, params, (("Dense_0/kernel", (None, "model")),))
    specs = param_specs(rules, params, mesh)
    assert specs["Dense_0"]["kernel"] == PartitionSpec(None, "model")
    assert specs["Conv_0"]["kernel"] == PartitionSpec()


# ------------------------------------------------------------------ ZeRO-1 / ZeRO-2 (Rajbhandari et al. 2020)

from dtx.comm import hlo  # noqa: E402
from dtx import optim  # noqa: E402
from dtx.ckpt.checkpoint import Checkpointer, abstract_target, state_digest  # noqa: E402

ZERO_MODEL = dict(features=(64, 32), num_classes=16)  # every kernel and bias divides by 8


def _zero_parts(name, mesh, tx, example):
    model = models.build_model("mlp", **ZERO_MODEL)
    abstract = abstract_train_state(model, tx, example)
    placement = get_layout(name).place(abstract, mesh)
    return model, abstract, placement.state, placement


ZERO_LR, ZERO_STEPS = 1e-2, 20


@pytest.fixture(scope="module")
def zero_runs(digits):
    """20 steps (2 micro-batches each) of data parallel, zero1 and zero2 under three optimizers."""
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    mesh = mesh_lib.make_mesh([("data", 8)])
    runs = {}
    for opt in ("momentum", "adam", "lamb"):
        tx = optim.make_optimizer(opt, ZERO_LR, momentum=0.9, weight_decay=1e-4 if opt == "lamb" else 0.0)
        for name in ("data", "zero1", "zero2"):
            model, abstract, shardings, placement = _zero_parts(name, mesh, tx, example)
            state = init_train_state(model, tx, example, 0, mesh, shardings=shardings)
            step = make_train_step(model, tx, mesh, StepSpec(driver="jit", accum_steps=2, placement=placement))
            loader = TrainLoader(digits.train, 64, mesh, seed=0)
            compiled = step.lower(state, loader.batch(0)).compile()
            for s in range(ZERO_STEPS):
                state, metrics = step(state, loader.batch(s))
                jax.block_until_ready(metrics)
            runs[opt, name] = (state, shardings, compiled)
    return runs


def _sensitivity(opt_state, params, lr: float, beta: float = 0.9) -> list:
    """Per parameter leaf ``(gradient scale, gain)`` from the data-parallel run's final optimizer state: how large the
    leaf's gradients are (the terms a reordered sum rounds at) and how much of a gradient's change one step carries
    into the parameters. Adam: ``sqrt`` of the largest second moment ``v``, and ``lr/(sqrt(v) + eps)`` per entry (its
    first moment's ``(1 − β1)`` summed back over later steps; ``v`` not bias-corrected, which overstates the late
    steps' gain about 7-fold at step 20 and covers the early steps' bias correction). SGD-momentum: the trace's
    largest entry times ``1 − β``, and ``lr/(1 − β)``."""
    is_state = lambda x: isinstance(x, (optax.ScaleByAdamState, optax.TraceState))  # noqa: E731
    for state in jax.tree.leaves(opt_state, is_leaf=is_state):
        if isinstance(state, optax.ScaleByAdamState):
            return [(float(np.sqrt(v.max())), lr / (np.sqrt(v) + 1e-8))
                    for v in (np.asarray(x, np.float64) for x in jax.tree.leaves(state.nu))]
        if isinstance(state, optax.TraceState):
            return [(float(np.abs(np.asarray(t, np.float64)).max()) * (1 - beta), lr / (1 - beta))
                    for t in jax.tree.leaves(state.trace)]
    raise AssertionError("no Adam or momentum state")


@pytest.mark.parametrize("opt", ["momentum", "adam", "lamb"])
@pytest.mark.parametrize("name", ["zero1", "zero2"])
def test_zero_trains_exactly_like_data_parallel(zero_runs, opt, name):
    """Elementwise optimizers: ZeRO-1 bit for bit (it accumulates and reduces as data parallelism does:
    each shard's micro-batches summed, then one reduction, dtx.step.accumulate). ZeRO-2 reduces each
    micro-batch's gradient and sums the reduced ones: the same sums in another order, whose rounding differs by
    tests/numerics.py's bound on a sum of 16 terms (8 shards × 2 micro-batches) at the scale of the leaf's
    gradients (``sqrt`` of its largest second moment). SGD-momentum passes that difference on at the learning rate
    (measured 1.6e-7 after 20 steps). Adam divides each entry's update by ``sqrt(v)``: an entry whose gradients are
    small beside its leaf's largest moves by the rounding times ``lr·(1 − β1)/(sqrt(v) + eps)`` each step, so each
    entry's bound is the 20 steps of that (read with ``v`` from the data-parallel run's final state), held in norm
    over each leaf (a ReLU that flips on one example moves a column past its entries' bounds). A fixed
    atol=1e-6, rtol=1e-5 held on AVX2 code (1.9e-6 at |w| = 0.17) and failed with XLA's SSE4.2 code (1.97e-6 at
    |w| = 0.034; 5.4e-6 at 0.17): a near-zero gradient's last bits, not a fault (one dropped micro-batch moves
    every entry by ~lr).
    LAMB's trust ratio needs each tensor's *global* norm; XLA sums the
    shards' squares in another order than one device sums the whole (measured 6e-8), so held to 1e-6 —
    a norm taken per shard would be off by the ratio sqrt(8) on every update (and fail by far)."""
    state, _, _ = zero_runs[opt, name]
    reference, _, _ = zero_runs[opt, "data"]
    pairs = list(zip(jax.tree.leaves(state.params), jax.tree.leaves(reference.params)))
    if opt == "lamb":
        for a, b in pairs:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    elif name == "zero2":
        for (a, b), (scale, gain) in zip(pairs, _sensitivity(reference.opt_state, reference.params, ZERO_LR)):
            # the gradient sum's rounding (16 terms at the leaf's gradient scale), carried by each of the 20 steps,
            # and the parameter's own last bit; in norm over the leaf: a hidden unit whose ReLU flips on one example
            # under another rounding moves its column past its entries' bounds (seen on SSE4.2 code: 13 of 4096
            # entries, one column, by up to 2.1x), while the leaf stays within
            bound = ZERO_STEPS * sum_atol(None, terms=8 * 2, scale=scale) * gain
            bound = bound + np.finfo(np.float32).eps * np.abs(np.asarray(b))
            assert np.linalg.norm(np.asarray(a, np.float64) - b) <= np.linalg.norm(bound), (
                np.linalg.norm(np.asarray(a, np.float64) - b), np.linalg.norm(bound))
    else:
        for a, b in pairs:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name", ["zero1", "zero2"])
def test_zero_keeps_one_eighth_of_the_optimizer_state_per_device(zero_runs, name):
    state, shardings, compiled = zero_runs["adam", name]
    data_state, _, data_compiled = zero_runs["adam", "data"]
    for leaf in jax.tree.leaves(state.opt_state):  # Adam's moments: 1/8 of every tensor on each device
        if leaf.ndim:
            assert {s.data.size for s in leaf.addressable_shards} == {leaf.size // 8}
    for leaf in jax.tree.leaves(state.params):  # the parameters stay whole
        assert leaf.sharding.is_fully_replicated
    # XLA's own accounting of the step's inputs: exactly the optimizer bytes a device no longer holds.
    saved = sum(leaf.nbytes - leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(state.opt_state))
    assert saved > 0
    assert (data_compiled.memory_analysis().argument_size_in_bytes
            - compiled.memory_analysis().argument_size_in_bytes) == saved
    # Each device updates its slice, then the new parameters are all-gathered (ZeRO's second collective).
    gathered = sum(c.operand_bytes * 8 for c in hlo.collectives(compiled) if c.kind == "all-gather")
    assert gathered == sum(leaf.nbytes for leaf in jax.tree.leaves(state.params))
    assert not any(c.kind == "all-gather" for c in hlo.collectives(data_compiled))


def test_zero_checkpoint_restores_onto_data_parallel_and_other_device_counts(zero_runs, digits, tmp_path):
    state, shardings, _ = zero_runs["adam", "zero2"]
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    tx = optim.make_optimizer("adam", 1e-2)
    checkpointer = Checkpointer(tmp_path, async_save=False)
    checkpointer.save(20, state, {})
    checkpointer.close()
    for name, devices in (("data", 8), ("zero2", 4), ("zero1", 1), ("fsdp", 8)):
        mesh = mesh_lib.make_mesh([("data", devices)], devices=jax.devices()[:devices])
        _, abstract, target_shardings, _ = _zero_parts(name, mesh, tx, example)
        restored, _ = Checkpointer(tmp_path).restore(20, abstract_target(abstract, target_shardings))
        assert state_digest(restored) == state_digest(state), (name, devices)
        mu = jax.tree.leaves(restored.opt_state)[1]
        assert mu.sharding.is_equivalent_to(jax.tree.leaves(target_shardings.opt_state)[1], mu.ndim)
