"""Tests for dtx.mesh: meshes from (name, size) data, batch axes, size checks, CPU emulation."""
import jax
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import dtx
from dtx import mesh as mesh_lib
from dtx.mesh import (
    MeshError, batch_axes, batch_sharding, group_batch_axes, check_batch_size, data_parallel_size, emulate_cpu_devices,
    make_mesh, replicated, resolve_axis_sizes,
)


def _shard_rows(array):
    """Sorted (start, stop) row ranges of an array's shards, one entry per device."""
    return sorted((s.index[0].start or 0, s.index[0].stop or array.shape[0]) for s in array.addressable_shards)


# ------------------------------------------------------------------ make_mesh

def test_default_mesh_is_one_data_axis_over_all_devices():
    mesh = make_mesh([("data", -1)])
    assert mesh.axis_names == ("data",)
    assert dict(mesh.shape) == {"data": 8}
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())
    assert mesh.axis_types == (AxisType.Auto,)
    assert batch_axes(mesh) == ("data",)
    assert data_parallel_size(mesh) == 8
    # The default argument is the same mesh.
    assert dict(make_mesh().shape) == {"data": 8}


def test_data_model_mesh_splits_the_batch_over_every_axis():
    # Das et al. §3.3: data-parallel layers see 1/N of the batch on every one of the N devices;
    # only model-parallel layers gather their input inside the model group.
    mesh = make_mesh([("data", 4), ("model", 2)])
    assert mesh.axis_names == ("data", "model")
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    assert batch_axes(mesh) == ("data", "model")
    assert data_parallel_size(mesh) == 8
    assert group_batch_axes(mesh) == ("data",)


def test_wildcard_takes_the_devices_left_by_fixed_axes():
    mesh = make_mesh([("data", -1), ("model", 2)])
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    assert resolve_axis_sizes([("data", -1), ("model", 2)], 8) == (("data", 4), ("model", 2))
    assert resolve_axis_sizes([("a", 2), ("b", -1), ("c", 2)], 8) == (("a", 2), ("b", 2), ("c", 2))


def test_two_level_data_mesh_is_pure_data_parallelism():
    mesh = make_mesh([("node", 2), ("local", 4)])
    assert dict(mesh.shape) == {"node": 2, "local": 4}
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    assert batch_axes(mesh) == ("node", "local")
    assert data_parallel_size(mesh) == 8
    assert batch_sharding(mesh).spec == P(("node", "local"))


def test_one_device_mesh():
    device = jax.devices()[0]
    mesh = make_mesh([("data", -1)], devices=jax.devices()[:1])
    assert dict(mesh.shape) == {"data": 1}
    assert list(mesh.devices.flat) == [device]
    assert mesh.axis_types == (AxisType.Auto,)
    assert data_parallel_size(mesh) == 1
    check_batch_size(3, mesh)  # any positive batch fits one device
    x = jax.device_put(np.arange(6.0).reshape(3, 2), batch_sharding(mesh))
    assert [s.device for s in x.addressable_shards] == [device]
    np.testing.assert_array_equal(np.asarray(x), np.arange(6.0).reshape(3, 2))


def test_subset_of_devices_keeps_their_order():
    devices = jax.devices()[4:]
    mesh = make_mesh([("data", 2), ("model", -1)], devices=devices)
    assert dict(mesh.shape) == {"data": 2, "model": 2}
    assert list(mesh.devices.flat) == list(devices)


# --------------------------------------------------------------- shardings

def test_batch_sharding_splits_rows_over_every_axis():
    rows = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)

    mesh = make_mesh([("data", -1)])
    assert batch_sharding(mesh).spec == P(("data",))
    x = jax.device_put(rows, batch_sharding(mesh))
    assert _shard_rows(x) == [(2 * i, 2 * i + 2) for i in range(8)]
    assert all(s.data.shape == (2, 3) for s in x.addressable_shards)

    # With a model axis the batch is still split 8 ways: no two devices hold the same rows.
    mesh = make_mesh([("data", 4), ("model", 2)])
    assert batch_sharding(mesh).spec == P(("data", "model"))
    x = jax.device_put(rows, batch_sharding(mesh))
    assert _shard_rows(x) == [(2 * i, 2 * i + 2) for i in range(8)]
    assert all(s.data.shape == (2, 3) for s in x.addressable_shards)
    np.testing.assert_array_equal(np.asarray(x), rows)


def test_replicated_puts_the_whole_array_on_every_device():
    mesh = make_mesh([("data", 4), ("model", 2)])
    assert replicated(mesh).spec == P()
    assert replicated(mesh).mesh == mesh
    value = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = jax.device_put(value, replicated(mesh))
    assert len(x.addressable_shards) == 8
    for shard in x.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), value)


# ------------------------------------------------------- resolve_axis_sizes

