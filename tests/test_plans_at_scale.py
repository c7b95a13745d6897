"""``dtx simulate --verify --devices N`` (dtx.tools.plancheck): plans for more nodes than the suite's 8 devices,
compiled on N emulated CPU devices in a fresh ``dtx simulate`` process (nothing runs); per-device FLOPs and bytes
within 2 % of dtx.perf.model, memory within 15 % of dtx.perf.memory (what ``--memory`` prints), and a plan the
model says does not fit the node reported as OOM. Bad ``--devices`` is refused before anything compiles."""

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

from dtx.tools import plancheck
from dtx.tools.simulate import simulate_main

DEVICES = 32
# A model whose first layer is a small share of the work: the step skips the input's gradient, which
# dtx.perf.model counts, and a narrow Dense's bias is a visible share of its FLOPs (both ~1 % here).
TINY = textwrap.dedent('''
    from collections.abc import Sequence
    from dtx.models.mlp import MLP

    class TinyMLP(MLP):
        features: Sequence[int] = (512, 512, 512)
        num_classes: int = 16
''')
ARGV = ["--model", "tiny_plan_model:TinyMLP", "--input-shape", "32", "--cluster", "haswell_fdr",
        "--global-batch", "1024", "--nodes", f"2,{DEVICES}"]


@pytest.fixture(scope="module")
def at_scale(tmp_path_factory):
    """The memory ``--memory`` prints for both plans, then ``--verify --devices 32`` in a child process on a
    node memory between the two: the 2-node plan must not fit, the 32-node one must."""
    folder = tmp_path_factory.mktemp("tiny_model")
    (folder / "tiny_plan_model.py").write_text(TINY)
    sys.path.insert(0, str(folder))  # the in-process --memory reads the same class
    try:
        capture = _Capture()
        with capture:
            assert simulate_main(ARGV + ["--memory", "--json"]) == 0
        modelled = {row["nodes"]: row["total"] for row in json.loads(capture.text)["memory"]
                    if row["layout"].startswith("plan (")}
    finally:
        sys.path.remove(str(folder))
    assert modelled[2] > 2 * modelled[DEVICES]  # so a node between them separates the plans beyond 15 %
    capacity = math.sqrt(modelled[2] * modelled[DEVICES])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}
    child = subprocess.run([sys.executable, "-m", "dtx.tools.cli", "simulate", *ARGV, "--verify", "--devices",
                            str(DEVICES), "--device-memory", str(capacity), "--json"],
                           capture_output=True, text=True, env=env, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout)["verify"], modelled, capacity


class _Capture:
    """stdout of an in-process ``simulate_main`` (a module fixture has no capsys)."""

    def __enter__(self):
        import io

        self._old, sys.stdout = sys.stdout, io.StringIO()

    def __exit__(self, *exc):
        self.text, sys.stdout = sys.stdout.getvalue(), self._old


def test_plans_compile_on_more_devices_than_the_suite_has(at_scale):
    verified, _, _ = at_scale
    assert [plan["nodes"] for plan in verified] == [2, DEVICES]
    assert all(plan["devices"] == DEVICES for plan in verified)  # not the suite's 8: the child's own
    assert verified[1]["group_size"] > 1  # the 32-node plan splits its layers: model-parallel collectives
    for plan in verified:
        assert plan["checks"][-1]["name"] == "step"
        for row in plan["checks"]:
            assert abs(row["flops_ratio"] - 1) <= 0.02, (plan["plan"], row)
            assert abs(row["bytes_ratio"] - 1) <= 0.02, (plan["plan"], row)
        assert plan["compile_s"] > 0 and plan["host_peak_rss"] > 2**20


def test_memory_is_the_model_against_the_compiled_step(at_scale):
    verified, modelled, _ = at_scale
    for plan in verified:
        memory = plan["memory"]
        assert memory["predicted_bytes"] == pytest.approx(modelled[plan["nodes"]], rel=1e-9)  # what --memory prints
        assert abs(memory["ratio"] - 1) <= 0.15 and memory["within"], memory
        assert memory["ratio"] == pytest.approx(memory["compiled_bytes"] / memory["predicted_bytes"])


