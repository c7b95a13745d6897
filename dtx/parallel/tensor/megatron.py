"""Which parameters Megatron's tensor parallelism splits, read from the parameters themselves.

Shoeybi et al., *Megatron-LM* (arXiv 1909.08053, §3): attention is split by heads, its output projection by
input rows; of two consecutive ``Dense`` layers of one module whose widths chain ``d -> f -> d`` the first is
split by columns and the second by rows; everything else is replicated. :func:`megatron_rules` turns that reading
into ``(regex, PartitionSpec)`` rules over the ``model`` axis (and, for FSDP over the data axes, the rest split
over them too), refusing a width the axis does not divide with the sizes that would work. Used by the ``tensor``
layout (:mod:`dtx.parallel.tensor.layout`) and by pipeline stages split over ``model``
(:mod:`dtx.parallel.pipeline.tensor_stages`).

And what one device runs of each split layer, written once for both (:func:`attention`, :func:`column`,
:func:`row`): a region on this device's ``1/T`` of the heads or units, parameterised by Megatron's pair
(:class:`Pair`): ``f``, which brings the region's input to every device of the group before its column products
(and reduces their input gradient over ``model``), and ``g``, which reduces the row products' partial sums. The
``tensor`` layout runs them inside ``shard_map`` regions with its own pair (sequence parallelism's ``f`` gathers
the input again in the backward pass, so that a layer keeps ``1/T`` of it); pipeline stages run them in their
per-device step with theirs (the backward slot re-runs the forward, so the gathered input is kept). Masks and
dropout reach the attention the same way in both.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dtx import mesh as mesh_lib
from dtx.models.remat import PROJECTION
from dtx.parallel.rules import PartitionError
from dtx.paths import named_leaves

MODEL = mesh_lib.MODEL_AXIS
_ATTENTION = ("query", "key", "value", "out")


def _fits(width: int, mesh: Mesh) -> list[int]:
    """The ``model`` axis sizes that split ``width`` and the devices."""
    return [t for t in range(1, mesh.size + 1) if mesh.size % t == 0 and width % t == 0]


def _refuse(layout: str, layer: str, what: str, width: int, mesh: Mesh) -> PartitionError:
    size = mesh.shape[MODEL]
    return PartitionError(
        f"parallel.name={layout!r} splits layer {layer!r}'s {width} {what} over the {MODEL!r} axis of size {size}, "
        f"which does not divide them; use a {MODEL!r} axis size in {_fits(width, mesh)} (--config.mesh, e.g. "
        f"--config.mesh='((\"data\", -1), (\"model\", {max(_fits(width, mesh))}))'), or a model whose {what} "
        f"divide by {size}")


def megatron_rules(abstract_params: Any, mesh: Mesh, layout: str = "tensor", data: bool = False) -> list[tuple[str, P]]:
    """Rules of Megatron's split read from the parameters' paths and shapes (module docstring): attention's
    ``query``/``key``/``value`` kernels ``(in, heads, head_dim)`` split by heads and their biases with them,
    ``out`` ``(heads, head_dim, out)`` by heads (its bias whole); each chaining pair of Dense layers split by
    the first's output and the second's input (the second's bias whole); the rest replicated. A width ``T``
    does not divide is refused naming the layer and the axis sizes that would split it. ``data``: every tensor
    also split over the data axes along its largest dimension not split already that they divide (ZeRO's
    partitioning over the data-parallel replicas: the optimizer state at stages 1–2, the parameters at 3)."""
    leaves = dict(named_leaves(abstract_params))
    size = mesh.shape[MODEL]
    rules: list[tuple[str, P]] = []

    def rule(path: str, *spec) -> None:
        rules.append((f"^{re.escape(path)}$", P(*spec)))

    parents = {}
    for path, leaf in leaves.items():
        if path.endswith("/kernel"):
            parent, _, layer = path[: -len("/kernel")].rpartition("/")
            parents.setdefault(parent, {})[layer] = tuple(leaf.shape)
    for parent, layers in parents.items():
        prefix = parent + "/" if parent else ""
        if all(layers.get(name, ()) and len(layers[name]) == 3 for name in _ATTENTION):  # a module's attention
            module = parent
            heads = layers["query"][1]
            if heads % size:
                raise _refuse(layout, module, "attention heads", heads, mesh)
            for name in _ATTENTION[:3]:
                rule(f"{prefix}{name}/kernel", None, MODEL, None)
                if f"{prefix}{name}/bias" in leaves:
                    rule(f"{prefix}{name}/bias", MODEL, None)
            rule(f"{prefix}out/kernel", MODEL, None, None)
            continue
        dense = sorted((name for name, shape in layers.items() if len(shape) == 2 and re.fullmatch(r"Dense_\d+", name)),
                       key=lambda name: int(name.split("_")[1]))
        i = 0
        while i + 1 < len(dense):
            up, down = layers[dense[i]], layers[dense[i + 1]]
            if up[1] == down[0] and down[1] == up[0]:  # d -> f -> d: Megatron's MLP
                if up[1] % size:
                    raise _refuse(layout, prefix + dense[i], "hidden units (the MLP's width)", up[1], mesh)
                rule(f"{prefix}{dense[i]}/kernel", None, MODEL)
                if f"{prefix}{dense[i]}/bias" in leaves:
                    rule(f"{prefix}{dense[i]}/bias", MODEL)
                rule(f"{prefix}{dense[i + 1]}/kernel", MODEL, None)
                i += 2
            else:
                i += 1
    if not rules:
        raise PartitionError(
            f"parallel.name={layout!r} pairs attention heads and MLP layers (Megatron), and this model has neither "
            f"(parameters: {', '.join(list(leaves)[:6])}, ...); use parallel.name='model' or 'hybrid' for a model "
            "of Dense/Conv layers")
    return (_over_data(rules, leaves, mesh) if data else rules) + [(".*", P())]


def _over_data(rules: list, leaves: dict, mesh: Mesh) -> list[tuple[str, P]]:
    """Each parameter's rule with the state axes (``fsdp``, or every data axis) added along its largest free
    dimension they divide."""
    axes = mesh_lib.state_axes(mesh, over=mesh_lib.group_batch_axes(mesh))
    size = math.prod(mesh.shape[axis] for axis in axes)
    placed = []
    for path, leaf in leaves.items():
        spec = next((s for regex, s in rules if re.search(regex, path)), P())
        spec = list(spec) + [None] * (len(leaf.shape) - len(spec))
        free = [d for d in sorted(range(len(spec)), key=lambda d: -leaf.shape[d])
                if spec[d] is None and leaf.shape[d] % size == 0]
        if free and size > 1:
            spec[free[0]] = axes[0] if len(axes) == 1 else axes
        placed.append((f"^{re.escape(path)}$", P(*spec)))
    return placed


# ------------------------------------------------------------------------------------------- the regions, per device

class Pair(NamedTuple):
    """Megatron's ``f`` and ``g`` as a caller runs them (Shoeybi et al. §3, Fig. 3).

    Attributes:
      project: ``(x, [(kernel, bias), ...], dtype, precision) -> outputs``: ``f`` applied to the region's input
        ``x``, then each column product (:func:`products`) of what it gives.
      reduce: ``g``: the row products' partial sums reduced over ``model``.
    """

    project: Callable
    reduce: Callable


def products(x, layers, dtype, precision) -> tuple:
    """``x·W + b`` for each ``(W, b)`` of ``layers`` (``b`` may be None), contracting ``x``'s last axis with
    ``W``'s first, in ``dtype`` as flax's ``Dense``/``DenseGeneral`` promote them."""
    outs = []
    for kernel, bias in layers:
        x_, kernel, bias = promote_dtype(x, kernel, bias, dtype=dtype)
        y = jax.lax.dot_general(x_, kernel, (((x_.ndim - 1,), (0,)), ((), ())), precision=precision)
        outs.append(y if bias is None else y + bias)
    return tuple(outs)


def after(f: Callable) -> Callable:
    """A :attr:`Pair.project` that applies ``f`` to the input and keeps what it gives for the products' gradient."""
    return lambda x, layers, dtype, precision: products(f(x), layers, dtype, precision)


def check_self_attention(module, args, kwargs, layer: str, what: str) -> None:
    """Refuse an attention call the split does not cover (other keys or values, decoding, sown weights,
    normalised query/key, a module whose ``tensor_refusal`` says why: the zoo transformer's rotary positions,
    grouped key/value heads, SwiGLU), naming ``layer`` and ``what`` splits it."""
    x = args[0]
    others = list(args[1:3]) + [kwargs.get("inputs_k"), kwargs.get("inputs_v"), kwargs.get("inputs_kv")]
    if (any(o is not None and o is not x for o in others) or module.decode or kwargs.get("sow_weights")
            or module.normalize_qk):
        raise PartitionError(f"{what} splits self-attention; layer {layer!r} is called with other keys/values, "
                             "decode, sow_weights or normalize_qk, which it does not split")
    if getattr(module, "tensor_refusal", ""):  # a module's own settings this split does not run (it says which)
        raise PartitionError(f"{what} cannot split layer {layer!r}: {module.tensor_refusal}")


def dropout_of(module, kwargs) -> tuple[bool, Any]:
    """``(deterministic, rng)`` of an attention call: its dropout key where it drops weights (the caller folds
    in what makes each device's draw its own)."""
    deterministic = module.dropout_rate == 0 or nn.merge_param("deterministic", module.deterministic,
                                                                kwargs.get("deterministic"))
    return deterministic, (None if deterministic else module.make_rng("dropout"))


def attention(module, params, x, pair: Pair, mask=None, rng=None, deterministic: bool = True, attention_fn=None):
    """Self-attention on this device's heads: Q, K and V from one ``f`` of the input (their kernels
    ``(in, h/T, head_dim)``), attention with ``mask`` and dropout (``rng``), this device's rows of the output
    projection; the partial outputs reduced by ``g``. Without the output bias, which the caller adds once after
    the reduction (``params["out"]`` may hold it or not). ``attention_fn``: the module's own unless given (a
    context split's kernel over the positions of other devices)."""
    heads, head_dim = params["query"]["kernel"].shape[1:]
    width = module.out_features or x.shape[-1]
    own = {"attention_fn": attention_fn} if attention_fn is not None else {}
    local = module.clone(parent=None, name=None, num_heads=heads, qkv_features=heads * head_dim, out_features=width,
                         **own)
    params = dict(params)
    kernel = params["out"]["kernel"]
    params["out"] = {"kernel": kernel, **({"bias": jnp.zeros((width,), kernel.dtype)} if module.use_bias else {})}
    names = ("query", "key", "value")
    done = dict(zip(names, pair.project(x, [(params[n]["kernel"], params[n].get("bias")) for n in names],
                                        module.dtype, module.precision)))

    def projected(next_fun, args, kwargs, context):  # the local module's projections: the results above
        if context.method_name == "__call__" and context.module.name in done and \
                isinstance(context.module, nn.DenseGeneral):
            return done[context.module.name]
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(projected):
        y = local.apply({"params": params}, x, x, mask=mask, deterministic=deterministic, dropout_rng=rng)
    return checkpoint_name(pair.reduce(y), PROJECTION)  # kept by remat's dots: no collective runs again


def column(module, params, x, pair: Pair):
    """An MLP up-projection: ``f`` of the input times this device's ``1/T`` of the columns (and their bias)."""
    return pair.project(x, [(params["kernel"], params.get("bias"))], module.dtype, module.precision)[0]


def row(module, kernel, x, pair: Pair):
    """An MLP down-projection: this device's ``1/T`` of the hidden units times its rows, reduced by ``g``; without
    the bias, which the caller adds once after."""
    y = module.clone(parent=None, name=None, use_bias=False).apply({"params": {"kernel": kernel}}, x)
    return checkpoint_name(pair.reduce(y), PROJECTION)  # kept by remat's dots: no collective runs again
