"""The run's environment fingerprint and run record as tables (never raw JSON).

The fingerprint (run.json's `environment`: versions, inventory sections such as host, cpu, memory,
gpus, the config digest, the git sha) has no fixed shape: each engine, host and version of kvgate
may add sections. So the tables follow the data's shape: the top level's scalars in one table
with the run's own fields, a mapping of scalars as a field / value table, a mapping of mappings
(the targets) as one row per entry, a list of mappings (devices, filesystems) as a table of its own.
A section that says `available: false` is one line: why it is not there.
Values read: `*_bytes` in GiB with the exact count, `*_at` epoch seconds as UTC times.
"""

from __future__ import annotations

import json
import time
from typing import Any

SCALARS = (str, int, float, bool, type(None))


def _words(key: str) -> str:
    return str(key).replace("_", " ")


def value_text(value: Any, key: str = "") -> str:
    """One value as a table cell."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)) and str(key).endswith("_bytes"):
        return f"{value / 2 ** 30:,.1f} GiB ({int(value):,} bytes)"
    if isinstance(value, (int, float)) and str(key).endswith("_at"):
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(value))
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, SCALARS) for v in value):
        return ", ".join(value_text(v) for v in value) or "—"
    if isinstance(value, dict) and all(isinstance(v, SCALARS) for v in value.values()):
        return ", ".join(f"{_words(k)}: {value_text(v, k)}" for k, v in value.items()) or "—"
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, default=str, ensure_ascii=False, separators=(", ", ": "))
    return str(value)


def _records(title: str, entries: list[dict]) -> dict:
    """A list of mappings as one table: a column per key any of them has, in the order first seen."""
    columns: list[str] = []
    for entry in entries:
        columns += [k for k in entry if k not in columns]
    return {"title": title, "columns": [_words(c) for c in columns],
            "rows": [[value_text(entry.get(c), c) for c in columns] for entry in entries],
            "text_columns": list(range(len(columns)))}


def _flat(value: Any) -> bool:
    """A scalar, or a list of scalars: one cell."""
    return isinstance(value, SCALARS) or (isinstance(value, (list, tuple))
                                          and all(isinstance(v, SCALARS) for v in value))


def _is_records(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, dict) for v in value)


def section_tables(title: str, section: dict) -> list[dict]:
    """One section: its flat fields as field / value rows, each list of mappings as a table of its own,
    a mapping of mappings (the targets) as a row per entry."""
    if section.get("available") is False:
        return [{"title": title, "columns": ["field", "value"],
                 "rows": [["not available", str(section.get("reason") or "no reason given")]], "text_columns": [0, 1]}]
    if section and all(isinstance(v, dict) for v in section.values()):
        return [_records(title, [{"name": name, **entry} for name, entry in section.items()])]
    inline = {k: v for k, v in section.items() if k != "available" and (_flat(v) or _flat_mapping(v))}
    rows = [[_words(k.removesuffix("_bytes")), value_text(v, k)] for k, v in inline.items()]
    tables = [{"title": title, "columns": ["field", "value"], "rows": rows, "text_columns": [0, 1]}] if rows else []
    for key, value in section.items():
        if key in inline or key == "available":
            continue
        if _is_records(value):
            tables.append(_records(f"{title}: {_words(key)}", list(value)))
        elif isinstance(value, dict):
            tables += section_tables(f"{title}: {_words(key)}", value)
        else:
            tables.append({"title": f"{title}: {_words(key)}", "columns": ["value"], "rows": [[value_text(value)]],
                           "text_columns": [0]})
    return tables


def _flat_mapping(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(v, SCALARS) for v in value.values())


def _title(key: str) -> str:
    return TITLES.get(key, _words(key).capitalize())


TITLES = {"cpu": "CPU", "gpus": "GPUs", "nvme": "NVMe", "raid": "RAID", "nics": "NICs", "rdma": "RDMA"}


def environment_tables(environment: dict, run: dict) -> list[dict]:
    """The fingerprint's and the run record's tables: the flat fields of both first, then each section."""
    record = {k: v for k, v in run.items() if k != "environment"}
    fields = {k: v for source in (record, environment) for k, v in source.items() if _flat(v)}
    tables = section_tables("Run", fields) if fields else []
    for source in (environment, record):
        for key, value in source.items():
            title = _title(key)
            if isinstance(value, dict) and value:
                tables += section_tables(title, value)
            elif _is_records(value):
                tables.append(_records(title, list(value)))
            elif not _flat(value):
                tables += section_tables(title, {key: value})
    return tables
