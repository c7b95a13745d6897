"""Low-rank gradient compression: PowerSGD's power step (Hitchhiker's Guide §5).

The low-rank family of the Hitchhiker's Guide's compression section (Chahal et al.,
arXiv 1810.11787, §5) as pure array functions; :mod:`dtx.compress` builds its
``powersgd`` compressor from them. PowerSGD (Vogels, Karimireddy & Jaggi, *PowerSGD:
Practical Low-Rank Gradient Compression for Distributed Optimization*, NeurIPS 2019,
Alg. 1): each leaf with two or more dimensions is viewed as an ``n × m`` matrix ``M``
(``n <= m``) and approximated by one step of subspace iteration per training step,
warm-started from the previous step's factor ``Q`` (``m × r``):

1. ``P = M Q``; allreduce ``P`` (the workers' mean);
2. orthogonalise ``P`` (QR): ``P̂``;
3. ``Q = Mᵀ P̂``; allreduce ``Q``;
4. the update is ``P̂ Qᵀ``; ``Q`` is kept for the next step.

Vectors (biases, norms) travel uncompressed with ``P``. Each phase packs all its
factors into one buffer: two allreduces per step, whatever the number of leaves.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from dtx.paths import path_str


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int, bool]:
    """``(n, m, transposed)``: the leaf as an ``n × m`` matrix with ``n <= m``.

    The shorter side carries P: at full rank ``r = n`` the orthogonalised P is square,
    so ``P̂P̂ᵀ = I`` and the approximation is exact whatever the warm-started Q.
    """
    rows, cols = math.prod(shape[:-1]), shape[-1]
    return (rows, cols, False) if rows <= cols else (cols, rows, True)


def as_matrix(x: jax.Array) -> jax.Array:
    x2 = x.reshape(-1, x.shape[-1])
    return x2.T if matrix_shape(x.shape)[2] else x2


def from_matrix(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return (x.T if matrix_shape(shape)[2] else x).reshape(shape)


def matrices(tree: Any) -> list[tuple[int, str, tuple[int, ...], int, int]]:
    """``(leaf index, name, shape, n, m)`` of every leaf of ``tree`` with two or more dimensions."""
    found = []
    for i, (path, x) in enumerate(jax.tree_util.tree_flatten_with_path(tree)[0]):
        if jnp.ndim(x) >= 2:
            n, m, _ = matrix_shape(jnp.shape(x))
            found.append((i, path_str(path), tuple(jnp.shape(x)), n, m))
    return found


def initial_q(index: int, m: int, rank: int) -> jax.Array:
    """The first ``Q`` of leaf ``index``: a fixed-seed normal, the same on every worker."""
    return jax.random.normal(jax.random.fold_in(jax.random.key(0), index), (m, rank), jnp.float32)


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.matmul(a, b, precision=lax.Precision.HIGHEST)


def _packed(tree: Any, allreduce: Callable[[Any], Any]) -> tuple[Any, jax.ShapeDtypeStruct]:
    """``allreduce`` of every leaf of ``tree`` packed into one flat float32 buffer.

    One message per phase, as PowerSGD's reference implementation packs its factors
    (Vogels et al. 2019, §4): the second phase then depends on the whole first one, and
    every phase is one allreduce the accountant counts, whatever the algorithm.
    Returns the reduced tree and the buffer's shape.
    """
    leaves, treedef = jax.tree.flatten(tree)
    sizes = [x.size for x in leaves]
    buffer = jax.ShapeDtypeStruct((sum(sizes),), jnp.float32)
    if not buffer.shape[0]:
        return tree, buffer
    flat = allreduce(jnp.concatenate([x.reshape(-1) for x in leaves]))
    pieces = jnp.split(flat, list(itertools.accumulate(sizes))[:-1])
    return treedef.unflatten([y.reshape(x.shape) for y, x in zip(pieces, leaves)]), buffer


def power_step(v: list[jax.Array], q: dict[str, jax.Array], allreduce: Callable[[Any], Any]
               ) -> tuple[list[jax.Array], dict[str, jax.Array], dict[str, jax.Array], tuple[Any, Any]]:
    """One PowerSGD step (steps 1–4 of the module docstring) on this worker's float32 leaves.

    Args:
      v: this worker's leaves (its error-feedback residual already added), float32.
      q: the warm-started factors, ``{str(leaf index): (m, r)}`` for every matrix leaf.
      allreduce: ``tree -> mean over the workers``.

    Returns:
      ``(mean, q, mine, messages)``: the decoded mean per leaf (identical on every worker);
      the new factors; this worker's own approximation ``P̂(MᵀP̂)ᵀ`` per matrix leaf, whose
      difference from ``v`` is what its message lost (Vogels et al., Alg. 2: the residual);
      and the shapes of the two buffers allreduced (all P's with the vectors, all Q's).
    """
    mats = {str(i): as_matrix(x) for i, x in enumerate(v) if x.ndim >= 2}
    vectors = {str(i): x for i, x in enumerate(v) if x.ndim < 2}
    first, first_buffer = _packed({"p": {i: _dot(m, q[i]) for i, m in mats.items()}, "vectors": vectors}, allreduce)
    p_hat = {i: jnp.linalg.qr(p)[0] for i, p in first["p"].items()}
    q_local = {i: _dot(m.T, p_hat[i]) for i, m in mats.items()}
    q_new, second_buffer = _packed(q_local, allreduce)
    approx = {i: from_matrix(_dot(p_hat[i], q_new[i].T), v[int(i)].shape) for i in mats}
    mean = [approx[str(i)] if str(i) in approx else first["vectors"][str(i)] for i in range(len(v))]
    mine = {i: from_matrix(_dot(p_hat[i], q_local[i].T), v[int(i)].shape) for i in mats}
    return mean, q_new, mine, (first_buffer, second_buffer)
