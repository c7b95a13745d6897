"""Communication graphs of decentralised (gossip) SGD: mixing matrices and the ppermutes that apply them.

In decentralised SGD every worker ``i`` replaces its parameters by a weighted
average of its neighbours', ``x_i ← Σ_j W_ij x_j`` (Hitchhiker's Guide, Chahal et
al., arXiv 1810.11787, on decentralised SGD; Lian et al., *Can decentralized algorithms outperform
centralized algorithms?*, NeurIPS 2017; Koloskova et al., *A unified theory of
decentralized SGD*, ICML 2020). ``W`` is doubly stochastic, so the workers' mean is
preserved, and the disagreement between workers shrinks by the second-largest
eigenvalue magnitude ``|λ₂(W)|`` per mixing step (the spectral gap ``1 − |λ₂|``).

Every graph here is *circulant* — worker ``i`` talks to ``i ± s`` — so one mixing
step is a short list of ``(weight, shift)`` terms: ``x_i ← Σ w · x_{i−shift}``, each
nonzero shift one ``lax.ppermute``. Topologies (:data:`TOPOLOGIES`):

* ``ring``: weights ``(self, left, right)``, two neighbours (Lian et al. 2017).
* ``complete``: uniform ``1/p`` over all workers — one step reaches exact consensus,
  the same average a synchronous allreduce computes, at ``p − 1`` messages.
* ``exponential``: one peer per step, ``2^k`` away with ``k = step mod ⌈lg p⌉``,
  weights ``(1/2, 1/2)`` (the one-peer exponential graph of Assran et al., *Stochastic
  Gradient Push*, ICML 2019; Ying et al., NeurIPS 2021): exact consensus after
  ``lg p`` steps when ``p`` is a power of two, one message per step.

Pure numpy for the matrices; the mixing itself runs inside ``jax.shard_map``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

TOPOLOGIES: tuple[str, ...] = ("ring", "complete", "exponential")

Terms = tuple[tuple[float, int], ...]  # ((weight, shift), ...): x_i ← Σ weight · x_{(i − shift) mod p}


def num_rounds(topology: str, p: int) -> int:
    """How many distinct mixing steps the topology cycles through (exponential: ``⌈lg p⌉``)."""
    return max(1, math.ceil(math.log2(p))) if topology == "exponential" and p > 1 else 1


def mixing_terms(topology: str, weights: Sequence[float], p: int, round_: int = 0) -> Terms:
    """The ``(weight, shift)`` terms of one mixing step over ``p`` workers.

    Shifts are taken mod ``p`` and equal shifts merged (on 2 workers left and right are
    the same peer: one message, not two); zero weights are dropped (no message).
    """
    if topology == "ring":
        raw = [(weights[0], 0), (weights[1], 1), (weights[2], -1)]
    elif topology == "complete":
        raw = [(1.0 / p, s) for s in range(p)]
    elif topology == "exponential":
        raw = [(0.5, 0), (0.5, 2 ** (round_ % num_rounds(topology, p)))] if p > 1 else [(1.0, 0)]
    else:
        raise ValueError(f"unknown topology {topology!r}; choose one of {list(TOPOLOGIES)}")
    merged: dict[int, float] = {}
    for weight, shift in raw:
        merged[shift % p] = merged.get(shift % p, 0.0) + float(weight)
    return tuple((w, s) for s, w in sorted(merged.items()) if w != 0.0)


def mixing_matrix(topology: str, weights: Sequence[float], p: int, round_: int = 0) -> np.ndarray:
    """``W`` (``p × p``, float64) with ``x ← W x`` the mixing step ``round_`` of ``topology``."""
    matrix = np.zeros((p, p))
    for weight, shift in mixing_terms(topology, weights, p, round_):
        for i in range(p):
            matrix[i, (i - shift) % p] += weight
    return matrix


def neighbours(terms: Terms) -> int:
    """Peers a worker sends to in one mixing step (one ppermute per nonzero shift)."""
    return sum(1 for _, shift in terms if shift)


def mix(tree: Any, terms: Terms, axes: tuple[str, ...], p: int) -> Any:
    """``x_i ← Σ w · x_{i−shift}`` for every leaf, one ``lax.ppermute`` per nonzero shift and dtype.

    Inside ``jax.shard_map`` over ``axes`` (``p`` workers, numbered row-major as
    ``lax.axis_index(axes)`` numbers them). With ``axes == ()`` every worker is alone
    and keeps its own parameters. The leaves of one dtype travel packed in one flat
    buffer (:func:`packed_nbytes`): a message per leaf would pay the link's latency once
    per leaf, and the latency is what gossip's few neighbours are meant to save.
    """
    if not axes:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    out = list(leaves)
    for indices in _by_dtype(leaves).values():
        flat = jnp.concatenate([leaves[i].reshape(-1) for i in indices])
        total = None
        for weight, shift in terms:
            # Worker j sends to j + shift, so worker i receives x_{i − shift}.
            y = flat if shift == 0 else lax.ppermute(flat, axes, [(j, (j + shift) % p) for j in range(p)])
            total = weight * y if total is None else total + weight * y
        total = total.astype(flat.dtype)
        start = 0
        for i in indices:
            out[i] = total[start:start + leaves[i].size].reshape(leaves[i].shape)
            start += leaves[i].size
    return jax.tree.unflatten(treedef, out)


def packed_nbytes(tree: Any) -> list[int]:
    """Bytes of each flat buffer :func:`mix` sends to one peer: one per dtype among ``tree``'s leaves."""
    leaves = jax.tree.leaves(tree)
    return [sum(leaves[i].size * np.dtype(leaves[i].dtype).itemsize for i in indices)
            for indices in _by_dtype(leaves).values()]


def _by_dtype(leaves) -> dict:
    groups: dict = {}
    for i, x in enumerate(leaves):
        groups.setdefault(np.dtype(x.dtype), []).append(i)
    return groups
