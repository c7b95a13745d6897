"""The pipeline-parallel train step under ``shard_map``: stages on the ``stage`` axis, data on the others.

Pipeline parallelism (GPipe: Huang et al. 2019, arXiv 1811.06965; 1F1B: PipeDream-Flush, Narayanan et al.
2021, arXiv 2006.09503, and Narayanan et al. 2021, "Efficient large-scale language model training on GPU
clusters using Megatron-LM", arXiv 2104.04473). Each device of the ``stage`` axis holds its stages' parameter
row (one stage, or ``V`` under the interleaved schedule: :mod:`dtx.parallel.pipeline.stages`) and its optimizer
state; the other mesh axes split the batch
as data parallelism does. A batch arrives split over every axis, as dtx places batches; a step first
gathers each data shard's rows over ``stage`` (one all-gather), splits them into ``M`` micro-batches and
runs a schedule's ticks (:mod:`dtx.parallel.pipeline.schedules`):

* forward slot: stage 0 reads its micro-batch, the others the activation received in the previous tick's
  forward slot, which they also keep (GPipe §2.3's re-materialisation: a stage stores only its *input*,
  one ``(micro, width)`` buffer entry per micro-batch in flight); the last stage scores the logits;
  then one ``ppermute`` sends every stage's output to the next stage;
* backward slot: a stage re-runs its forward pass on the kept input and pulls back the gradient
  received in the previous tick's backward slot (the last stage: the loss's), adds the parameters'
  gradient to its accumulator, then one ``ppermute`` sends the input's gradient to the previous stage.

Which stage runs which micro-batch is the schedule's table, indexed by the stage's ``axis_index``; a
stage with nothing to run in a slot skips the work (``lax.cond``) but still takes part in the slot's
``ppermute``. After the last tick the accumulated gradient (the mean over the ``M`` micro-batches) is
all-reduced over the data axes — once per step, as gradient accumulation does — and each stage applies
the optimizer to its own row. The loss and the task's metrics come from the last stage (``psum`` over
``stage``, where the others add zeros) averaged over the data axes.

What follows the ticks is the step body's (:mod:`dtx.step.body`): its reduction (``make_reduce``: the reduce dtype,
the unscaling), its averages (``averages``: the records, and with loss scaling the verdict, here the sum of every
stage's so that the whole model decides) and its end (``finish``: the skip of an overflowing step, the loss scale,
the next key and step, the records); what is the pipeline's own is the schedule, the rows and their update.

Every message is this module's ``ppermute``, so the compiled program (:mod:`dtx.comm.hlo`) shows each
slot's ``collective-permute`` inside its phase's loop, once per tick.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dtx import compress, optim, strategies
from dtx import mesh as mesh_lib
from dtx.comm import context as comm_lib
from dtx.comm import costmodel
from dtx.data import tasks as task_lib
from dtx.parallel.context import CONTEXT_AXIS
from dtx.parallel.pipeline import optim as pipeline_optim
from dtx.parallel.pipeline import zero as pipeline_zero
from dtx.parallel.pipeline.context_stages import (
    context_plan,
    context_split,
    context_traffic,
    own_labels,
    reduce_axes,
)
from dtx.parallel.pipeline.positions import (
    arriving_shape,
    own_positions,
    positions_split,
    sum_replicated,
)
from dtx.parallel.pipeline.schedules import Schedule, make_schedule
from dtx.parallel.pipeline.stages import STAGE_AXIS, StagePlan, make_plan, row_spec
from dtx.parallel.pipeline.tensor_stages import MODEL, split_plan, tensor_traffic
from dtx.precision import LossScaler, Policy, all_finite
from dtx.step import body
from dtx.step.spec import StepError
from dtx.step.state import TrainState, run_init


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """What a pipeline step is built from: the stage plan, the schedule (its ``micro`` is ``M``) and the
    task (default classification)."""

    plan: StagePlan
    schedule: Schedule
    task: task_lib.Task | None = None
    policy: Policy = Policy()  # compute (and the activation buffer) in policy.compute, the all-reduce in .reduce
    per_tensor: bool = False  # the optimizer needs each stage's tensors (dtx.parallel.pipeline.optim), not the row
    loss_scaler: LossScaler = LossScaler()  # dynamic loss scaling (float16 compute): scaled seeds, skipped steps
    zero_stage: int = 0  # 1: the optimizer state and update split over the data axes; 3: the rows too (pipeline_zero)
    decay: tuple | None = dataclasses.field(default=None, compare=False)  # ZeRO-1's weight-decay row mask, as runs
    record_norm: bool = False  # report grad_norm, the whole model's (pipeline_optim.global_norm)
    clip_norm: float = 0.0  # clip by it (dtx.step.body.Norms)

    # The runner a placement carries (dtx.parallel.layouts.Placement.runner): what the drivers and the run ask.
    def train_step(self, tx: optax.GradientTransformation, mesh: Mesh, spec):
        return train_step(tx, mesh, self, spec)

    def eval_step(self, evaluate):
        return eval_step(evaluate, self.plan)

    def init_state(self, model, tx, example_inputs, seed: int, mesh: Mesh, shardings=None,
                   loss_scaler: LossScaler = LossScaler()) -> TrainState:
        return init_state(model, tx, example_inputs, seed, mesh, self.plan, shardings, loss_scaler)

    def model_params(self, params):
        """The stages' parameter rows as the model's own tree."""
        return self.plan.unpack(params)

    def clock(self, workers: int, global_batch: int, cluster, stragglers):
        """The simulated clock's model: the schedule timed tick by tick (:func:`.costs.clock_model`)."""
        from dtx.parallel.pipeline import costs  # the cost model only where a clock is asked for

        data = workers // self.plan.devices // context_split(self.plan)  # context takes no examples
        return costs.clock_model(self.plan, self.schedule, global_batch // data // self.schedule.micro, data,
                                 cluster, stragglers)


