"""PNG plots (matplotlib, headless) for studies and benchmarks, and ``dtx plot`` to compare runs.

    dtx plot RUN_DIR [RUN_DIR ...] [--out DIR] [--metrics loss,accuracy,...] [--x step,time,bytes,sim_time]

``dtx plot`` draws one PNG per metric and x axis, one line per run (named by its
folder): every metric against the step (``loss.png``), and the quality metrics
(loss, accuracy, test accuracy) against wall-clock time since the run started
(``loss_vs_time.png``, from ``elapsed_s``) and against the bytes one worker has
sent (``loss_vs_bytes.png``, from ``comm_bytes_total``) — how runs with different
allreduce algorithms, compressors or strategies trade time and traffic for
accuracy — and, for runs with a simulated clock (``--config.cluster``), against
the modelled time on that cluster (``loss_vs_sim_time.png``, from ``sim_time_s``). A step logged twice (a resumed run re-logs the steps after its
checkpoint) keeps its last record.

Each PNG says what it shows without help: axes carry names and units (:func:`axis_label`); a metric
every run records once (``test_accuracy`` of runs evaluated only at the end) is drawn as labelled bars,
one per run, so equal values cannot hide each other; a run's single point among other runs' lines is a
marker labelled with its name; the step-time and throughput plots mark the steps a checkpoint was saved
(``checkpoint_saved`` in the records: the save's seconds fall into that record's window); every plot
against the step marks each elastic restart at the step it restored, naming its processes and mesh
(``membership`` records, ``dtx launch --elastic``); and the
simulated-time plots name the cluster each run was timed on (its ``config.json``).

The drawing itself is :mod:`dtx.figures`' (re-exported here: :func:`line_plot`, :func:`panels_plot`).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
from collections.abc import Mapping, Sequence

from dtx.figures import Line, Panel, line_plot, panels_plot  # noqa: F401 - the public drawing API
from dtx.run import metrics as metrics_lib


DEFAULT_METRICS = ("loss", "accuracy", "test_accuracy", "test_loss", "perplexity", "examples_per_sec", "step_time_ms",
                   "mfu", "grad_norm", "comm_bytes_per_step", "learning_rate")
QUALITY_METRICS = ("loss", "accuracy", "test_accuracy")  # also drawn against time and bytes
# The x axes: record field, axis label ("{cluster}": the clusters the runs were timed on)
X_AXES = {"step": ("step", "training step"), "time": ("elapsed_s", "wall-clock time since the run started (s)"),
          "bytes": ("comm_bytes_total", "bytes sent per worker since step 0 (B)"),
          # the modelled time on --config.cluster (dtx.perf.simclock); runs without one draw no such plot
          "sim_time": ("sim_time_s", "simulated time on {cluster} (s)")}
# What a record field means, with its unit: the y axis of its plot (other keys: the key, unit from its suffix)
LABELS = {
    "loss": "training loss (the task's, e.g. cross-entropy in nats)",
    "accuracy": "training accuracy (fraction of the batch)",
    "test_accuracy": "test accuracy (fraction of the test set)",
    "test_loss": "test loss (the task's)",
    "perplexity": "test perplexity (exp of the mean token loss)",
    "examples_per_sec": "throughput (examples/s, all devices)",
    "examples_per_sec_per_device": "throughput (examples/s per device)",
    "step_time_ms": "time per training step (ms)",
    "mfu": "MFU (model FLOP/s / peak FLOP/s)",
    "hfu": "HFU (compiled FLOP/s / peak FLOP/s)",
    "grad_norm": "gradient norm (L2, after the allreduce)",
    "comm_bytes_per_step": "bytes sent per worker per step (B)",
    "comm_bytes_total": "bytes sent per worker since step 0 (B)",
    "comm_ratio": "float32 ring bytes / bytes sent (×)",
    "learning_rate": "learning rate",
    "sim_time_s": "simulated time (s)",
    "elapsed_s": "wall-clock time since the run started (s)",
}
_UNITS = (("_ms", "ms"), ("_s", "s"), ("_bytes", "B"), ("_per_sec", "1/s"))
TIMED_METRICS = ("step_time_ms", "examples_per_sec", "examples_per_sec_per_device", "mfu", "hfu")  # save marks


def axis_label(key: str) -> str:
    """The axis label of record field ``key``: its meaning and unit (``step_time_ms`` -> ``time per training
    step (ms)``); a key dtx does not know keeps its name, with the unit its suffix names."""
    if key in LABELS:
        return LABELS[key]
    unit = next((unit for suffix, unit in _UNITS if key.endswith(suffix)), None)
    return f"{key} ({unit})" if unit else key


def metric_series(records: list[dict], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    """``(xs, ys)`` of ``key`` against record field ``x``, one value per step (the last record wins).

    A record without ``x`` (an evaluation record) takes the ``x`` of the latest record
    at or before its step that has one.
    """
    by_step = {r["step"]: r[key] for r in records if _number(r.get(key))}
    steps = sorted(by_step)
    if x == "step":
        return steps, [float(by_step[s]) for s in steps]
    known = {r["step"]: float(r[x]) for r in records if _number(r.get(x))}
    known_steps = sorted(known)
    xs, ys = [], []
    for s in steps:
        i = bisect.bisect_right(known_steps, s)
        if i:
            xs.append(known[known_steps[i - 1]])
            ys.append(float(by_step[s]))
    return xs, ys


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def checkpoint_steps(records: list[dict]) -> list[int]:
    """The steps a run saved a checkpoint at (``checkpoint_saved`` of its records), in order, each once."""
    return sorted({int(step) for r in records for step in r.get("checkpoint_saved") or ()})


def restarts(records: list[dict]) -> list[tuple[int, str]]:
    """Each elastic restart (``membership`` records, :mod:`dtx.run.elastic`, from the first restart on): the step
    it restored and what it ran on, e.g. ``(5, "restart 1: 1 process, data=2, accumulation 2")``."""
    found = []
    for r in records:
        m = r.get("membership")
        if isinstance(m, dict) and m.get("restart", 0) >= 1:
            mesh = ", ".join(f"{axis}={size}" for axis, size in m.get("mesh", {}).items())
            found.append((int(m["restored_step"]), f"restart {m['restart']}: {m['processes']} process"
                          f"{'es' if m['processes'] != 1 else ''}, {mesh}, accumulation {m['grad_accum_steps']}"))
    return found


def run_cluster(workdir: str | os.PathLike) -> str:
    """The cluster a run's simulated clock modelled (``cluster.name`` of its ``config.json``; '' for none)."""
    try:
        with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
            cluster = json.load(f).get("cluster", {})
    except (OSError, ValueError):
        return ""
    return cluster.get("name", "") if isinstance(cluster, dict) else ""


