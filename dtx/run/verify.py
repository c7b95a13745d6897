"""The performance model checked against the program XLA compiles.

:mod:`dtx.perf.model` predicts, per layer of a plan (Das et al., arXiv 1602.06709
§3), what one device computes and sends: a data-parallel layer does the
forward + backward FLOPs of ``B/N`` examples and allreduces its weight gradient
over all ``N`` devices; a model-parallel layer in groups of ``G`` does ``1/G`` of
the work of the group's ``B·G/N`` examples, all-gathers its input and
reduce-scatters the input gradient inside the group, and allreduces its ``1/G``
weight slice across the ``N/G`` groups. Equal numbers cannot see redundant
compute or hidden communication, so this module compiles what the plan runs and
reads the program:

* **per layer**: the layer's forward and both backward products on the plan's
  mesh, its input arriving where the previous layer left its output, its weight
  gradient laid out like the weight, its activations constrained exactly as
  :class:`dtx.parallel.ActivationLayout` constrains them in training. FLOPs from
  XLA's cost analysis, bytes from the collectives in the compiled HLO
  (:mod:`dtx.comm.hlo`, ring conventions of :mod:`dtx.comm.costmodel`).
* **the whole step**: the training step :func:`dtx.step.make_train_step` builds
  for the plan (``jit`` driver, the plan's rules and layout, SGD), whose FLOPs
  also hold the element-wise layers and the update, and whose collectives also
  hold the loss's scalars.

Nothing runs: programs are lowered from shapes and compiled, so a full-size
VGG-A costs compile time (seconds), not memory — no scaled-down twin is needed. Each
device of the emulated CPU mesh is one node of the plan. Build the model in the
cluster's element type (``dtype``/``param_dtype`` bfloat16 for 2-byte clusters) so
the program moves the bytes the model assumes.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from dtx.perf import flops as flops_lib
from dtx.comm import hlo
from dtx import parallel
from dtx.parallel import activations
from dtx.perf import model as perfmodel
from dtx.perf import row_split
from dtx import mesh as mesh_lib
from dtx.perf.clusters import Cluster
from dtx.precision import Policy


class VerifyError(ValueError):
    """A plan that cannot be compiled on the devices at hand."""


class Check(NamedTuple):
    """Predicted against compiled, per device, for one layer or a group of layers."""

    name: str
    choice: str  # "data", "model", "hybrid", or a group's label
    predicted_flops: float
    compiled_flops: float
    predicted_bytes: float
    compiled_bytes: float

    @property
    def flops_ratio(self) -> float | None:
        return _ratio(self.compiled_flops, self.predicted_flops)

    @property
    def bytes_ratio(self) -> float | None:
        return _ratio(self.compiled_bytes, self.predicted_bytes)


def _ratio(compiled: float, predicted: float) -> float | None:
    if predicted == 0:
        return 1.0 if compiled == 0 else None
    return compiled / predicted


def plan_mesh(plan: perfmodel.Plan, devices: Sequence[jax.Device] | None = None):
    """The ``(data, model)`` mesh of ``plan`` on its first ``plan.nodes`` devices."""
    devices = list(jax.devices() if devices is None else devices)
    if plan.nodes > len(devices):
        raise VerifyError(f"the {plan.nodes}-node plan needs {plan.nodes} devices, {len(devices)} are available; "
                          f"verify node counts up to {len(devices)} (on CPU: dtx.emulate_cpu_devices(N))")
    return mesh_lib.make_mesh(plan.mesh_spec, devices=devices[: plan.nodes])


def capture_layers(model: nn.Module, input_shape: Sequence[int]) -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    """Each Dense/Conv layer of ``model`` as a stand-alone module with its per-example input shape."""
    found = {}

    def record(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name == "__call__" and isinstance(module, (nn.Dense, nn.Conv)):
            name = "/".join(module.path)
            found.setdefault(name, (module.clone(parent=None, name=None), tuple(args[0].shape[1:])))
        return next_fun(*args, **kwargs)

    x = jax.ShapeDtypeStruct((1, *map(int, input_shape)), jnp.float32)
    with nn.intercept_methods(record):
        jax.eval_shape(lambda x: model.init(jax.random.key(0), x, train=False), x)  # the key too: nothing runs
    return found


def verify_layers(model: nn.Module, input_shape: Sequence[int], plan: perfmodel.Plan, cluster: Cluster, *,
                  algorithm: str = "ring", devices: Sequence[jax.Device] | None = None) -> list[Check]:
    """Per layer of ``plan``: predicted and compiled per-device FLOPs and bytes sent."""
    mesh = plan_mesh(plan, devices)
    dtype = _dtype(cluster)
    kernels = _kernel_specs(plan)
    modules = capture_layers(model, input_shape)
    checks = []
    batch = PartitionSpec(_batch_entry(mesh))
    arriving, width = batch, None  # the batch arrives split over every device
    outputs = {}  # layer -> (output spec, width): where a residual network's branches find it
    moves, _ = _redistribution(plan, cluster)
    for layer in plan.layers:
        module, in_shape = modules[layer.name]
        x_shape = (plan.global_batch, *in_shape)
        if layer.source is not None:  # a residual network: the input arrives where its source left it
            arriving, width = activations.source_spec(layer.source, outputs, batch, batch)
        compiled, arriving, width = _layer_program(module, x_shape, dtype, mesh,
                                                   activations.carried(arriving, width, x_shape),
                                                   kernels.get(layer.name), moved=layer.name in moves)
        outputs[layer.name] = (arriving, width)
        # The layer alone: an output layer's hand-over to the loss belongs to the whole step's row.
        predicted = _layer_bytes(plan, layer, cluster, algorithm)
        checks.append(Check(
            layer.name, plan.choice(layer.name), layer_flops(plan, layer),
            flops_lib.compiled_flops(compiled) or 0.0, sum(predicted), hlo.total(compiled).bytes_sent))
    return checks


def layer_flops(plan: perfmodel.Plan, layer) -> float:
    """A layer's training FLOPs per device as XLA counts them: forward and both backward products (``train_flops``,
    3 × forward) on the device's share, and one FLOP per parameter the device holds (a split layer's ``1/G``):
    XLA's cost analysis counts the parameter gradient's accumulation once more (measured: 9·C_in·C_out/G more on
    ResNet-18's 3×3 convolutions over 1×1 maps, 1.023 of the layer without it; 1/G of a Dense layer's weights on the
    speech DNN's, 0.5 MFLOP on fc2 at G = 8; the 2.1 % of VGG-A's fc8 at 64 nodes)."""
    held = layer.weights / (plan.group_size if layer.name in plan.sharded else 1)
    return layer.train_flops * plan.global_batch / plan.nodes + held


def step_flops(plan: perfmodel.Plan) -> float:
    """The whole step's FLOPs per device from its layers' (:func:`layer_flops`), less the first layer's input
    gradient: the step differentiates with respect to the parameters, and the first layer's input is the batch, so
    no product computes it (the per-layer programs do: they hand a gradient on). The optimizer's update is
    :func:`dtx.tools.plancheck.with_update`'s (it depends on the optimizer)."""
    first = plan.layers[0]
    return sum(layer_flops(plan, layer) for layer in plan.layers) - first.forward_flops * plan.global_batch / plan.nodes


