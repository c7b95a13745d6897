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
"""

from __future__ import annotations

from dtx.parallel.context.attention import KINDS


def block_bytes(kind: str, examples: int, positions: int, width: int, size: int, itemsize: int = 4) -> float:
    """Bytes one device sends per block and step for attention ``kind`` (module docstring's table): ``examples``
    of its data shard, ``positions`` of the whole sequence, ``width`` the attention's, ``size`` the axis's."""
    if kind not in KINDS:
        raise ValueError(f"context.attention={kind!r}: choose one of {', '.join(KINDS)}")
    chunk = examples * positions // size * width * itemsize
    if kind == "ulysses":
        return 8 * (size - 1) / size * chunk
    return 4 * (size - 1) * chunk
