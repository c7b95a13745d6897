"""What a run is built from, read from the config in one place: its mesh, data, parts and step.

``dtx.train`` and ``dtx bench step`` both build through here (so the step a benchmark times is the
step a run trains), ``dtx eval`` / ``dtx export`` rebuild a run's parts with :func:`build_parts`.
Everything that can be refused without compiling is refused here, naming the config key.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import flax.linen as nn
import jax
import numpy as np
import optax
from ml_collections import ConfigDict

from dtx import compress, models, optim, parallel, precision, strategies
from dtx import config as config_lib
from dtx import mesh as mesh_lib
from dtx.ckpt import checkpoint as checkpoint_lib
from dtx.comm import hlo
from dtx.data import datasets, inputs, userdata
from dtx.data import tasks as tasks_lib
from dtx.data.loader import TrainLoader
from dtx.parallel.pipeline import check as pipeline_check
from dtx.parallel.pipeline import relayout as pipeline_relayout
from dtx.parallel.pipeline import stages as stages_lib
from dtx.parallel.pipeline import step as step_pipeline
from dtx.parallel.pipeline.check import micro_batches
from dtx.parallel.pipeline.stages import STAGE_AXIS
from dtx.paths import named_leaves
from dtx.perf import clusters, flops, row_split, simclock
from dtx.perf import layers as layers_lib
from dtx.perf import model as perfmodel
from dtx.run.memory_check import check_memory
from dtx.step import (
    StepSpec,
    check_accumulation,
    check_combination,
    make_eval_step,
    make_train_step,
)
from dtx.step.state import TrainState, abstract_train_state, init_train_state
from dtx.strategies.stragglers import Stragglers


def make_mesh(config: ConfigDict, devices=None):
    """The run's device mesh (``config.mesh``; over the first of ``devices`` it needs, all when ``None``), refusing
    batch sizes that do not split over it."""
    mesh = mesh_lib.make_mesh(config.mesh, devices=devices)
    mesh_lib.check_batch_size(config.global_batch_size, mesh)
    mesh_lib.check_batch_size(config.eval_batch_size, mesh, what="eval_batch_size")
    return mesh


class Inputs(NamedTuple):
    """The run's data: what it trains on, how it is batched, and how long the run is."""

    dataset: datasets.Dataset
    loader: TrainLoader
    num_steps: int
    task: tasks_lib.Task  # the loss and metrics (config.task, or train(..., task=))


def load_data(config: ConfigDict, mesh, *, task: tasks_lib.Task | None = None, data=None) -> Inputs:
    """``config.dataset`` (or your ``data``), checked against the task, batched over ``mesh``."""
    task = task or config_task(config)
    given = data is not None
    if not given:  # image datasets are read through grain, augmented (dtx.data.inputs)
        data = inputs.load_dataset(config.dataset, seed=config.seed)
    dataset = userdata.as_dataset(data, task)  # labels the task cannot score are refused here
    loader = inputs.make_loader(dataset, config.global_batch_size, mesh, seed=config.seed,
                                  settings=None if given else config.dataset)
    num_steps = config.num_steps or math.ceil(config.num_epochs * loader.steps_per_epoch)
    if isinstance(loader, inputs.GrainLoader):
        loader.num_steps = num_steps  # its prefetching workers stop after the run's last batch
    return Inputs(dataset, loader, num_steps, task)


def config_task(config: ConfigDict) -> tasks_lib.Task:
    """The task ``config.task`` names (built in, or your function by import path), built from its settings."""
    return tasks_lib.make_task(config.task.name, **_settings(config.task, tasks_lib.task_settings(config.task.name)))


