"""Multi-process jobs (`dtx launch`, jax.distributed over 127.0.0.1 with gloo): same result as one
process, and a dead rank never hangs the job. Kept few and serial: each costs two JAX processes."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from dtx.run import metrics
from dtx.ckpt.checkpoint import Checkpointer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(REPO, "experiments", "digits_mlp.py")
TINY = ["--config.model.features=(32,)", "--config.log_every=1", "--config.progress=False"]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def _dtx(*args):
    return [sys.executable, "-m", "dtx.tools.cli", *args]


def _losses(workdir):
    by_step = {r["step"]: r["loss"] for r in metrics.read_metrics(workdir) if "loss" in r}
    return np.array([by_step[s] for s in sorted(by_step)])


LAUNCH = ["launch", "--processes", "2", "--devices-per-process", "4"]
# 100 steps: the preempted run stops ~11 steps (3.5 s) after its SIGTERM at step 11 (measured), and the elastic
# run's faults come at steps 8 and 20; each further step costs both processes a cross-process all-reduce.
STEPS = 100
REFERENCE_STEPS = [f"--config.num_steps={STEPS}", "--config.checkpoint.every_steps=1000"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted 2-process x 4-device run (STEPS steps, one checkpoint at the end): what the 1-process,
    the preempted and the elastic runs are compared with."""
    workdir = tmp_path_factory.mktemp("reference")
    done = subprocess.run(_dtx(*LAUNCH, DEFAULT, "--workdir", str(workdir), *TINY, *REFERENCE_STEPS),
                          capture_output=True, text=True, env=ENV, timeout=400)
    assert done.returncode == 0, done.stderr
    return workdir


def test_two_processes_equal_one_process(tmp_path, reference):
    """2 processes x 4 devices == 1 process x 8 devices: the same global batches, the same mean
    gradient; only the all-reduce's summation order differs (gloo across processes), so per-step
    losses agree to rtol 1e-5 (measured: 2.2e-7 over 100 steps) and the final test accuracy exactly."""
    one = subprocess.run(_dtx("train", DEFAULT, "--workdir", str(tmp_path / "one"), *TINY, *REFERENCE_STEPS),
                         capture_output=True, text=True, env=ENV, timeout=300)
    assert one.returncode == 0, one.stderr
    records = metrics.read_metrics(reference)
    assert records[0]["num_devices"] == 8
    np.testing.assert_allclose(_losses(reference), _losses(tmp_path / "one"), rtol=1e-5)
    final_one = metrics.read_metrics(tmp_path / "one")[-1]
    assert records[-1]["test_accuracy"] == final_one["test_accuracy"]
    assert (reference / "logs" / "process_1.log").exists()


def test_dead_process_fails_the_job_fast_naming_the_rank(tmp_path):
    """SIGKILL one rank mid-run: the launcher stops the other and exits non-zero within 60 s."""
    command = _dtx("launch", "--processes", "2", "--devices-per-process", "4", DEFAULT, "--workdir",
                   str(tmp_path), *TINY, "--config.num_steps=100000", "--config.checkpoint.every_steps=0")
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.time() + 180
    while time.time() < deadline and not ((tmp_path / "metrics.jsonl").exists() and len(_losses(tmp_path)) > 5):
        time.sleep(0.1)
    assert len(_losses(tmp_path)) > 5, "the job must be training before the fault"
    victim = subprocess.run(["pgrep", "-f", f"DTX_PROCESS_ID=1|workdir {tmp_path}"], capture_output=True, text=True)
    pids = [int(p) for p in victim.stdout.split() if int(p) != launcher.pid]
    rank1 = [p for p in pids if "DTX_PROCESS_ID=1" in open(f"/proc/{p}/environ", "rb").read().decode(errors="ignore")
             .replace("\0", " ")]
    assert rank1, "rank 1's process must exist"
    killed_at = time.time()
    os.kill(rank1[0], signal.SIGKILL)
    stdout, stderr = launcher.communicate(timeout=90)
    assert launcher.returncode != 0, (rank1, pids, stderr)
    assert time.time() - killed_at < 60
    assert "first failed rank: 1" in stderr