def _panel(runs: Mapping[str, list[dict]], key: str, x: str, clusters: Mapping[str, str]) -> Panel | None:
    """The panel of ``key`` against x axis ``x``: bars when every run has one value at one step, else lines."""
    field, xlabel = X_AXES[x]
    lines = {name: metric_series(records, key, field) for name, records in runs.items()}
    lines = {name: xy for name, xy in lines.items() if xy[0]}
    if not lines:
        return None
    ylabel, title = axis_label(key), key
    if x == "step" and all(len(xs) == 1 for xs, _ in lines.values()):  # evaluated once: one labelled bar per run
        return Panel(lines, title=title, ylabel=ylabel, kind="bars", bar_x_label="step")
    if x == "sim_time":  # name the cluster: on the axis when the runs share it, else beside each run
        named = {clusters.get(name, "") for name in lines}
        if len(named) == 1:
            cluster = named.pop()
            xlabel = xlabel.format(cluster=cluster or "the run's cluster")
            title += f", simulated on {cluster}" if cluster else ""
        else:
            xlabel = xlabel.format(cluster="each run's cluster")
            lines = {f"{name} ({clusters.get(name) or '?'})": xy for name, xy in lines.items()}
    marks, colors = {}, {}
    if x == "step" and key in TIMED_METRICS:  # a save blocks the loop: its record's step time shows it
        for name in lines:
            saves = checkpoint_steps(runs[name])
            if saves:
                mark = f"{name}: checkpoint saved" if len(lines) > 1 else "checkpoint saved (that step's time includes it)"
                marks[mark], colors[mark] = saves, name
    if x == "step":  # an elastic restart: the step it went back to, on which processes and mesh
        for name in lines:
            for step, what in restarts(runs[name]):
                mark = f"{name}: {what}" if len(lines) > 1 else what
                marks[mark], colors[mark] = [step], name
    return Panel(lines, title=title, xlabel=xlabel, ylabel=ylabel, logy=key == "loss", marks=marks,
                 mark_colors=colors)


def plot_runs(runs: Mapping[str, list[dict]], out: str, metrics: Sequence[str] = DEFAULT_METRICS,
              x_axes: Sequence[str] = tuple(X_AXES), clusters: Mapping[str, str] | None = None) -> list[str]:
    """Write the PNGs of ``dtx plot`` for ``name -> records``; returns their paths.

    ``clusters``: ``name -> cluster`` the run's simulated clock modelled (:func:`run_cluster`), for the
    ``sim_time`` plots."""
    written = []
    for x in x_axes:
        for key in metrics if x == "step" else [m for m in metrics if m in QUALITY_METRICS]:
            panel = _panel(runs, key, x, clusters or {})
            if panel is not None:
                suffix = "" if x == "step" else f"_vs_{x}"
                written.append(panels_plot([panel], os.path.join(out, f"{key}{suffix}.png")))
    return written


def plot_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dtx plot", description="Plot runs' metrics.jsonl records as PNGs.")
    parser.add_argument("runs", nargs="+", help="run directories (each holding metrics.jsonl)")
    parser.add_argument("--out", default=".", help="folder for the PNGs (default: current folder)")
    parser.add_argument("--metrics", default=",".join(DEFAULT_METRICS), help="comma-separated record keys")
    parser.add_argument("--x", default=",".join(X_AXES),
                        help="x axes: step (every metric), time, bytes and sim_time (loss and accuracies); "
                        "default all")
    args = parser.parse_args(argv)
    x_axes = [x for x in args.x.split(",") if x]
    unknown = [x for x in x_axes if x not in X_AXES]
    if unknown:
        print(f"dtx plot: error: unknown --x {unknown[0]!r}; choose from {', '.join(X_AXES)}", file=sys.stderr)
        return 2
    records = {}
    for run in args.runs:
        if not os.path.isfile(os.path.join(run, metrics_lib.METRICS_FILE)):
            print(f"dtx plot: error: {run} has no {metrics_lib.METRICS_FILE} (is it a run directory?)",
                  file=sys.stderr)
            return 2
        records[os.path.basename(os.path.normpath(run))] = metrics_lib.read_metrics(run)
    clusters = {os.path.basename(os.path.normpath(run)): run_cluster(run) for run in args.runs}
    written = plot_runs(records, args.out, [m for m in args.metrics.split(",") if m], x_axes, clusters)
    if not written:
        print(f"dtx plot: error: none of {args.metrics} is in the runs' records", file=sys.stderr)
        return 2
    print("\n".join(written))
    return 0
