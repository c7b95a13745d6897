"""Where a partitioned model's activations live on the mesh, and the constraints that move them between layers.

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

A Dense split by its *input* features (row-split, the partner of a column-split
one in Megatron's pairing: ``parallel.rules`` ``(None, "model")`` then
``("model", None)``) takes the features where the column layer left them and
reduce-scatters its partial sums onto the batch: no gather between the pair.

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
from collections.abc import Mapping
from typing import Any, ClassVar

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dtx import mesh as mesh_lib
from dtx.parallel import nested
from dtx.paths import named_leaves


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
      mapped: mesh axes a surrounding ``jax.vmap`` already splits the batch over (its ``spmd_axis_name``,
        :meth:`inside_map`): left out of every constraint, which then places one mapped shard.
    """

    mesh: Mesh
    kernels: Mapping[str, PartitionSpec]
    mappable: ClassVar[bool] = True  # runs inside a per-shard map (:meth:`inside_map`; gradient accumulation)
    # That map is a shard_map manual over the data axes (dtx.step.accumulate.manual_gradients): under a vmap XLA
    # gathered a convolution's activations across the map and computed them again (hybrid VGG-A, k = 2: 3.4x).
    manual: ClassVar[bool] = True
    mapped: tuple[str, ...] = ()

    def inside_map(self, axes: tuple[str, ...]) -> ActivationLayout:
        """This layout for the body of a ``shard_map`` manual over mesh ``axes`` (:mod:`dtx.step.accumulate`):
        those axes are in no constraint inside it, and a model-parallel layer's own region nests in it over
        ``model`` (:func:`dtx.parallel.nested.region`). Only axes a model group does not span can be mapped (a
        layer's group gather stays inside a shard)."""
        if mesh_lib.MODEL_AXIS in axes:
            raise ValueError(f"a model-parallel layer's group cannot be split by a map over {axes}")
        return dataclasses.replace(self, mapped=tuple(axes))

    def _batch(self, group: bool = False):
        """The spec entry of a data-parallel (``group``: model-parallel) layer's batch, less the mapped axes."""
        axes = mesh_lib.group_batch_axes(self.mesh) if group else mesh_lib.batch_axes(self.mesh)
        return _axes_entry(tuple(a for a in axes if a not in self.mapped))

    def __call__(self, arriving: PartitionSpec | None = None):
        """The interception context; ``arriving``: where the model's input is (default: the batch split)."""
        produced = [(arriving, None, "")]  # the previous layer's output spec and width, in trace (= forward) order
        inside = []  # set while a model-parallel layer's own per-device computation is traced
        outputs = {}  # layer -> its output's (spec, width): where a branch's consumer finds it
        graph = {}  # layer -> the source of its input (dtx.perf.layers.sources), read at the model's own call

        def constrain(next_fun, args, kwargs, context):
            module = context.module
            if inside:
                return next_fun(*args, **kwargs)
            if not isinstance(module.parent, nn.Module) and not graph and args and hasattr(args[0], "shape"):
                inside.append("graph")  # the model's own call: its graph, traced apart with nothing constrained
                try:
                    graph.update(_graph(module, args[0]))
                finally:
                    inside.pop()
            if context.method_name != "__call__" or not isinstance(module, (nn.Dense, nn.Conv)) or not args:
                return next_fun(*args, **kwargs)
            name, x = "/".join(module.path), args[0]
            if graph.get(name) is not None and graph[name] != produced[-1][2]:
                # A branch (a shortcut projection) or a join (a residual add): it arrives where its source left it.
                produced.append((*source_spec(graph[name], outputs, produced[0][0], None), None))
            if name in self.kernels and _column_split(module, self.kernels[name]):
                inside.append(name)
                try:
                    out = self._model_parallel(module, x, self._arriving(x.ndim, carried(*produced[-1][:2], x.shape)))
                finally:
                    inside.pop()
            elif name in self.kernels and _row_split(module, self.kernels[name]):
                inside.append(name)
                try:
                    out = self._row_parallel(module, x)
                finally:
                    inside.pop()
            else:
                out = self.leave(next_fun(self.enter(x, name, carried(*produced[-1][:2], x.shape)), *args[1:], **kwargs),
                                 name, x.ndim)
            if len(produced[-1]) == 3 and produced[-1][2] is None:
                produced.pop()  # the branch's arriving spec: not a layer's output
            outputs[name] = (self.specs(name, x.ndim, out.ndim)[1], out.shape[-1])
            produced.append((*outputs[name], name))
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
        batch = self._batch()
        x_spec = arriving if gather_features else PartitionSpec(batch, *[None] * (x.ndim - 1))
        _, out_spec = self.specs("/".join(module.path), x.ndim, x.ndim)
        split = {"kernel": PartitionSpec(*[None] * (params["kernel"].ndim - 1), model), "bias": PartitionSpec(model)}

        def per_device(x, params):
            x = jax.lax.all_gather(x, model, axis=x.ndim - 1 if gather_features else 0, tiled=True)
            return local.apply({"params": params}, x)

        specs = {k: split[k] for k in params}
        return self._region(per_device, (x_spec, specs), out_spec)(x, dict(params))

    def _row_parallel(self, module: nn.Module, x: jax.Array) -> jax.Array:
        """A row-split Dense (its input features over ``model``), the partner of a column-split one (Megatron's
        pairing, Shoeybi et al., arXiv 1909.08053, §3): it takes the features where the column layer left them,
        each device multiplies its slice by its rows, and the partial sums are reduce-scattered over the group onto
        the batch, each device keeping its ``1/N`` of the examples as the next data-parallel layer wants them. No
        gather between the pair; backward: the output gradient all-gathered in the group. The bias is added once,
        after the reduction."""
        model = mesh_lib.MODEL_AXIS
        params = module.variables["params"]
        local = module.clone(parent=None, name=None, use_bias=False)
        x_spec, out_spec = self.specs("/".join(module.path), x.ndim, x.ndim)

        def per_device(x, kernel):
            y = local.apply({"params": {"kernel": kernel}}, x)
            return jax.lax.psum_scatter(y, model, scatter_dimension=0, tiled=True)

        y = self._region(per_device, (x_spec, PartitionSpec(model, None)), out_spec)(x, params["kernel"])
        return y + params["bias"].astype(y.dtype) if "bias" in params else y

    def _arriving(self, ndim: int, arriving: PartitionSpec | None) -> PartitionSpec:
        """Where an activation of rank ``ndim`` is, given the previous layer's output spec."""
        if arriving is None or len(arriving) != ndim:  # e.g. a flatten in between: the batch split carries
            first = arriving[0] if arriving is not None and len(arriving) else self._batch()
            arriving = PartitionSpec(first, *[None] * (ndim - 1))
        return arriving

    def specs(self, layer: str, in_ndim: int, out_ndim: int) -> tuple[PartitionSpec, PartitionSpec]:
        """``(input spec, output spec)`` of ``layer`` for activations of these ranks (batch first)."""
        kernel = self.kernels.get(layer)
        if kernel is None:  # data parallel: the batch over every device, features whole
            batch = self._batch()
            return PartitionSpec(batch, *[None] * (in_ndim - 1)), PartitionSpec(batch, *[None] * (out_ndim - 1))
        kernel = tuple(kernel) + (None,) * max(0, 2 - len(kernel))
        batch = self._batch(group=True)
        if _is_model(kernel[-2]) and kernel[-1] is None:  # row-split: its partial sums land on the batch split
            return (PartitionSpec(batch, *[None] * (in_ndim - 2), kernel[-2]),
                    PartitionSpec(self._batch(), *[None] * (out_ndim - 1)))
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
        # A data-parallel layer's input gradient is whole per example: computed on the batch split and moved back
        # (an all-to-all inside the group when its input arrived split by features), not left to the partitioner,
        # which computed it feature-split by gathering the output gradient over the batch (ResNet-50's conv3 after
        # a split conv2: 8x the bytes).
        return _reshard(x, self._sharding(forward), self._sharding(arriving),
                        via_forward=self.kernels.get(layer) is None and forward != arriving)

    def leave(self, y: jax.Array, layer: str, in_ndim: int) -> jax.Array:
        """Pin ``layer``'s output to its output layout (features split for model-parallel layers)."""
        return jax.lax.with_sharding_constraint(y, self._sharding(self.specs(layer, in_ndim, y.ndim)[1]))

    def _sharding(self, spec: PartitionSpec) -> NamedSharding:
        """``spec`` on the mesh; inside the map, on the context's mesh (the map's axes manual there)."""
        return NamedSharding(jax.sharding.get_abstract_mesh() if self.mapped else self.mesh, spec)

    def _region(self, per_device, in_specs: tuple, out_specs: PartitionSpec):
        """A model-parallel layer's per-device computation: a ``shard_map``, nested over ``model`` inside the map."""
        if self.mapped:
            return nested.region(per_device, in_specs, out_specs, mesh_lib.MODEL_AXIS)
        return jax.shard_map(per_device, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)


