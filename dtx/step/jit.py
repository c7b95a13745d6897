"""The ``jit`` driver ("pjit-style"): ``jax.jit`` with ``NamedSharding``; XLA places the collectives.

The one per-worker body (:mod:`dtx.step.body`) sees the global batch, its gradient reduction is the
identity, and XLA's SPMD partitioner inserts the collectives that the state's placement implies —
data, model, hybrid (Das et al., arXiv 1602.06709, §3), FSDP and ZeRO (Rajbhandari et al. 2020)
alike. Their bytes cannot be counted while tracing: ``dtx train`` reads them from the compiled
program (:func:`dtx.comm.hlo.total`).

With gradient accumulation the gradients are reduced once per step, as under ``shard_map``: each
shard's are summed apart over the micro-batches (:mod:`dtx.step.accumulate`). A shard is a device where
each device holds a whole gradient (data, ZeRO-1), and a model group under the model-parallel layouts
(model, hybrid, rules): their split layers gather activations inside a group, so only the other axes
are mapped; a data-parallel layer among them is still summed inside its group per micro-batch. The map is a
``shard_map`` (under a vmap XLA gathered a conv net's activations and computed them again) but for FSDP. ZeRO-2
and FSDP reduce every micro-batch's gradient to their split accumulator (that is what they are), unless FSDP
is told ``parallel.reduce=once`` ("no sync"): then a shard is a device, holding its own whole gradient. Under
``parallel.name=tensor`` a shard is a model group too, and the map is a ``shard_map`` manual over the data
axes, the Megatron regions nested in it (a vmap of them fails JAX's replication typing). The records count
each loop's collectives once per trip.

Without accumulation a gradient taken on the global batch has XLA reduce the partial sums of each use of a
parameter apart, so a tied embedding (its lookup and the output layer) crossed the data axes twice (GPT-2
small: +31 % of the gradient bytes). A model that declares ``reuses_parameters`` therefore takes its one pass
inside a ``shard_map`` manual over the batch axes where the parameters are whole (data, ZeRO-1, ZeRO-2): each
device sums its uses, then the one reduction. Only such a model: the map changes XLA's buffers, which the
memory model reads from the global program (and a vmap instead made XLA gather a convolution's activations).
"""

from __future__ import annotations

import contextlib
import functools

import jax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dtx import mesh as mesh_lib
from dtx.comm import context as comm_lib
from dtx.parallel import activations as activations_lib
from dtx.step import accumulate, batchnorm, body
from dtx.step.spec import StepSpec


class JitDriver:
    """``jax.jit`` with the placement's shardings (module docstring)."""

    name = "jit"
    explicit = False  # XLA places the collectives: no strategy, compressor or algorithm of ours runs

    def comm(self, mesh: Mesh, spec: StepSpec) -> comm_lib.CommContext:
        """The compiler's context: the gradient is already global, nothing is counted while tracing."""
        return comm_lib.compiler(mesh_lib.data_parallel_size(mesh))

    def train_step(self, model, tx, mesh: Mesh, spec: StepSpec):
        placement = spec.placement
        gradients = placement.gradients if placement is not None else None
        split_grads = (functools.partial(lax.with_sharding_constraint, shardings=gradients)
                       if gradients is not None else _identity)
        micro_sharding = NamedSharding(mesh, PartitionSpec(None, mesh_lib.batch_axes(mesh)))
        apart = _apart(mesh, spec, getattr(model, "reuses_parameters", False))
        layout = _activations(placement, mesh)
        if apart is not None:  # batch norm inside the per-shard map: statistics over all shards, as in one pass
            model = batchnorm.synchronise(model, apart.axis_names)
            if placement is not None and placement.activations is not None:
                layout = placement.activations.inside_map(apart.axes)
            elif placement is not None and placement.layout.zero_stage == 3:  # FSDP's lookups, one mapped shard
                layout = activations_lib.lookup_layout(mesh, apart.axes)
        route = body.Route(shards=mesh_lib.data_parallel_size(mesh),
                           constrain=lambda x: lax.with_sharding_constraint(x, micro_sharding), layout=layout,
                           split_grads=split_grads, apart=apart,
                           split_micro=split_grads if placement is not None and placement.shard_accumulator
                           else _identity)
        train = _prepared(functools.partial(body.train_body, worker=body.Worker.of(model, tx, spec), route=route,
                                            comm=self.comm(mesh, spec)), layout)
        state_sharding = _state_sharding(mesh, placement)
        return jax.jit(_without_comm(train), in_shardings=(state_sharding, mesh_lib.batch_sharding(mesh)),
                       out_shardings=(state_sharding, mesh_lib.replicated(mesh)),
                       donate_argnums=(0,) if spec.donate else ())

    def eval_step(self, model, mesh: Mesh, spec: StepSpec):
        layout = _activations(spec.placement, mesh)
        evaluate = _prepared(functools.partial(body.eval_body, body.Worker.of(model, None, spec),
                                               self.comm(mesh, spec), _identity, layout), layout)
        return jax.jit(evaluate, in_shardings=(_state_sharding(mesh, spec.placement), mesh_lib.batch_sharding(mesh)),
                       out_shardings=mesh_lib.replicated(mesh))


