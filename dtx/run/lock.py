"""One run per workdir: an advisory lock (``flock``) on ``WORKDIR/.dtx-lock``, held for the run's life.

Two runs writing one workdir would fail on each other's checkpoint files and mix their records in
one ``metrics.jsonl``; the second is refused before it writes anything, naming the process that
holds the workdir. The kernel drops the lock when its process ends, however it ends, so a crashed
or killed run leaves nothing that blocks the next one (a stale file is simply locked again).

``dtx launch`` holds the lock for its ranks and tells them so (:data:`ENV_HELD`); in a multi-process
job started otherwise, process 0 holds it.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import socket
import sys
import time

LOCK_FILE = ".dtx-lock"
ENV_HELD = "DTX_WORKDIR_LOCKED_BY"  # "<launcher pid>:<workdir>": the parent process holds this workdir's lock


class WorkdirInUse(FileExistsError):
    """Another live process holds the workdir's lock."""


class WorkdirLock:
    """``with WorkdirLock(workdir):`` -- the workdir is this process's (or its launcher's) until the block ends.

    Args:
      workdir: the run's directory (created if missing; removed again on release if it was created
        here and is still empty, e.g. after a run refused before its first record).
      enabled: ``False`` takes nothing (a multi-process job's other ranks).
      what: how the refusal names the folder (``checkpoint.dir``: one outside the workdir, locked too).
    """

    def __init__(self, workdir: str | os.PathLike, *, enabled: bool = True, what: str = "workdir"):
        self.workdir = os.path.abspath(os.fspath(workdir))
        self.what = what
        self.path = os.path.join(self.workdir, LOCK_FILE)
        self.enabled = enabled
        self._fd: int | None = None
        self._created = False

    def token(self) -> str:
        """What :data:`ENV_HELD` says to the processes this one starts on the workdir."""
        return f"{os.getpid()}:{self.workdir}"

    def acquire(self) -> WorkdirLock:
        if not self.enabled or self._inherited():
            return self
        self._created = not os.path.exists(self.workdir)
        os.makedirs(self.workdir, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _describe(os.pread(fd, 4096, 0))
                os.close(fd)
                raise WorkdirInUse(
                    f"{self.what} {self.workdir!r} is in use by {holder}; one run per {self.what}: wait for it to "
                    f"end, stop it, or choose another {'--workdir' if self.what == 'workdir' else self.what}") from None
            # The holder removes the file as it releases: if it did so between our open and our lock,
            # we locked a file no one else will see; lock the one at the path instead.
            try:
                current = os.stat(self.path)
            except FileNotFoundError:
                current = None
            mine = os.fstat(fd)
            if current is not None and (current.st_ino, current.st_dev) == (mine.st_ino, mine.st_dev):
                break
            os.close(fd)
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                  "command": shlex.join(getattr(sys, "orig_argv", sys.argv))}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)  # while still locked: no one can be holding the file unlinked here
        except FileNotFoundError:
            pass
        os.close(self._fd)  # the lock goes with the last descriptor
        self._fd = None
        if self._created:
            try:
                os.rmdir(self.workdir)  # only if nothing was written: a run refused before its first record
            except OSError:
                pass

    def __enter__(self) -> WorkdirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _inherited(self) -> bool:
        """The parent (``dtx launch``) holds this workdir's lock for us."""
        pid, _, workdir = os.environ.get(ENV_HELD, "").partition(":")
        return pid.isdigit() and int(pid) == os.getppid() and workdir == self.workdir


def _describe(content: bytes) -> str:
    """The holder the lock file names, for the refusal."""
    try:
        holder = json.loads(content.decode())
        return (f"process {holder['pid']} on {holder['host']} (since {holder['since']}: "
                f"{holder['command']})")
    except (ValueError, KeyError, TypeError):
        return "another process (it has not named itself yet)"
