"""``memory_limit``: a run whose estimated per-device peak does not fit is refused before anything compiles.

The estimate is :mod:`dtx.perf.memory`'s (Das et al. 2016 size a layout by its parameters, gradients, optimizer
state and activations per device; the terms and the cases they were measured on are in docs/memory.md), a
pipeline's :func:`dtx.parallel.pipeline.costs.memory_estimate` through
:func:`dtx.parallel.pipeline.check.check_memory`. The refusal names the biggest terms and the cheapest layout that
would fit; an estimate outside the measured regime is said, fit or not.

``host_memory_check``: on the CPU backend every emulated device is a slice of the one host's memory, which reports
no per-device limit, so a run that cannot fit grows until the kernel kills it, printing nothing. There the estimate
times this process's devices, plus :data:`HOST_ALLOWANCE`, is held against what the host has available
(:func:`host_memory`: ``MemAvailable``, or less under a cgroup's limit) and a run that cannot fit is refused.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import sys
import warnings
from typing import NamedTuple

import flax.linen as nn
import jax
from ml_collections import ConfigDict

from dtx import config as config_lib
from dtx import mesh as mesh_lib
from dtx import parallel
from dtx.parallel.pipeline import check as pipeline_check
from dtx.parallel.pipeline.check import micro_batches
from dtx.parallel.pipeline.stages import STAGE_AXIS
from dtx.run import preflight
from dtx.step import get_driver

# What the process needs beyond the devices' buffers the estimate counts and what it held at the check (the host's
# available memory is read then, so the imports and the loaded data are already out of it): XLA compiling the train
# and eval steps, the runtime, the eval step's own buffers. Measured with dtx train on 8 emulated devices (jax
# 0.10, XLA:CPU; docs/memory.md): peak RSS less RSS at the check less 8 x the estimate was 0.12 GiB for digits_mlp,
# 0.19 GiB for digits_lenet, 0.85 GiB for gpt2_small's width-scaled twin (bfloat16 compute, where the estimate reads
# low, and a 50257-wide eval output). The floor, rounded up: the check refuses only what cannot fit.
HOST_ALLOWANCE = 0.25 * 2**30


class HostMemory(NamedTuple):
    """Bytes this process may still allocate on its host, and where that was read."""

    available: float
    source: str


def check_memory(config: ConfigDict, model: nn.Module, example, policy, mesh, layout, pipeline=None) -> None:
    """Refuse, before compiling, a run whose estimated per-device peak (:mod:`dtx.perf.memory`) exceeds the device's
    memory (``memory_limit``, or what an accelerator reports), naming the biggest consumers and the cheapest
    layout that would fit (the layouts by their declared communication cost); on the CPU backend, also one whose
    estimate times this process's devices exceeds the host's available memory (:func:`check_host`)."""
    from dtx.perf import memory

    capacity = config.memory_limit or _device_memory()
    host = host_memory() if config.host_memory_check and jax.default_backend() == "cpu" else None
    if not capacity and host is None:
        return
    chosen = parallel.configured(config)
    if chosen.stages:  # a pipeline's own model (dtx.parallel.pipeline.costs.memory_estimate)
        try:
            if capacity:
                pipeline_check.check_memory(pipeline, mesh, config.global_batch_size, example, config.optimizer.name,
                                            capacity)
        except ValueError as error:
            raise config_lib.ConfigError(str(error)) from None
        if host is not None and pipeline is not None:
            try:
                mine = _pipeline_estimate(pipeline, mesh, config.global_batch_size, example, config.optimizer.name)
            except Exception:  # noqa: BLE001 — on by default: a pipeline the model cannot size still trains
                return
            check_host(config, mine, mesh, host)
        return
    if chosen.pairs:  # Megatron's pairs: dtx.parallel.tensor.costs models them, not dtx.perf.memory
        return  # (docs/memory.md: neither memory_limit nor the host's memory is checked for parallel.name=tensor)
    # The kernels the activation layout split. A layout that estimates its devices its own way (a context split's
    # ``memory``: S/C positions of B/D examples, and what its attention keeps; an expert split's: 1/X of the
    # experts' state) declares the input shape a device is estimated at, the devices that share one example (the
    # axis), and how it adjusts the data-parallel estimate there.
    sharded = tuple(sorted(getattr(layout, "kernels", None) or ()))
    group = mesh.shape.get(mesh_lib.MODEL_AXIS, 1)
    own = getattr(layout, "memory", None)
    shape, adjust, sharing = example.shape[1:], None, 1
    if own is not None:
        shape, sharing, adjust = own(model, example, policy.compute)
    devices = mesh.size // sharing  # the devices that hold distinct examples
    common = dict(nodes=devices, global_batch=config.global_batch_size, optimizer=config.optimizer.name,
                  policy=policy, accum_steps=micro_batches(config),
                  backend="xla_cpu" if jax.default_backend() == "cpu" else "gpu",
                  explicit=get_driver(config.driver).explicit)
    split = math.prod(mesh.shape[a] for a in mesh_lib.state_axes(mesh))
    if chosen.zero_stage and split < devices:  # hybrid sharding: a device holds what FSDP over the fsdp axis
        # alone holds, with its replicas' share of the batch (each data index a run of its own, reduced after)
        common.update(nodes=split, global_batch=config.global_batch_size // (devices // split))
    # A layout that splits kernels is estimated by the kernels it actually split on this model.
    rules = parallel.rules_layout() if chosen.splits_kernels and sharded else chosen

    def estimate(**changes):
        found = memory.estimate_model(model, shape, rules, dtype=example.dtype,
                                      group_size=group if rules.splits_kernels else 1,
                                      sharded=sharded if rules.user_rules else (), **{**common, **changes})
        return found if adjust is None else adjust(found_examples(changes), found)

    def found_examples(changes) -> int:  # examples per device per micro-batch, as the estimate splits them
        settings = {**common, **changes}
        return settings["global_batch"] // settings["nodes"] // settings["accum_steps"]

    try:
        mine = estimate()
    except (ValueError, TypeError):  # a model the memory model cannot analyse: nothing to refuse on
        return
    except Exception:  # noqa: BLE001 — the host check is on by default: a model it cannot trace still trains
        if capacity:
            raise
        return
    doubt = "; ".join(filter(None, (
        memory.uncovered(rules, **{key: common[key] for key in ("accum_steps", "policy", "backend", "explicit")}),
        mine.outside)))  # the layout's regime, and this network's (a wide convolution, a stride-1 pool)
    if capacity:
        _check_device(config, model, example, chosen, group,  # the other layouts: every device its examples
                      {**common, "nodes": mesh.size} if sharing > 1 else common, mine, doubt, capacity)
    if host is not None:
        check_host(config, mine, mesh, host, doubt=doubt, estimate=estimate if group == 1 else None)


def _check_device(config, model, example, chosen, group, common, mine, doubt, capacity) -> None:
    """``memory_limit`` (or the accelerator's memory) against the per-device estimate ``mine``."""
    from dtx.perf import memory

    if doubt:  # the estimate is outside what the model is checked on: said, whether or not it fits
        warnings.warn(f"memory_limit: dtx.perf.memory's estimate ({_gib(mine.total)} per device) may be off by more "
                      f"than 15 % here: {doubt} (docs/memory.md)", preflight.RunWarning, stacklevel=4)
    if mine.fits(capacity):
        return
    parts = sorted(((mine.params, "parameters"), (mine.grads, "gradients"), (mine.optimizer, "optimizer state"),
                    (mine.activations, "activations"), (mine.buffers, "communication buffers")), reverse=True)
    biggest = ", ".join(f"{what} {_gib(value)}" for value, what in parts[:3])
    fits = []
    for other in sorted(parallel.LAYOUTS.values(), key=lambda lay: lay.cost_rank):
        if (other.name == chosen.name or other.user_rules or other.stages
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


def check_host(config: ConfigDict, mine, mesh, host: HostMemory, *, doubt: str = "", estimate=None) -> None:
    """Refuse a CPU run whose per-device estimate ``mine`` times this process's devices, plus
    :data:`HOST_ALLOWANCE`, exceeds ``host.available``: every emulated CPU device lives in the host's memory.

    The message names the estimate per device and in total, the host's memory and where it was read, the fixes
    that fit (``estimate(nodes=..., global_batch=...)`` re-estimates a smaller batch or fewer devices: a
    data-parallel layout's), the experiment's own smaller twin when its docstring offers one, and what
    ``memory_limit`` and ``host_memory_check`` mean here.
    """
    devices = _local_devices(mesh)
    need = mine.total * devices + HOST_ALLOWANCE
    if need <= host.available:
        return
    fits = _smaller_runs(config, mesh, devices, host.available, estimate) if estimate is not None else []
    twin = _twin_command(config)
    smaller = "a smaller model" + (" (no smaller global_batch_size or device count fits this one)"
                                   if estimate is not None and not fits else "")
    smaller += f", such as this experiment's width-scaled twin (its docstring): {twin}" if twin else ""
    fixes = [*fits, smaller, "an accelerator (--config.emulate_cpu_devices=0 on a GPU or TPU host)"]
    if estimate is None:  # a pipeline, or kernels split over a model axis: not re-estimated here
        fixes.insert(0, "a smaller global_batch_size or fewer devices")
    phase = f", peak in the {mine.phase} phase" if mine.phase else ""
    off = f" The estimate may be off by more than 15 % here: {doubt}." if doubt else ""
    raise config_lib.ConfigError(
        f"this run needs about {_gib(mine.total)} per device (dtx.perf.memory's estimate{phase}) × {devices} CPU "
        f"devices = {_gib(mine.total * devices)}, plus {_gib(HOST_ALLOWANCE)} for compiling and the runtime: "
        f"{_gib(need)} of the host's memory, but {_gib(host.available)} is available ({host.source}). On the CPU "
        f"backend every emulated device shares the host's memory, and a run that outgrows it is killed by the "
        f"kernel without a word. Instead: {'; '.join(fixes[:-1])}; or {fixes[-1]}.{off} (memory_limit "
        "caps each device and cannot raise the host's memory; --config.host_memory_check=False skips this check.)")


def _local_devices(mesh) -> int:
    """Devices of ``mesh`` this process drives (all of them but in a multi-process job): those in its memory."""
    here = jax.process_index()
    return sum(1 for device in mesh.devices.flat if device.process_index == here)


def _smaller_runs(config: ConfigDict, mesh, devices: int, available: float, estimate) -> list[str]:
    """The largest global batch, and the most devices, whose estimate fits ``available`` (a data-parallel
    layout's: every device a batch shard), as overrides."""
    accum, batch = micro_batches(config), config.global_batch_size
    step = mesh.size * accum  # a global batch must split over the devices and the micro-batches
    out = _first_fitting(available, "global_batch_size", range(batch - step, 0, -step),
                         lambda smaller: (estimate(global_batch=smaller), devices))
    single_axis = len(config.mesh) == 1 and config.mesh[0][1] == -1  # the mesh follows the device count
    if config.emulate_cpu_devices and single_axis and jax.process_count() == 1:
        out += _first_fitting(available, "emulate_cpu_devices",
                              [fewer for fewer in range(devices - 1, 0, -1) if batch % (fewer * accum) == 0],
                              lambda fewer: (estimate(nodes=fewer), fewer))
    return out


def _first_fitting(available: float, key: str, values, estimate) -> list[str]:
    """``[--config.KEY=VALUE (its total)]`` for the first of ``values`` whose ``estimate(value)`` — ``(per-device
    estimate, devices)`` — fits ``available`` with the allowance; ``[]`` if none (or none can be estimated)."""
    for value in values:
        try:
            e, count = estimate(value)
        except (ValueError, TypeError):
            continue
        if e.total * count + HOST_ALLOWANCE <= available:
            return [f"--config.{key}={value} ({_gib(e.total * count)})"]
    return []


def _twin_command(config: ConfigDict) -> str:
    """The smaller twin an experiment offers for the CPU, "" if none: in the docstring of the module that defines the
    run's own parts (``dataset.name``, ``model.name`` or ``task.name`` by import path, as experiments/gpt2_small.py's
    dataset is), the indented ``dtx train`` command after a paragraph that begins "The width-scaled twin"."""
    for block in ("dataset", "model", "task"):
        name = str(config[block].get("name", "")) if block in config else ""
        module = sys.modules.get(name.partition(":")[0]) if ":" in name else None  # imported by the run already
        paragraphs = re.split(r"\n[ \t]*\n", getattr(module, "__doc__", None) or "")
        for text, command in itertools.pairwise(paragraphs):
            if (re.match(r"\s*(the )?width-scaled twin", text, re.IGNORECASE) and command[:1].isspace()
                    and command.strip().startswith("dtx train")):
                return " ".join(command.replace("\\\n", " ").split())
    return ""


def _pipeline_estimate(pipeline, mesh, global_batch_size: int, example, optimizer: str):
    """A pipeline's per-device estimate (:func:`dtx.parallel.pipeline.costs.memory_estimate`), read from the built
    stages as :func:`dtx.parallel.pipeline.check.check_memory` reads it."""
    import numpy as np

    from dtx.parallel.pipeline import costs as pipeline_costs

    data = mesh.size // mesh.shape[STAGE_AXIS] // mesh.shape.get(mesh_lib.MODEL_AXIS, 1)
    micro = global_batch_size // data // pipeline.schedule.micro
    labels = int(np.prod(pipeline.plan.layers[-1].out_shape[:-1]))  # one per example, or per token of a sequence
    example_bytes = int(np.prod(example.shape[1:])) * np.dtype(example.dtype).itemsize + 4 * labels
    return pipeline_costs.memory_estimate(pipeline.plan, pipeline.schedule, micro=micro, data=data,
                                          optimizer=optimizer, example_bytes=example_bytes,
                                          zero_stage=pipeline.zero_stage)


def host_memory(proc: str = "/proc", cgroup: str = "/sys/fs/cgroup") -> HostMemory | None:
    """What this process may still allocate: the smaller of ``MemAvailable`` (``/proc/meminfo``: free memory plus
    the page cache the kernel can reclaim, Linux >= 3.14) and, under a cgroup memory limit (a container, a batch
    job's slice), the limit less the group's usage net of its reclaimable file cache, at every level of the
    process's group that sets one (v2 ``memory.max`` / ``memory.current``; v1 ``memory.limit_in_bytes`` /
    ``memory.usage_in_bytes``). Without ``/proc/meminfo`` (macOS, BSD): the available physical pages
    (``os.sysconf``), else the physical memory; ``None`` where none of these can be read (nothing is refused)."""
    found = []
    meminfo = _meminfo(os.path.join(proc, "meminfo"))
    if "MemAvailable" in meminfo:
        found.append(HostMemory(meminfo["MemAvailable"], f"MemAvailable in {os.path.join(proc, 'meminfo')}"))
    elif not meminfo:
        for name, what in (("SC_AVPHYS_PAGES", "available physical memory"), ("SC_PHYS_PAGES", "physical memory")):
            try:
                pages, size = os.sysconf(name), os.sysconf("SC_PAGE_SIZE")
            except (AttributeError, ValueError, OSError):  # not this OS's sysconf name (or no sysconf: Windows)
                continue
            if pages > 0 and size > 0:
                found.append(HostMemory(float(pages * size), f"{what}, os.sysconf({name!r})"))
                break
    found.extend(_cgroup_limits(proc, cgroup))
    return min(found, key=lambda h: h.available) if found else None


UNLIMITED = 2**60  # cgroup v1 writes "no limit" as the largest page-aligned int64 (9223372036854771712)


def _meminfo(path: str) -> dict[str, float]:
    """``/proc/meminfo``'s fields in bytes (its ``kB`` are KiB); {} if it cannot be read."""
    out = {}
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(":")
                parts = value.split()
                if parts and parts[0].isdigit():
                    out[key.strip()] = float(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    except OSError:
        return {}
    return out


def _cgroup_limits(proc: str, root: str) -> list[HostMemory]:
    """Per cgroup level with a memory limit, the limit less the usage its reclaimable file cache does not cover.

    ``/proc/self/cgroup`` names the process's group (v2 ``0::PATH``, v1 ``N:...memory...:PATH``); the group, each
    ancestor and, in a container whose namespace shows its own group as the root, the mount's root are read."""
    try:
        with open(os.path.join(proc, "self", "cgroup"), encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out, seen = [], set()
    for line in lines:
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and controllers == "":  # v2: the unified hierarchy (hybrid hosts mount it at unified/)
            bases = [root, os.path.join(root, "unified")]
            files = ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            bases = [os.path.join(root, "memory")]
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        parts = [part for part in path.strip("/").split("/") if part]
        for base in bases:
            for depth in range(len(parts), -1, -1):
                folder = os.path.join(base, *parts[:depth])
                if folder in seen:
                    continue
                seen.add(folder)
                limit = _read_number(os.path.join(folder, files[0]))
                if limit is None or limit >= UNLIMITED:
                    continue
                usage = _read_number(os.path.join(folder, files[1])) or 0.0
                cache = _stat(os.path.join(folder, "memory.stat")).get(files[2], 0.0)
                out.append(HostMemory(max(limit - max(usage - cache, 0.0), 0.0),
                                      f"the cgroup limit {_gib(limit)} in {os.path.join(folder, files[0])}, "
                                      f"less {_gib(max(usage - cache, 0.0))} in use"))
    return out


def _stat(path: str) -> dict[str, float]:
    """A cgroup's ``memory.stat`` (``name bytes`` per line); {} if it cannot be read."""
    try:
        with open(path, encoding="ascii") as f:
            pairs = [line.split() for line in f]
    except OSError:
        return {}
    return {pair[0]: float(pair[1]) for pair in pairs if len(pair) == 2 and pair[1].isdigit()}


def _read_number(path: str) -> float | None:
    """A cgroup file's one number; ``None`` if absent or ``max`` (no limit)."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    return float(text) if text.isdigit() else None


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.1f} MiB"
