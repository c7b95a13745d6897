"""Checkpoints: exact resume, restore onto other meshes, strictness, and faults that must not lose work.

Every fault test first checks that its fault really happened (the file changed,
the process was killed, the save failed), then that nothing committed was lost.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

from dtx import models
from dtx import config as config_lib
from dtx import mesh as mesh_lib
from dtx.run import metrics
from dtx.ckpt.checkpoint import Checkpointer, CheckpointError, abstract_target, state_digest
from dtx.step.state import abstract_train_state, init_train_state, replicated_shardings
from dtx.run.trainer import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(REPO, "experiments", "digits_mlp.py")
RUN = ["--config.model.features=(32,)", "--config.log_every=1", "--config.progress=False"]
EXAMPLE = jax.ShapeDtypeStruct((1, 8, 8, 1), np.float32)


def _dtx(*args):
    script = os.path.join(os.path.dirname(sys.executable), "dtx")
    return ([script] if os.path.exists(script) else [sys.executable, "-m", "dtx.tools.cli"]) + list(args)


def _losses(workdir):
    """Per-step loss bits and batch hashes; a step logged twice is an error (a resume drops the records
    past its step, so every step has one history).

    ``data_digest`` chains every batch's hash since step 0: equal digests mean no batch was repeated
    or skipped across the restart."""
    records = [r for r in metrics.read_metrics(workdir) if "loss" in r]
    by_step = {r["step"]: r for r in records}
    assert len(by_step) == len(records), sorted(r["step"] for r in records)
    return {step: (np.float32(r["loss"]).tobytes(), r["batch_hash"], r["data_digest"]) for step, r in by_step.items()}


def _state(mesh, model=None, seed=0):
    model = model or models.build_model("mlp", features=(32,))
    tx = optax.adam(1e-3)
    return init_train_state(model, tx, EXAMPLE, seed, mesh), (model, tx)


def _target(model, tx, mesh):
    abstract = abstract_train_state(model, tx, EXAMPLE)
    return abstract_target(abstract, replicated_shardings(abstract, mesh))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One committed checkpoint (step 7) of an 8-device state."""
    directory = tmp_path_factory.mktemp("saved") / "checkpoints"
    state, (model, tx) = _state(mesh_lib.make_mesh([("data", 8)]))
    state = state.replace(step=state.step + 7)
    checkpointer = Checkpointer(directory)
    checkpointer.save(7, state, {"note": "fixture"})
    checkpointer.close()
    return directory, jax.device_get(state), model, tx


def _copy(saved_dir, tmp_path):
    target = tmp_path / "checkpoints"
    shutil.copytree(saved_dir, target)
    return target


def test_sigterm_saves_and_resume_is_bitwise_identical(tmp_path):
    """A real SIGTERM to `dtx train`: exit 0 with a checkpoint; rerunning the command resumes and
    matches an uninterrupted run bit for bit (per-step loss bits and the final state's digest)."""
    steps = ["--config.num_steps=100", "--config.checkpoint.every_steps=1000"]  # one process stops at once
    reference = train(config_lib.load(DEFAULT, RUN + steps), tmp_path / "reference")

    workdir = tmp_path / "preempted"
    command = _dtx("train", DEFAULT, "--workdir", str(workdir), *RUN, *steps)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.time() + 120
    while time.time() < deadline and not (
            (workdir / "metrics.jsonl").exists() and len(_losses(workdir)) >= 20):
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    assert "preempted" in output
    stopped_at = Checkpointer(workdir / "checkpoints").latest_step()
    assert 20 <= stopped_at < 100, "the signal must have stopped the run early"

    resumed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    records = metrics.read_metrics(workdir)
    assert any(r.get("resumed_from") == stopped_at for r in records)
    assert _losses(workdir) == _losses(tmp_path / "reference")
    final = Checkpointer(workdir / "checkpoints").restore(100, _target_like(reference.state))[0]
    assert state_digest(final) == state_digest(reference.state)
    assert records[-1]["test_accuracy"] == reference.metrics["test_accuracy"]


