"""A/A runs (`kvgate run --aa`): a subject against itself, and the harness's own false decisions.

G3 records one `g3_aa_false_decision` measurement per judged check (`judged`, per level: TTFT p50 reduction,
throughput gain), with the candidate as its own baseline; the null is 0 (no reduction, no gain). G2
records one `g2_aa_false_decision` per side-by-side figure (`of`: the cold read, the model load, the
checkpoint write), with the storage's best job on both sides of every pair; the null is a ratio of 1.
The value is 1 when the interval excluded the null, where nothing differs (a false decision), 0 when it
covered it, None when the check had no interval (too few valid pairs). The console and the report say
them in one line, from these rows.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

AA_FALSE_DECISION = "g3_aa_false_decision"
G2_AA_FALSE_DECISION = "g2_aa_false_decision"
NULLS = {AA_FALSE_DECISION: "0", G2_AA_FALSE_DECISION: "a ratio of 1"}


def ratio_excludes_one(interval: Optional[tuple[float, float]]) -> Optional[int]:
    """A side-by-side ratio's A/A row value: 1 when its interval excludes 1, 0 when it holds it, None without one."""
    if interval is None:
        return None
    lo, hi = interval
    return int(not lo <= 1.0 <= (hi if math.isfinite(hi) else math.inf))


def false_decisions(measurements: Iterable[dict]) -> tuple[int, int, int]:
    """(intervals that excluded the null, intervals measured, A/A checks recorded) in a gate's measurements."""
    rows = [row for row in measurements if row.get("metric") in NULLS]
    measured = [row for row in rows if row.get("value") is not None]
    return sum(1 for row in measured if row["value"]), len(measured), len(rows)


def false_decision_line(measurements: Iterable[dict]) -> Optional[str]:
    """"A/A: 0 of 6 intervals excluded 0" from a gate's measurements; None when it recorded none (not an A/A run)."""
    rows = [row for row in measurements if row.get("metric") in NULLS]
    if not rows:
        return None
    excluded, measured, recorded = false_decisions(rows)
    missing = recorded - measured
    null = " or ".join(dict.fromkeys(NULLS[row["metric"]] for row in rows))
    unmeasured = f"; {missing} of {recorded} checks had no interval (too few valid pairs)" if missing else ""
    return (f"A/A: {excluded} of {measured} intervals excluded {null} (the subject against itself: each one "
            f"that did is a false decision of the harness){unmeasured}")