def _layer_bytes(plan: perfmodel.Plan, layer, cluster: Cluster, algorithm: str = "ring", last: bool = False):
    """The model's ``(activation, gradient)`` bytes of ``layer`` in ``plan``: split by rows or as it chose, and a
    residual network's branch moved to its add's layout (:func:`dtx.perf.model.redistribution`)."""
    if layer.name in plan.rows:
        return row_split.row_bytes(layer, plan.nodes, plan.global_batch, plan.group_size, cluster.bytes_per_element,
                                   algorithm)
    act, grad = perfmodel.layer_bytes(layer, plan.nodes, plan.global_batch, plan.group_size,
                                      layer.name in plan.sharded, cluster.bytes_per_element, algorithm, last)
    return act + _redistribution(plan, cluster)[0].get(layer.name, 0.0), grad


def _redistribution(plan: perfmodel.Plan, cluster: Cluster):
    split = [name for name in plan.sharded if name not in plan.rows]
    return perfmodel.redistribution(plan.layers, split, plan.nodes, plan.global_batch, plan.group_size,
                                    cluster.bytes_per_element)


def _dtype(cluster: Cluster):
    return jnp.bfloat16 if cluster.bytes_per_element == 2 else jnp.float32


def _kernel_specs(plan: perfmodel.Plan) -> dict[str, PartitionSpec]:
    """``layer -> kernel spec`` of the plan's model-parallel layers (column or row split, :meth:`Plan.rules`)."""
    specs = {regex: spec for regex, spec in plan.rules()}
    return {name: specs[f"^{re.escape(name)}/kernel$"] for name in plan.sharded}


