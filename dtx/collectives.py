"""Allreduce algorithms over named mesh axes, gradient bucketing, traffic counting.

The Hitchhiker's Guide (Chahal et al., arXiv 1810.11787, §4) surveys the All-Reduce
strategies of distributed SGD; here each one is explicit, selectable by name, checked
against ``lax.psum`` and costed (:mod:`dtx.costmodel`). Every algorithm runs *inside*
``jax.shard_map`` on per-device values and is built only from ``lax.ppermute``,
``lax.axis_index`` and arithmetic:

* ``psum`` — XLA's native all-reduce (the default; XLA picks the schedule).
* ``ring`` — reduce-scatter then all-gather around a ring, ``2(p−1)`` steps on
  ``n/p`` chunks: bandwidth-optimal (Patarasuk & Yuan, JPDC 2009).
* ``halving_doubling`` — Rabenseifner's recursive-halving reduce-scatter plus
  recursive-doubling all-gather (Thakur, Rabenseifner & Gropp, IJHPCA 2005, §4.5).
* ``recursive_doubling`` — ``lg p`` pairwise exchanges of the whole vector
  (butterfly; Thakur et al. §4.5): latency-optimal, for small messages.
* ``tree`` — binomial-tree reduce to rank 0, then binomial-tree broadcast.
* ``hierarchical`` — 2D: reduce-scatter inside the inner axis, ring allreduce of the
  shard across the outer axis, all-gather inside the inner axis (the Guide's
  hierarchical/2D All-Reduce; for fast links inside a node, slow ones between).

For ``p`` not a power of two, halving-doubling and recursive doubling fold the
``r = p − 2^⌊lg p⌋`` extra ranks into partners first and unfold after (Thakur §4).
Several axes act as one group of ``∏ sizes`` ranks (``lax.axis_index`` and
``lax.ppermute`` accept a tuple of names and number ranks row-major, outer first),
except ``hierarchical``, which needs exactly (outer, inner).

**Identical replicas.** Every device must end with the same bits, or replicated
parameters drift apart (nothing re-synchronises them). Each partial sum is computed
on one device and forwarded, or by both partners of an exchange from the same two
values (IEEE addition commutes); and the chunks are put back in order
behind a fusion boundary (:func:`_from_relative`), so that the code consuming the
result is the same on every device. ``tests/test_collectives.py`` trains 20 steps
with every algorithm and compares every replica bit for bit.

**Varying results.** Under ``check_vma=True`` (shard_map's default) a ppermute-built
sum is typed *varying* even though every device holds the same bits; only ``psum``
returns an invariant value. JAX has no free varying→invariant cast (``lax.pcast``
only goes to ``varying``/``reduced``/``unreduced``). To return such a result with
``out_specs=P()``, either build the shard_map with ``check_vma=False`` (free; every
algorithm here leaves bit-identical values on all devices, and the tests check it),
or pass the result through :func:`as_invariant` (an invariant all-gather: ``(p−1)/p``
of the bytes again, i.e. half a ring allreduce).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from dtx.costmodel import (  # noqa: F401  (re-exported: the cost model belongs with the algorithms)
    ALGORITHMS,
    CollectiveError,
    Traffic,
    bandwidth_lower_bound,
    cost_terms,
    expected_traffic,
    plan_buckets,
    predict_time,
)

PyTree = Any


@dataclasses.dataclass
class _Group:
    """Ranks ``0..size-1`` that exchange messages over mesh axis (or axes) ``axis``.

    ``send`` is the one place messages leave a device. When ``log`` is a list, it
    records every message round at trace time (who sends, how many bytes), which is
    how :func:`count_traffic` counts the schedule the code really builds. ``dry``
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


