"""Preemption: SIGTERM (a scheduler's notice) stops a run at the next step boundary, after a checkpoint,
instead of killing it mid-step; :mod:`dtx.ckpt.checkpoint` saves, this module only notices."""

from __future__ import annotations

import signal
import threading

import jax

from dtx import _sigterm


class PreemptionWatcher:
    """SIGTERM -> stop at the next step boundary (after saving), instead of dying mid-step.

    With several processes JAX's own preemption sync point decides, so every process
    stops at the same step; there JAX installs the signal notifier itself (a handler
    installed after ``jax.distributed.initialize`` would silently disable it).

    The ``dtx`` command notes SIGTERM from its first moment (:mod:`dtx._sigterm`); entering the
    watcher takes that over, so a signal that came while dtx was still importing stops the run
    before its first step.
    """

    def __init__(self, enabled: bool = True, multi_process: bool | None = None):
        self.enabled = enabled
        # Asked of the caller where it is known: jax.process_count() would start JAX's backend.
        self._multi_process = multi_process
        self._flag = threading.Event()
        self._previous = None

    @property
    def multi_process(self) -> bool:
        if self._multi_process is None:
            self._multi_process = jax.process_count() > 1
        return self._multi_process

    def requested(self, step: int) -> bool:
        if not self.enabled:
            return False
        if self.multi_process:
            from jax.experimental import multihost_utils

            return bool(multihost_utils.reached_preemption_sync_point(step))
        return self._flag.is_set()

    def __enter__(self) -> PreemptionWatcher:
        if self.enabled and not self.multi_process and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, lambda *_: self._flag.set())
            if _sigterm.take():  # came while the dtx command was still importing: stop before the first step
                self._flag.set()
        else:  # JAX's notifier (several processes) or the default action gets what the dtx command noted
            _sigterm.hand_back(restore_default=not self.multi_process)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
