"""PNG plots for studies and run comparisons (matplotlib, headless)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence


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
