"""The α-β(-γ) cost model of allreduce algorithms.

A message of ``n`` bytes costs ``α + n·β`` (latency plus bytes over bandwidth) and
reducing ``n`` bytes costs ``n·γ`` — the model of Thakur, Rabenseifner & Gropp,
*Optimization of Collective Communication Operations in MPICH* (IJHPCA 2005), which
the Hitchhiker's Guide (Chahal et al., arXiv 1810.11787, §4) uses to compare
All-Reduce strategies. For ``p`` devices and ``n`` bytes per device (``q = 2^⌊lg p⌋``,
``k = lg q``, ``r = p − q`` ranks left over, ``L = ⌈lg p⌉``; ``[r>0]`` is 1 or 0):

=====================  ===================  ==============================  ==========================
algorithm              α (rounds)           β (bytes on the critical path)  γ (bytes reduced)
=====================  ===================  ==============================  ==========================
ring (Patarasuk-Yuan)  2(p−1)               2(p−1)/p·n                      (p−1)/p·n
halving_doubling       2k + 2[r>0]          2(q−1)/q·n + 2[r>0]·n           (q−1)/q·n + [r>0]·n
recursive_doubling     k + 2[r>0]           (k + 2[r>0])·n                  (k + [r>0])·n
tree (binomial)        2L                   2L·n                            L·n
hierarchical m×s       2(s−1) + 2(m−1)      2(s−1)/s·n + 2(m−1)/m·n/s       (s−1)/s·n + (m−1)/m·n/s
=====================  ===================  ==============================  ==========================

``psum`` is XLA's own collective; its schedule is not ours to see, so it is modelled
as the ring (bandwidth-optimal, what NCCL picks for large messages). No allreduce can
beat the bandwidth term ``2(p−1)/p·n·β`` (:func:`bandwidth_lower_bound`): every
device must send and receive at least ``(p−1)/p`` of its data twice (Patarasuk & Yuan,
*Bandwidth optimal all-reduce algorithms for clusters of workstations*, JPDC 2009).
Non-powers of two fold the ``r`` extra ranks into partners first and unfold after
(Thakur et al. §4), which is where the ``[r>0]`` terms come from. Hierarchical is a
2D allreduce over an ``m × s`` mesh (outer × inner): reduce-scatter inside the inner
axis, a ring allreduce of the ``n/s`` shard across the outer axis, all-gather inside.

:func:`expected_traffic` gives what each algorithm *sends* per device, exactly, with
the padding the implementations add so that chunks are equal; ``dtx.comm.collectives``
counts the same quantities from its own ppermute schedule and the tests hold the two
equal. Each algorithm's formulas are declared with it (:mod:`dtx.comm.algorithms`); the functions
here take its name and ask it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from dtx.comm.algorithms import Algorithm, CollectiveError, get_algorithm


class Traffic(NamedTuple):
    """What one device sends during an allreduce: message count and bytes.

    Where devices differ (tree root vs leaves, the partners of folded ranks) each
    field is the maximum over devices, taken separately.
    """

    messages: int
    bytes_sent: int


class CostTerms(NamedTuple):
    """Coefficients of α, β and γ: time = rounds·α + path_bytes·β + reduced_bytes·γ."""

    rounds: float
    path_bytes: float
    reduced_bytes: float


def _check_sizes(algorithm: str | Algorithm, nbytes: float, p: int, inner: int | None) -> tuple[Algorithm, int, int]:
    """The declared algorithm and ``(outer, inner)`` for a two-level one, ``(p, 1)`` otherwise, validated."""
    declared = get_algorithm(algorithm)
    if p < 1 or int(p) != p:
        raise CollectiveError(f"device count p must be a positive integer, got {p!r}")
    if nbytes < 0:
        raise CollectiveError(f"message size must be >= 0 bytes, got {nbytes!r}")
    if declared.levels == 1:
        return declared, p, 1
    if inner is None or inner < 1 or p % inner:
        raise CollectiveError(
            f"{declared.name} needs inner = the inner-axis size, a divisor of p={p}; got inner={inner!r} "
            "(e.g. p=8, inner=4 for a mesh [('node', 2), ('local', 4)])"
        )
    return declared, p // inner, inner


def cost_terms(algorithm: str | Algorithm, nbytes: float, p: int, inner: int | None = None) -> CostTerms:
    """The α, β and γ coefficients of one allreduce of ``nbytes`` per device (table above)."""
    declared, outer, inner = _check_sizes(algorithm, nbytes, p, inner)
    return CostTerms(*declared.terms(float(nbytes), p, outer, inner))


def predict_time(
    algorithm: str,
    nbytes: float,
    p: int,
    alpha: float,
    beta: float,
    gamma: float = 0.0,
    inner: int | None = None,
) -> float:
    """Modelled seconds for one allreduce of ``nbytes`` per device over ``p`` devices.

    Args:
      algorithm: a name of :data:`dtx.comm.algorithms.ALGORITHMS`.
      nbytes: bytes each device contributes (and receives back).
      p: number of devices.
      alpha: latency per message round, seconds.
      beta: seconds per byte on a link (1 / bandwidth).
      gamma: seconds per byte reduced (the local additions).
      inner: inner-axis size for ``hierarchical`` (``p // inner`` is the outer size).

    Returns:
      ``rounds·α + path_bytes·β + reduced_bytes·γ`` from :func:`cost_terms`.
    """
    terms = cost_terms(algorithm, nbytes, p, inner)
    return terms.rounds * alpha + terms.path_bytes * beta + terms.reduced_bytes * gamma


def bandwidth_lower_bound(nbytes: float, p: int, beta: float) -> float:
    """``2(p−1)/p·n·β``: no allreduce moves less data per device (Patarasuk & Yuan 2009)."""
    return 2 * (p - 1) / p * nbytes * beta


def expected_traffic(algorithm: str, nbytes: int, p: int, inner: int | None = None, itemsize: int = 1) -> Traffic:
    """Messages and bytes one device sends (maximum over devices), in closed form.

    ``nbytes`` must be a whole number of ``itemsize``-byte elements. Chunked
    algorithms pad the ``e = nbytes / itemsize`` elements up to a multiple of the
    number of chunks, so for ``p ∤ e`` the bytes exceed the smooth formula above by
    the padding: e.g. the ring sends ``2(p−1)·⌈e/p⌉`` elements.
    """
    declared, outer, inner = _check_sizes(algorithm, nbytes, p, inner)
    if itemsize < 1 or nbytes % itemsize:
        raise CollectiveError(f"nbytes={nbytes} is not a whole number of {itemsize}-byte elements")
    e = nbytes // itemsize
    if e == 0 or p == 1:
        return Traffic(0, 0)
    return Traffic(*declared.sent(e, itemsize, p, outer, inner))


# ----------------------------------------------------------------------------- accountant
# What one device sends per step, for every way dtx communicates: the allreduces
# above, and the all-gathers, all-to-alls, neighbour exchanges and parameter-server
# pushes/pulls of gradient compression (dtx.compress) and relaxed synchronisation
# (dtx.strategies). Both report through these functions, so their bytes compare.


def add_traffic(*traffics: Traffic) -> Traffic:
    """Traffic of several collectives run one after the other."""
    return Traffic(sum(t.messages for t in traffics), sum(t.bytes_sent for t in traffics))


def all_gather_traffic(nbytes: int, p: int) -> Traffic:
    """Ring all-gather of ``nbytes`` from each device: each forwards ``p − 1`` blocks."""
    if p <= 1 or nbytes == 0:
        return Traffic(0, 0)
    return Traffic(p - 1, (p - 1) * nbytes)


def all_to_all_traffic(nbytes_per_peer: int, p: int) -> Traffic:
    """All-to-all with ``nbytes_per_peer`` for each of the ``p − 1`` other devices."""
    if p <= 1 or nbytes_per_peer == 0:
        return Traffic(0, 0)
    return Traffic(p - 1, (p - 1) * nbytes_per_peer)


def neighbour_traffic(nbytes: int, neighbours: int) -> Traffic:
    """One ``ppermute`` of ``nbytes`` to each of ``neighbours`` peers (gossip)."""
    if neighbours <= 0 or nbytes == 0:
        return Traffic(0, 0)
    return Traffic(neighbours, neighbours * nbytes)


def tree_nbytes(tree: Any, dtype: Any = None) -> int:
    """Bytes of a pytree of arrays (or ShapeDtypeStructs), optionally as if cast to ``dtype``."""
    import numpy as np  # local: this module stays importable without JAX

    total = 0
    for leaf in _leaves(tree):
        itemsize = np.dtype(dtype if dtype is not None else leaf.dtype).itemsize
        total += int(np.prod(leaf.shape, dtype=np.int64)) * itemsize
    return total


def plan_buckets(leaves: Any, bucket_bytes: int) -> list[tuple[int, ...]]:
    """Group leaf indices into buckets of at most ``bucket_bytes`` bytes.

    Horovod's tensor fusion (``HOROVOD_FUSION_THRESHOLD``) and PyTorch DDP's
    ``bucket_cap_mb``: many small messages become few large ones, trading α for β.
    Leaves (anything with ``.shape`` and ``.dtype``) are taken in order; each dtype
    fills its own open bucket (one bucket never mixes dtypes); a leaf larger than a
    bucket travels alone; empty leaves are in no bucket. Buckets are returned in
    order of their first leaf. ``dtx.comm.collectives`` reduces bucket by bucket in this
    plan and :func:`dense_allreduce_traffic` counts by it, so the two cannot disagree.
    """
    import numpy as np

    if bucket_bytes <= 0:
        raise CollectiveError(f"bucket_bytes must be > 0 to plan buckets, got {bucket_bytes}")
    open_buckets: dict[Any, tuple[list[int], int]] = {}
    done: list[list[int]] = []
    for i, leaf in enumerate(leaves):
        dtype = np.dtype(leaf.dtype)
        nbytes = int(np.prod(leaf.shape, dtype=np.int64)) * dtype.itemsize
        if nbytes == 0:
            continue
        members, used = open_buckets.get(dtype, ([], 0))
        if members and used + nbytes > bucket_bytes:
            done.append(members)
            members, used = [], 0
        open_buckets[dtype] = (members + [i], used + nbytes)
    done.extend(members for members, _ in open_buckets.values())
    return [tuple(b) for b in sorted(done, key=lambda b: b[0])]


def dense_allreduce_traffic(tree: Any, p: int, algorithm: str = "ring", dtype: Any = None,
                            inner: int | None = None, bucket_bytes: int = 0) -> Traffic:
    """Allreduce of every leaf of ``tree`` as ``dtx.comm.collectives.make_allreduce`` runs it.

    Leaf by leaf, or with ``bucket_bytes > 0`` one allreduce per bucket of
    :func:`plan_buckets` (the leaves of a bucket concatenated: one message per round,
    chunks padded once per bucket). ``dtype``: the leaves as if cast to it (the wire
    dtype, which is also what the buckets are planned in). The float32 ring allreduce
    of the gradients, leaf by leaf (``dtype="float32"``), is the reference every
    compression and strategy ratio is taken against.
    """
    import numpy as np

    specs = [_Spec(tuple(leaf.shape), np.dtype(dtype if dtype is not None else leaf.dtype)) for leaf in _leaves(tree)]
    groups = plan_buckets(specs, bucket_bytes) if bucket_bytes else [(i,) for i in range(len(specs))]
    parts = []
    for group in groups:
        itemsize = specs[group[0]].dtype.itemsize
        n = sum(int(np.prod(specs[i].shape, dtype=np.int64)) for i in group)
        parts.append(expected_traffic(algorithm, n * itemsize, p, inner, itemsize))
    return add_traffic(*parts)


class _Spec(NamedTuple):
    shape: tuple
    dtype: Any


def _leaves(tree: Any) -> list:
    if hasattr(tree, "shape") and hasattr(tree, "dtype"):
        return [tree]
    import jax

    return jax.tree.leaves(tree)


def compressed_allreduce_traffic(chunk_bytes: int, p: int) -> Traffic:
    """Two-phase compressed allreduce (1-bit Adam's): an all-to-all of one encoded chunk
    to each peer, then an all-gather of the re-encoded averaged chunk: ``2(p−1)`` chunks."""
    return add_traffic(all_to_all_traffic(chunk_bytes, p), all_gather_traffic(chunk_bytes, p))
