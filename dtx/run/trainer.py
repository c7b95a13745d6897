"""One training run, told top to bottom: set-up, the loop, evaluation.

The config is read here and in :mod:`dtx.run.setup` (what a run is built from) and :mod:`dtx.run.rundir`
(resume or refuse); everything below receives plain values and built collaborators. The loop's
records, one step behind the dispatch, are :mod:`dtx.run.steplog`'s.

**Record steps.** The loop reads a step's loss and metrics only for a record: every ``log_every``-th
step and the last (:func:`record_step`). Evaluations and checkpoints read the state, and every step's
traffic, which each step reports. So the steps in between run the program built with
``StepSpec(record=False)``: for workers with their own models (gossip, local SGD, DiLoCo, EASGD) it
holds no all-reduce of the averages (:func:`dtx.step.body.records_collective`), and between records
gossip talks to its neighbours only. The parameters are the same either way. A preempted run's last
record is of the step it stopped at: without ``loss`` when that step was not a record step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import sys
import time
from typing import NamedTuple

import flax.linen as nn
import jax
import numpy as np
import optax
from ml_collections import ConfigDict

from dtx.ckpt import barrier as barrier_lib
from dtx.ckpt import checkpoint as checkpoint_lib
from dtx import config as config_lib
from dtx import mesh as mesh_lib
from dtx import xla_cache
from dtx.run import metrics as metrics_lib
from dtx.run import elastic, preflight, rundir, setup, steplog
from dtx.perf import simclock
from dtx.data import tasks as tasks_lib
from dtx.data import userdata
from dtx.comm import costmodel
from dtx.perf import flops
from dtx.data.loader import TrainLoader, eval_batches
from dtx.run.metrics import to_host
from dtx.run.setup import Parts
from dtx.step.state import TrainState, num_params
from dtx.step import EvalStep, get_driver, make_train_step
from dtx.step import body as step_body
from dtx.ckpt.preemption import PreemptionWatcher
from dtx.run.lock import WorkdirLock
from dtx.run.watchdog import StepWatchdog
from dtx.run.progress import Progress


@dataclasses.dataclass
class TrainResult:
    """What a run leaves behind: its final state and its final evaluation."""

    state: TrainState
    metrics: dict
    workdir: str
    preempted: bool = False  # stopped by SIGTERM at a step boundary; run again to resume
    saved: bool = False  # a checkpoint holds the returned state (preempted runs: resume continues from it)


__all__ = ["TrainResult", "evaluate", "train"]


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
      task: the loss and metrics (:mod:`dtx.data.tasks`) instead of the ones ``config.task`` names.
      data: your arrays instead of ``config.dataset``: ``(inputs, labels)``, ``{"train": ...,
        "test": ...}``, :class:`dtx.data.datasets.Split` or :class:`dtx.data.datasets.Dataset`, in memory or
        memory-mapped (:mod:`dtx.data.userdata`); without a test split nothing is evaluated.

    Raises before any compilation on bad input (unknown names, batch sizes that do
    not split over the mesh, missing dataset files, a workdir that already holds a run);
    :class:`dtx.run.lock.WorkdirInUse` (a ``FileExistsError``) when another live run holds ``workdir``.
    """
    config_lib.validate(config)
    run_start = time.perf_counter()
    workdir = os.fspath(workdir)
    checkpoint_dir = config.checkpoint.dir or os.path.join(workdir, "checkpoints")
    rundir.check_paths(workdir, checkpoint_dir)
    if config.emulate_cpu_devices:
        mesh_lib.emulate_cpu_devices(config.emulate_cpu_devices)
    xla_cache.enable(config.compilation_cache)  # a second launch loads its programs instead of compiling
    progress = Progress.from_env(int(os.environ.get(mesh_lib.ENV_PROCESS_ID, "0")),  # dtx launch reads it
                                 {"watchdog_seconds": config.watchdog_seconds, "startup_seconds": config.startup_seconds})
    progress.mark("started")
    multi_process = mesh_lib.initialize_distributed(config.distributed, config.heartbeat_seconds,
                                                    config.startup_seconds)
    progress.mark("initialized")
    # SIGTERM from here on -- start-up included, where loading and compiling take seconds --
    # stops the run at a step boundary instead of killing it. Several processes agree on the
    # step through JAX's preemption sync point, which needs checkpoints to be worth it.
    watch = not multi_process or bool(config.checkpoint.every_steps) or config.checkpoint.resume != "never"
    # One run per workdir (dtx.run.lock): a second one is refused here, before it writes anything; and per
    # checkpoint.dir, where it lies outside the workdir (two workdirs could share it).
    holder = not multi_process or jax.process_index() == 0
    outside = os.path.relpath(os.path.abspath(checkpoint_dir), os.path.abspath(workdir)).startswith(os.pardir)
    with WorkdirLock(workdir, enabled=holder), \
            WorkdirLock(checkpoint_dir, what="checkpoint.dir", enabled=holder and outside and (
                bool(config.checkpoint.every_steps) or os.path.isdir(checkpoint_dir))), \
            PreemptionWatcher(enabled=watch, multi_process=multi_process) as preemption:
        return _train(config, workdir, checkpoint_dir, multi_process, preemption, run_start, progress,
                      model=model, optimizer=optimizer, optimizer_description=optimizer_description,
                      task=task, data=data)


