"""dtx.perf.flops: XLA's FLOP counts (per device, loops once), the peak table, MFU in the run's records."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dtx import config as config_lib
from dtx.perf import flops
from dtx.run import metrics
from dtx import mesh as mesh_lib
from dtx.run.trainer import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(REPO, "experiments", "digits_mlp.py")
TINY = ("--config.num_steps=12", "--config.model.features=(32,)", "--config.log_every=4", "--config.progress=False")
MATMUL_FLOPS = 2 * 128 * 64 * 32  # (128, 64) @ (64, 32)

_compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, *_, **__: _compiles.append(name) if name.endswith("backend_compile_duration") else None
)


class _Compiled:
    def __init__(self, analysis):
        self.analysis = analysis

    def cost_analysis(self):
        if isinstance(self.analysis, Exception):
            raise self.analysis
        return self.analysis


def test_cost_analysis_forms_across_jax_releases():
    assert flops.cost_analysis(_Compiled({"flops": 10.0, "bytes accessed": 4.0})) == {"flops": 10.0,
                                                                                      "bytes accessed": 4.0}
    assert flops.cost_analysis(_Compiled([{"flops": 10.0}, {"flops": 5.0}])) == {"flops": 15.0}  # older jax
    assert flops.cost_analysis(_Compiled(None)) == {}
    assert flops.cost_analysis(_Compiled(NotImplementedError("no cost model"))) == {}
    assert flops.compiled_flops(_Compiled({"bytes accessed": 4.0})) is None
    assert flops.compiled_flops(_Compiled([{"flops": 0.0}])) is None


def test_xla_reports_flops_per_device_for_shard_map_and_jit():
    mesh = mesh_lib.make_mesh([("data", -1)])
    w, x = jnp.ones((64, 32)), jnp.ones((128, 64))
    one_device = flops.step_flops(jax.jit(lambda w, x: (x @ w).sum()), w, x)
    mapped = jax.jit(jax.shard_map(lambda w, x: jax.lax.psum((x @ w).sum(), "data"), mesh=mesh,
                                   in_specs=(P(), P("data")), out_specs=P()))
    per_device_map = flops.step_flops(mapped, w, x)
    partitioned = jax.jit(lambda w, x: (x @ w).sum(),
                          in_shardings=(mesh_lib.replicated(mesh), mesh_lib.batch_sharding(mesh)))
    per_device_jit = flops.step_flops(partitioned, w, x)
    assert one_device == pytest.approx(MATMUL_FLOPS, rel=0.02)
    assert per_device_map == pytest.approx(MATMUL_FLOPS / 8, rel=0.02)
    assert per_device_jit == pytest.approx(MATMUL_FLOPS / 8, rel=0.02)


def test_xla_counts_a_loop_body_once():
    # Documented in dtx.perf.flops: why MFU is skipped under gradient accumulation (a scan).
    w = jnp.ones((64, 32))
    looped = jax.jit(lambda xs: jax.lax.scan(lambda c, x: (c + (x @ w).sum(), None), 0.0, xs)[0])
    assert flops.step_flops(looped, jnp.ones((8, 128, 64))) == pytest.approx(MATMUL_FLOPS, rel=0.05)


def test_step_flops_fills_the_cache_the_first_call_uses():
    f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
    x = jnp.ones((48, 16))
    before = len(_compiles)
    assert flops.step_flops(f, jax.ShapeDtypeStruct(x.shape, x.dtype)) > 2 * 48 * 48 * 16 * 0.9
    assert len(_compiles) == before + 1
    f(x).block_until_ready()
    assert len(_compiles) == before + 1, "the first real call compiled again"


@pytest.mark.parametrize("kind, dtype, peak", [
    ("NVIDIA H100 80GB HBM3", jnp.bfloat16, 989e12),
    ("NVIDIA H100 80GB HBM3", np.float32, 494e12),
    ("NVIDIA H100 PCIe", "bfloat16", 756e12),
    ("NVIDIA H200", "bfloat16", 989e12),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", 312e12),
    ("Tesla V100-SXM2-16GB", "bfloat16", 15.7e12),  # no bf16 unit: the float32 rate
    ("Tesla V100-SXM2-16GB", "float16", 125e12),
    ("NVIDIA L4", "bfloat16", 121e12),
    ("TPU v4", "bfloat16", 275e12),
    ("TPU v5 lite", "bfloat16", 197e12),
    ("TPU v5", "bfloat16", 459e12),
    ("TPU v5p", "float32", 459e12),
    ("TPU v6 lite", "bfloat16", 918e12),
    ("cpu", "float32", None),
])
def test_peak_table(kind, dtype, peak):
    assert flops.lookup_peak(kind, dtype) == peak


def test_peak_override_and_mfu():
    assert flops.device_peak_flops("float32") is None  # the emulated CPU devices have no entry
    assert flops.device_peak_flops("float32", override=2e9) == 2e9
    assert flops.mfu(1e9, 0.5, 4e9) == pytest.approx(0.5)
    assert flops.mfu(None, 0.5, 4e9) is None and flops.mfu(1e9, 0.5, None) is None and flops.mfu(1e9, 0, 1) is None
    # MFU: the model's FLOPs on the whole mesh over the mesh's peak; HFU: one device's compiled FLOPs over its peak.
    assert flops.utilisation(8e9, 1e9, 8, 0.5, None) == {}
    assert flops.utilisation(8e9, 1.5e9, 8, 0.5, 4e9) == {"mfu": pytest.approx(0.5), "hfu": pytest.approx(0.75)}
    assert flops.utilisation(None, 1.5e9, 8, 0.5, 4e9) == {"hfu": pytest.approx(0.75)}
    assert flops.header(None, None, None) == {}
    assert flops.header(80.0, 12.0, 3.0) == {"model_flops_per_step": 80.0, "compiled_flops_per_step_per_device": 12.0,
                                             "peak_flops_per_device": 3.0}


def test_records_carry_mfu_when_a_peak_is_set_and_start_up_compiles_nothing_more(tmp_path, monkeypatch):
    peak = 1e11
    before = len(_compiles)
    train(config_lib.load(DEFAULT, TINY + (f"--config.peak_flops={peak}",)), tmp_path / "mfu")
    with_flops = len(_compiles) - before
    records = metrics.read_metrics(tmp_path / "mfu")
    header = records[0]
    per_device = header["compiled_flops_per_step_per_device"]
    # Model FLOPs: forward + backward (3 x 2 x MACs) of the MLP 64-32-10 on the global batch of 128.
    assert header["model_flops_per_step"] == 6 * (64 * 32 + 32 * 10) * 128
    assert header["peak_flops_per_device"] == peak
    # What runs also holds the bias and activation arithmetic and the optimizer, but not the first layer's
    # input gradient (nobody needs it), which the model's convention counts.
    first_input_gradient = 2 * 64 * 32 * 16
    assert header["model_flops_per_step"] / 8 - first_input_gradient < per_device < header["model_flops_per_step"] / 8
    timed = [r for r in records if "step_time_ms" in r]
    assert timed and all(r["hfu"] == pytest.approx(per_device / (r["step_time_ms"] / 1e3) / peak) for r in timed)
    assert all(r["mfu"] == pytest.approx(header["model_flops_per_step"] / (r["step_time_ms"] / 1e3) / (8 * peak))
               for r in timed)
    assert all(r["elapsed_s"] > 0 for r in timed)

    # The same run without compiling the step ahead of the loop compiles exactly as many programs.
    import sys

    monkeypatch.setattr(sys.modules["dtx.run.setup"], "compile_step", lambda *args: None)
    before = len(_compiles)
    train(config_lib.load(DEFAULT, TINY), tmp_path / "plain")
    assert len(_compiles) - before == with_flops > 0
    records = metrics.read_metrics(tmp_path / "plain")
    assert not any("mfu" in r or "hfu" in r or "model_flops_per_step" in r for r in records)


def test_accumulation_has_mfu_but_no_hfu(tmp_path):
    train(config_lib.load(DEFAULT, TINY + ("--config.grad_accum_steps=2", "--config.peak_flops=1e11")), tmp_path)
    records = metrics.read_metrics(tmp_path)
    # XLA counts the accumulation loop once: no compiled FLOPs, no HFU; the model's count needs no compiler.
    assert "compiled_flops_per_step_per_device" not in records[0] and not any("hfu" in r for r in records)
    assert records[0]["model_flops_per_step"] == 6 * (64 * 32 + 32 * 10) * 128
    assert any("mfu" in r for r in records)


def test_a_program_compiled_to_be_read_reads_as_the_default_compile(monkeypatch):
    """flops.compile_to_read (LLVM at -O0 on XLA:CPU) gives a hybrid-parallel LeNet step (2 micro-batches, its
    collectives in a loop) the same HLO text, cost and memory analysis as the default compile: what the plan checks,
    the memory model's checks and the simulators read of it. And compile_layout_step, the one place a step is
    compiled from a layout outside a run, compiles that way."""
    import optax

    from dtx import mesh as mesh_lib
    from dtx import models
    from dtx.parallel import get_layout
    from dtx.run import verify
    from dtx.step import StepSpec, make_train_step
    from dtx.step.state import abstract_train_state

    model, tx = models.build_model("lenet", conv_features=(4, 8), dense_features=(32,)), optax.adam(1e-3)
    mesh = mesh_lib.make_mesh([("data", 4), ("model", 2)])
    example = jax.ShapeDtypeStruct((32, 28, 28, 1), jnp.float32)
    abstract = abstract_train_state(model, tx, example)
    placement = get_layout("hybrid").place(abstract, mesh)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, placement.state)
    split = mesh_lib.batch_sharding(mesh)
    batch = {"inputs": jax.ShapeDtypeStruct(example.shape, jnp.float32, sharding=split),
             "labels": jax.ShapeDtypeStruct((32,), jnp.int32, sharding=split)}
    lowered = make_train_step(model, tx, mesh, StepSpec(driver="jit", placement=placement, accum_steps=2)).lower(
        state, batch)
    default, read = lowered.compile(), flops.compile_to_read(lowered)
    assert read.as_text() == default.as_text() and "all-reduce" in read.as_text()
    assert flops.cost_analysis(read) == flops.cost_analysis(default)
    assert str(read.memory_analysis()) == str(default.memory_analysis())

    seen = []
    original = jax.stages.Lowered.compile
    monkeypatch.setattr(jax.stages.Lowered, "compile",
                        lambda self, options=None: seen.append(options) or original(self, options))
    verify.compile_layout_step(models.build_model("mlp", features=(16,)), (8,), "data", [("data", 8)], 8)
    assert seen == [flops.READ_ONLY_COMPILER_OPTIONS]
