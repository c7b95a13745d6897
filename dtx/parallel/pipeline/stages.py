"""Pipeline stages: a stack of layers cut into ``P`` contiguous stages, each stage's parameters one row.

Pipeline parallelism (GPipe: Huang et al. 2019, arXiv 1811.06965; 1F1B / PipeDream-Flush: Narayanan et
al. 2021, arXiv 2006.09503) gives each device of the ``stage`` mesh axis a contiguous run of the model's
layers; activations go forward and their gradients back between neighbouring stages
(:mod:`dtx.parallel.pipeline.step`). This module decides the cut and lays the parameters out:

* **The cut.** ``pipeline.boundaries`` (the layer indices where stages 1.. start), or balanced: the
  contiguous split whose costliest stage is cheapest, by each layer's forward FLOPs per example
  (:func:`balance`; GPipe §2.2 partitions "to minimise the variance in the estimated costs").
* **One row per stage.** Stages hold parameters of different shapes, so a stage's parameters are
  flattened into one vector and the vectors padded to the longest: a ``(P, row)`` array split over
  ``stage``, each device holding its own stage's row only. Elementwise optimizers (SGD, momentum, Adam)
  act on it as on the tree (a padded entry has zero gradient and stays zero).
* **One activation buffer.** Boundaries of different shapes (a convolution's ``H × W × C`` map, a
  Dense layer's vector, a transformer's ``T × d`` stream) travel flattened in one ``(micro, width)``
  buffer, ``width`` the largest boundary's elements per example (the logits never travel): a smaller
  boundary is zero-padded on the right, and the stage that receives it slices its elements back and
  reshapes them to its input's shape. The bytes a stage sends per message are therefore
  ``micro × width × itemsize``, padding included (:meth:`StagePlan.message_bytes`, what the model charges).

A model takes part by declaring ``pipeline_layers()``: its pieces in order, each either the name of a Dense
layer (applied to the flattened input or the previous piece's output, ReLU after all but the last: the MLP and
the speech DNN of Das et al. §5), or a pair ``(keys, fn)``: the top-level parameter names the piece owns and
``fn(params, x) -> y`` applying it to a batch (``params`` holds those keys), e.g. LeNet's convolution with its
ReLU and pooling, or a transformer block. Every parameter belongs to exactly one piece; the shapes crossing
each boundary are traced from the input example. A model without it is refused, naming the fix.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from dtx import mesh as mesh_lib
from dtx.mesh import MODEL_AXIS

STAGE_AXIS = "stage"
mesh_lib.declare_axis(mesh_lib.Axis(STAGE_AXIS, "pipeline", replicas=False,
                                    doc="pipeline stages, one per device; they share a data shard's examples"))


def row_spec(mesh) -> PartitionSpec:
    """Where the parameter rows live: split over ``stage``, and over ``model`` where the mesh has one (each device
    its slices of a tensor-parallel stage: :mod:`dtx.parallel.pipeline.tensor_stages`)."""
    return PartitionSpec(STAGE_AXIS, MODEL_AXIS) if MODEL_AXIS in mesh.axis_names else PartitionSpec(STAGE_AXIS)


class PipelineError(ValueError):
    """A pipeline that cannot be built (a model without layers to cut, a cut that does not fit, ...)."""


@dataclasses.dataclass(frozen=True)
class Layer:
    """One piece of the stack (module docstring): its parameters' leaves in row order, the shapes of one example's
    input and output, its forward FLOPs per example, and ``fn(params, x) -> y``."""

    name: str
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    leaves: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...]  # (path in the model's tree, shape), row order
    flops: int  # 2 × the multiply-adds of its matrix products and convolutions, one example
    fn: Callable = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def keys(self) -> tuple[str, ...]:
        """The top-level parameter names the piece owns."""
        return tuple(dict.fromkeys(path[0] for path, _ in self.leaves))

    @property
    def size(self) -> int:
        """Parameters."""
        return sum(math.prod(shape) for _, shape in self.leaves)

    @property
    def in_width(self) -> int:
        return math.prod(self.in_shape)

    @property
    def out_width(self) -> int:
        return math.prod(self.out_shape)


def dense_layer(name: str, fan_in: int, fan_out: int, relu: bool) -> Layer:
    """A Dense layer (kernel, then bias, in its row) on the flattened input, ReLU after it or not."""
    def fn(params, x):
        p = params[name]
        x = x.reshape((x.shape[0], -1))
        x = x if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(p["kernel"].dtype)
        y = jnp.dot(x, p["kernel"]) + p["bias"]
        return jax.nn.relu(y) if relu else y
    return Layer(name, (fan_in,), (fan_out,), (((name, "kernel"), (fan_in, fan_out)), ((name, "bias"), (fan_out,))),
                 2 * fan_in * fan_out, fn)


def product_flops(jaxpr) -> int:
    """2 × the multiply-adds of every ``dot_general`` and ``conv_general_dilated`` of a jaxpr, its inner jaxprs
    included (attention's products under ``jax.nn.dot_product_attention`` are counted over the full ``T × T``)."""
    import jax.extend.core as jex

    total = 0
    for eqn in jaxpr.eqns:
        out = math.prod(eqn.outvars[0].aval.shape) if eqn.outvars else 0
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            total += 2 * out * math.prod(eqn.invars[0].aval.shape[d] for d in contract)
        elif eqn.primitive.name == "conv_general_dilated":
            kernel = eqn.invars[1].aval.shape
            total += 2 * out * math.prod(kernel) // kernel[eqn.params["dimension_numbers"].rhs_spec[0]]
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jex.ClosedJaxpr):
                    total += product_flops(sub.jaxpr)
                elif isinstance(sub, jex.Jaxpr):
                    total += product_flops(sub)
    return total


