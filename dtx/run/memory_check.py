"""``memory_limit``: a run whose estimated per-device peak does not fit is refused before anything compiles.

The estimate is :mod:`dtx.perf.memory`'s (Das et al. 2016 size a layout by its parameters, gradients, optimizer
state and activations per device; the terms and the cases they were measured on are in docs/memory.md), a
pipeline's :mod:`dtx.perf.pipeline`'s through :func:`dtx.step.pipeline_check.check_memory`. The refusal names the
biggest terms and the cheapest layout that would fit; an estimate outside the measured regime is said, fit or not.
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
from ml_collections import ConfigDict

from dtx import config as config_lib
from dtx import mesh as mesh_lib
from dtx import parallel
from dtx.run import preflight
from dtx.step import get_driver
from dtx.step import pipeline_check
from dtx.step.pipeline_check import micro_batches


def check_memory(config: ConfigDict, model: nn.Module, example, policy, mesh, layout, pipeline=None) -> None:
    """Refuse, before compiling, a run whose estimated per-device peak (:mod:`dtx.perf.memory`) exceeds the device's
    memory (``memory_limit``, or what an accelerator reports), naming the biggest consumers and the cheapest
    layout that would fit (the layouts by their declared communication cost)."""
    from dtx.perf import memory

    capacity = config.memory_limit or _device_memory()
    if not capacity:
        return
    chosen = parallel.configured(config)
    if chosen.stages:  # a pipeline's own model (dtx.perf.pipeline, through dtx.perf.memory)
        try:
            pipeline_check.check_memory(pipeline, mesh, config.global_batch_size, example, config.optimizer.name,
                                        capacity)
        except ValueError as error:
            raise config_lib.ConfigError(str(error)) from None
        return
    if chosen.kernels == "paired":  # Megatron's pairs: dtx.perf.tensor models them, not dtx.perf.memory
        return
    sharded = tuple(sorted(layout.kernels)) if layout is not None else ()
    group = mesh.shape.get(mesh_lib.MODEL_AXIS, 1)
    common = dict(nodes=mesh.size, global_batch=config.global_batch_size, optimizer=config.optimizer.name,
                  policy=policy, accum_steps=micro_batches(config),
                  backend="xla_cpu" if jax.default_backend() == "cpu" else "gpu",
                  explicit=get_driver(config.driver).explicit)
    # A layout that splits kernels is estimated by the kernels it actually split on this model.
    rules = parallel.LAYOUTS["rules"] if chosen.kernels != "none" and sharded else chosen
    try:
        mine = memory.estimate_model(model, example.shape[1:], rules, dtype=example.dtype,
                                     group_size=group if rules.kernels != "none" else 1,
                                     sharded=sharded if rules.kernels == "explicit" else (), **common)
    except (ValueError, TypeError):  # a model the memory model cannot analyse: nothing to refuse on
        return
    doubt = "; ".join(filter(None, (
        memory.uncovered(rules, **{key: common[key] for key in ("accum_steps", "policy", "backend", "explicit")}),
        mine.outside)))  # the layout's regime, and this network's (a wide convolution, a stride-1 pool)
    if doubt:  # the estimate is outside what the model is checked on: said, whether or not it fits
        warnings.warn(f"memory_limit: dtx.perf.memory's estimate ({_gib(mine.total)} per device) may be off by more "
                      f"than 15 % here: {doubt} (docs/memory.md)", preflight.RunWarning, stacklevel=3)
    if mine.fits(capacity):
        return
    parts = sorted(((mine.params, "parameters"), (mine.grads, "gradients"), (mine.optimizer, "optimizer state"),
                    (mine.activations, "activations"), (mine.buffers, "communication buffers")), reverse=True)
    biggest = ", ".join(f"{what} {_gib(value)}" for value, what in parts[:3])
    fits = []
    for other in sorted(parallel.LAYOUTS.values(), key=lambda lay: lay.cost_rank):
        if (other.name == chosen.name or other.kernels == "explicit" or other.stages
                or (other.needs_model_axis and group == 1)):
            continue
        try:
            alternative = memory.estimate_model(model, example.shape[1:], other, dtype=example.dtype,
                                                group_size=group, **{
                **common, "explicit": get_driver(config.driver if config.driver in other.drivers
                                                 else other.drivers[0]).explicit})
        except (ValueError, TypeError):
            continue
        if alternative.fits(capacity):
            driver = "" if config.driver in other.drivers else f"--config.driver={other.drivers[0]} "
            fits.append(f"{driver}--config.parallel.name={other.name} fits: {_gib(alternative.total)} of "
                        f"{_gib(capacity)}")
            break
    hint = fits[0] if fits else ("no layout fits on this mesh: lower global_batch_size, raise grad_accum_steps, "
                                 "or use more devices")
    raise config_lib.ConfigError(
        f"this run needs about {_gib(mine.total)} per device (dtx.perf.memory's estimate, peak in the {mine.phase} phase) "
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
