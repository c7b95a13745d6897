"""Data, model, hybrid and fully-sharded partitioning of a model's parameters, as rules.

A partitioning is data: an ordered list of ``(regex, PartitionSpec)`` rules; a
parameter takes the spec of the first regex that matches its path
(``"fc6/kernel"``). The optimizer state follows its parameter. The ``jit``
driver runs any partitioning (XLA inserts the activation and gradient
collectives); the ``shard_map`` driver runs ``data``.

* ``data`` — replicate every parameter, split the batch (Das et al. §2,
  Hitchhiker's §3.1).
* ``model`` — split every Dense/Conv kernel's output features over the ``model``
  axis (Hitchhiker's §3.2; Das et al. §3.2): each device computes a slice of every
  layer's outputs, and activations are exchanged instead of weight gradients.
* ``hybrid`` — Das et al. §3.3: convolutions data-parallel (their weights are
  small against their activations), fully connected layers model-parallel inside
  groups of ``G`` devices (the ``model`` axis) and data-parallel across groups.
* ``fsdp`` — ZeRO-3 style (Rajbhandari et al. 2020, arXiv 1910.02054): every
  parameter and its optimizer state split over the batch axes along its largest
  divisible dimension; gathered for use, reduce-scattered for the update.
* ``zero1`` / ``zero2`` — ZeRO stages 1 and 2: parameters replicated, the
  optimizer state split like ``fsdp`` (:func:`optimizer_rules`). The gradients are
  reduce-scattered to the optimizer state's layout, each device updates its
  ``1/N`` of every tensor, and the new parameters are all-gathered. Stage 2 also
  keeps the gradients split while they are accumulated over micro-batches (one
  reduce-scatter per micro-batch into a ``1/N`` accumulator); stage 1 accumulates
  full gradients and reduce-scatters once per step.
* ``rules`` — explicit rules, e.g. the per-layer plan of :mod:`dtx.perfmodel`.

Where activations live (the batch of data-parallel layers over every device, model-parallel layers' inputs
gathered inside their group) is :mod:`dtx.activations`, derived from the same specs.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dtx import mesh as mesh_lib
from dtx.activations import ActivationLayout, activation_layout  # noqa: F401  (public here too)
from dtx.paths import named_leaves, path_str

PARALLELISMS = ("data", "model", "hybrid", "fsdp", "zero1", "zero2", "rules")
ZERO_STAGES = {"zero1": 1, "zero2": 2}
Rules = Sequence[tuple[str, PartitionSpec]]

# Kernels of convolutions are rank 4 (H, W, C_in, C_out); of dense layers rank 2 (C_in, C_out).
_CONV_KERNEL, _DENSE_KERNEL = 4, 2


class PartitionError(ValueError):
    """A partitioning that does not fit the mesh or the parameters."""


def make_rules(name: str, mesh: Mesh, abstract_params: Any = None, explicit: Sequence = ()) -> list[tuple[str, PartitionSpec]]:
    """The rules of partitioning ``name`` on ``mesh``.

    Args:
      name: one of :data:`PARALLELISMS`.
      mesh: the device mesh; ``model`` and ``hybrid`` need a ``model`` axis.
      abstract_params: the parameter tree (shapes suffice); needed by ``model``,
        ``hybrid`` and ``fsdp``, whose rules depend on each parameter's rank/shape.
      explicit: for ``rules``: ``(regex, spec)`` pairs, ``spec`` a PartitionSpec
        or a tuple of axis names / ``None`` (config files hold tuples).

    Returns:
      ``[(regex, PartitionSpec), ...]``, first match wins, ending with ``(".*", P())``.
    """
    if name not in PARALLELISMS:
        raise PartitionError(f"unknown parallel.name {name!r}; choose one of {list(PARALLELISMS)}")
    if name in ("model", "hybrid") and mesh_lib.MODEL_AXIS not in mesh.axis_names:
        raise PartitionError(
            f"parallel.name={name!r} needs a {mesh_lib.MODEL_AXIS!r} mesh axis (the model-parallel group), e.g. "
            f"--config.mesh='((\"data\", -1), (\"model\", 2))' (in Python: make_mesh([(\"data\", -1), (\"model\", 2)])); "
            f"the mesh has axes {mesh.axis_names}"
        )
    if name in ("data", *ZERO_STAGES):  # ZeRO keeps the parameters whole; see optimizer_rules
        return [(".*", PartitionSpec())]
    if name == "rules":
        rules = [(str(regex), _as_spec(spec)) for regex, spec in explicit]
        if abstract_params is not None:
            check_rules_match(rules, abstract_params)
        return rules + [(".*", PartitionSpec())]
    if abstract_params is None:
        raise PartitionError(f"parallel.name={name!r} derives its rules from the parameters; pass abstract_params")
    rules = []
    leaves = dict(named_leaves(abstract_params))
    for path, leaf in leaves.items():
        spec = _spec_for(name, path, leaf.shape, mesh)
        if spec != PartitionSpec():
            rules.append((f"^{re.escape(path)}$", spec))
            bias = path[: -len("kernel")] + "bias"
            if name in ("model", "hybrid") and bias in leaves:  # the bias follows its output features
                rules.append((f"^{re.escape(bias)}$", PartitionSpec(mesh_lib.MODEL_AXIS)))
    return rules + [(".*", PartitionSpec())]


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


def optimizer_rules(name: str, mesh: Mesh, abstract_params: Any = None, explicit: Sequence = ()) -> list:
    """The rules the optimizer state (and, for ZeRO, the reduced gradients) is laid out by.

    For ``zero1``/``zero2`` the ``fsdp`` split of every tensor over the batch axes;
    for every other partitioning the parameters' own rules.
    """
    return make_rules("fsdp" if name in ZERO_STAGES else name, mesh, abstract_params, explicit)


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


def _spec_for(name: str, path: str, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    model = mesh_lib.MODEL_AXIS
    if name == "model" and path.endswith("kernel") and len(shape) in (_CONV_KERNEL, _DENSE_KERNEL):
        return _split_dim(path, shape, len(shape) - 1, model, mesh, name)
    if name == "hybrid" and path.endswith("kernel") and len(shape) == _DENSE_KERNEL:
        return _split_dim(path, shape, 1, model, mesh, name)
    if name == "fsdp":
        axes = mesh_lib.batch_axes(mesh)
        size = mesh_lib.data_parallel_size(mesh)
        # The largest dimension the data-parallel size divides: even shards, fewest gathers.
        candidates = [d for d in sorted(range(len(shape)), key=lambda d: -shape[d]) if shape[d] % size == 0]
        if candidates and size > 1:
            spec = [None] * len(shape)
            spec[candidates[0]] = axes if len(axes) > 1 else axes[0]
            return PartitionSpec(*spec)
    return PartitionSpec()


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