def data_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes that split the batch under a pipeline: the data replicas' (:func:`dtx.mesh.replica_axes`), not
    ``stage`` nor ``model`` (:mod:`.tensor_stages`)."""
    return mesh_lib.replica_axes(mesh)


def _group(mesh: Mesh) -> tuple[str, ...]:
    """The axes whose devices share a data shard's examples: ``stage``, and ``model`` where there is one."""
    return tuple(name for name in (STAGE_AXIS, MODEL) if name in mesh.axis_names)


def check_mesh(mesh: Mesh, pipeline: Pipeline) -> None:
    """The mesh's ``stage`` axis has one device per stage."""
    devices = pipeline.plan.devices
    if STAGE_AXIS not in mesh.axis_names or mesh.shape[STAGE_AXIS] != devices:
        raise StepError(f"a pipeline of {devices} devices needs a {STAGE_AXIS!r} mesh axis of that size, "
                        f"e.g. --config.mesh='((\"{STAGE_AXIS}\", {devices}), (\"data\", -1))'; "
                        f"the mesh is {dict(mesh.shape)}")


def state_shardings(abstract_state: TrainState, mesh: Mesh, plan: StagePlan, zero_stage: int = 0) -> TrainState:
    """Every leaf shaped like the parameter rows split over ``stage`` (and ``model``); the rest replicated. ZeRO-1:
    the optimizer's rows split over the data (or ``fsdp``) axes too, ZeRO-3 the parameter rows as well
    (:func:`dtx.parallel.pipeline.zero.state_shardings`)."""
    rows = plan.rows_shape
    split, whole = NamedSharding(mesh, row_spec(mesh)), NamedSharding(mesh, PartitionSpec())
    if zero_stage:
        return pipeline_zero.state_shardings(abstract_state, mesh, rows, split, zero_stage)
    return jax.tree.map(lambda x: split if tuple(x.shape) == rows else whole, abstract_state)


def _init_fn(model, tx, example_inputs, plan: StagePlan, loss_scaler: LossScaler = LossScaler()):
    def init(seed):
        init_rng, state_rng = jax.random.split(jax.random.key(seed))
        dummy = jnp.zeros((1,) + tuple(example_inputs.shape[1:]), example_inputs.dtype)
        params = model.init({"params": init_rng}, dummy, train=False)["params"]
        return TrainState(step=jnp.zeros((), jnp.int32), params=plan.pack(params), model_state={},
                          opt_state=pipeline_optim.init(tx, plan, params),
                          rng=jax.random.key_data(state_rng), loss_scale=loss_scaler.init())
    return init


