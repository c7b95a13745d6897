"""Mixed precision: the policy, its casts, loss scaling, and a float16 fault on one device of eight.

Semantics under test (DESIGN.md §4.4, Micikevicius et al. 2018):
  * a policy string parses to four dtypes; compute follows params, the rest default to float32;
  * casts touch floating leaves only;
  * a bfloat16 step multiplies in bfloat16 and keeps float32 master weights, under strict dtype promotion;
  * gradients travel in the policy's reduce dtype;
  * with dynamic loss scaling, a step whose gradients are non-finite on ANY device is skipped on
    EVERY device: parameters, optimizer state and model state bit-for-bit unchanged, scale halved.

Tolerances: the fault test compares bit for bit (a skipped step must not touch the state, and
the next clean step from the skipped state must equal the same step from the pre-fault state).
bf16 versus float32 end to end: both train 60 steps of the default experiment; their test
accuracies (360 examples) may differ by at most 0.02 — 7 examples — since bfloat16 has an
8-bit mantissa and the two runs round differently from the first step on.
"""

import dataclasses
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dtx import models
from dtx import config as config_lib
from dtx import optim
from dtx import mesh as mesh_lib
from dtx.precision import LossScaler, Policy, PrecisionError, all_finite, parse_policy, select_tree
from dtx.step.state import init_train_state
from dtx.step import StepSpec, make_train_step
from dtx.step.batchnorm import equations
from dtx.run.steplog import check_loss_scale
from dtx.run.trainer import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(REPO, "experiments", "digits_mlp.py")
F32, BF16, F16 = np.dtype("float32"), np.dtype(jnp.bfloat16), np.dtype("float16")
BATCH = 64
ROWS_PER_DEVICE = BATCH // 8
FAULTY_DEVICE = 3


# ---------------------------------------------------------------------------- parse_policy

@pytest.mark.parametrize("spec, expected", [
    ("params=float32,compute=bfloat16,output=float32", Policy(F32, BF16, F32, F32)),
    ("params=float32,compute=bfloat16,output=float32,reduce=bfloat16", Policy(F32, BF16, F32, BF16)),
    ("p=f32,c=bf16,o=f32", Policy(F32, BF16, F32, F32)),
    ("p=f32,c=f16,o=f32,r=f16", Policy(F32, F16, F32, F16)),
    ("c=fp16", Policy(F32, F16, F32, F32)),
    ("compute=half", Policy(F32, F16, F32, F32)),
    (" P = FP32 , C = BF16 ", Policy(F32, BF16, F32, F32)),  # case and spaces do not matter
    ("o=bf16,p=f32", Policy(F32, F32, BF16, F32)),  # any order
])
def test_parse_long_and_short_forms(spec, expected):
    assert parse_policy(spec) == expected


@pytest.mark.parametrize("spec, expected", [
    ("", Policy(F32, F32, F32, F32)),
    ("p=bf16", Policy(BF16, BF16, F32, F32)),  # compute follows params ...
    ("params=float16", Policy(F16, F16, F32, F32)),
    ("c=bf16", Policy(F32, BF16, F32, F32)),  # ... and params default to float32
    ("r=bf16", Policy(F32, F32, F32, BF16)),
])
def test_defaults(spec, expected):
    policy = parse_policy(spec)
    assert policy == expected
    assert all(isinstance(getattr(policy, f.name), np.dtype) for f in dataclasses.fields(policy))


@pytest.mark.parametrize("spec", ["", "p=f32,c=bf16", "c=f16,r=f16", "p=bf16,o=bf16", "r=bf16"])
def test_str_round_trips(spec):
    policy = parse_policy(spec)
    assert parse_policy(str(policy)) == policy
    assert str(policy).startswith("params=")


def test_str_is_the_long_form():
    assert str(parse_policy("p=f32,c=bf16,r=f16")) == "params=float32,compute=bfloat16,output=float32,reduce=float16"