def carried(spec: PartitionSpec | None, width: int | None, x_shape) -> PartitionSpec | None:
    """Where the previous layer's output (``spec``, ``width`` features) arrives as an input of shape ``x_shape``. A
    flatten of positions pooled to 1x1 (VGG-A on 32x32 images: fc6 takes conv5_2's 512 channels) keeps a model-split
    layer's channels split over ``model``: they arrive as they left, and a column layer gathers them (the Das model's
    features gather; without this XLA resharded them to the batch split, 1.5x the bytes). Any other change of rank
    (positions flattened into features) is left to :meth:`ActivationLayout._arriving`: the batch split."""
    if (spec is not None and width is not None and len(spec) > 2 and len(spec) != len(x_shape)
            and _is_model(spec[-1]) and x_shape[-1] == width):
        return PartitionSpec(spec[0], *[None] * (len(x_shape) - 2), spec[-1])
    return spec


def source_spec(source, outputs: Mapping, model_input: PartitionSpec | None, batch: PartitionSpec | None) -> tuple:
    """``(spec, width)`` where ``source`` (:func:`dtx.perf.layers.sources`) leaves a layer's input: a layer's output
    where that layer left it (``outputs``: layer -> its output's ``(spec, width)``); ``model_input`` for the model's
    input; a join of branches (a residual add) where they all are, or ``batch`` (the batch split over every device)
    when they differ -- the add then moves the split branch there (an all-to-all, and one back for its gradient;
    :mod:`dtx.perf.model` charges it). The layout and :mod:`dtx.run.verify`'s per-layer programs share the rule."""
    if isinstance(source, frozenset):
        members = [source_spec(member, outputs, model_input, batch) for member in source]
        return members[0] if all(m == members[0] for m in members) else (batch, None)
    if source == "":
        return model_input, None
    return outputs.get(source, (batch, None))


