"""A host-side step watchdog: a process alive but stuck (a hung collective, a dead peer that
JAX has not noticed yet) aborts the job with a message naming the step and the rank."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

EXIT_CODE = 86


class StepWatchdog:
    """Aborts the process when no step completes for ``timeout`` seconds.

    Armed at the first :meth:`tick` (compilation happens before it), so a long
    first compile is never mistaken for a hang. ``timeout <= 0`` disables it. ``progress``
    (a :class:`dtx.run.progress.Progress`) is marked with each ticked step.
    """

    def __init__(self, timeout: float, rank: int = 0, progress=None):
        self.timeout, self.rank, self.progress = float(timeout), rank, progress
        self._last = None
        self._step = 0
        self._paused = False
        self._stop = threading.Event()
        self._thread = None

    def dispatched(self, step: int) -> None:
        """Step ``step`` was handed to the devices (marked in the progress file; the clock is the tick's)."""
        if self.progress is not None:
            self.progress.mark("training", max(self._step, self.progress.step), dispatched=step)

    def tick(self, step: int) -> None:
        self._step, self._last = step, time.monotonic()
        if self.progress is not None:  # dtx.run.progress: what the launcher reads to name a stalled rank
            self.progress.mark("training", step)

    def alive(self) -> None:
        """Work between steps made progress (an evaluation's batch): the clock starts again, the step stays."""
        if self._last is not None:
            self._last = time.monotonic()
            if self.progress is not None:
                self.progress.mark("training", self._step)

    @contextlib.contextmanager
    def paused(self):
        """Work between steps that may outlast ``timeout`` without being stuck (an evaluation of a large
        test split and its first compile, the wait for the last checkpoint): not watched; the clock
        starts again when it ends."""
        self._paused = True
        try:
            yield
        finally:
            if self._last is not None:
                self._last = time.monotonic()
            self._paused = False

    def __enter__(self) -> StepWatchdog:
        if self.timeout > 0:
            self._thread = threading.Thread(target=self._watch, name="dtx-step-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            if self._paused and self._last is not None and self.progress is not None:
                # Alive though not stepping (an evaluation, the last save): the launcher's stall bound
                # (dtx.tools.launch) reads the progress file's time; a stopped process stops renewing it.
                self.progress.mark("training", self._step)
            if not self._paused and self._last is not None and time.monotonic() - self._last > self.timeout:
                print(f"dtx watchdog: rank {self.rank} made no progress for {self.timeout:.0f} s after step "
                      f"{self._step}; aborting the job (a stuck collective or a dead peer)",
                      file=sys.stderr, flush=True)
                os._exit(EXIT_CODE)  # a stuck thread cannot be interrupted; leave at once
