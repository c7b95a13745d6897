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

from dtx import config as config_lib
from dtx import datasets
from dtx import mesh as mesh_lib
from dtx import tasks as tasks_lib
from dtx import userdata
from dtx import compress, flops, hlo, models, optim, parallel, perfmodel, precision, simclock, strategies
from dtx.data import TrainLoader
from dtx.paths import named_leaves
from dtx.state import TrainState, abstract_train_state, init_train_state
from dtx.step import check_accumulation, check_combination, make_train_step


def make_mesh(config: ConfigDict):
    """The run's device mesh (``config.mesh``), refusing batch sizes that do not split over it."""
    mesh = mesh_lib.make_mesh(config.mesh)
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
    task = task or tasks_lib.make_task(**config.task.to_dict())
    if data is None:
        data = datasets.load_dataset(
            config.dataset.name, data_dir=config.dataset.data_dir, seed=config.seed,
            synthetic=config.dataset.synthetic.to_dict(), seq_len=config.dataset.seq_len,
        )
    dataset = userdata.as_dataset(data, task)  # labels the task cannot score are refused here
    loader = TrainLoader(dataset.train, config.global_batch_size, mesh, seed=config.seed)
    num_steps = config.num_steps or math.ceil(config.num_epochs * loader.steps_per_epoch)
    return Inputs(dataset, loader, num_steps, task)


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
    shardings: TrainState
    layout: parallel.ActivationLayout | None  # where model-parallel layers' activations live (jit driver)
    gradient_shardings: object  # ZeRO: the reduced gradients split like the optimizer state (else None)
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
                                   param_dtype=policy.params, **model_kwargs)
    opt = config.optimizer
    peak_lr = optim.scaled_learning_rate(opt.learning_rate, config.global_batch_size, opt.base_batch_size,
                                         opt.scaling)
    warmup_steps = opt.warmup_steps or round(opt.warmup_epochs * steps_per_epoch)
    learning_rate = optim.make_schedule(opt.schedule, peak_lr, num_steps, warmup_steps, power=opt.decay_power,
                                        boundaries=opt.step_boundaries, factor=opt.step_factor)
    tx = optimizer if optimizer is not None else optim.make_optimizer(
        opt.name, learning_rate, momentum=opt.momentum, weight_decay=opt.weight_decay, exclude=opt.exclude,
        trust_coefficient=opt.trust_coefficient)
    check_accumulation(config.global_batch_size, config.grad_accum_steps, mesh)
    compressor = compress.make_compressor(config.compression.name, **_settings(config.compression))
    # backup's arrival order is the straggler model's, the one the simulated clock times (dtx.simclock)
    strategy = strategies.make_strategy(config.strategy.name, stragglers=simclock.stragglers_from_config(config),
                                        **_settings(config.strategy))
    if config.parallel.name != "data" and not (strategy.caps.identity and compressor.caps.identity):
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
            "use compute=bfloat16 (no loss scaling), or compression.error_feedback=False with an unbiased compressor")
    rules = parallel.make_rules(config.parallel.name, mesh, abstract_state.params, config.parallel.rules)
    opt_rules = parallel.optimizer_rules(config.parallel.name, mesh, abstract_state.params, config.parallel.rules)
    shardings = parallel.state_shardings(abstract_state, rules, mesh, opt_rules)
    zero = config.parallel.name in parallel.ZERO_STAGES
    gradient_shardings = parallel.gradient_shardings(abstract_state.params, opt_rules, mesh) if zero else None
    layout = parallel.activation_layout(jax.tree.map(lambda s: s.spec, shardings.params), mesh)
    if layout is not None and config.driver != "jit":
        raise config_lib.ConfigError(
            f"parallel.name={config.parallel.name!r} makes layers {', '.join(sorted(layout.kernels))} model-parallel, "
            "which needs --config.driver=jit (XLA places their activation collectives)")
    check_memory(config, model, example, policy, mesh, layout)
    return Parts(policy, loss_scaler, model, tx, learning_rate, peak_lr, compressor, strategy, example, workers,
                 abstract_state, shardings, layout, gradient_shardings,
                 task or tasks_lib.make_task(**config.task.to_dict()))


