"""Allreduce algorithms over named mesh axes, gradient bucketing, traffic counting.

The Hitchhiker's Guide (Chahal et al., arXiv 1810.11787, §4) surveys the All-Reduce
strategies of distributed SGD; here each one is explicit, selectable by name, checked
against ``lax.psum`` and costed (:mod:`dtx.comm.costmodel`). Every algorithm runs *inside*
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
behind a fusion boundary (:func:`dtx.comm.schedules._from_relative`), so that the code consuming the
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

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from dtx.comm import schedules
from dtx.comm.algorithms import Algorithm, CollectiveError, get_algorithm
from dtx.comm.costmodel import Traffic, expected_traffic, plan_buckets

PyTree = Any


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


def _check_axes(algorithm: Algorithm, axes: Any) -> tuple[str, ...]:
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    if not axes or len(set(axes)) != len(axes):
        raise CollectiveError(f"axes must be one or more distinct mesh axis names, got {axes!r}")
    if algorithm.levels == 2 and len(axes) != 2:
        raise CollectiveError(
            f"{algorithm.name} allreduce needs exactly two batch axes (outer, inner), got {axes!r}; "
            "use a mesh with two batch axes like [('node', 2), ('local', 4)]"
        )
    return axes


def make_allreduce(
    algorithm: str, axes: tuple[str, ...], *, mean: bool = True, bucket_bytes: int = 0
) -> Callable[[PyTree], PyTree]:
    """Build ``tree -> sum (or mean) over all devices of axes``, for use inside shard_map.

    Args:
      algorithm: a name of :data:`dtx.comm.algorithms.ALGORITHMS` (module docstring).
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
    declared = get_algorithm(algorithm)
    axes = _check_axes(declared, axes)
    if not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise CollectiveError(f"bucket_bytes must be an integer >= 0 (0 = no bucketing), got {bucket_bytes!r}")

    if declared.native and not bucket_bytes:
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
        if declared.native:
            reduce_flat = lambda x: lax.psum(x, axes)  # noqa: E731
        else:
            ranks = [lax.axis_index(a) for a in axes] if declared.levels == 2 else [lax.axis_index(axes)]
            groups = declared.groups(axes, sizes, ranks)
            leaves = [_varying(leaf, axes) for leaf in leaves]
            reduce_flat = lambda x: declared.reduce(x, groups)  # noqa: E731
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
        mine = lax.dynamic_index_in_dim(schedules.chunks(leaf.reshape(-1), p), lax.axis_index(axes), keepdims=False)
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
      algorithm: a name of :data:`dtx.comm.algorithms.ALGORITHMS`.
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
    declared = get_algorithm(algorithm)
    if declared.native or n == 0:
        return model
    log: list = []
    sizes = (p // inner, inner) if declared.levels == 2 else (p,)
    axes = ("outer", "inner") if declared.levels == 2 else ("group",)

    def trace(x, ranks):
        return declared.reduce(x, declared.groups(axes, sizes, ranks, log=log, dry=True))

    rank_spec = [jax.ShapeDtypeStruct((), jnp.int32)] * len(sizes)
    jax.eval_shape(trace, jax.ShapeDtypeStruct((n,), spec.dtype), rank_spec)
    messages = [sum(rank_of(d) in srcs for rank_of, srcs, _ in log) for d in range(p)]
    sent = [sum(nbytes for rank_of, srcs, nbytes in log if rank_of(d) in srcs) for d in range(p)]
    return Traffic(max(messages), max(sent))
