"""dtx.perf.clusters: the presets' numbers are their data-sheet arithmetic, the two-level allreduce is the sum of its
levels, and non-physical numbers are refused naming the field. Pure Python, no devices."""
import math

import pytest

from dtx.comm import costmodel
from dtx.perf.clusters import PRESETS, Cluster, ClusterError, get_cluster

HASWELL = get_cluster("haswell_fdr")


def test_presets_are_their_data_sheet_arithmetic():
    assert set(PRESETS) == {"haswell_fdr", "cloud_10gbe", "h100_nvlink_ndr", "h200_nvlink_ndr"}
    assert 2 * 14 * 2.6e9 * 32 == pytest.approx(HASWELL.node_flops, rel=0.02)  # sockets x cores x GHz x FLOP/cycle
    assert 2 * 4 * 8 * 2.133e9 == pytest.approx(HASWELL.memory_bandwidth, rel=0.01)  # 2 sockets x 4 DDR4-2133 channels
    assert 4 * 14.0625e9 * 64 / 66 / 8 == pytest.approx(HASWELL.bandwidth, rel=0.01)  # FDR 4x, 64b/66b
    assert get_cluster("cloud_10gbe").bandwidth == 10e9 / 8
    h100, h200 = get_cluster("h100_nvlink_ndr"), get_cluster("h200_nvlink_ndr")
    assert h100.node_flops == h200.node_flops == 989e12 and h100.bytes_per_element == 2
    assert (h100.local_size, h100.local_bandwidth, h100.bandwidth) == (8, 18 * 25e9, 400e9 / 8)
    assert (h100.device_memory, h200.device_memory) == (80e9, 141e9)
    assert all(set(c.efficiency) == {"conv", "dense"} for c in PRESETS.values())


def test_two_level_allreduce_is_the_sum_of_its_levels():
    h100 = get_cluster("h100_nvlink_ndr")
    nbytes, p, gamma = 1 << 20, 16, 3.0 / h100.memory_bandwidth
    inside = costmodel.predict_time("ring", nbytes, 8, h100.local_latency, 1 / h100.local_bandwidth, gamma)
    across = costmodel.predict_time("ring", nbytes / 8, 2, h100.latency, 1 / h100.bandwidth, gamma)
    assert h100.allreduce_time(nbytes, p, local=8) == pytest.approx(inside + across)
    assert h100.allreduce_time(nbytes, p) == pytest.approx(
        costmodel.predict_time("ring", nbytes, p, h100.latency, 1 / h100.bandwidth, gamma))  # local=1: one level
    assert h100.allreduce_time(nbytes, 1) == h100.allreduce_time(0, p) == 0.0


def test_non_physical_numbers_are_refused_naming_the_field():
    with pytest.raises(ClusterError, match=r"unknown cluster preset 'dgx'; choose one of cloud_10gbe, h100"):
        get_cluster("dgx")
    with pytest.raises(ClusterError, match=r"bandwidth must be a positive number, got -1"):
        Cluster("x", node_flops=1e12, memory_bandwidth=1e11, latency=1e-6, bandwidth=-1)
    with pytest.raises(ClusterError, match=r"latency must be >= 0 seconds, got inf"):
        HASWELL.replace(latency=math.inf)
    with pytest.raises(ClusterError, match=r"efficiency\['conv'\] must be in \(0, 1\], got 1.5"):
        HASWELL.replace(efficiency={"conv": 1.5, "dense": 0.7})
    with pytest.raises(ClusterError, match=r"efficiency needs a value for \['dense'\]"):
        HASWELL.replace(efficiency={"conv": 0.5})
