"""End to end: the training story, its records, the CLI, and bad input refused before any work."""

import contextlib
import json
import os
import subprocess
import sys

import jax
import pytest
from ml_collections import ConfigDict

from dtx import config as config_lib
from dtx.data import datasets
from dtx.run import metrics
from dtx import mesh as mesh_lib
from dtx.tools.cli import main
from dtx.run.trainer import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(REPO, "experiments", "digits_mlp.py")
TINY = ("--config.num_steps=12", "--config.model.features=(32,)", "--config.log_every=4", "--config.progress=False")


def tiny_config(*overrides):
    return config_lib.load(DEFAULT, TINY + overrides)


_compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, *_, **__: _compiles.append(name) if name.endswith("backend_compile_duration") else None
)


@contextlib.contextmanager
def no_compilation():
    before = len(_compiles)
    yield
    assert len(_compiles) == before, "bad input must be refused before anything is compiled"


@pytest.mark.parametrize("driver", ["shard_map", "jit"])
def test_default_experiment_reaches_97_percent(tmp_path, driver):
    config = config_lib.load(DEFAULT, [f"--config.driver={driver}", "--config.progress=False"])
    result = train(config, tmp_path)
    assert result.metrics["test_accuracy"] >= 0.97
    assert result.metrics["test_examples"] == 360
    records = metrics.read_metrics(tmp_path)
    assert records[-1]["test_accuracy"] == result.metrics["test_accuracy"]


def test_records(tmp_path):
    result = train(tiny_config(), tmp_path)
    assert int(result.state.step) == 12
    records = metrics.read_metrics(tmp_path)
    assert all("step" in r for r in records)
    train_steps = [r["step"] for r in records if "loss" in r]
    assert train_steps == [4, 8, 12]
    for r in records:
        if "loss" in r and "examples_per_sec" in r:
            assert r["examples_per_sec"] > 0 and r["learning_rate"] == pytest.approx(2e-3)
            assert r["examples_per_sec_per_device"] == pytest.approx(r["examples_per_sec"] / 8)
            assert r["step_time_ms"] > 0
    final = records[-1]
    assert final["step"] == 12 and 0 <= final["test_accuracy"] <= 1
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model"]["features"] == [32]


def test_periodic_evaluation(tmp_path):
    train(tiny_config("--config.eval_every=5"), tmp_path)
    evals = [r["step"] for r in metrics.read_metrics(tmp_path) if "test_accuracy" in r]
    assert evals == [5, 10, 12]


def test_refuses_a_workdir_that_holds_a_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with no_compilation(), pytest.raises(FileExistsError, match="already holds a run"):
        train(tiny_config(), tmp_path)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'  # untouched


def test_batch_not_divisible_fails_before_compilation(tmp_path):
    config = tiny_config("--config.global_batch_size=100")
    with no_compilation(), pytest.raises(mesh_lib.MeshError) as error:
        train(config, tmp_path)
    message = str(error.value)
    assert "global_batch_size=100" in message and "8" in message and "96 or 104" in message
    assert not (tmp_path / "metrics.jsonl").exists()


def test_missing_dataset_file_fails_before_compilation(tmp_path):
    config = tiny_config("--config.dataset.name=mnist", f"--config.dataset.data_dir={tmp_path}")
    with no_compilation(), pytest.raises(datasets.DatasetError, match="mnist.npz"):
        train(config, tmp_path / "run")


def test_unknown_model_setting_fails_before_compilation(tmp_path):
    with no_compilation(), pytest.raises(ValueError, match="model.width"):  # refused as the override applies
        config_lib.override(tiny_config(), **{"model": ConfigDict({"name": "mlp", "width": 3})})
    config = tiny_config()
    config.model = ConfigDict({"name": "mlp", "width": 3})  # assigned as an experiment file does
    with no_compilation(), pytest.raises(ValueError, match="model.width"):
        train(config, tmp_path)


def test_cli_errors_are_one_clear_line(tmp_path, capsys):
    assert main(["train", DEFAULT, "--config.learning_rat=0.1", f"--workdir={tmp_path}"]) == 2
    assert "learning_rat" in capsys.readouterr().err
    assert main(["train", DEFAULT, "--config.num_steps=ten", f"--workdir={tmp_path}"]) == 2
    assert "num_steps" in capsys.readouterr().err
    assert main(["train", str(tmp_path / "nope.py")]) == 2
    assert "nope.py" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", DEFAULT, "--bogus"])