@pytest.mark.parametrize("spec, bad_parts", [
    ("p=f32,x=bf16", ["'x=bf16'", "params|compute|output|reduce"]),  # unknown field
    ("weights=f32", ["'weights=f32'"]),
    ("c=f64", ["'f64'", "compute"]),  # unknown dtype
    ("p=f32,o=int8", ["'int8'", "output"]),
    ("p=f32,params=bf16", ["params is given twice"]),  # duplicated field, short and long
    ("c=bf16,c=bf16", ["compute is given twice"]),
    ("p=f32,bf16", ["'bf16'", "NAME=DTYPE"]),  # missing "="
    ("p:f32", ["'p:f32'", "NAME=DTYPE"]),
])
def test_parse_errors_name_the_bad_part(spec, bad_parts):
    with pytest.raises(PrecisionError) as error:
        parse_policy(spec)
    for part in bad_parts:
        assert part in str(error.value)
    assert repr(spec) in str(error.value)  # and the whole spec, for context


# ---------------------------------------------------------------------------- casts

def test_casts_touch_floating_leaves_only():
    tree = {"x": jnp.ones((2, 3), jnp.float32), "h": jnp.ones(3, jnp.float16),
            "labels": jnp.arange(4, dtype=jnp.int32), "mask": jnp.array([True, False]), "key": jnp.uint32(7)}
    policy = parse_policy("p=f32,c=bf16,o=f16,r=bf16")
    for cast, dtype in ((policy.cast_to_compute, BF16), (policy.cast_to_params, F32),
                        (policy.cast_to_output, F16), (policy.cast_to_reduce, BF16)):
        out = cast(tree)
        assert out["x"].dtype == dtype and out["h"].dtype == dtype
        assert out["labels"].dtype == jnp.int32 and out["mask"].dtype == jnp.bool_ and out["key"].dtype == jnp.uint32
        np.testing.assert_array_equal(out["labels"], tree["labels"])
        np.testing.assert_array_equal(out["mask"], tree["mask"])


@pytest.mark.parametrize("spec, needs", [
    ("p=f32,c=f32", False), ("p=f32,c=bf16", False), ("p=bf16", False), ("p=f32,c=bf16,r=bf16", False),
    ("p=f32,c=f16", True), ("p=f16", True), ("p=f32,c=bf16,r=f16", True),
])
def test_needs_loss_scaling_only_for_float16(spec, needs):
    assert parse_policy(spec).needs_loss_scaling is needs


@pytest.mark.parametrize("spec", ["p=f16,c=f32", "p=f32,c=f32,o=f16"])
def test_needs_loss_scaling_whenever_gradients_pass_through_float16(spec):
    """float16 master weights have float16 gradients (cotangents take the primal's dtype); float16
    logits get a float16 cotangent. Either underflows like float16 compute does, so needs scaling."""
    assert parse_policy(spec).needs_loss_scaling is True


# ---------------------------------------------------------------------------- shared setup

@pytest.fixture(scope="module")
def mesh8():
    return mesh_lib.make_mesh([("data", -1)])


