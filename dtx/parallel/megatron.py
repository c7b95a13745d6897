"""Which parameters Megatron's tensor parallelism splits, read from the parameters themselves.

Shoeybi et al., *Megatron-LM* (arXiv 1909.08053, §3): attention is split by heads, its output projection by
input rows; of two consecutive ``Dense`` layers of one module whose widths chain ``d -> f -> d`` the first is
split by columns and the second by rows; everything else is replicated. :func:`megatron_rules` turns that reading
into ``(regex, PartitionSpec)`` rules over the ``model`` axis (and, for FSDP over the data axes, the rest split
over them too), refusing a width the axis does not divide with the sizes that would work. Used by the ``tensor``
layout (:mod:`dtx.parallel.tensor`) and by pipeline stages split over ``model``
(:mod:`dtx.parallel.tensor_stages`).
"""

from __future__ import annotations

import math
import re
from typing import Any

from jax.sharding import Mesh, PartitionSpec as P

from dtx import mesh as mesh_lib
from dtx.paths import named_leaves
from dtx.parallel.rules import PartitionError

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
