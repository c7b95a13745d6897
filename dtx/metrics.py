"""Metric records (JSON lines and TensorBoard event files) and the progress display.

Values arrive on the host already: the training loop reads step ``s - 1``'s
metrics after dispatching step ``s``, so logging never stalls asynchronous
dispatch (and bounds the steps in flight — DESIGN.md §2).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

METRICS_FILE = "metrics.jsonl"


class MetricWriter:
    """Appends ``{"step": s, **metrics}`` lines to ``WORKDIR/metrics.jsonl`` and scalars to TensorBoard."""

    def __init__(self, workdir: str | os.PathLike, tensorboard: bool = True, enabled: bool = True):
        self.workdir = os.fspath(workdir)
        self.enabled = enabled  # in a multi-process job only process 0 writes
        self._jsonl = self._tb = None
        if not enabled:
            return
        os.makedirs(self.workdir, exist_ok=True)
        self._jsonl = open(os.path.join(self.workdir, METRICS_FILE), "a", encoding="utf-8")
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(logdir=self.workdir, flush_secs=10)

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

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> MetricWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(workdir: str | os.PathLike) -> list[dict]:
    """All records of a run, in order."""
    with open(os.path.join(os.fspath(workdir), METRICS_FILE), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class ProgressBar:
    """Step, loss and throughput: a live bar on terminals, a few plain lines elsewhere (CI logs)."""

    def __init__(self, total_steps: int, enabled: bool = True, console: Console | None = None):
        self.total = total_steps
        self.console = console or Console(file=sys.stderr)
        self.live = enabled and (self.console.is_terminal or self.console.is_jupyter)
        self.quiet = not enabled
        self._next_line = 0
        self._start = time.perf_counter()
        self._bar = None
        if self.live:
            self._bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[rate]} ex/s"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self._task = self._bar.add_task("train", total=total_steps, loss="-", rate="-")

    def update(self, step: int, loss: float, examples_per_sec: float) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=step, loss=f"{loss:.4f}", rate=f"{examples_per_sec:,.0f}")
        elif not self.quiet and step >= self._next_line:
            self._next_line = step + max(1, math.ceil(self.total / 10))
            self.console.print(f"step {step}/{self.total}  loss {loss:.4f}  {examples_per_sec:,.0f} ex/s")

    def __enter__(self) -> ProgressBar:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()


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