def _apart(mesh: Mesh, spec: StepSpec, reuses: bool = False) -> accumulate.Apart | None:
    """Each shard's gradient summed apart and reduced once per step: at ``k = 1`` for a model that declares it
    uses a parameter twice (``reuses_parameters``) where the parameters are whole (module docstring); with
    accumulation
    (:mod:`dtx.step.accumulate`), where a shard can hold its own unreduced gradient laid out as the
    parameters are: one device per shard with whole parameters (data, ZeRO-1; FSDP accumulating whole
    gradients, Placement.whole_gradients), one model group per shard
    when kernels are split over ``model`` and over nothing the map runs along (model, hybrid, rules, tensor:
    a ``shard_map`` where the layout's regions are ``manual``). ZeRO-2 and FSDP (by default) split every
    micro-batch's gradient over all devices: that is what they are."""
    placement = spec.placement
    activations = placement.activations if placement is not None else None
    if activations is not None and not (getattr(activations, "mappable", True)
                                        or getattr(activations, "manual", False)):
        return None  # a layout that moves activations its own way (context parallelism) runs in the global view
    if spec.accum_steps == 1:  # each shard's whole gradient, then one reduction (module docstring)
        whole = placement is None or (not placement.layout.splits_kernels and placement.layout.zero_stage < 3)
        return accumulate.Apart(mesh, mesh_lib.batch_axes(mesh), manual=True) if reuses and whole else None
    if placement is None or placement.whole_gradients:
        # A shard_map (module docstring), but for FSDP: it held the whole parameters beside the whole accumulator.
        fsdp = placement is not None and placement.layout.zero_stage == 3
        return accumulate.Apart(mesh, mesh_lib.batch_axes(mesh), manual=not fsdp)
    axes = mesh_lib.group_batch_axes(mesh)
    specs = jax.tree.map(lambda s: s.spec, placement.state.params)
    used = {a for p in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec)) for entry in p
            for a in ((entry,) if isinstance(entry, str) else entry or ())}
    manual = getattr(activations, "manual", False)  # its regions run inside a shard_map, not a vmap
    if placement.layout.zero_stage != 0 or activations is None or not (activations.mappable or manual) \
            or used & set(axes):
        return None
    return accumulate.Apart(mesh, axes, specs, manual=manual)


def _prepared(step, layout):
    """``step(state, batch)`` on the batch as the activation layout lays it out first (``layout.prepare``: context
    parallelism's load-balanced order of positions), or ``step`` itself."""
    prepare = getattr(layout, "prepare", None)
    if prepare is None:
        return step
    return lambda state, batch: step(state, prepare(batch))


def _state_sharding(mesh: Mesh, placement):
    return mesh_lib.replicated(mesh) if placement is None else placement.state


def _activations(placement, mesh: Mesh):
    """Where activations live: a context manager factory — model-parallel layers' layout; under FSDP embedding
    lookups' outputs on the batch split (:func:`dtx.parallel.activations.lookup_layout`); else nothing."""
    if placement is not None and placement.activations is not None:
        return placement.activations
    if placement is not None and placement.layout.zero_stage == 3:
        return activations_lib.lookup_layout(mesh)
    return contextlib.nullcontext


def _without_comm(train):
    """Under ``jit`` XLA places the collectives, so the step cannot count them while tracing: their bytes
    are read from the compiled program instead (:mod:`dtx.comm.hlo`; ``dtx train`` records them)."""

    def step(state, batch):
        new_state, metrics = train(state, batch)
        return new_state, {k: v for k, v in metrics.items() if k not in ("comm_bytes", "comm_rounds")}

    return step


def _identity(tree):
    return tree