def _train(config: ConfigDict, workdir: str, checkpoint_dir: str, multi_process: bool,
           preemption: PreemptionWatcher, run_start: float, progress: Progress, **given) -> TrainResult:
    with xla_cache.CompileClock() as compiling:  # JAX's own timings of start-up, for the first record
        run = _start(config, workdir, checkpoint_dir, multi_process, run_start, compiling=compiling, **given)
    state, data_digest, every, log = run.state, run.data_digest, config.checkpoint.every_steps, run.log
    progress.mark("compiled", run.start_step)
    watchdog = StepWatchdog(config.watchdog_seconds, rank=jax.process_index(), progress=progress)
    log.watchdog = watchdog  # ticked as each step is seen done: arms it, and marks the step's progress
    trace = metrics_lib.StepTrace(os.path.join(workdir, "profile"), run.start_step + 1, config.profile_steps,
                                  enabled=jax.process_index() == 0)
    # The loop moves data only explicitly (batch placement, metric reads): an implicit
    # host<->device transfer would be a hidden sync point, so the guard refuses it.
    # Leaving on an error, the checkpointer still lets its pending save commit (after the watchdog stopped).
    with run.writer, run.checkpointer or contextlib.nullcontext(), log, watchdog, trace, jax.transfer_guard("disallow"):
        preempted = preemption.requested(run.start_step)  # a SIGTERM during start-up: no step runs
        for step in range(run.start_step, run.start_step if preempted else run.num_steps):
            trace.before_step(step, state)  # --config.profile_steps: starts/stops a profiler trace
            batch = run.loader.batch(step)
            # A chained hash of every batch's indices so far: equal logs prove no batch was repeated or skipped.
            batch_hash = hashlib.sha256(run.loader.indices(step).tobytes()).hexdigest()[:16]
            data_digest = hashlib.sha256((data_digest + batch_hash).encode()).hexdigest()[:16]
            step_fn = run.train_step if record_step(step, config.log_every, run.num_steps) else run.quiet_step
            state, step_metrics = step_fn(state, batch)
            # Waits for the step before (lag-1), reads it once, records it every log_every steps.
            log.dispatched(step + 1, step_metrics, {"batch_hash": batch_hash, "data_digest": data_digest})
            if config.eval_every and (step + 1) % config.eval_every == 0 and step + 1 < run.num_steps and run.tests:
                run.writer.write(step + 1, watched_evaluation(run, state, watchdog, config, step + 1))
            preempted = preemption.requested(step + 1)
            if run.checkpointer and (preempted or (every and (step + 1) % every == 0) or step + 1 == run.num_steps):
                started = time.perf_counter()
                with watchdog.paused():  # every rank arrives first: bounded by itself, it names a rank that never does
                    run.checkpointer.arrive(step + 1)
                with jax.transfer_guard("allow"):  # a checkpoint is an explicit copy to the host
                    run.checkpointer.save(step + 1, state, {"config": json.loads(config.to_json()),
                                                             "data_digest": data_digest, "workers": run.parts.workers,
                                                             "user_data": run.user_data, "comm": log.comm_saved(),
                                                             **({"clock": run.clock.saved()} if run.clock else {})})
                run.saves.saved(step + 1, started)  # the record whose window holds the save says so
                if not preempted and step + 1 < run.num_steps:  # (those two are flushed below, whatever log_every)
                    log.settle()  # the step's record now, not after a next step that may never come
            if preempted:
                break
        log.flush()  # the last step, whatever log_every says
        trace.stop()

        if run.checkpointer:
            with watchdog.paused():  # bounded by the checkpointer's own timeout
                run.checkpointer.close()  # waits for the last save; a failed save raises here
        if preempted:
            run.writer.write(int(to_host(state.step)), {"preempted": 1})
            saved = run.checkpointer is not None and run.checkpointer.latest_step() == int(to_host(state.step))
            return TrainResult(state=state, metrics={}, workdir=workdir, preempted=True, saved=saved)

        final = watched_evaluation(run, state, watchdog, config, run.num_steps) if run.tests else {}
        # A finished run started again resumes its last checkpoint and runs no step: its records already hold
        # this evaluation (the resume kept the records up to its step), so it is returned, not recorded twice.
        # Every rank still evaluates (its collectives need them all); only the record is left out.
        if final and run.start_step == run.num_steps and run.writer.holds(run.num_steps, final):
            if jax.process_index() == 0:
                print(f"dtx: the run in {workdir} had already finished at step {run.num_steps}; its final "
                      "evaluation is recorded already", file=sys.stderr, flush=True)
        elif final:
            run.writer.write(run.num_steps, final)
    return TrainResult(state=state, metrics=final, workdir=workdir)


