"""The train loop's records, one step behind the dispatch (lag-1).

``train`` dispatches step k+1 before it looks at step k: the host never waits for the step it
just queued, yet at most two steps are in flight, which XLA:CPU's collectives need (about 35
unsynchronised steps deadlock its all-reduce; docs/data_parallel.md). :class:`StepLog` holds
that pending step. When the next one is dispatched it reads the pending step's metrics to the
host once, adds its bytes to the communication totals (:class:`CommTotals`), ticks the
watchdog, halts a diverged run, and every ``log_every`` steps writes its record and moves
the progress bar; :meth:`StepLog.flush` does the same for the last step, and :meth:`StepLog.settle` at once
for a step the loop has just checkpointed (a checkpoint never commits before its step's record).

A record holds the step's metrics (``loss``, the task's, ``grad_norm``...), ``learning_rate``,
``batch_hash`` and ``data_digest``, the communication figures (``comm_steps``: each step's own bytes and
rounds since the previous record, what the simulated clock times step by step), the throughput of the
steps since the previous record (``examples_per_sec``, ``step_time_ms``, MFU/HFU) and ``elapsed_s``.
A step built without records (:class:`dtx.step.StepSpec`'s ``record``) reports no ``loss``: its
record, if it gets one (a preempted run's last), has none.
The last step's record, written by :meth:`StepLog.flush`, has no next dispatch to close its
window: it carries no throughput and no ``learning_rate``. The progress bar still shows that
window's throughput for it (its steps are done once the last one is read), so a run of a single
step shows that step's rate.

**To add a record field**, pass ``extras=[fn]`` where ``fn(step, record) -> dict`` returns the
fields to add; it sees the record assembled so far (:meth:`StepLog._record`, the one place a
record is built) and runs for every record, the last step's included.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from dtx import precision
from dtx.run.metrics import to_host


@dataclasses.dataclass
class CommTotals:
    """Bytes and message rounds one worker sent since step 0, summed on the host step by step
    (strategies communicate on some steps only, so one step's figure is not the rate)."""

    steps: int = 0
    bytes: float = 0.0
    rounds: float = 0.0
    # (bytes, rounds) of every step when they are the compiled program's (jit driver), not the step's
    fixed: tuple[float, float] | None = dataclasses.field(default=None, compare=False)
    # (bytes, rounds) of each step counted since the last record (record_window empties it)
    window: list = dataclasses.field(default_factory=list, compare=False)

    def add(self, metrics: dict) -> None:
        """Count one step from its metrics, read to the host."""
        if self.fixed is not None or "comm_bytes" in metrics:
            sent = self.fixed or (metrics["comm_bytes"], metrics["comm_rounds"])
            self.steps += 1
            self.bytes += float(sent[0])
            self.rounds += float(sent[1])
            self.window.append([float(sent[0]), float(sent[1])])

    def record_window(self) -> dict:
        """``comm_steps``: ``[bytes, rounds]`` of each step since the previous record, oldest first (strategies
        send different amounts on different steps; the simulated clock times each step with its own)."""
        window, self.window = self.window, []
        return {"comm_steps": window} if window else {}

    def record(self, reference_bytes: int) -> dict:
        """``comm_bytes_per_step`` (mean so far) and ``comm_ratio``: float32 ring allreduce bytes ÷ bytes sent."""
        if not self.steps:
            return {}
        per_step = self.bytes / self.steps
        out = {"comm_bytes_total": self.bytes, "comm_bytes_per_step": per_step,
               "comm_rounds_per_step": self.rounds / self.steps}
        if per_step:
            out["comm_ratio"] = reference_bytes / per_step
        return out

    def saved(self, pending: dict | None) -> dict:
        """The totals as of the state being checkpointed (including the step still in flight, on the device)."""
        totals = dataclasses.replace(self, window=[])
        if pending is not None:
            totals.add(to_host(pending))  # a checkpoint waits for that step anyway
        return {"steps": totals.steps, "bytes": totals.bytes, "rounds": totals.rounds}

    def step_record(self) -> dict:
        """``comm_bytes``/``comm_rounds`` of each step when they are the compiled program's."""
        return {} if self.fixed is None else {"comm_bytes": self.fixed[0], "comm_rounds": self.fixed[1]}


class _Pending(NamedTuple):
    step: int  # the step count once it is done (state.step after it)
    metrics: dict  # its metrics, still on the device
    batch: dict  # batch_hash and data_digest of its batch


class StepLog:
    """Owns the lag-1 pending step and everything read from it (see the module docstring).

    Args:
      writer: a :class:`dtx.run.metrics.MetricWriter` (anything with ``write(step, dict)``).
      log_every: a record every this many steps (and for the last one).
      global_batch_size, num_devices: for ``examples_per_sec`` and its per-device share.
      comm: the run's :class:`CommTotals` (a resumed run's, restored from its checkpoint).
      reference_bytes: a float32 ring allreduce of the gradients, the ``comm_ratio`` yardstick.
      learning_rates: the rate of every step (index ``step - 1``), or ``None`` when not known.
      utilisation: ``step_seconds -> {"mfu": ..., "hfu": ...}`` (:func:`dtx.perf.flops.utilisation`).
      loss_scaler, peak_learning_rate: for the divergence checks and their messages.
      bar: a :class:`dtx.run.metrics.ProgressBar`, entered and left with this object.
      watchdog: ticked as each step is seen done (:class:`dtx.run.watchdog.StepWatchdog`).
      run_start: ``perf_counter()`` when the run started, for ``elapsed_s``.
      extras: ``fn(step, record) -> dict`` called on every record; their fields are added.
    """

    def __init__(self, writer, *, log_every: int, global_batch_size: int, num_devices: int,
                 comm: CommTotals | None = None, reference_bytes: float = 0.0, learning_rates=None,
                 utilisation: Callable[[float], dict] = lambda step_seconds: {},
                 loss_scaler: precision.LossScaler | None = None, peak_learning_rate: float | None = None,
                 bar=None, watchdog=None, run_start: float | None = None,
                 extras: Sequence[Callable[[int, dict], dict]] = (), clock: Callable[[], float] = time.perf_counter):
        self.writer, self.log_every = writer, log_every
        self.global_batch_size, self.num_devices = global_batch_size, num_devices
        self.comm = comm if comm is not None else CommTotals()
        self.reference_bytes, self.learning_rates, self.utilisation = reference_bytes, learning_rates, utilisation
        self.loss_scaler = loss_scaler or precision.LossScaler(enabled=False)
        self.peak_learning_rate = peak_learning_rate
        self.bar, self.watchdog, self.extras, self.clock = bar, watchdog, tuple(extras), clock
        self.run_start = clock() if run_start is None else run_start
        self._pending: _Pending | None = None
        self._window_start, self._window_steps = clock(), 0
        self._rate: float | None = None  # the progress bar's examples/s: None until a window closes

    def __enter__(self) -> StepLog:
        if self.bar is not None:
            self.bar.__enter__()
        self._window_start, self._window_steps = self.clock(), 0  # the loop starts now
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def dispatched(self, step: int, metrics: dict, batch: dict) -> None:
        """Step ``step`` (``state.step`` once done) was just dispatched: settle the one before, hold this one."""
        self._window_steps += 1
        if self.watchdog is not None:  # a rank waiting in this step's collective is ahead of one that never got here
            self.watchdog.dispatched(step)
        if self._pending is not None:
            self._settle(self._pending, last=False)
        self._pending = _Pending(step, metrics, batch)

    def comm_saved(self) -> dict:
        """The communication totals a checkpoint of the newest state stores (the pending step included)."""
        return self.comm.saved(self._pending.metrics if self._pending is not None else None)

    def settle(self) -> None:
        """The pending step settled now, not at the next dispatch: the loop has just saved a checkpoint of it, and
        its record must not wait for a next step that may never come (a rank killed, or stuck until killed,
        between the save and the next dispatch left a run resumed from that checkpoint without the step's
        record). Recorded only on a record step, as the next dispatch would; nothing is in flight."""
        if self._pending is not None:
            self._settle(self._pending, last=False, in_flight=0)
            self._pending = None

    def flush(self) -> None:
        """The last dispatched step, recorded whatever ``log_every`` says (the loop ended or was preempted)."""
        if self._pending is not None:
            self._settle(self._pending, last=True)
            self._pending = None

    def _settle(self, pending: _Pending, *, last: bool, in_flight: int = 1) -> None:
        host = to_host(pending.metrics)  # the step's one host read; it waits for the step (lag-1)
        self.comm.add(host)
        if self.watchdog is not None:
            self.watchdog.tick(pending.step)
        if self.loss_scaler.enabled:
            check_loss_scale(pending.step, host, self.loss_scaler)
        if not last and pending.step % self.log_every:
            return
        record = {k: float(v) for k, v in host.items()}
        check_finite_loss(pending.step, record, self.loss_scaler, self.peak_learning_rate)
        timing = None if last else self._close_window(in_flight)
        if last and self._window_steps:
            # The bar's rate, not the record's: the to_host above waited for the last step, so the window's
            # steps are done -- a run of one step (a resume one step from its end) shows that step's rate,
            # never a rate of 0 from no window at all.
            self._rate = self._window_steps * self.global_batch_size / max(self.clock() - self._window_start, 1e-9)
        record = self._record(pending, record, timing)
        self.writer.write(pending.step, record)
        if self.bar is not None and "loss" in record:  # a step built without records has none
            self.bar.update(pending.step, record["loss"], self._rate, record.get("mfu"))

    def _close_window(self, in_flight: int = 1) -> dict:
        """Throughput of the steps done since the previous record; the next window starts with the step in flight
        (none when :meth:`settle` closes it)."""
        elapsed = self.clock() - self._window_start
        done = self._window_steps - in_flight  # the step just dispatched is still running
        self._rate = done * self.global_batch_size / max(elapsed, 1e-9)
        step_seconds = elapsed / max(done, 1)
        self._window_start, self._window_steps = self.clock(), in_flight
        return {"examples_per_sec": self._rate, "examples_per_sec_per_device": self._rate / self.num_devices,
                "step_time_ms": 1e3 * step_seconds, **self.utilisation(step_seconds)}

    def _record(self, pending: _Pending, record: dict, timing: dict | None) -> dict:
        """The one place a record is assembled: metrics, rate, batch, communication, throughput, time, extras."""
        if timing is not None and self.learning_rates is not None:
            record["learning_rate"] = float(self.learning_rates[pending.step - 1])
        record.update(pending.batch)
        record.update(self.comm.step_record())
        record.update(self.comm.record(self.reference_bytes))
        record.update(self.comm.record_window())
        record.update(timing or {})
        record["elapsed_s"] = self.clock() - self.run_start
        for extra in self.extras:
            record.update(extra(pending.step, record))
        return record


def check_finite_loss(step: int, record: dict, scaler: precision.LossScaler, peak_lr) -> None:
    """A non-finite loss without loss scaling is divergence: stop now, naming the step, rather than train
    NaNs to the end (with loss scaling such a step is skipped and the scale backs off instead)."""
    loss = record.get("loss")
    if scaler.enabled or loss is None or math.isfinite(loss):
        return
    rate = f" (the peak rate is {peak_lr:g})" if peak_lr is not None else ""
    raise FloatingPointError(
        f"step {step}: the training loss is {loss} — the run diverged. Lower optimizer.learning_rate{rate}, add "
        "warmup (optimizer.warmup_steps) or gradient clipping, or check the inputs for NaN/inf. Checkpoints "
        "already committed are kept; this run's state is not saved.")


def check_loss_scale(step: int, metrics: dict, scaler: precision.LossScaler) -> None:
    """Non-finite gradients at the minimum scale are divergence, not float16 overflow: stop."""
    if metrics["skipped"] and float(metrics["loss_scale"]) <= scaler.min_scale:
        raise FloatingPointError(
            f"step {step}: gradients are non-finite even at the minimum loss scale "
            f"(loss_scale.min_scale={scaler.min_scale}); the run diverged (NaN/inf in the loss or the data) "
            "rather than overflowing float16. Lower optimizer.learning_rate, check the inputs, or use "
            "compute=bfloat16. The parameters were left at their last finite values."
        )
