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

Every PNG dtx writes — ``dtx plot``, ``dtx simulate``, ``dtx bench collectives``,
the sweeps in ``benchmarks/`` — goes through :func:`line_plot` or
:func:`panels_plot`. They draw on a bare ``Figure`` with the Agg canvas: no
pyplot state and no backend switch, so they are safe in CI and in notebooks
(show the PNG with ``IPython.display.Image(path)``).
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import os
import sys
from collections.abc import Mapping, Sequence

from dtx.run import metrics as metrics_lib


@dataclasses.dataclass
class Line:
    """One series with a style: ``"-"`` (default), ``"--"`` dashed, ...; ``same_color_as`` names
    an earlier series of the same panel to share its colour (measured vs predicted pairs)."""

    xs: Sequence[float]
    ys: Sequence[float]
    style: str = "-"
    same_color_as: str | None = None


@dataclasses.dataclass
class Panel:
    """One set of axes: ``series`` maps a legend name to ``(xs, ys)`` or a :class:`Line`."""

    series: Mapping[str, tuple[Sequence[float], Sequence[float]] | Line]
    title: str = ""
    xlabel: str = ""
    ylabel: str = ""
    logx: bool = False
    logy: bool = False


def panels_plot(panels: Sequence[Panel], path: str | os.PathLike, *, title: str = "") -> str:
    """Draw ``panels`` side by side and write a PNG to ``path``; returns the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4 * len(panels), 4.4 if title else 4.2), dpi=120)
    FigureCanvasAgg(fig)
    for ax, panel in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        colors = {}
        for name, data in panel.series.items():
            line = data if isinstance(data, Line) else Line(*data)
            style = dict(marker="o", markersize=3) if line.style == "-" else {}
            (drawn,) = ax.plot(list(line.xs), list(line.ys), line.style, label=name,
                               color=colors.get(line.same_color_as), **style)
            colors[name] = drawn.get_color()
        if panel.logx:
            ax.set_xscale("log", base=2)
        if panel.logy:
            ax.set_yscale("log")
        ax.set(title=panel.title, xlabel=panel.xlabel, ylabel=panel.ylabel)
        ax.grid(True, which="both", alpha=0.3)
        if len(panel.series) > 1:
            ax.legend(fontsize=7 if len(panel.series) > 6 else None)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)
    return path


def line_plot(
    series: Mapping[str, tuple[Sequence[float], Sequence[float]] | Line],
    path: str | os.PathLike,
    *,
    title: str = "",
    xlabel: str = "",
    ylabel: str = "",
    logx: bool = False,
    logy: bool = False,
) -> str:
    """Draw one line per ``name -> (xs, ys)`` and write a PNG to ``path``; returns the path."""
    return panels_plot([Panel(series, title, xlabel, ylabel, logx, logy)], path)


DEFAULT_METRICS = ("loss", "accuracy", "test_accuracy", "examples_per_sec", "step_time_ms", "mfu", "grad_norm",
                   "comm_bytes_per_step", "learning_rate")
QUALITY_METRICS = ("loss", "accuracy", "test_accuracy")  # also drawn against time and bytes
X_AXES = {"step": ("step", "step"), "time": ("elapsed_s", "seconds since the run started"),
          "bytes": ("comm_bytes_total", "bytes sent per worker"),
          # the modelled time on --config.cluster (dtx.perf.simclock); runs without one draw no such plot
          "sim_time": ("sim_time_s", "simulated seconds on the cluster")}


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


def plot_runs(runs: Mapping[str, list[dict]], out: str, metrics: Sequence[str] = DEFAULT_METRICS,
              x_axes: Sequence[str] = tuple(X_AXES)) -> list[str]:
    """Write the PNGs of ``dtx plot`` for ``name -> records``; returns their paths."""
    written = []
    for x in x_axes:
        field, label = X_AXES[x]
        for key in metrics if x == "step" else [m for m in metrics if m in QUALITY_METRICS]:
            lines = {name: metric_series(records, key, field) for name, records in runs.items()}
            lines = {name: xy for name, xy in lines.items() if xy[0]}
            if lines:
                suffix = "" if x == "step" else f"_vs_{x}"
                written.append(line_plot(lines, os.path.join(out, f"{key}{suffix}.png"), title=key, xlabel=label,
                                         ylabel=key, logy=key == "loss"))
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
    written = plot_runs(records, args.out, [m for m in args.metrics.split(",") if m], x_axes)
    if not written:
        print(f"dtx plot: error: none of {args.metrics} is in the runs' records", file=sys.stderr)
        return 2
    print("\n".join(written))
    return 0
