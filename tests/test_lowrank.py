"""dtx.compress.lowrank: PowerSGD's power step on one worker (the allreduce the identity): exact at full rank, a rank-r
matrix at rank r, vectors untouched, two packed buffers; matrices seen with the shorter side first."""
import jax.numpy as jnp
import numpy as np

from dtx.compress import lowrank

TOL = dict(rtol=1e-5, atol=1e-5)


def test_matrix_views_put_the_shorter_side_first_and_round_trip():
    assert lowrank.matrix_shape((3, 3, 4, 8)) == (8, 36, True)  # a conv kernel: 36 rows of 8 outputs, transposed
    assert lowrank.matrix_shape((4, 10)) == (4, 10, False)
    x = jnp.arange(3 * 3 * 4 * 8, dtype=jnp.float32).reshape(3, 3, 4, 8)
    assert lowrank.as_matrix(x).shape == (8, 36)
    np.testing.assert_array_equal(lowrank.from_matrix(lowrank.as_matrix(x), x.shape), x)


def test_power_step_is_exact_at_full_rank_and_projects_at_lower_rank():
    rng = np.random.default_rng(0)
    m = jnp.asarray(rng.normal(size=(4, 10)), jnp.float32)
    bias = jnp.asarray(rng.normal(size=(10,)), jnp.float32)
    identity = lambda tree: tree  # noqa: E731  (one worker: the mean is its own value)
    mean, q, mine, (first, second) = lowrank.power_step([m, bias], {"0": lowrank.initial_q(0, 10, 4)}, identity)
    np.testing.assert_allclose(mean[0], m, **TOL)  # r = n: P̂ is square and orthogonal, P̂ P̂ᵀ M = M
    np.testing.assert_array_equal(mean[1], bias)  # vectors travel uncompressed
    np.testing.assert_allclose(mine["0"], m, **TOL)  # what this worker sent loses nothing either
    assert q["0"].shape == (10, 4) and (first.shape, second.shape) == ((4 * 4 + 10,), (10 * 4,))
    mean, *_ = lowrank.power_step([m, bias], {"0": lowrank.initial_q(0, 10, 1)}, identity)
    assert np.linalg.matrix_rank(np.asarray(mean[0]), tol=1e-4) == 1  # rank 1: one direction survives
    assert np.linalg.norm(mean[0] - m) < np.linalg.norm(m)  # a projection: never further than zero
