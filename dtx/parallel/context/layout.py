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
anything else is refused when the step is traced, naming the module.

Load balancing (``context.balance``, the default): the drivers hand the step its batch through :meth:`prepare`,
which permutes every ``(batch, positions, ...)`` array along its positions so that the contiguous split gives
device ``i`` chunks ``i`` and ``2C − 1 − i`` of ``2C`` (inputs and labels alike; the whole sequence is on every
device of a context group, so nothing moves between devices), and the model is called with ``positions=`` their
global positions (its position table and the kernels' causal masks follow them). The ring then computes the same
number of blocks on every device; contiguous (``context.balance=False``), device ``i`` computes ``i + 1``.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import ClassVar

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dtx import mesh as mesh_lib
from dtx.config import ConfigError, register_check
from dtx.parallel.context import CONTEXT_AXIS
from dtx.parallel.context import attention as kernels
from dtx.parallel.tensor import layout as tensor_layout


class ContextError(ValueError):
    """A module or setting context parallelism cannot run, named with the fix."""


@dataclasses.dataclass(frozen=True, eq=False)
class ContextSplit:
    """The activation context of a context-parallel step (module docstring): call it for a context manager."""

    mesh: Mesh
    attention: str = "ring"
    balance: bool = True
    mappable: ClassVar[bool] = False  # no per-shard map for gradient accumulation (dtx.step.accumulate)
    manual: ClassVar[bool] = False

    def __post_init__(self):
        if self.attention not in kernels.ATTENTION:
            raise ContextError(f"context.attention={self.attention!r}: choose one of {', '.join(kernels.KINDS)}")

    @property
    def spec(self) -> P:
        batch = mesh_lib.batch_axes(self.mesh)
        return P(batch[0] if len(batch) == 1 else (batch or None), CONTEXT_AXIS)

    axis: ClassVar[str] = CONTEXT_AXIS

    def attention_fn(self, query, key, value, *args, **kwargs):
        """flax's ``attention_fn`` signature: the kernel over the split positions (``mask``, ``bias`` and dropout
        are what the declared-causal function ignores too)."""
        return jax.shard_map(self._kernel, mesh=self.mesh, in_specs=(self.spec,) * 3, out_specs=self.spec)(
            query, key, value)

    def _kernel(self, query, key, value, *args, **kwargs):
        """The chosen kernel on this device's chunk, inside a region manual over the ``context`` axis."""
        return local_kernel(self.attention, self.balance)(query, key, value)

    def local_attention(self, module: nn.Module):
        """The ``attention_fn`` of ``module`` run inside a region manual over ``context`` (a Megatron region's
        heads: :mod:`dtx.parallel.tensor.layout`): the chosen kernel, for a module that declares its own causal."""
        check_causal(module)
        return self._kernel

    def root_kwargs(self, module: nn.Module, args, kwargs) -> dict:
        """``kwargs`` of a module's call, with ``positions=`` the balanced sequence's global positions where the
        module is the model itself (not a clone or a layer below it) and the split is balanced."""
        if not (self.balance and module.scope is not None and not module.scope.path and args
                and not isinstance(module, nn.MultiHeadDotProductAttention)):
            return kwargs
        if "positions" not in inspect.signature(type(module).__call__).parameters:
            raise ContextError(f"{type(module).__name__} takes no positions= argument, which context.balance "
                               "hands the permuted sequence's global positions to: add one (as "
                               "dtx.models.transformer.Transformer has) or set --config.context.balance=False")
        return {**kwargs, "positions": kernels.order(self.size, args[0].shape[1], balanced=True)}

    @property
    def size(self) -> int:
        return self.mesh.shape[CONTEXT_AXIS]

    def memory(self, model: nn.Module, example, dtype):
        """What the memory model (:mod:`dtx.run.memory_check`) estimates a device as: ``(shape, sharing, adjust)``,
        one example's input at its ``S/C`` positions (the model's data-parallel estimate there), the devices that
        share each example (the axis's ``C``), and ``adjust(examples, estimate)``, that estimate with the bytes its
        attention adds beyond it (:func:`dtx.parallel.context.costs.memory_bytes`, per attention call of ``model``
        on ``example``, with the caller's examples per device) added to its activations."""
        from dtx.parallel.context import costs

        positions = example.shape[1]
        calls = attention_calls(model, example)

        def adjust(examples: int, found):
            more = costs.memory_bytes(self.attention, calls, examples, positions, self.size, dtype)
            return dataclasses.replace(found, activations=found.activations + more, total=found.total + more)

        return (positions // self.size, *example.shape[2:]), self.size, adjust

    def prepare(self, batch):
        """The batch as the devices hold it (the drivers call this first): balanced, every array of the inputs'
        ``(batch, positions, ...)`` shape permuted along its positions (:func:`.attention.order`) — inputs and
        labels alike, so the loss, a mean over every token, is unchanged; the whole sequence is on every device
        of a context group, so the permutation moves nothing between devices."""
        if not self.balance:
            return batch
        inputs = batch["inputs"] if isinstance(batch, dict) and "inputs" in batch else jax.tree.leaves(batch)[0]
        if getattr(inputs, "ndim", 0) < 2:
            return batch
        length = inputs.shape[1]
        order = kernels.order(self.size, length, balanced=True)
        return jax.tree.map(lambda x: x[:, order] if getattr(x, "ndim", 0) >= 2 and x.shape[1] == length else x,
                            batch)

    def __call__(self):
        split = NamedSharding(self.mesh, self.spec)

        def constrain(x):
            return jax.lax.with_sharding_constraint(x, split) if getattr(x, "ndim", 0) == 3 else x

        def intercept(next_fun, args, kwargs, context):
            module = context.module
            if context.method_name != "__call__":
                return next_fun(*args, **kwargs)
            rooted = self.root_kwargs(module, args, kwargs)
            if rooted is not kwargs:  # the model (not a clone below): its balanced global positions
                return jax.tree.map(constrain, next_fun(*args, **rooted))
            if isinstance(module, nn.MultiHeadDotProductAttention) and \
                    getattr(module.attention_fn, "__self__", None) is not self:  # not the clone below
                check_causal(module)
                return constrain(run_split(module, self.attention_fn, jax.tree.map(constrain, args), kwargs))
            return jax.tree.map(constrain, next_fun(*jax.tree.map(constrain, args), **kwargs))

        return nn.intercept_methods(intercept)


def local_kernel(attention: str, balanced: bool = True):
    """flax's ``attention_fn`` run by kernel ``attention`` of :mod:`~dtx.parallel.context.attention` on this device's
    positions, inside a computation manual over ``context`` (``mask``, ``bias`` and dropout are what the
    declared-causal function it replaces ignores too)."""
    kernel = kernels.ATTENTION[attention]

    def attention_fn(query, key, value, *args, **kwargs):
        return kernel(query, key, value, axis=CONTEXT_AXIS, balanced=balanced)

    attention_fn.context_kernel = True  # a clone already running it is not intercepted again
    return attention_fn


def check_causal(module: nn.Module) -> None:
    """Refuse ``module`` (a flax attention) unless its ``attention_fn`` declares itself causal: the kernels compute
    causal self-attention only."""
    if not getattr(module.attention_fn, "causal", False):
        raise ContextError(
            f"{module.name}: context parallelism runs causal self-attention, and its attention_fn "
            f"{getattr(module.attention_fn, '__name__', module.attention_fn)!r} does not declare itself "
            "causal (set attention_fn.causal = True on a causal one, as dtx.models.transformer's "
            "causal_attention does; attention dropout, model.dropout_rate > 0, uses flax's masked "
            "attention instead: set model.dropout_rate=0) or drop the context axis")


def run_split(module: nn.Module, attention_fn, args, kwargs):
    """``module`` (a flax attention) called with ``attention_fn`` in place of its own, on its own parameters."""
    local = module.clone(parent=None, name=None, attention_fn=attention_fn)
    return local.apply({"params": module.variables["params"]}, *args, **kwargs)


def attention_calls(model: nn.Module, example) -> list[tuple[int, int]]:
    """``(heads, head_dim)`` of each ``nn.MultiHeadDotProductAttention`` call of ``model`` on ``example`` (traced from
    shapes: nothing runs)."""
    calls = []

    def record(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name == "__call__" and isinstance(module, nn.MultiHeadDotProductAttention):
            width = module.qkv_features or args[0].shape[-1]
            calls.append((module.num_heads, width // module.num_heads))
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(lambda x: model.init(jax.random.key(0), x), example)
    return calls


def context_split(specs, mesh: Mesh, attention: str = "ring", balance: bool = True) -> ContextSplit:
    """The layout's activation factory (:attr:`dtx.parallel.Layout.activation_factory`): ``specs`` (the
    parameters' partition specs, whole here) are not read."""
    _check_mesh(mesh)
    return ContextSplit(mesh, attention, bool(balance))


def context_tensor_split(specs, mesh: Mesh, attention: str = "ring", balance: bool = True,
                         sequence_parallel: bool = False) -> tensor_layout.TensorLayout:
    """The activation factory of a ``context`` axis composed with Megatron's split over ``model``: the tensor
    layout (:mod:`dtx.parallel.tensor.layout`, TP or, ``sequence_parallel``, TP + SP) of ``specs`` with every
    sequence split over ``context`` too — positions over ``context`` (and ``model`` under SP) between the pairs,
    each region's ``h/T`` heads attending by the chosen context kernel."""
    _check_mesh(mesh)
    return tensor_layout.tensor_layout(specs, mesh, sequence_parallel, context=ContextSplit(mesh, attention,
                                                                                             bool(balance)))


def _check_mesh(mesh: Mesh) -> None:
    if CONTEXT_AXIS not in mesh.axis_names:
        raise ContextError(f"parallel.name=context splits sequences over a {CONTEXT_AXIS!r} mesh axis, and the mesh "
                           f"{dict(mesh.shape)} has none: add one, e.g. --config.mesh='((\"data\", 2), "
                           "(\"context\", 4))'")


@register_check
def check_config(config) -> None:
    """``context.attention`` names a kernel; on a mesh with a ``context`` axis of known size ``C``, the sequence
    (``dataset.seq_len``) splits into ``2C`` chunks (balanced) or ``C``, and Ulysses' heads (``model.num_heads``)
    divide by ``C`` — refused by key before anything is built."""
    block = config.context
    if block.attention not in kernels.ATTENTION:
        raise ConfigError(f"context.attention={block.attention!r}: choose one of {', '.join(kernels.KINDS)}")
    size = dict((name, size) for name, size in config.mesh).get(CONTEXT_AXIS)
    if not size or size < 1:  # no context axis, or its size is resolved from the devices (-1)
        return
    seq = (config.get("dataset") or {}).get("seq_len")
    chunks = 2 * size if block.balance else size
    if seq and seq % chunks:
        raise ConfigError(f"dataset.seq_len={seq} does not split into {chunks} chunks over the {size} devices of the "
                          f"'context' axis" + (" (balanced: 2 per device, context.balance=True)" if block.balance
                                               else "") + f"; use a sequence length divisible by {chunks}"
                          + (" or --config.context.balance=False" if block.balance and seq % size == 0 else ""))
    heads = (config.get("model") or {}).get("num_heads")
    tensor = dict((name, size) for name, size in config.mesh).get(mesh_lib.MODEL_AXIS, 1)  # Megatron's heads split
    if block.attention == "ulysses" and heads and tensor > 0 and heads % (size * tensor):
        over = f"{size} devices of the 'context' axis" + (f" times the {tensor} of 'model' (each device's "
                                                           f"{heads // tensor} heads)" if tensor > 1 else "")
        raise ConfigError(f"context.attention='ulysses' splits model.num_heads={heads} over the {over}: they must "
                          "divide; use --config.context.attention=ring or allgather")
    sp = (config.get("tensor") or {}).get("sequence_parallel")
    if seq and sp and tensor > 1 and seq % (size * tensor):
        raise ConfigError(f"dataset.seq_len={seq} with tensor.sequence_parallel=True splits over the {size} devices "
                          f"of 'context' and the {tensor} of 'model': use a sequence length divisible by "
                          f"{size * tensor}, or tensor.sequence_parallel=False")
