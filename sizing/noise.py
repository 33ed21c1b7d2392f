"""The measurement's own noise beside the model's error: how far each compared figure's own samples (G2's rounds,
G3's measured blocks) lie from the figure they make, as a mean relative deviation. A model error within it is
within what the gate itself repeats to on this machine's minute; said beside each accuracy line, never judged.

How it works: docs/methods/sizing-model.md (sizing/noise.py).
"""

from __future__ import annotations

import math
import statistics
from typing import Iterable, Optional

from kvcore.predictions import same_place

# A compared figure's samples: (gate, its metric) -> (the rows' metric, where a row holds the sample's value:
# "value", or a key of its context)
SAMPLES = {("g2", "ttft_ms"): ("ttft_round_ms", "value"),
           ("g3", "output_tokens_per_s"): ("g3_block", "output_tokens_per_s"),
           ("g3", "ttft_p50_ms"): ("g3_block", "ttft_p50_ms")}


def samples(measurements: Iterable[dict], prediction: dict) -> list[float]:
    """The values the gate made `prediction`'s figure of: G2's rounds of a TTFT, G3's measured blocks of a step
    (its warm-up pairs are not recorded as blocks; a block recorded invalid is left out); [] for other figures."""
    found = SAMPLES.get((str(prediction.get("gate")), str(prediction.get("metric"))))
    if found is None:
        return []
    metric, key = found
    wanted = {**prediction, "metric": metric}
    values = []
    for row in measurements:
        context = row.get("context") or {}
        if not same_place(wanted, row) or context.get("valid") is False:
            continue
        value = row.get("value") if key == "value" else context.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            values.append(float(value))
    return values


def spread(values: list[float], figure: float) -> Optional[float]:
    """The mean |sample − figure| / figure of a figure's samples; None with under two samples or no figure."""
    if len(values) < 2 or not figure:
        return None
    return statistics.fmean(abs(v - figure) for v in values) / abs(figure)


def group_spread(rows: list[dict]) -> Optional[float]:
    """The mean of the compared rows' spreads (`spread` of each row's samples), None when no row has one."""
    found = [r["spread"] for r in rows if r.get("spread") is not None]
    return statistics.fmean(found) if found else None
