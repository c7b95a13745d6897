"""Device meshes built from data, CPU-device emulation, and batch-size checks.

A mesh is described as data — a sequence of ``(axis_name, size)`` pairs such as
``[("data", -1)]`` or ``[("data", 4), ("model", 2)]`` — so experiments can state
their topology in a config file. One size may be ``-1``: it takes
whatever devices the other axes leave.

Each axis name says what it does, declared by the parallelism that owns it (:class:`Axis`,
:data:`AXES`): ``data`` (and ``node``/``local``, the two levels hierarchical all-reduce uses)
holds data replicas; ``fsdp`` holds replicas whose train state is split over it (ZeRO, FSDP);
``stage`` holds a pipeline's stages; ``model`` a model-parallel group. A name no parallelism
declares is refused (:func:`check_axes`), naming those that exist, so a typo or an axis of a
parallelism not built cannot silently split the batch.

Batches are placed split over every axis whose devices do not share one stream of examples
(:func:`batch_axes`): data parallelism (the Hitchhiker's Guide §3.1; Das et al. §2) splits the
global batch over all of them, so a data-parallel layer sees ``1/N`` of the batch on each of the
``N`` devices whatever the mesh's shape. A 2D data mesh such as ``[("node", 2), ("local", 4)]``
is thus pure data parallelism, laid out so hierarchical all-reduce can use the two levels. The
``model`` and ``stage`` axes gather a data shard's rows inside their group where they need them:
the group of Das et al. §3.3 that gathers a layer's input and splits its weights, a pipeline's
stages that share a data shard.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MODEL_AXIS = "model"
FSDP_AXIS = "fsdp"

MeshSpec = Sequence[tuple[str, int]]


class MeshError(ValueError):
    """A mesh description or batch size that does not fit the devices."""


@dataclasses.dataclass(frozen=True)
class Axis:
    """What a mesh axis does, declared once by the parallelism that owns it.

    Attributes:
      name: the axis name in meshes and ``--config.mesh``.
      parallelism: the parallelism that declares it (its package or layout).
      replicas: whether its devices are data replicas (different examples, the same model): the gradient is
        reduced over it. Otherwise its devices share a data shard's examples (a pipeline's stages, a model group).
      state: whether the train state (parameters, gradients, optimizer state) is split over it: ZeRO and FSDP
        over an ``fsdp`` axis; its stage is that parallelism's setting.
      batch: whether dtx places batches split over it (:func:`batch_axes`). An axis whose devices need the whole
        sequence or the same rows without gathering them (a future ``context`` axis) declares False.
      doc: one line for errors and docs.
    """

    name: str
    parallelism: str
    replicas: bool
    state: bool = False
    batch: bool = True
    doc: str = ""


AXES: dict[str, Axis] = {}


def declare_axis(axis: Axis) -> Axis:
    """Register ``axis`` (a parallelism's module does this at import); the same declaration again is a no-op."""
    if axis.name in AXES and AXES[axis.name] != axis:
        raise MeshError(f"mesh axis {axis.name!r} is declared twice: by {AXES[axis.name].parallelism} and by "
                        f"{axis.parallelism}")
    AXES[axis.name] = axis
    return axis


# Data parallelism is every mesh's default: its axes are declared here, the others by their parallelisms.
for _name, _doc in (("data", "data replicas"), ("node", "data replicas, the nodes of hierarchical all-reduce"),
                    ("local", "data replicas, the devices of a node in hierarchical all-reduce")):
    declare_axis(Axis(_name, "data", replicas=True, doc=_doc))


def check_axes(names: Sequence[str], where: str = "mesh") -> None:
    """Refuse an axis name no parallelism declares, naming the declared ones and what each does."""
    unknown = [name for name in names if name not in AXES]
    if unknown:
        known = "; ".join(f"{a.name!r} ({a.parallelism}: {a.doc})" for a in AXES.values())
        raise MeshError(f"{where} axis {', '.join(map(repr, unknown))} is declared by no parallelism, so dtx cannot "
                        f"tell whether it splits the batch or the model; the axes are: {known}. Rename it "
                        "(e.g. --config.mesh='((\"data\", -1),)') or declare it with dtx.mesh.declare_axis")


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
    """The mesh axes batches are placed split over: every declared axis that takes the batch (:class:`Axis`).

    Leaving one out would make the devices along it compute the same examples
    twice: with a ``model`` axis of size ``G``, every convolution ``G`` times over.
    ``model`` comes last, whatever its place in the mesh: then the ``G`` devices of a
    model group hold adjacent rows, and gathering them inside the group yields the
    group's rows in order.
    """
    return group_batch_axes(mesh) + ((MODEL_AXIS,) if MODEL_AXIS in mesh.axis_names else ())


def group_batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes a model-parallel layer's batch is split over: every batch axis but ``model``.

    The ``G`` devices of a model group share their examples at such a layer (its
    input is gathered inside the group) and each computes ``1/G`` of its outputs.
    """
    check_axes(mesh.axis_names)
    return tuple(name for name in mesh.axis_names if name != MODEL_AXIS and AXES[name].batch)


def replica_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes whose devices are data replicas (the gradient is reduced over them): ``data``, ``node``,
    ``local``, ``fsdp``; not a pipeline's ``stage`` nor a ``model`` group."""
    check_axes(mesh.axis_names)
    return tuple(name for name in mesh.axis_names if AXES[name].replicas)


def state_axes(mesh: Mesh, over: Sequence[str] | None = None) -> tuple[str, ...]:
    """The axes ZeRO/FSDP split the train state over: the mesh's ``fsdp`` axes (the state axes), or where it has
    none every axis of ``over`` (default :func:`batch_axes`): ``parallel.name=fsdp`` (zero1, zero2) on a plain
    data mesh splits the state over every device, as ZeRO does. With both a ``data`` and an ``fsdp`` axis the
    state is split over ``fsdp`` and replicated over ``data`` (hybrid sharding: HSDP)."""
    check_axes(mesh.axis_names)
    split = tuple(name for name in mesh.axis_names if AXES[name].state)
    return split or tuple(batch_axes(mesh) if over is None else over)


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