class Parts(NamedTuple):
    """What a run is built from, read from the config in one place (:func:`train`, ``dtx bench step``)."""

    policy: precision.Policy
    loss_scaler: precision.LossScaler
    model: nn.Module
    tx: optax.GradientTransformation
    learning_rate: optax.Schedule  # of config.optimizer (unused when a custom optimizer is given)
    peak_learning_rate: float
    compressor: compress.Compressor
    strategy: strategies.Strategy
    example: jax.ShapeDtypeStruct  # the inputs' shape and dtype
    workers: int  # data-parallel size: the leading axis of per-worker state
    abstract_state: TrainState
    placement: parallel.Placement  # the layout's shardings of the state, gradients and activations
    task: tasks_lib.Task  # the loss and metrics (config.task, or train(..., task=))


def build_parts(config: ConfigDict, mesh, dataset: datasets.Dataset, steps_per_epoch: int, num_steps: int, *,
                model: nn.Module | None = None, optimizer: optax.GradientTransformation | None = None,
                task: tasks_lib.Task | None = None) -> Parts:
    """Precision policy, model, optimizer, compressor, strategy, and the state's shape and layout.

    Everything that can be refused without compiling is refused here (accumulation that
    does not split, impossible combinations, shape-dependent settings).
    """
    policy = precision.parse_policy(config.precision)
    if np.dtype(policy.params) == np.float16:
        raise config_lib.ConfigError(
            f"precision={config.precision!r}: float16 master weights overflow and lose small updates (a probe "
            "had every parameter non-finite after one step); keep params=float32 and compute in float16 "
            "(p=f32,c=f16: dynamic loss scaling turns on by itself), or use bfloat16")
    loss_scaler = _loss_scaler(config.loss_scale, policy)
    if model is None:
        model_kwargs = {k: v for k, v in config.model.items() if k != "name"}
        model = models.build_model(config.model.name, num_classes=dataset.num_classes, dtype=policy.compute,
                                   param_dtype=policy.params, remat=config.remat.policy, **model_kwargs)
    elif dataset.token_bytes is not None and isinstance(getattr(model, "num_classes", None), int) \
            and model.num_classes < dataset.num_classes:  # token ids past its logits would score garbage
        raise config_lib.ConfigError(
            f"the model you passed ({type(model).__name__}) has model.num_classes={model.num_classes} logits but the "
            f"dataset's tokenizer has {dataset.num_classes} ids (dataset.vocab_size); build it with "
            f"num_classes={dataset.num_classes} (or more), or lower --config.dataset.vocab_size to {model.num_classes}")
    elif config.remat.policy != "none" and getattr(model, "remat", "none") != config.remat.policy:
        raise config_lib.ConfigError(
            f"remat.policy={config.remat.policy!r} cannot reach the model you passed ({type(model).__name__}, "
            f"remat={getattr(model, 'remat', None)!r}); build it with remat={config.remat.policy!r} or leave "
            "remat.policy at none")
    try:  # offload needs a pinned host memory space: refused here, naming the backend, not by the compiler
        models.remat.check_backend(getattr(model, "remat", "none"), mesh.devices.flat)
    except ValueError as error:
        raise config_lib.ConfigError(str(error)) from None
    opt = config.optimizer
    peak_lr = optim.scaled_learning_rate(opt.learning_rate, config.global_batch_size, opt.base_batch_size,
                                         opt.scaling)
    warmup_steps = opt.warmup_steps or round(opt.warmup_epochs * steps_per_epoch)
    learning_rate = optim.make_schedule(opt.schedule, peak_lr, num_steps, warmup_steps, power=opt.decay_power,
                                        boundaries=opt.step_boundaries, factor=opt.step_factor)
    tx = optimizer if optimizer is not None else optim.make_optimizer(
        opt.name, learning_rate, momentum=opt.momentum, weight_decay=opt.weight_decay, exclude=opt.exclude,
        trust_coefficient=opt.trust_coefficient)
    if not parallel.configured(config).stages:  # a pipeline's micro-batches split each data shard's batch: its check
        check_accumulation(config.global_batch_size, micro_batches(config), mesh)
    compressor = compress.make_compressor(config.compression.name,
                                          **_settings(config.compression, compress.compressor_settings()))
    # backup's arrival order is the straggler model's, the one the simulated clock times (dtx.perf.simclock)
    strategy = strategies.make_strategy(config.strategy.name, stragglers=stragglers(config),
                                        **_settings(config.strategy, strategies.strategy_settings()))
    if not parallel.configured(config).replicated and not (
            strategy.caps.identity and compressor.caps.identity):
        raise config_lib.ConfigError(
            f"parallel.name={config.parallel.name!r} with strategy.name={config.strategy.name!r} / "
            f"compression.name={config.compression.name!r}: strategies and compression replace the gradient "
            "all-reduce of data parallelism, which a partitioned model or ZeRO (its own reduce-scatter and "
            "all-gather) does not run; use parallel.name=data with them, or strategy.name=sync and "
            "compression.name=none with this partitioning")
    check_combination(config.driver, strategy, compressor, loss_scaler)

    example = jax.ShapeDtypeStruct(dataset.train.inputs.shape, dataset.train.inputs.dtype)
    workers = mesh_lib.data_parallel_size(mesh)
    abstract_state = abstract_train_state(model, tx, example, loss_scaler, strategy, compressor, workers)
    if loss_scaler.enabled and jax.tree.leaves(abstract_state.worker["compress"]):
        raise config_lib.ConfigError(
            f"compression.name={config.compression.name!r} keeps per-worker state (error-feedback residuals, "
            "DGC momentum) of loss-scaled gradients, which goes stale whenever the float16 loss scale changes; "
            "use compute=bfloat16 (no loss scaling), or an unbiased compressor without it (compression.name=terngrad "
            "or qsgd, or randomk with compression.error_feedback=False)")
    chosen, pipeline = parallel.configured(config), None  # with its parallel.* fields (parallel.reduce)
    if chosen.stages:  # the model's layers cut into stages; the state is their parameter rows
        pipeline, abstract_state = _pipeline(config, model, tx, example, abstract_state.params, mesh)
    settings = dict(config[chosen.block]) if chosen.block else {}  # the layout's own block (tensor.*)
    for key in chosen.borrows if not chosen.stages else ():  # and what it borrows (a context axis: tensor's SP)
        block, name = key.split(".")
        settings[name] = config[block][name]
    if parallel.fsdp_stage(config):  # the fsdp axis's stage, composed into the layout (parallel.compose)
        settings.pop("zero_stage", None)
    placement = chosen.place(abstract_state, mesh, config.parallel.rules, **settings)._replace(runner=pipeline)
    if pipeline is not None and pipeline.zero_stage:  # ZeRO's optimizer rows (stage 3: parameter rows) split too
        placement = placement._replace(state=step_pipeline.state_shardings(abstract_state, mesh, pipeline.plan,
                                                                           pipeline.zero_stage))
    layout = placement.activations
    if config.driver not in placement.layout.drivers:
        raise config_lib.ConfigError(
            f"parallel.name={config.parallel.name!r}"
            + (f" composed with the mesh's axes ({placement.layout.name!r}"
               + (f"; an 'fsdp' axis runs ZeRO stage fsdp.zero_stage={config.fsdp.zero_stage}"
                  if any(name == mesh_lib.FSDP_AXIS for name, _ in config.mesh) else "") + ")"
               if placement.layout.name != config.parallel.name else "")
            + f" runs under driver {' or '.join(placement.layout.drivers)}"
            + (f" (it makes layers {', '.join(sorted(layout.kernels))} model-parallel: XLA places their activation "
               "collectives)" if getattr(layout, "kernels", None) else
               " (XLA places the collectives that move its activations)" if layout is not None else "")
            + f"; set --config.driver={placement.layout.drivers[0]}")
    check_memory(config, model, example, policy, mesh, layout, pipeline)
    # On text, evaluation also counts the bytes the scored tokens spell: bits per byte (the train step is unchanged).
    return Parts(policy, loss_scaler, model, tx, learning_rate, peak_lr, compressor, strategy, example, workers,
                 abstract_state, placement,
                 tasks_lib.count_bytes(task or config_task(config), dataset.token_bytes))


