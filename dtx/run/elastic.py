"""Elastic restarts: which processes a job goes on with after losing some, and the record each restart leaves.

``dtx launch --elastic MIN`` (:mod:`dtx.tools.launch`) restarts a job that lost a process on the processes it
still has. JAX cannot change a running job's process count, so the job stops and starts again: the newest
checkpoint that verifies is restored onto the new mesh (:mod:`dtx.ckpt`), and because batches are a function of
``(seed, step)`` the restarted job continues the *same* run. The global batch, the learning-rate schedule and the
data order do not change; gradient accumulation makes up for the missing devices: each device runs more
micro-batches of the same size (Goyal et al. 2017, "Accurate, Large Minibatch SGD", §2: the update depends on
the global batch, not on how it is split). The mean gradient is the same sum of the same per-example terms, only
added in another order, so parameters agree with an uninterrupted run within float reassociation.

:func:`plan` chooses the processes and ``grad_accum_steps``; :func:`record` is the ``membership`` entry rank 0
writes in the first record of every start (``dtx plot`` marks it).
"""

from __future__ import annotations

import json
import math
import os
from typing import Callable, NamedTuple

ENV = "DTX_MEMBERSHIP"  # set by dtx launch --elastic for every rank: this start's membership (JSON)


class ElasticError(ValueError):
    """An elastic setting that cannot work, or a job that cannot go on (names the setting and the fix)."""


class Plan(NamedTuple):
    """How a (re)started job runs: ``processes`` of the ones available, with ``grad_accum_steps``."""

    processes: int
    devices: int  # processes x devices per process: the mesh's size
    data_parallel: int  # devices over the batch axes
    grad_accum_steps: int


def micro_batch(global_batch: int, data_parallel: int, accum: int) -> int:
    """Examples per device per micro-batch: what every start keeps (same memory, same numerics per pass)."""
    return global_batch // (data_parallel * accum)


def fixed_axes(mesh) -> int:
    """The product of ``mesh``'s fixed axis sizes; the one ``-1`` axis takes the rest (refused otherwise)."""
    sizes = [int(size) for _, size in mesh]
    if sizes.count(-1) != 1:
        raise ElasticError(
            f"--elastic needs config.mesh with exactly one axis of size -1 (the one that shrinks), e.g. "
            f"(('data', -1),); got mesh={tuple(tuple(a) for a in mesh)!r}")
    return math.prod(s for s in sizes if s != -1)


