"""``dtx launch``: several local processes forming one JAX job (multi-controller, ``jax.distributed``).

    dtx launch --processes 2 --devices-per-process 4 EXPERIMENT.py [--workdir DIR] [--config.KEY=VALUE ...]

Each process runs ``dtx train`` with the same arguments; they meet at a
coordinator on 127.0.0.1 and their CPU collectives go over gloo — the same code
path as a multi-host cluster, on one machine. Output of process ``i`` goes to
``WORKDIR/logs/process_<i>.log``. If one process fails, the others are stopped
and the launcher exits non-zero naming the first failed rank — or, when a rank
stopped responding and a healthy peer aborted on noticing it, the stuck rank: a
process stopped by a signal, one JAX's coordination service reports as sending no
heartbeats, or (after a step watchdog abort) the rank whose progress stopped first,
read from the per-rank progress files (:mod:`dtx.run.progress`) in the logs folder.
It also prints the last step every rank completed. SIGTERM is forwarded to
every process (each then saves at the same step and exits 0). The processes also
die with the launcher: on Linux the kernel kills them when it dies, even by
SIGKILL, so none trains on as an orphan (the run resumes from its last checkpoint).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from dtx import _sigterm
from dtx import mesh as mesh_lib
from dtx.run import lock as lock_lib
from dtx.run import progress as progress_lib
from dtx.run.watchdog import EXIT_CODE as WATCHDOG_EXIT
from dtx.run.lock import WorkdirInUse, WorkdirLock

GRACE_SECONDS = 10  # after a failure, how long the survivors get before being killed


def launch_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dtx launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, required=True, help="number of local processes")
    parser.add_argument("--devices-per-process", type=int, default=1, help="emulated CPU devices in each")
    parser.add_argument("experiment")
    parser.add_argument("--workdir", help="shared workdir (default runs/<experiment>-<time>)")
    args, rest = parser.parse_known_args(argv)
    if args.processes < 1 or args.devices_per_process < 1:
        parser.error("--processes and --devices-per-process must be >= 1")
    unknown = [a for a in rest if not a.startswith("--config.")]
    if unknown:
        parser.error(f"unrecognised arguments: {' '.join(unknown)} (config overrides are --config.KEY=VALUE)")
    workdir = args.workdir or os.path.join(
        "runs", f"{os.path.splitext(os.path.basename(args.experiment))[0]}-{time.strftime('%Y%m%d-%H%M%S')}")
    # One run per workdir: the launcher holds the lock for its ranks (dtx.run.lock), refusing at once.
    try:
        lock = WorkdirLock(workdir).acquire()
    except WorkdirInUse as e:
        print(f"dtx launch: error: {e}", file=sys.stderr)
        return 2
    logs = os.path.join(workdir, "logs")
    os.makedirs(logs, exist_ok=True)
    for rank in range(args.processes):  # a previous launch's progress would pass for this one's
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(logs, f"progress_{rank}.json"))
    port = free_port()
    command = [sys.executable, "-m", "dtx.tools.cli", "train", args.experiment, "--workdir", workdir, *rest,
               f"--config.emulate_cpu_devices={args.devices_per_process}"]
    processes, terminated = [], []

    def forward(signum, _frame):
        terminated.append(signum)
        for process, _ in processes:
            if process.poll() is None:
                process.send_signal(signum)

    # Before any rank starts: a SIGTERM from now on (or noted while dtx imported: dtx._sigterm) reaches every rank.
    previous = signal.signal(signal.SIGTERM, forward)
    if _sigterm.take():
        terminated.append(signal.SIGTERM)
    starting = []
    try:
        for rank in range(args.processes if not terminated else 0):
            env = {**os.environ, mesh_lib.ENV_COORDINATOR: f"127.0.0.1:{port}", lock_lib.ENV_HELD: lock.token(),
                   mesh_lib.ENV_NUM_PROCESSES: str(args.processes), mesh_lib.ENV_PROCESS_ID: str(rank),
                   progress_lib.ENV_DIR: logs}
            log = open(os.path.join(logs, f"process_{rank}.log"), "w")
            starting.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                              preexec_fn=_die_with(os.getpid())), log))
        processes.extend(starting)
        if terminated:  # before every rank had started: none has got past its imports, none has run a step
            for process, _ in starting:
                process.kill()
                process.wait()
            print("dtx launch: preempted before the processes started; run the same command to start", flush=True)
            return 0
        print(f"launched {args.processes} processes x {args.devices_per_process} devices; logs in {logs}",
              flush=True)
        return _supervise(processes, logs)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for process, log in starting:
            if process.poll() is None:
                process.kill()
            log.close()
        lock.release()
        _sigterm.settle()  # the job has ended: a SIGTERM while Python shuts down has nothing to stop


# JAX's coordination service, in the log of the process that noticed, e.g. "The following tasks are
# unhealthy (stopped sending heartbeats): /job:jax_worker/replica:0/task:1" (the form varies by release).
_UNHEALTHY = re.compile(r"unhealthy[^\n]*?heartbeat[^\n]*(?:\n[^\n]*){0,4}", re.I)
_TASK = re.compile(r"task[:_ ](\d+)|:\s*(\d+(?:\s*,\s*\d+)*)\s*$", re.M)


def stuck_ranks(logs: str, processes: int, detector: int) -> list[int]:
    """Ranks a peer's log names as having stopped sending heartbeats (never the detector itself)."""
    try:
        with open(os.path.join(logs, f"process_{detector}.log"), errors="replace") as f:
            text = f.read()
    except OSError:
        return []
    ranks = set()
    for block in _UNHEALTHY.findall(text):
        for task, listed in _TASK.findall(block):
            for value in ([task] if task else re.split(r"\s*,\s*", listed)):
                if value.isdigit() and int(value) < processes and int(value) != detector:
                    ranks.add(int(value))
    return sorted(ranks)


