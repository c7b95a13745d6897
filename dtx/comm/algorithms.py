"""The allreduce algorithms, each declared once: its message schedule, its α-β cost and its traffic.

The Hitchhiker's Guide (Chahal et al., arXiv 1810.11787, §4) compares All-Reduce algorithms by the
α-β model of Thakur, Rabenseifner & Gropp (IJHPCA 2005). Here each algorithm is an
:class:`Algorithm` that declares everything the rest of dtx asks of it — how many batch axes it
needs (``levels``), whether it is XLA's own all-reduce (``native``), its schedule of messages
(:mod:`dtx.comm.schedules`), the coefficients of its cost (table in :mod:`dtx.comm.costmodel`) and,
in closed form, what one device sends. :mod:`dtx.comm.collectives` builds allreduces from the
schedule, :mod:`dtx.comm.costmodel` answers cost questions from the formulas, the drivers ask
:meth:`Algorithm.inner_size`; nothing compares an algorithm's name. A new algorithm is one
declaration (its schedule beside it) and one line of :data:`ALGORITHMS` (docs/extending.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from dtx.comm import schedules

Terms = tuple[float, float, float]  # rounds (α), bytes on the critical path (β), bytes reduced (γ)
Sent = tuple[int, int]  # messages, bytes one device sends (the maximum over devices)


class CollectiveError(ValueError):
    """A bad allreduce algorithm, axis set, bucket size or cost-model argument."""


class Algorithm(NamedTuple):
    """An allreduce algorithm as the rest of dtx knows it.

    Attributes:
      name: its ``allreduce`` config value.
      terms: ``(n, p, outer, inner) -> (rounds, path_bytes, reduced_bytes)`` for ``n`` bytes per device.
      sent: ``(elements, itemsize, p, outer, inner) -> (messages, bytes)`` one device sends, with the
        padding the schedule adds so that chunks are equal.
      reduce: ``(flat array, groups) -> sum over the groups`` (:mod:`dtx.comm.schedules`); ``None`` for
        XLA's own.
      levels: 1: any number of batch axes act as one group; 2: exactly ``(outer, inner)``.
      native: XLA's own all-reduce (``lax.psum``): its schedule is the backend's, and XLA's combiner
        merges it with the step's other all-reduces.
    """

    name: str
    terms: Callable[[float, int, int, int], Terms]
    sent: Callable[[int, int, int, int, int], Sent]
    reduce: Callable | None = None
    levels: int = 1
    native: bool = False

    def inner_size(self, mesh_shape: Mapping[str, int], axes: Sequence[str]) -> int | None:
        """The inner group's size on a mesh (two-level algorithms over two batch axes), else ``None``."""
        return mesh_shape[axes[-1]] if self.levels == 2 and len(axes) == 2 else None

    def groups(self, axes, sizes, ranks, *, log=None, dry=False) -> list[schedules.Group]:
        """The groups its schedule exchanges over (:func:`dtx.comm.schedules.make_groups`)."""
        return schedules.make_groups(self.levels, axes, sizes, ranks, log=log, dry=dry)


def _pow2_split(p: int) -> tuple[int, int, int]:
    """``(q, k, r)``: the largest power of two ``q = 2^k <= p`` and the ``r = p − q`` extras."""
    k = p.bit_length() - 1
    return 1 << k, k, p - (1 << k)


def _ring_terms(n, p, outer, inner) -> Terms:
    return 2 * (p - 1), 2 * (p - 1) / p * n, (p - 1) / p * n


def _ring_sent(e, itemsize, p, outer, inner) -> Sent:
    return 2 * (p - 1), 2 * (p - 1) * -(-e // p) * itemsize


def _halving_doubling_terms(n, p, outer, inner) -> Terms:
    q, k, r = _pow2_split(p)
    fold = 1 if r else 0
    return 2 * k + 2 * fold, 2 * (q - 1) / q * n + 2 * fold * n, (q - 1) / q * n + fold * n


def _halving_doubling_sent(e, itemsize, p, outer, inner) -> Sent:
    q, k, r = _pow2_split(p)
    fold = 1 if r else 0  # the partner of a folded rank receives its vector, runs the core, sends it back
    return 2 * k + fold, (2 * (q - 1) * -(-e // q) + fold * e) * itemsize


def _recursive_doubling_terms(n, p, outer, inner) -> Terms:
    q, k, r = _pow2_split(p)
    fold = 1 if r else 0
    return k + 2 * fold, (k + 2 * fold) * n, (k + fold) * n


def _recursive_doubling_sent(e, itemsize, p, outer, inner) -> Sent:
    q, k, r = _pow2_split(p)
    fold = 1 if r else 0
    return k + fold, (k + fold) * e * itemsize


def _tree_terms(n, p, outer, inner) -> Terms:
    lg = math.ceil(math.log2(p)) if p > 1 else 0
    return 2 * lg, 2 * lg * n, lg * n


def _tree_sent(e, itemsize, p, outer, inner) -> Sent:
    lg = math.ceil(math.log2(p))  # rank 0 sends the whole vector to each of its ⌈lg p⌉ children
    return lg, lg * e * itemsize


def _hierarchical_terms(n, p, outer, inner) -> Terms:
    shard = n / inner  # inner reduce-scatter + outer ring on the n/inner shard + inner all-gather
    return (2 * (inner - 1) + 2 * (outer - 1), 2 * (inner - 1) / inner * n + 2 * (outer - 1) / outer * shard,
            (inner - 1) / inner * n + (outer - 1) / outer * shard)


def _hierarchical_sent(e, itemsize, p, outer, inner) -> Sent:
    shard = -(-e // inner)
    return (2 * (inner - 1) + 2 * (outer - 1),
            (2 * (inner - 1) * shard + 2 * (outer - 1) * -(-shard // outer)) * itemsize)


def _flat(schedule):
    return lambda x, groups: schedule(x, groups[0])


ALGORITHMS: dict[str, Algorithm] = {algorithm.name: algorithm for algorithm in (
    # XLA's own schedule is not visible in the program: modelled as the ring (bandwidth-optimal, what NCCL
    # picks for large messages).
    Algorithm("psum", _ring_terms, _ring_sent, native=True),
    Algorithm("ring", _ring_terms, _ring_sent, _flat(schedules.ring)),
    Algorithm("halving_doubling", _halving_doubling_terms, _halving_doubling_sent, _flat(schedules.halving_doubling)),
    Algorithm("recursive_doubling", _recursive_doubling_terms, _recursive_doubling_sent,
              _flat(schedules.recursive_doubling)),
    Algorithm("tree", _tree_terms, _tree_sent, _flat(schedules.tree)),
    Algorithm("hierarchical", _hierarchical_terms, _hierarchical_sent,
              lambda x, groups: schedules.hierarchical(x, *groups), levels=2),
)}


def get_algorithm(algorithm: str | Algorithm) -> Algorithm:
    """The registered algorithm ``name`` (an :class:`Algorithm` passes through)."""
    if isinstance(algorithm, Algorithm):
        return algorithm
    if algorithm not in ALGORITHMS:
        raise CollectiveError(f"unknown allreduce algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    return ALGORITHMS[algorithm]
