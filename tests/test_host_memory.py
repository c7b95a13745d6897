"""host_memory_check: on the CPU backend every emulated device lives in the host's memory, so a run whose
estimate (dtx.perf.memory) times its devices exceeds what the host has available is refused before compiling,
naming the numbers; dtx.run.memory_check.host_memory reads what is available (/proc/meminfo, cgroup limits)."""

from __future__ import annotations

import os
import re

import jax
import pytest

from dtx import config as config_lib
from dtx.run import memory_check, setup
from dtx.run.trainer import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIGITS_MLP = os.path.join(REPO, "experiments", "digits_mlp.py")
GPT2_SMALL = os.path.join(REPO, "experiments", "gpt2_small.py")
# One hidden layer of 256 under Adam at batch 128: 0.37 MiB a device by the estimate, 1.5 MiB on 4 devices.
MODEST = ("--config.num_steps=12", "--config.model.features=(256,)", "--config.progress=False")
MIB = 2**20

_compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, *_, **__: _compiles.append(name) if name.endswith("backend_compile_duration") else None)


def _host(monkeypatch, available: float) -> None:
    """The host's available memory, as the check reads it, set to ``available`` bytes."""
    monkeypatch.setattr(memory_check, "host_memory",
                        lambda: memory_check.HostMemory(float(available), "a test's figure"))


def _estimate(monkeypatch) -> list:
    """Records the per-device estimate check_host is given (the figure the refusal multiplies)."""
    seen, check = [], memory_check.check_host

    def spy(config, mine, *args, **kwargs):
        seen.append(mine.total)
        return check(config, mine, *args, **kwargs)

    monkeypatch.setattr(memory_check, "check_host", spy)
    return seen


def _gib_or_mib(text: str) -> float:
    number, unit = text.split()
    return float(number) * (2**30 if unit == "GiB" else MIB)


def test_a_cpu_run_that_outgrows_the_host_is_refused_before_compiling(tmp_path, monkeypatch):
    """8 devices x 0.37 MiB, plus the 0.25 GiB allowance, against 0.25 GiB + 2 MiB available: refused inside
    dtx.train before its step is built or anything compiles, naming the estimate per device, the total for 8
    devices, the host's figure and the fix that fits (4 devices). One device's estimate alone would fit: the
    refusal is the product."""
    seen = _estimate(monkeypatch)
    _host(monkeypatch, memory_check.HOST_ALLOWANCE + 2 * MIB)
    monkeypatch.setattr(setup, "make_step", lambda *a, **k: pytest.fail("the step was built before the refusal"))
    before = len(_compiles)
    with pytest.raises(config_lib.ConfigError) as refused:
        train(config_lib.load(DIGITS_MLP, MODEST), tmp_path)
    assert len(_compiles) == before, "a run that cannot fit must be refused before anything is compiled"
    message = str(refused.value)
    found = re.search(r"needs about ([\d.]+ [MG]iB) per device .* × 8 CPU devices = ([\d.]+ [MG]iB), plus "
                      r"([\d.]+ [MG]iB) for compiling .*but ([\d.]+ [MG]iB) is available \(a test's figure\)", message)
    assert found, message
    per_device, total, allowance, available = (_gib_or_mib(value) for value in found.groups())
    assert seen and abs(per_device - seen[0]) < 0.05 * MIB and seen[0] < 2 * MIB < 8 * seen[0]  # one would fit
    assert abs(total - 8 * seen[0]) < 0.05 * MIB, message  # the product, to the message's rounding
    assert allowance == memory_check.HOST_ALLOWANCE  # 0.25 GiB, exact in the message's two decimals
    assert abs(available - (memory_check.HOST_ALLOWANCE + 2 * MIB)) <= 0.005 * 2**30
    # The parameters and Adam's state are most of it, replicated per device: fewer devices fit, a smaller batch not.
    assert "--config.emulate_cpu_devices=4" in message and "--config.global_batch_size=" not in message, message
    assert "--config.host_memory_check=False" in message and "memory_limit caps each device" in message


def test_enough_host_memory_or_the_check_turned_off_is_not_refused(monkeypatch):
    """The same run with 8 x the estimate + the allowance + 1 MiB available builds its parts; with 1 MiB less than
    that it is refused; with host_memory_check=False nothing is refused, whatever the host has."""
    seen = _estimate(monkeypatch)
    config = config_lib.load(DIGITS_MLP, MODEST)
    mesh = setup.make_mesh(config)
    inputs = setup.load_data(config, mesh)

    def build(config):
        return setup.build_parts(config, mesh, inputs.dataset, inputs.loader.steps_per_epoch, inputs.num_steps)

    _host(monkeypatch, 0)
    with pytest.raises(config_lib.ConfigError, match="× 8 CPU devices"):
        build(config)
    need = 8 * seen[0] + memory_check.HOST_ALLOWANCE
    _host(monkeypatch, need + MIB)
    build(config)
    _host(monkeypatch, need - MIB)
    with pytest.raises(config_lib.ConfigError, match="× 8 CPU devices"):
        build(config)
    build(config_lib.override(config, host_memory_check=False))


