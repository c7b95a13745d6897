"""Partitioning rules: ``(regex, PartitionSpec)`` pairs that place a model's parameters on the mesh.

A partitioning is data: an ordered list of rules; a parameter takes the spec of the first
regex that matches its path (``"fc6/kernel"``), and the optimizer state follows its
parameter. The layouts (:mod:`dtx.parallel.layouts`) derive their rules from what they
declare with the builders here: kernels split over the ``model`` axis by their output
features (:func:`split_kernels`, Das et al. §3.2–3.3), every tensor split over the batch
axes along its largest divisible dimension (:func:`fsdp_rules`, ZeRO's partitioning,
Rajbhandari et al. 2020), or the user's own rules (:func:`explicit_rules`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dtx import mesh as mesh_lib
from dtx.paths import named_leaves, path_str

Rules = Sequence[tuple[str, PartitionSpec]]

mesh_lib.declare_axis(mesh_lib.Axis(
    mesh_lib.FSDP_AXIS, "fsdp", replicas=True, state=True,
    doc="data replicas with the train state split over them (ZeRO stage fsdp.zero_stage: 1, 2 or 3)"))

# Kernels of convolutions are rank 4 (H, W, C_in, C_out); of dense layers rank 2 (C_in, C_out).
_CONV_KERNEL, _DENSE_KERNEL = 4, 2


class PartitionError(ValueError):
    """A partitioning that does not fit the mesh or the parameters."""


def check_rules_match(rules: Rules, abstract_params: Any) -> None:
    """Every rule but the catch-all must name at least one parameter (a typo would silently run data parallel)."""
    paths = [path for path, _ in named_leaves(abstract_params)]
    for regex, spec in rules:
        if regex != ".*" and not any(re.search(regex, path) for path in paths):
            raise PartitionError(
                f"parallel.rules: the rule ({regex!r}, {tuple(spec)}) names no parameter; parameters are "
                f"{', '.join(paths[:8])}{', ...' if len(paths) > 8 else ''} (regexes match paths like "
                "'fc6/kernel'); fix the regex or drop the rule")


def param_specs(rules: Rules, abstract_params: Any, mesh: Mesh) -> Any:
    """A PartitionSpec per parameter (first matching rule), checked against shapes and mesh."""
    compiled = [(re.compile(regex), spec) for regex, spec in rules]

    def spec_of(path, leaf):
        name = path_str(path)
        spec = next((s for pattern, s in compiled if pattern.search(name)), PartitionSpec())
        _check_fits(name, leaf.shape, spec, mesh)
        return spec

    return jax.tree_util.tree_map_with_path(spec_of, abstract_params)


def gradient_shardings(abstract_params: Any, rules: Rules, mesh: Mesh) -> Any:
    """A NamedSharding per parameter-shaped gradient, laid out by ``rules`` (ZeRO: :func:`optimizer_rules`)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(rules, abstract_params, mesh),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def state_shardings(abstract_state: Any, rules: Rules, mesh: Mesh, opt_rules: Rules | None = None) -> Any:
    """NamedShardings for a whole TrainState: params by the rules, optimizer state like its
    parameter (matched by path suffix and shape) or by ``opt_rules`` when given (ZeRO),
    everything else replicated."""
    by_path = {}
    specs = param_specs(rules, abstract_state.params, mesh)
    opt_specs = specs if opt_rules is None else param_specs(opt_rules, abstract_state.params, mesh)
    for (path, leaf), spec in zip(named_leaves(abstract_state.params), jax.tree.leaves(
            opt_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))):
        by_path[path] = (tuple(leaf.shape), spec)

    def follow(path, leaf):
        name = path_str(path)
        for param_path, (shape, spec) in by_path.items():
            if (name == param_path or name.endswith("/" + param_path)) and tuple(leaf.shape) == shape:
                return NamedSharding(mesh, spec)
        return NamedSharding(mesh, PartitionSpec())

    shardings = jax.tree_util.tree_map_with_path(follow, abstract_state)
    # Per-worker state (compression residuals, local models): one entry per data-parallel worker.
    split = NamedSharding(mesh, PartitionSpec(mesh_lib.batch_axes(mesh)))
    return shardings.replace(params=jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                                 is_leaf=lambda x: isinstance(x, PartitionSpec)),
                             worker=jax.tree.map(lambda _: split, abstract_state.worker))


