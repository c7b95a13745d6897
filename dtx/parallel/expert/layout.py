"""Where an expert-parallel step's state and activations live: the experts split over the ``expert`` axis.

Placement (:func:`expert_rules`): the stacked expert weights of every mixture of experts in the model — the
``wi``, ``bi``, ``wo``, ``bo`` beside a ``router`` (:data:`dtx.models.moe.EXPERT_PARAMS`), leading dimension
``E`` — are split over ``expert`` along ``E`` (``E/X`` experts a device), their optimizer state with them; every
other parameter is placed as the layout without the axis would place it (replicated, or split over ``fsdp`` at
its ZeRO stage; an expert weight's ``fsdp`` split moves off its leading dimension). The batch is split over the data
axes and ``expert`` together (the axis takes the batch, :mod:`dtx.parallel.expert`), so under the ``jit`` driver
(:mod:`dtx.step.jit`) XLA averages the gradient of every layer that is not an expert over both, as over any batch
axis.

The all-to-alls (:class:`ExpertSplit`, the layout's activation context): every MoE layer routes in the global
view, exactly as on one device — so the same tokens are dropped on any layout, routing being per sequence — and its
dispatch, experts and combine (:meth:`dtx.models.moe.MoE.mix`, intercepted with ``nn.intercept_methods``) run
inside a ``jax.shard_map`` manual over the mesh (in the global view XLA's partitioner gathered the dispatch's and
combine's per-sequence gathers whole on every device): each device fills the capacity buckets ``(E, g, C, d)``
of its own ``g`` sequences, an all-to-all over ``expert``
sends expert ``j``'s buckets to the device holding it (``(E, g, C, d) -> (E/X, X·g, C, d)``), the device's
``E/X`` experts run on the buckets of every sequence of its expert group, and the reverse all-to-all brings each
output back to its sequence's device (``(E/X, X·g, C, d) -> (E, g, C, d)``). The backward pass runs their
transposes, two more all-to-alls; the expert weights' gradient is summed over the data axes where the region's
input is replicated over them (shard_map's transpose). All-to-alls with replica groups run in every device's
program unconditionally (no collective sits in a branch some devices skip, which XLA:CPU cannot run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from typing import Any, ClassVar

import flax.linen as nn
import jax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dtx import mesh as mesh_lib
from dtx.config import ConfigError, is_import_path, register_check
from dtx.models import moe as moe_lib
from dtx.parallel.activations import lookup_layout
from dtx.parallel.expert import EXPERT_AXIS
from dtx.parallel.rules import PartitionError
from dtx.paths import named_leaves


class ExpertError(ValueError):
    """A model or batch expert parallelism cannot run, named with the fix."""


def expert_paths(abstract_params: Any) -> dict[str, tuple[int, ...]]:
    """The paths (``"Block_0/moe/wi"``) and shapes of every MoE layer's stacked expert weights: the leaves named
    :data:`dtx.models.moe.EXPERT_PARAMS` beside a ``router`` kernel whose outputs (the experts) lead them."""
    leaves = {path: tuple(leaf.shape) for path, leaf in named_leaves(abstract_params)}
    found = {}
    for path, shape in leaves.items():
        parent, _, name = path.rpartition("/")
        router = leaves.get(f"{parent}/router/kernel" if parent else "router/kernel")
        if name in moe_lib.EXPERT_PARAMS and router is not None and shape and shape[0] == router[-1]:
            found[path] = shape
    return found


def expert_rules(abstract_params: Any, mesh: Mesh, rules: list) -> list:
    """``rules`` (a layout's, for the parameters or the optimizer state) with every expert weight split over
    ``expert`` along its leading dimension first (module docstring); refused, naming the key, for a model without
    MoE layers or experts the axis does not divide."""
    if EXPERT_AXIS not in mesh.axis_names:
        raise PartitionError(f"the expert layout splits experts over an {EXPERT_AXIS!r} mesh axis, and the mesh "
                             f"{dict(mesh.shape)} has none: add one, e.g. --config.mesh='((\"data\", 2), "
                             f"(\"{EXPERT_AXIS}\", 4))'")
    if abstract_params is None:
        raise PartitionError("the expert layout reads the experts from the parameters; pass abstract_params")
    paths, size = expert_paths(abstract_params), mesh.shape[EXPERT_AXIS]
    if not paths:
        raise PartitionError(f"an {EXPERT_AXIS!r} mesh axis splits a mixture of experts' experts, and this model has "
                             "no MoE layer (no stacked expert weights beside a router: dtx.models.moe.MoE): drop the "
                             f"{EXPERT_AXIS!r} axis from --config.mesh (a 'data' axis carries the batch) or give the "
                             "model MoE layers (model.moe.experts)")
    compiled = [(re.compile(regex), spec) for regex, spec in rules]
    own = []
    for path, shape in paths.items():
        if shape[0] % size:
            raise PartitionError(f"model.moe.experts={shape[0]} ({path}) does not split over the {size} devices of "
                                 f"the {EXPERT_AXIS!r} mesh axis: use experts divisible by {size}, or an "
                                 f"{EXPERT_AXIS!r} axis whose size divides {shape[0]} in --config.mesh")
        spec = next((s for pattern, s in compiled if pattern.search(path)), P())
        own.append((f"^{re.escape(path)}$", _with_expert(spec, shape, mesh)))
    return own + list(rules)


def _with_expert(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
    """``spec`` with ``expert`` on the leading dimension; a split it had there (``fsdp``) moves to the largest
    other dimension it divides, or is dropped."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    moved, entries[0] = entries[0], EXPERT_AXIS
    if moved is not None:
        size = math.prod(mesh.shape[a] for a in (moved if isinstance(moved, tuple) else (moved,)))
        free = [d for d in sorted(range(1, len(shape)), key=lambda d: -shape[d])
                if entries[d] is None and shape[d] % size == 0]
        if free:
            entries[free[0]] = moved
    return P(*entries)


@dataclasses.dataclass(frozen=True, eq=False)
class ExpertSplit:
    """The activation context of an expert-parallel step (module docstring): call it for a context manager.
    ``lookups``: embedding lookups pinned to the batch split too, as FSDP's (the parameters split over ``fsdp``:
    :func:`dtx.parallel.activations.lookup_layout`)."""

    mesh: Mesh
    lookups: bool = False
    mappable: ClassVar[bool] = False  # no per-shard map for gradient accumulation (dtx.step.accumulate)
    manual: ClassVar[bool] = False

    @property
    def size(self) -> int:
        return self.mesh.shape[EXPERT_AXIS]

    def memory(self, model: nn.Module, example, dtype):
        """What the memory model (:mod:`dtx.run.memory_check`) estimates a device as: ``(shape, sharing, adjust)``,
        one example's input (the axis takes the batch: every device holds examples of its own), ``1`` device an
        example, and ``adjust(examples, estimate)``: the model's data-parallel estimate with ``1 − 1/X`` of the
        experts' share of the parameters, their gradients and optimizer state taken off — a device holds ``E/X``
        of them (:func:`expert_rules`). The buckets are the activations' estimate's (the MoE layer's own). Read
        against ``memory_analysis`` in tests/test_expert.py."""
        abstract = jax.eval_shape(lambda x: model.init(jax.random.key(0), x), example)["params"]
        experts = sum(math.prod(shape) for shape in expert_paths(abstract).values())
        share = experts / max(sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(abstract)), 1)
        cut = (1 - 1 / self.size) * share

        def adjust(examples: int, found):
            saved = cut * (found.params + found.grads + found.optimizer)
            return dataclasses.replace(found, params=found.params * (1 - cut), grads=found.grads * (1 - cut),
                                       optimizer=found.optimizer * (1 - cut), total=found.total - saved)

        return tuple(example.shape[1:]), 1, adjust

    def run(self, module: moe_lib.MoE, x, chosen, slot, kept, gates, wi, bi, wo, bo):
        """:meth:`dtx.models.moe.MoE.mix` over the ``expert`` axis: each device dispatches its own sequences'
        tokens (``x (groups, tokens, d)`` and their routing, split over the batch axes) to their buckets, which an
        all-to-all brings to the experts' devices and another brings back, and combines them (module
        docstring)."""
        batch = mesh_lib.batch_axes(self.mesh)
        shards = math.prod(self.mesh.shape[a] for a in batch)
        experts, groups = module.experts, x.shape[0]
        if experts % self.size or groups % shards:
            raise ExpertError(f"{module.name}: its {experts} experts must split over the {self.size} devices of "
                              f"{EXPERT_AXIS!r} and its {groups} groups (sequences) over the {shards} devices of "
                              f"the batch axes {batch}; use model.moe.experts divisible by {self.size} and a "
                              "(batch, tokens, d) input whose batch the batch axes divide (global_batch_size)")
        slots = moe_lib.capacity(x.shape[1], experts, module.routing.top_k, module.routing.capacity_factor)

        def local(x, chosen, slot, kept, gates, *weights):
            return moe_lib.mix(x, chosen, slot, kept, gates, weights, experts, slots, run=_exchange)

        spread, split = P(batch[0] if len(batch) == 1 else batch), P(EXPERT_AXIS)
        return jax.shard_map(local, mesh=self.mesh, in_specs=(spread,) * 5 + (split,) * 4, out_specs=spread)(
            x, chosen, slot, kept, gates, wi, bi, wo, bo)

    @contextlib.contextmanager
    def __call__(self):
        def intercept(next_fun, args, kwargs, context):
            if context.method_name == moe_lib.EXPERT_METHOD and isinstance(context.module, moe_lib.MoE):
                return self.run(context.module, *args, **kwargs)
            return next_fun(*args, **kwargs)

        with contextlib.ExitStack() as stack:
            if self.lookups:
                stack.enter_context(lookup_layout(self.mesh)())
            stack.enter_context(nn.intercept_methods(intercept))
            yield


