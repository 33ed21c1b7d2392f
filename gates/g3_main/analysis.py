"""G3's figures for one concurrency level, from the raw records of the baseline and candidate steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from gates.stats import gain_ci, reduction_ci

THROUGHPUT_WINDOW_S = 2.0


def throughput_windows(records: list[dict], window_s: float = THROUGHPUT_WINDOW_S) -> list[float]:
    """Output tokens per second in consecutive windows of the measured period (by completion time).

    The last, partial window is dropped; a period shorter than one window gives one figure.
    """
    if not records:
        return []
    done = np.array([r["sent_at"] + r["e2e_s"] for r in records])
    tokens = np.array([r["completion_tokens"] or 0 for r in records], dtype=float)
    start = min(r["sent_at"] for r in records)
    edges = np.arange(start, done.max() + window_s, window_s)
    if len(edges) < 2:
        edges = np.array([start, start + window_s])
    sums, _ = np.histogram(done, bins=edges, weights=tokens)
    full = sums[:-1] if len(sums) > 1 else sums
    return list(full / window_s)


@dataclass(frozen=True)
class LevelFigures:
    ttft_reduction: Optional[float]
    ttft_interval: Optional[tuple[float, float]]
    throughput_gain: Optional[float]
    throughput_interval: Optional[tuple[float, float]]
    valid: bool
    invalid_reason: str


def level_figures(baseline: dict, candidate: dict) -> LevelFigures:
    """TTFT p50 reduction (requests) and throughput gain (windows), with bootstrap intervals.

    `baseline` and `candidate` are steps: {"summary": sweep row, "records": measured ok records}.
    An invalid step's reasons (its errors by type among them) reach the verdict, each named by its target.
    """
    reasons = [f"{s['summary'].get('target', role)}: {s['summary']['invalid_reasons']}"
               for role, s in (("baseline", baseline), ("candidate", candidate)) if s["summary"]["invalid_reasons"]]
    valid = bool(baseline["summary"]["valid"] and candidate["summary"]["valid"])
    b_ttft = [r["ttft_s"] for r in baseline["records"] if r["ttft_s"] is not None]
    c_ttft = [r["ttft_s"] for r in candidate["records"] if r["ttft_s"] is not None]
    b_windows, c_windows = throughput_windows(baseline["records"]), throughput_windows(candidate["records"])
    if not (b_ttft and c_ttft and b_windows and c_windows):
        return LevelFigures(None, None, None, None, False, "; ".join(reasons) or "no completed requests in a step")
    reduction, r_interval = reduction_ci(b_ttft, c_ttft)
    gain, g_interval = gain_ci(b_windows, c_windows, statistic=np.mean)
    return LevelFigures(reduction, r_interval, gain, g_interval, valid, "; ".join(reasons))