def _pipeline(config: ConfigDict, model: nn.Module, tx, example, abstract_params, mesh):
    """``parallel.name=pipeline``: every setting it cannot take refused by key (:mod:`dtx.parallel.pipeline.check`),
    then the stages, the schedule and the abstract state in rows."""
    try:
        layers = stages_lib.model_layers(model, abstract_params, example)
        opt = config.optimizer
        block = config.pipeline
        pipeline_check.check_settings(pipeline_check.PipelineSettings(
            mesh_shape=dict(mesh.shape), schedule=block.schedule, boundaries=block.boundaries,
            virtual_stages=block.virtual_stages, num_layers=len(layers), global_batch_size=config.global_batch_size,
            microbatches=block.microbatches, driver=config.driver, optimizer=opt.name,
            weight_decay=opt.weight_decay, strategy=config.strategy.name, compression=config.compression.name,
            allreduce=config.allreduce, bucket_bytes=config.bucket_bytes, precision=config.precision,
            zero_stage=pipeline_check.zero_stage(config)))
        options = step_pipeline.StageOptions(
            schedule=block.schedule, boundaries=block.boundaries, micro=block.microbatches,
            chunks=block.virtual_stages,
            per_tensor=pipeline_check.per_tensor(opt.name, opt.weight_decay, pipeline_check.zero_stage(config)),
            zero_stage=pipeline_check.zero_stage(config), sequence_parallel=config.tensor.sequence_parallel,
            attention=config.context.attention, balance=config.context.balance,
            decay_mask=optim.path_mask(opt.exclude) if opt.weight_decay else None)
        pipeline = step_pipeline.make_pipeline(model, abstract_params, mesh, options, example=example)
    except ValueError as error:  # PipelineError, StepError: the config's fault here
        raise config_lib.ConfigError(str(error)) from None
    return pipeline, step_pipeline.abstract_state(model, tx, example, pipeline.plan)