def test_sigterm_two_processes_save_at_the_same_step_and_resume_bitwise(tmp_path, reference):
    """SIGTERM to the launcher: both ranks stop at the same step (JAX's preemption sync point),
    save, exit 0; relaunching resumes and matches an uninterrupted 2-process run bit for bit."""
    workdir = tmp_path / "preempted"
    command = _dtx(*LAUNCH, DEFAULT, "--workdir", str(workdir), *TINY, *REFERENCE_STEPS)
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.time() + 180
    while time.time() < deadline and not ((workdir / "metrics.jsonl").exists() and len(_losses(workdir)) > 10):
        time.sleep(0.05)
    launcher.send_signal(signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, stderr
    stopped = Checkpointer(workdir / "checkpoints").latest_step()
    assert 10 < stopped < STEPS
    _restore_in_one_process_on_one_device(workdir / "checkpoints", stopped)
    resumed = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert _losses(workdir).tobytes() == _losses(reference).tobytes()
    assert _data_digest(workdir) == _data_digest(reference)  # no batch repeated or skipped across the restart
    assert json.dumps(metrics.read_metrics(workdir)[-1]) == json.dumps(metrics.read_metrics(reference)[-1])


def _data_digest(workdir):
    return [r["data_digest"] for r in metrics.read_metrics(workdir) if "data_digest" in r][-1]


def _restore_in_one_process_on_one_device(directory, step):
    """2 processes -> 1: the two-process checkpoint restores here, exactly (digests verified); returns the state."""
    import jax

    from dtx import models
    from dtx import mesh as mesh_lib
    from dtx import optim
    from dtx.ckpt.checkpoint import abstract_target
    from dtx.step.state import abstract_train_state, replicated_shardings

    mesh = mesh_lib.make_mesh([("data", 1)], devices=jax.devices()[:1])
    tx = optim.make_optimizer("adam", optim.make_schedule("constant", 2e-3, STEPS))  # as the trainer builds it
    abstract = abstract_train_state(models.build_model("mlp", features=(32,)), tx,
                                    jax.ShapeDtypeStruct((1, 8, 8, 1), np.float32))
    state, _ = Checkpointer(directory).restore(step, abstract_target(abstract, replicated_shardings(abstract, mesh)))
    assert int(state.step) == step
    return state


def _rank_pids(tmp_path, launcher_pid):
    """{rank: pid} of the training processes of the launch writing into ``tmp_path``."""
    found = subprocess.run(["pgrep", "-f", f"workdir {tmp_path}"], capture_output=True, text=True)
    ranks = {}
    for pid in (int(p) for p in found.stdout.split()):
        if pid == launcher_pid:
            continue
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().decode(errors="ignore").split("\0")
        except OSError:
            continue
        for entry in environ:
            if entry.startswith("DTX_PROCESS_ID="):
                ranks[int(entry.split("=", 1)[1])] = pid
    return ranks


def _launch(tmp_path, *extra, experiment=DEFAULT):
    command = _dtx("launch", "--processes", "2", "--devices-per-process", "4", experiment, "--workdir",
                   str(tmp_path), *TINY, "--config.num_steps=100000", "--config.checkpoint.every_steps=0", *extra)
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def _start_training_launch(tmp_path, *extra):
    launcher = _launch(tmp_path, *extra)
    deadline = time.time() + 180
    while time.time() < deadline and not ((tmp_path / "metrics.jsonl").exists() and len(_losses(tmp_path)) > 5):
        time.sleep(0.1)
    assert len(_losses(tmp_path)) > 5, "the job must be training before the fault"
    ranks = _rank_pids(tmp_path, launcher.pid)
    assert sorted(ranks) == [0, 1], ranks
    return launcher, ranks


def test_a_stuck_rank_is_named_not_the_rank_that_noticed(tmp_path):
    """SIGSTOP rank 1: rank 0 aborts when rank 1's heartbeats stop. The launcher blames rank 1, the stuck
    one (the probe found it blaming rank 0, the healthy detector). `heartbeat_seconds` bounds the wait: the
    job stops within it (plus start-up of the abort), not after the 30 s default."""
    launcher, ranks = _start_training_launch(tmp_path, "--config.heartbeat_seconds=10")
    stderr, waited = _stop_until_the_job_ends(launcher, ranks[1], timeout=150)
    assert launcher.returncode != 0
    assert "rank 1 is stuck" in stderr, stderr
    assert "first failed rank: 0" not in stderr
    assert "last completed step: rank 0: step " in stderr, stderr  # both ranks were training
    assert waited < 30 + 15, "the job must stop once heartbeat_seconds=10 has passed, not after 30 s"


def _stop_until_the_job_ends(launcher, pid, timeout):
    """SIGSTOP ``pid`` and wait for the launcher to end the job: its stderr, and the seconds it took."""
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.time()
    try:
        _, stderr = launcher.communicate(timeout=timeout)
    finally:
        if os.path.exists(f"/proc/{pid}"):
            os.kill(pid, signal.SIGKILL)
    return stderr, time.time() - stopped_at


def _last_steps(stderr):
    """{rank: last completed step (None: still starting up)} from the launcher's summary line."""
    line = next(line for line in stderr.splitlines() if "last completed step:" in line)
    found = re.findall(r"rank (\d+): (?:step (\d+)|no step)", line)
    return {int(rank): int(step) if step else None for rank, step in found}


def test_rank_0_stopped_before_it_registers_is_named_within_startup_seconds(tmp_path):
    """SIGSTOP rank 0 (the coordinator) as it starts, before it registers: rank 1 gives up joining after
    `startup_seconds` (the probe: ~317 s, past the watchdog, blaming rank 0 only by chance), the launcher
    names rank 0 -- stopped, at start-up -- not rank 1, the one that gave up."""
    launcher = _launch(tmp_path, "--config.startup_seconds=10")
    ranks, deadline = {}, time.time() + 120  # the launcher imports dtx first: slow on a loaded machine
    while 0 not in ranks and time.time() < deadline:
        ranks = _rank_pids(tmp_path, launcher.pid)
    assert 0 in ranks, "rank 0's process must exist"
    stderr, waited = _stop_until_the_job_ends(launcher, ranks[0], timeout=240)
    assert launcher.returncode != 0
    assert "rank 0 is stuck (its process was stopped" in stderr, stderr
    assert "first failed rank" not in stderr
    assert _last_steps(stderr) == {0: None, 1: None}, stderr  # neither reached a step
    assert not (tmp_path / "metrics.jsonl").exists()
    assert waited < 10 + 100, "the job must stop once startup_seconds=10 has passed, not 300 s"


# An experiment whose rank 1 blocks in its input pipeline before step 5: alive and heartbeating, it never
# enters step 5's collective, and rank 0 waits in it.
_BLOCKED_INPUT = """
import os, time
from dtx.data import loader

_batch = loader.TrainLoader.batch


def _blocking_batch(self, step):
    if step == 5 and os.environ.get("DTX_PROCESS_ID") == "1":
        time.sleep(600)
    return _batch(self, step)


loader.TrainLoader.batch = _blocking_batch


def get_config():
    default = {}
    exec(open(%r).read(), default)
    return default["get_config"]()
""" % DEFAULT


def test_a_rank_blocked_in_its_input_pipeline_is_named_by_the_step_watchdog(tmp_path):
    """Rank 1 sleeps in its input pipeline before step 5: the step watchdog (watchdog_seconds=10) aborts
    the job, and the launcher names rank 1 -- which completed fewer steps than rank 0 -- with every
    rank's last completed step."""
    experiment = tmp_path / "blocked_input.py"
    experiment.write_text(_BLOCKED_INPUT)
    launcher = _launch(tmp_path / "run", "--config.watchdog_seconds=10", experiment=str(experiment))
    _, stderr = launcher.communicate(timeout=300)
    assert launcher.returncode != 0
    names_rank_1 = "first failed rank: 1 (exit code 86)" in stderr or "rank 1 is stuck (stopped making" in stderr
    assert names_rank_1, stderr
    assert _last_steps(stderr) == {0: 5, 1: 4}, stderr  # rank 0 ran into step 5's collective; rank 1 never did


def test_after_a_watchdog_abort_the_rank_that_got_least_far_is_named(tmp_path):
    """No processes: from progress files alone, the rank behind (fewer steps; at a tie, the earlier
    mark; a rank with no file is still at spawn) is blamed, not the rank whose watchdog fired first."""
    from dtx.run import progress
    from dtx.tools import launch

    for rank, step in ((0, 7), (1, 6), (2, 7)):
        progress.Progress(str(tmp_path), rank).mark("training", step)
    (tmp_path / "progress_4.json").write_text('{"phase": "trai')  # half a file reads as no progress
    records = {r: progress.read(str(tmp_path), r, spawned_at=0.0) for r in range(5)}
    assert records[3]["phase"] == records[4]["phase"] == "spawned"
    assert progress.behind(records)[:3] == [3, 4, 1]
    del records[3], records[4]
    assert launch._stuck(str(tmp_path), 0, launch.WATCHDOG_EXIT, [], records) == ([1], "stopped making progress first")
    assert launch._stuck(str(tmp_path), 0, 1, [], records)[0] == [0]  # a crash: the crashed rank
    assert launch._stuck(str(tmp_path), 0, launch.WATCHDOG_EXIT, [2], records)[0] == [2]  # a stopped process
    # As many steps done (the chaos benchmark's rank 0, asleep in its input pipeline right after the checkpoint
    # of step 49, and rank 1 in the collective of step 50): the rank that dispatched fewer steps is the one.
    waits, sleeps = progress.Progress(str(tmp_path), 5), progress.Progress(str(tmp_path), 6)
    waits.mark("training", 49)
    waits.mark("training", 49, dispatched=50)
    time.sleep(0.01)
    sleeps.mark("training", 49)  # its last mark the latest: the time alone would blame the waiting rank
    records = {r: progress.read(str(tmp_path), r, spawned_at=0.0) for r in (5, 6)}
    assert progress.behind(records)[0] == 6


def test_workers_die_with_a_killed_launcher(tmp_path):
    """SIGKILL to `dtx launch` (it cannot forward anything): its workers stop too instead of training on
    as orphans (the kernel kills them as their parent dies; the run resumes from its last checkpoint)."""
    launcher, ranks = _start_training_launch(tmp_path)
    launcher.kill()
    launcher.communicate(timeout=30)
    deadline = time.time() + 60
    while time.time() < deadline and any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in ranks.values()):
        time.sleep(0.2)
    survivors = [rank for rank, pid in ranks.items() if os.path.exists(f"/proc/{pid}") and _alive(pid)]
    for rank in survivors:
        os.kill(ranks[rank], signal.SIGKILL)
    assert not survivors, f"ranks {survivors} outlived the launcher"


