"""dtx.ckpt.barrier: under SLURM-style start (one `dtx train` per host with the multi-host environment, no
launcher to bound anything) a rank that never arrives at a restore or a save ends the job within the bound, named,
with nothing written; and every start records who it ran on (membership) though no launcher told it. One job of
2 processes x 2 devices, tiny MLP, three starts (each costs JAX start-up twice: kept to these)."""

import os
import socket
import subprocess
import sys
import time

import pytest

from dtx.run import metrics
from dtx.run.watchdog import EXIT_CODE as WATCHDOG_EXIT

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(REPO, "experiments", "digits_mlp.py")
TINY = ["--config.model.features=(16,)", "--config.log_every=1", "--config.progress=False",
        "--config.checkpoint.every_steps=2", "--config.heartbeat_seconds=10"]
BOUND = 10  # watchdog_seconds: the agreements of a restore and a save wait this long for a rank

# A rank alive but never at the restore, the save or an evaluation (asleep; its heartbeats go on, its own watchdog
# is paused there): rank 1 sleeps where the restore, the save of step 4 or the final evaluation begins, or
# inside the final evaluation after its second batch, as ASLEEP says; with DIFFER, rank 1 runs another learning rate.
_ASLEEP = """
import os, time
from dtx.ckpt import checkpoint

_resume, _arrive = checkpoint.Checkpointer.resume, checkpoint.Checkpointer.arrive


def _resume_late(self, *args, **kwargs):
    if os.environ.get("DTX_PROCESS_ID") == "1" and os.environ.get("ASLEEP") == "restore":
        time.sleep(600)
    return _resume(self, *args, **kwargs)


def _arrive_late(self, step):
    if os.environ.get("DTX_PROCESS_ID") == "1" and os.environ.get("ASLEEP") == "save" and step == 4:
        time.sleep(600)
    return _arrive(self, step)


checkpoint.Checkpointer.resume, checkpoint.Checkpointer.arrive = _resume_late, _arrive_late

from dtx.run import trainer

_evaluation = trainer.arrive_at_evaluation


def _evaluation_late(config, step):
    if os.environ.get("DTX_PROCESS_ID") == "1" and os.environ.get("ASLEEP") == "evaluation":
        time.sleep(600)
    return _evaluation(config, step)


trainer.arrive_at_evaluation = _evaluation_late

from dtx.run import watchdog

_alive = watchdog.StepWatchdog.alive


def _alive_late(self):  # called after each evaluation batch past the first
    if os.environ.get("DTX_PROCESS_ID") == "1" and os.environ.get("ASLEEP") == "inside":
        time.sleep(600)
    return _alive(self)


watchdog.StepWatchdog.alive = _alive_late


def get_config():
    default = {}
    exec(open(%r).read(), default)
    config = default["get_config"]()
    if os.environ.get("DTX_PROCESS_ID") == "1" and os.environ.get("DIFFER"):  # started with another setting
        config.optimizer.learning_rate *= 2
    return config
""" % DEFAULT


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_style(experiment, workdir, *overrides, processes=2, extra_env=None):
    """``processes`` x ``dtx train`` as a SLURM job script starts them: the coordinator, the count and each rank's
    index in its environment, nothing watching them."""
    port, started = _port(), []
    for rank in range(processes):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", **(extra_env or {})}
        env.pop("DTX_PROGRESS_DIR", None)
        if processes > 1:
            env.update(DTX_COORDINATOR=f"127.0.0.1:{port}", DTX_NUM_PROCESSES=str(processes),
                       DTX_PROCESS_ID=str(rank))
        started.append(subprocess.Popen(
            [sys.executable, "-m", "dtx.tools.cli", "train", experiment, "--workdir", str(workdir), *TINY,
             *overrides], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    return started


def _finish(processes, timeout):
    """Each process's (exit code, stderr, seconds it took from now), killing any still running at ``timeout``."""
    start, ended = time.monotonic(), []
    for p in processes:
        try:
            _, err = p.communicate(timeout=max(1, timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        ended.append((p.returncode, err, time.monotonic() - start))
    return ended


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The first start: 2 processes x 2 devices train 4 steps, checkpoints at 2 and 4."""
    root = tmp_path_factory.mktemp("slurm")
    experiment = root / "asleep.py"
    experiment.write_text(_ASLEEP)
    workdir = root / "run"
    ended = _finish(_slurm_style(str(experiment), workdir, "--config.num_steps=4",
                                 "--config.emulate_cpu_devices=2"), timeout=300)
    assert all(code == 0 for code, _, _ in ended), ended
    return experiment, workdir


def _files(directory):
    return sorted(os.path.relpath(os.path.join(root, name), directory)
                  for root, dirs, names in os.walk(directory) for name in dirs + names
                  if "logs" not in root and not name.startswith(".dtx-lock"))


def test_a_rank_that_never_arrives_at_the_restore_is_named_within_the_bound(job):
    """Rank 1 sleeps before the restore (alive: its heartbeats go on, so JAX sees nothing wrong). Rank 0 waits for
    it at the restore's agreement for watchdog_seconds, then fails naming rank 1 with the step watchdog's exit
    code (a stuck peer: dtx launch restarts without it); a collective there waited forever. Rank 1 loses the
    coordinator and ends. Nothing is written: the same files, the same records, no checkpoint moved aside."""
    experiment, workdir = job
    before = _files(workdir), (workdir / "metrics.jsonl").read_bytes()
    rank0, rank1 = _finish(_slurm_style(str(experiment), workdir, "--config.num_steps=6",
                                        "--config.emulate_cpu_devices=2", f"--config.watchdog_seconds={BOUND}",
                                        extra_env={"ASLEEP": "restore"}), timeout=240)
    assert rank0[0] == WATCHDOG_EXIT, rank0[1]
    assert f"rank 1 did not reach the restore of checkpoint step 4 within {BOUND} s" in rank0[1], rank0[1]
    assert rank1[0] != 0 and rank1[2] < 200, rank1  # ended, not asleep for its 600 s
    assert (_files(workdir), (workdir / "metrics.jsonl").read_bytes()) == before


def test_a_rank_that_never_arrives_at_a_save_is_named_and_the_start_recorded_who_ran(job):
    """A second start without a launcher (resumed at step 2, 2 processes): its first record carries its membership,
    read from the run's records -- restart 1, the step restored, the 2 steps the first start had recorded past
    it; which rank was lost no one told it (``None``). Rank 1 then never comes to the save of step 4: rank 0
    names it after watchdog_seconds, before anything of step 4 is written (no step 4, no orbax temporary)."""
    experiment, workdir = job
    first = [r["membership"] for r in metrics.read_metrics(workdir) if "membership" in r]
    assert first == [{"restart": 0, "processes": 2, "mesh": {"data": 4}, "grad_accum_steps": 1, "restored_step": 0,
                      "lost": [], "steps_recomputed": 0}]
    rank0, rank1 = _finish(_slurm_style(str(experiment), workdir, "--config.num_steps=6",
                                        "--config.emulate_cpu_devices=2", f"--config.watchdog_seconds={BOUND}",
                                        "--config.checkpoint.resume_step=2", extra_env={"ASLEEP": "save"}),
                           timeout=240)
    assert rank0[0] == WATCHDOG_EXIT, rank0[1]
    assert f"rank 1 did not reach the save of checkpoint step 4 within {BOUND} s" in rank0[1], rank0[1]
    assert rank1[0] != 0 and rank1[2] < 200, rank1
    starts = [r["membership"] for r in metrics.read_metrics(workdir) if "membership" in r]
    assert starts[1:] == [{"restart": 1, "processes": 2, "mesh": {"data": 4}, "grad_accum_steps": 1,
                           "restored_step": 2, "lost": None, "steps_recomputed": 2}], starts
    assert sorted(n for n in os.listdir(workdir / "checkpoints") if not n.startswith(".")) == ["2", "superseded"]


def test_a_rank_that_never_arrives_at_an_evaluation_is_named_and_a_config_that_differs_is_refused(tmp_path):
    """A fresh start (the step watchdog is paused during evaluations, whose first compile may outlast it): rank 1
    sleeps before the final evaluation, and rank 0 names it after watchdog_seconds instead of waiting in the
    evaluation's first collective for ever (with the arrival removed, rank 0 hangs until killed). Then a start
    whose rank 1 was given another learning rate is refused at once, by both ranks, before anything is written:
    the config check exchanges digests with a deadline, not through a collective."""
    experiment = tmp_path / "asleep.py"
    experiment.write_text(_ASLEEP)
    rank0, rank1 = _finish(_slurm_style(str(experiment), tmp_path / "run", "--config.num_steps=2",
                                        "--config.emulate_cpu_devices=2", f"--config.watchdog_seconds={BOUND}",
                                        extra_env={"ASLEEP": "evaluation"}), timeout=240)
    assert rank0[0] == WATCHDOG_EXIT, rank0[1]
    assert f"rank 1 did not reach the evaluation after step 2 within {BOUND} s" in rank0[1], rank0[1]
    assert rank1[0] != 0 and rank1[2] < 200, rank1
    ended = _finish(_slurm_style(str(experiment), tmp_path / "other", "--config.num_steps=2",
                                 "--config.emulate_cpu_devices=2", f"--config.watchdog_seconds={BOUND}",
                                 extra_env={"DIFFER": "1"}), timeout=240)
    for code, err, _ in ended:
        assert code == 2 and "the config of rank(s) 1 differs from rank 0's" in err, (code, err[-2000:])
    assert not (tmp_path / "other" / "checkpoints").exists()


def test_a_rank_stuck_inside_an_evaluation_is_caught_by_the_watchdog(tmp_path):
    """Past its first batch (the one that may compile) an evaluation is watched as steps are: rank 1 stops after
    the final evaluation's second batch of six, rank 0 waits in the third's collective, and the step watchdogs
    end the job within watchdog_seconds (paused for the whole evaluation, as before, both waited for ever). Which
    process goes first is a race (each watchdog counts from its own last batch); the other then loses the
    coordinator and aborts, so one watchdog's report is asserted, and both ends."""
    experiment = tmp_path / "asleep.py"
    experiment.write_text(_ASLEEP)
    ended = _finish(_slurm_style(str(experiment), tmp_path / "run", "--config.num_steps=2",
                                 "--config.emulate_cpu_devices=2", f"--config.watchdog_seconds={BOUND}",
                                 "--config.eval_batch_size=64", extra_env={"ASLEEP": "inside"}), timeout=240)
    assert any(code == WATCHDOG_EXIT and f"made no progress for {BOUND} s after step 2" in err
               for code, err, _ in ended), [(code, err[-2000:]) for code, err, _ in ended]
    assert all(code != 0 and seconds < 200 for code, _, seconds in ended), ended
