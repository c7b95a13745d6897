"""`dtx bench step` (a train step split into compute and communication) and `dtx bench collectives`."""

import os
import re

import jax
import pytest

from dtx.comm import costmodel
from dtx.tools import bench
from dtx.tools.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(REPO, "experiments", "digits_mlp.py")
TINY = ["--config.model.features=(32,)", "--steps", "2", "--rounds", "1"]
_SPREAD = r"(?: \[-?[\d.]+, -?[\d.]+\])?"  # median [min, max] over the rounds
ROW = re.compile(rf"^\| (?P<name>[^|]+) \| (?P<step>[\d.]+){_SPREAD} \| (?P<compute>[\d.]+|n/a){_SPREAD} "
                 rf"\| (?P<comm>[\d.]+|≈0|n/a){_SPREAD} \| (?P<share>\d+%|within noise|n/a) \| (?P<bytes>[\d,]+|n/a) "
                 r"\| (?P<hfu>[\d.]+%|n/a) \|$")


def _rows(text):
    return [m.groupdict() for m in map(ROW.match, text.splitlines()) if m and m.group("name") != "setting"]


def test_bench_step_splits_compute_from_communication(capsys):
    assert main(["bench", "step", DEFAULT, *TINY, "--config.peak_flops=1e11"]) == 0
    out = capsys.readouterr().out
    assert bench.STEP_HEADER in out
    (row,) = _rows(out)
    assert row["name"] == "shard_map psum, none, sync"
    step, compute = float(row["step"]), float(row["compute"])
    assert step > 0 and compute > 0
    if row["comm"] == "≈0":  # one round: within noise exactly when the compute twin was the slower
        assert step <= compute + 0.011 and row["share"] == "within noise"
    else:
        assert float(row["comm"]) == pytest.approx(step - compute, abs=0.011)
    # The accountant's bytes: a float32 ring allreduce of the MLP 64-32-10's parameters over 8 workers, and
    # of the step's (loss, accuracy) averages, one float32[2] vector.
    params = {"w1": jax.ShapeDtypeStruct((64, 32), "float32"), "b1": jax.ShapeDtypeStruct((32,), "float32"),
              "w2": jax.ShapeDtypeStruct((32, 10), "float32"), "b2": jax.ShapeDtypeStruct((10,), "float32"),
              "metrics": jax.ShapeDtypeStruct((2,), "float32")}
    expected = costmodel.dense_allreduce_traffic(params, 8, "ring", "float32").bytes_sent
    assert int(row["bytes"].replace(",", "")) == expected
    assert row["hfu"] != "n/a" and "no peak" not in out


def test_bench_step_varies_a_key_and_says_what_it_cannot_know(capsys):
    assert main(["bench", "step", DEFAULT, *TINY, "--vary", "driver=shard_map,jit"]) == 0
    out = capsys.readouterr().out
    split, whole = _rows(out)
    assert (split["name"], whole["name"]) == ("driver=shard_map", "driver=jit")
    assert float(split["compute"]) > 0 and float(whole["step"]) > 0 and whole["compute"] == whole["comm"] == "n/a"
    assert "needs --config.driver=shard_map" in out  # under jit XLA places the collectives
    assert split["hfu"] == whole["hfu"] == "n/a" and "set --config.peak_flops" in out  # no peak for CPUs


def test_bench_step_errors(capsys):
    assert main(["bench", "step", DEFAULT, "--config.nope=1"]) == 2
    assert "unknown config key" in capsys.readouterr().err
    assert main(["bench", "step", DEFAULT, "--config.global_batch_size=12"]) == 2
    assert "global_batch_size" in capsys.readouterr().err
    for bad in (["--vary", "allreduce"], ["--steps", "0"], ["--frobnicate"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", "step", DEFAULT, *bad])
        assert exit_info.value.code == 2


def test_collectives_command_writes_csv_and_plot(tmp_path, capsys):
    assert main(["bench", "collectives", "--sizes", "4KiB", "--algorithms", "psum,ring,hierarchical",
                 "--repeats", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "hierarchical" in out and "ring" in out
    assert (tmp_path / "collectives.csv").read_text().count("\n") == 4
    assert (tmp_path / "collectives.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_vary_values_split_at_top_level_commas():
    assert bench._top_level_split("psum,ring") == ["psum", "ring"]
    assert bench._top_level_split("(64,),(64, 64)") == ["(64,)", "(64, 64)"]
    assert bench._top_level_split('(("data", -1),),(("node", 2), ("local", 4))') == [
        '(("data", -1),)', '(("node", 2), ("local", 4))']


def _result(full, compute):
    """A measure_step result from per-round seconds (the statistics measure_step takes)."""
    import statistics

    paired = [f - c for f, c in zip(full, compute)]
    return {"step_s": statistics.median(full), "compute_s": statistics.median(compute),
            "comm_s": statistics.median(paired), "comm_bytes_per_step": 100.0, "hfu": None,
            "spread": {"step_s": (min(full), max(full)), "compute_s": (min(compute), max(compute)),
                       "comm_s": (min(paired), max(paired))}}


def test_a_step_row_gives_the_spread_and_no_negative_time():
    """Rounds that agree: the communication time with its range. Rounds that disagree on its sign, or a
    compute twin that was the slower: "≈0" with the range, "within noise", never a negative time."""
    clear = bench.step_row("a", _result([0.010, 0.011, 0.012], [0.006, 0.007, 0.0065]))
    row = _rows(clear)[0]
    assert (row["step"], row["comm"], row["share"]) == ("11.00", "4.00", "36%") and "[4.00, 5.50]" in clear
    for full, compute in (([0.010, 0.011, 0.012], [0.0105, 0.0108, 0.0125]), ([0.010], [0.011])):
        noisy = bench.step_row("b", _result(full, compute))
        row = _rows(noisy)[0]
        assert (row["comm"], row["share"]) == ("≈0", "within noise"), noisy
        assert "| -" not in noisy and not re.search(r"\| -?[\d.]+% \|", noisy.replace("within noise", ""))