def _die_with(launcher_pid: int):
    """A ``preexec_fn`` for the workers: the kernel kills them when the launcher dies (Linux
    ``PR_SET_PDEATHSIG``), so a killed launcher leaves no orphans; elsewhere a no-op. SIGKILL, not
    SIGTERM: without checkpoints a multi-process worker's SIGTERM only marks a preemption point
    nobody saves at, and the worker would train on."""

    def set_parent_death_signal() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # not Linux: the launcher's own cleanup still applies
            return
        if os.getppid() != launcher_pid:  # the launcher died before the signal was armed
            os._exit(1)

    return set_parent_death_signal


def _supervise(processes, logs: str) -> int:
    # One waiter thread per process stamps each exit as it happens: when one rank dies its
    # peers abort moments later, and the first *in time* is the one to report.
    exits: list[tuple[float, int, int]] = []
    lock = threading.Lock()

    def wait(rank: int, process: subprocess.Popen) -> None:
        code = process.wait()
        with lock:
            exits.append((time.monotonic(), rank, code))

    waiters = [threading.Thread(target=wait, args=(rank, p), daemon=True) for rank, (p, _) in enumerate(processes)]
    for waiter in waiters:
        waiter.start()
    spawned_at = time.time()
    first_failure, deadline, stopped = None, None, []
    while any(waiter.is_alive() for waiter in waiters):
        with lock:
            failures = sorted(e for e in exits if e[2] != 0)
        if failures and first_failure is None:
            _, rank, code = failures[0]
            first_failure, deadline = (rank, code), time.monotonic() + GRACE_SECONDS
            # Before anything is signalled: a process stopped by a signal (SIGSTOP) is the stuck one.
            stopped = [r for r, (p, _) in enumerate(processes) if _stopped(p.pid)]
            print(f"dtx launch: process {rank} failed (exit code {code}); stopping the others. "
                  f"See {os.path.join(logs, f'process_{rank}.log')}", file=sys.stderr, flush=True)
            for process, _ in processes:
                if process.poll() is None:
                    process.terminate()
        if deadline is not None and time.monotonic() > deadline:
            for process, _ in processes:
                if process.poll() is None:
                    process.kill()
        time.sleep(0.05)
    failures = sorted(e for e in exits if e[2] != 0)  # all may have exited between two looks
    if failures and first_failure is None:
        first_failure = failures[0][1:]
    summary = ", ".join(f"rank {rank}: {code}" for _, rank, code in sorted(exits))
    print(f"dtx launch: exit codes in order of exit: {summary}", file=sys.stderr)
    if first_failure is not None:
        rank, code = first_failure
        records = {r: progress_lib.read(logs, r, spawned_at) for r in range(len(processes))}
        stuck, why = _stuck(logs, rank, code, stopped, records)
        if stuck and stuck != [rank]:
            print(f"dtx launch: failed; rank {', '.join(map(str, stuck))} is stuck ({why}); "
                  f"rank {rank} noticed and aborted (exit code {code}). See "
                  f"{os.path.join(logs, f'process_{stuck[0]}.log')}", file=sys.stderr)
        else:
            print(f"dtx launch: failed; first failed rank: {rank} (exit code {code})", file=sys.stderr)
        print("dtx launch: last completed step: " + ", ".join(
            f"rank {r}: {progress_lib.describe(records[r])}" for r in sorted(records)), file=sys.stderr)
        return 1
    with open(os.path.join(logs, "process_0.log")) as f:
        print("\n".join(f.read().strip().splitlines()[-2:]))  # rank 0's summary line
    return 0


def _stuck(logs: str, failed: int, code: int, stopped: list[int], records: dict) -> tuple[list[int], str]:
    """The ranks to blame for a failure first seen at rank ``failed``, and why."""
    if stopped:
        return stopped, "its process was stopped by a signal, e.g. SIGSTOP"
    heartbeats = stuck_ranks(logs, len(records), failed)
    if heartbeats:
        return heartbeats, "stopped sending heartbeats"
    if code == WATCHDOG_EXIT:  # a step watchdog fired: the rank that got least far held the others up
        return progress_lib.behind(records)[:1], "stopped making progress first"
    return [failed], "failed first"


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (Linux /proc; elsewhere never)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1] in ("T", "t")
    except (OSError, IndexError):
        return False


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
