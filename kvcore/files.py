"""Files that a crash cannot tear: atomic replacement and append-only JSON lines."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

_append_lock = threading.Lock()


def write_text_atomic(path: Path, text: str) -> None:
    """Replace a file's text atomically (a temp file beside it, then rename): readers see old or new."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    temp.write_text(text, encoding="utf-8")
    os.replace(temp, path)


def write_json(path: Path, data: Any) -> None:
    """Replace a JSON file atomically."""
    write_text_atomic(path, json.dumps(data, indent=2, default=str))


def append_jsonl(path: Path, row: dict) -> None:
    """Append one JSON line with a single write (a crash loses nothing already written)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(row, separators=(",", ":"), default=str) + "\n").encode()
    with _append_lock:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def read_jsonl_file(path: Path) -> list[dict]:
    """Every complete JSON line of a file ([] when absent); a torn last line (a crash mid-write) is skipped."""
    if not Path(path).exists():
        return []
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def read_jsonl(directory: Path, pattern: str) -> list[dict]:
    """Every JSON line of the files matching `pattern` in `directory`."""
    return [row for path in sorted(Path(directory).glob(pattern)) for row in read_jsonl_file(path)]