def _chunks(x: jax.Array, parts: int) -> jax.Array:
    """Pad a flat array to ``parts·⌈n/parts⌉`` and split it into ``parts`` equal rows."""
    width = -(-x.size // parts)
    return jnp.pad(x, (0, parts * width - x.size)).reshape(parts, width)


def _to_relative(chunks: jax.Array, g: _Group) -> list[jax.Array]:
    """Rows in rank-relative order (row ``j`` is chunk ``(rank + j) mod p``).

    Selecting the rows once here and putting them back once in :func:`_from_relative`
    makes every ring step's index static: faster to compile, and 2–3× faster to run
    at 16 MiB than per-step dynamic slices or rolls of the whole buffer (measured).
    """
    p = chunks.shape[0]
    return [lax.dynamic_index_in_dim(chunks, (g.rank + j) % p, keepdims=False) for j in range(p)]


def _from_relative(rows: list[jax.Array], g: _Group) -> jax.Array:
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


def _ring_reduce_scatter(rows: list[jax.Array], g: _Group) -> list[jax.Array]:
    """After ``p−1`` steps, relative row 1 (chunk ``rank+1``) holds the full sum."""
    p = g.size
    right = [(i, (i + 1) % p) for i in range(p)]
    for step in range(p - 1):
        # Each rank passes on the partial sum it just grew; p−1 hops visit every rank.
        recv = g.send(rows[-step % p], right)
        rows[(-step - 1) % p] = rows[(-step - 1) % p] + recv
    return rows


def _ring_all_gather(rows: list[jax.Array], g: _Group) -> list[jax.Array]:
    """Circulate the complete chunks, starting from relative row 1."""
    p = g.size
    right = [(i, (i + 1) % p) for i in range(p)]
    for step in range(p - 1):
        rows[-step % p] = g.send(rows[(1 - step) % p], right)
    return rows


def _ring(x: jax.Array, g: _Group) -> jax.Array:
    if g.size == 1:
        return x
    rows = _ring_all_gather(_ring_reduce_scatter(_to_relative(_chunks(x, g.size), g), g), g)
    return _from_relative(rows, g).reshape(-1)[: x.size]


def _fold(x: jax.Array, g: _Group, q: int) -> jax.Array:
    """Ranks ``q..p−1`` hand their vectors to ranks ``0..r−1``, leaving a power of two."""
    extra = g.size - q
    if not extra:
        return x
    recv = g.send(x, [(q + i, i) for i in range(extra)])
    return jnp.where(g.rank < extra, x + recv, x)


def _unfold(x: jax.Array, g: _Group, q: int) -> jax.Array:
    """Ranks ``0..r−1`` return the finished sum to the ranks they folded in."""
    extra = g.size - q
    if not extra:
        return x
    recv = g.send(x, [(i, q + i) for i in range(extra)])
    return jnp.where(g.rank >= q, recv, x)


def _pow2(p: int) -> tuple[int, int]:
    k = p.bit_length() - 1
    return 1 << k, k


def _halving_doubling(x: jax.Array, g: _Group) -> jax.Array:
    q, k = _pow2(g.size)
    if g.size == 1:
        return x
    x = _fold(x, g, q)
    n = x.size
    seg = _chunks(x, q).reshape(-1)
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


def _recursive_doubling(x: jax.Array, g: _Group) -> jax.Array:
    q, k = _pow2(g.size)
    x = _fold(x, g, q)
    for j in range(k):
        # IEEE addition commutes, so both partners compute bit-identical sums.
        x = x + g.send(x, [(i, i ^ (1 << j)) for i in range(q)])
    return _unfold(x, g, q)


def _tree(x: jax.Array, g: _Group) -> jax.Array:
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


def _hierarchical(x: jax.Array, outer: _Group, inner: _Group) -> jax.Array:
    rows = _ring_reduce_scatter(_to_relative(_chunks(x, inner.size), inner), inner)
    rows[1 % inner.size] = _ring(rows[1 % inner.size], outer)  # only 1/inner crosses the slow links
    rows = _ring_all_gather(rows, inner)
    return _from_relative(rows, inner).reshape(-1)[: x.size]


_FLAT = {"ring": _ring, "halving_doubling": _halving_doubling, "recursive_doubling": _recursive_doubling, "tree": _tree}


def _groups(algorithm, axes, sizes, ranks, *, log=None, dry=False) -> list[_Group]:
    if algorithm == "hierarchical":
        (outer, inner), (m, s) = axes, sizes
        return [
            _Group(outer, m, ranks[0], lambda d: d // s, log, dry),
            _Group(inner, s, ranks[1], lambda d: d % s, log, dry),
        ]
    return [_Group(axes[0] if len(axes) == 1 else tuple(axes), math.prod(sizes), ranks[0], lambda d: d, log, dry)]


def _reduce_flat(algorithm: str, x: jax.Array, groups: list[_Group]) -> jax.Array:
    if algorithm == "hierarchical":
        return _hierarchical(x, *groups)
    return _FLAT[algorithm](x, groups[0])


def _varying_axes(x: jax.Array) -> frozenset:
    """The mesh axes ``x`` is typed as varying over (empty under ``check_vma=False``)."""
    aval = jax.typeof(x)
    return aval.mat.varying if hasattr(aval, "mat") else getattr(aval, "vma", frozenset())  # jax 0.10+ / older


def _varying(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Cast ``x`` to varying over ``axes``: ppermute refuses invariant inputs under check_vma."""
    missing = tuple(a for a in axes if a not in _varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x


def _mean(x: jax.Array, p: int) -> jax.Array:
    if p == 1:
        return x
    # Integers keep their dtype: floor division, exact for sums that are multiples of p.
    return x // p if jnp.issubdtype(x.dtype, jnp.integer) else x / p


def _check_axes(algorithm: str, axes: Any) -> tuple[str, ...]:
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    if not axes or len(set(axes)) != len(axes):
        raise CollectiveError(f"axes must be one or more distinct mesh axis names, got {axes!r}")
    if algorithm == "hierarchical" and len(axes) != 2:
        raise CollectiveError(
            f"hierarchical allreduce needs exactly two batch axes (outer, inner), got {axes!r}; "
            "use a mesh with two batch axes like [('node', 2), ('local', 4)]"
        )
    return axes


def make_allreduce(
    algorithm: str, axes: tuple[str, ...], *, mean: bool = True, bucket_bytes: int = 0
) -> Callable[[PyTree], PyTree]:
    """Build ``tree -> sum (or mean) over all devices of axes``, for use inside shard_map.

    Args:
      algorithm: one of :data:`ALGORITHMS` (module docstring).
      axes: mesh axis names to reduce over. Flat algorithms treat several axes as one
        group of ``∏ sizes`` ranks; ``hierarchical`` needs exactly ``(outer, inner)``.
      mean: divide by the number of devices (integer leaves: floor division).
      bucket_bytes: ``0`` reduces leaf by leaf; ``> 0`` packs leaves into buckets of at
        most this many bytes (:func:`plan_buckets`) and reduces bucket by bucket.

    Returns:
      A function of a pytree of per-device arrays (any mix of dtypes) returning the
      reduced tree, every leaf with its shape and dtype, bit-identical on all devices.
      ``psum`` results are invariant; the others are typed varying (module docstring).

    Example::

        reduce = make_allreduce("ring", ("data",))
        f = jax.shard_map(lambda g: reduce(g), mesh=mesh, in_specs=P("data"),
                          out_specs=P(), check_vma=False)
    """
    if algorithm not in ALGORITHMS:
        raise CollectiveError(f"unknown allreduce algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    axes = _check_axes(algorithm, axes)
    if not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise CollectiveError(f"bucket_bytes must be an integer >= 0 (0 = no bucketing), got {bucket_bytes!r}")

    if algorithm == "psum" and not bucket_bytes:
        # XLA's own collective on the tree as it is (XLA fuses small all-reduces itself).
        def native(tree: PyTree) -> PyTree:
            summed = lax.psum(tree, axes)
            if not mean:
                return summed
            p = math.prod(lax.axis_size(a) for a in axes)
            return jax.tree.map(lambda x: _mean(x, p), summed)

        return native

    def allreduce(tree: PyTree) -> PyTree:
        leaves, treedef = jax.tree.flatten(tree)
        leaves = [jnp.asarray(leaf) for leaf in leaves]
        sizes = [lax.axis_size(a) for a in axes]
        if algorithm == "psum":
            reduce_flat = lambda x: lax.psum(x, axes)  # noqa: E731
        else:
            ranks = [lax.axis_index(a) for a in axes] if algorithm == "hierarchical" else [lax.axis_index(axes)]
            groups = _groups(algorithm, axes, sizes, ranks)
            leaves = [_varying(leaf, axes) for leaf in leaves]
            reduce_flat = lambda x: _reduce_flat(algorithm, x, groups)  # noqa: E731
        out = list(leaves)
        buckets = plan_buckets(leaves, bucket_bytes) if bucket_bytes else [(i,) for i, v in enumerate(leaves) if v.size]
        for bucket in buckets:
            flat = reduce_flat(jnp.concatenate([leaves[i].reshape(-1) for i in bucket]))
            offset = 0
            for i in bucket:
                out[i] = flat[offset : offset + leaves[i].size].reshape(leaves[i].shape)
                offset += leaves[i].size
        if mean:
            out = [_mean(leaf, math.prod(sizes)) for leaf in out]
        return jax.tree.unflatten(treedef, out)

    return allreduce


def as_invariant(tree: PyTree, axes: tuple[str, ...]) -> PyTree:
    """Retype values that are identical on every device of ``axes`` as invariant.

    For ``check_vma=True`` callers with ``out_specs=P()``. Device ``i`` contributes
    the ``i``-th of ``p`` slices to ``lax.all_gather(..., to="invarying")``, so the
    result is bit-identical to the input but costs an all-gather
    (``(p−1)/p·n`` bytes per device). Leaves already invariant (or any leaf when
    ``check_vma=False``, where nothing is typed varying) pass through for free.
    """
    axes = (axes,) if isinstance(axes, str) else tuple(axes)

    def cast(leaf):
        leaf = jnp.asarray(leaf)
        if leaf.size == 0 or not set(axes) & _varying_axes(leaf):
            return leaf
        p = math.prod(lax.axis_size(a) for a in axes)
        mine = lax.dynamic_index_in_dim(_chunks(leaf.reshape(-1), p), lax.axis_index(axes), keepdims=False)
        full = lax.all_gather(mine, axes, tiled=True, to="invarying")
        return full[: leaf.size].reshape(leaf.shape)

    return jax.tree.map(cast, tree)


def count_traffic(algorithm: str, nbytes_or_shape_dtype: Any, p: int, inner: int | None = None) -> Traffic:
    """Messages and bytes one device sends, counted from the algorithm's own schedule.

    Traces the implementation (``jax.eval_shape``, no devices needed, any ``p``)
    with a recording ``send`` and tallies, for every device, the message rounds in
    which it is a source. Returns the maximum over devices of each field
    (asymmetric schedules: the tree root, the partners of folded ranks). ``psum`` is
    XLA's and cannot be counted; its entry is the modelled ring traffic.

    Args:
      algorithm: one of :data:`ALGORITHMS`.
      nbytes_or_shape_dtype: an int (a flat uint8 vector of that many bytes) or
        anything with ``.shape`` and ``.dtype`` (one array or bucket).
      p: number of devices.
      inner: inner-axis size, for ``hierarchical`` only.
    """
    if isinstance(nbytes_or_shape_dtype, int):
        spec = jax.ShapeDtypeStruct((nbytes_or_shape_dtype,), jnp.uint8)
    else:
        spec = jax.ShapeDtypeStruct(tuple(nbytes_or_shape_dtype.shape), nbytes_or_shape_dtype.dtype)
    n = math.prod(spec.shape)
    itemsize = jnp.dtype(spec.dtype).itemsize
    model = expected_traffic(algorithm, n * itemsize, p, inner, itemsize)  # also validates the arguments
    if algorithm == "psum" or n == 0:
        return model
    log: list = []
    sizes = (p // inner, inner) if algorithm == "hierarchical" else (p,)
    axes = ("outer", "inner") if algorithm == "hierarchical" else ("group",)

    def trace(x, ranks):
        return _reduce_flat(algorithm, x, _groups(algorithm, axes, sizes, ranks, log=log, dry=True))

    rank_spec = [jax.ShapeDtypeStruct((), jnp.int32)] * len(sizes)
    jax.eval_shape(trace, jax.ShapeDtypeStruct((n,), spec.dtype), rank_spec)
    messages = [sum(rank_of(d) in srcs for rank_of, srcs, _ in log) for d in range(p)]
    sent = [sum(nbytes for rank_of, srcs, nbytes in log if rank_of(d) in srcs) for d in range(p)]
    return Traffic(max(messages), max(sent))