def test_a_plan_that_does_not_fit_is_reported_as_oom(at_scale, capsys):
    verified, _, capacity = at_scale
    small, large = verified
    assert small["memory"]["device_memory"] == pytest.approx(capacity)
    assert small["memory"]["fits"] is False and small["memory"]["model_fits"] is False
    assert large["memory"]["fits"] is True and large["memory"]["model_fits"] is True
    plancheck.print_checks(verified)
    memory_lines = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("memory ")]
    assert "OOM: does not fit in" in memory_lines[0] and "fits in" in memory_lines[1]
    assert "OOM" not in memory_lines[1]


@pytest.mark.parametrize("devices, message", [
    ("0", "must be a positive number of devices like 64, got '0'"),
    ("-4", "must be a positive number of devices"),
    ("1.5", "expected a whole number of devices like 64, got '1.5'"),
    ("many", "expected a whole number of devices"),
    (str(plancheck.MAX_DEVICES + 1), f"too many for one host process (at most {plancheck.MAX_DEVICES}"),
])
def test_devices_must_be_a_count_the_host_can_emulate(devices, message, capsys):
    rc = simulate_main(["--model", "speech_dnn", "--cluster", "haswell_fdr", "--nodes", "2", "--verify",
                        "--devices", devices])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--devices" in err and message in err


def test_a_plan_needing_more_nodes_than_devices_is_refused_before_compiling(capsys):
    rc = simulate_main(["--model", "speech_dnn", "--cluster", "haswell_fdr", "--nodes", "2,64,128", "--verify",
                        "--devices", "32"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--nodes 64,128 needs 128 devices, --devices 32 emulates 32; pass --devices 128" in err


def test_devices_without_verify_warns_and_compiles_nothing(capsys):
    rc = simulate_main(["--model", "speech_dnn", "--cluster", "haswell_fdr", "--nodes", "2", "--devices", "16",
                        "--json"])
    assert rc == 0
    captured = capsys.readouterr()
    assert "--devices 16 sets the devices --verify compiles on" in captured.err and "add --verify" in captured.err
    assert "verify" not in json.loads(captured.out)


def test_a_started_backend_cannot_switch_its_count(capsys):
    """The suite's JAX runs on 8 devices: --devices 16 in-process is refused, naming the fresh process."""
    rc = simulate_main(["--model", "speech_dnn", "--cluster", "haswell_fdr", "--nodes", "2,16", "--verify",
                        "--devices", "16"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "cannot switch to 16" in err and "fresh process" in err


def test_the_transformer_planners_64_gpu_plan_compiles_on_64_devices():
    """``dtx simulate --model experiments/gpt2_small.py --nodes 64 --verify --devices 64`` (dtx.tools.lm_sim): the
    printed 64-GPU plan compiled on 64 emulated devices at the width-scaled twin, its batch ``64/8`` times the twin's
    (measured D64: FLOPs 0.9983, bytes 1.0000, memory 0.992); without 8-node rows nothing else compiles."""
    child = subprocess.run([sys.executable, "-m", "dtx.tools.cli", "simulate", "--model", "experiments/gpt2_small.py",
                            "--cluster", "h100_nvlink_ndr", "--nodes", "64", "--verify", "--devices", "64", "--json"],
                           capture_output=True, text=True, timeout=300,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert child.returncode == 0, child.stderr[-3000:]
    out = json.loads(child.stdout)
    printed = out["plans"][0]["runnable"]
    (row,) = out["verify"]
    assert row["nodes"] == 64 and row["role"] == "twin" and "128 sequences" in row["shape"]
    assert printed["data"] * printed["tensor"] * printed["stages"] == 64
    assert row["plan"].startswith(f"D{printed['data']}")
    for ratio in ("flops_ratio", "bytes_ratio"):
        assert abs(row[ratio] - 1) <= plancheck.VERIFY_TOLERANCE, row
