"""What a pipeline-parallel run refuses, before anything is compiled, each refusal naming the key and the fix.

The pipeline step (:mod:`dtx.parallel.pipeline.step`; GPipe: Huang et al. 2019; 1F1B: Narayanan et al. 2021)
places its own collectives — ``ppermute`` between stages, one gradient all-reduce over the data axes —
and keeps each stage's parameters as one flattened row (:mod:`dtx.parallel.pipeline.stages`). So it runs under
the ``shard_map`` driver only, with synchronous SGD and no compression or custom allreduce. Every optimizer
runs (each stage is updated as its own parameter tree: :mod:`dtx.parallel.pipeline.optim`).

Its ``pipeline.microbatches`` ``M`` *are* the run's gradient accumulation — each data shard's batch splits into
``M`` micro-batches whose gradients are summed before the one all-reduce — so ``grad_accum_steps`` is left at 1
(or set to ``M``); anything else is refused (:func:`check_config`, at load time), as is a ``pipeline.*`` key set
for another layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from dtx import compress, optim, strategies
from dtx import mesh as mesh_lib
from dtx.comm.algorithms import get_algorithm
from dtx.config import ConfigError, base_config, register_check
from dtx.mesh import FSDP_AXIS, MODEL_AXIS
from dtx.parallel.context import CONTEXT_AXIS
from dtx.parallel.layouts import LAYOUTS, configured, fsdp_stage
from dtx.parallel.pipeline.context_stages import UNSTAGED
from dtx.parallel.pipeline.schedules import CHUNKED, SCHEDULES
from dtx.parallel.pipeline.stages import STAGE_AXIS
from dtx.precision import parse_policy
from dtx.step.drivers import get_driver
from dtx.step.spec import StepError


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineSettings:
    """What :func:`check_settings` reads of a pipeline run, each field named as its ``--config`` key says (by
    keyword: ``mesh_shape``, ``num_layers`` and ``global_batch_size`` have no default).

    Attributes:
      mesh_shape: axis name -> size (``mesh``).
      schedule: ``pipeline.schedule``.
      boundaries: ``pipeline.boundaries``, the first layer of stages 1..; ``()``: balanced by FLOPs.
      num_layers: the model's layers to cut (:func:`dtx.parallel.pipeline.stages.model_layers`).
      virtual_stages: ``pipeline.virtual_stages``, the chunks per device.
      global_batch_size: ``global_batch_size``.
      microbatches: ``M`` (:func:`micro_batches` of the config).
      driver, optimizer, weight_decay, strategy, compression, allreduce, bucket_bytes, precision: the keys of those
        names (``optimizer.name``, ``optimizer.weight_decay``, ``strategy.name``, ``compression.name``).
      zero_stage: the ZeRO stage over the rows (:func:`zero_stage` of the config).
    """

    mesh_shape: dict
    schedule: str = "gpipe"
    boundaries: Sequence[int] = ()
    num_layers: int
    virtual_stages: int = 1
    global_batch_size: int
    microbatches: int = 1
    driver: str = "shard_map"
    optimizer: str = "adam"
    weight_decay: float = 0.0
    strategy: str = "sync"
    compression: str = "none"
    allreduce: str = "psum"
    bucket_bytes: int = 0
    precision: str = ""
    zero_stage: int = 0


def check_settings(settings: PipelineSettings) -> None:
    """Raise :class:`~dtx.step.spec.StepError` listing every setting a pipeline run cannot take, each with
    its ``--config`` key and the fix (module docstring)."""
    # The checks read each setting by its own name.
    mesh_shape, schedule, boundaries = settings.mesh_shape, settings.schedule, settings.boundaries
    num_layers, virtual_stages, microbatches = settings.num_layers, settings.virtual_stages, settings.microbatches
    global_batch_size, driver, optimizer = settings.global_batch_size, settings.driver, settings.optimizer
    weight_decay, strategy, compression = settings.weight_decay, settings.strategy, settings.compression
    allreduce, bucket_bytes, precision = settings.allreduce, settings.bucket_bytes, settings.precision
    zero_stage = settings.zero_stage
    problems = []
    devices = mesh_shape.get(STAGE_AXIS)
    stages = None if devices is None else devices * virtual_stages  # the (virtual) stages the layers are cut into
    if stages is None:
        problems.append(f"the mesh has no {STAGE_AXIS!r} axis (it is {dict(mesh_shape)}): set e.g. "
                        f"--config.mesh='((\"{STAGE_AXIS}\", 2), (\"data\", -1))'")
    elif stages > num_layers:
        problems.append(f"mesh axis {STAGE_AXIS!r} of {devices} devices x pipeline.virtual_stages={virtual_stages} "
                        f"makes {stages} stages but the model has {num_layers} layers to cut: use a smaller stage axis "
                        "or fewer virtual stages")
    if schedule not in SCHEDULES:
        problems.append(f"pipeline.schedule={schedule!r} is unknown: choose one of {list(SCHEDULES)}")
    elif (virtual_stages > 1) != (schedule in CHUNKED):
        problems.append(f"pipeline.virtual_stages={virtual_stages} with pipeline.schedule={schedule!r}: chunks per "
                        f"device are for {' or '.join(CHUNKED)} (2 or more there): set --config.pipeline.schedule="
                        f"{CHUNKED[0] if virtual_stages > 1 else schedule} or --config.pipeline.virtual_stages="
                        f"{1 if virtual_stages > 1 else 2}")
    elif schedule in CHUNKED and devices and microbatches % devices:
        problems.append(f"pipeline.microbatches={microbatches}: the interleaved schedule sends micro-batches round "
                        f"the ring in groups of the {devices} stage devices; set it to a multiple of {devices}")
    if boundaries and stages is not None:
        cuts = list(boundaries)
        if len(cuts) != stages - 1 or cuts != sorted(set(cuts)) or not all(0 < b < num_layers for b in cuts):
            problems.append(f"pipeline.boundaries={tuple(boundaries)} must be {stages - 1} increasing layer indices "
                            f"in 1..{num_layers - 1} for {stages} stages; or () to balance the stages by FLOPs")
    if not get_driver(driver).explicit:
        problems.append(f"driver={driver!r}: the pipeline places its own ppermutes, so it runs under a driver that "
                        "leaves the collectives to the step: set --config.driver=shard_map")
    for key, value, plain, fine in (("strategy.name", strategy, "sync", _identity(strategies.make_strategy, strategy)),
                                    ("compression.name", compression, "none",
                                     _identity(compress.make_compressor, compression)),
                                    ("allreduce", allreduce, "psum", get_algorithm(allreduce).native),
                                    ("bucket_bytes", bucket_bytes, 0, not bucket_bytes)):
        if not fine:
            problems.append(f"{key}={value!r}: the pipeline reduces each stage's gradient once with psum over the "
                            f"data axes: set --config.{key}={plain}")
    if MODEL_AXIS in mesh_shape and optim.declared(optimizer).whole_tensors:
        problems.append(f"optimizer.name={optimizer!r}: a {MODEL_AXIS!r} mesh axis splits each stage's attention and "
                        "MLP kernels (dtx.parallel.pipeline.tensor_stages), and LARS's and LAMB's trust ratios need each "
                        "tensor's whole norm: use adam, adamw, momentum or sgd, or drop the model axis")
    problems += zero_problems(zero_stage, mesh_shape, optimizer, weight_decay)
    if precision and np.dtype(parse_policy(precision).params) != np.float32:
        problems.append(f"precision={precision!r}: the pipeline keeps float32 parameters (its rows); compute in "
                        "bfloat16 or float16 with p=f32, e.g. --config.precision=p=f32,c=bf16")
    if stages:
        data = _replicas(mesh_shape)
        local = global_batch_size // data if global_batch_size % data == 0 else None
        if local is None or microbatches < 1 or local % microbatches:
            fits = ("" if local is None else f" (each shard's batch is {local}: pipeline.microbatches one of "
                    f"{[d for d in range(1, local + 1) if local % d == 0]})")
            problems.append(f"global_batch_size={global_batch_size} must split over the {data} data shards (the "
                            f"axes but {STAGE_AXIS!r}) and each shard's batch into pipeline.microbatches="
                            f"{microbatches}{fits}: change --config.global_batch_size or "
                            "--config.pipeline.microbatches")
        elif microbatches < devices:
            problems.append(f"pipeline.microbatches={microbatches} on {devices} stages leave each stage idle "
                            f"{(devices - 1) / (microbatches * virtual_stages + devices - 1):.0%} of the step: set "
                            f"--config.pipeline.microbatches to at least {devices}")
    if problems:
        raise StepError("parallel.name='pipeline': " + "; ".join(problems))


def _replicas(mesh_shape: dict, split: bool = False) -> int:
    """How many data replicas a mesh of ``mesh_shape`` (axis name -> size) holds, by its axes' declarations
    (:data:`dtx.mesh.AXES`); ``split``: only those the state is split over (the ``fsdp`` axes)."""
    return math.prod(size for name, size in mesh_shape.items() if name in mesh_lib.AXES and
                     mesh_lib.AXES[name].replicas and (not split or mesh_lib.AXES[name].state))


def _identity(make, name: str) -> bool:
    """Whether the plug-in ``name`` (a strategy or compressor, built with its defaults) leaves the gradient's
    reduction as it is (``caps.identity``): what a pipeline's one psum over the data axes can take."""
    try:
        return bool(make(name).caps.identity)
    except ValueError:  # an unknown name: its family's own check names the choices
        return False


