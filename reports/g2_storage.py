"""G2's model-load and checkpoint figures as the report draws them: a table per loader and per round
with its phases, and bar charts against the storage's best job's line. Reads only the measurements' rows (the suites'
metrics and their `context` keys, kvcore.rundata), never reason strings.

How it works: docs/methods/storage-best.md (reports/g2_storage.py).
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable, Optional

from kvcore.loader_names import READS_WITH_O_DIRECT
from kvcore.percent import format_percent
from kvcore.rundata import finite_number

from . import plots

LOAD_PHASES = ("open", "read", "deserialize", "copy")
SERVICE_PHASES = ("imports", "weights", "ready", "first_token")


def _rows(measurements: Iterable[dict], metric: str) -> list[dict]:
    return [m for m in measurements if m.get("metric") == metric]


def _median(values: Iterable[Any]) -> Optional[float]:
    numbers = [n for n in (finite_number(v) for v in values) if n is not None]
    return statistics.median(numbers) if numbers else None


def _seconds(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.3f}"


def _gbps(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.2f}"


def _percent(value: Optional[float]) -> str:
    return "" if value is None else format_percent(value)


def _gigabytes(value: Any) -> str:
    number = finite_number(value)
    return "" if number is None else f"{number / 1e9:.2f} GB"


def _by(rows: list[dict], key: str) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(str((row.get("context") or {}).get(key, "")), []).append(row)
    return groups


def _under_test(rows: list[dict]) -> list[dict]:
    return [r for r in rows if (r.get("context") or {}).get("storage", "under test") == "under test"]


def _warm(loader_row: Optional[dict]) -> str:
    """The loader's one warm load (files in the page cache), apart from the judged cold ones."""
    context = (loader_row or {}).get("context") or {}
    gbps = finite_number(context.get("warm_gbps"))
    if gbps is None:
        return "none (reads with O_DIRECT)" if context.get("loader") in READS_WITH_O_DIRECT else ""
    return _gbps(gbps) + (" (read the device: O_DIRECT)" if context.get("warm_read_device") else "")


def model_load_tables(measurements: list[dict]) -> list[dict]:
    """Per loader: medians of its cold rounds on the storage under test, phase by phase; and the server
    start per loader when it was timed."""
    tables = []
    loads = _under_test(_rows(measurements, "model_load_round"))
    ratios = {str((r.get("context") or {}).get("loader")): r for r in _rows(measurements, "model_load_loader")}
    if loads:
        rows = []
        for loader, rounds in _by(loads, "loader").items():
            contexts = [r.get("context") or {} for r in rounds]
            ratio = ratios.get(loader)
            interval = (ratio.get("context") or {}).get("interval") if ratio else None
            ratio_text = _percent(finite_number(ratio.get("value"))) if ratio else ""
            if interval and len(interval) == 2:
                ratio_text += f" [{_percent(finite_number(interval[0]))}, {_percent(finite_number(interval[1]))}]"
            judged = bool(ratio and (ratio.get("context") or {}).get("judged_loader"))
            rows.append([f"{loader} (judged)" if judged else loader, _gbps(_median(r.get("value") for r in rounds)),
                         _gbps(_median(c.get("fio_gbps") for c in contexts)), ratio_text,
                         *(_seconds(_median((c.get("phases") or {}).get(p) for c in contexts)) for p in LOAD_PHASES),
                         _seconds(_median(c.get("seconds") for c in contexts)),
                         _gigabytes(_median(c.get("bytes") for c in contexts)),
                         f"{sum(1 for c in contexts if c.get('cold'))} / {len(contexts)}",
                         f"{sum(1 for c in contexts if c.get('identical'))} / {len(contexts)}",
                         _warm(ratio)])
        tables.append(
            {
                "title": "Model load: cold rounds per loader (medians), beside the storage's best read job reading "
                "the same files",
                "columns": [
                    "loader",
                    "GB/s",
                    "best job GB/s",
                    "loader / best",
                    *(f"{p} s" for p in LOAD_PHASES),
                    "total s",
                    "bytes",
                    "cold rounds",
                    "identical rounds",
                    "warm GB/s",
                ],
                "rows": rows,
            }
        )
    starts = _rows(measurements, "service_load")
    if starts:
        rows = []
        for loader, rounds in _by(starts, "loader").items():
            contexts = [r.get("context") or {} for r in rounds]
            weights = [c.get("weights") or {} for c in contexts]
            gbps = _median((finite_number(w.get("nbytes", w.get("bytes"))) or 0) / w["seconds"] / 1e9 for w in weights
                           if finite_number(w.get("seconds")))
            rows.append([loader, *(_seconds(_median((c.get("phases") or {}).get(p) for c in contexts))
                                   for p in SERVICE_PHASES),
                         _seconds(_median(r.get("value") for r in rounds)), _gbps(gbps), str(len(rounds))])
        tables.append(
            {
                "title": "Service load: process start to first token, per loader (seconds, medians; cold)",
                "columns": [
                    "loader",
                    "imports (Python, torch)",
                    "model + weights",
                    "ready",
                    "first token",
                    "total",
                    "weights GB/s",
                    "starts",
                ],
                "rows": rows,
            }
        )
    return tables


