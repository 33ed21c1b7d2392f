"""Trace files for tests: small ones written by the test, and where the real Mooncake trace lies.

The real trace is never part of the repository; tests that need it skip when it is absent
(`KVGATE_TRACE` points at another copy).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

TRACE_PATH = Path(os.environ.get("KVGATE_TRACE", "/work/shared/data/mooncake-traces/conversation_trace.jsonl"))

needs_real_trace = pytest.mark.skipif(
    not TRACE_PATH.is_file(), reason=f"the Mooncake trace is not at {TRACE_PATH} (set KVGATE_TRACE to a copy)")


def write_trace(directory: Path, rows: list[dict], name: str = "trace.jsonl") -> Path:
    """`rows` as a JSONL trace file in `directory`."""
    path = directory / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