def cluster_spec(config: ConfigDict) -> simclock.ClusterSpec | None:
    """The modelled cluster of ``config.cluster`` (``None`` without a name: no simulated clock)."""
    block = config.cluster
    try:
        cluster = clusters.from_settings(block.name, node_flops=block.node_flops,
                                         memory_bandwidth=block.memory_bandwidth, bandwidth=block.bandwidth,
                                         latency=block.latency)
    except clusters.ClusterError as e:
        raise simclock.ClockError(str(e)) from None
    if cluster is None:
        return None
    return simclock.ClusterSpec(cluster, stragglers(config), float(block.overlap), float(block.get("compute_s", 0.0)))


def stragglers(config: ConfigDict) -> Stragglers:
    """``config.cluster``'s straggler model bound to ``config.seed`` (the arrival order of ``backup`` and the
    simulated clock's draws are the same)."""
    block = config.cluster
    try:
        return Stragglers(block.straggler, int(config.seed), float(block.sigma), float(block.slow_fraction),
                          float(block.slow_factor)).check()
    except ValueError as e:
        raise simclock.ClockError(str(e)) from None


def clock_recorder(config: ConfigDict, parts: Parts, saved: dict | None = None) -> simclock.Recorder | None:
    """The run's simulated clock (``None`` without ``config.cluster``): the example's own dtype (a token model
    takes integer ids; the clock only traces shapes), the strategy's capabilities (who waits for whom). A pipeline's
    clock times its schedule tick by tick (:func:`dtx.parallel.pipeline.costs.clock_model`)."""
    runner, spec = parts.placement.runner, cluster_spec(config)
    if runner is not None and spec is not None:  # a parallelism that runs its own step times it
        return simclock.Recorder(runner.clock(parts.workers, config.global_batch_size, spec.cluster,
                                              spec.stragglers), saved)
    return simclock.recorder_for_run(cluster_spec(config), parts.model, parts.example.shape[1:], parts.example.dtype,
                                     workers=parts.workers, global_batch=config.global_batch_size,
                                     accum_steps=micro_batches(config), algorithm=config.allreduce,
                                     caps=parts.strategy.caps, saved=saved)


