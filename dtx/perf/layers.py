"""A model's layers as the performance model sees them: per-layer FLOPs, weights and activations.

:func:`analyze` reads them off any flax model by abstract evaluation (``jax.eval_shape`` +
``nn.intercept_methods``; nothing runs), for :mod:`dtx.perf.model`'s iteration-time model and
:mod:`dtx.perf.memory`'s estimates (Das et al., arXiv 1602.06709, §3: compute against communication,
layer by layer).

Convention: forward = 2·MACs FLOPs; backward = 2× forward (one GEMM for the input gradient, one
for the weight gradient), so a training step is 6·MACs. MACs count only the kernel taps that land
inside the (unpadded) input — what a device computes, and what XLA's cost analysis counts; the
papers' tables count every tap (:attr:`Layer.macs`), 1–2 % more for VGG-A at 224×224, but 2× more
for a 3×3 map padded to 2×2. :func:`analyze` gives the Dense/Conv layers (what dtx's layouts split,
what the planner and the memory model see); :func:`matmuls` every matrix product, attention's too, and
:func:`model_flops` their training FLOPs, MFU's numerator (:mod:`dtx.perf.flops`). Element-wise layers
are not counted: ≲1 % of a CNN's FLOPs, and XLA fuses them into their neighbours (for a width-32
transformer ~10 %: softmax, GELU, LayerNorm; tests/test_layers.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name


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
    # Where the layer's input comes from (:func:`sources`): ``None`` in a chain (the previous layer's output, the
    # model's input for the first), else a layer's name, ``INPUT``, or a :data:`Join` (an add of branches).
    source: Any = None

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
    (for Dense ``in``, for Conv ``kh·kw·C_in/groups``). These are the layers dtx's layouts split over the
    ``model`` axis, as the planner and the memory model see them; :func:`matmuls` adds the model's other
    matrix products (attention), which :func:`model_flops` counts.
    """
    traced = _trace(model, input_shape, dtype)
    layers = tuple(layer for layer in traced[0] if layer.kind in ("dense", "conv"))
    if not layers:
        raise PerfModelError(f"{type(model).__name__} has no nn.Dense or nn.Conv layers to model")
    found = dict(traced[2])
    chain = all(found.get(layer.name, ...) == (layers[i - 1].name if i else INPUT) for i, layer in enumerate(layers))
    if chain:  # a chain's layers as they always were: each takes the previous one's output
        return layers
    return tuple(dataclasses.replace(layer, source=found.get(layer.name, INPUT)) for layer in layers)


def matmuls(model: nn.Module, input_shape: Sequence[int], *, dtype: Any = jnp.float32) -> tuple[Layer, ...]:
    """Every matrix product of ``model``'s forward pass on one example, in call order, abstractly.

    :func:`analyze`'s Dense/Conv layers and, of kind ``"projection"``, ``nn.DenseGeneral`` (attention's
    query/key/value/out projections) and ``nn.Embed.attend`` (a tied output layer: logits against the
    embedding table), and, of kind ``"attention"`` (no weights), each ``nn.MultiHeadDotProductAttention``'s
    score and value products: ``QKᵀ`` and ``AV``, ``S_q·S_kv·H·head_dim`` MACs each, whatever the mask. A
    causal mask does not halve them: the convention of Chowdhery et al. (*PaLM*, arXiv 2204.02311, App. B;
    ``12·L·d·S`` FLOPs per token for a training step) and what XLA runs for ``jax.nn.dot_product_attention``
    (the full product, then the mask). The planner and the memory model take :func:`analyze`'s layers only.
    """
    layers = _trace(model, input_shape, dtype)[0]
    if not layers:
        raise PerfModelError(f"{type(model).__name__} has no matrix products to model")
    return layers


def model_flops(model: nn.Module, input_shape: Sequence[int], *, dtype: Any = jnp.float32) -> int:
    """Model FLOPs of one training example: forward + backward of every matrix product (:func:`matmuls`),
    ``6·MACs``. For a transformer LM of ``L`` blocks of width ``d`` on ``S`` tokens this is Kaplan et al.'s
    (arXiv 2001.08361, §2.1) and PaLM's ``S·(6·N + 12·L·d·S)``, ``N`` the weights of its matrix products
    (the output layer's included, tied or not; biases, norms and position embeddings are not matmuls)."""
    return sum(layer.train_flops for layer in matmuls(model, input_shape, dtype=dtype))


def abstract_variables(model: nn.Module, input_shape: Sequence[int], *, dtype: Any = jnp.float32) -> Any:
    """``model.init``'s variables on one example of ``input_shape``, as shapes and dtypes (``jax.ShapeDtypeStruct``;
    read-only: shared with every caller that asks for the same model), from the same abstract trace as
    :func:`analyze`."""
    return _trace(model, input_shape, dtype)[1]