def _traced_layer(keys: tuple[str, ...], fn: Callable, abstract_params, x: jax.ShapeDtypeStruct) -> Layer:
    """A ``(keys, fn)`` piece with its shapes and FLOPs traced at one example (nothing runs)."""
    params = {key: abstract_params[key] for key in keys}
    leaves = tuple((tuple(str(getattr(k, "key", k)) for k in path), tuple(leaf.shape))
                   for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0])
    jaxpr, out = jax.make_jaxpr(fn, return_shape=True)(params, x)
    return Layer("+".join(keys), tuple(x.shape[1:]), tuple(out.shape[1:]), leaves, product_flops(jaxpr.jaxpr), fn)


def model_layers(model, abstract_params, example=None) -> tuple[Layer, ...]:
    """The model's declared pieces (module docstring), their shapes read from its parameters (Dense stacks) or traced
    from ``example`` (an array or shape/dtype struct of a batch of inputs; needed by other pieces)."""
    declare = getattr(model, "pipeline_layers", None)
    if declare is None:
        raise PipelineError(
            f"parallel.name='pipeline' cuts a sequential model into stages, and model {type(model).__name__} declares "
            "no pieces: use model.name=mlp, speech_dnn, lenet, vgg_a or transformer, or give your module a "
            "pipeline_layers() method (dtx.parallel.pipeline.stages: Dense layer names, or (keys, fn) pairs, in order)")
    try:
        pieces = list(declare())
    except ValueError as error:  # a setting of the model the pipeline cannot run, named by the model
        raise PipelineError(str(error)) from None
    layers, x = [], None
    if example is not None:
        x = jax.ShapeDtypeStruct((1,) + tuple(example.shape[1:]), example.dtype)
    for i, piece in enumerate(pieces):
        if isinstance(piece, str):
            if piece not in abstract_params or set(abstract_params[piece]) != {"kernel", "bias"}:
                raise PipelineError(f"pipeline_layers() names {piece!r}, which is not a Dense layer's parameters "
                                    f"(kernel and bias) of {type(model).__name__}")
            fan_in, fan_out = abstract_params[piece]["kernel"].shape
            layer = dense_layer(piece, int(fan_in), int(fan_out), relu=i < len(pieces) - 1)
        else:
            keys, fn = tuple(piece[0]), piece[1]
            if x is None:
                raise PipelineError(f"{type(model).__name__}'s pipeline pieces are traced from an input example: "
                                    "pass example= (a batch's shape and dtype) to make_plan / make_pipeline")
            missing = [key for key in keys if key not in abstract_params]
            if missing:
                raise PipelineError(f"pipeline_layers() names parameters {missing} that {type(model).__name__} "
                                    "does not have")
            layer = _traced_layer(keys, fn, abstract_params, x)
        layers.append(layer)
        x = jax.ShapeDtypeStruct((1,) + layer.out_shape, jnp.float32)
    owned = [key for layer in layers for key in layer.keys]
    if sorted(owned) != sorted(abstract_params) or len(set(owned)) != len(owned):
        raise PipelineError(f"{type(model).__name__}.pipeline_layers() must own each parameter once: it leaves out "
                            f"{sorted(set(abstract_params) - set(owned))}, repeats "
                            f"{sorted({k for k in owned if owned.count(k) > 1})}")
    return tuple(layers)