# Layouts by what they cost in communication: the first that fits is the one to suggest.
_CHEAPEST_FIRST = ("data", "zero1", "zero2", "hybrid", "model", "fsdp")


def check_memory(config: ConfigDict, model: nn.Module, example, policy, mesh, layout) -> None:
    """Refuse, before compiling, a run whose estimated per-device peak (:mod:`dtx.memory`) exceeds the device's
    memory (``memory_limit``, or what an accelerator reports), naming the biggest consumers and the cheapest
    layout that would fit."""
    from dtx import memory

    capacity = config.memory_limit or _device_memory()
    if not capacity:
        return
    name = config.parallel.name
    sharded = tuple(sorted(layout.kernels)) if layout is not None else ()
    group = mesh.shape.get(mesh_lib.MODEL_AXIS, 1)
    common = dict(nodes=mesh.size, global_batch=config.global_batch_size, optimizer=config.optimizer.name,
                  policy=policy, accum_steps=config.grad_accum_steps,
                  backend="xla_cpu" if jax.default_backend() == "cpu" else "gpu")

    def estimate(layout_name: str):
        kind = "rules" if layout_name == "rules" or (layout_name in ("model", "hybrid") and sharded) else layout_name
        return memory.estimate_model(model, example.shape[1:], kind, group_size=group if kind != "data" else 1,
                                     sharded=sharded if kind == "rules" else (), **common)

    try:
        mine = estimate(name)
    except (ValueError, TypeError):  # a model the memory model cannot analyse: nothing to refuse on
        return
    if mine.fits(capacity):
        return
    parts = sorted(((mine.params, "parameters"), (mine.grads, "gradients"), (mine.optimizer, "optimizer state"),
                    (mine.activations, "activations"), (mine.buffers, "communication buffers")), reverse=True)
    biggest = ", ".join(f"{what} {_gib(value)}" for value, what in parts[:3])
    fits = []
    for other in _CHEAPEST_FIRST:
        if other == name or (other in ("model", "hybrid") and group == 1):
            continue
        try:
            alternative = memory.estimate_model(model, example.shape[1:], other, group_size=group, **common)
        except (ValueError, TypeError):
            continue
        if alternative.fits(capacity):
            driver = "" if other in ("data", "zero1", "zero2") else "--config.driver=jit "  # both drivers run these
            fits.append(f"{driver}--config.parallel.name={other} fits: {_gib(alternative.total)} of {_gib(capacity)}")
            break
    hint = fits[0] if fits else ("no layout fits on this mesh: lower global_batch_size, raise grad_accum_steps, "
                                 "or use more devices")
    raise config_lib.ConfigError(
        f"this run needs about {_gib(mine.total)} per device (dtx.memory's estimate, peak in the {mine.phase} phase) "
        f"but a device has {_gib(capacity)} (memory_limit or the accelerator's): biggest are {biggest}. {hint}")


def _device_memory() -> float:
    """Bytes an accelerator reports for one device (0 on CPU, which reports none)."""
    try:  # this process's own device: another process's cannot be asked (multi-process runs)
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 — a backend without memory statistics reports nothing
        return 0.0
    return float((stats or {}).get("bytes_limit", 0))


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.1f} MiB"


def make_step(config: ConfigDict, parts: Parts, mesh, *, communicate: bool = True):
    """The run's jitted train step (``communicate=False``: its no-collective twin, for ``dtx bench step``)."""
    return make_train_step(parts.model, parts.tx, mesh, driver=config.driver, policy=parts.policy,
                           loss_scaler=parts.loss_scaler, accum_steps=config.grad_accum_steps,
                           allreduce=config.allreduce, bucket_bytes=config.bucket_bytes,
                           state_shardings=parts.shardings, strategy=parts.strategy, compressor=parts.compressor,
                           communicate=communicate, grad_norm=config.log_grad_norm, layout=parts.layout,
                           gradient_shardings=parts.gradient_shardings,
                           shard_accumulator=parallel.ZERO_STAGES.get(config.parallel.name) == 2, task=parts.task)


