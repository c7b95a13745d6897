"""What a pipeline-parallel run refuses, before anything is compiled, each refusal naming the key and the fix.

The pipeline step (:mod:`dtx.step.pipeline`; GPipe: Huang et al. 2019; 1F1B: Narayanan et al. 2021)
places its own collectives — ``ppermute`` between stages, one gradient all-reduce over the data axes —
and keeps each stage's parameters as one flattened row (:mod:`dtx.parallel.stages`). So it runs under
the ``shard_map`` driver only, with synchronous SGD and no compression or custom allreduce, and with
optimizers that act entry by entry (a per-tensor norm, as LARS/LAMB take, or a weight-decay mask by
parameter name cannot see tensors in a row). Its micro-batches are the run's ``grad_accum_steps``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from dtx.comm.algorithms import get_algorithm
from dtx.parallel.pipeline_schedules import CHUNKED, SCHEDULES
from dtx.precision import parse_policy
from dtx.parallel.stages import STAGE_AXIS
from dtx.step.drivers import get_driver
from dtx.step.spec import StepError

ELEMENTWISE_OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam")


def check_settings(*, mesh_shape: dict, schedule: str = "gpipe", boundaries: Sequence[int] = (), num_layers: int,
                   virtual_stages: int = 1,
                   global_batch_size: int, grad_accum_steps: int = 1, driver: str = "shard_map",
                   optimizer: str = "adam", weight_decay: float = 0.0, strategy: str = "sync",
                   compression: str = "none", allreduce: str = "psum", bucket_bytes: int = 0,
                   precision: str = "", loss_scale: str = "auto") -> None:
    """Raise :class:`~dtx.step.spec.StepError` listing every setting a pipeline run cannot take, each with
    its ``--config`` key and the fix (module docstring). ``mesh_shape``: axis name -> size."""
    problems = []
    devices = mesh_shape.get(STAGE_AXIS)
    stages = None if devices is None else devices * virtual_stages  # the (virtual) stages the layers are cut into
    if stages is None:
        problems.append(f"the mesh has no {STAGE_AXIS!r} axis (it is {dict(mesh_shape)}): set e.g. "
                        f"--config.mesh='((\"{STAGE_AXIS}\", 2), (\"data\", -1))'")
    elif stages > num_layers:
        problems.append(f"mesh axis {STAGE_AXIS!r} of {devices} devices x parallel.virtual_stages={virtual_stages} "
                        f"makes {stages} stages but the model has {num_layers} layers to cut: use a smaller stage axis "
                        "or fewer virtual stages")
    if schedule not in SCHEDULES:
        problems.append(f"parallel.schedule={schedule!r} is unknown: choose one of {list(SCHEDULES)}")
    elif (virtual_stages > 1) != (schedule in CHUNKED):
        problems.append(f"parallel.virtual_stages={virtual_stages} with parallel.schedule={schedule!r}: chunks per "
                        f"device are for {' or '.join(CHUNKED)} (2 or more there): set --config.parallel.schedule="
                        f"{CHUNKED[0] if virtual_stages > 1 else schedule} or --config.parallel.virtual_stages="
                        f"{1 if virtual_stages > 1 else 2}")
    elif schedule in CHUNKED and devices and grad_accum_steps % devices:
        problems.append(f"grad_accum_steps={grad_accum_steps}: the interleaved schedule sends micro-batches round the "
                        f"ring in groups of the {devices} stage devices; set it to a multiple of {devices}")
    if boundaries and stages is not None:
        cuts = list(boundaries)
        if len(cuts) != stages - 1 or cuts != sorted(set(cuts)) or not all(0 < b < num_layers for b in cuts):
            problems.append(f"parallel.boundaries={tuple(boundaries)} must be {stages - 1} increasing layer indices "
                            f"in 1..{num_layers - 1} for {stages} stages; or () to balance the stages by FLOPs")
    if not get_driver(driver).explicit:
        problems.append(f"driver={driver!r}: the pipeline places its own ppermutes, so it runs under a driver that "
                        "leaves the collectives to the step: set --config.driver=shard_map")
    if optimizer not in ELEMENTWISE_OPTIMIZERS or weight_decay:
        problems.append(f"optimizer.name={optimizer!r} with weight_decay={weight_decay}: a stage's parameters are one "
                        f"row, so only optimizers acting entry by entry run ({', '.join(ELEMENTWISE_OPTIMIZERS)}, "
                        "weight_decay=0): set --config.optimizer.name=adam --config.optimizer.weight_decay=0")
    for key, value, plain, fine in (("strategy.name", strategy, "sync", strategy == "sync"),
                                    ("compression.name", compression, "none", compression == "none"),
                                    ("allreduce", allreduce, "psum", get_algorithm(allreduce).native),
                                    ("bucket_bytes", bucket_bytes, 0, not bucket_bytes)):
        if not fine:
            problems.append(f"{key}={value!r}: the pipeline reduces each stage's gradient once with psum over the "
                            f"data axes: set --config.{key}={plain}")
    if precision and any(np.dtype(d) != np.float32 for d in dataclasses.astuple(parse_policy(precision))):
        problems.append(f"precision={precision!r}: the pipeline computes in float32 for now; leave --config.precision "
                        "at its default")
    if loss_scale not in ("auto", "none"):
        problems.append(f"loss_scale.name={loss_scale!r}: no loss scaling under the pipeline; set "
                        "--config.loss_scale.name=auto")
    if stages:
        data = 1
        for name, size in mesh_shape.items():
            data *= size if name != STAGE_AXIS else 1
        local = global_batch_size // data if global_batch_size % data == 0 else None
        if local is None or grad_accum_steps < 1 or local % grad_accum_steps:
            problems.append(f"global_batch_size={global_batch_size} must split over the {data} data shards (the "
                            f"axes but {STAGE_AXIS!r}) and each shard's batch into grad_accum_steps={grad_accum_steps} "
                            "micro-batches: change --config.global_batch_size or --config.grad_accum_steps")
        elif grad_accum_steps < devices:
            problems.append(f"grad_accum_steps={grad_accum_steps} micro-batches on {devices} stages leave each stage "
                            f"idle {(devices - 1) / (grad_accum_steps * virtual_stages + devices - 1):.0%} of the "
                            f"step: set --config.grad_accum_steps to at least {devices}")
    if problems:
        raise StepError("parallel.name='pipeline': " + "; ".join(problems))
