"""Cluster descriptions for the performance model: physical quantities with their sources.

A :class:`Cluster` is what :mod:`dtx.perf.model` needs to predict an iteration: each
node's peak arithmetic rate and memory bandwidth (the two roofs of Williams,
Waterman & Patterson's roofline, CACM 2009), the network's latency α and bandwidth
(the α-β model of Thakur et al. 2005 that :mod:`dtx.comm.costmodel` implements), and the
fraction of peak the layer kernels sustain. A "node" is one compute unit of the
model: a dual-socket server in Das et al. (arXiv 1602.06709 §5), one GPU in the
NVLink preset (whose ``local_size`` GPUs share a faster intra-node link).

Every number below is a data-sheet or link-rate figure with its source in a comment,
never a value fitted to a measured speedup. The one assumption of the time model is **kernel
efficiency** (fraction of peak FLOP/s a well-tuned convolution or matrix-multiply
sustains on large operands): ``DEFAULT_EFFICIENCY = 0.7`` for both layer types, the
lower end of what vendor-tuned SGEMM/convolution libraries reach on large problems
(MKL on Haswell, cuBLAS/cuDNN on Hopper). It is an explicit, named input: override it
(``dtx simulate --efficiency conv=0.8,dense=0.6``) rather than read it as measured.
Each preset also carries one node's memory (``device_memory``: HBM of a GPU, DRAM
of a server), against which :mod:`dtx.perf.memory` checks plans; the Haswell node's
128 GiB is an assumed configuration, marked as such below.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from dtx.comm import costmodel

DEFAULT_EFFICIENCY = 0.7  # assumption, see module docstring; not fitted
LAYER_KINDS = ("conv", "dense")


class ClusterError(ValueError):
    """An unknown preset or a non-physical cluster number."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    """One homogeneous cluster.

    Attributes:
      name: preset name or "custom".
      node_flops: peak FLOP/s of one node at the training precision.
      memory_bandwidth: node memory bandwidth, bytes/s (the roofline's slanted roof).
      latency: inter-node message latency α, seconds.
      bandwidth: inter-node bandwidth per node and direction, bytes/s (β = 1/bandwidth).
      local_size: nodes (e.g. GPUs) per machine sharing the faster local link; 1 = none.
      local_latency / local_bandwidth: α and bandwidth of that local link.
      efficiency: fraction of ``node_flops`` each layer kind sustains ("conv", "dense").
      bytes_per_element: bytes of one activation / weight / gradient element.
      description: what the preset is, for tables and plots.
      device_memory: memory of one node (GPU: its HBM; server: its DRAM), bytes; ``inf`` = unknown,
        no limit (:mod:`dtx.perf.memory` checks plans against it).
    """

    name: str
    node_flops: float
    memory_bandwidth: float
    latency: float
    bandwidth: float
    local_size: int = 1
    local_latency: float = 0.0
    local_bandwidth: float = math.inf
    efficiency: Mapping[str, float] = dataclasses.field(
        default_factory=lambda: {kind: DEFAULT_EFFICIENCY for kind in LAYER_KINDS})
    bytes_per_element: int = 4
    description: str = ""
    device_memory: float = math.inf

    def __post_init__(self):
        for field in ("node_flops", "memory_bandwidth", "bandwidth", "local_bandwidth", "device_memory"):
            value = getattr(self, field)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ClusterError(f"cluster {self.name!r}: {field} must be a positive number, got {value!r}")
        for field in ("latency", "local_latency"):
            value = getattr(self, field)
            if not (isinstance(value, (int, float)) and 0 <= value < math.inf):
                raise ClusterError(f"cluster {self.name!r}: {field} must be >= 0 seconds, got {value!r}")
        if int(self.local_size) != self.local_size or self.local_size < 1:
            raise ClusterError(f"cluster {self.name!r}: local_size must be a positive integer, got {self.local_size!r}")
        if self.bytes_per_element not in (1, 2, 4, 8):
            raise ClusterError(f"bytes_per_element must be 1, 2, 4 or 8, got {self.bytes_per_element!r}")
        missing = sorted(set(LAYER_KINDS) - set(self.efficiency))
        if missing:
            raise ClusterError(f"cluster {self.name!r}: efficiency needs a value for {missing} (e.g. conv=0.7)")
        for kind, eff in self.efficiency.items():
            if not (isinstance(eff, (int, float)) and 0 < eff <= 1):
                raise ClusterError(f"efficiency[{kind!r}] must be in (0, 1], got {eff!r}")

    def allreduce_time(self, nbytes: float, p: int, local: int = 1, algorithm: str = "ring") -> float:
        """Seconds for an allreduce of ``nbytes`` per node over ``p`` nodes, ``local`` of them per machine.

        One level: :func:`dtx.comm.costmodel.predict_time` with this link's α, β. Two levels
        (``1 < local < p``): the Hitchhiker's hierarchical allreduce — reduce-scatter and
        all-gather on the local link (one ``algorithm`` allreduce's cost), the
        ``algorithm`` allreduce of the ``1/local`` shard across machines; each local
        node drives its own network port (rail-optimised, as in DGX H100). The reduction
        costs γ = 3 / memory bandwidth per byte (read two operands, write one).
        """
        if p <= 1 or nbytes <= 0:
            return 0.0
        gamma = 3.0 / self.memory_bandwidth
        local = math.gcd(max(1, min(int(local), self.local_size)), p)
        inter = costmodel.predict_time(algorithm, nbytes / local, p // local, self.latency, 1 / self.bandwidth, gamma)
        if local == 1:
            return inter
        intra = costmodel.predict_time(algorithm, nbytes, local, self.local_latency, 1 / self.local_bandwidth, gamma)
        return intra + (inter if p > local else 0.0)

    def replace(self, **changes) -> Cluster:
        return dataclasses.replace(self, **changes)


# Intel Xeon E5-2697 v3 (Haswell-EP, 2014), two sockets per node, FDR InfiniBand: the
# class of cluster Das et al. report on (arXiv 1602.06709 §5, Intel "Endeavor").
HASWELL_FDR = Cluster(
    name="haswell_fdr",
    # 2 sockets × 14 cores × 2.6 GHz × 32 SP FLOP/cycle (2 AVX2 FMA units × 8 lanes × 2)
    # = 2.33e12 (Intel ARK E5-2697 v3; the AVX base clock of 2.2 GHz would give 1.97e12).
    node_flops=2.3e12,
    # 2 sockets × 4 DDR4-2133 channels × 8 B × 2.133e9 /s = 1.365e11 B/s (Intel ARK: 68 GB/s per socket).
    memory_bandwidth=1.36e11,
    # FDR 4x: 4 lanes × 14.0625 Gb/s, 64b/66b coding → 54.5 Gb/s = 6.8e9 B/s per direction (IBTA spec).
    bandwidth=6.8e9,
    # MPI point-to-point latency over FDR incl. software, ~1-2 µs (Mellanox ConnectX-3 data sheet: < 1 µs hardware).
    latency=2e-6,
    # 128 GiB DDR4 per node: 8 × 16 GiB DDR4-2133 RDIMMs, one per channel. An assumption: a common
    # 2015-16 configuration of this board class (Intel ARK: up to 768 GB per socket); Das et al. do not
    # state the node memory of their cluster.
    device_memory=128 * 2**30,
    description="2016 dual-socket Xeon E5-2697 v3 (Haswell) + FDR InfiniBand, fp32",
)

# A 2016 10 Gigabit Ethernet cloud cluster, as in Das et al.'s AWS runs: c4.8xlarge-class
# nodes (two 9-core Xeon E5-2666 v3, Haswell) — the instance type is our assumption.
CLOUD_10GBE = Cluster(
    name="cloud_10gbe",
    # 18 cores × 2.9 GHz × 32 SP FLOP/cycle = 1.67e12 (AWS c4 spec: 2.9 GHz base E5-2666 v3).
    node_flops=1.67e12,
    # Same DDR4-2133 4-channel sockets as above: 2 × 68 GB/s.
    memory_bandwidth=1.36e11,
    # 10 Gb/s line rate = 1.25e9 B/s (IEEE 802.3ae).
    bandwidth=1.25e9,
    # TCP/IP through a virtualised NIC: tens of µs per message (EC2 enhanced networking, 2015-16 era).
    latency=50e-6,
    # 60 GiB per instance (AWS EC2 c4.8xlarge specification).
    device_memory=60 * 2**30,
    description="10 GbE cloud cluster, c4.8xlarge-class Haswell nodes, fp32",
)


def _hopper(name: str, hbm_bandwidth: float, memory: str, hbm_bytes: float) -> Cluster:
    return Cluster(
        name=name,
        device_memory=hbm_bytes,
        # Dense BF16 tensor-core peak of an H100/H200 SXM: 989 TFLOP/s (NVIDIA H100 data sheet,
        # 1,979 "with sparsity"; the H200 has the same GH100 compute).
        node_flops=989e12,
        memory_bandwidth=hbm_bandwidth,
        # NDR InfiniBand 400 Gb/s per port = 5.0e10 B/s, one ConnectX-7 port per GPU (DGX H100 compute fabric).
        bandwidth=5.0e10,
        # ~1 µs switch+HCA latency (NVIDIA Quantum-2 / ConnectX-7); NCCL adds a few µs per step.
        latency=5e-6,
        local_size=8,
        # NVLink 4: 18 links × 25 GB/s per direction = 450 GB/s per GPU per direction (900 GB/s bidirectional),
        # all-to-all through NVSwitch.
        local_bandwidth=4.5e11,
        # NCCL per-step latency inside an NVSwitch node, a few µs (physical hop < 1 µs).
        local_latency=3e-6,
        bytes_per_element=2,  # bf16 activations, weights and gradients
        description=f"8x{memory} NVLink/NVSwitch node + NDR InfiniBand (one 400 Gb/s port per GPU), bf16; node = GPU",
    )


PRESETS: dict[str, Cluster] = {
    c.name: c
    for c in (
        HASWELL_FDR,
        CLOUD_10GBE,
        # H100 SXM5: 80 GB HBM3 at 3.35 TB/s (NVIDIA H100 data sheet).
        _hopper("h100_nvlink_ndr", 3.35e12, "H100", 80e9),
        # H200 SXM: 141 GB HBM3e at 4.8 TB/s (NVIDIA H200 data sheet).
        _hopper("h200_nvlink_ndr", 4.8e12, "H200", 141e9),
    )
}


def get_cluster(name: str) -> Cluster:
    """The preset called ``name``; unknown names list the presets."""
    if name not in PRESETS:
        raise ClusterError(f"unknown cluster preset {name!r}; choose one of {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def from_settings(name: str, *, node_flops: float = 0.0, memory_bandwidth: float = 0.0, bandwidth: float = 0.0,
                  latency: float = -1.0) -> Cluster | None:
    """The cluster of ``config.cluster`` (the simulated clock's block): ``None`` when ``name`` is empty.

    ``name`` is a preset whose numbers the positive values replace (0 keeps the preset's;
    ``latency`` >= 0 replaces, -1 keeps), or ``custom``, which needs all four. Errors name
    the ``cluster.*`` key and the fix.
    """
    if not name:
        return None
    given = {"node_flops": node_flops, "memory_bandwidth": memory_bandwidth, "bandwidth": bandwidth}
    for key, value in given.items():
        if value < 0 or not math.isfinite(value):
            raise ClusterError(f"cluster.{key}={value!r} must be a positive number (0: the preset's)")
    if latency < 0 and latency != -1 or not math.isfinite(latency):
        raise ClusterError(f"cluster.latency={latency!r} must be >= 0 seconds (-1: the preset's)")
    changes = {key: float(value) for key, value in given.items() if value > 0}
    if latency >= 0:
        changes["latency"] = float(latency)
    if name == "custom":
        missing = [f"cluster.{key}" for key in (*given, "latency") if key not in changes]
        if missing:
            raise ClusterError(f"cluster.name='custom' needs {', '.join(missing)} (e.g. --config.cluster.bandwidth="
                               f"1.25e9 bytes/s, --config.cluster.latency=5e-5 s); or name a preset: "
                               f"{', '.join(sorted(PRESETS))}")
        return Cluster("custom", **changes, description="custom cluster (config.cluster)")
    if name not in PRESETS:
        raise ClusterError(f"cluster.name={name!r} is unknown; choose a preset ({', '.join(sorted(PRESETS))}), "
                           "'custom' with cluster.node_flops/memory_bandwidth/bandwidth/latency, or '' for no clock")
    return PRESETS[name].replace(**changes)