def _alive(pid):
    try:
        return open(f"/proc/{pid}/stat").read().split(") ", 1)[1][0] != "Z"  # a zombie has exited
    except OSError:
        return False


# An experiment that loses rank 1 (SIGKILL, as a host that vanishes) before step 8 of the first start, and whose
# rank 0 tells the launcher at step 20 of the second start that a replacement is ready (SIGUSR1).
_LOSES_A_RANK = """
import json, os, signal
from dtx.data import loader

_batch = loader.TrainLoader.batch


def _batch_with_faults(self, step):
    start, rank = json.loads(os.environ["DTX_MEMBERSHIP"])["restart"], os.environ["DTX_PROCESS_ID"]
    if start == 0 and rank == "1" and step == 8:
        os.kill(os.getpid(), signal.SIGKILL)
    if start == 1 and rank == "0" and step == 20:
        os.kill(os.getppid(), signal.SIGUSR1)
    return _batch(self, step)


loader.TrainLoader.batch = _batch_with_faults


def get_config():
    default = {}
    exec(open(%r).read(), default)
    return default["get_config"]()
""" % DEFAULT


def test_elastic_goes_on_without_a_lost_rank_and_takes_a_replacement_back(tmp_path, reference):
    """--elastic 1: rank 1 dies at step 8; the job restarts on rank 0 alone (4 devices, grad_accum_steps 2: the
    same 128-example batches in the same 16-example micro-batches) from the newest checkpoint; at step 20 a
    replacement is announced (SIGUSR1) and the job saves, stops and goes on with 2 processes again. The run is
    the uninterrupted 2-process run's: the same batches (data digest), per-step losses and final parameters
    within float reassociation (the mean gradient adds the same terms in another order: rtol 1e-5; measured
    over 100 steps: losses 1.4e-7 relative, parameters 1.5e-7 absolute), and each start is recorded (membership)."""
    experiment = tmp_path / "loses_a_rank.py"
    experiment.write_text(_LOSES_A_RANK)
    workdir = tmp_path / "run"
    done = subprocess.run(_dtx(*LAUNCH, "--elastic", "1", str(experiment), "--workdir", str(workdir), *TINY,
                               f"--config.num_steps={STEPS}", "--config.checkpoint.every_steps=5"),
                          capture_output=True, text=True, env=ENV, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "first failed rank: 1" in done.stderr
    assert "restart 1 on 1 processes x 4 devices, grad_accum_steps=2 (lost rank 1)" in done.stderr, done.stderr
    assert "restart 2 on 2 processes x 4 devices, grad_accum_steps=1" in done.stderr, done.stderr
    starts = [r["membership"] for r in metrics.read_metrics(workdir) if "membership" in r]
    assert [(m["restart"], m["processes"], m["mesh"], m["grad_accum_steps"], m["lost"]) for m in starts] == [
        (0, 2, {"data": 8}, 1, []), (1, 1, {"data": 4}, 2, [1]), (2, 2, {"data": 8}, 1, [])]
    lost, rejoined = starts[1], starts[2]
    assert lost["restored_step"] in (0, 5) and lost["restored_step"] + lost["steps_recomputed"] in (7, 8), lost
    assert rejoined["restored_step"] >= 20 and rejoined["steps_recomputed"] == 0, rejoined  # saved where it stopped
    assert _data_digest(workdir) == _data_digest(reference)
    np.testing.assert_allclose(_losses(workdir), _losses(reference), rtol=1e-5)
    ours = _restore_in_one_process_on_one_device(workdir / "checkpoints", STEPS)
    theirs = _restore_in_one_process_on_one_device(reference / "checkpoints", STEPS)
    for a, b in zip(jax_leaves(ours.params), jax_leaves(theirs.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert (workdir / "logs" / "start_0" / "process_1.log").exists()  # each start's logs kept


def jax_leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_elastic_refuses_what_cannot_restart_before_any_process_starts(tmp_path, capsys):
    from dtx.tools.launch import launch_main

    base = [*LAUNCH, "--elastic", "1", DEFAULT, "--workdir", str(tmp_path)][1:]
    assert launch_main(base + ["--config.checkpoint.every_steps=0"]) == 2
    assert "checkpoint.every_steps=0 saves none" in capsys.readouterr().err
    assert launch_main(base + ["--config.checkpoint.every_steps=5", "--config.mesh=(('data',8),)"]) == 2
    assert "exactly one axis of size -1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launch_main([*LAUNCH, "--elastic", "3", DEFAULT][1:])  # more than --processes
    assert "--elastic 3" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()


def test_every_rank_stopped_still_ends_the_job_naming_them(tmp_path):
    """SIGSTOP every rank (no peer is left to notice, no watchdog thread runs): the launcher's own bound
    (watchdog_seconds + 20 s without a progress mark) ends the job and names both ranks."""
    launcher, ranks = _start_training_launch(tmp_path, "--config.watchdog_seconds=10",
                                             "--config.heartbeat_seconds=600")
    os.kill(ranks[1], signal.SIGSTOP)
    stderr, waited = _stop_until_the_job_ends(launcher, ranks[0], timeout=150)
    assert launcher.returncode != 0
    assert "ranks 0, 1 are stuck (its process was stopped by a signal" in stderr, stderr
    assert "made no progress for" in stderr
    assert waited < 10 + 20 + 25, "the job must stop once watchdog_seconds + 20 s have passed"
