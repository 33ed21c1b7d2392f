"""The report's chart kinds: data in, an inline SVG element out (drawn by matplotlib, see svg_figure.py).

Kinds: `line_chart` (series with optional interval error bars, predicted series as hollow
markers on a dashed line, a shaded band or bound, vertical markers, shaded spans), `bar_chart`
(bars coloured by verdict against a reference per bar or one across the chart), `dot_chart`
(measured with its interval beside predicted, per figure, against its threshold) and `cdf_chart`
(empirical CDFs, one panel per level, a line per target).
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from typing import Optional, Sequence, TypeGuard

from matplotlib.artist import Artist
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator, PercentFormatter

from .svg_figure import (
    CHART_CSS,
    HEIGHT_IN,
    STYLE,
    WIDE_IN,
    literal,
    new_figure,
    place,
    set_title,
    style,
    text_width_in,
    to_svg,
)

__all__ = ["CHART_CSS", "Bar", "Distribution", "Dot", "Panel", "Series", "bar_chart", "cdf_chart", "dot_chart",
           "empty_chart", "fmt_tick", "line_chart", "to_svg"]
PALETTE = ("#2563eb", "#ea580c", "#059669", "#7c3aed", "#db2777", "#0891b2", "#65a30d", "#64748b")
STATUS_COLORS = {"PASS": "#16a34a", "FAIL": "#dc2626", "INCONCLUSIVE": "#d97706"}
REFERENCE_COLOR, MARKER_COLOR, BAND_COLOR, SPAN_COLOR = "#111827", "#b91c1c", "#16a34a", "#6b7280"
MAX_CDF_STEPS = 200            # a CDF curve drawn from at most this many quantiles (its n is the records')
Point = tuple[Optional[float], Optional[float]]   # a point without both figures is not drawn
Interval = tuple[float, float]


@dataclass(frozen=True)
class Series:
    """One line. `errors`: an interval (lo, hi) per point, or None where a point has none.
    `predicted`: drawn dashed with hollow markers. `key`: the colour; a measured series and its
    prediction share one (defaults to the name)."""

    name: str
    points: Sequence[Point]
    errors: Sequence[Optional[Interval]] = ()
    predicted: bool = False
    key: str = ""


@dataclass(frozen=True)
class Bar:
    """One bar; `reference` (a spec, fio's figure) is drawn as a line across this bar alone."""

    label: str
    value: Optional[float]                 # None: no figure, the bar is left out
    reference: Optional[float] = None
    status: str = ""


@dataclass(frozen=True)
class Dot:
    """One figure of a dot chart: measured (with its interval) beside predicted, against a threshold."""

    label: str
    measured: Optional[float]
    interval: Optional[Interval] = None
    predicted: Optional[float] = None
    threshold: Optional[float] = None
    status: str = ""


@dataclass(frozen=True)
class Distribution:
    """The raw values of one target at one level (a CDF line)."""

    name: str
    values: Sequence[float]
    key: str = ""


@dataclass(frozen=True)
class Panel:
    """One subplot of a CDF chart: its title and its distributions."""

    title: str
    distributions: Sequence[Distribution]


# ---------------------------------------------------------------- helpers

def finite(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def fmt_tick(value: float, _position: object = None) -> str:
    """Compact axis number: 25k, 1.5M, 0.25, 3; token counts that are multiples of 1024 read 4k, 16k, 128k."""
    magnitude = abs(value)
    if 1024 <= magnitude < 1e7 and value == int(value) and int(value) % 1024 == 0:
        return f"{int(value) // 1024}k"
    for limit, divisor, suffix in ((1e9, 1e9, "G"), (1e6, 1e6, "M"), (1e4, 1e3, "k")):
        if magnitude >= limit:
            return f"{value / divisor:.3g}{suffix}"
    if magnitude >= 1 or value == 0:
        return f"{value:.4g}"
    return f"{value:.2g}"


def _colours(keys: Sequence[str]) -> dict[str, str]:
    order: list[str] = []
    for key in keys:
        if key not in order:
            order.append(key)
    return {key: PALETTE[i % len(PALETTE)] for i, key in enumerate(order)}


def empty_chart(title: str) -> str:
    with style(title):
        figure = new_figure(height=1.2)
        axes = figure.add_subplot()
        axes.set_position((0.02, 0.0, 0.96, 0.8))
        axes.set_axis_off()
        set_title(figure, title)
        axes.text(0.5, 0.4, "no data", ha="center", va="center", color="#6b7280", transform=axes.transAxes)
        return to_svg(figure, title)


def _level_ticks(axes, xs: Sequence[float], log_x: bool) -> None:
    """Ticks at the levels themselves when there are few of them (concurrencies, context lengths)."""
    distinct = sorted(set(xs))
    if log_x:
        axes.set_xscale("log")
    if 1 <= len(distinct) <= 10:
        axes.xaxis.set_major_locator(FixedLocator(distinct))
        axes.xaxis.set_minor_locator(NullLocator())
    axes.xaxis.set_major_formatter(FuncFormatter(fmt_tick))


def _y_format(axes, percent: bool) -> None:
    axes.yaxis.set_major_formatter(PercentFormatter(xmax=1.0, decimals=None) if percent else FuncFormatter(fmt_tick))


def _shade_band(axes, band: tuple[Optional[float], Optional[float]], label: str) -> None:
    """A band (lo, hi) shaded across the chart; an open side reaches the chart's edge, each finite side a line."""
    lo, hi = (float(v) if finite(v) else None for v in band)
    if lo is None and hi is None:
        return
    bottom, top = axes.get_ylim()
    values = [v for v in (lo, hi) if v is not None]
    bottom, top = min(bottom, *values), max(top, *values)
    margin = 0.05 * (top - bottom or 1.0)
    bottom, top = bottom - (margin if lo is None else 0), top + (margin if hi is None else 0)
    axes.axhspan(lo if lo is not None else bottom, hi if hi is not None else top, color=BAND_COLOR, alpha=0.12,
                 lw=0, label=literal(label), zorder=0)
    for value in values:
        axes.axhline(value, color=BAND_COLOR, lw=1.0, ls="--", zorder=1)
    axes.set_ylim(bottom, top)


# ---------------------------------------------------------------- charts

def line_chart(series: Sequence[Series], title: str, x_label: str, y_label: str, *, log_x: bool = False,
               percent: bool = False, band: Optional[tuple[Optional[float], Optional[float]]] = None,
               band_label: str = "accepted band", markers: Sequence[tuple[float, str]] = (), marker_label: str = "",
               spans: Sequence[tuple[float, float, str]] = (), span_label: str = "left out",
               y_from_zero: bool = True, y_reach: Optional[float] = None) -> str:
    """Lines with points; intervals as error bars; predictions dashed and hollow beside the measured lines.

    `band` (lo, hi; either may be None: a bound) is shaded across the chart; `markers` are dashed
    vertical lines with a label (injected faults), named `marker_label` in the legend; `spans` (x from, x to, label) are
    shaded grey
    from top to bottom (windows left out). `percent`: y values are fractions, shown as percents.
    `y_reach`: the y axis goes at least this high (1.0: a share shown up to 100%).
    """
    clean = []
    for s in series:
        errors = list(s.errors) + [None] * (len(s.points) - len(s.errors))
        kept = sorted((float(x), float(y), e) for (x, y), e in zip(s.points, errors)
                      if finite(x) and finite(y) and (not log_x or x > 0))
        if kept:
            clean.append((s, kept))
    if not clean:
        return empty_chart(title)
    colours = _colours([s.key or s.name for s, _ in clean])
    with style(title):
        figure = new_figure()
        place(figure)
        axes = figure.add_subplot()
        for s, kept in clean:
            colour = colours[s.key or s.name]
            xs, ys = [p[0] for p in kept], [p[1] for p in kept]
            if s.predicted:
                axes.plot(xs, ys, ls="--", lw=1.4, marker="D", ms=5.5, mfc="white", mec=colour, mew=1.4, color=colour,
                          label=literal(s.name), zorder=3)
            else:
                axes.plot(xs, ys, ls="-", lw=1.8, marker="o", ms=4.5, color=colour, label=literal(s.name), zorder=4)
            bars = [(x, y, e) for x, y, e in kept if e is not None and finite(e[0]) and finite(e[1])]
            if bars:
                axes.errorbar([b[0] for b in bars], [b[1] for b in bars],
                              yerr=[[max(b[1] - b[2][0], 0.0) for b in bars], [max(b[2][1] - b[1], 0.0) for b in bars]],
                              fmt="none", ecolor=colour, elinewidth=1.2, capsize=4, zorder=4)
        xs = [x for _, kept in clean for x, _, _ in kept]
        _level_ticks(axes, xs, log_x)
        if y_from_zero:
            axes.set_ylim(bottom=min(0.0, axes.get_ylim()[0]))
        if y_reach is not None:
            axes.set_ylim(top=max(y_reach, axes.get_ylim()[1]))
        if band is not None:
            _shade_band(axes, band, band_label)
        shaded = [(a, b) for a, b, _ in spans if finite(a) and finite(b) and a < b]
        for a, b in shaded:
            axes.axvspan(a, b, color=SPAN_COLOR, alpha=0.15, lw=0, zorder=0)
        extra: list[Artist] = [Patch(color=SPAN_COLOR, alpha=0.15, lw=0, label=literal(span_label))] if shaded else []
        if marker_label and any(finite(at) for at, _ in markers):
            extra.append(Line2D([], [], color=MARKER_COLOR, lw=1.2, ls=(0, (4, 3)), label=literal(marker_label)))
        for at, words in markers:
            if finite(at):
                axes.axvline(at, color=MARKER_COLOR, lw=1.2, ls=(0, (4, 3)), zorder=2)
                axes.annotate(
                    literal(words),
                    (at, 0.02),
                    xycoords=("data", "axes fraction"),
                    xytext=(3, 0),
                    textcoords="offset points",
                    color=MARKER_COLOR,
                    fontsize=7.5,
                    rotation=90,
                    va="bottom",
                    bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.85},
                )
        _y_format(axes, percent)
        set_title(figure, title)
        axes.set_xlabel(literal(x_label))
        axes.set_ylabel(literal(y_label))
        axes.legend(handles=axes.get_legend_handles_labels()[0] + extra, loc="best")
        return to_svg(figure, title)


def _wrapped(label: str, width: int) -> str:
    lines = textwrap.wrap(label, width, break_long_words=True, break_on_hyphens=False) or [label]
    return "\n".join(lines[:3]) + ("…" if len(lines) > 3 else "")


def bar_chart(bars: Sequence[Bar], title: str, unit: str, *, reference_label: str = "spec",
              line: Optional[tuple[float, str]] = None, log: bool = False, horizontal: bool = False) -> str:
    """Bars (coloured by verdict when given) with a reference line across each bar that has one, and
    `line` (value, label) across the whole chart. `horizontal` suits long labels; `log` a wide range."""
    bars = [b for b in bars if finite(b.value) and (not log or b.value > 0)]
    if not bars:
        return empty_chart(title)
    statuses = [b.status.upper() for b in bars]
    with style(title):
        height = max(HEIGHT_IN, 1.2 + 0.38 * len(bars)) if horizontal else HEIGHT_IN
        figure = new_figure(height=height)
        axes = figure.add_subplot()  # placed below, once its labels are known
        positions = list(range(len(bars)))
        colours = [STATUS_COLORS.get(s, PALETTE[0]) for s in statuses]
        labels = [literal(b.label) for b in bars]
        values = [b.value for b in bars if b.value is not None]   # every one: the bars left are finite
        if horizontal:
            names = [_wrapped(t, 40) for t in labels]
            place(figure, left=text_width_in(names, STYLE["font.size"]) + 0.3)
            drawn = axes.barh(positions, values, color=colours, height=0.6, zorder=3)
            axes.set_yticks(positions, names)
            axes.invert_yaxis()
            axes.grid(axis="y", visible=False)
        else:
            names = [_wrapped(t, max(6, 70 // len(bars))) for t in labels]
            place(figure, bottom=0.3 + 0.16 * max(n.count("\n") + 1 for n in names))
            drawn = axes.bar(positions, values, color=colours, width=0.6, zorder=3)
            axes.set_xticks(positions, names)
            axes.grid(axis="x", visible=False)
        axes.bar_label(drawn, labels=[fmt_tick(v) for v in values], padding=2, fontsize=7.5)
        references = [(i, b.reference) for i, b in enumerate(bars) if finite(b.reference)]
        for i, value in references:
            if horizontal:
                axes.vlines(value, i - 0.42, i + 0.42, color=REFERENCE_COLOR, lw=2.4, zorder=4)
            else:
                axes.hlines(value, i - 0.42, i + 0.42, color=REFERENCE_COLOR, lw=2.4, zorder=4)
        extra: list[Artist] = (
            [Line2D([], [], color=REFERENCE_COLOR, lw=2.4, label=literal(reference_label))] if references else []
        )
        if line is not None and finite(line[0]):
            (axes.axvline if horizontal else axes.axhline)(line[0], color=REFERENCE_COLOR, lw=1.2, ls="--",
                                                           label=literal(line[1]), zorder=2)
        value_axis = axes.xaxis if horizontal else axes.yaxis
        if log:
            (axes.set_xscale if horizontal else axes.set_yscale)("log")
        value_axis.set_major_formatter(FuncFormatter(fmt_tick))
        extra += [Patch(color=STATUS_COLORS[s], label=s) for s in dict.fromkeys(statuses) if s in STATUS_COLORS]
        set_title(figure, title)
        (axes.set_xlabel if horizontal else axes.set_ylabel)(literal(unit))
        handles = axes.get_legend_handles_labels()[0] + extra
        if handles:
            axes.legend(handles=handles, loc="best")
        return to_svg(figure, title)


def dot_chart(dots: Sequence[Dot], title: str, x_label: str, *, percent: bool = False) -> str:
    """One row per figure: measured (filled, with its interval), predicted (hollow) and the threshold (a tick)."""
    dots = [d for d in dots if finite(d.measured) or finite(d.predicted)]
    if not dots:
        return empty_chart(title)
    with style(title):
        figure = new_figure(height=max(2.2, 1.3 + 0.5 * len(dots)))
        names = [_wrapped(literal(d.label), 34) for d in dots]
        place(figure, left=text_width_in(names, STYLE["font.size"]) + 0.3)
        axes = figure.add_subplot()
        for row, dot in enumerate(dots):
            colour = STATUS_COLORS.get(dot.status.upper(), PALETTE[0])
            if finite(dot.measured):
                error = None
                if dot.interval and finite(dot.interval[0]) and finite(dot.interval[1]):
                    error = [[max(dot.measured - dot.interval[0], 0.0)], [max(dot.interval[1] - dot.measured, 0.0)]]
                axes.errorbar([dot.measured], [row], xerr=error, fmt="o", ms=7, color=colour, ecolor=colour,
                              capsize=4, zorder=4)
            if finite(dot.predicted):
                axes.plot([dot.predicted], [row], ls="none", marker="D", ms=7, mfc="white", mec=PALETTE[3], mew=1.6,
                          zorder=5)
            if finite(dot.threshold):
                axes.plot(
                    [dot.threshold], [row], ls="none", marker="|", ms=18, mew=2.2, color=REFERENCE_COLOR, zorder=3
                )
        legend = [Line2D([], [], ls="none", marker="o", ms=7, color="#6b7280",
                         label="measured, 95% interval (coloured by verdict)")]
        if any(finite(d.predicted) for d in dots):
            legend.append(Line2D([], [], ls="none", marker="D", ms=7, mfc="white", mec=PALETTE[3], mew=1.6,
                                 label="predicted before the gate"))
        if any(finite(d.threshold) for d in dots):
            legend.append(
                Line2D([], [], ls="none", marker="|", ms=12, mew=2.2, color=REFERENCE_COLOR, label="threshold")
            )
        axes.set_yticks(range(len(dots)), names)
        axes.set_ylim(len(dots) - 0.5, -0.5)
        axes.grid(axis="y", visible=False)
        axes.xaxis.set_major_formatter(
            PercentFormatter(xmax=1.0, decimals=None) if percent else FuncFormatter(fmt_tick)
        )
        axes.set_xlim(left=min(0.0, axes.get_xlim()[0]))
        set_title(figure, title)
        axes.set_xlabel(literal(x_label))
        axes.legend(handles=legend, loc="best")
        return to_svg(figure, title)


def cdf_steps(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """The empirical CDF of `values` as (x, F(x)) steps: the k-th smallest value at k / n. Above
    MAX_CDF_STEPS values the curve is drawn through evenly spaced order statistics (the last included)."""
    ordered = sorted(float(v) for v in values if finite(v))
    n = len(ordered)
    picks: Sequence[int]
    if n <= MAX_CDF_STEPS:
        picks = range(n)
    else:
        picks = sorted({round(i * (n - 1) / (MAX_CDF_STEPS - 1)) for i in range(MAX_CDF_STEPS)})
    return [ordered[i] for i in picks], [(i + 1) / n for i in picks]


def cdf_chart(panels: Sequence[Panel], title: str, x_label: str, *, log_x: Optional[bool] = None,
              columns: int = 3) -> str:
    """Empirical CDFs: one panel per level, one line per target, each labelled with its number of values.
    `log_x` None: logarithmic when the values span 10× or more."""
    panels = [p for p in panels if any(any(finite(v) for v in d.values) for d in p.distributions)]
    if not panels:
        return empty_chart(title)
    everything = [float(v) for p in panels for d in p.distributions for v in d.values if finite(v)]
    if log_x is None:
        positive = [v for v in everything if v > 0]
        log_x = bool(positive) and len(positive) == len(everything) and max(positive) / min(positive) >= 10
    colours = _colours([d.key or d.name for p in panels for d in p.distributions])
    columns = max(1, min(columns, len(panels)))
    rows = -(-len(panels) // columns)
    with style(title):
        figure = new_figure(height=0.8 + 2.7 * rows, width=WIDE_IN)
        place(figure, left=0.8, top=0.6, wspace=0.06, hspace=0.45)
        grid = figure.subplots(rows, columns, sharex=True, sharey=True, squeeze=False)
        for index, axes in enumerate(grid.flat):
            if index >= len(panels):
                axes.set_visible(False)
                continue
            panel = panels[index]
            for d in panel.distributions:
                xs, ys = cdf_steps(d.values)
                if xs:
                    axes.step(xs, ys, where="post", lw=1.6, color=colours[d.key or d.name],
                              label=literal(f"{d.name} (n={sum(1 for v in d.values if finite(v))})"))
            if log_x:
                axes.set_xscale("log")
            axes.xaxis.set_major_formatter(FuncFormatter(fmt_tick))
            axes.xaxis.set_minor_formatter(FuncFormatter(lambda v, _p: ""))
            axes.set_ylim(0, 1.02)
            axes.yaxis.set_major_locator(FixedLocator([0, 0.25, 0.5, 0.75, 0.9, 0.99]))
            axes.yaxis.set_major_formatter(PercentFormatter(xmax=1.0, decimals=0))
            axes.set_title(literal(panel.title), fontsize=9.5)
            axes.legend(loc="lower right", fontsize=7.0)
            if index % columns == 0:
                axes.set_ylabel("share of requests ≤ x")
            if index >= len(panels) - columns:
                axes.set_xlabel(literal(x_label))
        set_title(figure, title)
        return to_svg(figure, title, wide=True)
