"""PNG figures (matplotlib, headless): lines, labelled points, bars and marks, one or more panels.

Every PNG dtx writes — ``dtx plot``, ``dtx simulate`` and :meth:`dtx.perf.report.ScalingReport.plot`,
``dtx bench collectives``, the sweeps in ``benchmarks/`` — goes through :func:`line_plot` or
:func:`panels_plot`. They draw on a bare ``Figure`` with the Agg canvas: no pyplot state and no
backend switch, so they are safe in CI and in notebooks (show the PNG with ``IPython.display.Image(path)``).

A series of one point is drawn as a marker labelled with its name (points that coincide share one
label), so runs evaluated once each stay visible; a ``Panel(kind="bars")`` draws each series' last
value as a labelled bar instead; ``Panel.marks`` draws vertical lines at named x values (checkpoint saves).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence


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
    """One set of axes: ``series`` maps a legend name to ``(xs, ys)`` or a :class:`Line`.

    ``kind="bars"``: one horizontal bar per series, its last value, labelled with the value and its x
    (``bar_x_label``, e.g. ``"step"``). ``marks`` maps a legend name to x values drawn as dotted vertical
    lines, in the colour of the series of the same name where there is one (``"run a: checkpoint saved"``
    takes run ``a``'s colour when ``mark_colors`` maps it to ``"run a"``).
    """

    series: Mapping[str, tuple[Sequence[float], Sequence[float]] | Line]
    title: str = ""
    xlabel: str = ""
    ylabel: str = ""
    logx: bool = False
    logy: bool = False
    kind: str = "lines"
    bar_x_label: str = ""
    marks: Mapping[str, Sequence[float]] = dataclasses.field(default_factory=dict)
    mark_colors: Mapping[str, str] = dataclasses.field(default_factory=dict)


KINDS = ("lines", "bars")


def _lines(ax, panel: Panel) -> None:
    colors, points = {}, {}
    for name, data in panel.series.items():
        line = data if isinstance(data, Line) else Line(*data)
        xs, ys = list(line.xs), list(line.ys)
        style = dict(marker="o", markersize=3) if line.style == "-" else {}
        if len(xs) == 1:  # one point: a bigger marker, labelled below (a line of one point is invisible)
            style = dict(marker="o", markersize=7)
            points.setdefault((xs[0], ys[0]), []).append(name)
        (drawn,) = ax.plot(xs, ys, line.style if len(xs) > 1 else "", label=name,
                           color=colors.get(line.same_color_as), **style)
        colors[name] = drawn.get_color()
    for (x, y), names in points.items():  # runs at the same point share one label instead of hiding each other
        ax.annotate(f"{', '.join(names)}: {y:.4g}", (x, y), textcoords="offset points", xytext=(6, 6), fontsize=7)
    for name, xs in panel.marks.items():
        color = colors.get(panel.mark_colors.get(name), "0.4")
        for i, x in enumerate(xs):
            ax.axvline(x, color=color, linestyle=":", linewidth=1.2, label=name if i == 0 else None)


def _bars(ax, panel: Panel) -> None:
    names = list(panel.series)
    lines = [data if isinstance(data, Line) else Line(*data) for data in panel.series.values()]
    last = [(list(line.xs)[-1], list(line.ys)[-1]) for line in lines]
    values = [y for _, y in last]
    bars = ax.barh(range(len(names)), values, color=[f"C{i % 10}" for i in range(len(names))])
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()  # the first run on top, as in the legend of a line plot
    at = f" ({panel.bar_x_label} {{x:g}})" if panel.bar_x_label else ""
    ax.bar_label(bars, labels=[f"{y:.4g}" + at.format(x=x) for x, y in last], padding=3, fontsize=8)
    ax.set_xlim(0, max(values + [0.0]) * 1.3 or 1.0)  # room for the labels


def panels_plot(panels: Sequence[Panel], path: str | os.PathLike, *, title: str = "") -> str:
    """Draw ``panels`` side by side and write a PNG to ``path``; returns the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    unknown = [panel.kind for panel in panels if panel.kind not in KINDS]
    if unknown:
        raise ValueError(f"Panel(kind={unknown[0]!r}): choose one of {', '.join(KINDS)}")
    fig = Figure(figsize=(6.4 * len(panels), 4.4 if title else 4.2), dpi=120)
    FigureCanvasAgg(fig)
    for ax, panel in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        if panel.kind == "bars":
            _bars(ax, panel)
            ax.set(title=panel.title, xlabel=panel.ylabel)  # the value runs along the bars
            ax.grid(True, axis="x", alpha=0.3)
            continue
        _lines(ax, panel)
        if panel.logx:
            ax.set_xscale("log", base=2)
        if panel.logy:
            ax.set_yscale("log")
        ax.set(title=panel.title, xlabel=panel.xlabel, ylabel=panel.ylabel)
        ax.grid(True, which="both", alpha=0.3)
        if len(panel.series) + len(panel.marks) > 1:
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