def test_a_pipeline_is_held_against_the_host_by_its_own_estimate(monkeypatch):
    """A pipeline (2 stages x 4 data) is estimated by dtx.parallel.pipeline.costs.memory_estimate, as memory_limit estimates it:
    refused on a host with nothing available, naming 8 devices; built with 1 GiB more than the allowance."""
    overrides = ("--config.parallel.name=pipeline", '--config.mesh=(("stage", 2), ("data", 4))',
                 "--config.pipeline.microbatches=4", "--config.global_batch_size=64", "--config.model.features=(32, 16)")
    config = config_lib.load(DIGITS_MLP, MODEST[:1] + overrides)
    mesh = setup.make_mesh(config)
    inputs = setup.load_data(config, mesh)

    def build():
        return setup.build_parts(config, mesh, inputs.dataset, inputs.loader.steps_per_epoch, inputs.num_steps)

    seen = _estimate(monkeypatch)
    _host(monkeypatch, 0)
    with pytest.raises(config_lib.ConfigError, match=r"× 8 CPU devices .* a smaller global_batch_size or fewer"):
        build()
    assert seen and 0 < seen[0] < 2**20  # bytes a device: the stage's rows and the kept inputs of a tiny MLP
    _host(monkeypatch, memory_check.HOST_ALLOWANCE + 2**30)
    build()


def test_gpt2_small_on_8_cpu_devices_is_refused_naming_its_width_scaled_twin(monkeypatch):
    """experiments/gpt2_small.py at full size (5.69 GiB a device by the estimate: 8 x 5.69 = 45.5 GiB) against a
    24 GiB host, the case the kernel killed without a word: refused, and the fix named is the experiment's own
    twin, its docstring's command. Only the parts are built (shapes; nothing is allocated or compiled)."""
    _host(monkeypatch, 24 * 2**30)
    config = config_lib.load(GPT2_SMALL, ["--config.num_steps=30"])
    mesh = setup.make_mesh(config)
    inputs = setup.load_data(config, mesh)
    with pytest.raises(config_lib.ConfigError) as refused:
        setup.build_parts(config, mesh, inputs.dataset, inputs.loader.steps_per_epoch, inputs.num_steps)
    message = str(refused.value)
    assert "× 8 CPU devices" in message and "24.00 GiB is available" in message
    assert ("width-scaled twin (its docstring): dtx train experiments/gpt2_small.py --config.model.num_layers=2 "
            "--config.model.d_model=64 --config.model.num_heads=4 --config.model.max_len=64 "
            "--config.dataset.seq_len=64 --config.global_batch_size=16 --config.optimizer.learning_rate=3e-3 "
            "--config.optimizer.warmup_steps=2 --config.num_steps=12;") in message, message


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_host_memory_reads_meminfo_and_the_tightest_cgroup_limit(tmp_path, monkeypatch):
    """MemAvailable alone; under a v2 limit the limit less the usage its inactive file cache does not cover
    (4 GiB - (1.5 - 0.5) GiB = 3 GiB < 8 GiB), the tightest level of the group's ancestors winning; v1 reads
    memory.limit_in_bytes, its "no limit" value ignored; without /proc/meminfo, os.sysconf's pages; nothing
    readable: None (nothing is refused)."""
    gib = 2**30
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    _write(proc / "meminfo", "MemTotal:       24683784 kB\nMemFree:  100 kB\nMemAvailable:    8388608 kB\n")
    read = memory_check.host_memory(str(proc), str(cgroup))
    assert read.available == 8 * gib and "MemAvailable" in read.source

    _write(proc / "self" / "cgroup", "0::/jobs/mine\n")
    _write(cgroup / "jobs" / "mine" / "memory.max", "max\n")
    _write(cgroup / "jobs" / "memory.max", f"{4 * gib}\n")
    _write(cgroup / "jobs" / "memory.current", f"{int(1.5 * gib)}\n")
    _write(cgroup / "jobs" / "memory.stat", f"anon 123\ninactive_file {gib // 2}\nactive_file 7\n")
    read = memory_check.host_memory(str(proc), str(cgroup))
    assert read.available == 3 * gib and "jobs/memory.max" in read.source, read

    _write(proc / "self" / "cgroup", "5:cpu,cpuacct:/\n4:memory:/slice/task\n")  # v1
    _write(cgroup / "memory" / "slice" / "task" / "memory.limit_in_bytes", "9223372036854771712\n")  # no limit
    _write(cgroup / "memory" / "slice" / "memory.limit_in_bytes", f"{2 * gib}\n")
    _write(cgroup / "memory" / "slice" / "memory.usage_in_bytes", f"{gib}\n")
    _write(cgroup / "memory" / "slice" / "memory.stat", f"total_inactive_file {gib // 4}\n")
    read = memory_check.host_memory(str(proc), str(cgroup))
    assert read.available == 1.25 * gib and "memory.limit_in_bytes" in read.source, read

    (proc / "meminfo").unlink()
    (proc / "self" / "cgroup").unlink()
    pages = {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(os, "sysconf", lambda name: pages[name] if name in pages else (_ for _ in ()).throw(
        ValueError(name)))
    read = memory_check.host_memory(str(proc), str(cgroup))
    assert read.available == 4096 * 1000 and "os.sysconf" in read.source

    monkeypatch.setattr(os, "sysconf", lambda name: (_ for _ in ()).throw(ValueError(name)))
    assert memory_check.host_memory(str(proc), str(cgroup)) is None
