"""dtx eval / dtx export / resume_step from the command line, on one trained workdir shared by the module.

The run: digits, a small LeNet with batch norm, 10 steps on 8 devices, checkpoints at 5 and 10
and an evaluation record at 5 — so every figure ``dtx eval`` prints has a recorded twin to equal,
and an export carries batch-norm statistics as well as parameters.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from dtx.run import evaluate, metrics
from dtx.tools.cli import main

EXPERIMENT = textwrap.dedent('''
    """A tiny run for tests/test_evaluate.py."""
    from ml_collections import ConfigDict

    from dtx.config import base_config


    def get_config():
        config = base_config()
        config.model = ConfigDict(dict(name="lenet", conv_features=(4,), dense_features=()))
        config.global_batch_size = 64
        config.eval_batch_size = 64
        config.num_steps = 10
        config.log_every = 5
        config.eval_every = 5
        config.checkpoint.every_steps = 5
        config.progress = False
        return config
''')


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The experiment file and the workdir of one finished run, trained through the CLI."""
    root = tmp_path_factory.mktemp("evaluate")
    experiment = root / "tiny.py"
    experiment.write_text(EXPERIMENT)
    workdir = root / "run"
    assert main(["train", str(experiment), "--workdir", str(workdir)]) == 0
    return experiment, workdir


def _test_metrics(record):
    return {k: record[k] for k in ("test_accuracy", "test_loss", "test_examples")}


