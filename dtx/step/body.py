"""The per-worker training and evaluation bodies that both drivers of :mod:`dtx.step` run.

One step of data-parallel SGD (Das et al., arXiv 1602.06709, §2), job by job, each a
named helper here or a collaborator passed in:

1. keys — the step's, each worker's (dropout), and one shared by all (:func:`step_keys`);
2. the loss — the task's (:mod:`dtx.data.tasks`) on the model's forward pass in the precision
   policy's dtypes (:func:`make_loss_fn`);
3. gradients — per worker, summed over micro-batches into one accumulator (:func:`gradients`);
4. the reduction — the compressor around the configured allreduce, in the reduce dtype,
   with the finiteness verdict of what is applied (:func:`make_reduce`);
5. the update — the strategy's (:mod:`dtx.strategies`), which calls the reduction;
6. the averages — loss, metrics, overflow flags and batch-norm statistics in one
   all-reduce, and their bytes (:func:`averages`); workers with their own models run it on
   record steps only and keep their own statistics (:func:`records_collective`);
7. loss scaling — skip the step everywhere when any gradient overflowed (:func:`skip_unless_finite`).

:func:`train_body` runs them in three parts: the worker's pass (1–3, 6: :func:`worker_pass`), the
strategy's update (4–5) and the end (7 and the records: :func:`finish`). ZeRO under ``shard_map``
(Rajbhandari et al. 2020, arXiv 1910.02054; :mod:`dtx.step.zero_step`) runs the same three parts,
its reduce-scatter as the pass's ``split_micro``/``split_grads`` and the update at ``jit`` level.

What the step computes is one :class:`Worker` (model, optimizer, policy, loss scaling, micro-batches,
strategy, compressor, task), the same under every driver; where the drivers and layouts differ — the
axes the body runs over, how micro-batches and gradients are laid out, the activations' context — is one
:class:`Route`. A driver builds both and calls the body; no function here takes more than 8 parameters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from dtx.comm import context as comm_lib
from dtx.comm import costmodel
from dtx import compress, strategies
from dtx.data import tasks as task_lib
from dtx.data.loader import Batch
from dtx.precision import Policy, all_finite, select_tree
from dtx.step import accumulate, batchnorm
from dtx.data.tasks import Task
from dtx.models import sown

Metrics = dict[str, jax.Array]


class BodyError(ValueError):
    """A body configuration that cannot work (accumulation that does not split the batch, ...)."""


def _identity(tree):
    return tree


@dataclasses.dataclass(frozen=True)
class Norms:
    """What the reduction does with the whole model's gradient norm.

    Attributes:
      record: report it (``grad_norm``).
      clip: ``c > 0`` scales the gradient by ``min(1, c / ‖g‖)`` (Pascanu et al. 2013, arXiv 1211.5063, §3.2:
        clipping by the global norm keeps the step's direction) and reports ``grad_norm`` and ``grad_clipped``.
      of: ``grads -> ‖g‖``, the whole model's L2 norm from what this device holds: ``optax.tree.norm`` where the
        reduction sees every tensor whole or as global arrays; a layout whose devices hold parts of the model (a
        pipeline's stage rows) gives its own, which sums the parts' squares over the devices.
    """

    record: bool = False
    clip: float = 0.0
    of: Callable = dataclasses.field(default=optax.tree.norm, compare=False)

    @classmethod
    def of_spec(cls, spec, of: Callable | None = None) -> Norms:
        """A step spec's (:class:`dtx.step.spec.StepSpec`): ``grad_norm`` and ``clip_norm``, with a layout's norm."""
        return cls(bool(spec.grad_norm), float(spec.clip_norm), of or optax.tree.norm)

    def apply(self, grads, stats: Metrics):
        """``(grads, stats)``: clipped where :attr:`clip` says, with the records asked for."""
        if not (self.record or self.clip):
            return grads, stats
        norm = self.of(grads)
        stats = {**stats, "grad_norm": norm}
        if self.clip:
            factor = jnp.minimum(1.0, self.clip / jnp.maximum(norm, jnp.finfo(jnp.float32).tiny))
            grads = jax.tree.map(lambda g: (g * factor).astype(g.dtype), grads)
            stats["grad_clipped"] = (norm > self.clip).astype(jnp.float32)
        return grads, stats


@dataclasses.dataclass(frozen=True)
class Worker:
    """What one worker computes, the same under every driver and layout: the model (its batch norm synchronised
    as the driver needs), the optimizer, the precision policy and loss scaling, the micro-batches per step, the
    synchronisation strategy, the compressor around its reduction, the task, and whether the reduced gradient's
    norm is recorded."""

    model: Any
    tx: Any
    policy: Policy
    scaler: Any
    accum_steps: int
    strategy: Any
    compressor: Any
    task: Task
    norms: Norms = None  # the reduced gradient's norm: recorded, clipped (default: neither)

    @classmethod
    def of(cls, model, tx, spec) -> Worker:
        """A step spec's worker (:class:`dtx.step.spec.StepSpec`): no strategy is synchronous SGD, no compressor
        none, no task classification."""
        return cls(model, tx, spec.policy, spec.loss_scaler, spec.accum_steps, spec.strategy or strategies.sync(),
                   spec.compressor or compress.none(), spec.task or task_lib.classification(), Norms.of_spec(spec))


@dataclasses.dataclass(frozen=True)
class Route:
    """Where the drivers and layouts differ, in one object: how a worker's batch and gradients are laid out.

    Attributes:
      axes: the mesh axes the body runs per device over (``shard_map``: the batch axes); ``()`` under ``jit``,
        whose body sees the global batch.
      shards: the batch's shards in the body's view (``jit``: every device's), so that micro-batch ``i`` takes
        the ``i``-th ``1/k`` of each shard (:func:`gradients`).
      constrain: lays a micro-batch out as the batch is (``jit``: a sharding constraint).
      layout: the context the forward pass runs in (where model-parallel layers' activations live).
      split_grads: once per step, the gradient laid out as the optimizer state is (ZeRO: reduce-scattered).
      split_micro: per micro-batch, the gradient laid out as the accumulator is (ZeRO-2).
      accumulator: ``params -> zeros`` laid out as ``split_micro`` leaves them, made without a collective;
        ``None``: ``split_micro`` of zeros.
      apart: each shard's gradient summed apart and reduced once (:class:`dtx.step.accumulate.Apart`, ``jit``).
    """

    axes: tuple = ()
    shards: int = 1
    constrain: Callable = _identity
    layout: Callable = contextlib.nullcontext
    split_grads: Callable = _identity
    split_micro: Callable = _identity
    accumulator: Callable | None = None
    apart: Any = None


def train_body(state, batch: Batch, worker: Worker, route: Route, comm, record: bool = True):
    """One training step on this worker's batch (module docstring): ``(state, metrics)``.

    Three parts, each one function, so that a driver may run them apart: :func:`worker_pass` (jobs
    1–3 and 6), the strategy's update (4–5) and :func:`finish` (7 and the records). ZeRO under
    ``shard_map`` (:mod:`dtx.step.zero_step`) runs the pass inside ``shard_map`` and the update at
    ``jit`` level, where an optimizer sees whole tensors. ``comm``: the reduction's context;
    ``record=False``: a step whose records nobody reads (:func:`records_collective`)."""
    strategy = worker.strategy
    rng, step_rng, shared_key, index = step_keys(state, route.axes)
    reduce = make_reduce(worker.compressor, worker.policy, worker.scaler, state.loss_scale, comm, worker.norms)
    ctx = strategies.StepContext(tx=worker.tx, comm=comm, reduce=reduce, key=shared_key, index=index)
    worked = worker_pass(state, batch, strategy.grad_params(state, ctx), (rng, step_rng), worker, route,
                         averages_merge(comm, strategy, worker.compressor), record)
    new_state, stats = strategy.apply(state, worked.grads, ctx)
    return finish(state, new_state, stats, worked, worker.scaler, strategy)


def records_collective(strategy) -> bool:
    """Whether the averages are an all-reduce of their own that only the records need, so that a step
    built with ``record=False`` runs without it: workers with their own models (``caps.local_models``:
    local SGD, DiLoCo, EASGD, gossip, Streaming DiLoCo) need no collective for training but their
    strategy's own (D-PSGD, Lian et al. 2017, has no global barrier at all). Synchronous strategies
    average every step whatever ``record`` says: their averages ride in the gradients' all-reduce
    (Das et al., arXiv 1602.06709, §2), and their batch-norm statistics are the global batch's.

    Without the averages a step reports neither ``loss`` nor the task's metrics, only its traffic and the
    strategy's stats (replicated). The batch-norm statistics of such workers need no all-reduce in any
    train step: each worker normalises over its own batch and keeps its own running averages
    (``state.worker["model_state"]``); the evaluated model takes their mean (:func:`eval_model_state`) —
    what an every-step average gave, since a running average is linear in the batch statistics.
    """
    return strategy.caps.local_models


def model_state_of(state, strategy):
    """This worker's model state (batch-norm statistics): its own where each keeps its own
    (:func:`records_collective`), else the replicated ``state.model_state``."""
    return state.worker["model_state"] if strategy.caps.local_models else state.model_state


def eval_model_state(state, strategy, comm: comm_lib.CommContext):
    """The evaluated model's state: the workers' mean of their own statistics where each keeps its own
    (inside the eval program, over ``comm.axes``), else ``state.model_state``."""
    if not strategy.caps.local_models:
        return state.model_state
    return lax.pmean(state.worker["model_state"], comm.axes) if comm.axes else state.worker["model_state"]


class Pass(NamedTuple):
    """A worker's pass over its batch (:func:`worker_pass`): what the update and :func:`finish` need.
    Arrays only, so that it can leave a ``shard_map`` (loss, metrics, flag, statistics, key: replicated)."""

    grads: Any  # this worker's gradient after ``split_grads`` (ZeRO: its 1/N of the mean)
    loss: jax.Array | None  # the averages over all workers (:class:`Averages`); None: not averaged
    values: dict
    finite: jax.Array | None
    model_state: Any
    rng: jax.Array  # the key data the next step starts from
    traffic: Metrics  # the averages' part of the comm fields (:func:`averages_traffic`)


def worker_pass(state, batch: Batch, params, keys, worker: Worker, route: Route, merged: bool,
                record: bool = True) -> Pass:
    """The loss, this worker's gradients (accumulated, split by the route's ``split_micro``/``split_grads``),
    its finiteness verdict and the averages, at ``params`` (the strategy's ``grad_params``); ``keys``: the
    carried key and this worker's step key (:func:`step_keys`); ``merged``: whether the averages ride in the
    gradients' all-reduce (:func:`averages_merge`). Where the averages are the records' own collective
    (:func:`records_collective`) they run only with ``record``, and the model state stays this worker's."""
    rng, step_rng = keys
    strategy, task, policy, scaler, axes = worker.strategy, worker.task, worker.policy, worker.scaler, route.axes
    accum_steps, apart = worker.accum_steps, route.apart
    denominator = valid_denominator(task, batch, axes, accum_steps, strategy, apart.shards if apart else 1)
    model_state = model_state_of(state, strategy)
    loss_fn = make_loss_fn(worker.model, policy, task, route.layout, list(model_state), denominator,
                           functools.partial(scaler.scale_loss, state.loss_scale))
    if axes and not strategy.caps.local_models:
        # Differentiate per-device copies: each gradient is then its own batch's, and *we* choose how
        # to combine them (shard_map would otherwise sum them when transposing the cast).
        params = lax.pcast(params, axes, to="varying")
    # The model's own collectives (synchronised batch norm's statistics), once per micro-batch.
    inside = batchnorm.model_traffic(jax.value_and_grad(loss_fn, has_aux=True), (
        params, model_state, jax.tree.map(lambda x: x[: x.shape[0] // accum_steps], batch), step_rng), axes)
    grads, loss, values, model_state = gradients(loss_fn, params, model_state, batch, step_rng, accum_steps, route)
    grads = route.split_grads(grads)  # ZeRO: reduce-scattered to the optimizer state's layout
    # Each worker's verdict on what it is about to send, before any compressor sees it: a compressor may
    # leave overflowing entries out of the average, and the step must be skipped all the same
    # (Micikevicius et al. 2018, §3.2).
    finite_here = all_finite(policy.cast_to_reduce(grads)) if scaler.enabled else None
    if records_collective(strategy):  # no loss scaling with these (drivers.check_combination): no verdict
        mean = averages(axes, loss, values, None, {}) if record else Averages(None, {}, None, {},
                                                                              costmodel.Traffic(0, 0))
        mean = mean._replace(model_state=model_state)  # this worker's own statistics, never averaged here
    else:
        mean = averages(axes, loss, values, finite_here, model_state)
    return Pass(grads, mean.loss, mean.values, mean.finite, mean.model_state, jax.random.key_data(rng),
                averages_traffic(mean, task, axes, strategy, merged,
                                 costmodel.Traffic(inside.messages * accum_steps, inside.bytes_sent * accum_steps)))


def finish(state, new_state, stats: Metrics, worked: Pass, scaler, strategy):
    """The step's end after the update (``new_state``, its ``stats``): the loss-scaling skip, the next
    key and step, and the records — ``loss`` and the task's metrics (where averaged), the update's stats
    with the averages' traffic added, and with loss scaling ``loss_scale``, ``skipped``, ``skipped_steps``.
    The model state goes where :func:`model_state_of` reads it."""
    applied_finite = stats.pop("grads_finite", None)
    if scaler.enabled and applied_finite is None:
        raise BodyError(f"loss scaling needs strategy {strategy.name!r} to reduce the gradients once per step "
                        "and return the reduction's stats")
    metrics = {**({} if worked.loss is None else {"loss": worked.loss}), **worked.values, **stats}
    if worked.traffic:
        metrics.update(comm_bytes=stats["comm_bytes"] + worked.traffic["comm_bytes"],
                       comm_rounds=stats["comm_rounds"] + worked.traffic["comm_rounds"],
                       comm_bytes_logging=worked.traffic["comm_bytes_logging"],
                       comm_rounds_logging=worked.traffic["comm_rounds_logging"])
    model_state = worked.model_state
    if scaler.enabled:
        finite = jnp.logical_and(worked.finite, applied_finite)
        new_state, model_state = skip_unless_finite(finite, new_state, model_state, state)
        metrics.update(loss_scale=state.loss_scale.scale, skipped=(~finite).astype(jnp.int32))
        new_state = new_state.replace(loss_scale=scaler.update(state.loss_scale, finite))
        metrics["skipped_steps"] = new_state.loss_scale.skipped_steps
    if strategy.caps.local_models:  # each worker's own statistics (records_collective)
        new_state = new_state.replace(worker={**new_state.worker, "model_state": model_state})
    else:
        new_state = new_state.replace(model_state=model_state)
    return new_state.replace(step=state.step + 1, rng=worked.rng), metrics


def step_keys(state, axes):
    """``(carried rng, this worker's step key, a key shared by all workers, worker index)``."""
    rng, step_rng = jax.random.split(jax.random.wrap_key_data(state.rng))
    shared_key = jax.random.fold_in(step_rng, 1)  # the same on every worker (random-k's common indices)
    index = lax.axis_index(axes) if axes else jnp.zeros((), jnp.int32)
    if axes:  # independent dropout per device; the carried rng stays replicated
        step_rng = jax.random.fold_in(step_rng, index)
    return rng, step_rng, shared_key, index


def make_reduce(compressor, policy: Policy, scaler, loss_scale, comm: comm_lib.CommContext, norms: Norms | None):
    """The gradient reduction a strategy calls: ``(grads, compress_state, key) -> (grads, state, stats)``.

    The synchronisation point of data-parallel SGD: one averaged gradient for all, compressed as
    configured and communicated in the reduce dtype, unscaled. With loss scaling ``stats`` carries
    ``grads_finite``, the verdict on the applied gradient (a float16 sum of finite gradients can
    itself overflow); the body takes it out of the metrics. ``norms``: the whole model's gradient norm
    recorded and clipped by (:class:`Norms`), of the gradient every replica applies (after compression).
    """
    norms = norms or Norms()

    def reduce(grads, compress_state, key):
        grads, compress_state, stats = compressor.update(policy.cast_to_reduce(grads), compress_state, key, comm)
        grads = scaler.unscale(loss_scale, policy.cast_to_params(grads))
        if scaler.enabled:
            stats = {**stats, "grads_finite": all_finite(grads)}
        grads, stats = norms.apply(grads, stats)  # of the gradient every replica applies (unscaled, compressed)
        return grads, compress_state, stats

    return reduce


def make_loss_fn(model, policy: Policy, task: Task, layout, mutable: list, denominator, scale=lambda loss: loss):
    """``(params, model_state, micro_batch, rng) -> (scaled loss, (loss, metrics, model_state))``: the
    forward pass in the policy's compute dtype inside the activation ``layout``, scored by the task.

    What the model sows (:mod:`dtx.models.sown`: a mixture of experts' balancing losses and records) is taken
    out of its state: the losses are added to the task's loss before differentiating, the records join the
    task's metrics; ``loss`` stays the task's, so that it compares with ``test_loss``."""

    def loss_fn(params, model_state, micro, micro_rng):
        variables = {"params": policy.cast_to_compute(params), **model_state}
        inputs = policy.cast_to_compute(micro["inputs"])
        with layout():
            logits, model_state = model.apply(variables, inputs, train=True, mutable=[*mutable, *sown.COLLECTIONS],
                                              rngs={"dropout": micro_rng})
        model_state, added, records = sown.take(model_state)
        loss, values = task_lib.batch_mean_terms(task, policy.cast_to_output(logits), micro["labels"], denominator)
        objective = loss if added is None else loss + added
        return scale(objective), (loss, {**values, **records}, model_state)

    return loss_fn


def gradients(loss_fn, params, model_state, batch, rng, k, route: Route = Route()):
    """``(grads, loss, metrics, model_state)`` of the batch: one pass, or ``k`` micro-batches summed into one
    accumulator (no k-fold copies). Micro-batch ``i`` takes the ``i``-th ``1/k`` of *every device's* slice
    (the route's ``shards``, laid out by its ``constrain``), so each stays spread over all devices and both
    drivers see the same ones. The route's ``split_micro`` lays each micro-batch's gradient out as the
    accumulator is (ZeRO-2); its ``accumulator(params)`` is that accumulator's zero (default: ``split_micro``
    of zeros; ZeRO under ``shard_map`` makes it without a collective). Its ``apart``
    (:class:`dtx.step.accumulate.Apart`, ``jit`` only): every shard's gradient summed apart and reduced once
    after the loop."""
    shards, constrain, axes, apart = route.shards, route.constrain, route.axes, route.apart
    split_micro, accumulator = route.split_micro, route.accumulator
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if k == 1 and apart is None:
        (_, (loss, values, model_state)), grads = grad_fn(params, model_state, batch, rng)
        return grads, loss, values, model_state
    if apart is not None:
        _check_split(batch, shards, k)
        return accumulate.gradients(grad_fn, params, model_state, batch, rng, k, apart)

    _check_split(batch, shards, k)

    def split(x):
        x = x.reshape((shards, k, x.shape[0] // (shards * k)) + x.shape[1:])
        return constrain(jnp.swapaxes(x, 0, 1).reshape((k, -1) + x.shape[3:]))

    micro_batches = jax.tree.map(split, batch)

    def one(carry, inputs):
        grads_sum, loss_sum, values_sum, model_state = carry
        micro, index = inputs
        (_, (loss, values, model_state)), grads = grad_fn(params, model_state, micro, jax.random.fold_in(rng, index))
        grads_sum = jax.tree.map(jnp.add, grads_sum, split_micro(grads))
        return (grads_sum, loss_sum + loss, jax.tree.map(jnp.add, values_sum, values), model_state), None

    zero = jnp.zeros((), jnp.float32)
    if axes:  # the running sums hold per-device values: type them so for shard_map's checker
        zero = lax.pcast(zero, axes, to="varying")
    # The metrics' names, from the first micro-batch's shapes (tracing only, nothing runs).
    first = jax.tree.map(lambda x: x[0], micro_batches)
    names = jax.eval_shape(lambda: grad_fn(params, model_state, first, rng)[0][1][1])
    accumulator = accumulator or (lambda tree: split_micro(jax.tree.map(jnp.zeros_like, tree)))
    init = (accumulator(params), zero, {name: zero for name in names}, model_state)
    (grads, loss, values, model_state), _ = lax.scan(one, init, (micro_batches, jnp.arange(k)))
    return jax.tree.map(lambda g: g / k, grads), loss / k, {n: v / k for n, v in values.items()}, model_state


def _check_split(batch, shards: int, k: int) -> None:
    for x in jax.tree.leaves(batch):
        if x.shape[0] % (shards * k):
            raise BodyError(f"accum_steps={k} must divide the per-device batch {x.shape[0] // shards}; "
                            "see dtx.step.check_accumulation")


class Averages(NamedTuple):
    """The step's averages over the workers (:func:`averages`)."""

    loss: jax.Array
    values: dict
    finite: jax.Array | None  # every worker's gradients finite (loss scaling), else None
    model_state: Any
    traffic: costmodel.Traffic


def averages(axes, loss, values, finite, model_state) -> Averages:
    """Loss and the task's metrics (the records), whether every worker's gradients are finite (with loss
    scaling) and the model state (batch-norm statistics), averaged in one all-reduce of one float32 vector
    (one ring of a few entries, not one per scalar), with that all-reduce's traffic."""
    names = list(values)
    scalars = [loss.astype(jnp.float32), *(values[n].astype(jnp.float32) for n in names)]
    if finite is not None:  # 1 where this worker overflowed: the mean is 0 only if no worker did
        scalars.append(jnp.where(finite, 0.0, 1.0).astype(jnp.float32))
    vector = jnp.stack(scalars)
    traffic = costmodel.Traffic(0, 0)
    if axes:
        vector, model_state = lax.pmean((vector, model_state), axes)
        traffic = comm_lib.pmean_traffic((vector, model_state), math.prod(lax.axis_size(a) for a in axes))
    everywhere = None if finite is None else vector[-1] == 0
    return Averages(vector[0], {n: vector[1 + i] for i, n in enumerate(names)}, everywhere, model_state, traffic)


def averages_merge(comm: comm_lib.CommContext, strategy, compressor) -> bool:
    """Whether the averages ride in the gradients' all-reduce: where the gradients travel by ``psum`` every
    step, XLA's all-reduce combiner merges the averages' independent all-reduce into that op."""
    return comm.explicit and comm.native and strategy.caps.reduces_once and compressor.caps.allreduce


def averages_traffic(mean: Averages, task: Task, axes, strategy, merged: bool,
                     inside: costmodel.Traffic = costmodel.Traffic(0, 0)) -> Metrics:
    """The averages' and the valid-element count's part of the step's ``comm_bytes``/``comm_rounds``
    (:func:`finish` adds the update's); ``merged`` (:func:`averages_merge`): the averages' bytes, no
    rounds of their own. Nothing without axes (under ``jit`` the compiled program says).

    The averages' own part is also reported as ``comm_bytes_logging``/``comm_rounds_logging``, for the
    reader: it runs for the records, not for training. It runs all the same, so it is part of
    ``comm_bytes``/``comm_rounds`` and the simulated clock (:mod:`dtx.perf.simclock`) charges it; where it
    is the records' own collective, a step built without records runs none (:func:`records_collective`).
    ``inside``: the model's own collectives in the step (:func:`dtx.step.batchnorm.model_traffic`)."""
    if not axes:
        return {}
    counted = costmodel.add_traffic(count_traffic(task, axes, strategy), inside)
    logging_rounds = 0 if merged else mean.traffic.messages
    return {"comm_bytes": comm_lib.count_scalar(mean.traffic.bytes_sent + counted.bytes_sent),
            "comm_rounds": comm_lib.count_scalar(logging_rounds + counted.messages),
            "comm_bytes_logging": comm_lib.count_scalar(mean.traffic.bytes_sent),
            "comm_rounds_logging": comm_lib.count_scalar(logging_rounds)}


def skip_unless_finite(finite, new_state, model_state, state):
    """Dynamic loss scaling's skip: a step with any overflow leaves everything the update wrote as it was
    (parameters, optimizer, per-worker and shared state, delay buffers, batch-norm statistics), on every
    replica alike. Returns ``(state, model_state)``."""
    return select_tree(finite, (new_state, model_state), (state, state.model_state))


def valid_denominator(task: Task, batch: Batch, axes, accum_steps: int, strategy, shards_apart: int = 1):
    """What each (micro-)batch's sums are divided by so that averaging over micro-batches and workers
    gives the mean over the *global* batch's valid elements (``None``: every element counts, a plain mean).

    With padding the workers hold different numbers of valid tokens, so a mean of per-worker means is not
    the global mean; sum / (global count / (workers · micro-batches)) is. Workers with their own models
    (local SGD, ...) average over their own batch: no collective enters their local steps. ``shards_apart``:
    shards whose sums are averaged after the loss (:class:`Apart`), workers as far as the division goes.
    """
    if task.valid is None:
        return None
    count = task_lib.valid_count(task, batch["labels"])
    workers = shards_apart
    if axes and not strategy.caps.local_models:
        count = lax.psum(count, axes)
        workers = math.prod(lax.axis_size(a) for a in axes)
    return jnp.maximum(count, 1).astype(jnp.float32) / (workers * accum_steps)


def count_traffic(task: Task, axes, strategy) -> costmodel.Traffic:
    """The all-reduce of the valid-element count (:func:`valid_denominator`): an int32 scalar, on its own
    (the gradients depend on it, so XLA cannot merge it into their all-reduce)."""
    if task.valid is None or not axes or strategy.caps.local_models:
        return costmodel.Traffic(0, 0)
    return comm_lib.pmean_traffic(jnp.zeros((), jnp.int32), math.prod(lax.axis_size(a) for a in axes))


def eval_body(worker: Worker, comm: comm_lib.CommContext, reduce_sum, layout, state, batch: Batch) -> Metrics:
    """Sums over the real examples of an evaluation batch (:func:`dtx.data.tasks.eval_sums`) at the strategy's
    global parameters, ``reduce_sum`` adding the workers' (``shard_map``: a ``psum``), the forward pass in the
    activation ``layout``."""
    strategy, policy = worker.strategy, worker.policy
    params = strategy.eval_params(state, comm)
    variables = {"params": policy.cast_to_compute(params), **eval_model_state(state, strategy, comm)}
    with layout():
        logits = worker.model.apply(variables, policy.cast_to_compute(batch["inputs"]), train=False)
    return reduce_sum(task_lib.eval_sums(worker.task, policy.cast_to_output(logits), batch["labels"], batch["mask"]))
