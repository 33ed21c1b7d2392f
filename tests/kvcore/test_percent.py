"""One way to write a fraction as a percentage, used by verdict reasons, the claims sheet, predictions and reports."""

import math

from kvcore.percent import format_percent


def test_a_fraction_reads_as_a_percentage_with_one_decimal():
    assert format_percent(0.312) == "31.2%"
    assert format_percent(1.0) == "100.0%"
    assert format_percent(0.98765, 0) == "99%"


def test_a_figure_that_rounds_to_zero_reads_zero_not_minus_zero():
    assert format_percent(-0.00001) == "0.0%"
    assert format_percent(-0.00001, signed=True) == "+0.0%"
    assert format_percent(-0.000001, 2, trim=True) == "0%"


def test_trim_drops_trailing_zeros_as_a_rules_number_is_written():
    assert format_percent(0.25, 2, trim=True) == "25%"
    assert format_percent(0.2512, 2, trim=True) == "25.12%"
    assert format_percent(0.295, 2, trim=True) == "29.5%"


def test_signed_marks_gains_and_symbol_false_writes_an_intervals_ends():
    assert format_percent(0.05, signed=True) == "+5.0%"
    assert format_percent(-0.125, signed=True) == "-12.5%"
    assert format_percent(0.279, symbol=False) == "27.9"
    assert format_percent(math.nan, signed=True) == "+nan%"
