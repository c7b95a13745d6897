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

Where activations live (Das et al. §3.3). The batch of every data-parallel layer
is split over **every** mesh axis, ``model`` included, so each of the ``N``
devices computes ``1/N`` of its examples. A layer whose kernel is split over the
``model`` axis is model-parallel inside its group of ``G`` devices: its input is
gathered inside the group (batch split over the other axes only), each device
computes its ``1/G`` of the output features, and the next data-parallel layer
splits the batch over the group again. XLA's SPMD partitioner then inserts exactly
the collectives this implies: the all-gather of the layer input and the
reduce-scatter of its gradient inside the group, the weight-gradient all-reduce
over all ``N`` devices for data-parallel layers and over the ``N/G`` groups for
model-parallel ones.

How: :class:`ActivationLayout` is derived from the same parameter specs the
state is laid out by (never from edits to the model) and applied by flax method
interception (``nn.intercept_methods``): every ``nn.Dense``/``nn.Conv`` call gets a
``with_sharding_constraint`` on its input and its output. Interception needs no
change to the model and sees every Dense/Conv of any flax module by its parameter
path, which is what the rules match; other layers (norms, pooling, activations)
sit between two constrained boundaries and follow them.

::

    conv layers (data parallel)      fc layers (model parallel, groups of G)
    device d: examples [d·B/N, …)    group g: examples of its G devices, gathered
    ─────────────────────────────┬─────────────────────────────────────────────
    forward     conv → conv →    │ all-gather (in group) → fc6[:, d's 1/G] → …
    backward    ← ← dX           │ reduce-scatter (in group) ← dX partial sums
    gradients   all-reduce over N│ all-reduce of the 1/G weight slice over N/G
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dtx import mesh as mesh_lib
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
            f"--config.mesh='((\"data\", -1), (\"model\", 2))'; the mesh has axes {mesh.axis_names}"
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


@dataclasses.dataclass(frozen=True, eq=False)
class ActivationLayout:
    """Where each Dense/Conv layer's input and output live on the mesh (module docstring).

    Call it for a context manager; inside, every ``nn.Dense``/``nn.Conv`` call of any
    flax module is wrapped in sharding constraints::

        layout = activation_layout(specs, mesh)      # None when no layer is model-parallel
        with layout():
            logits = model.apply(variables, inputs)

    Attributes:
      mesh: the device mesh.
      kernels: the model-parallel layers: layer path (``"fc6"``) -> its kernel's spec.
    """

    mesh: Mesh
    kernels: Mapping[str, PartitionSpec]

    def __call__(self, arriving: PartitionSpec | None = None):
        """The interception context; ``arriving``: where the model's input is (default: the batch split)."""
        produced = [arriving]  # the previous layer's output spec, in trace (= forward) order
        inside = []  # set while a model-parallel layer's own per-device computation is traced

        def constrain(next_fun, args, kwargs, context):
            module = context.module
            if (context.method_name != "__call__" or not isinstance(module, (nn.Dense, nn.Conv)) or not args
                    or inside):
                return next_fun(*args, **kwargs)
            name, x = "/".join(module.path), args[0]
            if name in self.kernels and _column_split(module, self.kernels[name]):
                inside.append(name)
                try:
                    out = self._model_parallel(module, x, self._arriving(x.ndim, produced[-1]))
                finally:
                    inside.pop()
            else:
                out = self.leave(next_fun(self.enter(x, name, produced[-1]), *args[1:], **kwargs), name, x.ndim)
            produced.append(self.specs(name, x.ndim, out.ndim)[1])
            return out

        return nn.intercept_methods(constrain)

    def _model_parallel(self, module: nn.Module, x: jax.Array, arriving: PartitionSpec) -> jax.Array:
        """A column-split Dense/Conv as Das et al. §3.2 run it, with explicit collectives.

        Inside a ``shard_map`` each device gathers the group's input (an all-gather
        over ``model``: of the batch after a data-parallel layer, of the features after
        a model-parallel one) and computes its ``1/G`` of the output features with its
        slice of the weights. Autodiff turns the gather into a reduce-scatter of the
        input gradient, and the weight slice's gradient is summed over the other axes
        (the ``N/G`` groups). Written out rather than left to XLA because XLA:CPU
        compiles that input gradient as an all-reduce plus a slice: 1.5× the bytes.
        """
        model = mesh_lib.MODEL_AXIS
        size = self.mesh.shape[model]
        params = module.variables["params"]
        local = module.clone(parent=None, name=None, features=module.features // size)
        gather_features = arriving[-1] == model
        batch = _axes_entry(mesh_lib.batch_axes(self.mesh))
        x_spec = arriving if gather_features else PartitionSpec(batch, *[None] * (x.ndim - 1))
        _, out_spec = self.specs("/".join(module.path), x.ndim, x.ndim)
        split = {"kernel": PartitionSpec(*[None] * (params["kernel"].ndim - 1), model), "bias": PartitionSpec(model)}

        def per_device(x, params):
            x = jax.lax.all_gather(x, model, axis=x.ndim - 1 if gather_features else 0, tiled=True)
            return local.apply({"params": params}, x)

        specs = {k: split[k] for k in params}
        return jax.shard_map(per_device, mesh=self.mesh, in_specs=(x_spec, specs), out_specs=out_spec)(
            x, dict(params))

    def _arriving(self, ndim: int, arriving: PartitionSpec | None) -> PartitionSpec:
        """Where an activation of rank ``ndim`` is, given the previous layer's output spec."""
        if arriving is None or len(arriving) != ndim:  # e.g. a flatten in between: the batch split carries
            first = arriving[0] if arriving is not None and len(arriving) else _axes_entry(
                mesh_lib.batch_axes(self.mesh))
            arriving = PartitionSpec(first, *[None] * (ndim - 1))
        return arriving

    def specs(self, layer: str, in_ndim: int, out_ndim: int) -> tuple[PartitionSpec, PartitionSpec]:
        """``(input spec, output spec)`` of ``layer`` for activations of these ranks (batch first)."""
        kernel = self.kernels.get(layer)
        if kernel is None:  # data parallel: the batch over every device, features whole
            batch = _axes_entry(mesh_lib.batch_axes(self.mesh))
            return PartitionSpec(batch, *[None] * (in_ndim - 1)), PartitionSpec(batch, *[None] * (out_ndim - 1))
        kernel = tuple(kernel) + (None,) * max(0, 2 - len(kernel))
        batch = _axes_entry(mesh_lib.group_batch_axes(self.mesh))
        # The kernel's last two dimensions are (input features, output features) for Dense and Conv.
        return (PartitionSpec(batch, *[None] * (in_ndim - 2), kernel[-2]),
                PartitionSpec(batch, *[None] * (out_ndim - 2), kernel[-1]))

    def enter(self, x: jax.Array, layer: str, arriving: PartitionSpec | None = None) -> jax.Array:
        """Move ``x`` to ``layer``'s input layout; its gradient goes back to ``arriving``.

        ``arriving`` is where ``x`` was produced (the previous layer's output spec;
        ``None``: the batch over every device). Constraining the gradient there, not
        to the gathered layout, lets XLA turn a model-parallel layer's partial input
        gradients into one reduce-scatter inside the group (Das et al. §3.2) instead
        of an all-reduce followed by a slice, 1.5× the bytes.
        """
        forward, _ = self.specs(layer, x.ndim, x.ndim)
        arriving = self._arriving(x.ndim, arriving)
        return _reshard(x, NamedSharding(self.mesh, forward), NamedSharding(self.mesh, arriving))

    def leave(self, y: jax.Array, layer: str, in_ndim: int) -> jax.Array:
        """Pin ``layer``'s output to its output layout (features split for model-parallel layers)."""
        return jax.lax.with_sharding_constraint(y, NamedSharding(self.mesh, self.specs(layer, in_ndim, y.ndim)[1]))


def _reshard(x: jax.Array, forward: NamedSharding, backward: NamedSharding) -> jax.Array:
    """``x`` constrained to ``forward``; its cotangent constrained to ``backward``."""

    @jax.custom_vjp
    def move(x):
        return jax.lax.with_sharding_constraint(x, forward)

    def move_fwd(x):
        return move(x), None

    def move_bwd(_, g):
        return (jax.lax.with_sharding_constraint(g, backward),)

    move.defvjp(move_fwd, move_bwd)
    return move(x)


def activation_layout(specs: Any, mesh: Mesh) -> ActivationLayout | None:
    """The layout implied by a parameter-spec tree (:func:`param_specs`); ``None`` without model-parallel layers.

    A layer is model-parallel when a dimension of its ``kernel`` is split over the
    ``model`` axis alone (a dimension split over several axes together, as FSDP
    does, is storage, not a model-parallel computation).
    """
    kernels = {}
    for path, spec in named_leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec)):
        if path.endswith("/kernel") and any(axes in (mesh_lib.MODEL_AXIS, (mesh_lib.MODEL_AXIS,)) for axes in spec):
            kernels[path[: -len("/kernel")]] = spec
    return ActivationLayout(mesh, kernels) if kernels else None


def _column_split(module: nn.Module, kernel: PartitionSpec) -> bool:
    """Whether ``module`` is split over ``model`` along its output features only (run by :meth:`_model_parallel`)."""
    spec = tuple(kernel)
    return (len(spec) >= 1 and spec[-1] in (mesh_lib.MODEL_AXIS, (mesh_lib.MODEL_AXIS,))
            and all(axes is None for axes in spec[:-1]) and getattr(module, "feature_group_count", 1) == 1
            and isinstance(getattr(module, "features", None), int))


def _axes_entry(axes: tuple[str, ...]):
    """A PartitionSpec entry for a dimension split over ``axes`` (``None`` when there are none)."""
    return None if not axes else axes[0] if len(axes) == 1 else axes


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
            f"(--config.mesh), or keep {layer!r} data parallel with parallel.name='rules' and rules for the "
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
