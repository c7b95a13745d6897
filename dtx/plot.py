"""``dtx plot``: compare runs from their ``metrics.jsonl`` records as PNG plots.

    dtx plot RUN_DIR [RUN_DIR ...] [--out DIR] [--metrics loss,accuracy]

One PNG per metric, one line per run (named by its folder), against the step. A
step logged twice (a resumed run re-logs the steps after its checkpoint) keeps
its last record.
"""

from __future__ import annotations

import argparse
import os
import sys

from dtx import metrics as metrics_lib
from dtx import plots

DEFAULT_METRICS = ("loss", "accuracy", "test_accuracy", "examples_per_sec", "learning_rate")


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
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
        lines = {name: series(r, key) for name, r in records.items()}
        lines = {name: xy for name, xy in lines.items() if xy[0]}
        if not lines:
            continue
        written.append(plots.line_plot(lines, os.path.join(args.out, f"{key}.png"), title=key, xlabel="step",
                                       ylabel=key, logy=key == "loss"))
    if not written:
        print(f"dtx plot: error: none of {args.metrics} is in the runs' records", file=sys.stderr)
        return 2
    print("\n".join(written))
    return 0
