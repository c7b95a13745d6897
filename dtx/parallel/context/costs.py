"""What context parallelism moves, by formula: per block and step, what one device sends.

``b`` the examples of a device's data shard, ``S`` positions, ``C`` the ``context`` axis, ``H`` the attention
width (heads × head width), ``e`` bytes per element; a device's chunk of keys (or values) is ``n = b·(S/C)·H·e``.

==============  ==========================================  ==========================================
kernel          forward                                     backward (the transposes)
==============  ==========================================  ==========================================
``ring``        ``C − 1`` hops of a key and a value chunk:  the keys' and values' gradients travel the
                ``2(C − 1)·n``                              ring back: ``2(C − 1)·n``
``allgather``   keys and values all-gathered (ring):        their gradients reduce-scattered:
                ``2(C − 1)·n``                              ``2(C − 1)·n``
``ulysses``     4 all-to-alls (q, k, v, the output):        4 all-to-alls: ``4·(C − 1)/C·n``
                ``4·(C − 1)/C·n``
==============  ==========================================  ==========================================

So the ring and the all-gather send the same bytes — the ring in ``C − 1`` messages that can overlap the
blocks' compute, the all-gather at once, holding every key and value of the sequence (``C`` times a chunk) while
it attends — and Ulysses ``C/2`` times fewer, at the price of heads divisible by ``C``. ``tests/test_context.py``
holds these to the compiled step's collectives.

Memory (:func:`memory_bytes`): a device holds ``S/C`` positions of its examples, so everything position-wise is the
model's data-parallel estimate at ``S/C`` positions; attention adds what its kernel keeps for the backward pass
beyond one device's attention over those positions, traced from the kernel's own VJP (:func:`kept_bytes`) and
scaled by what XLA:CPU was read to keep of it (:data:`KEPT`).
"""

from __future__ import annotations

import collections
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from dtx.parallel.context import CONTEXT_AXIS as CONTEXT
from dtx.parallel.context.attention import ATTENTION, KINDS


def block_bytes(kind: str, examples: int, positions: int, width: int, size: int, itemsize: int = 4) -> float:
    """Bytes one device sends per block and step for attention ``kind`` (module docstring's table): ``examples``
    of its data shard, ``positions`` of the whole sequence, ``width`` the attention's, ``size`` the axis's."""
    if kind not in KINDS:
        raise ValueError(f"context.attention={kind!r}: choose one of {', '.join(KINDS)}")
    chunk = examples * positions // size * width * itemsize
    if kind == "ulysses":
        return 8 * (size - 1) / size * chunk
    return 4 * (size - 1) * chunk


# What XLA:CPU keeps of a kernel's autodiff residuals beyond one device's attention over its own positions (the
# compiled peak's growth over the model's data-parallel estimate at S/C positions, per residual byte): read on the
# development rows, the tiny transformer LM (2 blocks of width 32, 4 heads, 2 sequences per data shard) on data 2 x
# context 4 at 128 and 256 positions, least squares of the peak's relative error; the held-out rows (384 and 512
# positions at C = 4; C = 2 at 256 and 512) are in docs/context_parallel.md and tests/test_context.py. XLA keeps
# less than autodiff names: the ring's and Ulysses' masks and the all-gather's gathered copies are recomputed or
# fused into the backward pass.
KEPT = dict(ring=0.811, allgather=0.611, ulysses=0.834)


@functools.lru_cache(maxsize=256)  # the memory check asks again for each batch it tries; a block's calls repeat
def kept_bytes(kind: str, examples: int, positions: int, heads: int, head_dim: int, size: int,
               dtype=jnp.float32) -> int:
    """Bytes of the residuals autodiff keeps on one device for kernel ``kind``'s backward pass, ``examples`` of
    ``positions`` (the whole sequence) split over ``size`` devices: traced (:func:`jax.eval_shape` of the kernel's
    VJP in a ``shard_map`` over an abstract ``context`` axis), nothing compiled or run. ``size = 1`` with
    ``kind=None``: one device's causal attention over ``positions`` (flax's, what the model runs without the axis).
    """
    got = []
    if kind is None:
        def attend(q, k, v):
            mask = nn.make_causal_mask(jnp.zeros(q.shape[:2]))
            return nn.dot_product_attention(q, k, v, mask=mask)
    else:
        attend = functools.partial(ATTENTION[kind], axis=CONTEXT, balanced=True)

    def residuals(q, k, v):
        out, vjp = jax.vjp(attend, q, k, v)
        got.append(sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(vjp)))
        return out

    x = jax.ShapeDtypeStruct((examples, positions, heads, head_dim), dtype)
    if kind is None:
        jax.eval_shape(residuals, x, x, x)
    else:
        spec = P(None, CONTEXT)
        jax.eval_shape(jax.shard_map(residuals, mesh=AbstractMesh((size,), (CONTEXT,)), in_specs=(spec,) * 3,
                                     out_specs=spec), x, x, x)
    return got[0]


def memory_bytes(kind: str, calls, examples: int, positions: int, size: int, dtype=jnp.float32) -> float:
    """Modelled bytes per device that a context split adds to the model's data-parallel estimate at ``S/C``
    positions (:func:`dtx.perf.memory.estimate` of a device's tokens): for each attention call of ``calls``
    (``(heads, head_dim)``), :data:`KEPT` of what the kernel's residuals keep beyond one device's attention over
    ``S/C`` positions — the key and value chunks the ring received, the gathered keys and values, Ulysses' whole
    sequence of ``h/C`` heads, and the ``S/C × S`` scores' softmax statistics."""
    dtype = jnp.dtype(dtype)
    extra = sum(count * (kept_bytes(kind, examples, positions, h, d, size, dtype)
                         - kept_bytes(None, examples, positions // size, h, d, 1, dtype))
                for (h, d), count in collections.Counter(calls).items())
    return KEPT[kind] * extra
