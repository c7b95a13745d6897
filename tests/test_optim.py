"""Tests for dtx.optim: optimizers, masks, trust ratios, schedules and scaling rules.

Semantics under test (DESIGN.md §4.3): every optimizer is the optax one, except that
parameters whose path matches ``exclude`` (default: biases and normalisation
scales/offsets) get neither weight decay nor a LARS/LAMB trust ratio; trust ratios
are norms of the *global* tensor, whatever its sharding.

Tolerances: comparisons with optax's own optimizers run the same float32 ops in
the same order, so they are held to ``rtol=1e-6, atol=1e-7`` (a couple of ulps, for
XLA fusing differently). Hand-computed float64 references go through ~10 float32
roundings (adam moments, bias corrections, sqrt, two norms), held to
``rtol=1e-5, atol=1e-8``. Schedule values are float32 numbers of order 0.1:
``rtol=1e-5, atol=1e-7``. The sharded-versus-unsharded trust ratio sums the squares
of a 1024-element tensor in a different order (8 partial sums, then an
all-reduce): a few float32 ulps, held to ``rtol=1e-5, atol=1e-7``.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from dtx import models
from dtx import mesh as mesh_lib
from dtx.optim import (
    DEFAULT_EXCLUDE, OPTIMIZERS, SCALING_RULES, SCHEDULES, OptimizerError, make_optimizer, make_schedule, path_mask,
    scaled_learning_rate,
)

PARAMS = {
    "dense": {"kernel": jnp.asarray([[0.5, -1.0], [2.0, 0.25], [-0.75, 1.5]]), "bias": jnp.asarray([0.1, -0.2])},
    "scale": jnp.asarray(1.5),
}
GRADS = {
    "dense": {"kernel": jnp.asarray([[0.3, -0.2], [0.1, 0.4], [-0.5, 0.6]]), "bias": jnp.asarray([0.05, -0.3])},
    "scale": jnp.asarray(-0.7),
}
MATCH_NOTHING = "$^"  # a regex no path matches: every leaf gets decay and trust ratio, as in plain optax
OPTAX_TOL = dict(rtol=1e-6, atol=1e-7)
HAND_TOL = dict(rtol=1e-5, atol=1e-8)
SCHEDULE_TOL = dict(rtol=1e-5, atol=1e-7)
SHARDED_TOL = dict(rtol=1e-5, atol=1e-7)


def _step(tx, params, grads, state=None):
    state = tx.init(params) if state is None else state
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), updates, state


def _leaves(tree):
    return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


def _np(tree):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


# ------------------------------------------------------------- optimizers

def test_names():
    assert OPTIMIZERS == ("sgd", "momentum", "nesterov", "adam", "adamw", "lars", "lamb")
    assert SCHEDULES == ("constant", "cosine", "polynomial", "step")
    assert SCALING_RULES == ("none", "linear", "sqrt")
    assert DEFAULT_EXCLUDE == r"(^|/)(bias|scale)$"


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_takes_a_descent_step(name):
    tx = make_optimizer(name, 0.01)
    assert isinstance(tx, optax.GradientTransformation)
    new, updates, _ = jax.jit(lambda p, g: _step(tx, p, g))(PARAMS, GRADS)
    assert jax.tree.structure(new) == jax.tree.structure(PARAMS)
    for old_leaf, new_leaf in zip(jax.tree.leaves(PARAMS), jax.tree.leaves(new)):
        assert new_leaf.shape == old_leaf.shape and new_leaf.dtype == old_leaf.dtype
        assert np.all(np.asarray(new_leaf) != np.asarray(old_leaf))  # every entry moved
    # The first step goes downhill: the update points against the gradient.
    inner = sum(float(np.sum(u * g)) for u, g in zip(_leaves(updates), _leaves(GRADS)))
    assert inner < 0


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_accepts_a_schedule(name):
    # Warmup from 0: the first update is exactly zero, later ones are not.
    tx = make_optimizer(name, make_schedule("constant", 0.01, total_steps=10, warmup_steps=2))

    @jax.jit
    def two_steps(params, grads):
        first, updates0, state = _step(tx, params, grads)
        _, updates1, _ = _step(tx, first, grads, state)
        return updates0, updates1

    updates0, updates1 = two_steps(PARAMS, GRADS)
    for leaf in _leaves(updates0):
        np.testing.assert_array_equal(leaf, np.zeros_like(leaf))
    assert all(np.all(leaf != 0) for leaf in _leaves(updates1))


def test_sgd_equals_optax_sgd_exactly():
    ours, theirs = make_optimizer("sgd", 0.1), optax.sgd(0.1)
    p1, p2, s1, s2 = PARAMS, PARAMS, ours.init(PARAMS), theirs.init(PARAMS)
    for _ in range(3):
        p1, u1, s1 = _step(ours, p1, GRADS, s1)
        p2, u2, s2 = _step(theirs, p2, GRADS, s2)
        for a, b in zip(_leaves(u1), _leaves(u2)):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(_leaves(p1), _leaves(p2)):
        np.testing.assert_array_equal(a, b)
    # Plain SGD: update = -lr * grad.
    _, updates, _ = _step(ours, PARAMS, GRADS)
    for u, g in zip(_leaves(updates), _leaves(GRADS)):
        np.testing.assert_array_equal(u, np.asarray(-0.1 * g, np.float32))


def _two_steps(*txs, params=PARAMS, grads=GRADS):
    """Parameters after two steps of each optimizer in ``txs``, from the same start, in one compiled call."""

    @jax.jit
    def run(params, grads):
        finals = []
        for tx in txs:
            p, state = params, tx.init(params)
            for _ in range(2):
                p, _, state = _step(tx, p, grads, state)
            finals.append(p)
        return finals

    return run(params, grads)


@pytest.mark.parametrize(
    "name, reference",
    [
        ("momentum", lambda: optax.sgd(0.1, momentum=0.8)),
        ("nesterov", lambda: optax.sgd(0.1, momentum=0.8, nesterov=True)),
        ("adam", lambda: optax.adam(0.1, b1=0.8)),
    ],
)
def test_named_optimizers_are_the_optax_ones(name, reference):
    p1, p2 = _two_steps(make_optimizer(name, 0.1, momentum=0.8), reference())
    for a, b in zip(_leaves(p1), _leaves(p2)):
        np.testing.assert_allclose(a, b, **OPTAX_TOL)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_lamb_without_exclusions_is_optax_lamb(weight_decay):
    """With an ``exclude`` that matches nothing, our LAMB is optax.lamb (eps=1e-6, b2=0.999) on every leaf."""
    ours = make_optimizer("lamb", 0.1, momentum=0.8, weight_decay=weight_decay, exclude=MATCH_NOTHING)
    p1, p2 = _two_steps(ours, optax.lamb(0.1, b1=0.8, b2=0.999, eps=1e-6, weight_decay=weight_decay))
    for a, b in zip(_leaves(p1), _leaves(p2)):
        np.testing.assert_allclose(a, b, **OPTAX_TOL)


def test_lamb_default_is_lamb_on_kernels_and_adam_on_excluded_leaves():
    """Default exclude: the kernel follows optax.lamb; bias and scale follow plain Adam (no decay, no ratio)."""
    lamb_params, reference_lamb, reference_adam = _two_steps(
        make_optimizer("lamb", 0.1, momentum=0.8, weight_decay=0.01),
        optax.lamb(0.1, b1=0.8, eps=1e-6, weight_decay=0.01),
        optax.adam(0.1, b1=0.8, b2=0.999, eps=1e-6),
    )
    np.testing.assert_allclose(lamb_params["dense"]["kernel"], reference_lamb["dense"]["kernel"], **OPTAX_TOL)
    np.testing.assert_allclose(lamb_params["dense"]["bias"], reference_adam["dense"]["bias"], **OPTAX_TOL)
    np.testing.assert_allclose(lamb_params["scale"], reference_adam["scale"], **OPTAX_TOL)
    # ... and that is a real difference: optax.lamb would have moved the bias elsewhere.
    assert not np.allclose(lamb_params["dense"]["bias"], reference_lamb["dense"]["bias"], rtol=1e-3)


def test_lars_without_exclusions_is_optax_lars():
    ours = make_optimizer("lars", 0.1, momentum=0.8, weight_decay=0.01, exclude=MATCH_NOTHING,
                          trust_coefficient=0.02)
    theirs = optax.lars(0.1, weight_decay=0.01, trust_coefficient=0.02, momentum=0.8)
    p1, p2 = _two_steps(ours, theirs)
    for a, b in zip(_leaves(p1), _leaves(p2)):
        np.testing.assert_allclose(a, b, **OPTAX_TOL)


# ------------------------------------------------------- weight decay masks

def test_sgd_weight_decay_is_l2_on_the_gradient_of_unmasked_leaves():
    tx = make_optimizer("sgd", 0.1, weight_decay=0.5)
    _, updates, _ = jax.jit(lambda p, g: _step(tx, p, g))(PARAMS, GRADS)
    g, p, u = _np(GRADS), _np(PARAMS), _np(updates)
    np.testing.assert_allclose(u["dense"]["kernel"], -0.1 * (g["dense"]["kernel"] + 0.5 * p["dense"]["kernel"]),
                               **HAND_TOL)
    # Biases and scales: plain SGD, no L2 term.
    np.testing.assert_allclose(u["dense"]["bias"], -0.1 * g["dense"]["bias"], **HAND_TOL)
    np.testing.assert_allclose(u["scale"], -0.1 * g["scale"], **HAND_TOL)


def test_adamw_weight_decay_is_decoupled_and_masked():
    # With zero gradients Adam's part is zero; only the decay -lr * wd * p remains, on kernels only.
    zeros = jax.tree.map(jnp.zeros_like, GRADS)
    tx = make_optimizer("adamw", 0.1, weight_decay=0.5)
    _, updates, _ = jax.jit(lambda p, g: _step(tx, p, g))(PARAMS, zeros)
    np.testing.assert_allclose(updates["dense"]["kernel"], -0.1 * 0.5 * _np(PARAMS)["dense"]["kernel"], **HAND_TOL)
    np.testing.assert_array_equal(updates["dense"]["bias"], np.zeros(2, np.float32))
    np.testing.assert_array_equal(updates["scale"], np.float32(0))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_weight_decay_skips_masked_leaves(name):
    """Zero gradient, positive weight decay: excluded leaves do not move at all; kernels shrink."""
    zeros = jax.tree.map(jnp.zeros_like, GRADS)
    tx = make_optimizer(name, 0.1, weight_decay=0.5)
    _, updates, _ = jax.jit(lambda p, g: _step(tx, p, g))(PARAMS, zeros)
    np.testing.assert_array_equal(updates["dense"]["bias"], np.zeros(2, np.float32))
    np.testing.assert_array_equal(updates["scale"], np.float32(0))
    kernel, update = np.asarray(PARAMS["dense"]["kernel"]), np.asarray(updates["dense"]["kernel"])
    assert np.all(update * kernel < 0)  # decay pulls every kernel entry towards zero


# --------------------------------------------------------------------- masks

@pytest.fixture(scope="module")
def lenet_params():
    """LeNet's parameter tree (conv, batch norm, dense), as shapes: a mask needs only the paths."""
    model = models.build_model("lenet")
    init = lambda rng, x: model.init(rng, x, train=False)  # noqa: E731
    return jax.eval_shape(init, jax.random.key(0), jnp.zeros((1, 8, 8, 1)))["params"]