@pytest.fixture(scope="module")
def mesh1():
    return mesh_lib.make_mesh([("data", 1)], devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def host_batch(digits):
    return {"inputs": digits.train.inputs[:BATCH].copy(), "labels": digits.train.labels[:BATCH].copy()}


def _tx():
    return optim.make_optimizer("momentum", 0.1, momentum=0.9)


@pytest.fixture(scope="module")
def host_state(digits, mesh1):
    """Initial state of the 64-32-10 MLP, on the host; placed afresh for each run (steps donate it).

    Initialised once for every policy below: float32 master weights are initialised the same
    whatever the compute dtype.
    """
    model = models.build_model("mlp", features=(32,))
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    return jax.device_get(init_train_state(model, _tx(), example, seed=0, mesh=mesh1))


def _abstract(tree, sharding):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


# ---------------------------------------------------------------------------- bfloat16 step

def test_bfloat16_step_multiplies_in_bfloat16_and_keeps_float32_masters(mesh8, host_state, host_batch):
    """Under strict dtype promotion (no silent up/down-casts anywhere in flax, optax or dtx), every
    matmul of the step — forward and backward — takes bfloat16 operands; the masters stay float32."""
    policy = parse_policy("p=f32,c=bf16,o=f32")
    model = models.build_model("mlp", features=(32,), dtype=policy.compute, param_dtype=policy.params)
    tx = _tx()
    state = jax.device_put(host_state, mesh_lib.replicated(mesh8))
    batch = jax.device_put(host_batch, mesh_lib.batch_sharding(mesh8))
    step = make_train_step(model, tx, mesh8, StepSpec(driver="shard_map", policy=policy, donate=False))
    with jax.numpy_dtype_promotion("strict"):
        new_state, metrics = step(state, batch)  # first call: traced and compiled under strict promotion
        jaxpr = jax.make_jaxpr(step)(state, batch)
    assert np.isfinite(float(metrics["loss"])) and metrics["loss"].dtype == jnp.float32
    for leaf in jax.tree.leaves(new_state.params) + jax.tree.leaves(new_state.opt_state):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert leaf.dtype == jnp.float32
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(state.params))]
    assert all(moved)  # the step really applied

    dots = [eqn for eqn in equations(jaxpr.jaxpr) if eqn.primitive.name == "dot_general"]
    # 2 Dense layers: 2 forward matmuls, and at least 2 backward (kernel gradients).
    assert len(dots) >= 4, [str(eqn) for eqn in dots]
    for eqn in dots:
        assert [v.aval.dtype for v in eqn.invars] == [BF16, BF16], str(eqn)
    # Among them the forward pass proper: this device's 8 rows times a kernel, flax's x @ W.
    kernels = {leaf.shape for leaf in jax.tree.leaves(state.params) if leaf.ndim == 2}
    forward = [eqn for eqn in dots if eqn.invars[0].aval.shape[0] == ROWS_PER_DEVICE
               and tuple(eqn.invars[1].aval.shape) in kernels
               and eqn.params["dimension_numbers"] == (((1,), (0,)), ((), ()))]
    assert len(forward) == 2, [str(eqn) for eqn in dots]


def _gradient_reductions(step, state, batch):
    params = {leaf.shape for leaf in jax.tree.leaves(state.params)}
    return [eqn for eqn in equations(jax.make_jaxpr(step)(state, batch).jaxpr)
            if eqn.primitive.name.startswith(("psum", "pmean", "all_reduce"))
            and tuple(eqn.invars[0].aval.shape) in params]


@pytest.mark.parametrize("spec, wire", [("p=f32,c=f32,r=bf16", BF16), ("p=f32,c=f32", F32)])
def test_gradients_travel_in_the_reduce_dtype(mesh8, digits, spec, wire):
    """shard_map driver: the gradient all-reduce (psum) operates on the reduce dtype; the
    reduced gradients come back as float32 and the new parameters stay float32. (Traced only.)"""
    policy = parse_policy(spec)
    model = models.build_model("mlp", features=(32,))
    tx = _tx()
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    state = _abstract(jax.eval_shape(lambda: init_train_state(model, tx, example, 0, mesh8)),
                      mesh_lib.replicated(mesh8))
    sharded = mesh_lib.batch_sharding(mesh8)
    batch = {"inputs": jax.ShapeDtypeStruct((BATCH, 8, 8, 1), jnp.float32, sharding=sharded),
             "labels": jax.ShapeDtypeStruct((BATCH,), jnp.int32, sharding=sharded)}
    step = make_train_step(model, tx, mesh8, StepSpec(driver="shard_map", policy=policy))
    reductions = _gradient_reductions(step, state, batch)
    reduced = [v.aval for eqn in reductions for v in eqn.invars]
    assert len(reduced) == len(jax.tree.leaves(state.params)), reduced  # every gradient leaf, once
    assert {aval.dtype for aval in reduced} == {wire}
    new_state, _ = jax.eval_shape(step, state, batch)
    assert {leaf.dtype for leaf in jax.tree.leaves(new_state.params)} == {F32}


# ---------------------------------------------------------------------------- LossScaler

@pytest.fixture(scope="module")
def scaler():
    return LossScaler(enabled=True, initial_scale=8.0, growth_interval=3, backoff=0.5, min_scale=2.0)


def _run(scaler, verdicts):
    """States after each update with the given finiteness verdicts (one compiled update)."""
    update = jax.jit(scaler.update)
    state, states = scaler.init(), []
    for finite in verdicts:
        state = update(state, jnp.bool_(finite))
        states.append(jax.device_get(state))
    return states


