"""Pipeline stages whose sequences are split over the ``context`` axis: context parallelism inside each stage.

A mesh with both a ``stage`` and a ``context`` axis runs the pipeline (:mod:`dtx.parallel.pipeline.step`; GPipe:
Huang et al. 2019, 1F1B: Narayanan et al. 2021) on ``1/C`` of every sequence per device: each device of a stage's
context group holds ``S/C`` positions of each example of its micro-batches — chunk ``i`` of ``C``, or balanced
chunks ``i`` and ``2C − 1 − i`` of ``2C`` (:mod:`dtx.parallel.context.attention`) — and every attention of a stage's
blocks runs the chosen kernel (``context.attention``: the ring, the all-gather or Ulysses) over the axis, as the
``context`` layout runs them under ``jit`` (Liu et al. 2023; Llama 3, Dubey et al. 2024; Jacobs et al. 2023).
The pipeline step is one ``shard_map`` manual over every axis, so the kernels run as they are, inside each stage's
slot; each attention module is intercepted (``nn.intercept_methods``) and cloned with the kernel as its
``attention_fn``. The model is unchanged.

What lives where:

* **the batch**: the ``context`` axis takes no examples, so every device of a context group receives its data
  shard's micro-batches whole.
* **the ends**: the model's first piece (the embedding and its learned positions, a lookup) runs on the whole
  sequence and each device keeps its own positions (:meth:`ContextStagePlan.own`), so positions stay the global
  ones; the last stage scores its own positions against their labels (kept the same way), and its loss is the
  mean over them.
* **the boundary buffer**: a device's ``S/C`` positions go to the same ``context`` index of the next stage
  (:attr:`ContextStagePlan.boundary_widths`): the pipeline's messages shrink ``C`` times.
* **the reduction**: each device's loss is the mean over its ``1/C`` of the tokens, the same number on every
  device, so the step's loss — the mean over every token — is their mean over ``context``; and each device's
  gradient is that of its own loss (the kernels' transposes bring the key and value gradients home), so the
  gradient row is averaged over ``context`` with the data axes in the one all-reduce of the step
  (:func:`reduce_axes`).

A model takes part when every piece after its first takes a ``(positions, features)`` stream that ``2C`` (balanced)
or ``C`` divides; refused otherwise, naming the fix (:func:`context_plan`). Megatron's split over a ``model``
axis inside the same stages is refused (:func:`dtx.parallel.pipeline.step.make_pipeline`).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from dtx.parallel.context import CONTEXT_AXIS
from dtx.parallel.context import attention as kernels
from dtx.parallel.context import layout as context_layout
from dtx.parallel.pipeline.stages import PipelineError, StagePlan


@dataclasses.dataclass(frozen=True)
class ContextStagePlan(StagePlan):
    """A :class:`StagePlan` whose stages run on ``1/C`` of every sequence (module docstring).

    Attributes:
      context: ``C``, the devices of the ``context`` axis.
      attention: the kernel (``context.attention``: :data:`dtx.parallel.context.attention.KINDS`).
      balanced: each device holds chunks ``i`` and ``2C − 1 − i`` of ``2C`` (``context.balance``), else chunk ``i``.
      calls: per layer, the width of each attention the kernel runs for it (:func:`attention_widths`; none for the
        first layer, which runs whole): what :func:`context_traffic` charges.
    """

    context: int = 1
    attention: str = "ring"
    balanced: bool = True
    calls: tuple = ()  # per layer, the width of each attention it calls (the first layer's run whole: none)

    def local_shape(self, shape) -> tuple[int, ...]:
        """One example's ``(positions, features)`` stream as a device holds it: ``S/C`` positions."""
        return (shape[0] // self.context,) + tuple(shape[1:])

    def own(self, x):
        """This device's positions of ``x`` (axis 1, natural order), by its ``context`` index: its chunk, or its two
        balanced chunks side by side (the layout the kernels take, :func:`dtx.parallel.context.attention.order`)."""
        local = x.shape[1] // self.context
        laid_out = kernels.balance(x, self.context, axis=1, balanced=self.balanced)
        return jax.lax.dynamic_slice_in_dim(laid_out, jax.lax.axis_index(CONTEXT_AXIS) * local, local, axis=1)

    def apply_params(self, stage: int, params, x):
        """Stage ``stage``'s pieces on this device's positions: the model's first piece on the whole sequence, then
        its own positions kept; every attention of the others run by the context kernel."""
        first = self.bounds[stage]
        for i, layer in enumerate(self.stage_layers(stage)):
            piece = {key: params[key] for key in layer.keys}
            if first + i == 0:
                x = self.own(layer.fn(piece, x))
                continue
            with attention_regions(self.attention, self.balanced):
                x = layer.fn(piece, x)
        return x


def attention_regions(attention: str, balanced: bool = True, hits: list | None = None):
    """The interception context that runs every flax attention called inside it by the context kernel
    ``attention`` (:func:`dtx.parallel.context.layout.local_kernel`), refusing one that does not declare itself
    causal; ``hits`` collects the attention modules' names it ran."""
    kernel = context_layout.local_kernel(attention, balanced)

    def intercept(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name != "__call__" or not isinstance(module, nn.MultiHeadDotProductAttention) \
                or getattr(module.attention_fn, "context_kernel", False):  # not an attention, or the clone below
            return next_fun(*args, **kwargs)
        context_layout.check_causal(module)
        if hits is not None:
            hits.append(module.name)
        return context_layout.run_split(module, kernel, args, kwargs)

    return nn.intercept_methods(intercept)


# The kernels a stage cannot run, with why: the ring's hops are collective-permutes inside each stage's slot (a
# branch of the stage's lax.switch, under the slot's lax.cond), and XLA's collective-permute is a rendezvous of every
# device of the program, which the devices of the other stages, running their own slots, never join (measured on
# XLA:CPU: the step deadlocks). The all-gather and Ulysses' all-to-alls rendezvous within their replica groups.
UNSTAGED = {"ring": "context.attention='ring' inside pipeline stages: the ring's hops are collective-permutes "
                    "inside each stage's slot, and every device of the program takes part in an XLA "
                    "collective-permute, so the other stages' devices (running their own slots) never join it; use "
                    "--config.context.attention=allgather (the same bytes) or ulysses, or drop the 'stage' axis"}


def context_split(plan: StagePlan) -> int:
    """Over how many devices of ``context`` a pipeline's sequences are split (``C``, else 1)."""
    return getattr(plan, "context", 1)


def reduce_axes(plan: StagePlan) -> tuple[str, ...]:
    """The axes a pipeline's gradient row and records are averaged over beside the data axes: ``context`` where
    the plan splits sequences over it (module docstring)."""
    return (CONTEXT_AXIS,) if context_split(plan) > 1 else ()


def own_labels(plan: StagePlan, labels):
    """The labels of this device's positions (a sequence's, axis 1 of ``(micro, positions)``), or all of them."""
    return plan.own(labels) if context_split(plan) > 1 else labels


def context_plan(plan: StagePlan, abstract_params, size: int, attention: str = "ring",
                 balanced: bool = True) -> ContextStagePlan:
    """``plan`` with every sequence split over ``size`` devices of ``context`` (module docstring). Refused, naming
    the fix: a piece after the first whose input is not a ``(positions, features)`` stream ``2·size`` (balanced)
    or ``size`` divides, and Ulysses over heads ``size`` does not divide (read where the kernel runs)."""
    if attention not in kernels.ATTENTION:
        raise PipelineError(f"context.attention={attention!r}: choose one of {', '.join(kernels.KINDS)}")
    if attention in UNSTAGED:
        raise PipelineError(UNSTAGED[attention])
    chunks = 2 * size if balanced else size
    for layer in plan.layers[1:]:
        length = layer.in_shape[0] if len(layer.in_shape) == 2 else None
        if length is None or length % chunks:
            what = (f"{length} positions" if length is not None else f"input shaped {layer.in_shape} (not "
                    "(positions, features))")
            raise PipelineError(f"a {CONTEXT_AXIS!r} mesh axis of size {size} splits pipeline piece {layer.name!r}'s "
                                f"{what} into {chunks} chunks" + (" (balanced: context.balance=True)" if balanced
                                                                  else "")
                                + f", which does not divide them; use a sequence length divisible by {chunks} "
                                "(dataset.seq_len), a model of sequences, or drop the context axis")
    calls = ((),) + tuple(attention_widths(layer, abstract_params) for layer in plan.layers[1:])
    return ContextStagePlan(plan.layers, plan.bounds, plan.chunks, size, attention, bool(balanced), calls,
                            row_multiple=plan.row_multiple)


def context_traffic(plan: StagePlan, schedule, micro: int, itemsize: int):
    """What one device of the busiest stage sends over ``context`` per step (:mod:`dtx.comm.costmodel`), by formula:
    each of a stage's attention calls (:attr:`ContextStagePlan.calls`) moves its kernel's forward bytes in the
    forward slot and, in the backward slot, the forward's again (the slot re-runs the stage from its kept input,
    GPipe's re-materialisation) and the backward's — ``3/2`` of
    :func:`dtx.parallel.context.costs.block_bytes`'s forward-and-backward, per micro-batch of ``micro`` examples,
    in the compute dtype's ``itemsize``; the messages are the kernel's collectives (2 per call forward and
    backward: the keys' and the values'; Ulysses 4)."""
    from dtx.comm import costmodel
    from dtx.parallel.context import costs

    if context_split(plan) == 1:
        return costmodel.Traffic(0, 0)
    length = plan.layers[0].out_shape[0]  # the whole sequence's positions
    per_call = 4 if plan.attention == "ulysses" else 2  # collectives of one call one way (q, k, v, out / k, v)

    def device(s):
        widths = [w for c in range(plan.chunks) for i in range(*plan.bounds[c * plan.devices + s: c * plan.devices
                                                                            + s + 2]) for w in plan.calls[i]]
        sent = sum(1.5 * costs.block_bytes(plan.attention, micro, length, w, plan.context, itemsize) for w in widths)
        return costmodel.Traffic(schedule.micro * 3 * per_call * len(widths), round(schedule.micro * sent))
    return max((device(s) for s in range(plan.devices)), key=lambda traffic: traffic.bytes_sent)


def attention_widths(layer, abstract_params) -> tuple[int, ...]:
    """The width (heads × head width) of each flax attention ``layer`` calls, traced at one example (nothing
    runs)."""
    widths = []

    def record(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name == "__call__" and isinstance(module, nn.MultiHeadDotProductAttention):
            widths.append(module.qkv_features or args[0].shape[-1])
        return next_fun(*args, **kwargs)

    params = {key: abstract_params[key] for key in layer.keys}
    with nn.intercept_methods(record):
        # a fresh function: jax caches a trace by the function, and the plan has traced layer.fn at these shapes
        jax.eval_shape(lambda p, x: layer.fn(p, x), params,
                       jax.ShapeDtypeStruct((1,) + tuple(layer.in_shape), jnp.float32))
    return tuple(widths)
