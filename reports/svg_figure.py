"""A matplotlib figure as an SVG element to inline in the report: offline, self-contained, deterministic.

How it works: docs/methods/measurement.md (reports/svg_figure.py).
"""

from __future__ import annotations

import hashlib
import io
import re
from contextlib import contextmanager
from html import escape
from typing import Any, Iterator, Sequence

import matplotlib
from matplotlib.backends.backend_svg import FigureCanvasSVG
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.textpath import text_to_path

WIDTH_IN, HEIGHT_IN, WIDE_IN = 7.0, 3.8, 10.5
STYLE: dict[str, Any] = {
    "svg.fonttype": "none",
    "font.family": "sans-serif",
    "font.sans-serif": ["DejaVu Sans", "Arial", "Helvetica"],
    "font.size": 9.0,
    "axes.titlesize": 11.0,
    "axes.titleweight": "bold",
    "axes.titlelocation": "left",
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.edgecolor": "#9ca3af",
    "axes.grid": True,
    "grid.color": "#e5e7eb",
    "grid.linewidth": 0.8,
    "legend.frameon": False,
    "legend.fontsize": 8.0,
    "xtick.color": "#4b5563",
    "ytick.color": "#4b5563",
    "axes.labelcolor": "#374151",
}
# matplotlib's own SVG stylesheet, once in the page's CSS: a <style> inside inline SVG would apply page-wide
CHART_CSS = ".chart * { stroke-linejoin: round; stroke-linecap: butt; }"
NO_METADATA = {"Date": None, "Creator": None, "Format": None, "Type": None}


def literal(text: object) -> str:
    """User text as matplotlib shows it literally: `$` escaped (no mathtext), no leading `_` (legend-hidden)."""
    words = str(text).replace("$", r"\$")
    return " " + words if words.startswith("_") else words


@contextmanager
def style(title: str) -> Iterator[None]:
    """Draw and write a chart under the report's style, its SVG ids salted with its title."""
    salt = hashlib.blake2b(title.encode(), digest_size=6).hexdigest()
    rc: dict[Any, Any] = {**STYLE, "svg.hashsalt": salt}
    with matplotlib.rc_context(rc):
        yield


def new_figure(height: float = HEIGHT_IN, width: float = WIDTH_IN) -> Figure:
    figure = Figure(figsize=(width, height))
    FigureCanvasSVG(figure)
    return figure


def place(figure: Figure, left: float = 0.85, bottom: float = 0.55, top: float = 0.4, right: float = 0.2,
           **spacing: float) -> None:
    """The axes' margins in inches (why fixed ones: docs/methods/measurement.md)."""
    width, height = figure.get_size_inches()
    figure.subplots_adjust(left=left / width, right=1 - right / width, bottom=bottom / height, top=1 - top / height,
                           **spacing)


def set_title(figure: Figure, title: str) -> None:
    """The chart's title at the figure's top left (not the axes': long category labels push those right)."""
    height = figure.get_size_inches()[1]
    figure.suptitle(literal(title), x=0.012, y=1 - 0.07 / height, ha="left", va="top", fontsize=11, fontweight="bold")


def text_width_in(labels: Sequence[str], size: float) -> float:
    """The widest line of `labels` in inches, by the font's metrics (no drawing)."""
    font = FontProperties(family=STYLE["font.family"], size=size)
    widths = [text_to_path.get_text_width_height_descent(line, font, ismath=False)[0]
              for label in labels for line in label.split("\n") if line]
    return max(widths, default=0.0) / 72.0


def to_svg(figure: Figure, title: str, wide: bool = False) -> str:
    """The figure as an inline <svg> element (what is removed and why: docs/methods/measurement.md);
    `wide`: the page gives it a whole row."""
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", metadata=NO_METADATA)
    text = buffer.getvalue()
    text = text[text.index("<svg"):]
    text = re.sub(r'\s+xmlns(:\w+)?="[^"]*"', "", text)
    text = text.replace("xlink:href=", "href=")
    text = re.sub(r"<metadata>.*?</metadata>\s*", "", text, flags=re.S)
    text = re.sub(r"<defs>\s*<style[^>]*>[^<]*</style>\s*</defs>\s*", "", text)  # page-wide in HTML: CHART_CSS
    text = re.sub(r"<script\b.*?</script>", "", text, flags=re.S | re.I)
    referenced = set(re.findall(r'(?:href="#|url\(#)([^")]+)', text))
    text = re.sub(r'(<[a-zA-Z][^<>]*?)\s+id="([^"]+)"',
                  lambda m: m.group(0) if m.group(2) in referenced else m.group(1), text)
    opening = text.index(">") + 1
    classes = "chart wide" if wide else "chart"
    head = text[:opening].replace("<svg", f'<svg class="{classes}" role="img" aria-label="{escape(title)}"', 1)
    return f"{head}\n <title>{escape(title)}</title>{text[opening:]}".strip()