def _triple(state):
    return float(state.scale), int(state.good_steps), int(state.skipped_steps)


def test_loss_scale_grows_after_growth_interval_finite_steps(scaler):
    states = _run(scaler, [True] * 7)
    assert [_triple(s) for s in states] == [
        (8.0, 1, 0), (8.0, 2, 0), (16.0, 0, 0),  # third finite step: x2 (1 / backoff), counter reset
        (16.0, 1, 0), (16.0, 2, 0), (32.0, 0, 0), (32.0, 1, 0),
    ]
    assert all(s.scale.dtype == np.float32 and s.good_steps.dtype == np.int32
               and s.skipped_steps.dtype == np.int32 for s in states)


def test_loss_scale_backs_off_clamps_and_counts_skips(scaler):
    states = _run(scaler, [True, True, False, False, False, False, True, True, True])
    assert [_triple(s) for s in states] == [
        (8.0, 1, 0), (8.0, 2, 0),
        (4.0, 0, 1),  # overflow: x backoff, the good-step counter restarts
        (2.0, 0, 2),
        (2.0, 0, 3), (2.0, 0, 4),  # clamped at min_scale, still counted as skipped
        (2.0, 1, 4), (2.0, 2, 4), (4.0, 0, 4),  # grows again after growth_interval finite steps
    ]


def test_growth_factor_is_one_over_backoff():
    states = _run(LossScaler(enabled=True, initial_scale=4.0, growth_interval=1, backoff=0.25), [True, False])
    assert [_triple(s) for s in states] == [(16.0, 0, 0), (4.0, 0, 1)]


def test_scale_and_unscale(scaler):
    state = scaler.init()
    assert _triple(state) == (8.0, 0, 0)
    assert float(scaler.scale_loss(state, jnp.float32(1.5))) == 12.0
    grads = {"w": jnp.asarray([8.0, -24.0], jnp.float32), "h": jnp.asarray([4.0], jnp.float16)}
    unscaled = scaler.unscale(state, grads)
    np.testing.assert_array_equal(unscaled["w"], [1.0, -3.0])
    assert unscaled["h"].dtype == jnp.float16 and float(unscaled["h"][0]) == 0.5


def test_disabled_scaler_is_inert():
    scaler = LossScaler()
    state = scaler.init()
    assert _triple(state) == (1.0, 0, 0)
    loss = jnp.float32(2.5)
    assert scaler.scale_loss(state, loss) is loss
    grads = {"w": jnp.ones(2)}
    assert scaler.unscale(state, grads) is grads
    assert scaler.update(state, jnp.bool_(False)) is state  # never skips, never counts


@pytest.mark.parametrize("kwargs, message", [
    (dict(initial_scale=0.5, min_scale=1.0), r"need initial_scale >= min_scale > 0, got 0\.5, 1\.0"),
    (dict(initial_scale=8.0, min_scale=0.0), r"need initial_scale >= min_scale > 0, got 8\.0, 0\.0"),
    (dict(backoff=1.0), r"loss_scale\.backoff=1\.0 must be in \(0, 1\)"),
    (dict(backoff=0.0), r"loss_scale\.backoff=0\.0 must be in \(0, 1\)"),
    (dict(backoff=2.0), r"loss_scale\.backoff=2\.0 must be in \(0, 1\)"),
    (dict(growth_interval=0), r"loss_scale\.growth_interval=0 must be >= 1"),
])
def test_loss_scaler_validation(kwargs, message):
    with pytest.raises(PrecisionError, match=message):
        LossScaler(enabled=True, **kwargs)
    LossScaler(enabled=False, **kwargs)  # a disabled scaler's settings are never used


def test_all_finite_and_select_tree():
    assert bool(all_finite({"a": jnp.ones(3), "n": jnp.arange(3)}))
    assert not bool(all_finite({"a": jnp.ones(3), "b": jnp.asarray([1.0, jnp.inf])}))
    assert not bool(all_finite({"a": jnp.asarray([jnp.nan], jnp.float16)}))
    assert bool(all_finite({"n": jnp.arange(3)}))  # no floating leaves: nothing can overflow
    a, b = {"x": jnp.ones(2)}, {"x": jnp.zeros(2)}
    np.testing.assert_array_equal(select_tree(jnp.bool_(False), a, b)["x"], [0.0, 0.0])
    np.testing.assert_array_equal(select_tree(jnp.bool_(True), a, b)["x"], [1.0, 1.0])


