"""dtx.comm: the context's placements and the accountant's rules, by hand (pure Python and shapes, no mesh).
The accountant against compiled programs, case by case, is tests/test_comm_accounting.py."""
import jax
import jax.numpy as jnp
import numpy as np

from dtx import comm
from dtx.comm import CommContext
from dtx.comm.costmodel import Traffic

TREE = {"kernel": jax.ShapeDtypeStruct((16, 10), jnp.float32), "bias": jax.ShapeDtypeStruct((10,), jnp.float32)}


def test_psum_is_the_rings_bytes_in_one_schedule_per_call():
    ctx = CommContext(("data",), 8, lambda t: t, "psum")
    # 170 float32 = 680 bytes, each leaf padded to 8 chunks: kernel 160 -> 20 x 4 B, bias 10 -> 2 x 4 B per chunk
    ring_bytes = 2 * 7 * (20 * 4) + 2 * 7 * (2 * 4)
    assert comm.allreduce_traffic(TREE, ctx) == Traffic(2 * 7, ring_bytes)  # one 2(p-1)-round call
    assert comm.allreduce_traffic(TREE, ctx._replace(algorithm="ring")) == Traffic(2 * 2 * 7, ring_bytes)  # per leaf
    assert comm.psum_traffic(Traffic(5, 0), 8) == Traffic(5, 0)  # nothing sent, no rounds invented


def test_only_explicit_collectives_are_counted_by_the_accountant():
    explicit = CommContext(("data",), 8, lambda t: t)
    assert explicit.explicit and comm.allreduce_traffic(TREE, explicit).bytes_sent > 0
    for ctx in (comm.compiler(8), comm.silent(explicit)):
        assert not ctx.explicit and ctx.size == 8 and ctx.allreduce(3) == 3  # the identity
        assert comm.allreduce_traffic(TREE, ctx) == Traffic(0, 0)
    assert (comm.compiler(8).placement, comm.silent(explicit).placement) == ("compiler", "none")
    assert int(comm.worker_index(comm.compiler(8))) == 0


def test_counts_stay_exact_as_device_scalars():
    assert comm.count_scalar(2**31 - 1).dtype == jnp.int32 and comm.count_scalar(2**31).dtype == jnp.float32
    stats = comm.traffic_stats(Traffic(3, 1000))
    assert (int(stats["comm_rounds"]), int(stats["comm_bytes"])) == (3, 1000)
    np.testing.assert_array_equal(comm.Capabilities(), (False, True, False, True, 0, 0, 0))  # a new plug-in's defaults
