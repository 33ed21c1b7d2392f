"""A measured figure beside what the sizing model predicted for it, and the error between them.

How it works: docs/methods/sizing-model.md (kvcore/predictions.py).
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

from .judged import judged, not_judged_reason
from .percent import format_percent
from .rundata import finite_number

CONTEXT_KEYS = ("concurrency", "multiplier", "context_tokens", "target", "mode")
IN_POINTS = ("hit_ratio", "ttft_p50_reduction", "throughput_gain", "sustained_rate_gain", "cold_read_vs_storage_best",
             "cross_node_hit_ratio")
IN_MAPE = ("ttft_p50_ms", "output_tokens_per_s", "disk_hit_ttft_vs_recompute", "ttft_ms")


def same_place(prediction: dict, row: dict) -> bool:
    """The prediction is of `row`'s figure: same metric, and each place key the prediction names agrees."""
    if prediction.get("metric") != row.get("metric"):
        return False
    mine, theirs = prediction.get("context") or {}, row.get("context") or {}
    return all(theirs.get(key) == mine[key] for key in CONTEXT_KEYS if key in mine)


def made_before(predictions: Iterable[dict], gate: str) -> list[dict]:
    """The predictions made before `gate` ran, for its figures (stage "before <gate>")."""
    return [p for p in predictions if p.get("gate") == gate and p.get("stage") == f"before {gate}"]


def prediction_for(row: dict, predictions: Iterable[dict]) -> Optional[dict]:
    """The latest prediction made before `row`'s gate of `row`'s figure (a verdict or a measurement)."""
    found = [p for p in made_before(predictions, str(row.get("gate"))) if same_place(p, row)]
    return found[-1] if found else None


def error(metric: str, predicted: float, measured: float) -> tuple[float, str]:
    """The error of a prediction and its words: "+3.0 points" or "-12.5%" (the module's rule)."""
    if metric in IN_POINTS:
        difference = predicted - measured
        return difference, format_percent(difference, signed=True, symbol=False) + " points"
    if not measured:  # a capacity of 0: exact when predicted so, else no relative error
        return (
            (0.0, format_percent(0.0, signed=True)) if not predicted else (math.nan, "no relative error (measured 0)")
        )
    relative = (predicted - measured) / measured
    return relative, format_percent(relative, signed=True)


def beside(row: dict, predictions: Iterable[dict]) -> Optional[dict]:
    """What a verdict or measurement `row` shows of its prediction, or None when it has none:
    {"predicted", "predicted_status", "error", "error_text"}. A verdict whose figure was not judged
    (INCONCLUSIVE: invalid or undecided, kvcore.judged) shows its prediction with no error: error None,
    error_text saying why it is not compared."""
    prediction = prediction_for(row, predictions)
    if prediction is None:
        return None
    value, measured = finite_number(prediction.get("value")), finite_number(row.get("value"))
    if value is None:
        return None
    shown = {"predicted": value, "predicted_status": str(prediction.get("status") or "")}
    if "status" in row and not judged(row):
        return {**shown, "error": None, "error_text": f"not compared ({not_judged_reason(row)})"}
    if measured is None:
        return None
    err, text = error(str(row.get("metric")), value, measured)
    return {**shown, "error": err, "error_text": text}


def format_figure(value: Optional[float], unit: str, signed: bool = False) -> str:
    """A figure as the report's tables and the console show it (a claim, a prediction, a measurement):
    31.2%, 13.3×, 1.21 GB/s, 1,360 ms; `signed`: with its sign (+43.2 MiB/h, -1,840 MiB/h)."""
    if value is None:
        return ""
    if unit == "%":
        return format_percent(value)
    if unit == "×":
        return f"{value:.1f}×"
    sign = "+" if signed else ""
    rounded = float(f"{value:.3g}")      # three significant figures, never an exponent: 1,360 ms, not 1.36e+03 ms
    return (f"{rounded:{sign},.0f} {unit}" if abs(rounded) >= 1000 else f"{value:{sign}.3g} {unit}").rstrip()


def beside_text(shown: dict, unit: str) -> str:
    """`beside`'s figures in words: "predicted 84.9% (PASS), error +2.2 points" (or "…, not compared (invalid:
    …)")."""
    status = f" ({shown['predicted_status']})" if shown.get("predicted_status") else ""
    error_words = f"error {shown['error_text']}" if shown.get("error") is not None else shown["error_text"]
    return f"predicted {format_figure(shown['predicted'], unit)}{status}, {error_words}"