# ---------------------------------------------------------------------------- the fault test

F16_POLICY = "p=f32,c=f16,o=f32"
FAULT_SCALER = LossScaler(enabled=True, initial_scale=2.0**10, growth_interval=1000, backoff=0.5, min_scale=1.0)


@pytest.fixture(scope="module")
def f16_setup(host_state):
    """float16-compute model (float32 masters) and its initial state, with the fault test's loss scale."""
    policy = parse_policy(F16_POLICY)
    model = models.build_model("mlp", features=(32,), dtype=policy.compute, param_dtype=policy.params)
    return policy, model, host_state.replace(loss_scale=jax.device_get(FAULT_SCALER.init()))


@pytest.fixture(scope="module")
def faulty_batch(host_batch, mesh8):
    """The batch with inf in exactly the rows device 3 holds, and nowhere else."""
    inputs = host_batch["inputs"].copy()
    inputs[FAULTY_DEVICE * ROWS_PER_DEVICE:(FAULTY_DEVICE + 1) * ROWS_PER_DEVICE] = np.inf
    batch = jax.device_put({"inputs": inputs, "labels": host_batch["labels"]}, mesh_lib.batch_sharding(mesh8))
    holding = [shard for shard in batch["inputs"].addressable_shards if np.isinf(np.asarray(shard.data)).any()]
    assert len(holding) == 1, "exactly one device must see the fault"
    assert holding[0].index[0] == slice(FAULTY_DEVICE * ROWS_PER_DEVICE, (FAULTY_DEVICE + 1) * ROWS_PER_DEVICE)
    assert holding[0].device == mesh8.devices.flat[FAULTY_DEVICE]
    return batch


def _assert_bitwise_equal(tree, reference, what):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(reference)):
        assert np.asarray(a).dtype == np.asarray(b).dtype
        assert np.array_equal(np.asarray(a), np.asarray(b)), f"{what}{jax.tree_util.keystr(path)} changed"


def _assert_replicas_identical(state):
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert len(shards) == 8
        assert all(np.array_equal(shards[0], s, equal_nan=True) for s in shards[1:]), jax.tree_util.keystr(path)


@pytest.mark.parametrize("driver", ["shard_map", "jit"])
def test_overflow_on_one_device_skips_the_step_on_every_device(f16_setup, faulty_batch, host_batch, mesh8, driver):
    policy, model, before = f16_setup
    step = make_train_step(model, _tx(), mesh8, StepSpec(driver=driver, policy=policy, loss_scaler=FAULT_SCALER))
    replicated = mesh_lib.replicated(mesh8)

    state, metrics = step(jax.device_put(before, replicated), faulty_batch)
    jax.block_until_ready(state)
    _assert_replicas_identical(state)
    after, metrics = jax.device_get((state, metrics))
    _assert_bitwise_equal(after.params, before.params, "params")
    _assert_bitwise_equal(after.opt_state, before.opt_state, "opt_state")
    _assert_bitwise_equal(after.model_state, before.model_state, "model_state")
    assert int(after.step) == int(before.step) + 1  # a skipped step still counts as a step
    assert float(after.loss_scale.scale) == 2.0**9  # halved
    assert int(after.loss_scale.skipped_steps) == 1 and int(after.loss_scale.good_steps) == 0
    assert int(metrics["skipped"]) == 1 and int(metrics["skipped_steps"]) == 1
    assert float(metrics["loss_scale"]) == 2.0**10  # the scale this step used

    # The next clean step applies normally: exactly the step the pre-fault state would take
    # with the halved scale (the skipped step left no trace but the scale and the counters).
    clean = jax.device_put(host_batch, mesh_lib.batch_sharding(mesh8))
    state, metrics = step(state, clean)
    reference, _ = step(jax.device_put(before.replace(loss_scale=after.loss_scale), replicated), clean)
    jax.block_until_ready((state, reference))
    _assert_replicas_identical(state)
    state, metrics, reference = jax.device_get((state, metrics, reference))
    assert int(metrics["skipped"]) == 0 and float(metrics["loss_scale"]) == 2.0**9
    assert int(state.loss_scale.skipped_steps) == 1 and int(state.loss_scale.good_steps) == 1
    assert int(state.step) == int(before.step) + 2
    _assert_bitwise_equal(state.params, reference.params, "params")
    _assert_bitwise_equal(state.opt_state, reference.opt_state, "opt_state")
    for new, old in zip(jax.tree.leaves(state.params), jax.tree.leaves(before.params)):
        assert np.all(np.isfinite(new)) and not np.array_equal(new, old)