def abstract_state(model, tx: optax.GradientTransformation, example_inputs, plan: StagePlan,
                   loss_scaler: LossScaler = LossScaler()) -> TrainState:
    """The pipeline state's shapes, computed without allocating it: ``params`` the ``(P, row)`` rows."""
    return jax.eval_shape(_init_fn(model, tx, example_inputs, plan, loss_scaler), 0)


def init_state(model, tx: optax.GradientTransformation, example_inputs, seed: int, mesh: Mesh,
               plan: StagePlan, shardings: TrainState | None = None,
               loss_scaler: LossScaler = LossScaler()) -> TrainState:
    """The train state with the parameters as the plan's rows, each stage's row (and its optimizer state) on
    that stage's devices. The parameters are the model's own initialisation (the same as one device's)."""
    init = _init_fn(model, tx, example_inputs, plan, loss_scaler)
    shardings = shardings or state_shardings(jax.eval_shape(init, seed), mesh, plan)
    return run_init(init, shardings, seed)


def traffic(plan: StagePlan, schedule: Schedule, micro: int, mesh: Mesh, records: int,
            batch_bytes: tuple[int, ...] = (), policy: Policy = Policy(), zero_stage: int = 0) -> costmodel.Traffic:
    """What one device sends per step, the accountant's count (:mod:`dtx.comm.costmodel`): the all-gather over
    ``stage`` of its ``batch_bytes`` (each array's local part), the schedule's ``ppermute`` messages of one
    micro-batch's buffer (in the policy's compute dtype), the gradient row's all-reduce over the data axes (in its
    reduce dtype; ZeRO: its reduce-scatter and a slice's all-gather, :func:`pipeline_zero.traffic`),
    and the ``records`` float32 scalars' ``psum`` over ``stage`` and ``pmean`` over the data axes."""
    data = math.prod(mesh.shape[a] for a in data_axes(mesh) + reduce_axes(plan))  # context: averaged as data
    split = pipeline_zero.data_size(mesh)  # the devices ZeRO splits the row over (the fsdp axes, or all data axes)
    group = math.prod(mesh.shape[a] for a in _group(mesh))
    sent = costmodel.add_traffic(*(costmodel.all_gather_traffic(n, group) for n in batch_bytes),
                                 tensor_traffic(plan, schedule, micro, jnp.dtype(policy.compute).itemsize),
                                 context_traffic(plan, schedule, micro, jnp.dtype(policy.compute).itemsize))
    sent = costmodel.add_traffic(sent, costmodel.Traffic(schedule.messages,
                                                         schedule.messages * plan.message_bytes(
                                                             micro, jnp.dtype(policy.compute).itemsize)))
    row = jax.ShapeDtypeStruct((plan.chunks * plan.row,), policy.reduce)
    scalars = jax.ShapeDtypeStruct((records,), jnp.float32)
    if zero_stage:
        sent = costmodel.add_traffic(sent, pipeline_zero.traffic(row, 4, split, data // split))
    scored = plan.devices * positions_split(plan)  # the scalars' psum: over model too under SP
    for tree, p in ((scalars, scored), (scalars, data)) if zero_stage else (
            (row, data), (scalars, scored), (scalars, data)):
        sent = costmodel.add_traffic(sent, comm_lib.pmean_traffic(tree, p))
    return sent


def metric_names(task: task_lib.Task, plan: StagePlan) -> tuple[str, ...]:
    """The task's metrics a last stage reports (beside the loss): probed with its outputs and labels shaped as the
    outputs without their class axis (a class per example, or per position of a sequence)."""
    out = plan.layers[-1].out_shape
    probe, labels = jnp.zeros((1,) + out, jnp.float32), jnp.zeros((1,) + out[:-1], jnp.int32)
    return tuple(jax.eval_shape(lambda: task_lib.batch_mean_terms(task, probe, labels, None)[1]))


def slot_functions(plan: StagePlan, task: task_lib.Task, m_count: int, policy: Policy = Policy()):
    """The forward and backward slots' work, one function per (virtual) stage, each its own layers at
    their own shapes (stage 0 reads ``x0``, the inputs as they arrive; the others the first ``in_width`` columns of
    the received buffer, reshaped to their first piece's input; outputs flattened and padded to the buffer's width):

    * ``forward(stage, row, x0, received, labels) -> (output buffer, loss, metrics)``;
    * ``backward(stage, row, x0, kept, labels, grad_in, seed) -> (d_row, d_kept)``: the forward re-run on the kept
      input and pulled back from ``grad_in`` (the last stage: from the loss, ``seed``: ``1/M`` of the step's, times
      the loss scale), the parameter
      gradient taken with respect to the stage's own tree and laid out as its row (:meth:`StagePlan.flatten`).

    Parameters and inputs are cast to ``policy.compute`` (activations travel in it), the logits to
    ``policy.output`` before the loss, as :func:`dtx.step.body.make_loss_fn` casts them."""
    width, last, names = plan.width, plan.num_stages - 1, metric_names(task, plan)
    split = positions_split(plan)  # SP: a device holds 1/T of the positions, its loss 1/T of the micro-batch's
    zero_values = {n: jnp.zeros((), jnp.float32) for n in names}

    def apply(s, params, x0, received, labels):
        first = plan.stage_layers(s)[0]
        shape = arriving_shape(plan, first)
        x = x0 if s == 0 else received[:, :math.prod(shape)].reshape((received.shape[0],) + shape)
        y = plan.apply_params(s, policy.cast_to_compute(params), policy.cast_to_compute(x))
        if s < last:
            zero = jnp.zeros((), jnp.float32)
            y = y.reshape((y.shape[0], -1))
            return jnp.pad(y, ((0, 0), (0, width - y.shape[1]))), zero, {n: zero for n in names}
        labels = own_positions(labels, split) if split > 1 else own_labels(plan, labels)
        loss, values = task_lib.batch_mean_terms(task, policy.cast_to_output(y), labels, None)
        loss = loss / split  # SP: summed over model with the metrics (every device scores as many positions)
        values = {n: lax.stop_gradient(v).astype(jnp.float32) / split for n, v in values.items()}
        return jnp.zeros((y.shape[0], width), policy.compute), loss.astype(jnp.float32), values

    def forward_branch(s):
        return lambda row, x0, received, labels: apply(s, plan.stage_params(s, row), x0, received, labels)

    def backward_branch(s):
        def run(row, x0, kept, labels, grad_in, seed):
            _, vjp = jax.vjp(lambda params, x: apply(s, params, x0, x, labels), plan.stage_params(s, row), kept)
            d_params, d_kept = vjp((grad_in, seed, zero_values))
            return plan.flatten(s, d_params), d_kept
        return run

    return [forward_branch(s) for s in range(plan.num_stages)], [backward_branch(s) for s in range(plan.num_stages)]


def make_pipeline_step(tx: optax.GradientTransformation, mesh: Mesh, pipeline: Pipeline, donate: bool = True):
    """The jitted ``(state, batch) -> (state, metrics)`` pipeline step (module docstring); metrics ``loss`` and
    the task's, averaged over the global batch."""
    check_mesh(mesh, pipeline)
    plan, schedule = pipeline.plan, pipeline.schedule
    task, policy, scaler = pipeline.task or task_lib.classification(), pipeline.policy, pipeline.loss_scaler
    axes = data_axes(mesh)
    # context: each device's loss and gradient are its 1/C of the tokens', averaged with the data replicas'
    reduced = axes + reduce_axes(plan)
    sliced = bool(pipeline.zero_stage and axes)  # ZeRO: the row's optimizer state and update split over axes
    split_rows = sliced and pipeline.zero_stage == 3  # ZeRO-3: the parameter rows too, gathered once per step
    zero_axes, replicas = pipeline_zero.zero_axes(mesh), pipeline_zero.unsplit_axes(mesh) + reduce_axes(plan)
    data_size = math.prod(mesh.shape[a] for a in reduced)
    # ZeRO's reduce-scatter already summed the row in the reduce dtype: the body's reduction then only unscales it
    reduced_policy = dataclasses.replace(policy, reduce=policy.params)
    p, m_count, width, slots = plan.devices, schedule.micro, plan.width, schedule.slots
    if schedule.chunks != plan.chunks or schedule.stages != p:
        raise StepError(f"schedule {schedule.name!r} is for {schedule.stages} devices x {schedule.chunks} chunks, "
                        f"the stages for {p} x {plan.chunks}")
    ring = [(p - 1, 0)] if plan.chunks > 1 else []  # interleaved: the last device's chunk feeds the first's next
    forward_pairs = [(s, s + 1) for s in range(p - 1)] + ring
    backward_pairs = [(s + 1, s) for s in range(p - 1)] + [(b, a) for a, b in ring]
    names = metric_names(task, plan)
    forward_branches, backward_branches = slot_functions(plan, task, m_count, policy)
    stage_fn = lambda stage, *args: lax.switch(stage, forward_branches, *args)  # noqa: E731
    stage_backward = lambda stage, *args: lax.switch(stage, backward_branches, *args)  # noqa: E731

    def per_device(state: TrainState, batch):
        stage = lax.axis_index(STAGE_AXIS)
        # this device's V stage rows side by side (ZeRO-3: gathered from the slices, kept for every micro-batch)
        row = (pipeline_zero.gather_row(state.params, zero_axes) if split_rows else state.params)[0]

        def locate(entry):  # a table entry -> (micro-batch, virtual stage, that stage's row)
            index = jnp.maximum(entry, 0)
            chunk = index // m_count
            stage_row = lambda r: lax.dynamic_slice_in_dim(r, chunk * plan.row, plan.row)  # noqa: E731
            return index % m_count, chunk * p + stage, stage_row
        # Every dtx batch arrives split over all the mesh's axes; a data shard's stages share its rows.
        batch_bytes = tuple(x.size * x.dtype.itemsize for x in (batch["inputs"], batch["labels"]))
        inputs, labels = (lax.all_gather(batch[k], _group(mesh), tiled=True) for k in ("inputs", "labels"))
        if inputs.shape[0] % m_count:
            raise StepError(f"the per-device batch {inputs.shape[0]} does not split into {m_count} micro-batches "
                            "(pipeline.microbatches); see dtx.parallel.pipeline.check")
        micro = inputs.shape[0] // m_count
        # Shaped as the first piece takes them (a Dense stack: flattened); token ids stay integers.
        x0s = inputs.reshape((m_count, micro) + plan.layers[0].in_shape)
        ys = labels.reshape((m_count, micro) + labels.shape[1:])
        zeros_buffer = jnp.zeros((micro, width), policy.compute)
        # The backward starts from the micro-batch's loss times the loss scale (one device's accumulation does the
        # same; the step's 1/M is applied to the accumulated gradient, after the float16 products).
        seed = state.loss_scale.scale if scaler.enabled else jnp.ones((), jnp.float32)

        def forward_slot(carry, m, send):
            kept, received, grad_in, grads, loss, values = carry
            index, virtual, stage_row = locate(m)
            kept = lax.cond(m >= 0, lambda: lax.dynamic_update_index_in_dim(kept, received, jnp.maximum(m, 0) % slots,
                                                                            0), lambda: kept)
            y, l, v = lax.cond(m >= 0, lambda: stage_fn(virtual, stage_row(row), x0s[index], received, ys[index]),
                               lambda: (zeros_buffer, jnp.zeros((), jnp.float32),
                                        {n: jnp.zeros((), jnp.float32) for n in names}))
            received = lax.ppermute(y, STAGE_AXIS, forward_pairs) if send else y
            values = {n: values[n] + v[n] for n in names}
            return kept, received, grad_in, grads, loss + l, values

        def backward_slot(carry, m, send):
            kept, received, grad_in, grads, loss, values = carry
            index, virtual, stage_row = locate(m)

            def pull_back(grads):
                x_in = kept[jnp.maximum(m, 0) % slots]
                d_row, d_x = stage_backward(virtual, stage_row(row), x0s[index], x_in, ys[index], grad_in, seed)
                if plan.chunks == 1:
                    return grads + d_row, d_x
                offset = (jnp.maximum(m, 0) // m_count) * plan.row  # this chunk's part of the device's row
                return lax.dynamic_update_slice_in_dim(
                    grads, lax.dynamic_slice_in_dim(grads, offset, plan.row) + d_row, offset, 0), d_x

            # Accumulated inside the branch: an idle slot passes the accumulator through (no zero row to add).
            grads, d_x = lax.cond(m >= 0, pull_back, lambda grads: (grads, zeros_buffer), grads)
            grad_in = lax.ppermute(d_x, STAGE_AXIS, backward_pairs) if send else d_x
            return kept, received, grad_in, grads, loss, values

        def tick(phase):
            def run(carry, mbs):
                f, b = mbs
                if phase.forward is not None:
                    carry = forward_slot(carry, f[stage], phase.send_forward)
                if phase.backward is not None:
                    carry = backward_slot(carry, b[stage], phase.send_backward)
                return carry, None
            return run

        zero = jnp.zeros((), jnp.float32)
        carry = (jnp.zeros((slots, micro, width), policy.compute), zeros_buffer, zeros_buffer, jnp.zeros_like(row),
                 zero, {n: zero for n in names})
        for phase in schedule.phases:
            dummy = jnp.zeros((phase.ticks, p), jnp.int32)
            tables = tuple(jnp.asarray(t) if t is not None else dummy for t in (phase.forward, phase.backward))
            carry, _ = lax.scan(tick(phase), carry, tables)
        _, _, _, grads, loss, values = carry
        grads = grads * (1.0 / m_count)  # the step's loss is the micro-batches' mean
        grads = sum_replicated(plan, grads)  # SP: the replicated leaves' gradients summed over model
        # The body's reduction (dtx.step.body.make_reduce): each stage's row averaged over its data replicas in the
        # policy's reduce dtype, unscaled. ZeRO reduce-scatters the row first (its split, as the body's split_grads)
        # and the reduction then has nothing left to send.
        if sliced:  # ZeRO: this data rank's slice of the row's mean, one reduce-scatter (HSDP: then the replicas')
            grads = pipeline_zero.reduce_scatter(grads, zero_axes, policy, replicas)
        comm = (comm_lib.CommContext(reduced, data_size, lambda tree: lax.pmean(tree, reduced))
                if reduced and not sliced else comm_lib.compiler(1))
        norms = body.Norms(pipeline.record_norm, pipeline.clip_norm, functools.partial(
            pipeline_optim.global_norm, plan, sliced=zero_axes if sliced else ()))
        reduce = body.make_reduce(compress.none(), policy if reduced and not sliced else reduced_policy, scaler,
                                  state.loss_scale, comm, norms)
        grads, _, norm_stats = reduce(grads, {}, None)
        # The last stage alone scored the micro-batches, the others add zeros: summed over stage (and model under
        # SP), every device holds the step's loss. With loss scaling each stage adds whether its reduced row
        # overflowed, so the verdict is the whole model's, the same on every stage.
        overflow = [1.0 - all_finite(grads).astype(jnp.float32)] if scaler.enabled else []
        scalars = lax.psum(jnp.stack([loss / m_count, *(values[n] / m_count for n in names), *overflow]),
                           (STAGE_AXIS, MODEL) if positions_split(plan) > 1 else STAGE_AXIS)
        mean = body.averages(reduced, scalars[0], {n: scalars[1 + i] for i, n in enumerate(names)},
                             (scalars[-1] == 0) if scaler.enabled else None, {})
        if sliced:  # the slice updated with its slice of the state, then (ZeRO-1) the rows all-gathered
            params, opt_state = pipeline_zero.update(tx, grads, state.opt_state, state.params, zero_axes,
                                                     pipeline.decay, split_rows)
        elif pipeline.per_tensor:  # each stage's update on its own tensors (LARS/LAMB's norms, weight decay's mask)
            updates, opt_state = pipeline_optim.update(tx, plan, grads[None], state.opt_state, state.params, stage)
            params = optax.apply_updates(state.params, updates)
        else:  # an element-wise optimizer acts on the row as on the tree
            updates, opt_state = tx.update(grads[None], state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        sent = traffic(plan, schedule, micro, mesh, 1 + len(names) + scaler.enabled, batch_bytes, policy, sliced)
        # The body's finish (Micikevicius et al. 2018, §3.2, with loss scaling: an overflowing step skipped on every
        # device alike, the scale backed off; grown when finite), the next key and step, the records.
        rng, _ = jax.random.split(jax.random.wrap_key_data(state.rng))
        worked = body.Pass(grads, mean.loss, mean.values, mean.finite, {}, jax.random.key_data(rng), {})
        stats = {**comm_lib.traffic_stats(sent), **({"grads_finite": jnp.array(True)} if scaler.enabled else {}),
                 **{k: v for k, v in norm_stats.items() if k in ("grad_norm", "grad_clipped")}}
        return body.finish(state, state.replace(params=params, opt_state=opt_state), stats, worked, scaler,
                           strategies.sync())

    def specs(state):
        return jax.tree.map(lambda s: s.spec, state_shardings(state, mesh, plan, pipeline.zero_stage if sliced else 0))

    def step(state, batch):
        batch_spec = PartitionSpec(mesh_lib.batch_axes(mesh))  # as every dtx batch is placed (dtx.data.loader)
        mapped = jax.shard_map(per_device, mesh=mesh, in_specs=(specs(state), batch_spec),
                               out_specs=(specs(state), PartitionSpec()), check_vma=False)
        return mapped(state, batch)

    return jax.jit(step, donate_argnums=(0,) if donate else ())


def gather_params(state: TrainState, plan: StagePlan):
    """The model's parameter tree from a pipeline state's rows (for evaluation, export and comparisons)."""
    return plan.unpack(state.params)


@dataclasses.dataclass(frozen=True)
class StageOptions:
    """How :func:`make_pipeline` cuts a model into stages and schedules them (the config's ``pipeline`` block, and
    what the run's optimizer and mesh ask of it).

    Attributes:
      schedule: the schedule's name (:data:`dtx.parallel.pipeline.schedules.SCHEDULES`: GPipe, 1F1B, interleaved).
      boundaries: the first layer of stages 1.. (:func:`dtx.parallel.pipeline.stages.make_plan`); ``()``: balanced by FLOPs.
      micro: ``M``, the micro-batches of a step (the schedule's ``micro``).
      chunks: the (virtual) stages per device, ``V`` (2 or more: the interleaved schedule).
      per_tensor: the optimizer updates each stage's tensors, not its row
        (:func:`dtx.parallel.pipeline.check.per_tensor`).
      zero_stage: ``1``: ZeRO-1 over the data axes (or the ``fsdp`` axes), ``3``: the parameter rows split too
        (:mod:`dtx.parallel.pipeline.zero`; the rows padded to split over them).
      sequence_parallel: with a ``model`` axis, each stage's stream split over it by positions too
        (``tensor.sequence_parallel``, :mod:`dtx.parallel.pipeline.tensor_stages`).
      attention, balance: with a ``context`` axis, the kernel its stages' attention runs (``context.attention``)
        and whether each device holds two balanced chunks of every sequence (``context.balance``,
        :mod:`dtx.parallel.pipeline.context_stages`).
      decay_mask: the optimizer's weight-decay mask function (:func:`dtx.optim.path_mask`), which ZeRO-1 lays out
        as a row; a function, so left out of comparisons.
    """

    schedule: str = "gpipe"
    boundaries: Sequence[int] = ()
    micro: int = 1
    chunks: int = 1
    per_tensor: bool = False
    zero_stage: int = 0
    sequence_parallel: bool = False
    attention: str = "ring"
    balance: bool = True
    decay_mask: Callable | None = dataclasses.field(default=None, compare=False)


def make_pipeline(model, abstract_params, mesh: Mesh, options: StageOptions = StageOptions(), *,
                  task: task_lib.Task | None = None, example=None) -> Pipeline:
    """The pipeline of ``model`` on ``mesh``'s ``stage`` axis: its layers cut at ``options.boundaries`` (or
    balanced) into ``options.chunks`` stages per device, and the schedule ``options.schedule`` of ``options.micro``
    micro-batches (:class:`StageOptions`: per-tensor updates, ZeRO, sequence parallelism, the decay mask);
    ``task``: the loss and metrics (default classification); ``example``: the inputs' shape and dtype
    (:func:`dtx.parallel.pipeline.stages.make_plan`)."""
    pipeline_zero.check(options.zero_stage, options.per_tensor)
    stages = mesh.shape.get(STAGE_AXIS, 0)
    if not stages:
        raise StepError(f"parallel.name='pipeline' needs a {STAGE_AXIS!r} mesh axis, e.g. "
                        f"--config.mesh='((\"{STAGE_AXIS}\", 2), (\"data\", -1))'; the mesh is {dict(mesh.shape)}")
    plan = make_plan(model, abstract_params, stages, options.boundaries, options.chunks, example)
    if CONTEXT_AXIS in mesh.axis_names and MODEL in mesh.axis_names:
        raise StepError(f"a pipeline's stages split over both {CONTEXT_AXIS!r} and {MODEL!r}: each runs alone "
                        "(dtx.parallel.pipeline.context_stages, tensor_stages), not both inside one stage; drop "
                        f"one of the axes from --config.mesh (context with tensor parallelism runs without a "
                        f"{STAGE_AXIS!r} axis)")
    if CONTEXT_AXIS in mesh.axis_names:  # every sequence split over context inside each stage
        plan = context_plan(plan, abstract_params, mesh.shape[CONTEXT_AXIS], options.attention, options.balance)
    if MODEL in mesh.axis_names:  # each stage's blocks split over model (Megatron; LARS/LAMB: pipeline_check)
        # sequence_parallel (tensor.sequence_parallel): each stage's stream split over model by positions too
        plan = split_plan(plan, abstract_params, mesh, example, options.sequence_parallel)
    if options.zero_stage:
        plan = dataclasses.replace(plan, row_multiple=pipeline_zero.data_size(mesh))
    decay = (pipeline_zero.decay_tables(plan, options.decay_mask)
             if options.zero_stage and options.decay_mask is not None else None)
    return Pipeline(plan, make_schedule(options.schedule, stages, options.micro, options.chunks), task,
                    per_tensor=options.per_tensor, zero_stage=options.zero_stage, decay=decay)


def train_step(tx: optax.GradientTransformation, mesh: Mesh, pipeline: Pipeline, spec):
    """The pipeline step a driver builds for a :class:`~dtx.step.spec.StepSpec` whose placement carries a
    pipeline; the spec's settings the pipeline does not take are refused (:mod:`dtx.parallel.pipeline.check` refuses
    them by config key before this)."""
    problems = [what for what, bad in (
        (f"accum_steps={spec.accum_steps} must be the schedule's {pipeline.schedule.micro} micro-batches",
         spec.accum_steps != pipeline.schedule.micro),
        ("float32 parameters", jnp.dtype(spec.policy.params) != jnp.float32),
        ("synchronous SGD without compression", not ((spec.strategy is None or spec.strategy.caps.identity)
                                                     and (spec.compressor is None or spec.compressor.caps.identity))),
        ("communicate=True", not spec.communicate),
        ("an optimizer that updates each tensor from its own gradient (this one reads other tensors' gradients, as "
         "optax.clip_by_global_norm does, and each stage would see only its own: clip with optimizer.clip_norm, "
         "StepSpec(clip_norm=...), the whole model's norm in every layout)", optim.couples_tensors(tx)),
        (f"a task that scores every element (task {getattr(spec.task, 'name', '')!r} leaves padding out: its mean "
         "needs the global count)", spec.task is not None and spec.task.valid is not None)) if bad]
    if problems:
        raise StepError("the pipeline step takes " + ", ".join(problems))
    return make_pipeline_step(tx, mesh, dataclasses.replace(pipeline, task=pipeline.task or spec.task,
                                                            policy=spec.policy, loss_scaler=spec.loss_scaler,
                                                            record_norm=spec.grad_norm, clip_norm=spec.clip_norm),
                              spec.donate)


def eval_step(evaluate, plan: StagePlan):
    """``evaluate`` (a data-parallel eval step over replicated parameters) on a pipeline state: the rows unpacked
    into the model's tree first (XLA gathers each stage's row to every device; evaluation is not pipelined)."""
    return jax.jit(lambda state, batch: evaluate(state.replace(params=plan.unpack(state.params), opt_state=()),
                                                 batch))
