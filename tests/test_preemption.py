"""dtx.ckpt.preemption: SIGTERM inside the watcher is a request to stop at the next step boundary, not a death;
leaving the watcher puts the previous handler back; a disabled watcher never asks to stop. The dtx command
catches SIGTERM from its first moment (dtx._sigterm), so a signal at any moment -- during the imports, a
save, a restore -- ends the run cleanly (exit 0, "preempted ...") and the same command then resumes."""
import os
import signal
import subprocess
import sys
import time

from dtx import _sigterm
from dtx.ckpt.preemption import PreemptionWatcher


def test_sigterm_becomes_a_stop_request_and_the_old_handler_returns():
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionWatcher(multi_process=False) as watcher:
        assert not watcher.requested(3)
        os.kill(os.getpid(), signal.SIGTERM)  # the process lives on: the handler only sets a flag
        assert watcher.requested(4)
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_disabled_watcher_installs_nothing_and_never_stops():
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionWatcher(enabled=False, multi_process=False) as watcher:
        assert signal.getsignal(signal.SIGTERM) is before
        assert not watcher.requested(1)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(REPO, "experiments", "digits_mlp.py")
TINY = ["--config.model.features=(32,)", "--config.log_every=1", "--config.progress=False"]


def test_only_the_dtx_train_and_launch_commands_catch_sigterm_before_their_imports():
    assert _sigterm._is_dtx_command(["/venv/bin/python3", "/venv/bin/dtx", "train", "digits_mlp"])
    assert _sigterm._is_dtx_command(["python", "-m", "dtx.tools.cli", "train", "x.py"])  # dtx launch's ranks
    assert _sigterm._is_dtx_command(["dtx", "launch", "--processes", "2"])
    assert not _sigterm._is_dtx_command(["/venv/bin/dtx", "export", "runs/x"])
    assert not _sigterm._is_dtx_command(["python", "my_training.py", "train"])  # your program importing dtx
    assert not _sigterm._is_dtx_command(["python", "-c", "import dtx"])
    assert not _sigterm.installed()  # pytest imported dtx: nothing was installed


def _catches_sigterm(pid):
    with open(f"/proc/{pid}/status") as f:
        caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def test_sigterm_while_dtx_train_still_imports_ends_cleanly_before_the_first_step(tmp_path):
    """The probe: SIGTERM in the first ~1.5 s killed `dtx train` with signal 15 (its handler came with the run).
    Now the handler is there before jax is even loaded; the run stops before its first step and says so,
    saving nothing."""
    command = [sys.executable, "-m", "dtx.tools.cli", "train", DEFAULT, "--workdir", str(tmp_path), *TINY,
               "--config.num_steps=4", "--config.checkpoint.every_steps=2"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not _catches_sigterm(process.pid) and time.monotonic() < deadline:
        time.sleep(0.002)
    with open(f"/proc/{process.pid}/maps") as f:
        assert "jaxlib" not in f.read(), "the handler must come before the heavy imports"
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    assert out.strip() == ("preempted at step 0 before anything new was saved; run the same command to start "
                           "again"), out
    assert not any(name.isdigit() for name in os.listdir(tmp_path / "checkpoints"))
    # That command then trains: tests/test_trainer.py's SIGTERM during start-up leaves this same workdir.


def _terminated_when_called(function):
    def wrapper(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # the main thread runs the handler before the next bytecode
        return function(*args, **kwargs)
    return wrapper


def test_sigterm_during_a_save_or_a_restore_ends_cleanly_and_the_next_run_resumes(tmp_path, monkeypatch, capsys):
    from dtx.ckpt import checkpoint
    from dtx.run import metrics, rundir
    from dtx.tools.cli import main

    args = ["train", DEFAULT, "--workdir", str(tmp_path), *TINY, "--config.checkpoint.every_steps=3"]
    save = checkpoint.Checkpointer.save
    with monkeypatch.context() as patched:  # the signal comes while step 3 is being saved
        patched.setattr(checkpoint.Checkpointer, "save", lambda self, step, *rest: (
            _terminated_when_called(save) if step == 3 else save)(self, step, *rest))
        assert main([*args, "--config.num_steps=6"]) == 0
    assert capsys.readouterr().out.strip() == ("preempted: checkpoint saved at step 4; run the same command to "
                                               "resume")  # the next step boundary saved too
    with monkeypatch.context() as patched:  # the signal comes while step 4 is being restored
        patched.setattr(rundir, "resume", _terminated_when_called(rundir.resume))
        assert main([*args, "--config.num_steps=6"]) == 0
    out, err = capsys.readouterr()
    assert "dtx: resumed from step 4" in err and out.startswith("preempted: checkpoint saved at step 4;")
    assert main([*args, "--config.num_steps=6"]) == 0
    assert capsys.readouterr().out.startswith("step 6: test_loss")
    records = metrics.read_metrics(tmp_path)
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]  # every step once
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