def plan(available: int, devices_per_process: int, *, global_batch: int, grad_accum_steps: int,
         data_parallel: int, fixed: int = 1, model_axis: int = 1, eval_batch: int | None = None) -> Plan:
    """The largest job on at most ``available`` processes whose batch axes split the global batch into the
    original run's micro-batches, and whose devices split ``eval_batch`` (the test batches are split over every
    device, :func:`dtx.mesh.check_batch_size`).

    ``data_parallel`` x ``grad_accum_steps`` micro-batches of ``micro_batch(...)`` examples make the global batch
    at the first start; a start on ``d`` data-parallel devices runs ``data_parallel·grad_accum_steps / d`` of them
    per device, so ``d`` must divide that product. ``fixed``: the product of the mesh's fixed axes (a ``model`` or
    ``stage`` axis keeps its size); ``model_axis``: the part of it that does not split the batch.
    """
    total = data_parallel * grad_accum_steps
    for processes in range(available, 0, -1):
        devices = processes * devices_per_process
        if devices % fixed or (eval_batch is not None and eval_batch % devices):
            continue
        parallel = devices // model_axis
        if total % parallel == 0:
            return Plan(processes, devices, parallel, total // parallel)
    raise ElasticError(
        f"no job on {available} or fewer processes x {devices_per_process} devices splits global_batch_size="
        f"{global_batch} into micro-batches of {micro_batch(global_batch, data_parallel, grad_accum_steps)}"
        + (f" and eval_batch_size={eval_batch} over its devices; set --config.eval_batch_size to a multiple of "
           f"every device count a restart may run on (e.g. {_multiple(available, devices_per_process)})"
           if eval_batch is not None else ""))


def _multiple(processes: int, devices_per_process: int) -> int:
    return math.lcm(*(n * devices_per_process for n in range(1, processes + 1)))


def available(slots: int, lost: int, replacements: int, processes: int) -> int:
    """Processes the next start may use: the job's ``slots`` (running, or set aside because the mesh could not
    use them: they rejoin now) less the ``lost``, plus announced ``replacements``, at most ``processes``."""
    return min(processes, slots - lost + replacements)


class Settings(NamedTuple):
    """An elastic job's first start, and how it starts on ``n`` available processes (``plan(n)``)."""

    start: Plan
    plan: Callable[[int], Plan]


def settings(experiment: str, overrides: list[str], processes: int, devices_per_process: int,
             minimum: int = 1) -> Settings:
    """What ``--elastic`` needs from the experiment (its global batch, accumulation and mesh), refused before any
    process starts when it cannot work (:class:`ElasticError`, or the config's own error)."""
    from dtx import config as config_lib
    from dtx import mesh as mesh_lib

    config = config_lib.load(experiment, overrides)
    if not config.checkpoint.every_steps:
        raise ElasticError("--elastic restarts from the newest checkpoint, and checkpoint.every_steps=0 saves none; "
                           "set --config.checkpoint.every_steps=N")
    fixed = fixed_axes(config.mesh)
    model_axis = next((int(s) for n, s in config.mesh if n == mesh_lib.MODEL_AXIS and int(s) != -1), 1)
    devices = processes * devices_per_process
    if devices % fixed:
        raise ElasticError(f"mesh={config.mesh!r}: its fixed axes ({fixed} devices) do not divide {devices} devices")

    def on(available: int) -> Plan:
        return plan(available, devices_per_process, global_batch=config.global_batch_size,
                    grad_accum_steps=config.grad_accum_steps, data_parallel=devices // model_axis, fixed=fixed,
                    model_axis=model_axis, eval_batch=config.eval_batch_size)

    try:
        start = on(processes)
    except ElasticError as e:
        raise ElasticError(f"the first start on {processes} processes would find no mesh: {e}") from None
    if start.processes < processes:  # the job the user asked for does not split its own batches
        keys = [f"{key}={config[key]}" for key in ("global_batch_size", "eval_batch_size") if config[key] % devices]
        raise ElasticError(
            f"the first start on {processes} processes x {devices_per_process} devices: {' and '.join(keys)} does not "
            f"split over its {devices} devices; set --config.{keys[0].split('=')[0]} to a multiple of every device "
            f"count a restart may run on (e.g. {_multiple(processes, devices_per_process)})")
    for left in range(processes - 1, minimum - 1, -1):  # every restart --elastic allows has a mesh, or none starts
        try:
            on(left)
        except ElasticError as e:
            raise ElasticError(f"--elastic {minimum}: a restart on {left} processes would find no mesh: {e}") from None
    check_same_run(config)
    return Settings(start, on)


def check_same_run(config) -> None:
    """Refuse what a restart on another mesh would not continue as the same run, before any process starts:
    state kept per data-parallel worker (what the strategy's and the compressor's ``init`` declare: local models,
    error-feedback residuals) has one entry per worker, and batch-norm statistics (the model's variables besides
    its parameters) are taken over each micro-batch's examples on all devices, which a mesh change regroups."""
    import jax

    from dtx import compress, models, optim, precision, strategies
    from dtx import config as config_lib
    from dtx.data import inputs
    from dtx.run import setup
    from dtx.step.state import abstract_train_state

    def plug_ins(strategy_name: str, compression_name: str, **compression):
        strategy = strategies.make_strategy(strategy_name, stragglers=setup.stragglers(config), **(
            config_lib.chosen_settings(config.strategy, strategies.strategy_settings())
            if strategy_name == config.strategy.name else {}))
        compressor = compress.make_compressor(compression_name, **{**(
            config_lib.chosen_settings(config.compression, compress.compressor_settings())
            if compression_name == config.compression.name else {}), **compression})
        return strategy, compressor

    dataset = inputs.load_dataset(config.dataset, seed=config.seed)
    policy = precision.parse_policy(config.precision)
    model = models.build_model(config.model.name, num_classes=dataset.num_classes, dtype=policy.compute,
                               param_dtype=policy.params, remat=config.remat.policy,
                               **{k: v for k, v in config.model.items() if k != "name"})
    tx = optim.make_optimizer(config.optimizer.name, config.optimizer.learning_rate,
                              momentum=config.optimizer.momentum, weight_decay=config.optimizer.weight_decay,
                              exclude=config.optimizer.exclude, trust_coefficient=config.optimizer.trust_coefficient)
    example = jax.ShapeDtypeStruct(dataset.train.inputs.shape, dataset.train.inputs.dtype)

    def worker_state(strategy, compressor) -> dict:
        state = abstract_train_state(model, tx, example, precision.LossScaler(), strategy, compressor)
        return {part: tree for part, tree in state.worker.items() if jax.tree.leaves(tree)}, state

    kept, state = worker_state(*plug_ins(config.strategy.name, config.compression.name))
    if kept:
        named = [f"strategy.name={config.strategy.name!r}" if kept.keys() - {"compress"} else "",
                 f"compression.name={config.compression.name!r}" if "compress" in kept else ""]
        works = _stateless(worker_state, plug_ins, config)
        raise ElasticError(
            f"--elastic with {' and '.join(n for n in named if n)}: it keeps state per data-parallel worker "
            f"({', '.join(f'worker.{part}' for part in sorted(kept))}: local models, error-feedback residuals), one "
            f"entry per worker, which a restart on fewer devices cannot split or merge; --elastic works with {works}, "
            "or run without --elastic (every restart then keeps its process count)")
    statistics = sorted(name for name, tree in state.model_state.items() if jax.tree.leaves(tree))
    if statistics:
        switches = [f"--config.model.{key}=False" for key, value in config.model.items()
                    if isinstance(value, bool) and value and "norm" in key]
        raise ElasticError(
            f"--elastic with model.name={config.model.name!r}: its {', '.join(statistics)} (batch normalisation) "
            "are taken over each micro-batch's examples on every device, so a restart on fewer devices with more "
            "accumulation normalises other groups and is not the same run; "
            + (f"turn it off ({' '.join(switches)}), " if switches else "use a model without batch norm, ")
            + "or run without --elastic")


def _stateless(worker_state, plug_ins, config) -> str:
    """The settings that keep no per-worker state, read from the plug-ins' own ``init`` (their declaration)."""
    from dtx import compress, strategies

    found = []
    for name in sorted(strategies.strategy_settings()):
        try:
            if not worker_state(*plug_ins(name, "none"))[0]:
                found.append(f"strategy.name={name}")
        except ValueError:  # a plug-in these settings do not build: not a suggestion
            continue
    for name, settings in sorted(compress.compressor_settings().items()):
        off = {"error_feedback": False} if "error_feedback" in settings else {}
        try:
            if not worker_state(*plug_ins("sync", name, **off))[0]:
                found.append(f"compression.name={name}" + (" with compression.error_feedback=False" if off else ""))
        except ValueError:
            continue
    return ", ".join(found)


def environment(restart: int, processes: int, lost: list[int], last_step: int | None) -> dict[str, str]:
    """The ranks' environment for one start: what :func:`record` reads."""
    return {ENV: json.dumps({"restart": restart, "processes": processes, "lost": lost, "last_step": last_step})}


def record(mesh_shape: dict, grad_accum_steps: int, restored_step: int, *, processes: int = 1,
           workdir: str | None = None) -> dict:
    """The first record's ``membership`` entry: restart number, processes, the mesh and accumulation this start
    runs, the step it restored, the ranks lost (of the start before) and the steps that start had completed past
    the restored one (``steps_recomputed``).

    Under ``dtx launch --elastic`` the launcher says who was lost and how far the start before got. Without it
    (one ``dtx train`` per host under SLURM) every multi-process start, and any start of a run that has one,
    writes it from ``workdir``'s records, read before the resume moves any aside: the restart is the number of
    starts recorded before, ``steps_recomputed`` the newest step recorded past the restored one, and ``lost``
    ``None`` (which ranks is not knowable; the processes' count is). ``{}`` for a single process's own run."""
    raw = os.environ.get(ENV)
    if raw:
        given = json.loads(raw)
        restart, count, lost, last = given["restart"], given["processes"], given["lost"], given.get("last_step")
    else:
        starts, last = _history(workdir)
        if processes < 2 and not starts:
            return {}
        restart, count, lost = len(starts), int(processes), (None if starts else [])
    return {"membership": {
        "restart": restart, "processes": count, "mesh": dict(mesh_shape),
        "grad_accum_steps": int(grad_accum_steps), "restored_step": int(restored_step), "lost": lost,
        "steps_recomputed": max(0, int(last) - int(restored_step)) if last is not None else 0}}


def _history(workdir: str | None) -> tuple[list[dict], int | None]:
    """The ``membership`` entries of the starts ``workdir`` recorded (kept or moved aside by a resume), and the
    newest step its kept records reach (``None``: no records)."""
    starts, last = [], None
    for name, kept in (("metrics.jsonl", True), ("metrics.superseded.jsonl", False)):
        try:
            with open(os.path.join(workdir or "", name), encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:  # a line a killed run left half-written
                continue
            if "membership" in entry:
                starts.append(entry["membership"])
            if kept and isinstance(entry.get("step"), int):
                last = max(last or 0, entry["step"])
    return starts, last
