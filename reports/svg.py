"""Small charts as inline SVG strings for the self-contained report.

Pure functions: data in, SVG text out. No scripts, no external references, no `xmlns`
URL (inline SVG in HTML needs none), every label escaped. Each chart carries a
<title> for screen readers and per-point <title> tooltips.
"""

from __future__ import annotations

import math
from html import escape
from typing import Optional, Sequence, Union

WIDTH, HEIGHT = 640, 340
LEFT, RIGHT, BOTTOM = 70, 18, 58
FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, 'Helvetica Neue', Arial, sans-serif"
PALETTE = ("#2563eb", "#ea580c", "#059669", "#7c3aed", "#db2777", "#0891b2", "#65a30d", "#64748b")
STATUS_FILL = {"PASS": "#16a34a", "FAIL": "#dc2626", "INCONCLUSIVE": "#d97706"}
SPEC_COLOR, MARKER_COLOR, BAND_FILL, SPAN_FILL = "#111827", "#b91c1c", "#16a34a", "#6b7280"
CHAR_W = 6.8  # average width of a 13 px glyph, for layout estimates

Point = tuple[float, float]


def _t(text: object) -> str:
    return escape(str(text), quote=True)


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def fmt_tick(value: float) -> str:
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


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values (1, 2, 2.5, 5 × 10^k) covering [lo, hi]."""
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [round(i * step, 12) for i in range(first, last + 1)]


def _open(title: str, height: int, legend: list[tuple[str, str, str]]) -> list[str]:
    parts = [
        (f'<svg class="chart" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" height="{height}" role="img" '
         f'aria-label="{_t(title)}" font-family="{_t(FONT)}" font-size="13">'),
        f"<title>{_t(title)}</title>",
        f'<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="#ffffff"/>',
        f'<text x="{LEFT}" y="20" font-size="15" font-weight="600" fill="#111827">{_t(title)}</text>',
    ]
    parts += _legend(legend)
    return parts


def _legend_rows(legend: list[tuple[str, str, str]]) -> list[list[tuple[float, tuple[str, str, str]]]]:
    rows, row, x = [], [], LEFT
    for entry in legend:
        width = 26 + CHAR_W * len(entry[0]) + 18
        if row and x + width > WIDTH - RIGHT:
            rows.append(row)
            row, x = [], LEFT
        row.append((x, entry))
        x += width
    return rows + [row] if row else rows


def _legend(legend: list[tuple[str, str, str]]) -> list[str]:
    """Entries are (label, colour, kind) with kind one of: line, bar, spec, band, marker."""
    parts = []
    for r, row in enumerate(_legend_rows(legend)):
        y = 38 + 18 * r
        for x, (label, colour, kind) in row:
            if kind in ("bar", "band"):
                opacity = ' fill-opacity="0.18"' if kind == "band" else ""
                parts.append(f'<rect x="{x}" y="{y - 6}" width="18" height="10" fill="{colour}"{opacity}/>')
            else:
                dash = ' stroke-dasharray="4 3"' if kind == "marker" else ""
                parts.append(f'<line x1="{x}" y1="{y - 1}" x2="{x + 18}" y2="{y - 1}" stroke="{colour}" '
                             f'stroke-width="{3 if kind == "spec" else 2}"{dash}/>')
            parts.append(f'<text x="{x + 24}" y="{y + 3}" fill="#374151">{_t(label)}</text>')
    return parts


def _top(legend: list[tuple[str, str, str]]) -> int:
    return 34 + 18 * max(1, len(_legend_rows(legend))) + 10


def _y_axis(ticks: list[float], y_of, top: int, bottom: int, label: str) -> list[str]:
    parts = []
    for tick in ticks:
        y = y_of(tick)
        parts.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" stroke="#e5e7eb"/>')
        parts.append(f'<text x="{LEFT - 8}" y="{y + 4:.1f}" text-anchor="end" fill="#4b5563">{fmt_tick(tick)}</text>')
    middle = (top + bottom) / 2
    parts.append(f'<text x="16" y="{middle:.1f}" transform="rotate(-90 16 {middle:.1f})" text-anchor="middle" '
                 f'fill="#374151">{_t(label)}</text>')
    parts.append(f'<line x1="{LEFT}" y1="{bottom}" x2="{WIDTH - RIGHT}" y2="{bottom}" stroke="#9ca3af"/>')
    parts.append(f'<line x1="{LEFT}" y1="{top}" x2="{LEFT}" y2="{bottom}" stroke="#9ca3af"/>')
    return parts


def _empty(title: str) -> str:
    parts = _open(title, 120, [])
    parts.append(f'<text x="{WIDTH / 2}" y="80" text-anchor="middle" fill="#6b7280">no data</text></svg>')
    return "".join(parts)


def _wrap(label: str, chars: int) -> list[str]:
    """Up to two lines of at most `chars` characters; the rest is cut with an ellipsis."""
    words, lines, current = label.split(), [], ""
    for word in words:
        candidate = f"{current} {word}".strip()
        if len(candidate) <= chars or not current:
            current = candidate
        else:
            lines.append(current)
            current = word
    lines.append(current)
    lines = [line if len(line) <= chars else line[: max(1, chars - 1)] + "…" for line in lines]
    if len(lines) > 2:
        lines = [lines[0], lines[1][: max(1, chars - 1)] + "…"]
    return lines


def bar_chart(bars: Sequence[tuple[str, float]], lines: Sequence[tuple[Union[str, int], float]], title: str,
              unit: str, *, statuses: Optional[Sequence[str]] = None, line_label: str = "spec") -> str:
    """Vertical bars of measured values with reference lines (the spec, or fio beside each bar).

    A line keyed by a bar's index (or its label) is drawn across that bar only; any
    other key draws a labelled line across the whole chart. `statuses` (PASS, FAIL,
    INCONCLUSIVE per bar) colours the bars; `line_label` names the lines in the legend.
    """
    bars = [(str(label), float(value)) for label, value in bars if _finite(value)]
    if not bars:
        return _empty(title)
    labels = [label for label, _ in bars]
    per_bar: dict[int, float] = {}
    global_lines: list[tuple[str, float]] = []
    for key, value in lines:
        if not _finite(value):
            continue
        if isinstance(key, int) and not isinstance(key, bool) and 0 <= key < len(bars):
            per_bar[key] = float(value)
        elif isinstance(key, str) and key in labels:
            per_bar[labels.index(key)] = float(value)
        else:
            global_lines.append((str(key), float(value)))
    colours = [STATUS_FILL.get(str(s).upper(), PALETTE[0]) for s in statuses] if statuses else [PALETTE[0]] * len(bars)
    colours += [PALETTE[0]] * (len(bars) - len(colours))
    legend = ([(s, STATUS_FILL[s], "bar") for s in STATUS_FILL if statuses and s in {str(x).upper() for x in statuses}]
              or [("measured", PALETTE[0], "bar")])
    if per_bar or global_lines:
        legend.append((line_label, SPEC_COLOR, "spec"))
    top, bottom = _top(legend), HEIGHT - BOTTOM
    values = [v for _, v in bars] + list(per_bar.values()) + [v for _, v in global_lines]
    ticks = nice_ticks(min(0.0, *values), max(0.0, *values))
    lo, hi = ticks[0], ticks[-1]

    def y_of(v: float) -> float:
        return bottom - (v - lo) / (hi - lo) * (bottom - top)

    parts = _open(title, HEIGHT, legend) + _y_axis(ticks, y_of, top, bottom, unit)
    slot = (WIDTH - RIGHT - LEFT) / len(bars)
    width = min(slot * 0.6, 90)
    chars = max(4, int(slot / CHAR_W))
    for i, (label, value) in enumerate(bars):
        centre = LEFT + slot * (i + 0.5)
        y0, y1 = sorted((y_of(0.0), y_of(value)))
        tip = f"{label}: {fmt_tick(value)} {unit}".strip()
        if i in per_bar:
            tip += f" ({line_label} {fmt_tick(per_bar[i])})"
        parts.append(f'<rect x="{centre - width / 2:.1f}" y="{y0:.1f}" width="{width:.1f}" '
                     f'height="{max(y1 - y0, 0.5):.1f}" fill="{colours[i]}" rx="2"><title>{_t(tip)}</title></rect>')
        parts.append(f'<text x="{centre:.1f}" y="{min(y0, y1) - 4:.1f}" text-anchor="middle" fill="#111827" '
                     f'font-size="11">{fmt_tick(value)}</text>')
        if i in per_bar:
            y = y_of(per_bar[i])
            half = min(slot * 0.42, width / 2 + 12)
            parts.append(f'<line x1="{centre - half:.1f}" y1="{y:.1f}" x2="{centre + half:.1f}" y2="{y:.1f}" '
                         f'stroke="{SPEC_COLOR}" stroke-width="3"><title>{_t(line_label)} {fmt_tick(per_bar[i])}</title></line>')
        for row, text in enumerate(_wrap(label, chars)):
            parts.append(f'<text x="{centre:.1f}" y="{bottom + 16 + 13 * row}" text-anchor="middle" fill="#374151">'
                         f"{_t(text)}<title>{_t(label)}</title></text>")
    for label, value in global_lines:
        y = y_of(value)
        parts.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" stroke="{SPEC_COLOR}" '
                     f'stroke-width="2" stroke-dasharray="6 3"/>')
        parts.append(f'<text x="{WIDTH - RIGHT - 4}" y="{y - 4:.1f}" text-anchor="end" '
                     f'fill="{SPEC_COLOR}">{_t(label)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def line_chart(series: dict[str, Sequence[Point]], title: str, x_label: str, y_label: str,
               band: Optional[tuple[Optional[float], Optional[float]]] = None,
               markers: Optional[Sequence[tuple[float, str]]] = None, *, log_x: bool = False,
               band_label: str = "band", spans: Optional[Sequence[tuple[float, float, str]]] = None,
               span_label: str = "left out") -> str:
    """One line per series with points; `band` (lo, hi; either may be None) is shaded
    across the chart, `markers` are dashed vertical lines with labels (e.g. injected faults),
    `spans` (x from, x to, label) are shaded in grey from top to bottom (e.g. windows left out)."""
    clean = {str(name): sorted((float(x), float(y)) for x, y in points
                               if _finite(x) and _finite(y) and (not log_x or x > 0))
             for name, points in series.items()}
    clean = {name: points for name, points in clean.items() if points}
    markers = [(float(x), str(label)) for x, label in (markers or []) if _finite(x) and (not log_x or x > 0)]
    spans = [(float(a), float(b), str(label)) for a, b, label in (spans or [])
             if _finite(a) and _finite(b) and a < b and (not log_x or a > 0)]
    if not clean:
        return _empty(title)
    band_lo, band_hi = band if band else (None, None)
    band_lo = float(band_lo) if _finite(band_lo) else None
    band_hi = float(band_hi) if _finite(band_hi) else None
    has_band = band_lo is not None or band_hi is not None
    legend = [(name, PALETTE[i % len(PALETTE)], "line") for i, name in enumerate(clean)]
    if has_band:
        legend.append((band_label, BAND_FILL, "band"))
    if markers:
        legend.append(("fault" if len(markers) == 1 else "faults", MARKER_COLOR, "marker"))
    if spans:
        legend.append((span_label, SPAN_FILL, "band"))
    top, bottom = _top(legend), HEIGHT - BOTTOM

    xs = ([x for points in clean.values() for x, _ in points] + [x for x, _ in markers]
          + [x for a, b, _ in spans for x in (a, b)])
    ys = [y for points in clean.values() for _, y in points] + [v for v in (band_lo, band_hi) if v is not None]
    y_ticks = nice_ticks(min(0.0, *ys), max(0.0, *ys))
    y_lo, y_hi = y_ticks[0], y_ticks[-1]
    if log_x:
        x_lo, x_hi = math.log10(min(xs)), math.log10(max(xs))
        distinct = sorted(set(xs) - {x for x, _ in markers} - {x for a, b, _ in spans for x in (a, b)})
        x_ticks = distinct if len(distinct) <= 10 else [10.0 ** k for k in range(math.ceil(x_lo), math.floor(x_hi) + 1)]
        pad = max((x_hi - x_lo) * 0.04, 0.05)
        x_lo, x_hi = x_lo - pad, x_hi + pad
    else:
        x_ticks = nice_ticks(min(xs), max(xs), 6)
        x_lo, x_hi = x_ticks[0], x_ticks[-1]

    def x_of(x: float) -> float:
        position = math.log10(x) if log_x else x
        return LEFT + (position - x_lo) / (x_hi - x_lo) * (WIDTH - RIGHT - LEFT)

    def y_of(y: float) -> float:
        return bottom - (y - y_lo) / (y_hi - y_lo) * (bottom - top)

    parts = _open(title, HEIGHT, legend)
    if has_band:
        y_top = y_of(band_hi if band_hi is not None else y_hi)
        y_bottom = y_of(band_lo if band_lo is not None else y_lo)
        parts.append(f'<rect x="{LEFT}" y="{y_top:.1f}" width="{WIDTH - RIGHT - LEFT}" '
                     f'height="{max(y_bottom - y_top, 0.5):.1f}" fill="{BAND_FILL}" fill-opacity="0.14">'
                     f"<title>{_t(band_label)}</title></rect>")
    for a, b, label in spans:
        parts.append(f'<rect x="{x_of(a):.1f}" y="{top}" width="{max(x_of(b) - x_of(a), 0.5):.1f}" '
                     f'height="{bottom - top}" fill="{SPAN_FILL}" fill-opacity="0.16"><title>{_t(label)}</title></rect>')
    parts += _y_axis(y_ticks, y_of, top, bottom, y_label)
    for tick in x_ticks:
        x = x_of(tick)
        parts.append(f'<line x1="{x:.1f}" y1="{bottom}" x2="{x:.1f}" y2="{bottom + 5}" stroke="#9ca3af"/>')
        parts.append(f'<text x="{x:.1f}" y="{bottom + 18}" text-anchor="middle" '
                     f'fill="#4b5563">{fmt_tick(tick)}</text>')
    parts.append(f'<text x="{(LEFT + WIDTH - RIGHT) / 2:.1f}" y="{HEIGHT - 12}" text-anchor="middle" '
                 f'fill="#374151">{_t(x_label)}</text>')
    for x, label in markers:
        px = x_of(x)
        parts.append(f'<line x1="{px:.1f}" y1="{top}" x2="{px:.1f}" y2="{bottom}" stroke="{MARKER_COLOR}" '
                     f'stroke-width="1.5" stroke-dasharray="4 3"><title>{_t(label)} at {fmt_tick(x)}</title></line>')
    for i, (name, points) in enumerate(clean.items()):
        colour = PALETTE[i % len(PALETTE)]
        path = " ".join(f"{x_of(x):.1f},{y_of(y):.1f}" for x, y in points)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2" '
                     f'stroke-linejoin="round"/>')
        if len(points) <= 60:
            for x, y in points:
                parts.append(f'<circle cx="{x_of(x):.1f}" cy="{y_of(y):.1f}" r="3.5" fill="{colour}">'
                             f"<title>{_t(f'{name}: {fmt_tick(x)}, {fmt_tick(y)}')}</title></circle>")
    for x, label in markers:  # labels last and low (charts start at 0), with a white halo, so lines never cover them
        for halo in (' stroke="#ffffff" stroke-width="3"', ""):
            parts.append(f'<text x="{x_of(x) + 4:.1f}" y="{bottom - 6}" fill="{MARKER_COLOR}" font-size="11"{halo}>'
                         f"{_t(label)}</text>")
    parts.append("</svg>")
    return "".join(parts)