# From dtx.optim's declarations: the optimizers that act on a row as on the tree (entry by entry, no mask by name),
# and those that need each tensor whole (trust ratios from each tensor's norm).
ELEMENTWISE_OPTIMIZERS = tuple(n for n, o in optim.DECLARED.items() if o.by_entry and not o.masks_by_name)
PER_TENSOR_OPTIMIZERS = tuple(n for n, o in optim.DECLARED.items() if o.whole_tensors)


def zero_problems(zero_stage: int, mesh_shape: dict, optimizer: str, weight_decay: float) -> list[str]:
    """What ``pipeline.zero_stage`` cannot take (:mod:`dtx.parallel.pipeline.zero`): stages 2 and 3, a mesh without
    data axes to split over, LARS and LAMB (their trust ratios need each tensor whole; weight decay runs)."""
    if not zero_stage:
        return []
    key = "fsdp.zero_stage" if FSDP_AXIS in mesh_shape else "pipeline.zero_stage"
    if zero_stage == 2:
        return [f"{key}=2: ZeRO-2 splits the gradient over the data ranks, but a pipeline accumulates each stage's "
                "gradient row whole over its micro-batches and reduces it once per step, which stage 1 already "
                "reduce-scatters: stage 2 would save nothing more (DeepSpeed and Megatron-LM also allow only ZeRO-1 "
                f"with pipelines); set --config.{key}=1, or 3 to split the parameter rows too"]
    if zero_stage not in (1, 3):
        return [f"{key}={zero_stage!r} is unknown: 0 (none), 1 (the optimizer state split over the data axes) or 3 "
                "(the parameter rows too)"]
    problems = []
    data = _replicas(mesh_shape, split=FSDP_AXIS in mesh_shape)
    if data < 2:
        problems.append(f"{key}={zero_stage} splits the stage rows' state over the data axes, and the mesh "
                        f"{dict(mesh_shape)} has no data replicas to split it over: add a data axis, e.g. "
                        f"--config.mesh='((\"{STAGE_AXIS}\", 2), (\"data\", -1))', or set "
                        f"--config.{key}=0")
    if optim.declared(optimizer).whole_tensors:
        problems.append(f"optimizer.name={optimizer!r}: {key}={zero_stage} updates a slice of each stage's row, "
                        "and LARS's and LAMB's trust ratios need each tensor's whole norm: use one of "
                        f"{', '.join(ELEMENTWISE_OPTIMIZERS)} or adamw (weight decay runs, masked by "
                        f"optimizer.exclude), or set --config.{key}=0")
    return problems


