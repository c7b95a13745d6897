"""PNG plots (matplotlib, headless) for studies, and ``dtx plot`` to compare runs.

    dtx plot RUN_DIR [RUN_DIR ...] [--out DIR] [--metrics loss,accuracy]

``dtx plot`` draws one PNG per metric, one line per run (named by its folder), against
the step; a step logged twice (a resumed run re-logs the steps after its checkpoint)
keeps its last record.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

from dtx import metrics as metrics_lib


def line_plot(
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    path: str | os.PathLike,
    *,
    title: str = "",
    xlabel: str = "",
    ylabel: str = "",
    logx: bool = False,
    logy: bool = False,
) -> str:
    """Draw one line per ``name -> (xs, ys)`` and write a PNG to ``path``; returns the path."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; safe in CI and in notebooks (they show the PNG)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for name, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), marker="o", markersize=3, label=name)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(True, alpha=0.3)
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


DEFAULT_METRICS = ("loss", "accuracy", "test_accuracy", "examples_per_sec", "learning_rate")


def metric_series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of ``key``, one value per step (the last record wins)."""
    by_step = {r["step"]: r[key] for r in records if isinstance(r.get(key), (int, float))}
    steps = sorted(by_step)
    return steps, [float(by_step[s]) for s in steps]


def plot_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dtx plot", description="Plot runs' metrics.jsonl records as PNGs.")
    parser.add_argument("runs", nargs="+", help="run directories (each holding metrics.jsonl)")
    parser.add_argument("--out", default=".", help="folder for the PNGs (default: current folder)")
    parser.add_argument("--metrics", default=",".join(DEFAULT_METRICS), help="comma-separated record keys")
    args = parser.parse_args(argv)
    records = {}
    for run in args.runs:
        if not os.path.isfile(os.path.join(run, metrics_lib.METRICS_FILE)):
            print(f"dtx plot: error: {run} has no {metrics_lib.METRICS_FILE} (is it a run directory?)",
                  file=sys.stderr)
            return 2
        records[os.path.basename(os.path.normpath(run))] = metrics_lib.read_metrics(run)
    written = []
    for key in filter(None, args.metrics.split(",")):
        lines = {name: metric_series(r, key) for name, r in records.items()}
        lines = {name: xy for name, xy in lines.items() if xy[0]}
        if not lines:
            continue
        written.append(line_plot(lines, os.path.join(args.out, f"{key}.png"), title=key, xlabel="step",
                                       ylabel=key, logy=key == "loss"))
    if not written:
        print(f"dtx plot: error: none of {args.metrics} is in the runs' records", file=sys.stderr)
        return 2
    print("\n".join(written))
    return 0