@pytest.mark.parametrize("driver", ["shard_map", "jit"])
def test_without_loss_scaling_the_fault_poisons_the_parameters(f16_setup, faulty_batch, mesh8, driver):
    """Negative control: the same batch, no scaler: the inf reaches every replica's parameters."""
    policy, model, before = f16_setup
    step = make_train_step(model, _tx(), mesh8, StepSpec(driver=driver, policy=policy, loss_scaler=LossScaler()))
    state, _ = step(jax.device_put(before, mesh_lib.replicated(mesh8)), faulty_batch)
    for shard in range(8):
        replica = [np.asarray(leaf.addressable_shards[shard].data) for leaf in jax.tree.leaves(state.params)]
        assert any(np.isnan(leaf).any() for leaf in replica), f"replica {shard} escaped the fault"


# ---------------------------------------------------------------------------- train level

def test_train_stops_when_the_minimum_scale_overflows(tmp_path):
    """A diverging run with dynamic loss scaling (learning rate 1e30: step 1 is finite, step 2
    overflows) and min_scale == initial scale: the first overflow is at the minimum, so training
    stops loudly. (The config has no proper way to inject non-finite *data*; divergence gives
    non-finite gradients. float32 compute: the check is the same, and compiles faster than float16.)"""
    config = config_lib.load(DEFAULT, [
        "--config.num_steps=6", "--config.model.features=(32,)", "--config.progress=False",
        "--config.loss_scale.name=dynamic",
        "--config.loss_scale.initial=1024.0", "--config.loss_scale.min_scale=1024.0",
        "--config.optimizer.name=sgd", "--config.optimizer.learning_rate=1e30",
    ])
    with pytest.raises(FloatingPointError, match=r"loss_scale\.min_scale=1024\.0"):
        train(config, tmp_path)


@pytest.mark.parametrize("skipped, scale, raises", [(1, 1.0, True), (1, 0.5, True), (1, 2.0, False), (0, 1.0, False)])
def test_check_loss_scale(skipped, scale, raises):
    scaler = LossScaler(enabled=True, initial_scale=4.0, min_scale=1.0)
    metrics = {"skipped": np.int32(skipped), "loss_scale": np.float32(scale)}
    if raises:
        with pytest.raises(FloatingPointError, match=r"step 7: .*loss_scale\.min_scale=1\.0"):
            check_loss_scale(7, metrics, scaler)
    else:
        check_loss_scale(7, metrics, scaler)


def test_bfloat16_trains_as_well_as_float32(tmp_path):
    """The default experiment, 60 steps, float32 versus bfloat16 compute: same accuracy within 0.02."""
    accuracy = {}
    for precision in ("p=f32,c=f32", "p=f32,c=bf16"):
        config = config_lib.load(DEFAULT, [f"--config.precision={precision}", "--config.progress=False",
                                           "--config.num_steps=60"])
        result = train(config, tmp_path / precision.replace(",", "_").replace("=", ""))
        assert {leaf.dtype for leaf in jax.tree.leaves(result.state.params)} == {jnp.dtype("float32")}
        accuracy[precision] = result.metrics["test_accuracy"]
    assert accuracy["p=f32,c=f32"] >= 0.9, accuracy  # both really trained, so the comparison means something
    assert abs(accuracy["p=f32,c=bf16"] - accuracy["p=f32,c=f32"]) <= 0.02, accuracy


