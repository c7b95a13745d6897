"""Tests for dtx.optim: optimizers and schedules by name, their errors, and equality with optax."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dtx.optim import OPTIMIZERS, SCHEDULES, OptimizerError, make_optimizer, make_schedule

PARAMS = {
    "dense": {"kernel": jnp.asarray([[0.5, -1.0], [2.0, 0.25], [-0.75, 1.5]]), "bias": jnp.asarray([0.1, -0.2])},
    "scale": jnp.asarray(1.5),
}
GRADS = {
    "dense": {"kernel": jnp.asarray([[0.3, -0.2], [0.1, 0.4], [-0.5, 0.6]]), "bias": jnp.asarray([0.05, -0.3])},
    "scale": jnp.asarray(-0.7),
}


def _step(tx, params, grads, state=None):
    state = tx.init(params) if state is None else state
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), updates, state


def _leaves(tree):
    return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


# ------------------------------------------------------------- optimizers

def test_optimizer_names():
    assert OPTIMIZERS == ("sgd", "momentum", "nesterov", "adam", "adamw", "lars", "lamb")
    assert SCHEDULES == ("constant", "cosine")


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


@pytest.mark.parametrize(
    "name, reference",
    [
        ("momentum", lambda: optax.sgd(0.1, momentum=0.8)),
        ("nesterov", lambda: optax.sgd(0.1, momentum=0.8, nesterov=True)),
        ("adam", lambda: optax.adam(0.1, b1=0.8)),
        ("lamb", lambda: optax.lamb(0.1, b1=0.8, weight_decay=0.0)),
    ],
)
def test_named_optimizers_are_the_optax_ones(name, reference):
    ours, theirs = make_optimizer(name, 0.1, momentum=0.8), reference()

    @jax.jit
    def two_steps(params, grads):
        s1, s2 = ours.init(params), theirs.init(params)
        p1 = p2 = params
        for _ in range(2):
            p1, _, s1 = _step(ours, p1, grads, s1)
            p2, _, s2 = _step(theirs, p2, grads, s2)
        return p1, p2

    p1, p2 = two_steps(PARAMS, GRADS)
    for a, b in zip(_leaves(p1), _leaves(p2)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_sgd_weight_decay_is_l2_on_the_gradient():
    tx = make_optimizer("sgd", 0.1, weight_decay=0.5)
    _, updates, _ = jax.jit(lambda p, g: _step(tx, p, g))(PARAMS, GRADS)
    for u, g, p in zip(_leaves(updates), _leaves(GRADS), _leaves(PARAMS)):
        np.testing.assert_allclose(u, -0.1 * (g + 0.5 * p), rtol=1e-6, atol=1e-7)


def test_adamw_weight_decay_is_decoupled():
    # With zero gradients Adam's part is zero; only the decay -lr * wd * p remains.
    zeros = jax.tree.map(jnp.zeros_like, GRADS)
    tx = make_optimizer("adamw", 0.1, weight_decay=0.5)
    _, updates, _ = jax.jit(lambda p, g: _step(tx, p, g))(PARAMS, zeros)
    for u, p in zip(_leaves(updates), _leaves(PARAMS)):
        np.testing.assert_allclose(u, -0.1 * 0.5 * p, rtol=1e-6, atol=1e-7)


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
    with pytest.raises(OptimizerError, match=r"unknown optimizer\.schedule 'linear'; choose one of \['constant', 'cosine'\]"):
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
    # Cosine over the remaining 90 steps: half way at step 55, ~0 at the end, never above the peak.
    np.testing.assert_allclose(curve[55], 0.05, rtol=1e-5)
    np.testing.assert_allclose(curve[100], 0.0, atol=1e-7)
    assert np.all(np.diff(curve[10:]) <= 0)
    assert curve.max() <= 0.1 * (1 + 1e-6)


def test_cosine_without_warmup_starts_at_the_peak():
    curve = _curve(make_schedule("cosine", 0.1, total_steps=100))
    np.testing.assert_allclose(curve[[0, 50, 100]], [0.1, 0.05, 0.0], rtol=1e-5, atol=1e-7)


def test_constant_with_and_without_warmup():
    curve = _curve(make_schedule("constant", 0.1, total_steps=100, warmup_steps=4))
    np.testing.assert_allclose(curve[[0, 1, 2, 4, 50, 100]], [0.0, 0.025, 0.05, 0.1, 0.1, 0.1], rtol=1e-6)
    np.testing.assert_allclose(_curve(make_schedule("constant", 0.1, 100)), np.full(101, 0.1), rtol=1e-7)