def per_tensor(optimizer: str, weight_decay: float, zero_stage: int = 0) -> bool:
    """Whether optimizer ``optimizer`` (:mod:`dtx.optim`) needs each stage's tensors: LARS's and LAMB's trust
    ratios are per tensor, and weight decay skips biases by name (``optimizer.exclude``); SGD, momentum, Nesterov
    and Adam without it act entry by entry, so the pipeline updates its flat rows directly (less memory). Under
    ``pipeline.zero_stage=1`` weight decay runs on the row's slices through a row-shaped mask
    (:mod:`dtx.parallel.pipeline.zero`), so only LARS and LAMB would."""
    declared = optim.declared(optimizer)
    if zero_stage:
        return declared.whole_tensors
    return declared.whole_tensors or declared.masks_by_name or not declared.by_entry or bool(weight_decay)


def _staged(config) -> bool:
    """Whether the run is a pipeline: its preset, or a ``stage`` mesh axis that composes it
    (:func:`dtx.parallel.layouts.compose`)."""
    if config.parallel.name not in LAYOUTS:
        return False
    try:
        return configured(config).stages
    except ValueError:  # an undeclared axis, a preset that does not compose: the layouts' own check says so
        return LAYOUTS[config.parallel.name].stages


def zero_stage(config) -> int:
    """A pipeline run's ZeRO stage over its rows: ``pipeline.zero_stage``, or the ``fsdp`` axis's
    ``fsdp.zero_stage``."""
    return int(config.pipeline.zero_stage) or fsdp_stage(config)


