"""Pipeline stages: a stack of layers cut into ``P`` contiguous stages, each stage's parameters one row.

Pipeline parallelism (GPipe: Huang et al. 2019, arXiv 1811.06965; 1F1B / PipeDream-Flush: Narayanan et
al. 2021, arXiv 2006.09503) gives each device of the ``stage`` mesh axis a contiguous run of the model's
layers; activations go forward and their gradients back between neighbouring stages
(:mod:`dtx.step.pipeline`). This module decides the cut and lays the parameters out:

* **The cut.** ``pipeline.boundaries`` (the layer indices where stages 1.. start), or balanced: the
  contiguous split whose costliest stage is cheapest, by each layer's forward FLOPs per example
  (:func:`balance`; GPipe §2.2 partitions "to minimise the variance in the estimated costs").
* **One row per stage.** Stages hold parameters of different shapes, so a stage's parameters are
  flattened into one vector and the vectors padded to the longest: a ``(P, row)`` array split over
  ``stage``, each device holding its own stage's row only. Elementwise optimizers (SGD, momentum, Adam)
  act on it as on the tree (a padded entry has zero gradient and stays zero).
* **One activation buffer.** Boundaries of different widths travel in one ``(micro, width)`` buffer,
  ``width`` the widest boundary a stage sends (the logits never travel): a narrower boundary is
  zero-padded on the right and sliced back by the stage that receives it. The bytes a stage sends per
  message are therefore ``micro × width × itemsize`` (:meth:`StagePlan.message_bytes`).

A model takes part by declaring ``pipeline_layers()``: its parameter collections in order, each a Dense
layer applied to the flattened input or the previous layer's output, ReLU between (the MLP and the
speech DNN of Das et al. §5). A model without it is refused, naming the fix.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

STAGE_AXIS = "stage"


class PipelineError(ValueError):
    """A pipeline that cannot be built (a model without layers to cut, a cut that does not fit, ...)."""


@dataclasses.dataclass(frozen=True)
class Layer:
    """One Dense layer of the stack: ``name`` (its parameter collection), widths, ReLU after it or not."""

    name: str
    in_width: int
    out_width: int
    relu: bool

    @property
    def size(self) -> int:
        """Parameters: kernel and bias."""
        return self.in_width * self.out_width + self.out_width

    @property
    def flops(self) -> int:
        """Forward FLOPs per example (a multiply and an add per kernel entry)."""
        return 2 * self.in_width * self.out_width


def model_layers(model, abstract_params) -> tuple[Layer, ...]:
    """The model's declared layer stack (module docstring), with widths read from its parameters."""
    declare = getattr(model, "pipeline_layers", None)
    if declare is None:
        raise PipelineError(
            f"parallel.name='pipeline' cuts a stack of Dense layers, and model {type(model).__name__} declares none: "
            "use model.name=mlp or speech_dnn, or give your module a pipeline_layers() method returning its Dense "
            "layers' parameter names in order (flattened input, ReLU between, logits last)")
    names = list(declare())
    layers = []
    for i, name in enumerate(names):
        if name not in abstract_params or set(abstract_params[name]) != {"kernel", "bias"}:
            raise PipelineError(f"pipeline_layers() names {name!r}, which is not a Dense layer's parameters "
                                f"(kernel and bias) of {type(model).__name__}")
        fan_in, fan_out = abstract_params[name]["kernel"].shape
        layers.append(Layer(name, int(fan_in), int(fan_out), relu=i < len(names) - 1))
    if set(abstract_params) != set(names):
        raise PipelineError(f"{type(model).__name__}.pipeline_layers() leaves out parameters "
                            f"{sorted(set(abstract_params) - set(names))}")
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
    """

    layers: tuple[Layer, ...]
    bounds: tuple[int, ...]
    chunks: int = 1

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
        """Parameters per stage."""
        return tuple(sum(layer.size for layer in self.stage_layers(s)) for s in range(self.num_stages))

    @property
    def stage_flops(self) -> tuple[int, ...]:
        """Forward FLOPs per example per stage."""
        return tuple(sum(layer.flops for layer in self.stage_layers(s)) for s in range(self.num_stages))

    @property
    def row(self) -> int:
        """Length of a stage's parameter row: the largest stage's parameters."""
        return max(self.stage_sizes)

    @property
    def width(self) -> int:
        """Width of the activation buffer: the widest output a stage sends on (1 for a single stage; the last stage's
        logits stay where the loss is)."""
        return max(self.boundary_widths or (1,))

    @property
    def boundary_widths(self) -> tuple[int, ...]:
        """The ``P - 1`` widths of the activations crossing each stage boundary."""
        return tuple(self.stage_layers(s)[-1].out_width for s in range(self.num_stages - 1))

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

    def stage_params(self, stage: int, row) -> dict:
        """Stage ``stage``'s layers' parameters, sliced out of its row (static offsets)."""
        params, offset = {}, 0
        for layer in self.stage_layers(stage):
            kernel = row[offset:offset + layer.in_width * layer.out_width].reshape(layer.in_width, layer.out_width)
            offset += layer.in_width * layer.out_width
            params[layer.name] = {"kernel": kernel, "bias": row[offset:offset + layer.out_width]}
            offset += layer.out_width
        return params

    def flatten(self, stage: int, params) -> jax.Array:
        """Stage ``stage``'s parameter tree (or its gradient) as its row (the inverse of :meth:`stage_params`):
        concatenated and zero-padded, so a gradient taken with respect to the tree becomes a row without the
        row-sized additions that differentiating through the row's slices costs (their transposes are pads)."""
        flat = jnp.concatenate([jnp.ravel(params[layer.name][leaf])
                                for layer in self.stage_layers(stage) for leaf in ("kernel", "bias")])
        return jnp.pad(flat, (0, self.row - flat.shape[0]))

    def apply_params(self, stage: int, params, x):
        """Stage ``stage``'s layers with parameters ``params`` (:meth:`stage_params`) on ``x`` (its real input
        width): Dense, then ReLU but after the last layer."""
        for layer in self.stage_layers(stage):
            p = params[layer.name]
            x = jnp.dot(x, p["kernel"]) + p["bias"]
            if layer.relu:
                x = jax.nn.relu(x)
        return x

    def apply_stage(self, stage: int, row, x):
        """Stage ``stage``'s layers on ``x``, their parameters sliced out of ``row``."""
        return self.apply_params(stage, self.stage_params(stage, row), x)


def make_plan(model, abstract_params, stages: int, boundaries: Sequence[int] = (), chunks: int = 1) -> StagePlan:
    """Cut ``model``'s layers into ``stages`` stages (``stages·chunks`` virtual stages with ``chunks`` per device):
    at ``boundaries`` (the first layer of stages 1..), or balanced by forward FLOPs (:func:`balance`)."""
    layers = model_layers(model, abstract_params)
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
