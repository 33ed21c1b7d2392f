"""A/A runs (`kvgate run g3 --aa`): the candidate against itself, and the harness's own false decisions.

G3 records one `g3_aa_false_decision` measurement per judged check (`judged`, per level: TTFT p50 reduction,
throughput gain): value 1 when the check's interval excluded the null (0 reduction, 0 gain), where
nothing differs, 0 when it covered it, None when the check had no interval (too few valid block
pairs), with its context (judged metric, level, interval). The console and the report say them in
one line, from these rows.
"""

from __future__ import annotations

from typing import Iterable, Optional

AA_FALSE_DECISION = "g3_aa_false_decision"


def false_decision_line(measurements: Iterable[dict]) -> Optional[str]:
    """"A/A: 0 of 6 intervals excluded 0" from a gate's measurements; None when it recorded none (not an A/A run)."""
    rows = [row for row in measurements if row.get("metric") == AA_FALSE_DECISION]
    if not rows:
        return None
    measured = [row for row in rows if row.get("value") is not None]
    excluded = sum(1 for row in measured if row["value"])
    missing = len(rows) - len(measured)
    unmeasured = f"; {missing} of {len(rows)} checks had no interval (too few valid block pairs)" if missing else ""
    return (f"A/A: {excluded} of {len(measured)} intervals excluded 0 (the candidate against itself: each one that "
            f"did is a false decision of the harness){unmeasured}")
