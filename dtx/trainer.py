"""One training run, told top to bottom: devices, data, model, steps, loop, evaluation.

The config is read here and only here; everything below it receives plain
values and built collaborators.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from typing import NamedTuple

import flax.linen as nn
import jax
import numpy as np
import optax
from ml_collections import ConfigDict

from dtx import checkpoint as checkpoint_lib
from dtx import config as config_lib
from dtx import datasets
from dtx import mesh as mesh_lib
from dtx import metrics as metrics_lib
from dtx import preflight
from dtx import tasks as tasks_lib
from dtx import userdata
from dtx import compress, costmodel, flops, hlo, models, optim, parallel, perfmodel, precision, strategies
from dtx.data import TrainLoader, eval_batches
from dtx.metrics import to_host
from dtx.state import TrainState, abstract_train_state, init_train_state, num_params
from dtx.step import EvalStep, check_accumulation, check_combination, make_eval_step, make_train_step
from dtx.watchdog import StepWatchdog


@dataclasses.dataclass
class TrainResult:
    """What a run leaves behind: its final state and its final evaluation."""

    state: TrainState
    metrics: dict
    workdir: str
    preempted: bool = False  # stopped by SIGTERM at a step boundary; run again to resume
    saved: bool = False  # a checkpoint holds the returned state (preempted runs: resume continues from it)


def train(config: ConfigDict, workdir: str | os.PathLike, *, model: nn.Module | None = None,
          optimizer: optax.GradientTransformation | None = None,
          optimizer_description: str | None = None, task: tasks_lib.Task | None = None, data=None) -> TrainResult:
    """Train ``config`` and evaluate on the test split; records go to ``workdir``.

    Args:
      config: the experiment (:func:`dtx.config.load`, :func:`dtx.config.override`).
      workdir: where records, TensorBoard events, checkpoints and traces go.
      model: a flax module to train instead of the one ``config.model`` names; it is
        called as ``model(inputs, train=bool)`` and returns logits.
      optimizer: an optax optimizer to use instead of the one ``config.optimizer``
        describes (its learning rate is then not logged).
      optimizer_description: how ``config.json`` and the first record name ``optimizer``
        (default: read from the optax transformation's factories and settings).
      task: the loss and metrics (:mod:`dtx.tasks`) instead of the ones ``config.task`` names.
      data: your arrays instead of ``config.dataset``: ``(inputs, labels)``, ``{"train": ...,
        "test": ...}``, :class:`dtx.datasets.Split` or :class:`dtx.datasets.Dataset`, in memory or
        memory-mapped (:mod:`dtx.userdata`); without a test split nothing is evaluated.

    Raises before any compilation on bad input (unknown names, batch sizes that do
    not split over the mesh, missing dataset files, a workdir that already holds a run).
    """
    config_lib.validate(config)
    run_start = time.perf_counter()
    workdir = os.fspath(workdir)
    checkpoint_dir = config.checkpoint.dir or os.path.join(workdir, "checkpoints")
    for what, path in (("--workdir (train(..., workdir=))", workdir), ("checkpoint.dir", checkpoint_dir)):
        if os.path.exists(path) and not os.path.isdir(path):
            raise config_lib.ConfigError(f"{what} {path!r} is a file, not a directory; name a directory "
                                         "(it is created if missing)")
    if config.emulate_cpu_devices:
        mesh_lib.emulate_cpu_devices(config.emulate_cpu_devices)
    multi_process = mesh_lib.initialize_distributed(config.distributed)
    # SIGTERM from here on -- start-up included, where loading and compiling take seconds --
    # stops the run at a step boundary instead of killing it. Several processes agree on the
    # step through JAX's preemption sync point, which needs checkpoints to be worth it.
    watch = not multi_process or bool(config.checkpoint.every_steps) or config.checkpoint.resume != "never"
    with checkpoint_lib.PreemptionWatcher(enabled=watch, multi_process=multi_process) as preemption:
        return _train(config, workdir, checkpoint_dir, multi_process, preemption, run_start,
                      model=model, optimizer=optimizer, optimizer_description=optimizer_description,
                      task=task, data=data)


def _train(config: ConfigDict, workdir: str, checkpoint_dir: str, multi_process: bool,
           preemption: checkpoint_lib.PreemptionWatcher, run_start: float, *, model, optimizer,
           optimizer_description=None, task=None, data=None) -> TrainResult:
    # ------------------------------------------------------------------ devices
    mesh = mesh_lib.make_mesh(config.mesh)
    mesh_lib.check_batch_size(config.global_batch_size, mesh)
    mesh_lib.check_batch_size(config.eval_batch_size, mesh, what="eval_batch_size")
    if multi_process:
        _check_same_config(config)
    resuming = _decide_resume(config.checkpoint.resume, checkpoint_dir, workdir, config.checkpoint.resume_step)
    hmac_key = _hmac_key(config.checkpoint.hmac_key_env)
    _barrier("dtx: every process has checked the workdir")  # before anyone writes to it
    if multi_process and (config.checkpoint.every_steps or resuming):
        _check_shared_directory(checkpoint_dir)

    # --------------------------------------------------------------------- data
    task_given = task is not None
    task = task or tasks_lib.make_task(**config.task.to_dict())
    given = data is not None
    if not given:
        data = datasets.load_dataset(
            config.dataset.name, data_dir=config.dataset.data_dir, seed=config.seed,
            synthetic=config.dataset.synthetic.to_dict(), seq_len=config.dataset.seq_len,
        )
    dataset = userdata.as_dataset(data, task)  # labels the task cannot score are refused here
    user_data = userdata.fingerprint(dataset) if given else None  # the caller's arrays: a resume checks them
    loader = TrainLoader(dataset.train, config.global_batch_size, mesh, seed=config.seed)
    num_steps = config.num_steps or math.ceil(config.num_epochs * loader.steps_per_epoch)
    # Dropped examples, a warmup as long as the run, config keys an argument replaces: said before any work.
    preflight.warn(config, train_size=loader.size, data_parallel=mesh_lib.data_parallel_size(mesh),
                   num_steps=num_steps, model=model, optimizer=optimizer, data_given=given, task_given=task_given)

    # ------------------------------------- precision, model, optimizer, techniques
    parts = build_parts(config, mesh, dataset, loader.steps_per_epoch, num_steps, model=model, optimizer=optimizer,
                        task=task)
    ran = preflight.what_ran(config, parts.model, model_given=model is not None, optimizer_given=optimizer is not None,
                             optimizer=optimizer, optimizer_description=optimizer_description, train_size=loader.size,
                             task_name=task.name, task_given=task_given, data_fingerprint=user_data,
                             data_description=userdata.describe(dataset) if given else None)
    policy, loss_scaler, model, tx = parts.policy, parts.loss_scaler, parts.model, parts.tx
    abstract_state, shardings, workers = parts.abstract_state, parts.shardings, parts.workers

    # -------------------------------------------------------------- state, steps
    # The rate each step uses, for the records (computed once: the loop allows no implicit transfers).
    lr_by_step = (np.asarray(jax.jit(jax.vmap(parts.learning_rate))(np.arange(num_steps)))
                  if optimizer is None else None)
    train_step = make_step(config, parts, mesh)
    eval_step = make_eval_step(model, mesh, driver=config.driver, policy=policy, state_shardings=shardings,
                               strategy=parts.strategy, layout=parts.layout, task=parts.task)
    # The yardstick of every communication figure: a float32 ring allreduce of the gradients.
    reference_bytes = costmodel.dense_allreduce_traffic(abstract_state.params, workers, "ring", "float32").bytes_sent
    checkpointer = None
    if config.checkpoint.every_steps or resuming:
        checkpointer = checkpoint_lib.Checkpointer(checkpoint_dir, keep=config.checkpoint.keep,
                                                   async_save=config.checkpoint.async_save, hmac_key=hmac_key)
    if resuming:  # the newest step that verifies (or checkpoint.resume_step), its config checked before any array
        resumed = checkpointer.resume(
            checkpoint_lib.abstract_target(abstract_state, shardings), step=config.checkpoint.resume_step or None,
            check=lambda saved: (_check_resumable(saved.get("config", {}), config),
                                 _check_workers(saved, workers, abstract_state),
                                 userdata.check_resume(saved, user_data)))
        state, saved = resumed.state, resumed.metadata
    else:
        state = init_train_state(model, tx, parts.example, config.seed, mesh, loss_scaler, shardings, parts.strategy,
                                 parts.compressor)
    start_step = int(to_host(state.step))
    if resuming and jax.process_index() == 0:
        print(f"dtx: resumed from step {start_step} ({checkpoint_dir})", file=sys.stderr, flush=True)
    # A chained hash of every batch's indices so far: equal logs prove no batch was repeated or skipped.
    data_digest = saved.get("data_digest", "") if resuming else ""
    comm = CommTotals(**saved.get("comm", {})) if resuming else CommTotals()
    test_batches = eval_batches(dataset.test, config.eval_batch_size, mesh) if dataset.test is not None else None
    # What the compiled step does, read once from the program the loop's first call reuses:
    # FLOPs per device (XLA's cost analysis; unknown under accumulation, whose loop XLA
    # counts once) and the bytes its collectives send (dtx.hlo). Beside them, what the
    # model predicts: the useful FLOPs and, for Dense/Conv layouts, the bytes (dtx.perfmodel).
    compiled = _compiled_step(train_step, state, loader.batch(start_step))
    step_flops = None if compiled is None or config.grad_accum_steps > 1 else flops.compiled_flops(compiled)
    program = {} if compiled is None else program_figures(compiled, model, parts, mesh, config.global_batch_size)
    peak_flops = flops.device_peak_flops(policy.compute, config.peak_flops)
    if config.driver == "jit":  # XLA placed the collectives: their bytes are the compiled program's
        comm.fixed = (program.get("comm_bytes_compiled_per_step", 0.0), program.get("comm_rounds_compiled_per_step", 0.0))

    # --------------------------------------------------------------------- loop
    main_process = jax.process_index() == 0
    if main_process:
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(ran.config, f, indent=2)  # the config, naming the module/optimizer that replaced its blocks
    # A resume drops the records past its step (a killed run's abandoned future): one history per step.
    writer = metrics_lib.MetricWriter(workdir, enabled=main_process, resumed_from=start_step if resuming else None)
    writer.write(start_step, {"num_params": num_params(state), "num_devices": mesh.size, "num_steps": num_steps,
                              "precision": str(policy), **ran.record,
                              **({"peak_learning_rate": parts.peak_learning_rate} if optimizer is None else {}),
                              **flops.header(program.get("model_flops_per_step"), step_flops, peak_flops),
                              **{k: v for k, v in program.items() if k != "model_flops_per_step"},
                              **({"resumed_from": start_step} if resuming else {}),
                              **({"resume_skipped": [{"step": s, "reason": why} for s, why in resumed.skipped]}
                                 if resuming and resumed.skipped else {})})
    every = config.checkpoint.every_steps
    bar = metrics_lib.ProgressBar(num_steps, enabled=config.progress and main_process)
    watchdog = StepWatchdog(config.watchdog_seconds, rank=jax.process_index())
    trace = metrics_lib.StepTrace(os.path.join(workdir, "profile"), start_step + 1, config.profile_steps,
                                  enabled=main_process)
    # The loop moves data only explicitly (batch placement, metric reads): an implicit
    # host<->device transfer would be a hidden sync point, so the guard refuses it.
    # Leaving on an error, the checkpointer still lets its pending save commit (after the watchdog stopped).
    with writer, checkpointer or contextlib.nullcontext(), bar, watchdog, trace, jax.transfer_guard("disallow"):
        previous = None  # (step, metrics, batch record) of the step before: read once the next is dispatched
        window_start, window_steps, rate = time.perf_counter(), 0, 0.0
        preempted = preemption.requested(start_step)  # a SIGTERM during start-up: no step runs
        for step in range(start_step, start_step if preempted else num_steps):
            trace.before_step(step, state)  # --config.profile_steps: starts/stops a profiler trace
            batch = loader.batch(step)
            batch_hash = hashlib.sha256(loader.indices(step).tobytes()).hexdigest()[:16]
            data_digest = hashlib.sha256((data_digest + batch_hash).encode()).hexdigest()[:16]
            state, step_metrics = train_step(state, batch)
            window_steps += 1
            if previous is not None:
                # Wait for step - 1 (lag-1): bounds the steps in flight, which XLA:CPU
                # collectives need (docs/data_parallel.md), without starving dispatch.
                jax.block_until_ready(previous[1])
                done = previous[0]
                comm.add(previous[1])
                watchdog.tick(done)
                if loss_scaler.enabled:
                    _check_loss_scale(done, to_host(previous[1]), loss_scaler)
                if done % config.log_every == 0:
                    elapsed = time.perf_counter() - window_start
                    rate = (window_steps - 1) * config.global_batch_size / max(elapsed, 1e-9)
                    step_seconds = elapsed / max(window_steps - 1, 1)
                    record = {k: float(v) for k, v in to_host(previous[1]).items()}
                    _check_finite_loss(done, record, loss_scaler, parts.peak_learning_rate if optimizer is None else None)
                    if lr_by_step is not None:
                        record["learning_rate"] = float(lr_by_step[done - 1])
                    record.update(previous[2])
                    record.update(comm.step_record())
                    record.update(comm.record(reference_bytes))
                    writer.write(done, {**record, "examples_per_sec": rate,
                                        "examples_per_sec_per_device": rate / mesh.size,
                                        "step_time_ms": 1e3 * step_seconds,
                                        **flops.utilisation(program.get("model_flops_per_step"), step_flops,
                                                            mesh.size, step_seconds, peak_flops),
                                        "elapsed_s": time.perf_counter() - run_start})
                    bar.update(done, record["loss"], rate)
                    window_start, window_steps = time.perf_counter(), 1
            previous = (step + 1, step_metrics, {"batch_hash": batch_hash, "data_digest": data_digest})
            if config.eval_every and (step + 1) % config.eval_every == 0 and step + 1 < num_steps and test_batches:
                writer.write(step + 1, evaluate(eval_step, state, test_batches, parts.task))
            preempted = preemption.requested(step + 1)
            if checkpointer and (preempted or (every and (step + 1) % every == 0) or step + 1 == num_steps):
                with jax.transfer_guard("allow"):  # a checkpoint is an explicit copy to the host
                    checkpointer.save(step + 1, state, {"config": json.loads(config.to_json()),
                                                         "data_digest": data_digest, "workers": workers,
                                                         "user_data": user_data,
                                                         "comm": comm.saved(previous[1])})
            if preempted:
                break
        if previous is not None:
            comm.add(previous[1])
            record = {k: float(v) for k, v in to_host(previous[1]).items()}
            _check_finite_loss(previous[0], record, loss_scaler, parts.peak_learning_rate if optimizer is None else None)
            record.update(comm.step_record())
            record.update(comm.record(reference_bytes))
            if loss_scaler.enabled:
                _check_loss_scale(previous[0], record, loss_scaler)
            writer.write(previous[0], {**record, **previous[2], "elapsed_s": time.perf_counter() - run_start})
            bar.update(previous[0], record["loss"], rate)
        trace.stop()

        if checkpointer:
            checkpointer.close()  # waits for the last save; a failed save raises here
        if preempted:
            writer.write(int(to_host(state.step)), {"preempted": 1})
            saved = checkpointer is not None and checkpointer.latest_step() == int(to_host(state.step))
            return TrainResult(state=state, metrics={}, workdir=workdir, preempted=True, saved=saved)

        # --------------------------------------------------------------- evaluate
        final = evaluate(eval_step, state, test_batches, parts.task) if test_batches else {}
        if final:
            writer.write(num_steps, final)
    return TrainResult(state=state, metrics=final, workdir=workdir)


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
    strategy = strategies.make_strategy(config.strategy.name, **_settings(config.strategy))
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


@dataclasses.dataclass
class CommTotals:
    """Bytes and message rounds one worker sent since step 0, summed on the host step by step
    (strategies communicate on some steps only, so one step's figure is not the rate)."""

    steps: int = 0
    bytes: float = 0.0
    rounds: float = 0.0
    # (bytes, rounds) of every step when they are the compiled program's (jit driver), not the step's
    fixed: tuple[float, float] | None = dataclasses.field(default=None, compare=False)

    def add(self, metrics: dict) -> None:
        if self.fixed is not None or "comm_bytes" in metrics:
            sent = self.fixed or to_host((metrics["comm_bytes"], metrics["comm_rounds"]))  # one transfer a step
            self.steps += 1
            self.bytes += float(sent[0])
            self.rounds += float(sent[1])

    def record(self, reference_bytes: int) -> dict:
        """``comm_bytes_per_step`` (mean so far) and ``comm_ratio``: float32 ring allreduce bytes ÷ bytes sent."""
        if not self.steps:
            return {}
        per_step = self.bytes / self.steps
        out = {"comm_bytes_total": self.bytes, "comm_bytes_per_step": per_step,
               "comm_rounds_per_step": self.rounds / self.steps}
        if per_step:
            out["comm_ratio"] = reference_bytes / per_step
        return out

    def saved(self, pending: dict | None) -> dict:
        """The totals as of the state being checkpointed (including the step still in flight)."""
        totals = dataclasses.replace(self)
        if pending is not None:
            totals.add(pending)
        return {"steps": totals.steps, "bytes": totals.bytes, "rounds": totals.rounds}

    def step_record(self) -> dict:
        """``comm_bytes``/``comm_rounds`` of each step when they are the compiled program's."""
        return {} if self.fixed is None else {"comm_bytes": self.fixed[0], "comm_rounds": self.fixed[1]}


def _compiled_step(train_step, state: TrainState, batch):
    """The step's executable; lowering and compiling here fills the cache its first call uses."""
    return train_step.lower(state, batch).compile()


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
    return [(jax.tree_util.keystr(path, simple=True, separator="/"), sharding)
            for path, sharding in jax.tree_util.tree_leaves_with_path(params)]


def evaluate(eval_step: EvalStep, state: TrainState, batches, task: tasks_lib.Task | None = None) -> dict:
    """Exact test metrics: integer counts and float64 sums over every real example (and, for sequences,
    every scored token): ``test_loss``, ``test_<metric>``, ``test_examples`` and the task's own
    (:func:`dtx.tasks.summarize`; ``task`` default classification)."""
    return tasks_lib.summarize([to_host(eval_step(state, batch)) for batch in batches], task)


def _settings(block: ConfigDict) -> dict:
    """A technique's config block without its ``name``: the keyword arguments of its factory."""
    return {k: v for k, v in block.to_dict().items() if k != "name"}


def _check_workers(saved: dict, workers: int, abstract_state: TrainState) -> None:
    """Per-worker state (residuals, local models) has one entry per worker: the count must match."""
    if jax.tree.leaves(abstract_state.worker) and saved.get("workers", workers) != workers:
        raise config_lib.ConfigError(
            f"cannot resume: the checkpoint holds per-worker state for {saved['workers']} data-parallel workers "
            f"(compression residuals or local models) but this mesh has {workers}; resume on "
            f"{saved['workers']} workers, or train into a new --workdir")


def _loss_scaler(settings: ConfigDict, policy: precision.Policy) -> precision.LossScaler:
    enabled = settings.name == "dynamic" or (settings.name == "auto" and policy.needs_loss_scaling)
    return precision.LossScaler(enabled=enabled, initial_scale=settings.initial,
                                growth_interval=settings.growth_interval, backoff=settings.backoff,
                                min_scale=settings.min_scale)


def _check_finite_loss(step: int, record: dict, scaler: precision.LossScaler, peak_lr) -> None:
    """A non-finite loss without loss scaling is divergence: stop now, naming the step, rather than train
    NaNs to the end (with loss scaling such a step is skipped and the scale backs off instead)."""
    loss = record.get("loss")
    if scaler.enabled or loss is None or math.isfinite(loss):
        return
    rate = f" (the peak rate is {peak_lr:g})" if peak_lr is not None else ""
    raise FloatingPointError(
        f"step {step}: the training loss is {loss} — the run diverged. Lower optimizer.learning_rate{rate}, add "
        "warmup (optimizer.warmup_steps) or gradient clipping, or check the inputs for NaN/inf. Checkpoints "
        "already committed are kept; this run's state is not saved.")


def _check_loss_scale(step: int, metrics: dict, scaler: precision.LossScaler) -> None:
    """Non-finite gradients at the minimum scale are divergence, not float16 overflow: stop."""
    if metrics["skipped"] and float(metrics["loss_scale"]) <= scaler.min_scale:
        raise FloatingPointError(
            f"step {step}: gradients are non-finite even at the minimum loss scale "
            f"(loss_scale.min_scale={scaler.min_scale}); the run diverged (NaN/inf in the loss or the data) "
            "rather than overflowing float16. Lower optimizer.learning_rate, check the inputs, or use "
            "compute=bfloat16. The parameters were left at their last finite values."
        )


def _decide_resume(mode: str, checkpoint_dir: str, workdir: str, step: int = 0) -> bool:
    """Whether to resume; refuses anything that would overwrite or mix runs, before any work."""
    steps = sorted(int(n) for n in os.listdir(checkpoint_dir) if n.isdigit()) if os.path.isdir(checkpoint_dir) else []
    has_checkpoint = bool(steps)
    if step and step not in steps:
        raise FileNotFoundError(f"checkpoint.resume_step={step} but {checkpoint_dir} holds no step {step} "
                                f"(it holds {steps or 'none'}); choose one of them, or 0 for the newest that verifies")
    if mode == "must" and not has_checkpoint:
        raise FileNotFoundError(f"checkpoint.resume=must but {checkpoint_dir} holds no checkpoint")
    if mode == "never" and has_checkpoint:
        raise FileExistsError(f"checkpoint.resume=never but {checkpoint_dir} already holds checkpoints; "
                              "choose another --workdir (dtx never overwrites a run)")
    resuming = has_checkpoint and mode != "never"
    if not resuming and mode != "must" and _interrupted_before_first_commit(checkpoint_dir, workdir):
        return False
    if not resuming and os.path.exists(os.path.join(workdir, metrics_lib.METRICS_FILE)):
        raise FileExistsError(
            f"workdir {workdir!r} already holds a run ({metrics_lib.METRICS_FILE}) and no checkpoint to resume; "
            "choose another --workdir or move that run away (dtx never overwrites records)"
        )
    return resuming


def _interrupted_before_first_commit(checkpoint_dir: str, workdir: str) -> bool:
    """A checkpointing run stopped before its first checkpoint committed left records but nothing to resume.

    Its checkpoint directory exists (created before training starts) but holds no committed step. Nothing of
    it can be resumed, so the run starts over; its records are moved into ``WORKDIR/interrupted-<n>/``,
    never deleted. A workdir whose run never checkpointed is still refused (that run may have finished).
    """
    records = os.path.join(workdir, metrics_lib.METRICS_FILE)
    if not (os.path.exists(records) and os.path.isdir(checkpoint_dir)):
        return False
    if any(n.isdigit() for n in os.listdir(checkpoint_dir)):
        return False
    if jax.process_index() == 0:
        n = 1 + sum(1 for name in os.listdir(workdir) if name.startswith("interrupted-"))
        aside = os.path.join(workdir, f"interrupted-{n}")
        os.makedirs(aside)
        for name in os.listdir(workdir):
            if name == metrics_lib.METRICS_FILE or name == "config.json" or name.startswith("events.out.tfevents"):
                os.replace(os.path.join(workdir, name), os.path.join(aside, name))
        print(f"dtx: {workdir} holds a run interrupted before its first checkpoint committed; starting over "
              f"(its records are in {aside})", file=sys.stderr)
    return True


def _hmac_key(variable: str) -> bytes | None:
    """The manifests' HMAC key, from the environment variable ``checkpoint.hmac_key_env`` names (never the config,
    which is saved in every checkpoint and config.json)."""
    if not variable:
        return None
    value = os.environ.get(variable, "")
    if not value:
        raise config_lib.ConfigError(
            f"checkpoint.hmac_key_env={variable!r} but the environment variable {variable} is unset or empty; "
            f"export it in every process (e.g. {variable}=$(openssl rand -hex 32)) or set checkpoint.hmac_key_env=''")
    return value.encode()


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _check_same_config(config: ConfigDict) -> None:
    """Every process must run the same experiment; a mismatch would silently train nonsense."""
    from jax.experimental import multihost_utils

    digest = np.frombuffer(hashlib.sha256(config.to_json().encode()).digest()[:4], np.int32)  # x64 is off
    multihost_utils.assert_equal(
        digest, f"process {jax.process_index()}: config differs between processes (compare their config.json); "
        "every process must be started with the same experiment and overrides")


def _check_shared_directory(directory: str) -> None:
    """Checkpoints need one directory that every process sees (a shared file system)."""
    token = os.path.join(directory, ".dtx-shared-check")
    if jax.process_index() == 0:
        os.makedirs(directory, exist_ok=True)
        with open(token, "w") as f:
            f.write(str(os.getpid()))
    _barrier("dtx: shared-directory token written")
    if not os.path.exists(token):
        raise FileNotFoundError(
            f"process {jax.process_index()} cannot see {directory} written by process 0: the checkpoint "
            "directory must be on storage shared by every process (set --config.checkpoint.dir)")
    _barrier("dtx: shared-directory token checked")


# Keys a resumed run may change: run length, logging, checkpointing and how (not what) it computes.
_RESUME_MAY_CHANGE = ("num_steps", "num_epochs", "checkpoint", "progress", "log_every", "eval_every",
                      "eval_batch_size", "watchdog_seconds", "emulate_cpu_devices", "mesh", "driver",
                      "distributed", "allreduce", "bucket_bytes", "parallel", "profile_steps", "peak_flops",
                      "log_grad_norm")


def _check_resumable(saved: dict, config: ConfigDict) -> None:
    """Refuse to resume a checkpoint under settings that change what its state means (data order,
    model, optimizer, precision): the run would silently stop being the run that was saved."""
    current = json.loads(config.to_json())  # the saved copy went through JSON too (tuples -> lists)
    changed = sorted(k for k in set(saved) | set(current)
                     if k not in _RESUME_MAY_CHANGE and saved.get(k) != current.get(k))
    if saved and changed:
        raise config_lib.ConfigError(
            f"cannot resume: {', '.join(changed)} differ from the checkpointed run's config; set them back "
            "or train into a new --workdir (only run length, logging, checkpointing, mesh, driver and "
            "allreduce may change on resume)")