def _flat(tree):
    return {jax.tree_util.keystr(path, simple=True, separator="/"): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def test_default_mask_on_a_real_flax_tree(lenet_params):
    mask = _flat(path_mask(DEFAULT_EXCLUDE)(lenet_params))
    assert set(mask) == set(_flat(lenet_params))
    expected_false = {"BatchNorm_0/scale", "BatchNorm_0/bias", "BatchNorm_1/scale", "BatchNorm_1/bias",
                      "Conv_0/bias", "Conv_1/bias", "Dense_0/bias", "Dense_1/bias", "Dense_2/bias"}
    expected_true = {"Conv_0/kernel", "Conv_1/kernel", "Dense_0/kernel", "Dense_1/kernel", "Dense_2/kernel"}
    assert {k for k, v in mask.items() if v is False} == expected_false
    assert {k for k, v in mask.items() if v is True} == expected_true
    # The full variables dict (paths start with "params/") is masked the same way.
    full = _flat(path_mask(DEFAULT_EXCLUDE)({"params": lenet_params}))
    assert {k.removeprefix("params/"): v for k, v in full.items()} == mask


def test_custom_exclude_regex(lenet_params):
    mask = _flat(path_mask(r"^(Conv_\d+|BatchNorm_\d+)/")(lenet_params))
    assert {k for k, v in mask.items() if v} == {"Dense_0/kernel", "Dense_0/bias", "Dense_1/kernel",
                                                 "Dense_1/bias", "Dense_2/kernel", "Dense_2/bias"}
    assert all(jax.tree.leaves(path_mask(MATCH_NOTHING)(lenet_params)))
    assert not any(jax.tree.leaves(path_mask("")(lenet_params)))  # the empty regex matches every path


@pytest.mark.parametrize("call", [lambda: path_mask("(bias"), lambda: make_optimizer("lamb", 0.1, exclude="[scale")])
def test_invalid_exclude_regex(call):
    with pytest.raises(OptimizerError, match=r"optimizer\.exclude=.* is not a valid regular expression"):
        call()


# --------------------------------------------------------- LARS / LAMB by hand

def test_lars_trust_ratio_on_kernels_only_by_hand():
    lr, wd, eta = 0.1, 0.01, 0.001
    tx = make_optimizer("lars", lr, momentum=0.9, weight_decay=wd, trust_coefficient=eta)
    _, updates, _ = jax.jit(lambda p, g: _step(tx, p, g))(PARAMS, GRADS)
    p, g, u = _np(PARAMS), _np(GRADS), _np(updates)
    # Kernel (You et al. 2017, eq. 6): d = g + wd*p; ratio = eta*|p|/|d|; first momentum step = the update itself.
    d = g["dense"]["kernel"] + wd * p["dense"]["kernel"]
    ratio = eta * np.linalg.norm(p["dense"]["kernel"]) / np.linalg.norm(d)
    assert abs(ratio - 1) > 0.5  # so "scaled" and "not scaled" are far apart
    np.testing.assert_allclose(u["dense"]["kernel"], -lr * ratio * d, **HAND_TOL)
    # Bias and scale: neither decay nor trust ratio: plain -lr * g.
    np.testing.assert_allclose(u["dense"]["bias"], -lr * g["dense"]["bias"], **HAND_TOL)
    np.testing.assert_allclose(u["scale"], -lr * g["scale"], **HAND_TOL)


def test_lamb_trust_ratio_on_kernels_only_by_hand():
    lr, wd, eps = 0.1, 0.01, 1e-6
    tx = make_optimizer("lamb", lr, momentum=0.8, weight_decay=wd)
    _, updates, _ = jax.jit(lambda p, g: _step(tx, p, g))(PARAMS, GRADS)
    p, g, u = _np(PARAMS), _np(GRADS), _np(updates)
    adam = jax.tree.map(lambda x: x / (np.abs(x) + eps), g)  # first bias-corrected Adam step: m/sqrt(v) = g/|g|
    d = adam["dense"]["kernel"] + wd * p["dense"]["kernel"]
    ratio = np.linalg.norm(p["dense"]["kernel"]) / np.linalg.norm(d)  # You et al. 2019, LAMB's phi = identity
    assert abs(ratio - 1) > 0.1
    np.testing.assert_allclose(u["dense"]["kernel"], -lr * ratio * d, **HAND_TOL)
    np.testing.assert_allclose(u["dense"]["bias"], -lr * adam["dense"]["bias"], **HAND_TOL)
    np.testing.assert_allclose(u["scale"], -lr * adam["scale"], **HAND_TOL)


def test_trust_ratio_uses_the_global_tensor_under_sharding():
    """A kernel split row-wise over 8 devices gets the LARS/LAMB trust ratio of the whole tensor, not of a shard."""
    mesh = mesh_lib.make_mesh([("data", -1)])
    keys = jax.random.split(jax.random.key(42), 4)
    params = {"kernel": jax.random.normal(keys[0], (64, 16)), "bias": 0.1 * jax.random.normal(keys[1], (16,))}
    grads = {"kernel": jax.random.normal(keys[2], (64, 16)), "bias": jax.random.normal(keys[3], (16,))}
    txs = [make_optimizer(name, 0.1, weight_decay=1e-2) for name in ("lars", "lamb")]

    def two_steps(params, grads):  # both optimizers in one compiled call (fewer compilations)
        updates = []
        for tx in txs:
            _, u1, state = _step(tx, params, grads)
            _, u2, _ = _step(tx, params, jax.tree.map(lambda x: -0.5 * x, grads), state)
            updates += [u1, u2]
        return updates

    cpu0 = jax.devices()[0]
    expected = jax.jit(two_steps)(*jax.device_put((params, grads), cpu0))
    rows = NamedSharding(mesh, PartitionSpec("data"))
    whole = NamedSharding(mesh, PartitionSpec())
    sharded_params, sharded_grads = (
        {"kernel": jax.device_put(t["kernel"], rows), "bias": jax.device_put(t["bias"], whole)} for t in (params, grads)
    )
    assert sharded_params["kernel"].addressable_shards[0].data.shape == (8, 16)  # really split
    got = jax.jit(two_steps)(sharded_params, sharded_grads)
    for a, b in zip(_leaves(got), _leaves(expected)):
        np.testing.assert_allclose(a, b, **SHARDED_TOL)
    # A per-shard ratio would differ from the global one by far more than the tolerance.
    shard = np.asarray(params["kernel"])[:8]
    shard_ratio = np.linalg.norm(shard) / np.linalg.norm(np.asarray(grads["kernel"])[:8])
    global_ratio = np.linalg.norm(params["kernel"]) / np.linalg.norm(grads["kernel"])
    assert abs(shard_ratio / global_ratio - 1) > 1e-3


# ------------------------------------------------------------------- errors

def test_unknown_optimizer_lists_the_choices():
    with pytest.raises(OptimizerError, match=r"unknown optimizer\.name 'adagrad'; choose one of") as e:
        make_optimizer("adagrad", 0.1)
    for name in OPTIMIZERS:
        assert repr(name) in str(e.value)


@pytest.mark.parametrize("momentum", [1.0, 1.5, -0.1])
def test_momentum_out_of_range(momentum):
    with pytest.raises(OptimizerError, match=rf"optimizer\.momentum={momentum} must be in \[0, 1\)"):
        make_optimizer("momentum", 0.1, momentum=momentum)


def test_momentum_zero_is_allowed():
    make_optimizer("momentum", 0.1, momentum=0.0)
    make_optimizer("adam", 0.1, momentum=0.0)


def test_negative_weight_decay():
    with pytest.raises(OptimizerError, match=r"optimizer\.weight_decay=-0\.1 must be >= 0"):
        make_optimizer("adamw", 0.1, weight_decay=-0.1)


@pytest.mark.parametrize("learning_rate", [0.0, -0.01])
def test_bad_learning_rate_in_schedule(learning_rate):
    with pytest.raises(OptimizerError, match=rf"optimizer\.learning_rate={learning_rate} must be > 0"):
        make_schedule("constant", learning_rate, total_steps=10)


@pytest.mark.parametrize("learning_rate", [0.0, -0.01])
def test_bad_float_learning_rate_in_optimizer(learning_rate):
    # make_optimizer takes a float directly too; a non-positive one would silently ascend.
    with pytest.raises(OptimizerError, match=rf"optimizer\.learning_rate={learning_rate} must be > 0"):
        make_optimizer("sgd", learning_rate)


@pytest.mark.parametrize("warmup", [11, -1])
def test_warmup_outside_total_steps(warmup):
    with pytest.raises(OptimizerError, match=rf"optimizer\.warmup_steps={warmup} must be in \[0, total steps=10\]"):
        make_schedule("cosine", 0.1, total_steps=10, warmup_steps=warmup)


def test_unknown_schedule_lists_the_choices():
    with pytest.raises(OptimizerError, match=r"unknown optimizer\.schedule 'linear'; choose one of "
                                             r"\['constant', 'cosine', 'polynomial', 'step'\]"):
        make_schedule("linear", 0.1, total_steps=10)


# --------------------------------------------------------------- schedules

def _curve(schedule, total=100):
    """The schedule's values at steps 0..total, computed in one compiled call."""
    return np.asarray(jax.jit(schedule)(jnp.arange(total + 1)), np.float64)


def test_cosine_with_warmup():
    schedule = make_schedule("cosine", 0.1, total_steps=100, warmup_steps=10)
    curve = _curve(schedule)
    assert curve[0] == 0.0
    assert float(schedule(0)) == 0.0  # scalar steps agree
    np.testing.assert_allclose(float(schedule(10)), 0.1, rtol=1e-6)
    # Linear ramp up to the peak at warmup_steps.
    np.testing.assert_allclose(curve[:11], 0.01 * np.arange(11), rtol=1e-5, atol=1e-8)
    # Cosine over the remaining 90 steps: lr(10 + t) = 0.05 * (1 + cos(pi t / 90)).
    hand = {40: 0.05 * (1 + math.cos(math.pi / 3)), 55: 0.05, 70: 0.05 * (1 + math.cos(2 * math.pi / 3)), 100: 0.0}
    np.testing.assert_allclose(curve[list(hand)], list(hand.values()), **SCHEDULE_TOL)
    assert np.all(np.diff(curve[10:]) <= 0)
    assert curve.max() <= 0.1 * (1 + 1e-6)


def test_cosine_without_warmup_starts_at_the_peak():
    curve = _curve(make_schedule("cosine", 0.1, total_steps=100))
    np.testing.assert_allclose(curve[[0, 50, 100]], [0.1, 0.05, 0.0], **SCHEDULE_TOL)


def test_constant_with_and_without_warmup():
    curve = _curve(make_schedule("constant", 0.1, total_steps=100, warmup_steps=4))
    np.testing.assert_allclose(curve[[0, 1, 2, 4, 50, 100]], [0.0, 0.025, 0.05, 0.1, 0.1, 0.1], rtol=1e-6)
    np.testing.assert_allclose(_curve(make_schedule("constant", 0.1, 100)), np.full(101, 0.1), rtol=1e-7)


def test_polynomial_power_two_with_warmup():
    """LARS paper's decay: lr(10 + t) = 0.1 * (1 - t / 90)^2 after 10 warmup steps."""
    curve = _curve(make_schedule("polynomial", 0.1, total_steps=100, warmup_steps=10, power=2.0))
    hand = {0: 0.0, 5: 0.05, 10: 0.1, 40: 0.1 * (2 / 3) ** 2, 55: 0.025, 85: 0.1 * (1 / 6) ** 2, 100: 0.0}
    np.testing.assert_allclose(curve[list(hand)], list(hand.values()), **SCHEDULE_TOL)
    assert np.all(np.diff(curve[10:]) <= 0)


def test_polynomial_power_one_is_linear_decay():
    curve = _curve(make_schedule("polynomial", 0.1, total_steps=100, power=1.0))
    np.testing.assert_allclose(curve, 0.1 * (1 - np.arange(101) / 100), **SCHEDULE_TOL)


def test_step_decay_with_warmup():
    """20 warmup steps, then 80 decay steps with factor 0.1 at 50% and 75% of them (steps 60 and 80).

    The factor applies from the boundary step on (optax's ``t >= b`` convention).
    """
    curve = _curve(make_schedule("step", 0.1, total_steps=100, warmup_steps=20, boundaries=(0.5, 0.75), factor=0.1))
    hand = {0: 0.0, 10: 0.05, 20: 0.1, 59: 0.1, 60: 0.01, 79: 0.01, 80: 0.001, 100: 0.001}
    np.testing.assert_allclose(curve[list(hand)], list(hand.values()), **SCHEDULE_TOL)


def test_step_decay_single_boundary_rounds_to_a_step():
    curve = _curve(make_schedule("step", 1.0, total_steps=100, boundaries=(0.3,), factor=0.5))
    np.testing.assert_allclose(curve[[0, 29, 30, 100]], [1.0, 1.0, 0.5, 0.5], **SCHEDULE_TOL)


@pytest.mark.parametrize("boundaries", [(0.75, 0.5), (0.0, 0.5), (0.5, 1.0), (-0.1,), (0.5, 0.5)])
def test_step_boundaries_must_be_increasing_fractions(boundaries):
    with pytest.raises(OptimizerError, match=r"optimizer\.step_boundaries=.* must be increasing fractions"):
        make_schedule("step", 0.1, total_steps=100, boundaries=boundaries)


def test_step_boundaries_never_drop_a_factor():
    """Boundaries 0.5 and 0.52 of 10 decay steps both round to step 5: the run must not silently
    lose one of the two decays. Either refuse them (naming step_boundaries) or apply both."""
    try:
        schedule = make_schedule("step", 0.1, total_steps=10, boundaries=(0.5, 0.52), factor=0.1)
    except OptimizerError as e:
        assert "step_boundaries" in str(e)
        return
    np.testing.assert_allclose(float(schedule(10)), 0.1 * 0.1 * 0.1, **SCHEDULE_TOL)


@pytest.mark.parametrize("factor", [0.0, 1.0, 1.5, -0.1])
def test_step_factor_in_open_unit_interval(factor):
    with pytest.raises(OptimizerError, match=rf"optimizer\.step_factor={factor} must be in \(0, 1\)"):
        make_schedule("step", 0.1, total_steps=100, factor=factor)


@pytest.mark.parametrize("power", [0.0, -1.0])
def test_polynomial_power_must_be_positive(power):
    with pytest.raises(OptimizerError, match=rf"optimizer\.decay_power={power} must be > 0"):
        make_schedule("polynomial", 0.1, total_steps=100, power=power)


# ------------------------------------------------------------- scaling rules

@pytest.mark.parametrize("rule, expected", [("linear", 0.4), ("sqrt", 0.2), ("none", 0.1)])
def test_scaled_learning_rate(rule, expected):
    """Goyal et al.: 0.1 at batch 256 -> 0.4 at 1024; Krizhevsky's sqrt rule -> 0.2; none keeps 0.1."""
    assert scaled_learning_rate(0.1, 1024, 256, rule) == pytest.approx(expected, rel=1e-12)


def test_scaled_learning_rate_below_the_base_batch():
    assert scaled_learning_rate(0.1, 64, 256, "linear") == pytest.approx(0.025, rel=1e-12)
    assert scaled_learning_rate(0.1, 64, 256, "sqrt") == pytest.approx(0.05, rel=1e-12)


def test_unknown_scaling_rule():
    with pytest.raises(OptimizerError, match=r"unknown optimizer\.scaling 'quadratic'; choose one of "
                                             r"\['none', 'linear', 'sqrt'\]"):
        scaled_learning_rate(0.1, 1024, 256, "quadratic")


@pytest.mark.parametrize("rule", ["linear", "sqrt"])
def test_base_batch_size_zero(rule):
    with pytest.raises(OptimizerError, match=r"optimizer\.base_batch_size=0 must be >= 1"):
        scaled_learning_rate(0.1, 1024, 0, rule)


def test_scaled_learning_rate_refuses_a_non_positive_base_rate():
    with pytest.raises(OptimizerError, match=r"optimizer\.learning_rate=0\.0 must be > 0"):
        scaled_learning_rate(0.0, 1024, 256, "linear")
