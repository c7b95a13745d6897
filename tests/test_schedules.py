"""dtx.comm.schedules: the message rounds each algorithm's schedule really sends, recorded at trace time without devices
(``Group(log=..., dry=True)``), against the α terms of the cost model; the ring's equal chunks. The sums
themselves are checked against ``lax.psum`` on 8 devices in test_collectives.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dtx.comm import algorithms, costmodel, schedules


def _rounds(algorithm, p, inner=None, n=64):
    """Message rounds of one allreduce of ``n`` float32 values over ``p`` ranks, from the schedule itself."""
    log = []
    sizes = (p // inner, inner) if algorithm == "hierarchical" else (p,)
    axes = ("outer", "inner") if algorithm == "hierarchical" else ("group",)

    declared = algorithms.get_algorithm(algorithm)

    def trace(x, ranks):
        return declared.reduce(x, declared.groups(axes, sizes, ranks, log=log, dry=True))

    jax.eval_shape(trace, jax.ShapeDtypeStruct((n,), jnp.float32), [jax.ShapeDtypeStruct((), jnp.int32)] * len(sizes))
    return len(log)


@pytest.mark.parametrize("algorithm, p, inner", [
    ("ring", 8, None), ("ring", 5, None), ("halving_doubling", 8, None), ("halving_doubling", 6, None),
    ("recursive_doubling", 8, None), ("recursive_doubling", 6, None), ("tree", 8, None), ("tree", 5, None),
    ("hierarchical", 8, 4),
])
def test_schedules_send_the_rounds_of_the_cost_model(algorithm, p, inner):
    assert _rounds(algorithm, p, inner) == costmodel.cost_terms(algorithm, 256, p, inner).rounds


def test_chunks_pad_to_equal_rows():
    rows = schedules.chunks(jnp.arange(10.0), 4)
    assert rows.shape == (4, 3)
    np.testing.assert_array_equal(np.asarray(rows).reshape(-1), [*range(10), 0, 0])  # zeros add nothing
