"""Pipeline stages split over the ``model`` axis: Megatron's column/row pairs inside each stage.

A mesh with both a ``stage`` and a ``model`` axis under ``parallel.name=pipeline`` runs each stage's blocks
tensor-parallel (Narayanan et al. 2021, *Efficient large-scale language model training on GPU clusters using
Megatron-LM*, arXiv 2104.04473, §2.3: pipeline stages of tensor-parallel groups; the split itself is Shoeybi
et al.'s, arXiv 1909.08053, §3, as :mod:`dtx.parallel.tensor.layout` reads it from the parameters): attention by
heads, the MLP's up-projection by columns and its down-projection by rows, so each device of a stage holds
``1/T`` of those kernels and one all-reduce over ``model`` closes each pair — in the forward pass after the
row layer (Megatron's ``g``), in the backward pass at the column layer's input (its ``f``).

The pipeline step is one ``shard_map`` manual over every axis (:mod:`dtx.parallel.pipeline.step`), so the regions here
are the per-device computation itself, not ``shard_map`` regions: each split module is intercepted
(``nn.intercept_methods``) and run by Megatron's per-device kernels (:func:`dtx.parallel.tensor.megatron.attention`,
``column``, ``row``: the ones the ``tensor`` layout runs inside its regions, masks and dropout included) on its
``1/T`` of the heads or units, with this module's ``f`` and ``g`` written out as custom VJPs (identity one way,
``psum`` over ``model`` the other), so the gradients do not depend on how JAX types a value's replication. The
model is unchanged.

What lives where:

* **parameters**: each stage row holds a device's own slice of the split kernels (and the column biases) and
  the whole of everything else (embedding, positions, LayerNorms, the row layers' and the attention output's
  biases, the head). The ``(P, T·V·row)`` rows are split over ``stage`` and ``model``: device ``(s, t)`` holds
  ``V·row``, ``row`` the largest stage's *local* parameters (:class:`TensorStagePlan`).
* **the boundary buffer**: replicated over ``model``. Between the pairs the residual stream is whole on every
  device of the group (tensor parallelism without sequence parallelism), so each device sends its copy to the
  same ``model`` index of the next stage: the ``ppermute`` over ``stage`` carries the pipeline's message
  unchanged, per device, and no collective over ``model`` is added at a boundary. (Narayanan et al. §4.1
  scatter it over ``model`` and gather it after the hop, trading ``T``-fold smaller inter-node messages for an
  all-gather; on one host nothing is gained, and the per-device bytes stay the pipeline formula's.)
* **replicated parameters' gradients**: equal on every device of the group (``f`` sums the input gradients
  over ``model`` before they reach them), so they need no reduction over ``model``; the gradient rows are
  all-reduced over the data axes only.

**Sequence parallelism** (``tensor.sequence_parallel=True``): the stream between the regions, the boundary buffer
and the ends split over ``model`` by positions too (:mod:`dtx.parallel.pipeline.positions`).
"""

from __future__ import annotations

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh

from dtx import mesh as mesh_lib
from dtx.parallel.pipeline.positions import (
    check_positions,
    gather_from_model,
    own_positions,
    replicated_size,
    scatter_to_model,
)
from dtx.parallel.pipeline.stages import STAGE_AXIS, PipelineError, StagePlan
from dtx.parallel.tensor import megatron
from dtx.parallel.tensor.megatron import megatron_rules
from dtx.paths import named_leaves

MODEL = mesh_lib.MODEL_AXIS


@jax.custom_vjp
def copy_to_model(x):
    """Megatron's ``f``: the region's input as it is; its gradient summed over ``model``."""
    return x


copy_to_model.defvjp(lambda x: (x, None), lambda _, g: (jax.lax.psum(g, MODEL),))


@jax.custom_vjp
def reduce_from_model(x):
    """Megatron's ``g``: the row layer's partial sums summed over ``model``; its gradient as it is."""
    return jax.lax.psum(x, MODEL)


reduce_from_model.defvjp(lambda x: (jax.lax.psum(x, MODEL), None), lambda _, g: (g,))


