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
ROW = re.compile(r"^\| (?P<name>[^|]+) \| (?P<step>[\d.]+) \| (?P<compute>[\d.]+|n/a) \| (?P<comm>-?[\d.]+|n/a) "
                 r"\| (?P<share>-?\d+%|n/a) \| (?P<bytes>[\d,]+|n/a) \| (?P<hfu>[\d.]+%|n/a) \|$")


def _rows(text):
    return [m.groupdict() for m in map(ROW.match, text.splitlines()) if m and m.group("name") != "setting"]


def test_bench_step_splits_compute_from_communication(capsys):
    assert main(["bench", "step", DEFAULT, *TINY, "--config.peak_flops=1e11"]) == 0
    out = capsys.readouterr().out
    assert bench.STEP_HEADER in out
    (row,) = _rows(out)
    assert row["name"] == "shard_map psum, none, sync"
    step, compute, comm = float(row["step"]), float(row["compute"]), float(row["comm"])
    assert step > 0 and compute > 0 and comm == pytest.approx(step - compute, abs=0.011)
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
