"""Fractions written as percentages: every figure kvgate keeps as a fraction (0.312) and shows as 31.2%."""

from __future__ import annotations


def format_percent(fraction: float, decimals: int = 1, *, trim: bool = False, signed: bool = False,
                   symbol: bool = True) -> str:
    """`fraction` as a percentage: 0.312 -> "31.2%".

    `trim` drops trailing zeros (0.25 with 2 decimals -> "25%", a rule's number); `signed` puts "+" before
    a figure that is not negative (a gain, a prediction's error); `symbol=False` leaves out the "%" (an
    interval's ends, "[27.9, 34.0]"). A figure that rounds to zero reads 0.0, never -0.0.
    """
    text = f"{100 * fraction:.{decimals}f}"
    if trim and "." in text:
        text = text.rstrip("0").rstrip(".")
    if text.startswith("-") and float(text) == 0:
        text = text[1:]
    if signed and not text.startswith("-"):
        text = "+" + text
    return text + ("%" if symbol else "")
