"""The suite compiles with LLVM at -O1 (tests/conftest.py: about half the compile time, which is about half
the suite's); users' programs compile at XLA:CPU's default level (-O2). What the tests read must be what users
get, so the same work is done here and in a process at the default level:

- compiled programs: the optimised HLO text, the cost analysis and the memory analysis are identical (XLA's
  passes do not depend on the LLVM level), so every collective, FLOP and byte figure a test checks holds;
- values: the same runs end with the same parameters, bit for bit for most and within float rounding for the
  rest (LLVM's code for the same HLO may differ between the levels, e.g. in which multiply-adds it fuses, and
  so in a last bit. Measured: 5 of 6 such runs bit for bit; a batch-norm LeNet differs in 667 of its 21,430
  parameters, by at most 3e-8). The suite's bit-for-bit claims compare programs compiled at one level.

The runs cover what the suite's value tests lean on: momentum, LAMB's trust ratio, both drivers, convolutions
with batch norm, attention and softmax, PowerSGD's QR factorisation, bfloat16 compute and an explicit ring
all-reduce."""

import os
import re
import subprocess
import sys
import tempfile

import numpy as np

CASES = {
    "mlp momentum powersgd shard_map": ("digits_mlp", ["--config.compression.name=powersgd",
                                                       "--config.optimizer.name=momentum"]),
    "mlp lamb bf16 jit": ("digits_mlp", ["--config.optimizer.name=lamb", "--config.driver=jit",
                                         "--config.precision=params=float32,compute=bfloat16,output=float32,"
                                         "reduce=float32"]),
    "lenet batch norm ring": ("digits_lenet", ["--config.global_batch_size=32", "--config.allreduce=ring"]),
    "tiny lm": ("tiny_lm", ["--config.global_batch_size=16", "--config.optimizer.warmup_steps=1"]),
}
LEVEL = "--xla_backend_optimization_level=1"


def run_cases(out: str) -> None:
    """Trains each case 3 steps and compiles a LeNet (batch norm) step of every layout; writes the parameters
    (flattened) and the programs' figures to ``out`` (.npz)."""
    import jax

    from dtx import config as config_lib
    from dtx import models
    from dtx.run.trainer import train
    from dtx.run.verify import compile_layout_step

    arrays = {}
    for name, (experiment, overrides) in CASES.items():
        config = config_lib.load(experiment, [*overrides, "--config.num_steps=3", "--config.progress=False",
                                              "--config.eval_every=0", "--config.eval_batch_size=64"])
        result = train(config, tempfile.mkdtemp(prefix="dtx-level-"))
        leaves = jax.tree.leaves(jax.device_get(result.state.params))
        arrays[f"params/{name}"] = np.concatenate([np.asarray(leaf, np.float32).ravel() for leaf in leaves])
    lenet = models.build_model("lenet")
    for layout, mesh in [("data", [("data", 8)]), ("fsdp", [("data", 8)]), ("model", [("data", 4), ("model", 2)])]:
        compiled = compile_layout_step(lenet, (8, 8, 1), layout, mesh, 32)
        memory = compiled.memory_analysis()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        arrays[f"hlo/{layout}"] = np.frombuffer(_program(compiled.as_text()).encode(), np.uint8)
        arrays[f"figures/{layout}"] = np.array(
            [memory.argument_size_in_bytes, memory.output_size_in_bytes, memory.alias_size_in_bytes,
             memory.temp_size_in_bytes, cost["flops"], cost["bytes accessed"]], np.float64)
    np.savez(out, **arrays)


def _program(text: str) -> str:
    """The optimised HLO without its source locations (the Python stack that traced it: another process's
    program read back from the compilation cache names that process's frames)."""
    text = re.sub(r"\n\n(FileNames|FunctionNames|FileLocations|StackFrames)\n.*?(?=\n\n)", "", text, flags=re.S)
    return re.sub(r", metadata=\{[^}]*\}", "", text)


def test_the_suites_compile_level_reads_the_same_programs_and_values_as_the_default_level(tmp_path):
    from conftest import SUITE_XLA_FLAGS

    assert LEVEL in SUITE_XLA_FLAGS  # what this test vouches for is what conftest sets
    run_cases(str(tmp_path / "suite.npz"))
    flags = [f for f in os.environ["XLA_FLAGS"].split() if not f.startswith("--xla_backend_optimization_level")]
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
            f"from test_compile_level import run_cases; run_cases({str(tmp_path / 'default.npz')!r})")
    default = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                             env={**os.environ, "XLA_FLAGS": " ".join(flags)})
    assert default.returncode == 0, default.stderr[-3000:]
    suite, users = np.load(tmp_path / "suite.npz"), np.load(tmp_path / "default.npz")
    assert sorted(suite.files) == sorted(users.files)
    for key in suite.files:
        if key.startswith(("hlo/", "figures/")):
            assert suite[key].tobytes() == users[key].tobytes(), f"{key} differs between the levels"
    bitwise = [key for key in suite.files if key.startswith("params/") and suite[key].tobytes() == users[key].tobytes()]
    print("bit for bit:", bitwise)
    assert len(bitwise) >= len(CASES) // 2, bitwise  # most runs: not a rounding difference everywhere
    for key in suite.files:
        if key.startswith("params/"):  # the suite's parameter tolerance (as N devices against 1)
            np.testing.assert_allclose(suite[key], users[key], rtol=1e-5, atol=1e-6, err_msg=key)