def _batch_entry(mesh):
    axes = mesh_lib.batch_axes(mesh)
    return axes[0] if len(axes) == 1 else axes


class _Alone(nn.Module):
    """One layer as a submodule named ``layer``, so the layout's interception sees it as in the model."""

    layer: nn.Module

    @nn.compact
    def __call__(self, x):
        return self.layer(x)


def _layer_program(module: nn.Module, x_shape, dtype, mesh, arriving: PartitionSpec, kernel_spec: PartitionSpec | None,
                   moved: bool = False):
    """Compile forward + input gradient + weight gradient of one layer as the plan lays it out.

    The layer runs under the same :class:`dtx.parallel.ActivationLayout` interception as
    in training; ``arriving`` is where its input comes from. Returns the compiled program,
    the spec of the layer's output (where the next layer finds its input) and its width.
    """
    alone = _Alone(module)
    layout = parallel.ActivationLayout(mesh, {} if kernel_spec is None else {"layer": kernel_spec})
    x = jax.ShapeDtypeStruct(x_shape, dtype)
    params = jax.eval_shape(alone.init, jax.random.key(0), jax.ShapeDtypeStruct((1, *x_shape[1:]), dtype))
    params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, dtype), params)
    y = jax.eval_shape(alone.apply, params, x)
    arriving = layout._arriving(x.ndim, arriving)
    _, out_spec = layout.specs("layer", x.ndim, y.ndim)
    named = functools.partial(NamedSharding, mesh)
    row = kernel_spec is not None and kernel_spec[-1] is None  # a row split's bias is whole
    split = {"kernel": kernel_spec, "bias": PartitionSpec(None if row else mesh_lib.MODEL_AXIS)
             } if kernel_spec is not None else {}
    param_shardings = jax.tree_util.tree_map_with_path(
        lambda path, p: named(split.get(str(path[-1].key), PartitionSpec())), params)

    def forward_backward(params, x, dy):
        def forward(params, x):
            with layout(arriving):
                return alone.apply(params, x)

        y, vjp = jax.vjp(forward, params, x)
        return y, *vjp(dy)  # the weight gradient lands where the weight lives, the input's where it came from

    # A moved branch (a residual add's split operand) hands its output over on the batch split, and takes its
    # gradient back from there: where the add is.
    given = PartitionSpec(_batch_entry(mesh), *[None] * (len(y.shape) - 1)) if moved else out_spec
    program = jax.jit(forward_backward, in_shardings=(param_shardings, named(arriving), named(given)),
                      out_shardings=(named(given), param_shardings, named(arriving)))
    return flops_lib.compile_to_read(program.lower(params, x, jax.ShapeDtypeStruct(y.shape, y.dtype))), out_spec, y.shape[-1]


def verify_step(model: nn.Module, input_shape: Sequence[int], plan: perfmodel.Plan, cluster: Cluster, *,
                devices: Sequence[jax.Device] | None = None, optimizer: str = "sgd") -> Check:
    """The whole training step of ``plan`` (``jit`` driver, ``optimizer``): per-device FLOPs and bytes against the
    sums of the layers' predictions."""
    return step_check(compile_plan_step(model, input_shape, plan, cluster, devices=devices, optimizer=optimizer),
                      plan, cluster)