def init_state(config: ConfigDict, parts: Parts, mesh) -> TrainState:
    """A fresh state of ``parts``, seeded by ``config.seed``, laid out on ``mesh``."""
    return init_train_state(parts.model, parts.tx, parts.example, config.seed, mesh, parts.loss_scaler,
                            parts.shardings, parts.strategy, parts.compressor)


def compile_step(train_step, state: TrainState, batch):
    """The step's executable; lowering and compiling here fills the cache its first call uses."""
    return train_step.lower(state, batch).compile()


def step_flops(config: ConfigDict, compiled) -> float | None:
    """FLOPs per device of one step (XLA's cost analysis); unknown under accumulation, whose loop XLA counts once."""
    return None if compiled is None or config.grad_accum_steps > 1 else flops.compiled_flops(compiled)


def program_figures(compiled, model: nn.Module, parts: Parts, mesh, global_batch: int) -> dict:
    """The first record's view of the step: compiled and modelled communication, model FLOPs.

    ``comm_bytes_compiled_per_step`` / ``comm_rounds_compiled_per_step``: what the compiled
    program's collectives send per device per step (:mod:`dtx.hlo`; a collective in a
    conditional branch counts as if taken, one in a loop once). ``model_flops_per_step``:
    forward + backward of the model's Dense/Conv layers on the global batch, and
    ``comm_bytes_modelled_per_step``: the bytes :mod:`dtx.perfmodel` predicts for this
    layout (data, model, hybrid or rules over Dense/Conv kernels; synchronous SGD without
    compression), for models it can analyse.
    """
    sent = hlo.total(compiled)
    out = {"comm_bytes_compiled_per_step": float(sent.bytes_sent), "comm_rounds_compiled_per_step": float(sent.rounds)}
    try:
        layers = perfmodel.analyze(model, parts.example.shape[1:], dtype=parts.policy.compute)
    except (perfmodel.PerfModelError, TypeError, ValueError):  # no Dense/Conv, or a model analyze cannot trace
        return out
    out["model_flops_per_step"] = float(sum(layer.train_flops for layer in layers) * global_batch)
    # The perf model covers synchronous SGD over data-parallel and column-split (model-parallel) layers.
    kernels = dict(parts.layout.kernels) if parts.layout is not None else {}
    split = {path.rsplit("/", 1)[0] for path, sharding in _shardings_by_path(parts.shardings.params)
             if not sharding.is_fully_replicated}
    columns = all(tuple(spec)[-1:] == (mesh_lib.MODEL_AXIS,) and not any(tuple(spec)[:-1]) for spec in kernels.values())
    if (parts.strategy.caps.identity and parts.compressor.caps.identity and split <= set(kernels) and columns
            and set(kernels) <= {layer.name for layer in layers}):
        group = mesh.shape[mesh_lib.MODEL_AXIS] if kernels else 1
        e = np.dtype(parts.policy.reduce).itemsize
        out["comm_bytes_modelled_per_step"] = float(sum(
            sum(perfmodel.layer_bytes(layer, mesh.size, global_batch, group, layer.name in kernels, e,
                                      last=layer is layers[-1]))
            for layer in layers))
    return out


def _shardings_by_path(params) -> list:
    return named_leaves(params)


def _settings(block: ConfigDict) -> dict:
    """A technique's config block without its ``name``: the keyword arguments of its factory."""
    return {k: v for k, v in block.to_dict().items() if k != "name"}


def _loss_scaler(settings: ConfigDict, policy: precision.Policy) -> precision.LossScaler:
    enabled = settings.name == "dynamic" or (settings.name == "auto" and policy.needs_loss_scaling)
    return precision.LossScaler(enabled=enabled, initial_scale=settings.initial,
                                growth_interval=settings.growth_interval, backoff=settings.backoff,
                                min_scale=settings.min_scale)
