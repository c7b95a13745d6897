"""dtx.run.watchdog: a process stuck between steps exits with EXIT_CODE naming its step and rank; one still
compiling (no step yet) or making progress is left alone. Each case runs in a child process (the watchdog ends
its process with os._exit)."""
import os
import subprocess
import sys
import time

from dtx.run.watchdog import EXIT_CODE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The module by its path: the child skips importing JAX through dtx/__init__.py (seconds on a busy machine).
_LOAD = """
import importlib.util
spec = importlib.util.spec_from_file_location("watchdog", "dtx/run/watchdog.py")
watchdog_lib = importlib.util.module_from_spec(spec)
spec.loader.exec_module(watchdog_lib)
StepWatchdog = watchdog_lib.StepWatchdog
"""


_STUCK = _LOAD + """
import time
with StepWatchdog(0.5, rank=3) as watchdog:
    watchdog.tick(41)
    time.sleep(30)  # a step that never finishes
"""


def test_watchdog_aborts_a_stuck_process_naming_step_and_rank():
    start = time.time()
    run = subprocess.run([sys.executable, "-c", _STUCK], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert run.returncode == EXIT_CODE == 86 and time.time() - start < 20
    assert "rank 3" in run.stderr and "step 41" in run.stderr



_ALIVE = _LOAD + """
import time
with StepWatchdog(1.0, rank=0) as watchdog:
    time.sleep(1.5)  # compiling: not armed before the first tick
    for step in range(5):  # steps of 0.1 s, each well inside the timeout
        watchdog.tick(step)
        time.sleep(0.1)
print("done")
"""


def test_watchdog_waits_for_the_first_step_and_spares_a_live_process():
    run = subprocess.run([sys.executable, "-c", _ALIVE], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "done", run.stderr


_PAUSED = _LOAD + """
import time
with StepWatchdog(0.5, rank=0) as watchdog:
    watchdog.tick(7)
    with watchdog.paused():  # an evaluation longer than the timeout is not a hang
        time.sleep(1.5)
    watchdog.tick(8)
    time.sleep(0.2)  # the clock started again when the pause ended
print("done")
with StepWatchdog(0.5, rank=2) as watchdog:
    watchdog.tick(9)
    with watchdog.paused():
        pass
    time.sleep(30)  # stuck after the pause: watched again
"""


def test_watchdog_spares_a_paused_evaluation_and_watches_again_after_it():
    run = subprocess.run([sys.executable, "-c", _PAUSED], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert run.stdout.strip() == "done", run.stderr
    assert run.returncode == EXIT_CODE and "rank 2" in run.stderr and "step 9" in run.stderr


def test_a_paused_watchdog_renews_the_progress_mark_the_launcher_bounds():
    """While paused (an evaluation, the last save) the rank is alive though it completes no step: its watchdog
    thread renews the progress mark each ~timeout/4, so dtx launch's stall bound (no mark for watchdog_seconds
    + 20 s) spares it; a SIGSTOPped rank stops renewing it (tests/test_launch.py)."""
    from dtx.run.watchdog import StepWatchdog

    class Marks:
        def __init__(self):
            self.seen = []

        def mark(self, phase, step=0):
            self.seen.append((phase, step, time.monotonic()))

    marks = Marks()
    with StepWatchdog(0.4, rank=0, progress=marks) as watchdog:
        watchdog.tick(5)
        paused_at = time.monotonic()
        with watchdog.paused():
            time.sleep(0.8)
    renewed = [m for m in marks.seen if m[2] > paused_at]
    assert renewed and all(m[:2] == ("training", 5) for m in renewed), marks.seen
