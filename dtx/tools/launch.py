"""``dtx launch``: several local processes forming one JAX job (multi-controller, ``jax.distributed``).

    dtx launch --processes 2 --devices-per-process 4 EXPERIMENT.py [--workdir DIR] [--config.KEY=VALUE ...]
    dtx launch --processes 4 --devices-per-process 2 --elastic 2 --max-restarts 3 EXPERIMENT.py [...]

Each process runs ``dtx train`` with the same arguments; they meet at a
coordinator on 127.0.0.1 and their CPU collectives go over gloo — the same code
path as a multi-host cluster, on one machine. Output of process ``i`` goes to
``WORKDIR/logs/process_<i>.log``. If one process fails, the others are stopped
and the launcher exits non-zero naming the first failed rank — or, when a rank
stopped responding and a healthy peer aborted on noticing it, the stuck rank: a
process stopped by a signal, one JAX's coordination service reports as sending no
heartbeats, or (after a step watchdog abort) the rank whose progress stopped first,
read from the per-rank progress files (:mod:`dtx.run.progress`) in the logs folder.
It also prints the last step every rank completed. The launcher bounds its own wait
too: a rank whose progress file has not moved for ``watchdog_seconds`` + 20 s while
training (``startup_seconds`` + ``watchdog_seconds`` + 20 s while starting) stops the
job and is named, so a job whose every rank is hung (all SIGSTOPped, say) still ends.
SIGTERM is forwarded to every process (each then saves at the same step and exits 0).
The processes also die with the launcher: on Linux the kernel kills them when it dies,
even by SIGKILL, so none trains on as an orphan (the run resumes from its last checkpoint).

``--elastic MIN`` (:mod:`dtx.run.elastic`): when a process is lost (killed by a signal,
stopped, stuck, or preempted on its own), the launcher stops the job and starts it again
on the processes it still has, at least MIN, restoring the newest checkpoint that
verifies; ``grad_accum_steps`` grows so the global batch, the schedule and the data
order stay the same. At most ``--max-restarts`` times. A lost process's slot stays
empty; SIGUSR1 to the launcher says a replacement is ready: the job saves, stops and
starts again with one more process (up to ``--processes``). A process exiting with an
error of its own (a config error, divergence) is not lost: the job ends.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import NamedTuple

from dtx import _sigterm
from dtx import mesh as mesh_lib
from dtx.run import elastic as elastic_lib
from dtx.run import lock as lock_lib
from dtx.run import progress as progress_lib
from dtx.run.watchdog import EXIT_CODE as WATCHDOG_EXIT
from dtx.run.lock import WorkdirInUse, WorkdirLock

GRACE_SECONDS = 10  # after a failure, how long the survivors get before being killed
STALL_MARGIN = 20  # the launcher's stall bound: a rank's own bound (progress.stall_bound) plus this


def launch_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dtx launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, required=True, help="number of local processes")
    parser.add_argument("--devices-per-process", type=int, default=1, help="emulated CPU devices in each")
    parser.add_argument("--elastic", type=int, default=0, metavar="MIN",
                        help="restart on the surviving processes (at least MIN) when one is lost")
    parser.add_argument("--max-restarts", type=int, default=3, help="with --elastic: restarts allowed (default 3)")
    parser.add_argument("experiment")
    parser.add_argument("--workdir", help="shared workdir (default runs/<experiment>-<time>)")
    args, rest = parser.parse_known_args(argv)
    if args.processes < 1 or args.devices_per_process < 1:
        parser.error("--processes and --devices-per-process must be >= 1")
    if args.elastic and not 1 <= args.elastic <= args.processes or args.elastic < 0:
        parser.error(f"--elastic {args.elastic}: the fewest processes to go on with, from 1 to --processes "
                     f"{args.processes} (0: no restarts)")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts {args.max_restarts} must be >= 0")
    unknown = [a for a in rest if not a.startswith("--config.")]
    if unknown:
        parser.error(f"unrecognised arguments: {' '.join(unknown)} (config overrides are --config.KEY=VALUE)")
    elastic = None
    if args.elastic:
        try:
            elastic = elastic_lib.settings(args.experiment, rest, args.processes, args.devices_per_process,
                                            args.elastic)
        except ValueError as e:  # ConfigError, ElasticError: said before any process starts
            print(f"dtx launch: error: {e}", file=sys.stderr)
            return 2
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
    _clear_progress(logs, args.processes)  # a previous launch's progress would pass for this one's
    command = [sys.executable, "-m", "dtx.tools.cli", "train", args.experiment, "--workdir", workdir, *rest,
               f"--config.emulate_cpu_devices={args.devices_per_process}"]
    job = _Job(lock.token(), logs)

    # Before any rank starts: a SIGTERM from now on (or noted while dtx imported: dtx._sigterm) reaches every rank.
    previous = signal.signal(signal.SIGTERM, job.forward)
    previous_usr1 = signal.signal(signal.SIGUSR1, job.replacement) if elastic else None
    if _sigterm.take():
        job.terminated.append(signal.SIGTERM)
    try:
        # slots: the processes the job has, running or set aside because the mesh could not use them
        processes, slots, restart, lost, last_step = args.processes, args.processes, 0, [], None
        plan = elastic.start if elastic else None
        while True:
            env = elastic_lib.environment(restart, plan.processes, lost, last_step) if elastic else {}
            extra = [f"--config.grad_accum_steps={plan.grad_accum_steps}"] if elastic else []
            ended = job.run(command + extra, plan.processes if elastic else processes, env,
                            args.devices_per_process)
            if not elastic or job.terminated or ended.code == 0 and not job.preempted_itself(workdir):
                return ended.code
            if ended.code != 0 and not ended.lost:
                print("dtx launch: not restarting: the failure is the program's own, not a lost process",
                      file=sys.stderr)
                return ended.code
            available = elastic_lib.available(slots, len(ended.lost), job.take_replacements(), args.processes)
            why = (f"--max-restarts {args.max_restarts} reached" if restart >= args.max_restarts else
                   f"{available} processes left, fewer than --elastic {args.elastic}" if available < args.elastic
                   else None)
            if why:  # a job that stopped preempted saved first: run the same command to resume
                print(f"dtx launch: not restarting: {why}", file=sys.stderr)
                return ended.code
            slots, plan = available, elastic.plan(available)
            restart, lost, last_step = restart + 1, ended.lost, ended.last_step
            print(f"dtx launch: restart {restart} on {plan.processes} processes x {args.devices_per_process} "
                  f"devices, grad_accum_steps={plan.grad_accum_steps}"
                  + (f" (lost rank {', '.join(map(str, lost))})" if lost else ""), file=sys.stderr, flush=True)
            _set_aside_logs(logs, restart)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if previous_usr1 is not None:
            signal.signal(signal.SIGUSR1, previous_usr1)
        job.kill()
        lock.release()
        _sigterm.settle()  # the job has ended: a SIGTERM while Python shuts down has nothing to stop


class _Ended(NamedTuple):
    code: int
    lost: list[int]  # ranks lost (killed by a signal, stopped, stuck): a restart goes on without them
    last_step: int | None  # the most steps any rank completed


class _Job:
    """The processes of one start at a time, and the signals the launcher got."""

    def __init__(self, token: str, logs: str):
        self.token, self.logs = token, logs
        self.processes: list[tuple[subprocess.Popen, object]] = []
        self.terminated: list[int] = []  # SIGTERM to the launcher: the job stops, no restart
        self._replacements = 0

    def forward(self, signum, _frame) -> None:
        self.terminated.append(signum)
        self._signal_all(signum)

    def replacement(self, _signum, _frame) -> None:
        """SIGUSR1: a replacement process is ready; the job saves and stops (the SIGTERM path) to start again."""
        self._replacements += 1
        self._signal_all(signal.SIGTERM)

    def take_replacements(self) -> int:
        taken, self._replacements = self._replacements, 0
        return taken

    @staticmethod
    def preempted_itself(workdir: str) -> bool:
        """Whether the job just ended preempted (its last record) though the launcher was not told to stop: a
        process was preempted on its own, or a replacement asked for a restart."""
        return _last_record(workdir).get("preempted") == 1

    def _signal_all(self, signum) -> None:
        for process, _ in self.processes:
            if process.poll() is None:
                process.send_signal(signum)

    def run(self, command: list[str], count: int, env: dict, devices_per_process: int) -> _Ended:
        port = free_port()
        self.kill()
        for rank in range(count if not self.terminated else 0):
            rank_env = {**os.environ, mesh_lib.ENV_COORDINATOR: f"127.0.0.1:{port}", lock_lib.ENV_HELD: self.token,
                        mesh_lib.ENV_NUM_PROCESSES: str(count), mesh_lib.ENV_PROCESS_ID: str(rank),
                        progress_lib.ENV_DIR: self.logs, **env}
            log = open(os.path.join(self.logs, f"process_{rank}.log"), "w")
            self.processes.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=rank_env,
                                                    preexec_fn=_die_with(os.getpid())), log))
        if self.terminated:  # before every rank had started: none has got past its imports, none has run a step
            self.kill()
            print("dtx launch: preempted before the processes started; run the same command to start", flush=True)
            return _Ended(0, [], None)
        print(f"launched {count} processes x {devices_per_process} devices; logs in {self.logs}", flush=True)
        return _supervise(self.processes, self.logs)

    def kill(self) -> None:
        for process, log in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()
            log.close()
        self.processes = []


def _last_record(workdir: str) -> dict:
    try:
        with open(os.path.join(workdir, "metrics.jsonl"), "rb") as f:
            f.seek(max(0, os.path.getsize(f.name) - 4096))
            lines = [line for line in f.read().splitlines() if line.strip()]
        return json.loads(lines[-1]) if lines else {}
    except (OSError, ValueError):
        return {}


def _clear_progress(logs: str, processes: int) -> None:
    for rank in range(processes):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(logs, f"progress_{rank}.json"))


def _set_aside_logs(logs: str, restart: int) -> None:
    """The stopped start's logs and progress go to ``logs/start_<restart-1>/``; the next start writes afresh."""
    aside = os.path.join(logs, f"start_{restart - 1}")
    os.makedirs(aside, exist_ok=True)
    for name in os.listdir(logs):
        if re.fullmatch(r"(process_\d+\.log|progress_\d+\.json)", name):
            shutil.move(os.path.join(logs, name), os.path.join(aside, name))


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