@pytest.mark.parametrize(
    "spec, message",
    [
        ([("data", -1), ("model", -1)], r"at most one mesh axis may have size -1.*'data', 'model'"),
        ([("data", 0)], r"must be positive or -1, got \[\('data', 0\)\]"),
        ([("data", -2)], r"must be positive or -1, got \[\('data', -2\)\]"),
        ([("data", 3)], r"needs 3 devices but 8 are available.*set one size to -1"),
        ([("data", 4), ("model", 4)], r"needs 16 devices but 8 are available"),
        ([("data", 2), ("data", 4)], r"axis names must be unique, got \['data', 'data'\]"),
        ([("model", 3), ("data", -1)], r"fixed axes need a multiple of 3 devices, but there are 8"),
        ([], r"mesh spec is empty; use e\.g\. \[\('data', -1\)\]"),
    ],
)
def test_resolve_axis_sizes_errors_say_what_is_wrong(spec, message):
    with pytest.raises(MeshError, match=message):
        resolve_axis_sizes(spec, 8)
    with pytest.raises(MeshError, match=message):
        make_mesh(spec)


def test_mesh_error_is_a_value_error_and_exported():
    assert issubclass(MeshError, ValueError)
    assert dtx.MeshError is MeshError and dtx.make_mesh is make_mesh


# ----------------------------------------------------------- check_batch_size

def test_check_batch_size_accepts_multiples_of_the_data_parallel_size():
    mesh = make_mesh([("data", -1)])
    for size in (8, 16, 128, 1024):
        check_batch_size(size, mesh)


def test_check_batch_size_names_the_value_the_size_and_the_nearest_valid():
    mesh = make_mesh([("data", -1)])
    with pytest.raises(MeshError, match=r"global_batch_size=100\b") as e:
        check_batch_size(100, mesh)
    message = str(e.value)
    assert "data-parallel size 8" in message
    assert "96 or 104" in message
    assert "--config.global_batch_size=<multiple of 8>" in message


def test_check_batch_size_smaller_than_the_mesh_suggests_the_mesh_size():
    mesh = make_mesh([("data", -1)])
    for size in (3, 0, -5):
        with pytest.raises(MeshError, match=rf"global_batch_size={size}\b") as e:
            check_batch_size(size, mesh)
        message = str(e.value)
        assert "nearest valid sizes: 8." in message  # only 8: 0 is never a valid batch size
        assert "0 or" not in message


def test_model_axis_splits_the_batch_too():
    mesh = make_mesh([("data", 4), ("model", 2)])
    check_batch_size(16, mesh)
    with pytest.raises(MeshError, match=r"global_batch_size=12\b") as e:
        check_batch_size(12, mesh)  # 3 per data shard would leave the two model devices sharing rows
    message = str(e.value)
    assert "data-parallel size 8" in message
    assert "data=4 x model=2" in message
    assert "8 or 16" in message


def test_check_batch_size_names_the_key_it_was_given():
    mesh = make_mesh([("node", 2), ("local", 4)])
    with pytest.raises(MeshError, match=r"eval_batch_size=20\b.*--config\.eval_batch_size=<multiple of 8>") as e:
        check_batch_size(20, mesh, what="eval_batch_size")
    assert "node=2 x local=4" in str(e.value)
    assert "16 or 24" in str(e.value)


# -------------------------------------------------------- emulate_cpu_devices

def test_emulate_same_count_after_start_is_a_no_op():
    assert emulate_cpu_devices(8) is None
    assert dtx.emulate_cpu_devices(8) is None
    assert len(jax.devices()) == 8


def test_emulate_other_count_after_start_says_to_call_it_first():
    with pytest.raises(MeshError, match=r"already started with 8 CPU device\(s\); cannot switch to 4") as e:
        emulate_cpu_devices(4)
    message = str(e.value)
    assert "before any JAX computation" in message
    assert "--xla_force_host_platform_device_count=4" in message
    assert len(jax.devices()) == 8  # nothing changed


@pytest.mark.parametrize("count", [0, -1])
def test_emulate_non_positive_count_raises(count):
    with pytest.raises(MeshError, match=rf"count must be >= 1, got {count}"):
        emulate_cpu_devices(count)


def test_a_launched_job_of_one_process_is_not_multi_process(monkeypatch):
    """dtx launch passes the coordinator and the process count; a job of one process (an --elastic restart on a
    lost rank's survivor) joins jax.distributed but has no peer, so it runs as a plain dtx train does -- its SIGTERM
    its own flag's, not JAX's preemption sync point, which such a job once missed and trained on to the end
    (test_launch's elastic test, 2 of 4 suite runs). jax.distributed.initialize is recorded, not run: it would
    join this test process to a job."""
    joined = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: joined.append(kw))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setenv(mesh_lib.ENV_COORDINATOR, "127.0.0.1:1")
    monkeypatch.setenv(mesh_lib.ENV_PROCESS_ID, "0")
    for count, multi in (("1", False), ("2", True)):
        monkeypatch.setenv(mesh_lib.ENV_NUM_PROCESSES, count)
        assert mesh_lib.initialize_distributed() is multi
    assert [kw["num_processes"] for kw in joined] == [1, 2]