def step_spec(config: ConfigDict, parts: Parts, *, communicate: bool = True) -> StepSpec:
    """The run's step settings: its driver, precision, accumulation, allreduce, strategy, compressor, task
    and the layout's placement (``communicate=False``: the no-collective twin, for ``dtx bench step``)."""
    return StepSpec(driver=config.driver, policy=parts.policy, loss_scaler=parts.loss_scaler,
                    accum_steps=micro_batches(config), allreduce=config.allreduce, bucket_bytes=config.bucket_bytes,
                    strategy=parts.strategy, compressor=parts.compressor, task=parts.task, placement=parts.placement,
                    communicate=communicate, grad_norm=config.log_grad_norm,
                    clip_norm=float(config.optimizer.clip_norm))


def make_step(config: ConfigDict, parts: Parts, mesh, *, communicate: bool = True):
    """The run's jitted train step (``communicate=False``: its no-collective twin, for ``dtx bench step``)."""
    return make_train_step(parts.model, parts.tx, mesh, step_spec(config, parts, communicate=communicate))


def make_eval(config: ConfigDict, parts: Parts, mesh):
    """The run's jitted evaluation step: the train step's driver, policy, strategy, task and placement."""
    return make_eval_step(parts.model, mesh, step_spec(config, parts))


def init_state(config: ConfigDict, parts: Parts, mesh) -> TrainState:
    """A fresh state of ``parts``, seeded by ``config.seed``, laid out on ``mesh``."""
    if parts.placement.runner is not None:  # a parallelism that runs its own step lays out its own state
        return parts.placement.runner.init_state(parts.model, parts.tx, parts.example, config.seed, mesh,
                                                 parts.placement.state, parts.loss_scaler)
    return init_train_state(parts.model, parts.tx, parts.example, config.seed, mesh, parts.loss_scaler,
                            parts.placement.state, step_spec(config, parts))


def relayout(parts: Parts, mesh):
    """How this run restores a checkpoint saved in the other layout (:func:`dtx.parallel.pipeline.relayout.relayout`): a
    pipeline's stage rows into the model's tree, or the tree into this pipeline's rows."""
    tree_state = abstract_train_state(parts.model, parts.tx, parts.example, parts.loss_scaler, parts.strategy,
                                      parts.compressor, parts.workers)
    plan = parts.placement.runner.plan if parts.placement.runner is not None else None
    def pipelined(saved: dict) -> bool:  # the saved run's layout cut stages: its preset, or a stage axis
        name = (saved.get("parallel") or {}).get("name")
        return (name in parallel.LAYOUTS and bool(parallel.get_layout(name).stages)) or any(
            axis == STAGE_AXIS for axis, _ in saved.get("mesh") or ())
    target = checkpoint_lib.abstract_target(parts.abstract_state, parts.placement.state)
    return pipeline_relayout.relayout(parts.model, parts.tx, parts.example, tree_state, target, mesh, plan, pipelined)


def compile_step(train_step, state: TrainState, batch):
    """The step's executable; lowering and compiling here fills the cache its first call uses."""
    return train_step.lower(state, batch).compile()


def step_flops(config: ConfigDict, compiled) -> float | None:
    """FLOPs per device of one step (XLA's cost analysis); unknown under accumulation, whose loop XLA counts once."""
    return None if compiled is None or micro_batches(config) > 1 else flops.compiled_flops(compiled)


