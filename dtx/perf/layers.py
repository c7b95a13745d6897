"""A model's layers as the performance model sees them: per-layer FLOPs, weights and activations.

:func:`analyze` reads them off any flax model by abstract evaluation (``jax.eval_shape`` +
``nn.intercept_methods``; nothing runs), for :mod:`dtx.perf.model`'s iteration-time model and
:mod:`dtx.perf.memory`'s estimates (Das et al., arXiv 1602.06709, §3: compute against communication,
layer by layer).

Convention: forward = 2·MACs FLOPs; backward = 2× forward (one GEMM for the input gradient, one
for the weight gradient), so a training step is 6·MACs. MACs count only the kernel taps that land
inside the (unpadded) input — what a device computes, and what XLA's cost analysis counts; the
papers' tables count every tap (:attr:`Layer.macs`), 1–2 % more for VGG-A at 224×224, but 2× more
for a 3×3 map padded to 2×2. Only Dense/Conv layers are counted: element-wise layers are ≲1 % of
the FLOPs and XLA fuses them into their neighbours.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


class PerfModelError(ValueError):
    """Bad input to the performance model; the message names the value and the fix."""


@dataclasses.dataclass(frozen=True)
class Layer:
    """A Dense or Conv layer, per example.

    Attributes:
      name: parameter path of the layer, e.g. ``"fc6"`` or ``"stage2_block1/conv1"``.
      kind: ``"dense"`` or ``"conv"``.
      macs: forward multiply-accumulates per example (summed over calls if shared),
        every kernel tap counted, padding included — the convention of the papers' tables.
      weights: parameters of the layer (kernel + bias).
      in_elements / out_elements: activation elements per example, input and output.
      kernel_shape: the kernel's shape; its last dimension is the output features.
    """

    name: str
    kind: str
    macs: int
    weights: int
    in_elements: int
    out_elements: int
    kernel_shape: tuple[int, ...]
    valid_macs: int = -1  # taps inside the input only (what runs); -1: same as macs

    @property
    def computed_macs(self) -> int:
        """Multiply-accumulates a device performs per example: padding taps excluded."""
        return self.macs if self.valid_macs < 0 else self.valid_macs

    @property
    def forward_flops(self) -> int:
        return 2 * self.computed_macs

    @property
    def train_flops(self) -> int:
        """Forward + backward FLOPs per example: 3 × forward (see module docstring)."""
        return 6 * self.computed_macs


def analyze(model: nn.Module, input_shape: Sequence[int], *, dtype: Any = jnp.float32) -> tuple[Layer, ...]:
    """Per-layer statistics of ``model`` on examples of ``input_shape`` (no batch dim), abstractly.

    ``model.init`` runs under ``jax.eval_shape`` with every Dense/Conv ``__call__``
    intercepted to record its input, output and parameter shapes, so a full-size
    VGG-A costs a trace, never a FLOP. MACs per output element = ``prod(kernel[:-1])``
    (for Dense ``in``, for Conv ``kh·kw·C_in/groups``).
    """
    found: dict[str, dict[str, Any]] = {}

    def record(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        module = context.module
        if context.method_name == "__call__" and isinstance(module, (nn.Dense, nn.Conv)):
            name = "/".join(module.path)
            params = module.variables["params"]
            kernel = tuple(params["kernel"].shape)
            macs = math.prod(out.shape[1:]) * math.prod(kernel[:-1])
            valid = macs if isinstance(module, nn.Dense) else _valid_conv_macs(module, args[0].shape, out.shape, kernel)
            entry = found.setdefault(name, dict(
                kind="dense" if isinstance(module, nn.Dense) else "conv", macs=0, valid_macs=0,
                weights=sum(math.prod(p.shape) for p in jax.tree.leaves(params)),
                in_elements=math.prod(args[0].shape[1:]), out_elements=0, kernel_shape=kernel))
            entry["macs"] += macs
            entry["valid_macs"] += valid
            entry["out_elements"] += math.prod(out.shape[1:])
        return out

    x = jax.ShapeDtypeStruct((1, *map(int, input_shape)), dtype)
    with nn.intercept_methods(record):
        jax.eval_shape(lambda x: model.init(jax.random.key(0), x, train=False), x)  # the key too: nothing runs
    if not found:
        raise PerfModelError(f"{type(model).__name__} has no nn.Dense or nn.Conv layers to model")
    return tuple(Layer(name=name, **entry) for name, entry in found.items())


def _valid_conv_macs(conv: nn.Conv, in_shape, out_shape, kernel) -> int:
    """Forward MACs of one example of ``conv`` counting only taps inside the input.

    Per spatial dimension, each output position sees the kernel taps that fall inside
    ``[0, in)`` after padding; dimensions are independent, so the count is the product
    of per-dimension sums times ``C_in/groups · C_out``. Circular padding and input
    dilation (every tap meaningful, or rarely used) fall back to the full count.
    """
    spatial = len(kernel) - 2
    full = math.prod(out_shape[1:]) * math.prod(kernel[:-1])
    if conv.padding == "CIRCULAR" or any(d != 1 for d in _per_dim(conv.input_dilation, spatial)):
        return full
    strides = _per_dim(conv.strides, spatial)
    dilation = _per_dim(conv.kernel_dilation, spatial)
    taps = 1
    for d in range(spatial):
        size, k, s, r, out = in_shape[1 + d], kernel[d], strides[d], dilation[d], out_shape[1 + d]
        if conv.padding == "SAME":
            low = max((out - 1) * s + (k - 1) * r + 1 - size, 0) // 2
        elif conv.padding == "VALID":
            low = 0
        elif conv.padding == "CAUSAL":
            low = (k - 1) * r
        else:
            pads = conv.padding if not isinstance(conv.padding, int) else [(conv.padding, conv.padding)] * spatial
            low = pads[d] if isinstance(pads[d], int) else pads[d][0]
        taps *= sum(1 for o in range(out) for t in range(k) if 0 <= o * s - low + t * r < size)
    return taps * kernel[-2] * kernel[-1]


def _per_dim(value, spatial: int) -> tuple[int, ...]:
    if value is None:
        return (1,) * spatial
    return (value,) * spatial if isinstance(value, int) else tuple(value)
