"""Where a context-parallel step's activations live: every sequence split over the ``context`` axis.

Under the ``jit`` driver (:mod:`dtx.step.jit`) the state is whole on every device of the axis and the batch is
split over the data axes only (the ``context`` axis declares ``batch=False``): each device of a context group
receives its examples' whole token ids. The activation context (:class:`ContextSplit`) then pins every
``(batch, positions, features)`` array a module takes or returns to the positions' split over ``context`` —
``S/C`` contiguous positions on each device — so the embedding, LayerNorms, projections, MLP, head and loss run
on ``1/C`` of the tokens, and XLA sums each parameter's gradient over the axis as it sums it over the batch.
Attention is the one layer that needs other devices' positions: every ``nn.MultiHeadDotProductAttention`` call
runs with its ``attention_fn`` replaced by the chosen kernel of :mod:`~dtx.parallel.context.attention`
(``context.attention``: ``ring``, ``allgather`` or ``ulysses``) inside a ``shard_map`` over the data axes and
``context``. Positions stay the global ones (the position table is indexed by the whole sequence before it is
split) and the loss is the mean over every token of every chunk (the task sees the global logits).

The kernels compute causal self-attention, so a module is run this way only when its ``attention_fn`` declares
itself causal (``attention_fn.causal``: the zoo transformer's :func:`dtx.models.transformer.causal_attention`);
anything else is refused when the step is traced, naming the module. The sequence keeps its natural order here
(``balanced=False``): the kernels compute every block and mask it, so every device does the same work either way.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dtx import mesh as mesh_lib
from dtx.config import ConfigError, register_check
from dtx.parallel.context import CONTEXT_AXIS
from dtx.parallel.context import attention as kernels


class ContextError(ValueError):
    """A module or setting context parallelism cannot run, named with the fix."""


@dataclasses.dataclass(frozen=True, eq=False)
class ContextSplit:
    """The activation context of a context-parallel step (module docstring): call it for a context manager."""

    mesh: Mesh
    attention: str = "ring"
    mappable: ClassVar[bool] = False  # no per-shard map for gradient accumulation (dtx.step.accumulate)
    manual: ClassVar[bool] = False

    def __post_init__(self):
        if self.attention not in kernels.ATTENTION:
            raise ContextError(f"context.attention={self.attention!r}: choose one of {', '.join(kernels.KINDS)}")

    @property
    def spec(self) -> P:
        batch = mesh_lib.batch_axes(self.mesh)
        return P(batch[0] if len(batch) == 1 else (batch or None), CONTEXT_AXIS)

    def attention_fn(self, query, key, value, *args, **kwargs):
        """flax's ``attention_fn`` signature: the kernel over the split positions (``mask``, ``bias`` and dropout
        are what the declared-causal function ignores too)."""
        kernel = functools.partial(kernels.ATTENTION[self.attention], axis=CONTEXT_AXIS, balanced=False)
        return jax.shard_map(kernel, mesh=self.mesh, in_specs=(self.spec,) * 3, out_specs=self.spec)(
            query, key, value)

    def __call__(self):
        split = NamedSharding(self.mesh, self.spec)

        def constrain(x):
            return jax.lax.with_sharding_constraint(x, split) if getattr(x, "ndim", 0) == 3 else x

        def intercept(next_fun, args, kwargs, context):
            module = context.module
            if context.method_name != "__call__":
                return next_fun(*args, **kwargs)
            if isinstance(module, nn.MultiHeadDotProductAttention) and \
                    getattr(module.attention_fn, "__self__", None) is not self:  # not the clone below
                if not getattr(module.attention_fn, "causal", False):
                    raise ContextError(
                        f"{module.name}: context parallelism runs causal self-attention, and its attention_fn "
                        f"{getattr(module.attention_fn, '__name__', module.attention_fn)!r} does not declare itself "
                        "causal (set attention_fn.causal = True on a causal one, as dtx.models.transformer's "
                        "causal_attention does; attention dropout, model.dropout_rate > 0, uses flax's masked "
                        "attention instead: set model.dropout_rate=0) or drop the context axis")
                params = module.variables["params"]
                local = module.clone(parent=None, name=None, attention_fn=self.attention_fn)
                return constrain(local.apply({"params": params}, *jax.tree.map(constrain, args), **kwargs))
            return jax.tree.map(constrain, next_fun(*jax.tree.map(constrain, args), **kwargs))

        return nn.intercept_methods(intercept)


def context_split(specs, mesh: Mesh, attention: str = "ring") -> ContextSplit:
    """The layout's activation factory (:attr:`dtx.parallel.Layout.activation_factory`): ``specs`` (the
    parameters' partition specs, whole here) are not read."""
    if CONTEXT_AXIS not in mesh.axis_names:
        raise ContextError(f"parallel.name=context splits sequences over a {CONTEXT_AXIS!r} mesh axis, and the mesh "
                           f"{dict(mesh.shape)} has none: add one, e.g. --config.mesh='((\"data\", 2), "
                           "(\"context\", 4))'")
    return ContextSplit(mesh, attention)


@register_check
def check_config(config) -> None:
    """``context.attention`` names a kernel, before anything is built."""
    if config.context.attention not in kernels.ATTENTION:
        raise ConfigError(f"context.attention={config.context.attention!r}: choose one of {', '.join(kernels.KINDS)}")