# (f, g) of a region: tensor parallelism's, or sequence parallelism's. The backward slot re-runs the stage's
# forward, so f's gathered input is kept for the products' gradient (the tensor layout's SP gathers it again).
PAIRS = {False: megatron.Pair(megatron.after(copy_to_model), reduce_from_model),
         True: megatron.Pair(megatron.after(gather_from_model), scatter_to_model)}


def _attention(module, args, kwargs, pair, layer):
    """Self-attention on this device's heads (:func:`dtx.parallel.tensor.megatron.attention`), the output bias added once
    after the reduction."""
    megatron.check_self_attention(module, args, kwargs, layer, "a pipeline stage split over 'model'")
    deterministic, rng = megatron.dropout_of(module, kwargs)
    if rng is not None:  # each device's examples and heads drop their own weights
        for axis in (STAGE_AXIS, MODEL):
            rng = jax.random.fold_in(rng, jax.lax.axis_index(axis))
    params = module.variables["params"]
    y = megatron.attention(module, params, args[0], pair, kwargs.get("mask"), rng, deterministic)
    out_bias = params["out"].get("bias")
    return y if out_bias is None else y + out_bias.astype(y.dtype)


def _column(module, args, kwargs, pair, layer):
    """The MLP's up-projection (:func:`dtx.parallel.tensor.megatron.column`)."""
    return megatron.column(module, module.variables["params"], args[0], pair)


def _row(module, args, kwargs, pair, layer):
    """The MLP's down-projection (:func:`dtx.parallel.tensor.megatron.row`), the bias added once after the reduction."""
    params = module.variables["params"]
    y = megatron.row(module, params["kernel"], args[0], pair)
    return y + params["bias"].astype(y.dtype) if "bias" in params else y


REGIONS = {"attention": _attention, "column": _column, "row": _row}


def regions(kinds: dict, hits: set | None = None, sequence_parallel: bool = False):
    """The interception context that runs the modules at ``kinds`` (module path inside a piece's ``fn`` -> region
    kind) split, with ``f`` and ``g`` of tensor or sequence parallelism (:data:`PAIRS`); ``hits`` collects the paths
    it ran."""
    inside: list = []
    pair = PAIRS[bool(sequence_parallel)]

    def intercept(next_fun, args, kwargs, context):
        path = tuple(context.module.path)
        if inside or context.method_name != "__call__" or path not in kinds:
            return next_fun(*args, **kwargs)
        if hits is not None:
            hits.add(path)
        inside.append(path)
        try:
            return REGIONS[kinds[path]](context.module, args, kwargs, pair, "/".join(path))
        finally:
            inside.pop()

    return nn.intercept_methods(intercept)