def compile_plan_step(model: nn.Module, input_shape: Sequence[int], plan: perfmodel.Plan, cluster: Cluster, *,
                      devices: Sequence[jax.Device] | None = None, optimizer: str = "sgd") -> Any:
    """The compiled training step of ``plan`` on its first ``plan.nodes`` devices (the plan's rules, state
    donated): what :func:`step_check` reads and :func:`dtx.perf.memory.compiled_peak` measures."""
    return compile_layout_step(model, input_shape, "rules", plan.mesh_spec, plan.global_batch, optimizer=optimizer,
                               rules=plan.rules(), devices=list(plan_mesh(plan, devices).devices.flat),
                               dtype=_dtype(cluster))


def step_check(compiled: Any, plan: perfmodel.Plan, cluster: Cluster) -> Check:
    """Predicted against compiled FLOPs and bytes of a plan's whole step (:func:`compile_plan_step`)."""
    predicted = sum(sum(_layer_bytes(plan, layer, cluster, last=layer is plan.layers[-1])) for layer in plan.layers)
    predicted += _redistribution(plan, cluster)[1]  # a moved branch's gradient, moved again by its norm's backward
    return Check("step", "whole step", step_flops(plan), flops_lib.compiled_flops(compiled) or 0.0, predicted,
                 hlo.total(compiled).bytes_sent)


def group_totals(checks: Sequence[Check]) -> list[Check]:
    """The layer checks summed per choice (data-parallel layers, model-parallel layers)."""
    groups: dict[str, list[Check]] = {}
    for check in checks:
        groups.setdefault(check.choice, []).append(check)
    return [Check(f"{choice} layers", choice, *(math.fsum(getattr(c, field) for c in members) for field in
                                                 ("predicted_flops", "compiled_flops", "predicted_bytes",
                                                  "compiled_bytes")))
            for choice, members in groups.items()]


def compile_layout_step(model: Any, input_shape: Sequence[int], layout: str | parallel.Layout,
                        mesh_spec: Sequence[tuple[str, int]], global_batch: int, *, optimizer: str = "adam",
                        policy: Policy = Policy(), accum_steps: int = 1, rules: Sequence = (),
                        devices: Sequence[Any] | None = None, dtype: Any = jnp.float32, task: Any = None,
                        labels_shape: Sequence[int] = ()) -> Any:
    """The compiled ``jit`` train step of ``layout`` on ``mesh_spec``, from shapes only: the one place a step is
    built from a layout outside a run (:func:`verify_step`, the memory model's checks;
    :func:`dtx.perf.memory.compiled_peak` reads its peak), compiled to be read and not run
    (:func:`dtx.perf.flops.compile_to_read`).

    The state is donated, as ``dtx train`` runs it; ``rules``: the explicit rules of
    layout ``rules`` (e.g. ``Plan.rules()``); ``dtype``: of the inputs and the parameters (an integer dtype:
    token ids, the parameters then float32); ``task``: the loss (:mod:`dtx.data.tasks`; ``None``:
    classification) with one example's ``labels_shape`` (``(T,)`` for ``next_token``).
    """
    from dtx import optim
    from dtx.step import StepSpec, make_train_step
    from dtx.step.state import abstract_train_state

    mesh = mesh_lib.make_mesh(list(mesh_spec), devices=devices)
    tx = optim.make_optimizer(optimizer, 1e-3)
    example = jax.ShapeDtypeStruct((global_batch, *input_shape), dtype)
    abstract = abstract_train_state(model, tx, example)
    param_dtype = dtype if jnp.issubdtype(dtype, jnp.floating) else jnp.float32
    abstract = abstract.replace(params=jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, param_dtype),
                                                    abstract.params))
    placement = parallel.get_layout(layout).place(abstract, mesh, rules)
    step = make_train_step(model, tx, mesh, StepSpec(driver="jit", policy=policy, accum_steps=accum_steps,
                                                     placement=placement, task=task))
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, placement.state)
    split = mesh_lib.batch_sharding(mesh)
    batch = {"inputs": jax.ShapeDtypeStruct(example.shape, dtype, sharding=split),
             "labels": jax.ShapeDtypeStruct((global_batch, *labels_shape), jnp.int32, sharding=split)}
    return flops_lib.compile_to_read(step.lower(state, batch))