def _exchange(buckets, wi, bi, wo, bo):
    """One device's experts on the buckets, inside the region manual over the mesh: its sequences' buckets
    ``(E, g, C, d)`` to the experts' devices (split along the experts, gathered along the groups), its ``E/X``
    experts on ``(E/X, X·g, C, d)``, the outputs back (split along the groups, gathered along the experts)."""
    mine = lax.all_to_all(buckets, EXPERT_AXIS, 0, 1, tiled=True)  # dispatch
    outputs = moe_lib.expert_mlp(mine, wi, bi, wo, bo)
    return lax.all_to_all(outputs, EXPERT_AXIS, 1, 0, tiled=True)  # combine


def expert_split(specs, mesh: Mesh) -> ExpertSplit:
    """The layout's activation factory (:attr:`dtx.parallel.Layout.activation_factory`): ``specs``, the parameters'
    partition specs, say whether anything is split over ``fsdp`` (then embedding lookups are pinned as FSDP's)."""
    if EXPERT_AXIS not in mesh.axis_names:
        raise ExpertError(f"the expert layout splits experts over an {EXPERT_AXIS!r} mesh axis, and the mesh "
                          f"{dict(mesh.shape)} has none: add one, e.g. --config.mesh='((\"data\", 2), "
                          f"(\"{EXPERT_AXIS}\", 4))'")
    named = {a for spec in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)) for entry in spec
             for a in ((entry,) if isinstance(entry, str) else entry or ())}
    return ExpertSplit(mesh, lookups=mesh_lib.FSDP_AXIS in named)