def _graph(root: nn.Module, x) -> dict:
    """Per Dense/Conv layer of the model ``root`` called on ``x``, the source of its input (the graph of a residual
    network, :func:`dtx.perf.layers.sources`); empty when it cannot be read (then each layer is taken to follow the
    previous one, as in a chain)."""
    from dtx.perf.layers import sources

    try:
        return sources(root.clone(parent=None), tuple(x.shape[1:]), x.dtype) or {"": None}
    except Exception:  # noqa: BLE001 -- a model the graph tracer cannot follow is laid out as a chain
        return {"": None}


def _reshard(x: jax.Array, forward: NamedSharding, backward: NamedSharding, via_forward: bool = False) -> jax.Array:
    """``x`` constrained to ``forward``; its cotangent constrained to ``backward`` (first to ``forward``, where it was
    computed, with ``via_forward``: the move back is then an explicit exchange of the cotangent itself)."""

    @jax.custom_vjp
    def move(x):
        return jax.lax.with_sharding_constraint(x, forward)

    def move_fwd(x):
        return move(x), None

    def move_bwd(_, g):
        if via_forward:
            g = jax.lax.with_sharding_constraint(g, forward)
        return (jax.lax.with_sharding_constraint(g, backward),)

    move.defvjp(move_fwd, move_bwd)
    return move(x)


def activation_layout(specs: Any, mesh: Mesh) -> ActivationLayout | None:
    """The layout implied by a parameter-spec tree (:func:`dtx.parallel.param_specs`); ``None`` without model-parallel layers.

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


def _is_model(axes) -> bool:
    return axes in (mesh_lib.MODEL_AXIS, (mesh_lib.MODEL_AXIS,))


def _row_split(module: nn.Module, kernel: PartitionSpec) -> bool:
    """Whether ``module`` is a Dense split over ``model`` along its input features only (:meth:`_row_parallel`)."""
    spec = tuple(kernel)
    return isinstance(module, nn.Dense) and len(spec) == 2 and _is_model(spec[0]) and spec[1] is None


def _axes_entry(axes: tuple[str, ...]):
    """A PartitionSpec entry for a dimension split over ``axes`` (``None`` when there are none)."""
    return None if not axes else axes[0] if len(axes) == 1 else axes


def lookup_layout(mesh: Mesh, mapped: tuple[str, ...] = ()):
    """A context manager factory placing every embedding lookup's output (``nn.Embed``) on the batch split, for
    layouts whose parameters are split while activations stay data parallel (FSDP: ZeRO stage 3,
    Rajbhandari et al. 2020, gathers parameters for use and keeps the examples where they are).

    An embedding table split along its features (a vocabulary the device count does not divide) otherwise
    lends its split to the lookup's output, and XLA's sharding propagation carries it through the whole
    residual stream: every later layer then exchanges activations (all-to-alls, gathered activations)
    instead of gathering its parameters — measured: 2.27x FSDP's bytes on a small transformer LM, 13x on
    the 7B-shape one. Only lookups are pinned: Dense/Conv layers keep XLA's per-layer choice between
    gathering weights, gathering activations and contracting slices, which is what keeps FSDP's memory
    (pinning every layer's output to the batch made XLA:CPU keep whole gathered weights and gradients: 2.6x
    the memory on the speech DNN and 3x on ResNet-18). The constraint holds for the cotangent too. ``mapped``:
    batch axes a surrounding ``jax.vmap`` already splits over (its ``spmd_axis_name``: FSDP's no-sync accumulation,
    :mod:`dtx.step.accumulate`), left out of the constraint, which then places one mapped shard.
    """
    batch = _axes_entry(tuple(axis for axis in mesh_lib.batch_axes(mesh) if axis not in mapped))

    def constrain(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.method_name == "__call__" and isinstance(context.module, nn.Embed) and isinstance(out, jax.Array):
            out = jax.lax.with_sharding_constraint(out, NamedSharding(mesh, PartitionSpec(batch, *[None] * (out.ndim - 1))))
        return out

    return lambda: nn.intercept_methods(constrain)
