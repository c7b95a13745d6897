"""Device meshes built from data, CPU-device emulation, and batch-size checks.

A mesh is described as data — a sequence of ``(axis_name, size)`` pairs such as
``[("data", -1)]`` or ``[("data", 4), ("model", 2)]`` — so experiments can state
their topology in a config file. One size may be ``-1``: it takes
whatever devices the other axes leave.

Every axis carries the batch: data parallelism (the Hitchhiker's Guide §3.1; Das
et al. §2) splits the global batch over all of them, so a data-parallel layer sees
``1/N`` of the batch on each of the ``N`` devices whatever the mesh's shape. A 2D
data mesh such as ``[("node", 2), ("local", 4)]`` is thus pure data parallelism,
laid out so hierarchical all-reduce can use the two levels. The ``model`` axis
means more only to model-parallel layers (:mod:`dtx.parallel`): there it is the
group of Das et al. §3.3 that gathers a layer's input and splits its weights.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MODEL_AXIS = "model"

MeshSpec = Sequence[tuple[str, int]]


class MeshError(ValueError):
    """A mesh description or batch size that does not fit the devices."""


def emulate_cpu_devices(count: int) -> None:
    """Make the CPU backend expose ``count`` devices (an emulated mesh).

    Must run before JAX starts its backends — at the top of a script or the first
    cell of a notebook. Calling it again with the same count is a no-op; a
    different count after start-up raises, since XLA cannot resize a live backend.
    Accelerator backends are unaffected: on a GPU/TPU host the mesh still uses the
    accelerators.
    """
    if count < 1:
        raise MeshError(f"emulate_cpu_devices: count must be >= 1, got {count}")
    if _backends_started():
        have = len(jax.devices("cpu"))
        if have != count:
            raise MeshError(
                f"JAX already started with {have} CPU device(s); cannot switch to {count}. "
                "Call dtx.emulate_cpu_devices(...) before any JAX computation (in a notebook: "
                "restart the kernel and call it in the first cell), or set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={count} before starting Python."
            )
        return
    jax.config.update("jax_num_cpu_devices", count)


def _backends_started() -> bool:
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - private module moved; assume started
        return True
    return bool(xla_bridge.backends_are_initialized())


def resolve_axis_sizes(spec: MeshSpec, num_devices: int) -> tuple[tuple[str, int], ...]:
    """Replace a ``-1`` size and check the product equals ``num_devices``."""
    spec = tuple((str(name), int(size)) for name, size in spec)
    if not spec:
        raise MeshError("mesh spec is empty; use e.g. [('data', -1)]")
    names = [name for name, _ in spec]
    if len(set(names)) != len(names):
        raise MeshError(f"mesh axis names must be unique, got {names}")
    wildcard = [name for name, size in spec if size == -1]
    if len(wildcard) > 1:
        raise MeshError(f"at most one mesh axis may have size -1, got {wildcard} in {list(spec)}")
    bad = [(name, size) for name, size in spec if size == 0 or size < -1]
    if bad:
        raise MeshError(f"mesh axis sizes must be positive or -1, got {bad}")
    fixed = math.prod(size for _, size in spec if size != -1)
    if wildcard:
        if num_devices % fixed:
            raise MeshError(
                f"mesh {list(spec)}: the fixed axes need a multiple of {fixed} devices, "
                f"but there are {num_devices}"
            )
        spec = tuple((name, num_devices // fixed if size == -1 else size) for name, size in spec)
    elif fixed != num_devices:
        raise MeshError(
            f"mesh {list(spec)} needs {fixed} devices but {num_devices} are available; "
            "make the sizes multiply to the device count or set one size to -1"
        )
    return spec


def make_mesh(spec: MeshSpec = (("data", -1),), devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build a :class:`jax.sharding.Mesh` from ``(name, size)`` pairs.

    Axes are ``AxisType.Auto`` so both the ``shard_map`` and the ``jit`` driver
    accept plainly placed inputs. ``devices`` defaults to all devices of the job
    (every process's, under ``jax.distributed``).
    """
    devices = list(jax.devices() if devices is None else devices)
    spec = resolve_axis_sizes(spec, len(devices))
    names = tuple(name for name, _ in spec)
    shape = tuple(size for _, size in spec)
    if len(devices) == len(jax.devices()):
        # Let JAX pick a topology-aware device order (matters on TPU/GPU slices).
        return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names), devices=devices)
    return Mesh(np.asarray(devices).reshape(shape), names, axis_types=(AxisType.Auto,) * len(names))


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes the batch (of data-parallel layers) is split over: every axis.

    Leaving one out would make the devices along it compute the same examples
    twice: with a ``model`` axis of size ``G``, every convolution ``G`` times over.
    ``model`` comes last, whatever its place in the mesh: then the ``G`` devices of a
    model group hold adjacent rows, and gathering them inside the group yields the
    group's rows in order.
    """
    return group_batch_axes(mesh) + ((MODEL_AXIS,) if MODEL_AXIS in mesh.axis_names else ())


def group_batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes a model-parallel layer's batch is split over: every axis but ``model``.

    The ``G`` devices of a model group share their examples at such a layer (its
    input is gathered inside the group) and each computes ``1/G`` of its outputs.
    """
    return tuple(name for name in mesh.axis_names if name != MODEL_AXIS)


