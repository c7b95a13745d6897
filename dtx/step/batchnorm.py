"""Batch normalisation over the global batch under the ``shard_map`` driver, for any flax module.

Under ``jax.jit`` with sharded inputs (the ``jit`` driver) a ``flax.linen.BatchNorm``
averages its statistics over the whole batch: XLA inserts the collective. Under
``shard_map`` each device sees only its slice, so the same layer silently
normalises each device's few examples on their own — a different model from the
one the ``jit`` driver and a single device train, and a different one again on
another device count. Batch normalisation as its authors define it (Ioffe &
Szegedy 2015) uses the statistics of the whole mini-batch; with synchronous
data parallelism that is the global batch.

:func:`synchronise` gives every ``nn.BatchNorm`` of a module the batch axes as its
``axis_name`` while the module runs in a train step, so both drivers compute the
same numbers. dtx's own models declare a ``norm_axis_name`` field for this and
are cloned with it; any other module is run under a flax method interceptor
that rebinds each ``BatchNorm`` with ``axis_name`` unset to the batch axes — the
user's module needs no change.

Those statistics travel: one all-reduce per layer forward, and one backward (the
cotangents of the mean and the mean of squares, which XLA's combiner merges). They are
the model's messages, not a plug-in's, so the step's accountant counts them from the
traced gradient itself (:func:`model_traffic`): every ``psum`` the model's forward and
backward hold, those that do not depend on one another (one layer's, or layers side by side) as one op.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
from jax.extend import core as jex_core

from dtx.comm import context as comm_lib
from dtx.comm import costmodel


class NormSyncError(ValueError):
    """A batch-norm layer whose own ``axis_name`` the shard_map driver cannot honour."""


def synchronise(model: nn.Module, axes: tuple[str, ...]) -> Any:
    """``model`` with the statistics of every ``nn.BatchNorm`` taken over ``axes`` (inside ``shard_map``).

    Returns the module cloned with ``norm_axis_name=axes`` when it declares that
    field (dtx's models), otherwise an object whose ``apply`` is the module's,
    run under :func:`flax.linen.intercept_methods` with :func:`interceptor`.
    """
    if any(f.name == "norm_axis_name" for f in dataclasses.fields(model)):
        model = model.clone(norm_axis_name=axes)
    return _Synchronised(model, axes)


def interceptor(axes: tuple[str, ...]):
    """A flax method interceptor: ``nn.BatchNorm.__call__`` (or that of a module with :func:`synchronised_statistics`)
    with ``axis_name=None`` runs with ``axes``.

    The layer is cloned onto its own scope (the same variables, the same
    ``batch_stats`` to update) with only ``axis_name`` changed; flax then
    averages the batch mean and variance over ``axes`` with ``lax.pmean``.
    Layers using their running averages compute no statistics and are unaffected.
    """
    wanted = _as_tuple(axes)

    def intercept(next_fun, args, kwargs, context):
        module = context.module
        if not synchronised_statistics(module) or context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        if module.axis_name is None:
            return module.clone(parent=module.scope, axis_name=axes)(*args, **kwargs)
        if _as_tuple(module.axis_name) != wanted:
            path = "/".join(module.scope.path) if module.scope is not None else module.name
            raise NormSyncError(
                f"{type(module).__name__} at {path!r} sets axis_name={module.axis_name!r}, but the shard_map driver splits "
                f"the batch over {wanted}; leave axis_name unset (dtx then averages its statistics over the "
                f"global batch), or use --config.driver=jit (make_train_step(..., driver='jit')), where XLA "
                "averages them with no axis name")
        return next_fun(*args, **kwargs)

    return intercept


def synchronised_statistics(module) -> bool:
    """Whether ``module`` takes statistics over the batch by ``axis_name``: an ``nn.BatchNorm``, or a module that
    declares ``batch_statistics = True`` (a mixture of experts' loads, :mod:`dtx.models.moe`)."""
    return isinstance(module, nn.BatchNorm) or getattr(module, "batch_statistics", False) is True


class _Synchronised:
    """The module, applied with its batch-norm layers synchronised; everything else is the module's."""

    def __init__(self, module: nn.Module, axes: tuple[str, ...]):
        self.module, self.axes = module, axes

    def apply(self, *args, **kwargs):
        with nn.intercept_methods(interceptor(self.axes)):
            return self.module.apply(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.module, name)

    def __repr__(self) -> str:
        return f"synchronise({self.module!r}, {self.axes!r})"


_SUMS = ("psum", "psum_invariant")  # what lax.psum/pmean trace to (pmean: a psum and a division)


def model_traffic(grad_fn, args, axes: tuple[str, ...]) -> costmodel.Traffic:
    """What one call of ``grad_fn(*args)`` (the model's loss and its gradient, traced here once more,
    nothing runs) sends in the collectives it holds itself over ``axes``: synchronised batch norm's.

    XLA's all-reduce combiner runs all-reduces that do not depend on one another as one op: a layer's
    sums of one direction, and also the sums of layers side by side (a ResNet block's projection
    shortcut beside its second convolution, forward and backward). So the sums are taken in the
    traced order and grouped greedily, a new group starting at the first sum that depends on one
    already in the group (:func:`independent_groups`); each group is the bytes of its leaves in one
    ring and one ring's rounds (:func:`dtx.comm.context.psum_traffic`). The gradient's own reduction
    is not in ``grad_fn`` (the body differentiates per-device copies), so nothing is counted twice.
    """
    if not axes:
        return costmodel.Traffic(0, 0)
    groups = independent_groups(jax.make_jaxpr(grad_fn)(*args).jaxpr,
                                lambda eqn: eqn.primitive.name in _SUMS
                                and bool(set(_as_tuple(eqn.params.get("axes", ()))) & set(axes)))
    p = math.prod(jax.lax.axis_size(a) for a in axes)
    return costmodel.add_traffic(costmodel.Traffic(0, 0), *(comm_lib.pmean_traffic(
        [v.aval for eqn in group for v in eqn.invars], p) for group in groups))


def independent_groups(jaxpr, selected) -> list[list]:
    """The ``selected`` equations of ``jaxpr`` (and of the jaxprs inside it) in traced order, cut into groups
    none of whose members depends on another member's result (through any chain of equations). An
    equation holding a jaxpr is followed as one step: its outputs depend on all its inputs and on every
    selected equation inside it."""
    groups: list[list] = []
    ids: list[int] = []  # the current group's members (indices into ``seen``)
    seen: list = []
    depends: dict = {}  # variable -> indices of the selected equations it depends on

    def visit(eqns):
        for eqn in eqns:
            before = frozenset().union(*(depends.get(v, frozenset()) for v in eqn.invars
                                         if not isinstance(v, jex_core.Literal)))
            inner = set()
            for sub in _inner_jaxprs(eqn):
                start = len(seen)
                visit(sub.eqns)
                inner.update(range(start, len(seen)))
            if selected(eqn):
                if groups and before & set(ids):
                    ids.clear()
                if not ids:
                    groups.append([])
                index = len(seen)
                seen.append(eqn)
                groups[-1].append(eqn)
                ids.append(index)
                inner.add(index)
            for v in eqn.outvars:
                depends[v] = before | inner

    visit(jaxpr.eqns)
    return groups


def _inner_jaxprs(eqn):
    for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
            inner = sub if hasattr(sub, "eqns") else getattr(sub, "jaxpr", None)
            if hasattr(inner, "eqns"):
                yield inner


def equations(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside it (jit, shard_map, scans, conds, custom rules)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = sub if hasattr(sub, "eqns") else getattr(sub, "jaxpr", None)
                if hasattr(inner, "eqns"):
                    yield from equations(inner)


def _as_tuple(axes) -> tuple:
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
