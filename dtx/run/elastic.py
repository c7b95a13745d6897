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
         data_parallel: int, fixed: int = 1, model_axis: int = 1) -> Plan:
    """The largest job on at most ``available`` processes whose batch axes split the global batch into the
    original run's micro-batches.

    ``data_parallel`` x ``grad_accum_steps`` micro-batches of ``micro_batch(...)`` examples make the global batch
    at the first start; a start on ``d`` data-parallel devices runs ``data_parallel·grad_accum_steps / d`` of them
    per device, so ``d`` must divide that product. ``fixed``: the product of the mesh's fixed axes (a ``model`` or
    ``stage`` axis keeps its size); ``model_axis``: the part of it that does not split the batch.
    """
    total = data_parallel * grad_accum_steps
    for processes in range(available, 0, -1):
        devices = processes * devices_per_process
        if devices % fixed:
            continue
        parallel = devices // model_axis
        if total % parallel == 0:
            return Plan(processes, devices, parallel, total // parallel)
    raise ElasticError(
        f"no job on {available} or fewer processes x {devices_per_process} devices splits global_batch_size="
        f"{global_batch} into micro-batches of {micro_batch(global_batch, data_parallel, grad_accum_steps)}")


def available(slots: int, lost: int, replacements: int, processes: int) -> int:
    """Processes the next start may use: the job's ``slots`` (running, or set aside because the mesh could not
    use them: they rejoin now) less the ``lost``, plus announced ``replacements``, at most ``processes``."""
    return min(processes, slots - lost + replacements)


class Settings(NamedTuple):
    """An elastic job's first start, and how it starts on ``n`` available processes (``plan(n)``)."""

    start: Plan
    plan: Callable[[int], Plan]


def settings(experiment: str, overrides: list[str], processes: int, devices_per_process: int) -> Settings:
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
                    model_axis=model_axis)

    return Settings(on(processes), on)


def environment(restart: int, processes: int, lost: list[int], last_step: int | None) -> dict[str, str]:
    """The ranks' environment for one start: what :func:`record` reads."""
    return {ENV: json.dumps({"restart": restart, "processes": processes, "lost": lost, "last_step": last_step})}


def record(mesh_shape: dict, grad_accum_steps: int, restored_step: int) -> dict:
    """The first record's ``membership`` entry under ``dtx launch --elastic`` (``{}`` otherwise): restart
    number, processes, the mesh and accumulation this start runs, the step it restored, the ranks lost (of the
    start before) and the steps that start had completed past the restored one (``steps_recomputed``)."""
    raw = os.environ.get(ENV)
    if not raw:
        return {}
    given = json.loads(raw)
    last = given.get("last_step")
    return {"membership": {
        "restart": given["restart"], "processes": given["processes"], "mesh": dict(mesh_shape),
        "grad_accum_steps": int(grad_accum_steps), "restored_step": int(restored_step), "lost": given["lost"],
        "steps_recomputed": max(0, int(last) - int(restored_step)) if last is not None else 0}}