def data_parallel_size(mesh: Mesh) -> int:
    """Number of batch shards (product of the batch axes' sizes): every device."""
    return math.prod(mesh.shape[name] for name in batch_axes(mesh))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension split over all batch axes; other dims whole."""
    return NamedSharding(mesh, PartitionSpec(batch_axes(mesh)))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def check_batch_size(batch_size: int, mesh: Mesh, what: str = "global_batch_size") -> None:
    """Fail early, naming the nearest valid sizes, when the batch can't be split evenly."""
    shards = data_parallel_size(mesh)
    if batch_size < 1 or batch_size % shards:
        lower = (max(batch_size, 0) // shards) * shards
        nearest = [size for size in (lower, lower + shards) if size >= shards]
        axes = " x ".join(f"{name}={mesh.shape[name]}" for name in batch_axes(mesh))
        raise MeshError(
            f"{what}={batch_size} is not divisible by the data-parallel size {shards} "
            f"(mesh axes {axes}); nearest valid sizes: {' or '.join(map(str, nearest))}. "
            f"Set {what} (the argument, or --config.{what}=<multiple of {shards}>) to a multiple of {shards}."
        )


# Environment set by `dtx launch` for each process it starts.
ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = "DTX_COORDINATOR", "DTX_NUM_PROCESSES", "DTX_PROCESS_ID"
# Variables by which jax.distributed.initialize() recognises a cluster launch on its own.
_CLUSTER_ENV = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES", "JAX_COORDINATOR_ADDRESS")


def initialize_distributed(mode: str = "auto", heartbeat_timeout_seconds: int = 30,
                           initialization_timeout_seconds: int = 300) -> bool:
    """Join a multi-process JAX job (``jax.distributed``), before any JAX computation.

    ``dtx launch`` passes the coordinator, process count and rank in ``DTX_*``
    variables; on clusters (SLURM, Open MPI, Kubernetes/TPU pods) JAX's own
    auto-detection fills them in (``jax.distributed.initialize()`` with no
    arguments). ``mode="off"`` never initializes. Returns whether this process is
    part of a multi-process job. A process not every rank has joined within
    ``initialization_timeout_seconds`` fails (so one that never registers cannot hang the rest).
    """
    if mode not in ("auto", "off"):
        raise MeshError(f"distributed={mode!r}; choose 'auto' or 'off'")
    if mode == "off" or jax.distributed.is_initialized():
        return jax.distributed.is_initialized()
    if os.environ.get(ENV_COORDINATOR):
        jax.distributed.initialize(
            coordinator_address=os.environ[ENV_COORDINATOR],
            num_processes=int(os.environ[ENV_NUM_PROCESSES]),
            process_id=int(os.environ[ENV_PROCESS_ID]),
            heartbeat_timeout_seconds=heartbeat_timeout_seconds,
            initialization_timeout=int(initialization_timeout_seconds),
        )
        # A job of one process (an --elastic restart on a lost rank's survivor) has joined but has no peer: it
        # runs as a plain dtx train does. JAX's preemption sync point, asked every step there, once missed the
        # step it chose after catching a SIGTERM, and the run trained on to its end instead of saving.
        return int(os.environ[ENV_NUM_PROCESSES]) > 1
    slurm_tasks = int(os.environ.get("SLURM_NTASKS", "1"))
    if any(k in os.environ for k in _CLUSTER_ENV) and (slurm_tasks > 1 or "SLURM_JOB_ID" not in os.environ):
        jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_timeout_seconds,
                                   initialization_timeout=int(initialization_timeout_seconds))
        return jax.process_count() > 1
    return False