def test_a_skipped_step_leaves_a_strategys_delay_buffer_alone(f16_setup, faulty_batch, digits, mesh8):
    """Async SGD keeps the last τ parameters in ``state.shared``: a skipped float16 step must not
    push the (unchanged) parameters into it, or later gradients would see the wrong staleness."""
    from dtx.strategies import make_strategy

    policy, model, _ = f16_setup
    strategy = make_strategy("async", staleness=2)
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    state = init_train_state(model, _tx(), example, seed=0, mesh=mesh8, loss_scaler=FAULT_SCALER,
                             per_worker=StepSpec(strategy=strategy))
    state = state.replace(shared=jax.tree.map(lambda x: x + 1.0, state.shared))  # distinct from the params
    assert jax.tree.leaves(state.shared), "async with staleness 2 keeps a delay buffer"
    before = jax.device_get(state)
    step = make_train_step(model, _tx(), mesh8, StepSpec(policy=policy, loss_scaler=FAULT_SCALER, strategy=strategy))
    after, metrics = jax.device_get(step(state, faulty_batch))
    assert int(metrics["skipped"]) == 1
    _assert_bitwise_equal(after.shared, before.shared, "shared")
    _assert_bitwise_equal(after.params, before.params, "params")


# ---------------------------------------------------------------------------- an overflow compression would hide

PROBE_ENTRIES, PROBE_FAULT = 1000, 637  # the probe's vector, and the one entry that overflows on one worker


class _Probe(nn.Module):
    """Logits from 16 input features, plus ``x · w`` on logit 0 with ``w = 0``: the forward pass ignores
    the other inputs, but ``w``'s gradient is ``inputs × dlogit₀``, so a large (finite) input in one
    column on one worker overflows float16 in exactly one gradient entry of that worker."""

    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train=False):
        x = x.reshape(x.shape[0], -1).astype(self.dtype)
        w = self.param("w", nn.initializers.zeros, (x.shape[-1],), jnp.float32)
        logits = nn.Dense(10, dtype=self.dtype)(x[:, :16])
        return logits.at[:, 0].add(x @ w.astype(self.dtype))


HIDING = {  # every compressor, error feedback on and off where it has it; DGC's settings too
    "none": dict(name="none"), "cast_bf16": dict(name="cast"), "cast_f16": dict(name="cast", dtype="float16"),
    "topk": dict(name="topk"), "topk_no_ef": dict(name="topk", error_feedback=False),
    "topk_dgc": dict(name="topk", momentum=0.9, clip_norm=1.0, warmup_steps=2),
    "randomk": dict(name="randomk"), "randomk_no_ef": dict(name="randomk", error_feedback=False),
    "sign": dict(name="sign"), "sign_no_ef": dict(name="sign", error_feedback=False),
    "terngrad": dict(name="terngrad"), "qsgd": dict(name="qsgd"),
    "powersgd": dict(name="powersgd", rank=2), "powersgd_no_ef": dict(name="powersgd", rank=2, error_feedback=False),
}


@pytest.fixture(scope="module")
def probe(mesh8):
    """The float16 probe, a clean batch and the same batch with one overflowing input column on worker 3."""
    policy = parse_policy("p=f32,c=f16")
    rng = np.random.default_rng(7)
    inputs = rng.normal(size=(BATCH, PROBE_ENTRIES)).astype(np.float32)
    labels = rng.integers(0, 10, BATCH).astype(np.int32)
    faulty = inputs.copy()
    faulty[FAULTY_DEVICE * ROWS_PER_DEVICE:(FAULTY_DEVICE + 1) * ROWS_PER_DEVICE, PROBE_FAULT] = 6e4  # < 65504
    place = lambda x: jax.device_put({"inputs": x, "labels": labels}, mesh_lib.batch_sharding(mesh8))  # noqa: E731
    return policy, _Probe(dtype=policy.compute), place(inputs), place(faulty)