def test_eval_equals_the_runs_final_evaluation(run, capsys):
    _, workdir = run
    final = metrics.read_metrics(workdir)[-1]
    assert final["step"] == 10
    capsys.readouterr()
    assert main(["eval", str(workdir)]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # The same program on the same batches and the same restored bits: equal, not close.
    assert printed == {"step": 10, **_test_metrics(final)}


def test_eval_step_picks_that_checkpoint(run):
    _, workdir = run
    at_5 = [r for r in metrics.read_metrics(workdir) if r["step"] == 5 and "test_loss" in r]
    assert len(at_5) == 1
    result = evaluate.evaluate_run(workdir, step=5)
    assert result == {"step": 5, **_test_metrics(at_5[0])}
    assert result["test_loss"] != metrics.read_metrics(workdir)[-1]["test_loss"]  # step 10 differs


def test_eval_refuses_a_step_it_does_not_hold_and_a_run_without_checkpoints(run, tmp_path, capsys):
    _, workdir = run
    assert main(["eval", str(workdir), "--step", "7"]) == 2
    assert "holds no checkpoint 7; it holds [5, 10]" in capsys.readouterr().err
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(workdir / "config.json", bare / "config.json")
    with pytest.raises(evaluate.RunError, match="train one with dtx train EXPERIMENT.py --config.checkpoint.every"):
        evaluate.evaluate_run(bare)


def test_eval_and_export_refusals_name_fixes_those_commands_take(run, tmp_path, monkeypatch, capsys):
    """The probe: their errors said --workdir, --config.KEY=VALUE and checkpoint.resume_step=N, which only dtx train
    takes. Now each names WORKDIR, --step, config.json (which they rebuild the run from) or dtx train itself."""
    _, workdir = run
    assert main(["eval", str(tmp_path)]) == 2  # no config.json
    err = capsys.readouterr().err
    assert "name as WORKDIR the folder a dtx train run wrote into" in err and "--workdir" not in err

    elsewhere = tmp_path / "elsewhere"  # a run of files that are not where config.json says
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text(json.dumps({"dataset": {"name": "mnist",
                                                                   "data_dir": str(tmp_path / "gone")}}))
    assert main(["export", str(elsewhere), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "set dataset.data_dir to an existing folder" in err and "--config.dataset" not in err
    assert f"change that key in {elsewhere}/config.json" in err and len(err.strip().splitlines()) == 1

    signed = tmp_path / "signed"  # a run that signed its manifests; its key is not in this environment
    (signed / "checkpoints" / "10").mkdir(parents=True)
    saved = json.loads((workdir / "config.json").read_text())
    saved["checkpoint"]["hmac_key_env"] = "DTX_TEST_ABSENT_KEY"
    (signed / "config.json").write_text(json.dumps(saved))
    monkeypatch.delenv("DTX_TEST_ABSENT_KEY", raising=False)
    assert main(["eval", str(signed)]) == 2
    err = capsys.readouterr().err
    assert "export DTX_TEST_ABSENT_KEY with that same key" in err and "hmac_key_env=''" not in err

    damaged = tmp_path / "damaged"
    shutil.copytree(workdir, damaged)
    (damaged / "checkpoints" / "10" / "manifest" / "manifest.json").write_text("{")
    assert main(["eval", str(damaged)]) == 4  # a checkpoint error
    err = capsys.readouterr().err
    assert "manifest" in err and "resume_step" not in err
    assert f"choose another step with --step N ({damaged}/checkpoints also holds [5]) or delete this one" in err
    assert main(["eval", str(damaged), "--step", "5"]) == 0  # and that fix works


@pytest.mark.parametrize("block, entry, argument", [
    ("model", {"class": "mine.Net", "fields": {}}, "model"),
    ("dataset", {"fingerprint": "0123abcd", "description": None}, "data"),
])
def test_eval_of_a_run_given_its_model_or_data_asks_for_them(tmp_path, block, entry, argument):
    (tmp_path / "config.json").write_text(json.dumps({block: {"given": f"dtx.train({argument}=...)", **entry}}))
    with pytest.raises(evaluate.RunError, match=rf"dtx\.train\({argument}=.*evaluate_run\(.*{argument}=\.\.\.\)"):
        evaluate.evaluate_run(tmp_path)


LOAD = textwrap.dedent('''
    import importlib.util, json, sys
    import flax.serialization
    import numpy as np

    out, inputs = sys.argv[1], np.load(sys.argv[2])
    meta = json.load(open(f"{out}/model.json"))
    spec = importlib.util.spec_from_file_location("exported_model", f"{out}/model.py")
    source = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = source
    spec.loader.exec_module(source)
    model = getattr(source, meta["class_name"])(**meta["kwargs"])
    with open(f"{out}/variables.msgpack", "rb") as f:
        variables = flax.serialization.msgpack_restore(f.read())
    np.save(sys.argv[3], np.asarray(model.apply(variables, inputs, train=False)))
    assert not any(name == "dtx" or name.startswith("dtx.") for name in sys.modules), "dtx was imported"
''')


def test_export_loads_into_plain_flax_with_identical_logits(run, tmp_path, capsys):
    _, workdir = run
    out = tmp_path / "exported"
    assert main(["export", str(workdir), "--out", str(out), "--step", "5"]) == 0
    described = json.loads((out / "model.json").read_text())
    assert described["step"] == 5 and described["class_name"] == "LeNet" and described["source"] == "model.py"
    assert described["kwargs"]["conv_features"] == [4] and described["kwargs"]["num_classes"] == 10
    assert described["collections"] == ["batch_stats", "params"]

    restored = evaluate.restore(workdir, step=5)
    inputs = restored.dataset.test.inputs[:16]
    variables = jax.device_get({"params": restored.state.params, **restored.state.model_state})
    expected = np.asarray(restored.parts.model.apply(variables, inputs, train=False))
    np.save(tmp_path / "inputs.npy", inputs)
    # A fresh interpreter that imports flax and numpy only, as a user without dtx would. It keeps this process's
    # XLA flags but a device count: the same flags compile the same code (a run of the suite under
    # --xla_cpu_max_isa=AVX read logits 1.8e-7 apart when the child dropped them all), so the logits are identical.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env.update({"XLA_FLAGS": " ".join(flags)} if flags else {})
    subprocess.run([sys.executable, "-c", LOAD, str(out), str(tmp_path / "inputs.npy"), str(tmp_path / "logits.npy")],
                   check=True, env={**env, "JAX_PLATFORMS": "cpu"}, cwd=tmp_path, timeout=120)
    np.testing.assert_array_equal(np.load(tmp_path / "logits.npy"), expected)

    # An export is never overwritten.
    assert main(["export", str(workdir), "--out", str(out)]) == 2
    assert "never overwrites" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["LeNet", "MLP", "VGGA", "ResNet18", "SpeechDNN", "OverFeatFast"])
def test_the_zoos_models_export_their_source_in_one_file(name):
    """An export carries model.py only for a module that imports no other dtx module: the zoo's models stay one
    file each (a shared helper module once made LeNet's export lose its source; only the CI run saw it)."""
    import models
    assert evaluate._self_contained_source(getattr(models, name)) is not None


def test_resume_step_from_the_command_line(run, tmp_path, capsys):
    experiment, workdir = run
    copy = tmp_path / "copy"
    shutil.copytree(workdir, copy)
    capsys.readouterr()
    assert main(["train", str(experiment), "--workdir", str(copy), "--config.checkpoint.resume_step=5"]) == 0
    assert "dtx: resumed from step 5" in capsys.readouterr().err
    # Steps 6-10 again from step 5's checkpoint: the same run, bit for bit.
    assert _test_metrics(metrics.read_metrics(copy)[-1]) == _test_metrics(metrics.read_metrics(workdir)[-1])


def test_a_finished_run_run_again_does_not_record_its_final_evaluation_twice(run, tmp_path, capsys):
    """The probe: the same dtx train again on a finished workdir resumed its last checkpoint, ran no step and
    appended a second evaluation record of step 10. It still evaluates (and prints what it recorded)."""
    experiment, workdir = run
    copy = tmp_path / "copy"
    shutil.copytree(workdir, copy)
    capsys.readouterr()
    assert main(["train", str(experiment), "--workdir", str(copy)]) == 0
    out, err = capsys.readouterr()
    evaluations = [r for r in metrics.read_metrics(copy) if r["step"] == 10 and "test_loss" in r]
    assert len(evaluations) == 1
    assert "dtx: resumed from step 10" in err and "had already finished at step 10" in err
    assert f"step 10: test_loss {evaluations[0]['test_loss']:.4f}" in out  # the same figures as recorded


def test_an_export_appears_whole_or_not_at_all_and_a_half_written_one_is_replaced(run, tmp_path, monkeypatch,
                                                                                  capsys):
    """The probe: SIGTERM/SIGKILL mid-export left variables.msgpack truncated, and the rerun refused it
    ("already holds variables.msgpack") without saying it was incomplete."""
    from dtx.run import exportdir

    _, workdir = run
    out = tmp_path / "exported"
    fsync = os.fsync

    def storage_fails_after_the_first_file(fd):
        monkeypatch.setattr(os, "fsync", lambda _: (_ for _ in ()).throw(OSError(28, "No space left on device")))
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", storage_fails_after_the_first_file)
    with pytest.raises(OSError, match="No space left on device"):
        evaluate.export_run(workdir, out, step=5)
    monkeypatch.setattr(os, "fsync", fsync)
    assert os.listdir(tmp_path) == []  # neither a half-written export nor its temporary folder

    gone = subprocess.Popen([sys.executable, "-c", ""])  # a pid no process has any more: a SIGKILLed export's
    gone.wait()
    (tmp_path / f".exported.partial-{gone.pid}").mkdir()
    (tmp_path / f".exported.partial-{gone.pid}" / "variables.msgpack").write_bytes(b"\x82")
    assert main(["export", str(workdir), "--out", str(out), "--step", "5"]) == 0
    assert os.listdir(tmp_path) == ["exported"]  # the killed export's temporary is gone with it
    whole = (out / "variables.msgpack").read_bytes()
    (out / "variables.msgpack").write_bytes(whole[: len(whole) // 2])  # what a killed older export left
    assert main(["export", str(workdir), "--out", str(out), "--step", "5"]) == 0
    assert (f"dtx: --out {out} holds an incomplete export (variables.msgpack is not the one model.json names "
            "(truncated?)); replacing it") in capsys.readouterr().err
    assert (out / "variables.msgpack").read_bytes() == whole and exportdir.incomplete(str(out)) is None
    (out / "model.json").write_text("")
    assert exportdir.incomplete(str(out)) == "model.json is truncated or garbled"


def test_a_sigterm_once_the_export_is_in_place_does_not_undo_its_success(run, tmp_path, monkeypatch, capsys):
    """The probe: a dtx export that had finished exited 143 when a SIGTERM came on its way out. From the rename
    that puts the folder in place, the dtx export process ignores SIGTERM; a failed publication gives it back."""
    from dtx import _sigterm
    from dtx.run import exportdir

    _, workdir = run
    out = tmp_path / "exported"
    monkeypatch.setattr(sys, "orig_argv", ["/venv/bin/dtx", "export", str(workdir), "--out", str(out)])
    rename, at_rename = os.rename, []

    def rename_then_sigterm(source, target):
        rename(source, target)
        if target == str(out):
            at_rename.append(signal.getsignal(signal.SIGTERM))
            if at_rename[-1] is not signal.SIG_DFL:  # (the default action would kill the test's process)
                os.kill(os.getpid(), signal.SIGTERM)  # a SIGTERM the instant the export is in place

    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    monkeypatch.setattr(exportdir.os, "rename", rename_then_sigterm)
    try:
        assert main(["export", str(workdir), "--out", str(out), "--step", "5"]) == 0
        assert at_rename and at_rename[0] is not signal.SIG_DFL  # held back during the rename ...
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # ... and ignored on the way out
        os.kill(os.getpid(), signal.SIGTERM)
        assert exportdir.incomplete(str(out)) is None and "step 5: " in capsys.readouterr().out
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with pytest.raises(OSError, match="Read-only"), _sigterm.publishing():  # a failed publication: SIGTERM kills
        raise OSError(30, "Read-only file system")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    monkeypatch.setattr(sys, "orig_argv", ["python", "my_program.py"])  # export_run in your program: untouched
    with _sigterm.publishing():
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
