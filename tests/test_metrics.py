"""Tests for dtx.run.metrics: JSON-lines records, TensorBoard event files, the progress display."""
import glob
import io
import json
import math
import os
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from rich.console import Console
from tensorboardX.proto.event_pb2 import Event

from dtx.run.metrics import (METRICS_FILE, MetricWriter, NotebookBar, ProgressBar, StepTrace, progress_mode,
                         read_metrics)


# ------------------------------------------------------- TFRecord reading

def _crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), bit by bit: slow but independent of the writer's implementation."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def test_crc32c_reference_value():
    assert _crc32c(b"123456789") == 0xE3069283  # the standard check value


def _read_events(path):
    """Every Event of a TFRecord file: uint64 length, masked crc, data, masked crc (little-endian)."""
    with open(path, "rb") as f:
        raw = f.read()
    events, offset = [], 0
    while offset < len(raw):
        header = raw[offset:offset + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", raw[offset + 8:offset + 12])
        assert length_crc == _masked_crc(header), f"bad length crc at byte {offset}"
        data = raw[offset + 12:offset + 12 + length]
        assert len(data) == length, "truncated record"
        (data_crc,) = struct.unpack("<I", raw[offset + 12 + length:offset + 16 + length])
        assert data_crc == _masked_crc(data), f"bad data crc at byte {offset}"
        events.append(Event.FromString(data))
        offset += 16 + length
    return events


def _scalars(workdir):
    """{tag: {step: value}} from the event files in ``workdir``."""
    files = glob.glob(os.path.join(str(workdir), "events.out.tfevents.*"))
    assert files, f"no TensorBoard event file in {os.listdir(workdir)}"
    scalars = {}
    for path in files:
        for event in _read_events(path):
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


# ------------------------------------------------------------- JSON lines

def test_records_are_json_lines_with_step_first(tmp_path):
    with MetricWriter(tmp_path, tensorboard=False) as writer:
        writer.write(0, {"num_params": 1234})
        writer.write(10, {"loss": 2.5, "accuracy": 0.25})
        writer.write(20, {"loss": 1.25, "accuracy": 0.5})
    lines = (tmp_path / METRICS_FILE).read_text(encoding="utf-8").splitlines()
    assert len(lines) == 3
    for line, step in zip(lines, (0, 10, 20)):
        record = json.loads(line)
        assert isinstance(record, dict)
        assert next(iter(record)) == "step" and record["step"] == step
        assert line.startswith('{"step": ')
    assert read_metrics(tmp_path) == [
        {"step": 0, "num_params": 1234},
        {"step": 10, "loss": 2.5, "accuracy": 0.25},
        {"step": 20, "loss": 1.25, "accuracy": 0.5},
    ]
    assert list(read_metrics(tmp_path)[1]) == ["step", "loss", "accuracy"]  # order kept


def test_writer_appends_to_an_existing_run(tmp_path):
    with MetricWriter(tmp_path, tensorboard=False) as writer:
        writer.write(1, {"loss": 1.0})
    with MetricWriter(tmp_path, tensorboard=False) as writer:
        writer.write(2, {"loss": 0.5})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_numpy_and_jax_scalars_become_plain_numbers(tmp_path):
    with MetricWriter(tmp_path, tensorboard=False) as writer:
        writer.write(np.int64(5), {
            "f32": np.float32(0.5), "f64": np.float64(0.25), "i64": np.int64(7), "i32": np.int32(-3),
            "jax_f": jnp.asarray(1.5, jnp.float32), "jax_i": jnp.asarray(4, jnp.int32),
            "flag": np.bool_(True), "name": "adam",
        })
    (record,) = read_metrics(tmp_path)
    assert record == {"step": 5, "f32": 0.5, "f64": 0.25, "i64": 7, "i32": -3, "jax_f": 1.5, "jax_i": 4,
                      "flag": True, "name": "adam"}
    for key in ("step", "i64", "i32", "jax_i"):
        assert type(record[key]) is int, key
    for key in ("f32", "f64", "jax_f"):
        assert type(record[key]) is float, key


def _strict_loads(line):
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")
    return json.loads(line, parse_constant=refuse)


def test_non_finite_values_stay_valid_json(tmp_path):
    with MetricWriter(tmp_path) as writer:
        writer.write(1, {"loss": float("nan"), "grad_norm": np.float32("inf"), "low": -math.inf,
                         "jax_nan": jnp.asarray(jnp.nan), "ok": 1.0})
    (line,) = (tmp_path / METRICS_FILE).read_text(encoding="utf-8").splitlines()
    assert "NaN" not in line and "Infinity" not in line
    record = _strict_loads(line)  # standard JSON: no bare NaN / Infinity tokens
    assert record == {"step": 1, "loss": "nan", "grad_norm": "inf", "low": "-inf", "jax_nan": "nan", "ok": 1.0}
    assert read_metrics(tmp_path) == [record]


# ------------------------------------------------------------- TensorBoard

def test_tensorboard_event_file_holds_the_scalars(tmp_path):
    losses = {1: 2.25, 2: 1.5, 3: 0.75}
    with MetricWriter(tmp_path) as writer:
        for step, loss in losses.items():
            writer.write(step, {"loss": np.float32(loss), "accuracy": step / 4, "optimizer": "adam"})
        writer.write(4, {"num_params": 1000, "flag": True, "loss": float("nan")})
    assert os.path.exists(tmp_path / METRICS_FILE)
    scalars = _scalars(tmp_path)
    assert scalars["loss"] == losses  # the NaN of step 4 is a string in JSON, not a TB scalar
    assert scalars["accuracy"] == {1: 0.25, 2: 0.5, 3: 0.75}
    assert scalars["num_params"] == {4: 1000.0}
    assert set(scalars) == {"loss", "accuracy", "num_params"}  # strings and booleans are not scalars


def test_tensorboard_can_be_turned_off(tmp_path):
    with MetricWriter(tmp_path, tensorboard=False) as writer:
        writer.write(1, {"loss": 1.0})
    assert os.listdir(tmp_path) == [METRICS_FILE]


def test_writer_creates_the_workdir(tmp_path):
    workdir = tmp_path / "runs" / "a"
    with MetricWriter(workdir) as writer:
        writer.write(1, {"loss": 0.5})
    assert read_metrics(workdir) == [{"step": 1, "loss": 0.5}]
    assert _scalars(workdir) == {"loss": {1: 0.5}}


# ------------------------------------------------------------- progress bar

def _console():
    return Console(file=io.StringIO(), force_terminal=False, force_jupyter=False, color_system=None, width=200)


def test_disabled_progress_prints_nothing():
    console = _console()
    with ProgressBar(100, enabled=False, console=console) as bar:
        for step in range(1, 101):
            bar.update(step, 1.0 / step, 1000.0)
    assert console.file.getvalue() == ""


def test_progress_off_a_terminal_prints_a_few_plain_lines():
    console = _console()
    assert not console.is_terminal
    with ProgressBar(100, console=console) as bar:
        for step in range(1, 101):
            bar.update(step, 1.0 / step, 1234.0)
    progress = console.file.getvalue().splitlines()
    assert 5 <= len(progress) <= 11
    assert progress[0] == "step 1/100  loss 1.0000  1,234 ex/s"
    for line in progress:
        assert "\x1b" not in line and "\r" not in line  # plain text for CI logs
        assert line.startswith("step ") and "/100" in line
        step = int(line.split()[1].split("/")[0])
        assert f"loss {1.0 / step:.4f}" in line
    steps = [int(line.split()[1].split("/")[0]) for line in progress]
    assert steps == sorted(steps) and steps[-1] >= 90  # spread over the whole run


def test_progress_with_few_steps_prints_each():
    console = _console()
    with ProgressBar(3, console=console) as bar:
        for step in (1, 2, 3):
            bar.update(step, 0.5, 10.0)
    assert console.file.getvalue().splitlines() == [f"step {s}/3  loss 0.5000  10 ex/s" for s in (1, 2, 3)]


def test_progress_on_a_terminal_draws_one_live_bar():
    console = Console(file=io.StringIO(), force_terminal=True, color_system=None, width=120)
    with ProgressBar(100, console=console) as bar:
        for step in range(1, 101):
            bar.update(step, 1.0 / step, 1234.0)
    output = console.file.getvalue()
    final = output.replace("\r", "\n").splitlines()
    final = [line for line in final if "100/100" in line]
    assert final, output[-300:]
    assert "loss 0.0100" in final[-1] and "1,234 ex/s" in final[-1]
    assert "step 1/100" not in output  # the bar, not the plain lines


# ------------------------------------------------- progress: mode selection, notebook bar

@pytest.mark.parametrize("enabled, terminal, jupyter, mode", [
    (False, True, False, "off"),
    (False, False, True, "off"),
    (True, False, True, "notebook"),
    (True, True, True, "notebook"),  # a kernel first: its streams may claim to be terminals
    (True, True, False, "terminal"),
    (True, False, False, "plain"),
])
def test_progress_mode_selection(enabled, terminal, jupyter, mode):
    console = Console(file=io.StringIO(), force_terminal=terminal, force_jupyter=jupyter, color_system=None)
    assert progress_mode(enabled, console) == mode
    bar = ProgressBar(10, enabled=enabled, console=console, display=_FakeDisplay())
    assert bar.mode == mode


class _FakeDisplay:
    """IPython.display.display with display_id=True: records the first bundle and every update."""

    def __init__(self):
        self.bundles = []

    def __call__(self, bundle, raw, display_id):
        assert raw and display_id is True
        self.bundles.append(bundle)
        return self

    def update(self, bundle, raw):
        assert raw
        self.bundles.append(bundle)


def test_notebook_bar_redraws_one_output_in_place():
    display = _FakeDisplay()
    console = Console(file=io.StringIO(), force_jupyter=True)
    with ProgressBar(100, console=console, display=display) as bar:
        for step in range(1, 101):
            bar.update(step, 1.0 / step, 1234.0)
    assert console.file.getvalue() == ""  # nothing on the streams: everything went to the one display
    first, *updates = display.bundles
    assert first["text/plain"].startswith("train 0/100")
    assert 1 <= len(updates) <= 100  # throttled redraws of the same output
    last = updates[-1]
    assert last["text/plain"].startswith("train 100/100  loss 0.0100  1,234 ex/s  done in ")
    assert '<progress value="100" max="100"' in last["text/html"]


def test_notebook_bar_throttles_and_shows_the_last_step_on_close():
    display = _FakeDisplay()
    bar = NotebookBar(1000, display=display, min_interval=3600.0)
    for step in range(1, 500):
        bar.update(step, 0.5, 10.0)
    assert len(display.bundles) == 2  # the empty bar, then the first update only
    bar.close()
    assert display.bundles[-1]["text/plain"].startswith("train 499/1000  loss 0.5000  10 ex/s")
    assert "s left" in display.bundles[-1]["text/plain"]


# ------------------------------------------------------------- profiler trace

def test_profile_steps_write_a_trace(tmp_path):
    from dtx import config as config_lib
    from dtx.run.trainer import train

    experiment = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments",
                              "digits_mlp.py")
    config = config_lib.load(experiment, ["--config.num_steps=8", "--config.model.features=(32,)",
                                          "--config.progress=False", "--config.profile_steps=3"])
    train(config, tmp_path)
    traces = glob.glob(str(tmp_path / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert len(traces) == 1 and os.path.getsize(traces[0]) > 0


def test_step_trace_window(monkeypatch):
    import jax

    calls = []
    monkeypatch.setattr(jax.profiler, "start_trace", lambda logdir: calls.append(("start", logdir)))
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: calls.append(("stop",)))
    with StepTrace("/tmp/x", first_step=3, count=2) as trace:
        for step in range(10):
            trace.before_step(step, {"loss": np.float32(step)})
            calls.append(step)
    assert calls == [0, 1, 2, ("start", "/tmp/x"), 3, 4, ("stop",), 5, 6, 7, 8, 9]
    calls.clear()
    with StepTrace("/tmp/x", first_step=3, count=100) as trace:  # the run ends first: stopped on exit
        for step in range(5):
            trace.before_step(step, None)
    assert calls == [("start", "/tmp/x"), ("stop",)]
    with StepTrace("/tmp/x", first_step=1, count=0) as trace:  # profile_steps=0: off
        for step in range(5):
            trace.before_step(step, None)
    assert calls == [("start", "/tmp/x"), ("stop",)]


# ------------------------------------------------------------- gradient norm

@pytest.mark.parametrize("driver", ["shard_map", "jit"])
def test_grad_norm_is_the_norm_of_the_applied_gradient(driver):
    import jax
    import optax

    from dtx import models
    from dtx.data import datasets
    from dtx import mesh as mesh_lib
    from dtx.data import TrainLoader
    from dtx.step.state import init_train_state
    from dtx.step import StepSpec, make_train_step

    digits = datasets.load_dataset("digits")
    mesh = mesh_lib.make_mesh([("data", -1)])
    model, tx = models.build_model("mlp", features=(16,)), optax.sgd(1.0)  # update = -gradient
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    state = init_train_state(model, tx, example, 0, mesh)
    batch = TrainLoader(digits.train, 64, mesh, seed=0).batch(0)
    new, metrics = make_train_step(model, tx, mesh, StepSpec(driver=driver, grad_norm=True, donate=False))(state, batch)
    applied = jax.tree.map(lambda a, b: a - b, state.params, new.params)
    assert float(metrics["grad_norm"]) == pytest.approx(float(optax.tree.norm(applied)), rel=1e-5)
    _, plain = make_train_step(model, tx, mesh, StepSpec(driver=driver, donate=False))(state, batch)
    assert "grad_norm" not in plain  # opt-in