def split_kernels(abstract_params: Any, mesh: Mesh, which: str, layout: str,
                  rows: Sequence[str] = ()) -> list[tuple[str, PartitionSpec]]:
    """Rules splitting kernels over the ``model`` axis by their output features, each bias with its kernel.

    ``which``: ``"all"`` (every Dense and Conv kernel: model parallelism, Das et al. §3.2) or ``"dense"``
    (fully connected layers only: their weights dominate, Das et al. §3.3's hybrid). ``layout`` names the
    layout in errors. ``rows``: Dense layers split by their input features instead, their bias whole
    (``parallel.fc_pairs``, :mod:`dtx.parallel.fc_pairs`).
    """
    leaves = dict(named_leaves(abstract_params))
    ranks = (_CONV_KERNEL, _DENSE_KERNEL) if which == "all" else (_DENSE_KERNEL,)
    rules = []
    for path, leaf in leaves.items():
        if path.endswith("/kernel") and path[: -len("/kernel")] in rows:
            rules.append((f"^{re.escape(path)}$", _split_dim(path, leaf.shape, 0, mesh_lib.MODEL_AXIS, mesh, layout)))
        elif path.endswith("kernel") and len(leaf.shape) in ranks:
            rules.append((f"^{re.escape(path)}$",
                          _split_dim(path, leaf.shape, len(leaf.shape) - 1, mesh_lib.MODEL_AXIS, mesh, layout)))
            bias = path[: -len("kernel")] + "bias"
            if bias in leaves:  # the bias follows its output features
                rules.append((f"^{re.escape(bias)}$", PartitionSpec(mesh_lib.MODEL_AXIS)))
    return rules + [(".*", PartitionSpec())]


def fsdp_rules(abstract_params: Any, mesh: Mesh) -> list[tuple[str, PartitionSpec]]:
    """Every tensor split over the state axes (:func:`dtx.mesh.state_axes`: ``fsdp``, or all batch axes) together along the largest dimension their size divides
    (even shards, fewest gathers); tensors no dimension of which divides stay whole."""
    axes = mesh_lib.state_axes(mesh)
    size = math.prod(mesh.shape[a] for a in axes)
    rules = []
    for path, leaf in named_leaves(abstract_params):
        shape = leaf.shape
        candidates = [d for d in sorted(range(len(shape)), key=lambda d: -shape[d]) if shape[d] % size == 0]
        if candidates and size > 1:
            spec = [None] * len(shape)
            spec[candidates[0]] = axes if len(axes) > 1 else axes[0]
            rules.append((f"^{re.escape(path)}$", PartitionSpec(*spec)))
    return rules + [(".*", PartitionSpec())]


def explicit_rules(explicit: Sequence, abstract_params: Any = None) -> list[tuple[str, PartitionSpec]]:
    """The user's ``(regex, spec)`` pairs (``spec`` a PartitionSpec or a tuple of axis names / ``None``, as
    config files hold them), each checked to name a parameter, then the catch-all."""
    rules = [(str(regex), _as_spec(spec)) for regex, spec in explicit]
    if abstract_params is not None:
        check_rules_match(rules, abstract_params)
    return rules + [(".*", PartitionSpec())]


REPLICATED: tuple[tuple[str, PartitionSpec], ...] = ((".*", PartitionSpec()),)


def _split_dim(path: str, shape, dim: int, axis: str, mesh: Mesh, name: str) -> PartitionSpec:
    if shape[dim] % mesh.shape[axis]:
        # Refused, not silently replicated: a replicated layer in a model-parallel plan is not the plan.
        layer = path.rsplit("/", 1)[0]
        size = mesh.shape[axis]
        fits = [d for d in range(1, size + 1) if size % d == 0 and shape[dim] % d == 0]
        raise PartitionError(
            f"parallel.name={name!r} splits layer {layer!r}'s {shape[dim]} output features over the "
            f"{axis!r} axis of size {size}, which does not divide them; use a {axis!r} axis size in {fits} "
            f"(--config.mesh, or make_mesh's spec), or keep {layer!r} data parallel with parallel.name='rules' and rules for the "
            "other layers only")
    spec = [None] * len(shape)
    spec[dim] = axis
    return PartitionSpec(*spec)


def _check_fits(name: str, shape, spec: PartitionSpec, mesh: Mesh) -> None:
    if len(spec) > len(shape):
        raise PartitionError(f"parameter {name} of shape {tuple(shape)}: spec {spec} has more dimensions")
    for dim, axes in enumerate(spec):
        if axes is None:
            continue
        axes = axes if isinstance(axes, tuple) else (axes,)
        for axis in axes:
            if axis not in mesh.axis_names:
                raise PartitionError(f"parameter {name}: spec {spec} names axis {axis!r}, not in mesh {mesh.axis_names}")
        size = 1
        for axis in axes:
            size *= mesh.shape[axis]
        if shape[dim] % size:
            raise PartitionError(
                f"parameter {name} of shape {tuple(shape)}: dimension {dim} ({shape[dim]}) does not divide "
                f"over {axes} (size {size}); change the rule or the mesh"
            )


def _as_spec(spec) -> PartitionSpec:
    if isinstance(spec, PartitionSpec):
        return spec
    return PartitionSpec(*[tuple(a) if isinstance(a, list) else a for a in spec])


