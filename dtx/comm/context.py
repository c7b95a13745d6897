"""The workers of a step and what they send: the context every communicating plug-in stands on.

Compressors (:mod:`dtx.compress`) and strategies (:mod:`dtx.strategies`,
:mod:`dtx.strategies.local_models`) both receive a :class:`CommContext` and count their traffic
with the accountant here; neither imports the other.

**Placement** says who places the step's collectives:

* ``explicit`` — the ``shard_map`` driver: plug-ins call ``ctx.allreduce`` and other
  collectives over ``ctx.axes`` themselves, and count what they send;
* ``compiler`` — the ``jit`` driver: XLA's partitioner places them (``allreduce`` is
  the identity, the gradient is already global); their bytes are read from the
  compiled program (:mod:`dtx.comm.hlo`), not counted while tracing;
* ``none`` — the same workers with every collective of the gradient path removed
  (``dtx bench step``'s yardstick): each keeps its own gradient, nothing is sent.

**The accountant's one rule for ``psum``.** XLA's all-reduce schedule is the backend's
choice and not visible in the program, so ``lax.psum``/``pmean`` is modelled as the
ring (the ``psum`` of :mod:`dtx.comm.algorithms`): its bytes for every leaf or bucket, and — because
XLA's all-reduce combiner merges the independent psums of one call into one op — one
``2(p−1)``-round schedule per call (:func:`psum_traffic`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from dtx.comm import costmodel
from dtx.comm.algorithms import get_algorithm

PyTree = Any
Stats = dict[str, jax.Array]


class Capabilities(NamedTuple):
    """What a plug-in (strategy or compressor) does, declared by it: the step and the checks read
    these, never a plug-in's name, so a new plug-in needs no edit outside its module and registry.

    Attributes:
      identity: leaves data parallelism's gradient all-reduce as it is (``sync``, ``none``): the
        step may then run under ``jit`` (XLA places the all-reduce), beside ZeRO or a partitioned
        model, and under ``shard_map`` with the replication checker on.
      reduces_once: reduces the gradients exactly once per step (one finiteness verdict for loss
        scaling, a ``grad_norm`` of the applied gradient).
      local_models: workers hold their own parameters (no gradient reduction most steps).
      allreduce: a compressor whose payload travels by ``ctx.allreduce`` (a ``psum`` then merges
        with the step's metric averages); the others all-gather or all-to-all their payloads.
      drops: a strategy's step applies all gradients but those of the ``drops`` slowest workers
        (backup workers): the simulated clock (:mod:`dtx.perf.simclock`) waits for the others only.
      runs_ahead: a strategy lets a worker run up to this many steps ahead of the slowest (async,
        ssp: the staleness bound); 0: every step waits for the workers it reduces.
      overlaps: a local-model strategy's exchange, sent at step ``k``, is first needed at the end of
        step ``k + overlaps`` (Streaming DiLoCo's ``τ``): the workers compute on meanwhile.
    """

    identity: bool = False
    reduces_once: bool = True
    local_models: bool = False
    allreduce: bool = True
    drops: int = 0
    runs_ahead: int = 0
    overlaps: int = 0


class CommContext(NamedTuple):
    """How the workers of one step talk to each other.

    Attributes:
      axes: mesh axes the workers span (``placement="explicit"``: collectives run over them).
      size: number of workers ``p``.
      allreduce: ``tree -> mean over the workers`` with the configured algorithm
        (the identity unless ``placement="explicit"``).
      algorithm: that algorithm's name, for the accountant (``psum``: :func:`psum_traffic`).
      inner: inner-axis size for the ``hierarchical`` algorithm, else ``None``.
      bucket_bytes: the allreduce's bucket size (0: leaf by leaf), for the accountant.
      placement: who places the collectives (module docstring): ``explicit``, ``compiler``, ``none``.
    """

    axes: tuple[str, ...]
    size: int
    allreduce: Callable[[PyTree], PyTree]
    algorithm: str = "psum"
    inner: int | None = None
    bucket_bytes: int = 0
    placement: str = "explicit"

    @property
    def native(self) -> bool:
        """The algorithm is XLA's own all-reduce, which XLA's combiner merges with the call's other ones."""
        return get_algorithm(self.algorithm).native

    @property
    def explicit(self) -> bool:
        """Collectives are the plug-ins' to run (and to count)."""
        return self.placement == "explicit"


def compiler(size: int) -> CommContext:
    """The ``jit`` driver's context: XLA places the collectives of ``size`` workers."""
    return CommContext((), size, _identity, "psum", placement="compiler")


def silent(ctx: CommContext) -> CommContext:
    """The same workers with the collectives taken out: each keeps its own gradient."""
    return ctx._replace(axes=(), allreduce=_identity, placement="none")


def worker_index(ctx: CommContext) -> jax.Array:
    """This worker's index in ``[0, ctx.size)`` (0 where collectives are not explicit)."""
    return lax.axis_index(ctx.axes) if ctx.explicit and ctx.axes else jnp.zeros((), jnp.int32)


def count_scalar(count: int) -> jax.Array:
    """An exact count as a device scalar: int32 while it fits, float32 beyond 2**31."""
    return jnp.asarray(count, jnp.int32 if count < 2**31 else jnp.float32)


def traffic_stats(traffic: costmodel.Traffic) -> Stats:
    """A static :class:`dtx.comm.costmodel.Traffic` as step metrics (``comm_bytes``, ``comm_rounds``)."""
    return {"comm_bytes": count_scalar(traffic.bytes_sent), "comm_rounds": count_scalar(traffic.messages)}


def psum_traffic(traffic: costmodel.Traffic, p: int) -> costmodel.Traffic:
    """``lax.psum``/``pmean`` of a tree in one call, counted as XLA compiles it: the ring's bytes,
    one ``2(p−1)``-round schedule for the call (XLA:CPU merges up to 256 operands into one op:
    larger trees take more rounds than counted; docs/compression.md)."""
    return costmodel.Traffic(2 * (p - 1), traffic.bytes_sent) if traffic.bytes_sent else traffic


def allreduce_traffic(tree: PyTree, ctx: CommContext, dtype: Any = None) -> costmodel.Traffic:
    """What ``ctx.allreduce(tree)`` sends: leaf by leaf or bucket by bucket, ``psum`` as one op;
    nothing unless the collectives are explicit (under ``jit`` the compiled program says)."""
    if not ctx.explicit:
        return costmodel.Traffic(0, 0)
    traffic = costmodel.dense_allreduce_traffic(tree, ctx.size, ctx.algorithm, dtype, ctx.inner, ctx.bucket_bytes)
    return psum_traffic(traffic, ctx.size) if ctx.native else traffic


def pmean_traffic(tree: PyTree, p: int) -> costmodel.Traffic:
    """One ``lax.pmean`` of ``tree`` over ``p`` workers (the step's metric averages, a count)."""
    return psum_traffic(costmodel.dense_allreduce_traffic(tree, p, "ring"), p)


def _identity(tree: PyTree) -> PyTree:
    return tree