def watched_evaluation(run: _Run, state: TrainState, watchdog, config: ConfigDict, step: int) -> dict:
    """:func:`evaluate`, every wait of it bounded: the ranks arrive first and the first batch (whose call may
    compile the evaluation step, for longer than ``watchdog_seconds``) runs with the step watchdog paused; each
    further batch is watched as a step is, so a rank stuck inside an evaluation is caught too."""
    with watchdog.paused():
        arrive_at_evaluation(config, step)
        batches = iter(run.tests)
        first = next(batches, None)
        results = [] if first is None else [to_host(run.eval_step(state, first))]
    for batch in batches:
        results.append(to_host(run.eval_step(state, batch)))
        watchdog.alive()
    return tasks_lib.summarize(results, run.parts.task)


def arrive_at_evaluation(config: ConfigDict, step: int) -> None:
    """Every rank arrives before an evaluation's collectives start (bounded as a save's arrival,
    :func:`dtx.run.rundir.barrier_seconds`): the step watchdog is paused there, so a rank asleep or stuck before
    the evaluation would otherwise hold the others in its first collective with nothing to name it."""
    barrier_lib.wait(f"the evaluation after step {step}", rundir.barrier_seconds(config))


class _Run(NamedTuple):
    """What the loop needs, built before its first step by :func:`_start`."""

    parts: Parts
    loader: TrainLoader
    num_steps: int
    train_step: object  # the record steps' program (record_step)
    eval_step: EvalStep
    tests: list | None  # the test split's batches (None: nothing to evaluate)
    checkpointer: checkpoint_lib.Checkpointer | None
    state: TrainState
    start_step: int
    data_digest: str
    user_data: str | None  # the fingerprint of train(..., data=); a resume checks it
    writer: metrics_lib.MetricWriter
    log: steplog.StepLog
    clock: simclock.Recorder | None = None  # --config.cluster: sim_time_s in the records
    quiet_step: object = None  # the other steps' program (StepSpec(record=False)), or train_step itself
    saves: metrics_lib.CheckpointMarks | None = None  # checkpoint_saved in the records