@dataclasses.dataclass(frozen=True)
class TensorStagePlan(StagePlan):
    """A :class:`StagePlan` whose stages are split over ``tensor`` devices of the ``model`` axis.

    Attributes:
      tensor: ``T``.
      splits: ``(leaf path, dimension)`` of every leaf split over ``model`` (the rest whole on every device).
      kinds: per layer index, ``(module path inside its fn, region kind)`` of its split modules.
      sequence_parallel: the stream between the regions split over ``model`` by positions (module docstring).
    """

    tensor: int = 1
    splits: tuple = ()
    kinds: tuple = ()
    sequence_parallel: bool = False

    @property
    def positions_split(self) -> int:
        """Over how many devices a stage's stream is split by positions: ``T`` under SP, else 1."""
        return self.tensor if self.sequence_parallel else 1

    def local_shape(self, shape) -> tuple[int, ...]:
        """One example's ``(positions, features)`` stream as a device holds it."""
        return (shape[0] // self.positions_split,) + tuple(shape[1:])

    def leaf_shape(self, path, shape) -> tuple[int, ...]:
        dim = dict(self.splits).get(tuple(path))
        if dim is None:
            return tuple(shape)
        return tuple(n // self.tensor if d == dim else n for d, n in enumerate(shape))

    @property
    def rows_shape(self) -> tuple[int, int]:
        return (self.devices, self.tensor * self.chunks * self.row)

    def local(self, params, index: int) -> dict:
        """Device ``index``'s part (of ``T``) of the model's parameter tree: its slice of each split leaf."""
        splits = dict(self.splits)

        def part(path, leaf):
            dim = splits.get(tuple(str(getattr(k, "key", k)) for k in path))
            if dim is None:
                return leaf
            size = leaf.shape[dim] // self.tensor
            return jax.lax.slice_in_dim(leaf, index * size, (index + 1) * size, axis=dim)
        return jax.tree_util.tree_map_with_path(part, params)

    def pack(self, params) -> jax.Array:
        """The ``(P, T·V·row)`` rows: device ``(s, t)``'s ``V`` stage rows of its slices side by side."""
        rows = []
        for t in range(self.tensor):
            mine = self.local(params, t)
            rows.append(StagePlan.pack(self, mine))  # (P, V·row)
        return jnp.concatenate(rows, axis=1)

    def unpack(self, rows) -> dict:
        """The model's parameter tree from the rows (the inverse of :meth:`pack`)."""
        rows = jnp.reshape(rows, (self.devices, self.tensor, self.chunks * self.row))
        parts = [StagePlan.unpack(self, rows[:, t]) for t in range(self.tensor)]
        splits = dict(self.splits)

        def join(path, *leaves):
            dim = splits.get(tuple(str(getattr(k, "key", k)) for k in path))
            return leaves[0] if dim is None else jnp.concatenate(leaves, axis=dim)
        return jax.tree_util.tree_map_with_path(join, *parts)

    def apply_params(self, stage: int, params, x):
        """Stage ``stage``'s pieces on this device's slices, the split modules run as Megatron's regions."""
        first, sp = self.bounds[stage], self.positions_split
        for i, layer in enumerate(self.stage_layers(stage)):
            scatter = sp > 1 and first + i == 0  # SP: the model's input arrives whole (Megatron's embedding)
            if scatter and self.kinds[0]:
                x = own_positions(x, sp)
            with regions(dict(self.kinds[first + i]), sequence_parallel=self.sequence_parallel):
                x = layer.fn({key: params[key] for key in layer.keys}, x)
            if scatter and not self.kinds[0]:  # run whole (a lookup), then this device's positions kept
                x = own_positions(x, sp)
        return x


def _kinds(rules, layers) -> tuple:
    """Per layer: ``(module path inside its fn, kind)`` of its split modules, from Megatron's rules (a layer's
    module paths are its parameter paths less the top-level key the piece hands its module)."""
    kinds = []
    for layer in layers:
        found = {}
        for path, _ in layer.leaves:
            spec = next((s for regex, s in rules if re.search(regex, "/".join(path))), ())
            if MODEL not in tuple(spec) or path[-1] != "kernel":
                continue
            if len(path) >= 3 and path[-2] == "query" and len(spec) == 3:
                found[tuple(path[1:-2])] = "attention"
            elif len(spec) == 2 and path[-2] not in ("key", "value", "out"):
                found[tuple(path[1:-1])] = "column" if spec[1] == MODEL else "row"
        kinds.append(tuple(sorted(found.items())))
    return tuple(kinds)


def split_plan(plan: StagePlan, abstract_params, mesh: Mesh, example=None,
               sequence_parallel: bool = False) -> TensorStagePlan:
    """``plan`` with its stages split over ``mesh``'s ``model`` axis (module docstring), the stream split by positions
    too under ``sequence_parallel``. Refused, naming the fix: a model with no attention or MLP pair, heads or widths
    the axis does not divide (:func:`megatron_rules`), a split layer its piece does not apply as a flax module (a
    Dense stack's named layers), and under SP a stream whose positions the axis does not divide."""
    size = mesh.shape[MODEL]
    try:
        rules = megatron_rules(abstract_params, mesh, "pipeline")
    except ValueError as error:
        raise PipelineError(f"a {MODEL!r} mesh axis under parallel.name='pipeline' splits each stage's attention "
                            f"heads and MLP pairs (Megatron): {error}; or drop the {MODEL!r} axis from "
                            "--config.mesh") from None
    splits = []
    for path, leaf in named_leaves(abstract_params):
        spec = next((s for regex, s in rules if re.search(regex, path)), ())
        if MODEL in tuple(spec):
            splits.append((tuple(path.split("/")), tuple(spec).index(MODEL)))
    kinds = _kinds(rules, plan.layers)
    split = TensorStagePlan(plan.layers, plan.bounds, plan.chunks, size, tuple(splits), kinds, bool(sequence_parallel))
    if sequence_parallel:
        check_positions(split)
    _check_pieces(split, abstract_params, example)
    return split


def split_over(plan: StagePlan, abstract_params, tensor: int, example=None) -> TensorStagePlan:
    """:func:`split_plan` over ``tensor`` devices of ``model`` without a mesh of devices: the layout of a run saved
    on another mesh (:func:`dtx.parallel.pipeline.relayout.relayout`)."""
    return split_plan(plan, abstract_params, AbstractMesh((tensor,), (MODEL,)), example)


def _check_pieces(plan: TensorStagePlan, abstract_params, example) -> None:
    """Every split layer runs as a region: each piece traced on its slices (nothing runs)."""
    splits = {path for path, _ in plan.splits}
    x = None if example is None else jax.ShapeDtypeStruct((1,) + tuple(example.shape[1:]), example.dtype)
    for i, layer in enumerate(plan.layers):
        wanted = {path for path, _ in plan.kinds[i]}
        owned = {path for path, _ in layer.leaves if path in splits}
        if owned and (not wanted or x is None):
            raise PipelineError(f"pipeline piece {layer.name!r} holds parameters split over {MODEL!r} "
                                f"({sorted('/'.join(p) for p in owned)[:2]}) that it does not apply as a flax "
                                f"attention or Dense module; a {MODEL!r} axis under a pipeline splits the "
                                f"transformer's blocks: drop it from --config.mesh")
        if wanted:
            params = {key: abstract_params[key] for key in layer.keys}
            hits: set = set()

            def run(params, x, layer=layer, i=i):
                with regions(dict(plan.kinds[i]), hits, plan.sequence_parallel):
                    return layer.fn(plan.local(params, 0), x)
            # Traced outside the step's shard_map: model bound as a map's axis of size 1.
            mapped = jax.vmap(run, in_axes=None, axis_size=1, axis_name=MODEL)
            jax.eval_shape(mapped, params, jax.ShapeDtypeStruct((1,) + layer.in_shape,
                                                                x.dtype if i == 0 else jnp.float32))
            if hits != wanted:
                raise PipelineError(f"pipeline piece {layer.name!r}: its layers {sorted(wanted - hits)} are split "
                                    f"over {MODEL!r} but its fn does not call them as flax modules; drop the "
                                    f"{MODEL!r} axis from --config.mesh")


def split_stages(plan: StagePlan) -> bool:
    """Whether ``plan``'s stages are split over ``model``."""
    return isinstance(plan, TensorStagePlan) and plan.tensor > 1


def stage_all_reduces(plan: TensorStagePlan, stage: int) -> int:
    """All-reduces over ``model`` one device of (virtual) stage ``stage`` runs per micro-batch: each region's ``g``
    in the forward slot, and in the backward slot the forward's ``g`` again (the slot re-runs the stage from its
    kept input, GPipe's re-materialisation) and each region's ``f`` (Megatron's 2 forward and 2 backward per block,
    :func:`dtx.parallel.tensor.costs.block_collectives`, plus the re-run's 2). On a stage but the last, the re-run's closing
    ``g`` (the stage's last layer's row layer, whose sum only the stage's output reads) is dead code in the backward
    slot, which reads the output's gradient, not the output: XLA drops it."""
    total = 0
    for i in range(plan.bounds[stage], plan.bounds[stage + 1]):
        kinds = [kind for _, kind in plan.kinds[i]]
        g = sum(kind in ("attention", "row") for kind in kinds)
        f = sum(kind in ("attention", "column") for kind in kinds)
        total += 2 * g + f
    last = [kind for _, kind in plan.kinds[plan.bounds[stage + 1] - 1]]
    return total - (stage < plan.num_stages - 1 and "row" in last)


def stage_collectives(plan: TensorStagePlan, stage: int) -> dict[str, int]:
    """The collectives over ``model`` one device of (virtual) stage ``stage`` runs per micro-batch, by kind. TP:
    :func:`stage_all_reduces`. SP: each all-reduce's place taken by a reduce-scatter and an all-gather — ``g`` a
    reduce-scatter forward (and in the re-run; the dead closing one dropped alike) and an all-gather backward, ``f``
    an all-gather forward (and in the re-run) and a reduce-scatter backward."""
    if not plan.sequence_parallel:
        return {"all-reduce": stage_all_reduces(plan, stage)}
    kinds = [kind for i in range(plan.bounds[stage], plan.bounds[stage + 1]) for _, kind in plan.kinds[i]]
    g = sum(kind in ("attention", "row") for kind in kinds)
    f = sum(kind in ("attention", "column") for kind in kinds)
    last = [kind for _, kind in plan.kinds[plan.bounds[stage + 1] - 1]]
    return {"reduce-scatter": 2 * g + f - (stage < plan.num_stages - 1 and "row" in last), "all-gather": 2 * f + g}


def tensor_traffic(plan: StagePlan, schedule, micro: int, itemsize: int):
    """What one device of the busiest stage sends over ``model`` per step (:mod:`dtx.comm.costmodel`): ``M`` times
    :func:`stage_collectives` of one micro-batch's residual stream (the compute dtype's): ring all-reduces of it
    (TP), reduce-scatters of it and all-gathers of its ``1/T`` (SP); and under SP the replicated gradients'
    all-reduce (float32, :func:`sum_replicated`)."""
    from dtx.comm import costmodel

    if not split_stages(plan):
        return costmodel.Traffic(0, 0)
    # the (time, d_model) stream of a micro-batch, whole: the boundary buffer's (T of a device's under SP)
    stream, t = micro * plan.width * plan.positions_split * itemsize, plan.tensor
    one = {"all-reduce": costmodel.expected_traffic("ring", stream, t, itemsize=itemsize),
           "reduce-scatter": costmodel.Traffic(t - 1, (t - 1) * stream // t),
           "all-gather": costmodel.all_gather_traffic(stream // t, t)}

    def device(s):
        counts = [stage_collectives(plan, c * plan.devices + s) for c in range(plan.chunks)]
        return costmodel.add_traffic(*(costmodel.Traffic(schedule.micro * n * one[kind].messages,
                                                         schedule.micro * n * one[kind].bytes_sent)
                                       for count in counts for kind, n in count.items()))
    busiest = max((device(s) for s in range(plan.devices)), key=lambda traffic: traffic.bytes_sent)
    if not plan.sequence_parallel:
        return busiest
    return costmodel.add_traffic(busiest, costmodel.expected_traffic("ring", 4 * replicated_size(plan), t,
                                                                     itemsize=4))


_BRANCH = re.compile(r"branch_(\d+)_fun/(jvp\(|transpose\(jvp\()?\w+\)*/")


def step_bytes(collectives, schedule, group: int) -> int:
    """Bytes one device of the busiest stage sends per step, from a compiled split pipeline's collectives
    (:func:`dtx.comm.hlo.collectives`). Every device's program holds every stage's slots, each inside its phases'
    loops, so the collectives over the axis that splits the stages (``model``, or ``context``:
    :mod:`dtx.parallel.pipeline.context_stages`; ``group`` devices) in a stage's ``lax.switch`` branch are counted
    as that stage runs them: their trips times ``M`` over the slot's ticks (the rest of the ticks are idle); the
    other collectives (``ppermute``, the gradient all-reduce, the batch's all-gather) run on every device as the
    program reads."""
    every, stages = 0, {}
    for c in collectives:
        m = ([None] + list(_BRANCH.finditer(c.op_name)))[-1]  # the innermost branch: the stage's
        if c.kind in ("all-reduce", "reduce-scatter", "all-gather", "all-to-all") and c.group_size == group \
                and group > 1 and m and "conditional" == c.context:
            kind = "forward" if m.group(2) is None else "backward"
            stage = int(m.group(1))
            stages[stage] = stages.get(stage, 0) + c.bytes_sent * c.trips * schedule.micro / schedule.slot_ticks(kind)
        else:
            every += c.bytes_sent * (c.trips or 1)
    return every + round(max(stages.values(), default=0))