def _supervise(processes, logs: str) -> _Ended:
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
    first_failure, deadline, stopped, stalled, looked = None, None, [], None, 0.0
    while any(waiter.is_alive() for waiter in waiters):
        with lock:
            failures = sorted(e for e in exits if e[2] != 0)
        if first_failure is None and time.monotonic() - looked > 1.0:
            looked = time.monotonic()
            stalled = _stalled(processes, logs, spawned_at)
            if stalled:  # no rank failed, but one stopped marking progress past its bound: end the job
                rank, waited = stalled
                first_failure, deadline = (rank, None), time.monotonic()
                stopped = [r for r, (p, _) in enumerate(processes) if _stopped(p.pid)]
                print(f"dtx launch: rank {rank} made no progress for {waited:.0f} s (the launcher's bound: the run's "
                      f"watchdog_seconds, startup_seconds while starting, + {STALL_MARGIN} s); stopping the job",
                      file=sys.stderr, flush=True)
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
    records = {r: progress_lib.read(logs, r, spawned_at) for r in range(len(processes))}
    steps = [rec["step"] for rec in records.values() if rec["phase"] == "training"]
    last_step = max(steps) if steps else None
    if first_failure is None:
        with open(os.path.join(logs, "process_0.log")) as f:
            print("\n".join(f.read().strip().splitlines()[-2:]))  # rank 0's summary line
        return _Ended(0, [], last_step)
    rank, code = first_failure
    if stalled:
        stuck, why = stopped or [rank], ("its process was stopped by a signal, e.g. SIGSTOP" if stopped
                                         else "its progress stopped past the launcher's bound")
        print(f"dtx launch: failed; {_ranks(stuck)} stuck ({why}). See "
              f"{os.path.join(logs, f'process_{stuck[0]}.log')}", file=sys.stderr)
        lost = stuck
    else:
        stuck, why = _stuck(logs, rank, code, stopped, records)
        if stuck and stuck != [rank]:
            print(f"dtx launch: failed; {_ranks(stuck)} stuck ({why}); "
                  f"rank {rank} noticed and aborted (exit code {code}). See "
                  f"{os.path.join(logs, f'process_{stuck[0]}.log')}", file=sys.stderr)
        else:
            print(f"dtx launch: failed; first failed rank: {rank} (exit code {code})", file=sys.stderr)
        # Lost: a rank killed by a signal, stopped or stuck; an error exit of its own is the program's.
        lost = stuck if (stuck != [rank] or code < 0 or code == WATCHDOG_EXIT) else []
    print("dtx launch: last completed step: " + ", ".join(
        f"rank {r}: {progress_lib.describe(records[r])}" for r in sorted(records)), file=sys.stderr)
    return _Ended(1, lost, last_step)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]} is" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} are"


def _stalled(processes, logs: str, spawned_at: float) -> tuple[int, float] | None:
    """The running rank longest past its stall bound (:func:`dtx.run.progress.stall_bound`), with the seconds
    since its last mark; ``None`` while every running rank is within its bound."""
    now, worst = time.time(), None
    for rank, (process, _) in enumerate(processes):
        if process.poll() is not None:
            continue
        record = progress_lib.read(logs, rank, spawned_at)
        bound = progress_lib.stall_bound(record, STALL_MARGIN)
        waited = now - record["time"]
        if bound is not None and waited > bound and (worst is None or waited > worst[1]):
            worst = (rank, waited)
    return worst


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