def record_step(step: int, log_every: int, num_steps: int) -> bool:
    """Whether the loop records step ``step`` (0-based): every ``log_every``-th, and the last
    (:class:`dtx.run.steplog.StepLog` reads every step's traffic, these steps' metrics)."""
    return (step + 1) % log_every == 0 or step + 1 == num_steps


def _start(config: ConfigDict, workdir: str, checkpoint_dir: str, multi_process: bool, run_start: float, *,
           model, optimizer, optimizer_description=None, task=None, data=None,
           compiling: xla_cache.CompileClock | None = None) -> _Run:
    """Devices, the run directory, data, parts, steps and state (fresh or resumed), and the first record."""
    mesh = setup.make_mesh(config)
    resuming, hmac_key = rundir.prepare(config, workdir, checkpoint_dir, multi_process)
    inputs = setup.load_data(config, mesh, task=task, data=data)
    dataset, loader, num_steps = inputs.dataset, inputs.loader, inputs.num_steps
    user_data = userdata.fingerprint(dataset) if data is not None else None  # the caller's arrays: a resume checks them
    # Dropped examples, a warmup as long as the run, config keys an argument replaces: said before any work.
    preflight.warn(config, train_size=loader.size, data_parallel=mesh_lib.data_parallel_size(mesh),
                   num_steps=num_steps, model=model, optimizer=optimizer, data_given=data is not None,
                   task_given=task is not None)
    parts = setup.build_parts(config, mesh, dataset, loader.steps_per_epoch, num_steps, model=model,
                              optimizer=optimizer, task=inputs.task)
    ran = preflight.what_ran(config, parts.model, model_given=model is not None, optimizer_given=optimizer is not None,
                             optimizer=optimizer, optimizer_description=optimizer_description, train_size=loader.size,
                             task_name=inputs.task.name, task_given=task is not None, data_fingerprint=user_data,
                             data_description=userdata.describe(dataset) if data is not None else None)
    # The rate each step uses, for the records (computed once: the loop allows no implicit transfers).
    lr_by_step = (np.asarray(jax.jit(jax.vmap(parts.learning_rate))(np.arange(num_steps)))
                  if optimizer is None else None)
    train_step = setup.make_step(config, parts, mesh)
    quiet_step = train_step
    if step_body.records_collective(parts.strategy):  # a program without the records' all-reduce
        quiet_step = make_train_step(parts.model, parts.tx, mesh, setup.step_spec(config, parts).replace(record=False))
    eval_step = setup.make_eval(config, parts, mesh)
    checkpointer = None
    if config.checkpoint.every_steps or resuming:
        checkpointer = checkpoint_lib.Checkpointer(checkpoint_dir, keep=config.checkpoint.keep,
                                                   async_save=config.checkpoint.async_save, hmac_key=hmac_key,
                                                   barrier_s=rundir.barrier_seconds(config))
    resumed = rundir.resume(checkpointer, config, parts.abstract_state, parts.placement.state, parts.workers,
                            user_data, setup.relayout(parts, mesh)) if resuming else None
    state = resumed.state if resuming else setup.init_state(config, parts, mesh)
    saved = resumed.metadata if resuming else {}
    # --config.cluster: every record's sim_time_s, the run's modelled time on that cluster (dtx.perf.simclock)
    # the example's own dtype: a token model takes integer ids (the clock only traces shapes)
    clock = setup.clock_recorder(config, parts, saved.get("clock"))
    start_step = int(to_host(state.step))
    if resuming and jax.process_index() == 0:
        print(f"dtx: resumed from step {start_step} ({checkpoint_dir})", file=sys.stderr, flush=True)
    tests = (eval_batches(dataset.test, config.eval_batch_size, mesh, config.eval_batches)
             if dataset.test is not None else None)
    # What the compiled step does, read once from the program the loop's first call reuses:
    # FLOPs per device and the bytes its collectives send (dtx.comm.hlo); beside them, what the
    # model predicts: the useful FLOPs and, for Dense/Conv layouts, the bytes (dtx.perf.model).
    compiled = setup.compile_step(train_step, state, loader.batch(start_step))
    if quiet_step is not train_step:  # most steps run this one: its figures are the run's per step
        compiled = setup.compile_step(quiet_step, state, loader.batch(start_step))
    step_flops = setup.step_flops(config, compiled)
    program = {} if compiled is None else setup.program_figures(compiled, parts.model, parts, mesh,
                                                                config.global_batch_size)
    peak_flops = flops.device_peak_flops(parts.policy.compute, config.peak_flops)
    comm = steplog.CommTotals(**saved.get("comm", {}))
    if not get_driver(config.driver).explicit:  # XLA placed the collectives: their bytes are the compiled program's
        comm.fixed = (program.get("comm_bytes_compiled_per_step", 0.0), program.get("comm_rounds_compiled_per_step", 0.0))

    main_process = jax.process_index() == 0
    if main_process:
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(ran.config, f, indent=2)  # the config, naming the module/optimizer that replaced its blocks
    # Who this start runs on (dtx.run.elastic; dtx plot marks it): read before the resume drops any record.
    membership = elastic.record(dict(mesh.shape), config.grad_accum_steps, start_step,
                                processes=jax.process_count(), workdir=workdir)
    # A resume drops the records past its step (a killed run's abandoned future): one history per step.
    writer = metrics_lib.MetricWriter(workdir, enabled=main_process, resumed_from=start_step if resuming else None,
                                      wandb=config.wandb.to_dict(), run_config=ran.config)
    writer.write(start_step, {"num_params": num_params(state), "num_devices": mesh.size, "num_steps": num_steps,
                              "precision": str(parts.policy), **ran.record,
                              **({"peak_learning_rate": parts.peak_learning_rate} if optimizer is None else {}),
                              **flops.header(program.get("model_flops_per_step"), step_flops, peak_flops),
                              **{k: v for k, v in program.items() if k != "model_flops_per_step"},
                              **({"resumed_from": start_step} if resuming else {}),
                              **membership,
                              **(compiling.record("startup_") if compiling else {}),
                              **({"resume_skipped": [{"step": s, "reason": why} for s, why in resumed.skipped]}
                                 if resuming and resumed.skipped else {})})
    saves = metrics_lib.CheckpointMarks()
    log = steplog.StepLog(
        writer, log_every=config.log_every, global_batch_size=config.global_batch_size, num_devices=mesh.size,
        comm=comm, learning_rates=lr_by_step, loss_scaler=parts.loss_scaler,
        # The yardstick of every communication figure: a float32 ring allreduce of the gradients.
        reference_bytes=costmodel.dense_allreduce_traffic(parts.abstract_state.params, parts.workers, "ring",
                                                          "float32").bytes_sent,
        utilisation=lambda seconds: flops.utilisation(program.get("model_flops_per_step"), step_flops, mesh.size,
                                                      seconds, peak_flops),
        peak_learning_rate=parts.peak_learning_rate if optimizer is None else None,
        # a sequence task's examples hold a label per position: its rate in tokens/s too
        bar=metrics_lib.ProgressBar(num_steps, enabled=config.progress and main_process,
                                    tokens=int(np.prod(dataset.train.labels.shape[1:]))), run_start=run_start,
        extras=((clock,) if clock else ()) + (saves,))
    return _Run(parts, loader, num_steps, train_step, eval_step, tests, checkpointer, state, start_step,
                saved.get("data_digest", ""), user_data, writer, log, clock, quiet_step, saves)


def evaluate(eval_step: EvalStep, state: TrainState, batches, task: tasks_lib.Task | None = None) -> dict:
    """Exact test metrics: integer counts and float64 sums over every real example (and, for sequences,
    every scored token): ``test_loss``, ``test_<metric>``, ``test_examples`` and the task's own
    (:func:`dtx.data.tasks.summarize`; ``task`` default classification)."""
    return tasks_lib.summarize([to_host(eval_step(state, batch)) for batch in batches], task)
