"""The storage's best as the report shows it: every point of the storage sweep, and each G2 ratio judged
against the best job with how many pairs decided it, why sampling stopped, and the same-pattern diagnostic.

Rows read (kvcore.rundata measurements; gates/storage_best.py and gates/g2_baseline):
- `storage_sweep_point` (value GB/s): context kind, direct, ioengine, iodepth, numjobs, bs, raw;
- `storage_best_read_gbps` / `storage_best_write_gbps`: the winners, the same context;
- `cold_read_vs_storage_best`, `model_load_vs_storage_best`, `checkpoint_write_vs_storage_best` (value: the
  judged ratio): context pairs, interval, stopping {pairs, decided, why}, best (the sweep's winner),
  best_modes (each I/O mode's job as run beside the subject), best_source, same_pattern_ratio, aa.
"""

from __future__ import annotations

from kvcore.rundata import finite_number

JUDGED = ("cold_read_vs_storage_best", "model_load_vs_storage_best", "checkpoint_write_vs_storage_best")


def _shape(context: dict) -> str:
    if not context:
        return ""
    mode = "direct" if context.get("direct") else "buffered"
    return (f"{mode}, {context.get('ioengine')}, iodepth {context.get('iodepth')}, {context.get('numjobs')} jobs, "
            f"{context.get('bs')}")


def _jobs_run(context: dict) -> str:
    """The yardstick's jobs as they ran beside the subject: each I/O mode's pick (`best_modes`, the faster
    counted each round), else the sweep's one winner (`best`: rows written before the picks were recorded)."""
    modes = context.get("best_modes") or {}
    if modes:
        return " or ".join(_shape(shape) for shape in modes.values())
    return _shape(context.get("best") or {})


def _number(value, digits: int = 2) -> str:
    number = finite_number(value)
    return "" if number is None else f"{number:.{digits}f}"


def sweep_tables(measurements: list[dict]) -> list[dict]:
    """Every sweep point, the winner of each kind marked."""
    points = [m for m in measurements if m.get("metric") == "storage_sweep_point"]
    if not points:
        return []
    best = {m["context"].get("kind"): m.get("value") for m in measurements
            if m.get("metric") in ("storage_best_read_gbps", "storage_best_write_gbps") and m.get("context")}
    rows = [[str(c.get("kind", "")), _shape(c), _number(m.get("value")),
             "best" if m.get("value") == best.get(c.get("kind")) else "", str(c.get("raw", ""))]
            for m in points for c in [m.get("context") or {}]]
    return [{"title": "Storage sweep: every point (G2's yardstick: each I/O mode's fastest job that streams the bytes "
                      "of its subject, the faster counted each round)",
             "columns": ["kind", "job", "GB/s", "", "raw fio JSON"], "rows": rows}]


def pairs_tables(measurements: list[dict]) -> list[dict]:
    """Each judged ratio against the storage's best: pairs, why sampling stopped, interval, yardstick, diagnostic."""
    rows = []
    for m in measurements:
        if m.get("metric") not in JUDGED:
            continue
        c = m.get("context") or {}
        stopping = c.get("stopping") or {}
        interval = c.get("interval") or []
        bounds = f"[{_number(interval[0])}, {_number(interval[1])}]" if len(interval) == 2 else ""
        rows.append([str(m["metric"]) + (" (A/A)" if c.get("aa") else ""), _number(m.get("value")), bounds,
                     str(c.get("pairs", "")), str(stopping.get("why", "")), _jobs_run(c),
                     str(c.get("best_source", "")), _number(c.get("same_pattern_ratio"))])
    if not rows:
        return []
    # each figure's interval method as recorded (a record from before it was recorded: Lai's sequence)
    methods = dict.fromkeys(str((m.get("context") or {}).get("interval_method")
                                or "Lai's anytime-valid t confidence sequence")
                            for m in measurements if m.get("metric") in JUDGED)
    return [{"title": f"G2 against the storage's best: sequential pairs ({'; '.join(methods)})",
             "columns": ["figure", "ratio", "95% interval", "pairs", "sampling stopped", "the best jobs", "found by",
                         "at its own pattern (diagnostic)"], "rows": rows}]