@register_check
def check_config(config) -> None:
    """On a mesh with an ``expert`` axis: the model has MoE layers (``model.moe.experts`` > 0) and the axis's size
    divides their experts — refused by key before anything is built. (A model given by import path is checked
    when the state is placed: :func:`expert_rules`.)"""
    size = dict((name, size) for name, size in config.mesh).get(EXPERT_AXIS)
    if size is None:
        return
    model = config.get("model") or {}
    name = model.get("name", "")
    block = model.get("moe")
    if block is None:
        if is_import_path(name):  # the user's module: its MoE layers are read from its parameters
            return
        raise ConfigError(f"an {EXPERT_AXIS!r} mesh axis in --config.mesh splits a mixture of experts' experts, and "
                          f"model.name={name!r} has no MoE layers: drop the {EXPERT_AXIS!r} axis (a 'data' axis "
                          "carries the batch), or use model.name=transformer with --config.model.moe.experts=8")
    experts = block.get("experts", 0)
    if not experts:
        raise ConfigError(f"an {EXPERT_AXIS!r} mesh axis in --config.mesh splits a mixture of experts' experts, and "
                          f"model.moe.experts={experts} keeps every MLP dense: set --config.model.moe.experts=8 (a "
                          f"multiple of the axis), or drop the {EXPERT_AXIS!r} axis")
    if size > 0 and experts % size:
        fits = [d for d in range(1, size + 1) if experts % d == 0]
        raise ConfigError(f"model.moe.experts={experts} does not split over the {size} devices of the "
                          f"{EXPERT_AXIS!r} mesh axis: use experts divisible by {size} "
                          f"(--config.model.moe.experts={size * max(1, experts // size)}), or an {EXPERT_AXIS!r} "
                          f"axis size in {fits} in --config.mesh")