def balance(costs: Sequence[float], stages: int) -> tuple[int, ...]:
    """The boundaries (first layer of stages 1..P-1) of the contiguous split of ``costs`` into ``stages`` parts
    whose largest part is smallest (dynamic programming over prefixes; ties: the earliest cut)."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise PipelineError(f"{stages} pipeline stages need at least as many layers; the model has {n}: "
                            "use a smaller 'stage' mesh axis")
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    best = {(0, 0): (0.0, ())}  # (layers used, stages used) -> (largest part, cuts)
    for used in range(1, stages + 1):
        for end in range(used, n - (stages - used) + 1):
            options = []
            for start in range(used - 1, end):
                if (start, used - 1) in best:
                    worst, cuts = best[start, used - 1]
                    options.append((max(worst, prefix[end] - prefix[start]), cuts + ((start,) if start else ())))
            best[end, used] = min(options, key=lambda o: o[0])
    return best[n, stages][1]


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """The layers cut into stages and laid out in rows (module docstring).

    Attributes:
      layers: the model's layer stack.
      bounds: ``S + 1`` layer indices: (virtual) stage ``v`` runs layers ``bounds[v]:bounds[v+1]``.
      chunks: ``V``, the stages each device holds (the interleaved schedule's virtual stages): device ``s``
        holds stages ``c·P + s``, its row the ``V`` stage rows side by side; 1: one stage per device.
      row_multiple: the row's length is padded to a multiple of it (ZeRO-1 splits each row over the ``D`` data
        ranks: :mod:`dtx.parallel.pipeline.zero`); 1: the largest stage's parameters exactly.
    """

    layers: tuple[Layer, ...]
    bounds: tuple[int, ...]
    chunks: int = 1
    row_multiple: int = dataclasses.field(default=1, kw_only=True)  # keyword: subclasses' fields stay positional

    @property
    def num_stages(self) -> int:
        """``S = P·V``: the (virtual) stages."""
        return len(self.bounds) - 1

    @property
    def devices(self) -> int:
        """``P``: the devices of the ``stage`` axis."""
        return self.num_stages // self.chunks

    def stage_layers(self, stage: int) -> tuple[Layer, ...]:
        return self.layers[self.bounds[stage]:self.bounds[stage + 1]]

    @property
    def stage_sizes(self) -> tuple[int, ...]:
        """Parameters per stage (a device's: its slices of a split stage's, :mod:`dtx.parallel.pipeline.tensor_stages`)."""
        return tuple(sum(math.prod(self.leaf_shape(path, shape)) for layer in self.stage_layers(s)
                         for path, shape in layer.leaves) for s in range(self.num_stages))

    def leaf_shape(self, path, shape) -> tuple[int, ...]:
        """A leaf's shape in a device's row (whole here; a split stage's slices in its subclass)."""
        return tuple(shape)

    @property
    def rows_shape(self) -> tuple[int, int]:
        """The parameter rows' shape: ``(P, V·row)``, split over ``stage`` (:func:`row_spec`)."""
        return (self.devices, self.chunks * self.row)

    @property
    def stage_flops(self) -> tuple[int, ...]:
        """Forward FLOPs per example per stage."""
        return tuple(sum(layer.flops for layer in self.stage_layers(s)) for s in range(self.num_stages))

    @property
    def row(self) -> int:
        """Length of a stage's parameter row: the largest stage's parameters (padded to :attr:`row_multiple`)."""
        return -(-max(self.stage_sizes) // self.row_multiple) * self.row_multiple

    @property
    def width(self) -> int:
        """Elements per example of the activation buffer: the largest output a stage sends on (1 for a single stage;
        the last stage's logits stay where the loss is)."""
        return max(self.boundary_widths or (1,))

    def local_shape(self, shape) -> tuple[int, ...]:
        """One example's activation ``shape`` as a device holds it: whole here; a stage whose stream is split by
        positions (sequence or context parallelism) holds its part in its subclass."""
        return tuple(shape)

    @property
    def boundary_widths(self) -> tuple[int, ...]:
        """The elements per example a device sends at each stage boundary (``S - 1`` of them): its part
        (:meth:`local_shape`) of the activations crossing it."""
        return tuple(math.prod(self.local_shape(self.stage_layers(s)[-1].out_shape))
                     for s in range(self.num_stages - 1))

    def message_bytes(self, micro: int, itemsize: int = 4) -> int:
        """Bytes of one activation (or gradient) message: the padded buffer of one micro-batch."""
        return micro * self.width * itemsize

    def pack(self, params) -> jax.Array:
        """The parameter tree as the ``(P, V·row)`` rows (each stage's kernels and biases flattened, zero-padded;
        device ``s``'s row holds stages ``s, P + s, ...``)."""
        rows = [self.flatten(s, params) for s in range(self.num_stages)]
        by_chunk = jnp.stack(rows).reshape(self.chunks, self.devices, self.row)
        return jnp.swapaxes(by_chunk, 0, 1).reshape(self.devices, self.chunks * self.row)

    def unpack(self, rows) -> dict:
        """The ``(P, V·row)`` rows as the model's parameter tree (the inverse of :meth:`pack`)."""
        rows = jnp.swapaxes(jnp.reshape(rows, (self.devices, self.chunks, self.row)), 0, 1)
        rows = rows.reshape(self.num_stages, self.row)
        params = {}
        for s in range(self.num_stages):
            params.update(self.stage_params(s, rows[s]))
        return params

    def stage_keys(self, stage: int) -> tuple[str, ...]:
        """The top-level parameter names stage ``stage`` holds."""
        return tuple(key for layer in self.stage_layers(stage) for key in layer.keys)

    def stage_params(self, stage: int, row) -> dict:
        """Stage ``stage``'s layers' parameters, sliced out of its row (static offsets)."""
        params, offset = {}, 0
        for layer in self.stage_layers(stage):
            for path, shape in layer.leaves:
                shape = self.leaf_shape(path, shape)
                node = params
                for key in path[:-1]:
                    node = node.setdefault(key, {})
                node[path[-1]] = row[offset:offset + math.prod(shape)].reshape(shape)
                offset += math.prod(shape)
        return params

    def flatten(self, stage: int, params) -> jax.Array:
        """Stage ``stage``'s parameter tree (or its gradient) as its row (the inverse of :meth:`stage_params`):
        concatenated and zero-padded, so a gradient taken with respect to the tree becomes a row without the
        row-sized additions that differentiating through the row's slices costs (their transposes are pads)."""
        def leaf(path):
            node = params
            for key in path:
                node = node[key]
            return jnp.ravel(node)
        flat = jnp.concatenate([leaf(path) for layer in self.stage_layers(stage) for path, _ in layer.leaves])
        return jnp.pad(flat, (0, self.row - flat.shape[0]))

    def apply_params(self, stage: int, params, x):
        """Stage ``stage``'s pieces with parameters ``params`` (:meth:`stage_params`) on ``x``, a batch shaped as
        its first piece's input."""
        for layer in self.stage_layers(stage):
            x = layer.fn({key: params[key] for key in layer.keys}, x)
        return x

    def apply_stage(self, stage: int, row, x):
        """Stage ``stage``'s layers on ``x``, their parameters sliced out of ``row``."""
        return self.apply_params(stage, self.stage_params(stage, row), x)


def make_plan(model, abstract_params, stages: int, boundaries: Sequence[int] = (), chunks: int = 1,
              example=None) -> StagePlan:
    """Cut ``model``'s layers into ``stages`` stages (``stages·chunks`` virtual stages with ``chunks`` per device):
    at ``boundaries`` (the first layer of stages 1..), or balanced by forward FLOPs (:func:`balance`); ``example``:
    a batch's inputs (shape and dtype), which pieces other than Dense layers are traced at (:func:`model_layers`)."""
    layers = model_layers(model, abstract_params, example)
    stages = stages * chunks
    if boundaries:
        cuts = tuple(int(b) for b in boundaries)
        if len(cuts) != stages - 1 or list(cuts) != sorted(set(cuts)) or not all(0 < b < len(layers) for b in cuts):
            raise PipelineError(
                f"pipeline.boundaries={tuple(boundaries)} must be {stages - 1} increasing layer indices in "
                f"1..{len(layers) - 1} (where stages 1..{stages - 1} start) for {stages} stages of {len(layers)} "
                "layers; or leave it () to balance the stages by their FLOPs")
    else:
        cuts = balance([layer.flops for layer in layers], stages)
    return StagePlan(layers, (0, *cuts, len(layers)), chunks)


def flops_imbalance(plan: StagePlan) -> float:
    """The costliest stage's FLOPs over the mean stage's (1: perfectly balanced)."""
    flops = plan.stage_flops
    return max(flops) * len(flops) / math.fsum(flops)


def describe(plan: StagePlan) -> list[dict[str, Any]]:
    """One line per stage: its layers, parameters and forward FLOPs per example."""
    return [dict(stage=s, layers=[layer.name for layer in plan.stage_layers(s)], params=plan.stage_sizes[s],
                 flops=plan.stage_flops[s]) for s in range(plan.num_stages)]