def checkpoint_tables(measurements: list[dict]) -> list[dict]:
    """Every save beside fio's write, every cold restore: round by round, with each rank's seconds."""
    tables = []
    for metric, title, extra in (
        (
            "checkpoint_save_round",
            "Checkpoint save: each round, beside the storage's best fsync'd write job writing as many bytes",
            ("best job GB/s", "save / best"),
        ),
        ("checkpoint_restore_round", "Checkpoint restore: each round, pages dropped first", ("equal", "cold")),
    ):
        rounds = _rows(measurements, metric)
        if not rounds:
            continue
        rows = []
        for r in rounds:
            c = r.get("context") or {}
            ranks = ", ".join(_seconds(finite_number(s)) for s in c.get("rank_seconds") or [])
            tail = (
                [_gbps(finite_number(c.get("fio_gbps"))), _percent(finite_number(c.get("ratio")))]
                if metric.endswith("save_round")
                else ["yes" if c.get("equal") else "NO", "yes" if c.get("cold") else "no"]
            )
            path = c.get("writer", "") if metric.endswith("save_round") else \
                f"{c.get('reader', '')} reader, {c.get('writer', '')} checkpoint"
            rows.append([str(c.get("storage", "under test")), str(path),
                         f"{c.get('round', '')}{' (warm-up, not judged)' if c.get('warmup') else ''}",
                         _seconds(finite_number(c.get("slowest_s"))), ranks, _gigabytes(c.get("bytes")),
                         _gbps(finite_number(r.get("value"))), *tail])
        tables.append({"title": title, "columns": ["storage", "path", "round", "slowest rank s", "each rank s", "bytes",
                                                   "GB/s", *extra], "rows": rows})
    return tables


def _label(kind: str, context: dict, path: str) -> str:
    """'kvgate save 3' (a run before the writers were named: 'save 3')."""
    return " ".join(str(part) for part in (context.get(path), kind, context.get("round")) if part is not None)


def storage_plots(measurements: list[dict]) -> list[str]:
    """Loaders' median GB/s with fio's median line over each; checkpoint saves and restores per round with
    fio's write line over each save."""
    charts = []
    loads = _under_test(_rows(measurements, "model_load_round"))
    if loads:
        bars = [plots.Bar(loader, _median(r.get("value") for r in rounds),
                          _median((r.get("context") or {}).get("fio_gbps") for r in rounds))
                for loader, rounds in _by(loads, "loader").items()]
        charts.append(plots.bar_chart(bars, "G2 model load: cold GB/s per loader (medians)", "GB/s",
                                      reference_label="the best read job, same files"))
    saves = _under_test(_rows(measurements, "checkpoint_save_round"))
    restores = _under_test(_rows(measurements, "checkpoint_restore_round"))
    if saves or restores:
        bars = ([plots.Bar(_label("save", r.get("context") or {}, "writer"), r.get("value"),
                           (r.get("context") or {}).get("fio_gbps")) for r in saves]
                + [plots.Bar(_label("restore", r.get("context") or {}, "reader"), r.get("value")) for r in restores])
        charts.append(plots.bar_chart(bars, "G2 checkpoint: save and cold restore GB/s per round", "GB/s",
                                      reference_label="the best fsync'd write job"))
    return charts