def per_model(trace):
    """``trace(model, input_shape, dtype)`` remembered per (model, example shape, dtype); what it returns is shared,
    read-only. A flax model is a frozen dataclass, hashed and compared by its settings, so two builds of one model
    share a trace: the memory model asks for the same model's layers and variables many times (once per layout it
    weighs, its VJP profile, its remat terms), and each abstract trace of a transformer costs a fraction of a
    second. A model that cannot be hashed (a field holding a list) is traced each time."""
    remembered = functools.lru_cache(maxsize=64)(trace)

    @functools.wraps(trace)
    def traced(model, input_shape, dtype):
        key = (model, tuple(int(d) for d in input_shape), jnp.dtype(dtype))
        try:
            hash(key)
        except TypeError:
            return trace(*key)
        return remembered(*key)

    return traced


@per_model
def _trace(model: nn.Module, input_shape: tuple[int, ...], dtype: Any) -> tuple[tuple[Layer, ...], Any]:
    """The matrix products of one abstract ``model.init`` (see :func:`matmuls`), each summed over its calls, and
    the variables it made (shapes and dtypes)."""
    found: dict[str, dict[str, Any]] = {}
    pending: list[dict[str, tuple[int, ...]]] = []  # per attention call in progress: its projections' outputs

    def add(name, kind, macs, weights, in_elements, out_elements, kernel, valid=None):
        entry = found.setdefault(name, dict(kind=kind, macs=0, valid_macs=0, weights=weights, in_elements=in_elements,
                                            out_elements=0, kernel_shape=kernel))
        entry["macs"] += macs
        entry["valid_macs"] += macs if valid is None else valid
        entry["out_elements"] += out_elements

    def record(next_fun, args, kwargs, context):
        module, method = context.module, context.method_name
        attention = method == "__call__" and isinstance(module, nn.MultiHeadDotProductAttention)
        if attention:
            pending.append({})
        name = "/".join(module.path)
        if method == "__call__" and isinstance(module, (nn.Dense, nn.Conv)) and args:  # marked for :func:`sources`
            out = next_fun(checkpoint_name(args[0], _IN + name), *args[1:], **kwargs)
            out = checkpoint_name(out, _OUT + name) if isinstance(out, jax.Array) else out
        else:
            out = next_fun(*args, **kwargs)
        if method == "__call__" and isinstance(module, (nn.Dense, nn.Conv)):
            params = module.variables["params"]
            kernel = tuple(params["kernel"].shape)
            macs = math.prod(out.shape[1:]) * math.prod(kernel[:-1])
            valid = macs if isinstance(module, nn.Dense) else _valid_conv_macs(module, args[0].shape, out.shape, kernel)
            add(name, "dense" if isinstance(module, nn.Dense) else "conv", macs,
                sum(math.prod(p.shape) for p in jax.tree.leaves(params)), math.prod(args[0].shape[1:]),
                math.prod(out.shape[1:]), kernel, valid)
        elif method == "__call__" and isinstance(module, nn.DenseGeneral):
            params = module.variables["params"]
            kernel = tuple(params["kernel"].shape)
            features = (module.features,) if isinstance(module.features, int) else tuple(module.features)
            batch = (module.batch_dims,) if isinstance(module.batch_dims, int) else tuple(module.batch_dims)
            batch_size = math.prod(args[0].shape[d] for d in batch)
            contracted = math.prod(kernel) // (math.prod(features) * batch_size)
            add(name, "projection", math.prod(out.shape[1:]) * contracted,
                sum(math.prod(p.shape) for p in jax.tree.leaves(params)), math.prod(args[0].shape[1:]),
                math.prod(out.shape[1:]), kernel)
            if pending and module.name in ("query", "key", "value"):
                pending[-1][module.name] = tuple(out.shape)
        elif method == "attend" and isinstance(module, nn.Embed):
            table = tuple(module.variables["params"]["embedding"].shape)  # (vocab, features)
            add(name + "/attend", "projection", math.prod(out.shape[1:]) * table[1], math.prod(table),
                math.prod(args[0].shape[1:]), math.prod(out.shape[1:]), table[::-1])
        elif attention:
            shapes = pending.pop()
            if set(shapes) != {"query", "key", "value"}:
                raise PerfModelError(f"{name}: its query/key/value projections were not seen; dtx.perf.layers "
                                     "counts flax's nn.MultiHeadDotProductAttention as it is written")
            q, k, v = shapes["query"], shapes["key"], shapes["value"]  # (batch, ..., length, heads, head_dim)
            scores = math.prod(q[1:-1]) * k[-3]  # per example: S_q·H score rows of S_kv entries
            add(name + "/attention", "attention", scores * q[-1] + scores * v[-1], 0, math.prod(q[1:]) +
                math.prod(k[1:]) + math.prod(v[1:]), math.prod(out.shape[1:]), ())
        return out

    x = jax.ShapeDtypeStruct((1, *map(int, input_shape)), dtype)
    with nn.intercept_methods(record):  # nothing runs
        closed, variables = jax.make_jaxpr(lambda x: model.init(jax.random.key(0), x, train=False),
                                           return_shape=True)(x)
    graph: dict[str, Any] = {}
    _follow(closed.jaxpr, [INPUT], graph)
    return tuple(Layer(name=name, **entry) for name, entry in found.items()), variables, tuple(graph.items())


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


