"""Metric records (JSON lines, TensorBoard event files, optionally wandb), the progress display, profiler traces.

Values arrive on the host already: the training loop reads step ``s - 1``'s
metrics after dispatching step ``s``, so logging never stalls asynchronous
dispatch (and bounds the steps in flight, which XLA:CPU's emulated collectives need: docs/data_parallel.md).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping
from html import escape

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from dtx.run import wandb_sink  # registers wandb's config check; wandb itself is imported only when used

METRICS_FILE = "metrics.jsonl"
SUPERSEDED_FILE = "metrics.superseded.jsonl"  # records a resume took out of METRICS_FILE


class MetricWriter:
    """Appends ``{"step": s, **metrics}`` lines to ``WORKDIR/metrics.jsonl`` and scalars to TensorBoard.

    ``resumed_from=N`` (a run resumed from checkpoint step N) first moves the records of
    steps after N to ``metrics.superseded.jsonl`` — they describe training the resumed run
    redoes — and tells TensorBoard to hide its events past N, so every step has one history.

    ``wandb`` (the config's ``wandb`` block) with a ``project`` also logs every record, and ``run_config``
    as the run's config, to Weights & Biases (:class:`dtx.run.wandb_sink.WandbSink`).
    """

    def __init__(self, workdir: str | os.PathLike, tensorboard: bool = True, enabled: bool = True,
                 resumed_from: int | None = None, wandb: Mapping | None = None, run_config: Mapping | None = None):
        self.workdir = os.fspath(workdir)
        self.enabled = enabled  # in a multi-process job only process 0 writes
        self._jsonl = self._tb = self._wandb = None
        if not enabled:
            return
        os.makedirs(self.workdir, exist_ok=True)
        if resumed_from is not None:
            truncate_after(self.workdir, resumed_from)
        self._jsonl = open(os.path.join(self.workdir, METRICS_FILE), "a", encoding="utf-8")
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(logdir=self.workdir, flush_secs=10,
                                     purge_step=None if resumed_from is None else resumed_from + 1)
        if wandb and wandb.get("project"):
            self._wandb = wandb_sink.WandbSink(self.workdir, wandb, run_config, resumed_from)

    def write(self, step: int, metrics: Mapping[str, float | int | str]) -> None:
        if not self.enabled:
            return
        record = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, global_step=int(step))
        if self._wandb is not None:
            self._wandb.write(step, record)

    def holds(self, step: int, keys) -> bool:
        """Whether ``metrics.jsonl`` already holds a record of ``step`` with every one of ``keys`` (e.g. an
        evaluation's ``test_loss``, ``test_accuracy``, ``test_examples``); ``False`` where this writer writes
        nothing (a process other than 0)."""
        if not self.enabled:
            return False
        path = os.path.join(self.workdir, METRICS_FILE)
        if not os.path.exists(path):
            return False
        with open(path, encoding="utf-8") as f:
            for line in filter(str.strip, f):
                try:
                    record = json.loads(line)
                except ValueError:  # a line a killed process left half-written
                    continue
                if isinstance(record, dict) and record.get("step") == step and all(k in record for k in keys):
                    return True
        return False

    def close(self, failed: bool = False) -> None:
        """``failed``: the run ends on an error (its wandb run is marked failed)."""
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close(failed)
            self._wandb = None

    def __enter__(self) -> MetricWriter:
        return self

    def __exit__(self, kind, *exc) -> None:
        self.close(failed=kind is not None)


class CheckpointMarks:
    """A :class:`dtx.run.steplog.StepLog` extra: the next record says which checkpoint saves its window holds.

    The loop saves step ``k`` after dispatching it and before the record of step ``k`` closes its timing
    window, so the seconds a save blocks the loop land in that record's ``step_time_ms``: the record carries
    ``checkpoint_saved`` (the steps saved since the previous record) and ``checkpoint_save_s`` (the seconds
    the loop spent in those saves), which ``dtx plot`` marks on its step-time plots.
    """

    def __init__(self, clock=time.perf_counter):
        self.clock, self._steps, self._seconds = clock, [], 0.0

    def saved(self, step: int, started: float) -> None:
        """Step ``step`` was saved by a call that began at ``clock()`` time ``started``."""
        self._steps.append(int(step))
        self._seconds += self.clock() - started

    def __call__(self, step: int, record: dict) -> dict:
        if not self._steps:
            return {}
        marks = {"checkpoint_saved": self._steps, "checkpoint_save_s": self._seconds}
        self._steps, self._seconds = [], 0.0
        return marks


def truncate_after(workdir: str | os.PathLike, step: int) -> int:
    """Move the records of steps after ``step`` (and a line torn by a killed process) from
    ``metrics.jsonl`` to ``metrics.superseded.jsonl``; returns how many moved. Nothing is lost:
    the moved lines are appended there before ``metrics.jsonl`` is replaced in one rename."""
    path = os.path.join(os.fspath(workdir), METRICS_FILE)
    if not os.path.exists(path):
        return 0
    keep, moved = [], []
    with open(path, encoding="utf-8") as f:
        for line in filter(str.strip, f):
            try:
                kept = int(json.loads(line)["step"]) <= step
            except (ValueError, KeyError, TypeError):
                kept = False
            (keep if kept else moved).append(line if line.endswith("\n") else line + "\n")
    if moved:
        with open(os.path.join(os.fspath(workdir), SUPERSEDED_FILE), "a", encoding="utf-8") as f:
            f.writelines(moved)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(keep)
        os.replace(path + ".tmp", path)
    return len(moved)


def read_metrics(workdir: str | os.PathLike) -> list[dict]:
    """All records of a run, in order."""
    with open(os.path.join(os.fspath(workdir), METRICS_FILE), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def progress_mode(enabled: bool, console: Console) -> str:
    """How to show progress: ``off``; ``notebook`` inside a Jupyter/Colab kernel (a bar
    redrawn in place in the cell's output); ``terminal`` (rich's live bar); ``plain``
    (a few lines, for CI logs and pipes)."""
    if not enabled:
        return "off"
    if console.is_jupyter:  # checked first: a kernel's streams are not terminals
        return "notebook"
    return "terminal" if console.is_terminal else "plain"


class ProgressBar:
    """Step, loss and throughput, shown as :func:`progress_mode` chooses.

    Args:
      total_steps: the run's last step.
      enabled: ``False`` shows nothing.
      console: where terminal and plain output go (default: stderr); its
        ``is_jupyter`` / ``is_terminal`` pick the mode.
      display: notebook mode's ``IPython.display.display`` (injectable for tests).
    """

    def __init__(self, total_steps: int, enabled: bool = True, console: Console | None = None, display=None,
                 tokens: int = 0):
        self.total, self.tokens = total_steps, tokens  # tokens per example: a sequence task's rate in tokens/s too
        self.console = console or Console(file=sys.stderr)
        self.mode = progress_mode(enabled, self.console)
        self._next_line = 0
        self._bar = self._notebook = None
        if self.mode == "notebook":
            self._notebook = NotebookBar(total_steps, display=display)
        elif self.mode == "terminal":
            self._bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[rate]} ex/s"),
                TextColumn("{task.fields[more]}"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self._task = self._bar.add_task("train", total=total_steps, loss="-", rate="-", more="")

    def more(self, examples_per_sec: float | None, mfu: float | None) -> str:
        """What follows the examples' rate: tokens/s for a sequence task, the model FLOPs utilisation where a peak
        is known (``peak_flops``, or the device kind's)."""
        fields = []
        if self.tokens > 1 and examples_per_sec is not None:
            fields.append(f"{examples_per_sec * self.tokens:,.0f} tok/s")
        if mfu is not None:
            fields.append(f"mfu {100 * mfu:.1f}%")
        return "  ".join(fields)

    def update(self, step: int, loss: float, examples_per_sec: float | None, mfu: float | None = None) -> None:
        """``examples_per_sec``: ``None`` while no throughput is measured yet (shown as ``-``, never as 0);
        ``mfu``: the record's model FLOPs utilisation, if any."""
        rate = "-" if examples_per_sec is None else f"{examples_per_sec:,.0f}"
        more = self.more(examples_per_sec, mfu)
        if self._bar is not None:
            self._bar.update(self._task, completed=step, loss=f"{loss:.4f}", rate=rate, more=more)
        elif self._notebook is not None:
            self._notebook.update(step, loss, examples_per_sec, more)
        elif self.mode == "plain" and step >= self._next_line:
            self._next_line = step + max(1, math.ceil(self.total / 10))
            self.console.print(f"step {step}/{self.total}  loss {loss:.4f}  {rate} ex/s" + (f"  {more}" if more
                                                                                         else ""))

    def __enter__(self) -> ProgressBar:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
        if self._notebook is not None:
            self._notebook.close()


class NotebookBar:
    """A progress bar in a notebook cell's output, redrawn in place.

    One ``display(..., display_id=True)`` output updated through its handle: an
    HTML ``<progress>`` element where the front end renders HTML (Jupyter, Colab,
    VS Code) and a text line elsewhere. Needs only IPython, which every kernel has
    (rich's own notebook support needs ipywidgets). Redraws at most every
    ``min_interval`` seconds, so a fast loop does not flood the notebook.
    """

    def __init__(self, total_steps: int, display=None, min_interval: float = 0.2):
        if display is None:
            from IPython.display import display
        self.total, self.min_interval = total_steps, min_interval
        self._start = time.perf_counter()
        self._last_draw = -math.inf
        self._pending = None
        self._handle = display(self._bundle(0, None, None, ""), raw=True, display_id=True)

    def update(self, step: int, loss: float, examples_per_sec: float | None, more: str = "") -> None:
        self._pending = (step, loss, examples_per_sec, more)
        now = time.perf_counter()
        if now - self._last_draw >= self.min_interval or step >= self.total:
            self._draw(now)

    def close(self) -> None:
        if self._pending is not None:
            self._draw(time.perf_counter())

    def _draw(self, now: float) -> None:
        self._handle.update(self._bundle(*self._pending), raw=True)
        self._last_draw, self._pending = now, None

    def _bundle(self, step: int, loss: float | None, rate: float | None, more: str) -> dict[str, str]:
        elapsed = time.perf_counter() - self._start
        fields = [f"train {step}/{self.total}"]
        if loss is not None:
            fields.append(f"loss {loss:.4f}")
        if rate is not None:
            fields.append(f"{rate:,.0f} ex/s")
        if more:
            fields.append(more)
        if 0 < step < self.total:
            fields.append(f"{elapsed * (self.total - step) / step:.0f} s left")
        elif step >= self.total:
            fields.append(f"done in {elapsed:.1f} s")
        text = "  ".join(fields)
        html = (f'<div style="font-family:monospace"><progress value="{step}" max="{max(self.total, 1)}" '
                f'style="width:30em;vertical-align:middle"></progress> {escape(text)}</div>')
        return {"text/plain": text, "text/html": html}


class StepTrace:
    """A ``jax.profiler`` trace of ``count`` steps starting at ``first_step``, into ``logdir``.

    Call :meth:`before_step` before dispatching each step, with the newest outputs:
    the trace starts before ``first_step`` is dispatched and stops once the last
    traced step has finished (waiting on it once). View the trace with TensorBoard's
    profile plugin or Perfetto (the ``*.trace.json.gz`` file).
    """

    def __init__(self, logdir: str | os.PathLike, first_step: int, count: int, enabled: bool = True):
        self.logdir, self.first, self.count = os.fspath(logdir), first_step, count
        self.enabled = enabled and count > 0
        self.active = False

    def before_step(self, step: int, outputs) -> None:
        if not self.enabled:
            return
        if step == self.first and not self.active:
            import jax

            jax.profiler.start_trace(self.logdir)
            self.active = True
        elif step == self.first + self.count and self.active:
            import jax

            jax.block_until_ready(outputs)  # the traced steps' work, not just their dispatch
            self.stop()

    def stop(self) -> None:
        if self.active:
            import jax

            jax.profiler.stop_trace()
            self.active = False

    def __enter__(self) -> StepTrace:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _plain(value):
    """numpy / jax scalars to JSON-ready Python numbers."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible instead of crashing
    return value


def to_host(tree):
    """Replicated device values as host numpy, also when other processes hold replicas too.

    ``jax.device_get`` refuses arrays that are not fully addressable (multi-process);
    a replicated array's local replica is the value.
    """
    import jax
    import numpy as np

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if not x.sharding.is_fully_replicated:
                raise ValueError("to_host needs replicated arrays in a multi-process job")
            return np.asarray(x.addressable_data(0))
        return np.asarray(jax.device_get(x))

    return jax.tree.map(one, tree)
