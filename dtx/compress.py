"""Gradient compression with error feedback (Hitchhiker's Guide, Chahal et al., arXiv 1810.11787, §5).

A compressor replaces the data-parallel step's allreduce: each worker compresses
its local gradient, the *compressed payload* crosses the mesh, and every worker
decodes the same average. Compressors have the optax shape — a pair of pure
functions with explicit state — and the state (error-feedback residuals, PowerSGD's
warm-started factors, ...) is per worker: it lives in ``TrainState.worker`` and so
in checkpoints.

Selected by ``config.compression.name``; see :data:`COMPRESSORS`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dtx import costmodel

PyTree = Any
Stats = dict[str, jax.Array]


class CompressionError(ValueError):
    """An unknown compressor or a setting out of range; the message says how to fix it."""


class CommContext(NamedTuple):
    """How the workers of one step talk to each other.

    Attributes:
      axes: mesh axes the workers span, for collectives inside ``shard_map``;
        ``()`` when XLA places the collectives itself (the ``jit`` driver).
      size: number of workers ``p``.
      allreduce: ``tree -> mean over the workers`` with the configured algorithm
        (the identity when ``axes == ()``).
      algorithm: that algorithm's name, for the accountant (``psum`` is modelled as ring).
      inner: inner-axis size for the ``hierarchical`` algorithm, else ``None``.
    """

    axes: tuple[str, ...]
    size: int
    allreduce: Callable[[PyTree], PyTree]
    algorithm: str = "psum"
    inner: int | None = None


class Compressor(NamedTuple):
    """A gradient compressor, optax-shaped.

    Attributes:
      name: its registry name.
      init: ``params -> state`` for one worker (unbatched shapes).
      update: ``(grads, state, key, ctx) -> (mean_grads, state, stats)``. Runs per
        worker; ``grads`` are this worker's, ``key`` is the same on every worker
        (fold in the worker index for private randomness), the result is the
        decoded average over workers, identical on every worker. ``stats`` holds
        ``comm_bytes`` (what this worker sent this step) and ``comm_rounds``
        (message rounds), as scalars.
    """

    name: str
    init: Callable[[PyTree], PyTree]
    update: Callable[[PyTree, PyTree, jax.Array, CommContext], tuple[PyTree, PyTree, Stats]]


def traffic_stats(traffic: costmodel.Traffic) -> Stats:
    """A static :class:`dtx.costmodel.Traffic` as step metrics."""
    return {"comm_bytes": count_scalar(traffic.bytes_sent), "comm_rounds": count_scalar(traffic.messages)}


def count_scalar(count: int) -> jax.Array:
    """An exact count as a device scalar: int32 while it fits, float32 beyond 2**31."""
    return jnp.asarray(count, jnp.int32 if count < 2**31 else jnp.float32)


def _modelled(algorithm: str) -> str:
    return "ring" if algorithm == "psum" else algorithm


def none() -> Compressor:
    """No compression: the configured allreduce of the dense gradient."""

    def update(grads, state, key, ctx):
        del key
        traffic = costmodel.dense_allreduce_traffic(grads, ctx.size, _modelled(ctx.algorithm), inner=ctx.inner)
        return ctx.allreduce(grads), state, traffic_stats(traffic)

    return Compressor("none", lambda params: {}, update)


COMPRESSORS: dict[str, Callable[..., Compressor]] = {"none": none}


def make_compressor(name: str, **settings) -> Compressor:
    """The compressor ``name`` built from ``config.compression``'s other keys.

    Keys a compressor does not use are ignored (the config block is shared).
    """
    if name not in COMPRESSORS:
        raise CompressionError(f"compression.name={name!r} is unknown; choose one of {sorted(COMPRESSORS)}")
    return COMPRESSORS[name]()
