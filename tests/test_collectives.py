"""Allreduce algorithms == lax.psum; bucketing; traffic counts == the cost model.

Each algorithm must equal ``lax.psum`` for every p in 1..8 (DESIGN.md §6): exactly on
integers, and on floats within ``FLOAT_RTOL`` (a different summation order is the
only difference). Each program combines many sizes in one pytree so the file compiles
few programs, and every result is waited on before the next call (DESIGN.md §2).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from dtx import collectives, costmodel
from dtx.collectives import ALGORITHMS, CollectiveError, Traffic, count_traffic, make_allreduce
from dtx.mesh import make_mesh

FLAT = tuple(a for a in ALGORITHMS if a != "hierarchical")
FLOAT_RTOL = 1e-5  # float32 sums of 8 values of magnitude <= 1 in different orders
FLOAT_ATOL = 1e-6
SHAPES = [(), (1,), (5,), (7, 3), (1000,)]  # scalars, sizes below p, not divisible by p, large


def _mesh(spec):
    devices = jax.devices()[: math.prod(size for _, size in spec)]
    return make_mesh(spec, devices=devices)


def _per_device(fn, mesh, axes, tree, **kwargs):
    """Run fn on per-device slices; return every device's output (leading axis = device)."""

    def body(t):
        out = fn(jax.tree.map(lambda v: v[0], t))
        return jax.tree.map(lambda v: jnp.asarray(v)[None], out)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes), **kwargs)
    return jax.tree.map(np.asarray, jax.jit(mapped)(tree))  # np.asarray waits for the result


def _tree(p, seed, dtype):
    """One leaf per shape in SHAPES, per-device values on a leading axis of size p (numpy: no compiles)."""
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.integer):
        return [rng.integers(-1000, 1000, (p, *s)).astype(dtype) for s in SHAPES]
    return [rng.uniform(-1.0, 1.0, (p, *s)).astype(dtype) for s in SHAPES]


def _assert_all_devices_equal(per_device, reference, *, exact):
    for got, want in zip(jax.tree.leaves(per_device), jax.tree.leaves(reference)):
        # Every device holds the very same bits (what lets out_specs=P() with check_vma=False work).
        np.testing.assert_array_equal(got, np.broadcast_to(got[:1], got.shape))
        assert got.dtype == want.dtype and got.shape == want.shape
        if exact:
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=FLOAT_RTOL, atol=FLOAT_ATOL)


@pytest.mark.parametrize("p", range(1, 9))
def test_flat_algorithms_equal_psum(p):
    mesh = _mesh([("data", p)])
    ints, floats = _tree(p, p, np.int32), _tree(p, 100 + p, np.float32)

    def fn(t):
        ints, floats = t
        out = {"ref": (lax.psum(ints, "data"), lax.pmean(floats, "data"))}
        for name in FLAT:
            out[name] = (make_allreduce(name, ("data",), mean=False)(ints),
                         make_allreduce(name, ("data",), mean=True)(floats))
        return out

    out = _per_device(fn, mesh, "data", (ints, floats))
    ref_ints, ref_floats = out.pop("ref")
    for name, (got_ints, got_floats) in out.items():
        _assert_all_devices_equal(got_ints, ref_ints, exact=True)
        _assert_all_devices_equal(got_floats, ref_floats, exact=False)
