"""One run per workdir (dtx.run.lock): a second `dtx train` or `dtx launch` on a workdir in use is refused before
it writes anything, naming the holder; a holder killed by SIGKILL leaves nothing that blocks the next run. And
no run waits forever on a save (dtx.ckpt.checkpoint): the probe's two runs on one workdir hung at exit."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dtx.run import lock as lock_lib
from dtx.run.lock import WorkdirInUse, WorkdirLock
from dtx.tools.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(REPO, "experiments", "digits_mlp.py")

# Another process holding the lock: dtx.run.lock is standard library only, so it is loaded from its file
# without importing dtx (milliseconds, not seconds).
HOLDER = f"""
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("lock", {lock_lib.__file__!r})
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)
lock.WorkdirLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
    """A live process holding ``tmp_path/run``, killed (SIGKILL) by the test or at its end."""
    workdir = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(workdir), "--marker"], stdout=subprocess.PIPE,
                               text=True)
    assert process.stdout.readline().strip() == "held"
    yield workdir, process
    process.kill()
    process.wait(timeout=30)


def test_a_second_train_or_launch_is_refused_naming_the_holder_before_writing(holder, capsys):
    workdir, process = holder
    with pytest.raises(WorkdirInUse, match=rf"(?s)in use by process {process.pid} on .*--marker"):
        WorkdirLock(workdir).acquire()
    assert main(["train", DEFAULT, "--workdir", str(workdir), "--config.num_steps=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dtx: error: workdir '{workdir}' is in use by process {process.pid}") and "--marker" in err
    assert main(["launch", "--processes", "2", "--devices-per-process", "4", DEFAULT, "--workdir", str(workdir)]) == 2
    assert f"is in use by process {process.pid}" in capsys.readouterr().err
    assert sorted(os.listdir(workdir)) == [lock_lib.LOCK_FILE]  # neither wrote a record, a log or a checkpoint
    # Two workdirs sharing one checkpoint.dir would write each other's steps: the folder is locked too.
    assert main(["train", DEFAULT, "--workdir", str(workdir.parent / "other"), f"--config.checkpoint.dir={workdir}",
                 "--config.checkpoint.every_steps=1"]) == 2
    assert f"checkpoint.dir '{workdir}' is in use by process {process.pid}" in capsys.readouterr().err
    assert not (workdir.parent / "other").exists()


def test_a_killed_holder_leaves_nothing_that_blocks_the_next_run(holder):
    workdir, process = holder
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    stale = workdir / lock_lib.LOCK_FILE
    assert json.loads(stale.read_text())["pid"] == process.pid  # the file outlived its process; the lock did not
    with WorkdirLock(workdir) as held:
        assert json.loads(stale.read_text())["pid"] == os.getpid()
        with pytest.raises(WorkdirInUse, match=f"process {os.getpid()}"):  # one holder at a time, in-process too
            WorkdirLock(workdir).acquire()
        assert held.token() == f"{os.getpid()}:{workdir}"
    assert not stale.exists()


def test_release_removes_a_workdir_it_created_only_while_empty(tmp_path):
    with WorkdirLock(tmp_path / "refused"):
        pass
    assert not (tmp_path / "refused").exists()  # a run refused before its first record leaves no folder
    with WorkdirLock(tmp_path / "ran"):
        (tmp_path / "ran" / "metrics.jsonl").write_text("{}\n")
    assert os.listdir(tmp_path / "ran") == ["metrics.jsonl"]


def test_a_launched_rank_trusts_only_its_own_parent(tmp_path, monkeypatch):
    """``dtx launch`` holds the lock for its ranks; the environment variable it sets helps no other process."""
    workdir = tmp_path / "run"
    with WorkdirLock(workdir):
        monkeypatch.setenv(lock_lib.ENV_HELD, f"{os.getppid()}:{workdir}")  # as if our parent were the launcher
        with WorkdirLock(workdir) as rank:
            assert rank._fd is None  # took nothing: the parent holds it
        monkeypatch.setenv(lock_lib.ENV_HELD, f"{os.getpid()}:{workdir}")  # not our parent
        with pytest.raises(WorkdirInUse):
            WorkdirLock(workdir).acquire()


def test_a_stalled_save_ends_the_wait_with_an_error_instead_of_hanging(tmp_path, monkeypatch):
    """Every wait on orbax is bounded: a save whose storage stalls (here the manifest write, in orbax's commit
    thread) ends the wait with an error naming the bound; the CLI then exits without joining the stuck thread."""
    import threading

    import jax.numpy as jnp

    from dtx.ckpt import checkpoint, handlers

    storage = threading.Event()
    write = handlers.ManifestHandler.save
    monkeypatch.setattr(handlers.ManifestHandler, "save", lambda self, *args: (storage.wait(60), write(self, *args)))
    saver = checkpoint.Checkpointer(tmp_path / "checkpoints", async_save=True)
    saver.save(1, {"w": jnp.arange(8.0)})
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"did not finish within 0.5 s .* newest committed step is None"):
        saver.wait(timeout_s=0.5)
    assert checkpoint.stalled()
    storage.set()  # the storage recovers: the save commits, and nothing is stuck any more
    saver.close()
    assert saver.steps() == [1]
    deadline = time.monotonic() + 30  # the given-up wait ends with the save it waited for
    while checkpoint.stalled() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not checkpoint.stalled()