def test_dtx_train_command(tmp_path):
    """The installed ``dtx`` command, as a user runs it, in a fresh process."""
    script = os.path.join(os.path.dirname(sys.executable), "dtx")
    command = [script] if os.path.exists(script) else [sys.executable, "-m", "dtx.tools.cli"]
    run = subprocess.run(
        command + ["train", DEFAULT, "--workdir", str(tmp_path), *TINY[:-1], "--config.driver=jit"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert run.returncode == 0, run.stderr
    assert "test_accuracy" in run.stdout + run.stderr
    records = metrics.read_metrics(tmp_path)
    assert records[-1]["step"] == 12 and "test_accuracy" in records[-1]
    assert records[0]["num_devices"] == 8  # the experiment's emulated mesh, in a fresh process


def test_error_feedback_under_float16_loss_scaling_is_refused_before_compiling(tmp_path):
    config = tiny_config("--config.compression.name=topk", "--config.precision=p=f32,c=f16,o=f32")
    with no_compilation(), pytest.raises(config_lib.ConfigError, match="loss-scaled gradients"):
        train(config, tmp_path)
    assert not os.path.exists(tmp_path / metrics.METRICS_FILE)


def test_divergence_without_checkpoints_stops_within_log_every_naming_the_step(tmp_path, capsys):
    """The probe: learning_rate 1e6, no checkpoints — NaN from step 10 to the end and exit 0. Now the run
    stops at the first record with a non-finite loss, naming the step, and the CLI exits 3."""
    argv = ["train", DEFAULT, "--workdir", str(tmp_path), "--config.num_steps=60", "--config.progress=False",
            "--config.optimizer.name=sgd", "--config.optimizer.learning_rate=1e6", "--config.log_every=4"]
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert "diverged" in err and "optimizer.learning_rate" in err
    step = int(err.split("step ")[1].split(":")[0])
    assert step % 4 == 0 and step < 60
    assert max(r["step"] for r in metrics.read_metrics(tmp_path)) < step  # nothing recorded past the halt


@pytest.mark.parametrize("overrides, message", [
    (("--config.precision=p=f16,c=f16",), r"float16 master weights"),
    (("--config.driver=jit", "--config.parallel.name=fsdp", "--config.compression.name=topk"),
     r"parallel\.name='fsdp' with .*compression\.name='topk'.*use parallel\.name=data with them"),
])
def test_impossible_settings_are_refused_with_one_fix(tmp_path, overrides, message):
    with no_compilation(), pytest.raises(config_lib.ConfigError, match=message):
        train(tiny_config(*overrides), tmp_path)


def test_a_workdir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "taken").write_text("")
    with no_compilation(), pytest.raises(config_lib.ConfigError, match=r"'.*taken' is a file, not a directory"):
        train(tiny_config(), tmp_path / "taken")


def test_a_run_killed_before_its_first_checkpoint_starts_over(tmp_path):
    """The probe (F1): SIGKILL after the first records but before any checkpoint commits left a workdir the
    same command refused ("already holds a run ... no checkpoint to resume"). Now it starts over and keeps
    the interrupted records aside."""
    import signal
    import time

    command = [sys.executable, "-m", "dtx.tools.cli", "train", DEFAULT, "--workdir", str(tmp_path), *TINY,
               "--config.num_steps=100000", "--config.log_every=1", "--config.checkpoint.every_steps=100000"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + 120
    while time.time() < deadline and not (
            (tmp_path / "metrics.jsonl").exists() and len((tmp_path / "metrics.jsonl").read_text().splitlines()) > 3):
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    assert not any(n.isdigit() for n in os.listdir(tmp_path / "checkpoints"))  # nothing committed
    interrupted = (tmp_path / "metrics.jsonl").read_text()
    command[command.index("--config.num_steps=100000")] = "--config.num_steps=8"
    rerun = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert "interrupted before its first checkpoint committed; starting over" in rerun.stderr
    assert (tmp_path / "interrupted-1" / "metrics.jsonl").read_text() == interrupted  # kept, not lost
    records = metrics.read_metrics(tmp_path)
    assert records[0]["step"] == 0 and "test_accuracy" in records[-1]


def test_sigterm_during_start_up_stops_cleanly_and_the_same_call_then_trains(tmp_path, monkeypatch, capsys):
    """A real SIGTERM while the step compiles (the start-up window of seconds): no step runs,
    nothing is saved, the CLI exits 0 saying so, and the same command then trains as if
    never interrupted -- bit for bit the loss of an uninterrupted run."""
    import signal

    from dtx.run import setup

    compile_step = setup.compile_step

    def terminated_while_compiling(*args):
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to the main thread before the next bytecode
        return compile_step(*args)

    args = ["train", DEFAULT, "--workdir", str(tmp_path / "run"), *TINY, "--config.checkpoint.every_steps=6"]
    with monkeypatch.context() as patched:
        patched.setattr(setup, "compile_step", terminated_while_compiling)
        assert main(args) == 0
    assert "preempted at step 0 before anything new was saved" in capsys.readouterr().out
    assert not any(n.isdigit() for n in os.listdir(tmp_path / "run" / "checkpoints"))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler left with the run

    assert main(args) == 0
    reference = train(tiny_config("--config.checkpoint.every_steps=6"), tmp_path / "reference")
    losses = [r["loss"] for r in metrics.read_metrics(tmp_path / "run") if "loss" in r]
    assert losses == [r["loss"] for r in metrics.read_metrics(tmp_path / "reference") if "loss" in r]
    assert int(reference.state.step) == 12


def test_a_run_that_cannot_fit_is_refused_before_compiling_with_the_layout_that_would(tmp_path):
    """memory_limit (what an accelerator reports by itself): the estimate of dtx.perf.memory against it."""
    with no_compilation(), pytest.raises(config_lib.ConfigError) as refused:
        wide = ("--config.num_steps=12", "--config.progress=False", "--config.model.features=(256,)")
        train(config_lib.load(DEFAULT, wide + ("--config.memory_limit=320000",)), tmp_path / "small")
    message = str(refused.value)
    assert "needs about" in message and "biggest are optimizer state" in message
    assert "--config.parallel.name=zero1 fits" in message
    with no_compilation(), pytest.raises(config_lib.ConfigError, match="no layout fits on this mesh"):
        train(tiny_config("--config.memory_limit=1000"), tmp_path / "tiny")
    result = train(tiny_config("--config.memory_limit=1e9"), tmp_path / "ample")
    assert result.metrics["test_examples"] == 360


@pytest.mark.parametrize("strategy", [("gossip",), ("local_sgd", "--config.strategy.period=2")])
def test_workers_with_their_own_models_average_only_at_records_and_train_the_same_whatever_log_every(tmp_path,
                                                                                                    strategy):
    """Gossip and local SGD run the records' all-reduce only on record steps (log_every and the last): the
    parameters are the same bit for bit at log_every 1 and 3, the bytes differ by exactly the 4 averages the
    second run leaves out (one float32 vector of loss and accuracy: 2(p-1) messages of 4 bytes, p = 8), and
    every record lists each step's own bytes and rounds since the one before."""
    flags = (f"--config.strategy.name={strategy[0]}", *strategy[1:], "--config.num_steps=7")
    runs = {every: (train(tiny_config(*flags, f"--config.log_every={every}"), tmp_path / str(every)),
                    [r for r in metrics.read_metrics(tmp_path / str(every)) if "comm_bytes_total" in r])
            for every in (1, 3)}
    for a, b in zip(*(jax.tree.leaves(jax.device_get(result.state)) for result, _ in runs.values())):
        assert (a == b).all()
    assert runs[1][0].metrics == runs[3][0].metrics
    assert [r["step"] for r in runs[3][1]] == [3, 6, 7] and all("loss" in r for r in runs[3][1])
    averages = (2 * 7 * 4, 2 * 7)
    for _, records in runs.values():  # the steps' own figures add up to the totals
        assert records[-1]["comm_bytes_total"] == sum(b for r in records for b, _ in r["comm_steps"])
    total = {every: (records[-1]["comm_bytes_total"], records[-1]["comm_rounds_per_step"] * 7)
             for every, (_, records) in runs.items()}
    assert total[1][0] - total[3][0] == 4 * averages[0] and total[1][1] - total[3][1] == pytest.approx(4 * averages[1])
    steps = [s for r in runs[3][1] for s in r["comm_steps"]]  # steps 3, 6 and 7 run the averages
    assert [s == runs[1][1][k]["comm_steps"][0] for k, s in enumerate(steps)] == [
        False, False, True, False, False, True, True]