INPUT = ""  # the source of a layer that takes the model's input
Join = frozenset  # the source of an input that adds (or otherwise combines) branches: the set of their sources


def join_members(source) -> tuple:
    """The branches a :data:`Join` combines, in a fixed order (by their text)."""
    return tuple(sorted(source, key=repr))


def sources(model: nn.Module, input_shape: Sequence[int], dtype: Any = jnp.float32) -> dict[str, Any]:
    """Per Dense/Conv layer of ``model``, where its input comes from: the graph of a residual network.

    Follows the arrays of one abstract ``model.init`` (``jax.make_jaxpr``: nothing runs) from the model's input
    (``INPUT``) and each layer's output (the layer's name) through the element-wise layers between them (norms,
    activations, pooling keep the source); an operation on arrays of different sources (a residual add: a block's
    last convolution plus its shortcut) makes a :data:`Join` of them. A chain gives each layer the previous one's
    name; ResNet's ``stage2_block1/proj`` takes what ``stage2_block1/conv1`` takes, the join of the previous
    block's branches. The first call of a layer shared by several calls counts."""
    return dict(_trace(model, input_shape, dtype)[2])


_IN, _OUT = "dtx_layer_in:", "dtx_layer_out:"
_CALLS = ("jaxpr", "call_jaxpr", "fun_jaxpr")  # a sub-program whose inputs are the equation's (jit, custom_jvp, ...)


def _follow(jaxpr, in_sources: list, found: dict[str, Any]) -> list:
    """The sources of ``jaxpr``'s outputs given its inputs'; records each marked layer's input source in ``found``."""
    env: dict = {}

    def read(v):
        return None if type(v).__name__ == "Literal" else env.get(v)

    for var, source in zip(jaxpr.invars, in_sources):
        env[var] = source
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        sub = next((eqn.params[k] for k in _CALLS if k in eqn.params and hasattr(eqn.params[k], "eqns")
                    or k in eqn.params and hasattr(getattr(eqn.params[k], "jaxpr", None), "eqns")), None)
        if eqn.primitive.name == "name" and isinstance(eqn.params.get("name"), str) and (
                eqn.params["name"].startswith((_IN, _OUT))):
            label = eqn.params["name"]
            if label.startswith(_IN):
                found.setdefault(label[len(_IN):], ins[0] if ins[0] is not None else INPUT)
                outs = ins[:1]
            else:
                outs = [label[len(_OUT):]]
        elif sub is not None:
            inner = sub.jaxpr if hasattr(sub, "jaxpr") else sub
            outs = (_follow(inner, ins, found) if len(inner.invars) == len(ins)
                    else [_combine(ins)] * len(eqn.outvars))
        else:
            outs = [_combine(ins)] * len(eqn.outvars)
        for var, source in zip(eqn.outvars, outs):
            env[var] = source
    return [read(v) for v in jaxpr.outvars]


def _combine(sources: list):
    """The source of an operation on arrays of these sources: the common one, or the :data:`Join` of them."""
    distinct = []
    for source in sources:
        if source is not None and source not in distinct:
            distinct.append(source)
    if not distinct:
        return None
    return distinct[0] if len(distinct) == 1 else Join(distinct)



def joins(graph: dict[str, Any]) -> list:
    """Every :data:`Join` of ``graph`` (layer -> source, :func:`sources`), nested ones included, each once, in the
    order the layers reach them."""
    found: list = []

    def visit(source):
        if isinstance(source, Join) and source not in found:
            for member in join_members(source):
                visit(member)
            found.append(source)

    for source in graph.values():
        visit(source)
    return found


def is_split(source, split) -> bool:
    """Whether ``source`` sits with its features split over ``model``: a layer's output in ``split`` (the
    column-split layers), a join whose branches all are; the model's input never."""
    if isinstance(source, Join):
        return all(is_split(member, split) for member in source)
    return source != INPUT and source in split


def moved(graph: dict[str, Any], split) -> set[str]:
    """The column-split layers whose output only feeds joins that are not split (a residual add of a split branch
    and a batch-split one): they hand their output over on the batch split (an all-to-all in the group, and one
    back for its gradient), where the add is done. The rule :mod:`dtx.parallel.activations` lays a residual
    network out by and :mod:`dtx.perf.model` charges."""
    consumed = {source for source in graph.values() if not isinstance(source, Join)}
    out = set()
    for join in joins(graph):
        if not is_split(join, split):
            out |= {m for m in join if not isinstance(m, Join) and m in split and m not in consumed}
    return out