def _target_like(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


@pytest.mark.parametrize("devices", [8, 4, 1])
def test_restore_onto_other_meshes_is_exact(saved, devices):
    directory, state, model, tx = saved
    mesh = mesh_lib.make_mesh([("data", devices)], devices=jax.devices()[:devices])
    restored, metadata = Checkpointer(directory).restore(7, _target(model, tx, mesh))
    assert metadata == {"note": "fixture"}
    assert state_digest(restored) == state_digest(state)
    for leaf in jax.tree.leaves(restored):
        assert leaf.sharding.mesh.size == devices


def test_shape_mismatch_names_the_parameter(saved):
    directory, _, _, tx = saved
    wider = models.build_model("mlp", features=(64,))
    with pytest.raises(CheckpointError, match=r"params/Dense_0/bias.*saved as float32\[32\] but this run expects float32\[64\]"):
        Checkpointer(directory).restore(7, _target(wider, tx, mesh_lib.make_mesh([("data", 8)])))


def test_dtype_mismatch_is_refused(saved):
    directory, _, _, tx = saved
    half = models.build_model("mlp", features=(32,), param_dtype=np.dtype("bfloat16"))
    with pytest.raises(CheckpointError, match="bfloat16.*never casts"):
        Checkpointer(directory).restore(7, _target(half, tx, mesh_lib.make_mesh([("data", 8)])))


def test_structure_mismatch_is_refused(saved):
    directory, _, model, _ = saved
    with pytest.raises(CheckpointError, match="different structure"):
        Checkpointer(directory).restore(7, _target(model, optax.sgd(0.1, momentum=0.9),
                                                   mesh_lib.make_mesh([("data", 8)])))


def _data_files(directory, step=7):
    """The array data files restore reads (ocdbt's merged store), largest first."""
    data = directory / str(step) / "state" / "d"
    return sorted((str(data / name) for name in os.listdir(data)), key=os.path.getsize, reverse=True)


def test_bit_flip_is_refused(saved, tmp_path):
    directory = _copy(saved[0], tmp_path)
    victim = _data_files(directory)[0]
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(victim, "wb").write(bytes(data))
    assert open(victim, "rb").read() != open(_data_files(saved[0])[0], "rb").read()  # the fault fired
    with pytest.raises(CheckpointError, match="SHA-256|unreadable"):
        Checkpointer(directory).restore(7, _target(saved[2], saved[3], mesh_lib.make_mesh([("data", 8)])))


def test_arrays_from_another_checkpoint_are_refused(saved, tmp_path):
    """Valid array files that belong to another state (mixed-up copies): readable, so only the
    manifest's digests can tell."""
    directory = _copy(saved[0], tmp_path)
    other, _ = _state(mesh_lib.make_mesh([("data", 8)]), seed=1)
    other_checkpointer = Checkpointer(tmp_path / "other")
    other_checkpointer.save(7, other.replace(step=other.step + 7))
    other_checkpointer.close()
    shutil.rmtree(directory / "7" / "state")
    shutil.copytree(tmp_path / "other" / "7" / "state", directory / "7" / "state")
    with pytest.raises(CheckpointError, match="SHA-256"):
        Checkpointer(directory).restore(7, _target(saved[2], saved[3], mesh_lib.make_mesh([("data", 8)])))


def test_truncation_is_refused(saved, tmp_path):
    directory = _copy(saved[0], tmp_path)
    victim = _data_files(directory)[0]
    size = os.path.getsize(victim)
    with open(victim, "r+b") as f:
        f.truncate(size // 2)
    assert os.path.getsize(victim) == size // 2
    with pytest.raises(CheckpointError):
        Checkpointer(directory).restore(7, _target(saved[2], saved[3], mesh_lib.make_mesh([("data", 8)])))


def test_symlink_is_refused(saved, tmp_path):
    directory = _copy(saved[0], tmp_path)
    victim = _data_files(directory)[0]
    outside = tmp_path / "outside"
    shutil.copy(victim, outside)
    os.remove(victim)
    os.symlink(outside, victim)
    with pytest.raises(CheckpointError, match="symbolic link"):
        Checkpointer(directory).restore(7, _target(saved[2], saved[3], mesh_lib.make_mesh([("data", 8)])))


def test_stale_temporary_is_cleaned_and_ignored(saved, tmp_path):
    """A crash between write and commit leaves a temporary step directory: it is never restored."""
    directory = _copy(saved[0], tmp_path)
    stale = directory / "9.orbax-checkpoint-tmp-1234567"
    shutil.copytree(directory / "7", stale)
    checkpointer = Checkpointer(directory)
    assert not stale.exists()
    assert checkpointer.steps() == [7]


def test_non_finite_state_is_never_committed(tmp_path):
    state, _ = _state(mesh_lib.make_mesh([("data", 8)]))
    bad = state.replace(params=jax.tree.map(lambda x: x * np.nan, state.params))
    checkpointer = Checkpointer(tmp_path / "checkpoints")
    checkpointer.save(1, state)
    checkpointer.wait()
    with pytest.raises(CheckpointError, match="non-finite"):
        checkpointer.save(2, bad)
    checkpointer.close()
    assert Checkpointer(tmp_path / "checkpoints").steps() == [1]


_FAILING_SAVE = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # exceed the limit -> EFBIG error instead of a signal
import jax
jax.config.update("jax_num_cpu_devices", 8)
import optax, models
from dtx import mesh as mesh_lib
from dtx.ckpt.checkpoint import Checkpointer
from dtx.step.state import init_train_state
mesh = mesh_lib.make_mesh([("data", 8)])
state = init_train_state(models.build_model("mlp", features=(32,)), optax.adam(1e-3),
                         jax.ShapeDtypeStruct((1, 8, 8, 1), "float32"), 1, mesh)
checkpointer = Checkpointer(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
checkpointer.save(8, state)
checkpointer.close()
"""


def test_failing_storage_keeps_the_last_good_checkpoint(saved, tmp_path):
    directory = _copy(saved[0], tmp_path)
    run = subprocess.run([sys.executable, "-c", _FAILING_SAVE, str(directory)], capture_output=True, text=True,
                         cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
    assert run.returncode != 0, "the save must fail under a 64-byte file-size limit"
    assert "CheckpointError" in run.stderr or "File too large" in run.stderr
    checkpointer = Checkpointer(directory)
    assert checkpointer.steps() == [7]
    restored, _ = checkpointer.restore(7, _target(saved[2], saved[3], mesh_lib.make_mesh([("data", 8)])))
    assert state_digest(restored) == state_digest(saved[1])


def test_resume_modes(tmp_path):
    config = config_lib.load(DEFAULT, RUN + ["--config.num_steps=6", "--config.checkpoint.every_steps=3"])
    train(config, tmp_path)
    never = config_lib.override(config, **{"checkpoint.resume": "never"})
    with pytest.raises(FileExistsError, match="resume=never"):
        train(never, tmp_path)
    must = config_lib.override(config, **{"checkpoint.resume": "must"})
    with pytest.raises(FileNotFoundError, match="resume=must"):
        train(must, tmp_path / "fresh")
    saved_steps = sorted(int(n) for n in os.listdir(tmp_path / "checkpoints") if n.isdigit())
    assert saved_steps == [3, 6]
    json.loads((tmp_path / "config.json").read_text())
    # What the state means may not change on resume; run length and checkpointing may.
    other_lr = config_lib.override(config, **{"optimizer.learning_rate": 0.5})
    with pytest.raises(config_lib.ConfigError, match="cannot resume: optimizer differ"):
        train(other_lr, tmp_path)
    longer = config_lib.override(config, **{"num_steps": 8, "checkpoint.every_steps": 0})
    result = train(longer, tmp_path)  # resumes at 6, saves only at the end
    assert int(result.state.step) == 8
    assert sorted(int(n) for n in os.listdir(tmp_path / "checkpoints") if n.isdigit())[-1] == 8


def test_sigkill_during_async_saves_loses_nothing_committed(tmp_path):
    """SIGKILL while asynchronous saves are in flight: the newest *committed* checkpoint restores with
    its digests, the half-written one is ignored and cleaned, and resuming reproduces the
    uninterrupted run bit for bit."""
    steps = ["--config.num_steps=60", "--config.checkpoint.every_steps=2", "--config.model.features=(512, 512)"]
    reference = train(config_lib.load(DEFAULT, RUN + steps), tmp_path / "reference")
    workdir = tmp_path / "killed"
    command = _dtx("train", DEFAULT, "--workdir", str(workdir), *RUN, *steps)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    checkpoints = workdir / "checkpoints"
    deadline = time.time() + 120
    while time.time() < deadline and not (checkpoints.exists() and
                                          len([n for n in os.listdir(checkpoints) if n.isdigit()]) >= 3):
        time.sleep(0.01)
    process.kill()
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    committed = Checkpointer(checkpoints).latest_step()
    assert committed is not None and committed < 60, "the kill must land mid-run"
    resumed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert _losses(workdir) == _losses(tmp_path / "reference")
    final = Checkpointer(checkpoints).restore(60, _target_like(reference.state))[0]
    assert state_digest(final) == state_digest(reference.state)


def test_per_worker_state_refuses_another_worker_count_before_reading_arrays(tmp_path):
    """Error-feedback residuals belong to workers: 8 saved cannot become 4; the same count resumes."""
    topk = RUN + ["--config.num_steps=4", "--config.checkpoint.every_steps=2", "--config.compression.name=topk",
                  "--config.compression.fraction=0.1"]
    train(config_lib.load(DEFAULT, topk), tmp_path)
    # Every device is a worker (the batch splits over every mesh axis): 4 workers take a 4-device process.
    four = subprocess.run(_dtx("train", DEFAULT, "--workdir", str(tmp_path), *topk, "--config.num_steps=6",
                               "--config.emulate_cpu_devices=4"),
                          capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert four.returncode == 2
    assert re.search("per-worker state for 8 data-parallel workers.*has 4", four.stderr), four.stderr
    result = train(config_lib.load(DEFAULT, topk + ["--config.num_steps=6"]), tmp_path)
    assert int(result.state.step) == 6


# ------------------------------------------------------------------ divergence, fallback, resume_step
DIVERGE = ["--config.checkpoint.every_steps=5", "--config.optimizer.name=sgd", "--config.optimizer.learning_rate=300",
           "--config.num_steps=20", "--config.progress=False"]


def _committed(directory):
    """Step directories and orbax temporaries (a save that never committed) in ``directory``."""
    names = os.listdir(directory)
    return sorted(int(n) for n in names if n.isdigit()), [n for n in names if "tmp" in n]


def test_refused_save_lets_the_pending_save_commit(tmp_path):
    """A non-finite state is refused only after the save in flight has committed: the moment the error
    is raised, the last good step is on disk, committed and restorable. (64 MB of random data keep the
    earlier save writing while the refused one is checked.)"""
    mesh = mesh_lib.make_mesh([("data", 8)])
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    weights = jax.device_put(np.random.default_rng(0).standard_normal((4096, 4096), np.float32), sharding)
    checkpointer = Checkpointer(tmp_path, keep=1)
    checkpointer.save(5, {"w": weights * 0.5})
    checkpointer.wait()
    checkpointer.save(10, {"w": weights})  # still writing in the background ...
    with pytest.raises(CheckpointError, match=r"not saving step 15: 'w' has non-finite values.*\(step 10\) is kept"):
        checkpointer.save(15, {"w": weights * np.inf})
    assert _committed(tmp_path) == ([10], [])  # ... and committed before the error left save()
    target = {"w": jax.ShapeDtypeStruct(weights.shape, weights.dtype, sharding=sharding)}
    restored, _ = Checkpointer(tmp_path).restore(10, target)
    assert state_digest(restored) == state_digest({"w": weights})


def test_divergence_keeps_the_last_good_checkpoint_cli_and_api(tmp_path):
    """The probe of the issue: training at lr=300 diverges after step 5. `dtx train` exits non-zero and
    train() raises; either way step 5 — still being written when the run stopped — is committed the
    moment the error is out (nothing is left to commit, or delete steps, after the caller saw it) and
    restores bit-identical to the state after 5 steps."""
    run = subprocess.run(_dtx("train", DEFAULT, "--workdir", str(tmp_path / "cli"), *DIVERGE), capture_output=True,
                         text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert run.returncode != 0
    assert "not saving step 10" in run.stderr or "diverged" in run.stderr, run.stderr[-2000:]
    assert "cannot schedule new futures" not in run.stderr and "Failed to run" not in run.stderr, run.stderr[-3000:]
    assert _committed(tmp_path / "cli" / "checkpoints") == ([5], [])

    # Logging every step, the non-finite loss stops the run before step 10 is even saved: any error
    # leaving the loop lets the pending save commit, not only a refused save.
    config = config_lib.load(DEFAULT, DIVERGE + ["--config.log_every=1"])
    with pytest.raises((CheckpointError, FloatingPointError), match="non-finite|diverged"):
        train(config, tmp_path / "api")
    assert _committed(tmp_path / "api" / "checkpoints") == ([5], [])

    five = train(config_lib.override(config, num_steps=5, **{"checkpoint.every_steps": 0}), tmp_path / "five").state
    for workdir in ("cli", "api"):
        restored, _ = Checkpointer(tmp_path / workdir / "checkpoints").restore(5, _target_like(five))
        assert state_digest(restored) == state_digest(five), workdir


def test_resume_falls_back_past_a_damaged_step_and_resume_step_is_exact(tmp_path, capfd):
    """Steps 2, 4, 6 saved; 6 damaged. resume_step=3 (absent) and resume_step=6 (damaged) are refused
    by name; resume=auto skips 6 loudly (stderr and a record field), resumes 4, moves 6 aside (kept),
    and the records past step 4 are truncated: one record per step, and the redone steps 5-6 equal
    the first run's bit for bit."""
    base = RUN + ["--config.checkpoint.every_steps=2", "--config.checkpoint.async_save=False"]
    train(config_lib.load(DEFAULT, base + ["--config.num_steps=6"]), tmp_path)
    victim = _data_files(tmp_path / "checkpoints", step=6)[0]
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(victim, "wb").write(bytes(data))
    first = {r["step"]: r["loss"] for r in metrics.read_metrics(tmp_path) if "loss" in r}
    assert sorted(first) == [1, 2, 3, 4, 5, 6]

    longer = config_lib.load(DEFAULT, base + ["--config.num_steps=8"])
    with pytest.raises(FileNotFoundError, match=r"resume_step=3 .*holds no step 3 \(it holds \[2, 4, 6\]\)"):
        train(config_lib.override(longer, **{"checkpoint.resume_step": 3}), tmp_path)
    with pytest.raises(CheckpointError, match=r"resume_step=6: checkpoint .*/6.*(SHA-256|unreadable)"):
        train(config_lib.override(longer, **{"checkpoint.resume_step": 6}), tmp_path)
    capfd.readouterr()
    result = train(longer, tmp_path)
    err = capfd.readouterr().err
    assert re.search(r"not resuming from checkpoint step 6: checkpoint .*/6", err), err
    assert "resumed from step 4" in err
    assert int(result.state.step) == 8
    records = metrics.read_metrics(tmp_path)
    header = next(r for r in records if r.get("resumed_from") == 4)
    assert [(s["step"], "/6" in s["reason"]) for s in header["resume_skipped"]] == [(6, True)]
    losses = [r for r in records if "loss" in r]
    assert [r["step"] for r in losses] == list(range(1, 9))  # steps 5 and 6 once, from the resumed run
    assert all(np.float32(r["loss"]) == np.float32(first[r["step"]]) for r in losses if r["step"] <= 6)
    superseded = [json.loads(line) for line in open(tmp_path / metrics.SUPERSEDED_FILE)]
    assert sorted(r["step"] for r in superseded if "loss" in r) == [5, 6]
    assert [n.split(".")[0] for n in os.listdir(tmp_path / "checkpoints" / "superseded")] == ["6"]
    assert _committed(tmp_path / "checkpoints")[0] == [4, 6, 8]  # 6 saved anew by the resumed run


def test_checkpoint_keys_are_checked_at_load_time():
    """The new keys fail when the config is loaded, naming the key and the fix, like every other key."""
    for overrides, message in ((["--config.checkpoint.resume_step=-1"], "resume_step=-1 must be >= 0"),
                               (["--config.checkpoint.resume_step=4", "--config.checkpoint.resume=never"],
                                "resume_step=4 asks to resume but checkpoint.resume='never'"),
                               (["--config.checkpoint.hmac_key_env=my secret"], "is not an environment variable name"),
                               (["--config.checkpoint.resume_step=four"], "checkpoint.resume_step.*wrong type")):
        with pytest.raises(config_lib.ConfigError, match=message):
            config_lib.load(DEFAULT, overrides)
    assert config_lib.load(DEFAULT, ["--config.checkpoint.hmac_key_env=DTX_KEY"]).checkpoint.hmac_key_env == "DTX_KEY"


def test_a_run_that_dies_right_after_a_checkpoint_still_has_that_steps_record(tmp_path, monkeypatch):
    """A step's record is written one step late (lag-1), but a checkpoint of it must not commit first: a run
    that died after saving step 7 and before dispatching step 8 (the chaos benchmark's rank asleep in its input
    pipeline, then killed) was resumed from step 7 with no record of step 7, ever. The loop settles the saved
    step at once (StepLog.settle): the resumed run has one record for every step."""
    from dtx.data.loader import TrainLoader

    config = config_lib.load("digits_mlp", ["--config.num_steps=10", "--config.model.features=(16,)",
                                            "--config.log_every=1", "--config.progress=False",
                                            "--config.checkpoint.every_steps=7", "--config.checkpoint.async_save=False"])
    batch = TrainLoader.batch

    def dies_before_step_8(self, step):
        if step == 7:
            raise RuntimeError("the process dies here, after the save of step 7")
        return batch(self, step)

    monkeypatch.setattr(TrainLoader, "batch", dies_before_step_8)
    with pytest.raises(RuntimeError, match="dies here"):
        train(config, str(tmp_path))
    assert Checkpointer(tmp_path / "checkpoints").latest_step() == 7
    monkeypatch.setattr(TrainLoader, "batch", batch)
    train(config, str(tmp_path))
    assert sorted(r["step"] for r in metrics.read_metrics(str(tmp_path)) if "loss" in r) == list(range(1, 11))
