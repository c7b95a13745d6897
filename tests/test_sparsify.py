"""dtx.compress.sparsify: DGC's warm-up schedule and local steps against hand-computed values, the narrowest honest index
type. Pure arrays, no mesh (the exchanges run on 8 devices in test_compress.py)."""
import math

import jax.numpy as jnp
import numpy as np
import pytest

from dtx.compress import sparsify


def test_dgc_warm_up_divides_by_four_down_to_the_fraction():
    assert sparsify.dgc_fractions(0.001, 4) == [0.25, 0.0625, 0.015625, 0.00390625, 0.001]  # Lin et al.'s 75%..99.9%
    assert sparsify.dgc_fractions(0.001, 0) == [0.001]  # no warm-up: one stage
    assert sparsify.dgc_fractions(0.5, 4) == [0.5]  # already denser than the first stage


def test_index_type_is_the_narrowest_that_addresses_every_entry():
    assert sparsify.index_dtype(2**16) == jnp.uint16 and sparsify.index_dtype(2**16 + 1) == jnp.int32


def test_dgc_local_steps_clip_correct_momentum_and_accumulate():
    g = [jnp.array([3.0, 4.0])]  # norm 5
    p, m, clip = 4, 0.9, 1.0
    u, v = sparsify.dgc_accumulate(g, [jnp.array([1.0, 1.0])], [jnp.array([0.5, -0.5])], p, m, clip)
    clipped = np.array([3.0, 4.0]) * clip * math.sqrt(p) / 5.0  # to a norm of clip * sqrt(p) = 2
    np.testing.assert_allclose(u[0], m * 1.0 + clipped, rtol=1e-6)  # u <- m u + g
    np.testing.assert_allclose(v[0], np.array([0.5, -0.5]) + u[0], rtol=1e-6)  # v <- v + u
    u, v = sparsify.dgc_accumulate(g, None, None, p, 0.0, 0.0)  # no clipping, no buffers: u = v = g
    np.testing.assert_array_equal(u[0], g[0])
    np.testing.assert_array_equal(v[0], g[0])
    with pytest.raises(AssertionError):  # the check can fail: clipping changes a gradient over the norm
        np.testing.assert_allclose(sparsify.dgc_accumulate(g, None, None, 1, 0.0, 1.0)[0][0], g[0])
