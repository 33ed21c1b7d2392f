"""The report's chart primitives (reports/plots.py): inline, offline, deterministic SVG drawn by matplotlib."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from reports import plots
from reports.plots import Bar, Distribution, Dot, Panel, Series


def texts(chart: str) -> list[str]:
    return ["".join(t.itertext()) for t in ET.fromstring(chart).iter("text")]


def test_a_chart_is_inline_svg_with_its_title_and_nothing_that_reaches_out():
    chart = plots.line_chart([Series("tiered", [(1, 10), (4, 30)])], "G3 <TTFT> & p50", "concurrency", "ms")
    root = ET.fromstring(chart)                      # well-formed, no namespace needed
    assert root.tag == "svg" and "chart" in root.get("class")
    assert root.find("title").text == "G3 <TTFT> & p50" and root.get("aria-label") == "G3 <TTFT> & p50"
    for forbidden in ("http", "xmlns", "xlink", "<script", "<?xml", "DOCTYPE", "<metadata", "<style"):
        assert forbidden not in chart
    assert "G3 <TTFT> & p50" in texts(chart)         # the title is text, found by search, not glyph paths


def test_user_strings_are_escaped_and_never_read_as_mathtext_or_hidden():
    chart = plots.line_chart([Series("a<b & $x$", [(1, 1), (2, 2)]), Series("_private", [(1, 2), (2, 3)])],
                             "t", "x", "y")
    assert "a&lt;b &amp; $x$" in chart               # escaped by the SVG writer, dollars literal (no math)
    assert " _private" in texts(chart)               # a leading underscore would hide it from the legend


def test_the_same_data_draws_the_same_bytes_and_two_titles_never_share_an_id():
    series = [Series("a", [(1, 1), (2, 4)], errors=[(0.5, 1.5), None])]
    first, again = plots.line_chart(series, "one", "x", "y"), plots.line_chart(series, "one", "x", "y")
    other = plots.line_chart(series, "two", "x", "y")
    assert first == again
    ids = set(re.findall(r'id="([^"]+)"', first))
    assert ids and not ids & set(re.findall(r'id="([^"]+)"', other))
    assert set(re.findall(r'href="#([^"]+)"', first)) <= ids     # every reference resolves inside its chart


def test_a_prediction_is_dashed_with_hollow_markers_beside_its_measured_line():
    chart = plots.line_chart([Series("candidate", [(2, 30), (4, 40)]),
                              Series("candidate (predicted)", [(2, 33), (4, 44)], predicted=True, key="candidate")],
                             "t", "c", "ms")
    assert {"candidate", "candidate (predicted)"} <= set(texts(chart))
    assert "stroke-dasharray" in chart and "fill: #ffffff; stroke: #2563eb" in chart   # hollow, same colour


def test_intervals_are_error_bars_and_a_bound_is_shaded_to_the_edge():
    chart = plots.line_chart([Series("reduction", [(2, 0.8), (4, 0.9)], errors=[(0.7, 0.85), (0.88, 0.93)])],
                             "t", "c", "reduction", percent=True, band=(0.25, None), band_label="passes")
    assert "passes" in texts(chart) and "80%" in texts(chart)       # fractions shown as percents
    caps = re.findall(r'<use href="#(m[0-9a-f]+)"', chart)
    assert len(caps) >= 2 * 2 + 2                                    # two caps per interval, plus the points


def test_bars_are_coloured_by_verdict_with_the_reference_in_the_legend():
    chart = plots.bar_chart([Bar("seq read", 1.5, 1.0, "PASS"), Bar("seq write", 0.4, 1.0, "FAIL")], "spec",
                            "GB/s", reference_label="the spec")
    words = texts(chart)
    assert {"PASS", "FAIL", "the spec", "seq read", "seq write", "1.5", "0.4"} <= set(words)
    assert plots.STATUS_COLORS["PASS"] in chart and plots.STATUS_COLORS["FAIL"] in chart


def test_a_dot_chart_lists_predicted_and_threshold_only_when_it_has_them():
    both = plots.dot_chart([Dot("disk hit / recompute", 0.075, (0.07, 0.08), 0.06, 0.25, "PASS")], "d", "ratio",
                           percent=True)
    bare = plots.dot_chart([Dot("cold read / fio", 0.86, (0.74, 0.97))], "d2", "ratio")
    assert {"predicted before the gate", "threshold"} <= set(texts(both))
    assert not {"predicted before the gate", "threshold"} & set(texts(bare))


def test_cdf_steps_put_the_kth_smallest_value_at_k_over_n():
    assert plots.cdf_steps([3.0, 1.0, 2.0]) == ([1.0, 2.0, 3.0], [1 / 3, 2 / 3, 1.0])
    xs, ys = plots.cdf_steps(list(range(1000)))      # drawn through 200 order statistics, both ends kept
    assert len(xs) == plots.MAX_CDF_STEPS and (xs[0], ys[0]) == (0, 1 / 1000) and (xs[-1], ys[-1]) == (999, 1.0)


def test_a_cdf_chart_has_a_panel_per_level_and_says_how_many_values_each_line_holds():
    chart = plots.cdf_chart([Panel("c=2", [Distribution("baseline", [300, 320, 310]),
                                           Distribution("candidate", [30.0] * 7)]),
                             Panel("c=4", [Distribution("baseline", [400, 420])])], "TTFT CDF", "TTFT (ms)")
    words = texts(chart)
    assert {"c=2", "c=4", "baseline (n=3)", "candidate (n=7)", "baseline (n=2)", "TTFT CDF"} <= set(words)
    assert 'class="chart wide"' in chart


def test_charts_without_data_say_so():
    for chart in (plots.line_chart([Series("x", [])], "empty", "x", "y"), plots.bar_chart([], "e", "GB/s"),
                  plots.cdf_chart([Panel("c=1", [Distribution("a", [])])], "e", "ms"), plots.dot_chart([], "e", "r")):
        assert "no data" in texts(chart)


def test_tick_numbers_are_compact():
    assert [plots.fmt_tick(v) for v in (4096, 131072, 25_000, 1.5e6, 0.25, 3, 0)] == \
        ["4k", "128k", "25k", "1.5M", "0.25", "3", "0"]