def program_figures(compiled, model: nn.Module, parts: Parts, mesh, global_batch: int) -> dict:
    """The first record's view of the step: compiled and modelled communication, model FLOPs.

    ``comm_bytes_compiled_per_step`` / ``comm_rounds_compiled_per_step``: what the compiled
    program's collectives send per device per step (:mod:`dtx.comm.hlo`; a collective in a
    conditional branch counts as if taken, one in a loop once per trip). ``model_flops_per_step``:
    forward + backward of the model's matrix products on the global batch (Dense/Conv layers, attention's
    projections and score and value products, a tied output layer: :func:`dtx.perf.layers.model_flops`), and
    ``comm_bytes_modelled_per_step``: the bytes :mod:`dtx.perf.model` predicts for this
    layout (data, model, hybrid or rules over Dense/Conv kernels; synchronous SGD without
    compression), for models it can analyse.
    """
    sent = hlo.total(compiled)
    out = {"comm_bytes_compiled_per_step": float(sent.bytes_sent), "comm_rounds_compiled_per_step": float(sent.rounds)}
    shape, dtype = parts.example.shape[1:], parts.example.dtype  # token ids stay integers (a transformer's input)
    dtype = dtype if np.issubdtype(dtype, np.integer) else parts.policy.compute
    try:
        out["model_flops_per_step"] = float(layers_lib.model_flops(model, shape, dtype=dtype) * global_batch)
        layers = layers_lib.analyze(model, shape, dtype=dtype)
    except (layers_lib.PerfModelError, TypeError, ValueError):  # no Dense/Conv, or a model analyze cannot trace
        return out
    # The perf model covers synchronous SGD over data-parallel and column-split (model-parallel) layers, not a
    # parallelism that moves activations its own way (context parallelism: no modelled figure).
    if parts.placement.layout.activation_factory is not None:
        return out
    activations = parts.placement.activations
    kernels = dict(activations.kernels) if activations is not None else {}
    split = {path.rsplit("/", 1)[0] for path, sharding in named_leaves(parts.placement.state.params)
             if not sharding.is_fully_replicated}
    rows = {name for name, spec in kernels.items() if tuple(spec) == (mesh_lib.MODEL_AXIS, None)}  # fc_pairs' rows
    columns = all(tuple(spec)[-1:] == (mesh_lib.MODEL_AXIS,) and not any(tuple(spec)[:-1])
                  for name, spec in kernels.items() if name not in rows)
    if (parts.strategy.caps.identity and parts.compressor.caps.identity and split <= set(kernels) and columns
            and set(kernels) <= {layer.name for layer in layers}):
        group = mesh.shape[mesh_lib.MODEL_AXIS] if kernels else 1
        e = np.dtype(parts.policy.reduce).itemsize
        out["comm_bytes_modelled_per_step"] = float(sum(
            sum(row_split.row_bytes(layer, mesh.size, global_batch, group, e) if layer.name in rows else
                perfmodel.layer_bytes(layer, mesh.size, global_batch, group, layer.name in kernels, e,
                                      last=layer is layers[-1]))
            for layer in layers))
    return out


def _settings(block: ConfigDict, taken: dict[str, tuple[str, ...]]) -> dict:
    """The keys of a plug-in's config block that its chosen plug-in takes (``taken``: each plug-in's declared
    settings): the keyword arguments of its factory. The config's check refused any other key set away from
    its default."""
    return config_lib.chosen_settings(block, taken)


def _loss_scaler(settings: ConfigDict, policy: precision.Policy) -> precision.LossScaler:
    enabled = settings.name == "dynamic" or (settings.name == "auto" and policy.needs_loss_scaling)
    return precision.LossScaler(enabled=enabled, initial_scale=settings.initial,
                                growth_interval=settings.growth_interval, backoff=settings.backoff,
                                min_scale=settings.min_scale)