@pytest.mark.parametrize("name", list(HIDING))
def test_an_overflow_the_compressor_does_not_send_still_skips_the_step(probe, mesh8, name):
    """One float16 overflow in one gradient entry of worker 3. Random-k at 1% leaves that entry out of
    the average (it used to be judged finite there), top-k sends it; whatever the compressor, every
    worker's own flag is combined before compression, so every worker skips: parameters, optimizer
    state and the per-worker compressor state (residuals, DGC momentum, PowerSGD's Q) bit-unchanged,
    the loss scale halved."""
    from dtx import compress

    policy, model, clean, faulty = probe
    settings = dict(HIDING[name])
    compressor = compress.make_compressor(settings.pop("name"), **settings)
    tx = optim.make_optimizer("sgd", 0.1)
    example = jax.ShapeDtypeStruct(clean["inputs"].shape, jnp.float32)
    state = init_train_state(model, tx, example, seed=0, mesh=mesh8, loss_scaler=FAULT_SCALER,
                             per_worker=StepSpec(compressor=compressor))
    step = make_train_step(model, tx, mesh8, StepSpec(policy=policy, loss_scaler=FAULT_SCALER, compressor=compressor, donate=False))
    # Two clean steps first, so that residuals, momenta and factors are not all zeros.
    for _ in range(2):
        state, metrics = step(state, clean)
        assert int(metrics["skipped"]) == 0, "the clean batch must not overflow"
    before = jax.device_get(state)
    after, metrics = step(state, faulty)
    jax.block_until_ready(after)
    _assert_replicas_identical(after.replace(worker={}))  # every worker took the same decision
    after, metrics = jax.device_get((after, metrics))
    assert int(metrics["skipped"]) == 1 and int(after.loss_scale.skipped_steps) == 1
    assert float(after.loss_scale.scale) == float(before.loss_scale.scale) / 2  # backed off
    _assert_bitwise_equal(after.params, before.params, "params")
    _assert_bitwise_equal(after.opt_state, before.opt_state, "opt_state")
    _assert_bitwise_equal(after.worker, before.worker, "worker")  # every worker's slice
    kept = jax.tree.leaves(before.worker)  # none for none, cast, TernGrad and QSGD
    assert not kept or any(np.any(np.asarray(x) != 0) for x in kept), "the clean steps left state to keep"


def test_a_float16_sum_can_overflow_where_no_worker_did(probe, mesh8):
    """reduce=float16: every worker's gradient entry is ~2e4, finite, but their float16 sum (XLA:CPU
    sums float16 all-reduces in float16) is not. The workers' flags all say finite, so the verdict
    also needs the reduced gradient: the step is skipped."""
    _, model, clean, _ = probe
    policy = parse_policy("p=f32,c=f16,r=f16")
    inputs = np.asarray(jax.device_get(clean["inputs"])).copy()
    inputs[:, PROBE_FAULT] = 200.0  # on every row: 200 × Σ (p₀ − y₀) · 2¹⁰/8 ≈ 2e4 per worker, all one sign
    batch = jax.device_put({"inputs": inputs, "labels": np.ones(BATCH, np.int32)}, mesh_lib.batch_sharding(mesh8))
    tx = optim.make_optimizer("sgd", 0.1)
    example = jax.ShapeDtypeStruct(inputs.shape, jnp.float32)
    state = init_train_state(model, tx, example, seed=0, mesh=mesh8, loss_scaler=FAULT_SCALER)
    step = make_train_step(model, tx, mesh8, StepSpec(policy=policy, loss_scaler=FAULT_SCALER, donate=False))
    grads = jax.jit(jax.grad(lambda p, x: FAULT_SCALER.init().scale * optim_loss(model, p, x, 1)))
    for worker in range(8):  # each worker's own (scaled) entry: finite in float16, and large
        rows = slice(worker * ROWS_PER_DEVICE, (worker + 1) * ROWS_PER_DEVICE)
        entry = float(grads(state.params, inputs[rows])["w"][PROBE_FAULT])
        assert 8192 < abs(entry) < 65504 / 2, entry
    after, metrics = jax.device_get(step(state, batch))
    assert int(metrics["skipped"]) == 1
    _assert_bitwise_equal(after.params, jax.device_get(state.params), "params")


def optim_loss(model, params, inputs, label):
    """One worker's mean cross-entropy, as the step computes it (float16 compute, float32 loss)."""
    from dtx.data.tasks import cross_entropy

    logits = model.apply({"params": params}, inputs)
    return cross_entropy(logits, np.full(len(inputs), label, np.int32)).mean()