def micro_batches(config) -> int:
    """The run's gradient-accumulation count: ``pipeline.microbatches`` under a pipeline (its micro-batches are the
    accumulation), else ``grad_accum_steps``."""
    return int(config.pipeline.microbatches) if _staged(config) else int(config.grad_accum_steps)


@register_check
def check_config(config) -> None:
    """``pipeline.*`` only with ``parallel.name=pipeline``; there ``grad_accum_steps`` is 1 or ``M`` (module
    docstring), ``M >= 1``, and with a ``context`` axis a kernel the stages can run
    (:data:`dtx.parallel.pipeline.context_stages.UNSTAGED`)."""
    block, defaults = config.pipeline, base_config().pipeline
    if not _staged(config):
        changed = [f"pipeline.{key}={block[key]!r}" for key in block if tuple(np.atleast_1d(block[key])) !=
                   tuple(np.atleast_1d(defaults[key]))]
        if changed:
            raise ConfigError(f"{', '.join(changed)} applies to pipelines only (parallel.name=pipeline, or a "
                              f"'stage' mesh axis), not {config.parallel.name}: set --config.parallel.name=pipeline "
                              "or leave pipeline.* at the defaults")
        return
    attention = config.context.attention
    if any(name == CONTEXT_AXIS for name, _ in config.mesh) and attention in UNSTAGED:
        raise ConfigError(UNSTAGED[attention])
    stage = zero_stage(config)
    if stage not in (0, 1, 3):  # the rest of zero_problems needs the mesh's sizes: refused with the others later
        raise ConfigError(zero_problems(stage, {name: size for name, size in config.mesh}, "", 0.0)[0])
    m, accum = block.microbatches, config.grad_accum_steps
    if m < 1:
        raise ConfigError(f"pipeline.microbatches={m} must be >= 1 (the micro-batches per step)")
    if accum not in (1, m):
        raise ConfigError(f"grad_accum_steps={accum} with pipeline.microbatches={m}: a pipeline's micro-batches are "
                          "its gradient accumulation (summed before the one all-reduce), so there is no second "
                          f"level; set --config.pipeline.microbatches={accum * m if m > 1 else accum} (all the micro-batches "
                          "of a step) and leave grad_accum_steps at 1")


def check_memory(pipeline, mesh, global_batch_size: int, example, optimizer: str, capacity: float) -> None:
    """Refuse a pipeline whose per-device peak (:func:`dtx.parallel.pipeline.costs.memory_estimate`) exceeds ``capacity``
    bytes (``memory_limit``, or the accelerator's), naming the biggest terms and what lowers them."""
    from dtx.parallel.pipeline import costs  # this package's model of the step

    if not capacity or pipeline is None:
        return
    data = _replicas(dict(mesh.shape))  # the axes that split the batch (not stage, model nor context)
    micro = global_batch_size // data // pipeline.schedule.micro
    labels = int(np.prod(pipeline.plan.layers[-1].out_shape[:-1]))  # one per example, or per token of a sequence
    example_bytes = int(np.prod(example.shape[1:])) * np.dtype(example.dtype).itemsize + 4 * labels
    e = costs.memory_estimate(pipeline.plan, pipeline.schedule, micro=micro, data=data,
                                 optimizer=optimizer, example_bytes=example_bytes, zero_stage=pipeline.zero_stage)
    if e.fits(capacity):
        return
    gib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    raise StepError(f"this pipeline needs about {gib(e.total)} per device (dtx.parallel.pipeline.costs.memory_estimate) but a "
                    f"device has {gib(capacity)} (memory_limit or the accelerator's): the stage row with its optimizer "
                    f"state and working rows {gib(e.params + e.grads + e.optimizer + e.buffers)}, kept inputs and "
                    f"the batch {gib(e.activations)}; use more stages (a longer 'stage' mesh axis), "
                    "pipeline.schedule=1f1b (fewer kept inputs), or a smaller global_batch_size")
