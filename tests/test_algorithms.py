"""Allreduce algorithms are declarations: the cost model, the accountant and make_allreduce ask them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from dtx import mesh as mesh_lib
from dtx.comm import algorithms, collectives, costmodel
from dtx.comm.algorithms import ALGORITHMS, Algorithm, CollectiveError, get_algorithm


def test_every_algorithm_declares_one_or_two_levels_and_psum_alone_is_native():
    assert {name for name, a in ALGORITHMS.items() if a.native} == {"psum"}
    assert {name for name, a in ALGORITHMS.items() if a.levels == 2} == {"hierarchical"}
    assert all(a.reduce is not None for a in ALGORITHMS.values() if not a.native)
    # psum is modelled as the ring: the same coefficients and bytes.
    assert costmodel.cost_terms("psum", 1e6, 8) == costmodel.cost_terms("ring", 1e6, 8)
    assert costmodel.expected_traffic("psum", 4000, 8, itemsize=4) == costmodel.expected_traffic("ring", 4000, 8,
                                                                                                  itemsize=4)


def test_inner_size_is_the_inner_axis_of_a_two_level_algorithm():
    shape = {"node": 2, "local": 4}
    assert get_algorithm("hierarchical").inner_size(shape, ("node", "local")) == 4
    assert get_algorithm("ring").inner_size(shape, ("node", "local")) is None
    assert get_algorithm("hierarchical").inner_size({"data": 8}, ("data",)) is None


def test_a_declaration_outside_the_registry_runs_through_every_consumer():
    """An algorithm object with the ring's schedule and formulas under another name equals psum, is counted as
    it declares, and its declared cost is the ring's: nothing keys on the name."""
    ring = ALGORITHMS["ring"]
    mine = Algorithm("my_ring", ring.terms, ring.sent, ring.reduce)
    mesh = mesh_lib.make_mesh([("data", 8)])
    x = jax.device_put(jnp.arange(8 * 100, dtype=jnp.float32).reshape(8, 100) / 3, NamedSharding(mesh, P("data")))
    run = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P("data"),  # noqa: E731
                                          check_vma=False))(x)
    np.testing.assert_allclose(run(collectives.make_allreduce(mine, ("data",), mean=False)),
                               run(lambda v: jax.lax.psum(v, "data")), rtol=1e-6)
    assert costmodel.cost_terms(mine, 400.0, 8) == costmodel.cost_terms("ring", 400.0, 8)
    assert collectives.count_traffic(mine, jax.ShapeDtypeStruct((100,), jnp.float32), 8) == \
        costmodel.expected_traffic("ring", 400, 8, itemsize=4)


def test_unknown_algorithms_are_refused_with_the_choices():
    with pytest.raises(CollectiveError, match=r"unknown allreduce algorithm 'butterfly'; choose one of psum, ring"):
        get_algorithm("butterfly")
    with pytest.raises(CollectiveError, match="needs inner"):
        costmodel.cost_terms("hierarchical", 1e6, 8)
    assert algorithms.get_algorithm(ALGORITHMS["tree"]) is ALGORITHMS["tree"]
