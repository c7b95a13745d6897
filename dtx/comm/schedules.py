"""The message schedules of the allreduce algorithms in :mod:`dtx.comm.collectives`, one public function each (declared in :mod:`dtx.comm.algorithms`).

Each takes one flat per-device array and a :class:`Group` (the ranks exchanging over a mesh axis)
and returns the sum over the group, built only from ``lax.ppermute`` (through :meth:`Group.send`),
``lax.axis_index`` and arithmetic: ring (Patarasuk & Yuan, JPDC 2009), recursive halving-doubling
and recursive doubling with the fold of non-power-of-two ranks (Thakur, Rabenseifner & Gropp,
IJHPCA 2005, §4), binomial tree, and the hierarchical 2D composition. :mod:`dtx.comm.collectives` wraps
them into allreduces of pytrees and counts their traffic by tracing them with a recording ``send``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass
class Group:
    """Ranks ``0..size-1`` that exchange messages over mesh axis (or axes) ``axis``.

    ``send`` is the one place messages leave a device. When ``log`` is a list, it
    records every message round at trace time (who sends, how many bytes), which is
    how :func:`dtx.comm.collectives.count_traffic` counts the schedule the code really builds. ``dry``
    skips the ppermute itself, so counting needs no mesh and works for any ``p``.
    """

    axis: str | tuple[str, ...]
    size: int
    rank: jax.Array
    rank_of: Callable[[int], int]  # device index over all axes -> its rank in this group
    log: list | None = None
    dry: bool = False

    def send(self, x: jax.Array, pairs: Sequence[tuple[int, int]]) -> jax.Array:
        pairs = tuple(pairs)
        if self.log is not None:
            self.log.append((self.rank_of, frozenset(src for src, _ in pairs), x.size * x.dtype.itemsize))
        if self.dry:
            return x
        # Ranks that receive nothing get zeros; callers select with jnp.where.
        return lax.ppermute(x, self.axis, pairs)


def chunks(x: jax.Array, parts: int) -> jax.Array:
    """Pad a flat array to ``parts·⌈n/parts⌉`` and split it into ``parts`` equal rows."""
    width = -(-x.size // parts)
    return jnp.pad(x, (0, parts * width - x.size)).reshape(parts, width)


def _to_relative(table: jax.Array, g: Group) -> list[jax.Array]:
    """Rows in rank-relative order (row ``j`` is chunk ``(rank + j) mod p``).

    Selecting the rows once here and putting them back once in :func:`_from_relative`
    makes every ring step's index static: faster to compile, and 2–3× faster to run
    at 16 MiB than per-step dynamic slices or rolls of the whole buffer (measured).
    """
    p = table.shape[0]
    return [lax.dynamic_index_in_dim(table, (g.rank + j) % p, keepdims=False) for j in range(p)]


def _from_relative(rows: list[jax.Array], g: Group) -> jax.Array:
    """The rows back in absolute chunk order: one static order per rank, chosen by ``lax.switch``.

    Not a gather at ``(i − rank) mod p``, though it computes the same: XLA fuses such a
    gather into whatever consumes the allreduce (the optimizer update), the fused loop
    then branches on which row an element comes from, and XLA:CPU's LLVM contracts
    multiply-adds into FMAs differently on different branches. Devices holding
    bit-identical sums then wrote parameters 1 ulp apart (measured: hierarchical on
    2 × 4, SGD with momentum, from the second step on). A conditional is a fusion
    boundary: each device copies its rows into one buffer in its own static order, and
    the consumer reads that buffer through the same code on every device.
    """
    p = len(rows)
    if p == 1:
        return rows[0][None]
    return lax.switch(g.rank, [functools.partial(_in_order, start=r) for r in range(p)], rows)


def _in_order(rows: list[jax.Array], start: int) -> jax.Array:
    """Relative rows of rank ``start`` stacked in absolute order (chunk ``c`` is row ``c − start``)."""
    p = len(rows)
    return jnp.stack([rows[(c - start) % p] for c in range(p)])


def _ring_reduce_scatter(rows: list[jax.Array], g: Group) -> list[jax.Array]:
    """After ``p−1`` steps, relative row 1 (chunk ``rank+1``) holds the full sum."""
    p = g.size
    right = [(i, (i + 1) % p) for i in range(p)]
    for step in range(p - 1):
        # Each rank passes on the partial sum it just grew; p−1 hops visit every rank.
        recv = g.send(rows[-step % p], right)
        rows[(-step - 1) % p] = rows[(-step - 1) % p] + recv
    return rows


def _ring_all_gather(rows: list[jax.Array], g: Group) -> list[jax.Array]:
    """Circulate the complete chunks, starting from relative row 1."""
    p = g.size
    right = [(i, (i + 1) % p) for i in range(p)]
    for step in range(p - 1):
        rows[-step % p] = g.send(rows[(1 - step) % p], right)
    return rows


def ring(x: jax.Array, g: Group) -> jax.Array:
    if g.size == 1:
        return x
    rows = _ring_all_gather(_ring_reduce_scatter(_to_relative(chunks(x, g.size), g), g), g)
    return _from_relative(rows, g).reshape(-1)[: x.size]


def _fold(x: jax.Array, g: Group, q: int) -> jax.Array:
    """Ranks ``q..p−1`` hand their vectors to ranks ``0..r−1``, leaving a power of two."""
    extra = g.size - q
    if not extra:
        return x
    recv = g.send(x, [(q + i, i) for i in range(extra)])
    return jnp.where(g.rank < extra, x + recv, x)


def _unfold(x: jax.Array, g: Group, q: int) -> jax.Array:
    """Ranks ``0..r−1`` return the finished sum to the ranks they folded in."""
    extra = g.size - q
    if not extra:
        return x
    recv = g.send(x, [(i, q + i) for i in range(extra)])
    return jnp.where(g.rank >= q, recv, x)


def _pow2(p: int) -> tuple[int, int]:
    k = p.bit_length() - 1
    return 1 << k, k


def halving_doubling(x: jax.Array, g: Group) -> jax.Array:
    q, k = _pow2(g.size)
    if g.size == 1:
        return x
    x = _fold(x, g, q)
    n = x.size
    seg = chunks(x, q).reshape(-1)
    rank = g.rank % q  # folded-out ranks mirror a partner; their result is discarded
    for j in range(k):  # recursive halving: keep one half, send the other to the rank at distance d
        d = q >> (j + 1)
        upper = (rank // d) % 2 == 1
        low, high = seg.reshape(2, -1)
        recv = g.send(jnp.where(upper, low, high), [(i, i ^ d) for i in range(q)])
        seg = jnp.where(upper, high, low) + recv
    # Rank i now owns the finished chunk i; recursive doubling gathers the others.
    for j in range(k):
        d = 1 << j
        upper = (rank // d) % 2 == 1
        recv = g.send(seg, [(i, i ^ d) for i in range(q)])
        seg = jnp.where(upper, jnp.concatenate([recv, seg]), jnp.concatenate([seg, recv]))
    return _unfold(seg[:n], g, q)


def recursive_doubling(x: jax.Array, g: Group) -> jax.Array:
    q, k = _pow2(g.size)
    x = _fold(x, g, q)
    for j in range(k):
        # IEEE addition commutes, so both partners compute bit-identical sums.
        x = x + g.send(x, [(i, i ^ (1 << j)) for i in range(q)])
    return _unfold(x, g, q)


def tree(x: jax.Array, g: Group) -> jax.Array:
    p = g.size
    levels = math.ceil(math.log2(p)) if p > 1 else 0
    for j in range(levels):  # reduce: ranks with lowest set bit j send to rank − 2^j
        d = 1 << j
        recv = g.send(x, [(s, s - d) for s in range(d, p, 2 * d)])
        x = jnp.where((g.rank % (2 * d) == 0) & (g.rank + d < p), x + recv, x)
    for j in reversed(range(levels)):  # broadcast: the same tree, edges reversed
        d = 1 << j
        recv = g.send(x, [(s, s + d) for s in range(0, p - d, 2 * d)])
        x = jnp.where(g.rank % (2 * d) == d, recv, x)
    return x


def hierarchical(x: jax.Array, outer: Group, inner: Group) -> jax.Array:
    rows = _ring_reduce_scatter(_to_relative(chunks(x, inner.size), inner), inner)
    rows[1 % inner.size] = ring(rows[1 % inner.size], outer)  # only 1/inner crosses the slow links
    rows = _ring_all_gather(rows, inner)
    return _from_relative(rows, inner).reshape(-1)[: x.size]




def make_groups(levels: int, axes, sizes, ranks, *, log=None, dry=False) -> list[Group]:
    """The groups a schedule exchanges over: one group of all the axes' ranks (``levels=1``: several axes
    act as one group of ``∏ sizes`` ranks, numbered row-major), or the outer and the inner axis (``levels=2``)."""
    if levels == 2:
        (outer, inner), (m, s) = axes, sizes
        return [
            Group(outer, m, ranks[0], lambda d: d // s, log, dry),
            Group(inner, s, ranks[1], lambda d: d % s, log, dry),
        ]
    return [Group(axes[0] if len(axes) == 1 else tuple(axes), math.prod(sizes), ranks[0], lambda d: d, log, dry)]
