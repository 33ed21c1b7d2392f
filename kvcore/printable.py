"""Text from a target made safe to write where people look: the console, JUnit, logs.

A target's text (a /v1/models id, an error message it sent) may hold an ESC sequence that recolours
or rewrites a terminal, NUL and the other C0/C1 controls that XML 1.0 forbids (a junit.xml holding
one no longer parses), or a lone surrogate (JSON's "\\ud800") that no UTF-8 writer accepts.
`printable` writes each of them as a Python-style escape (``\\x1b``, ``\\x00``, ``\\x9b``, ``\\ud800``)
and leaves everything else, tab and newline included, as it was.
"""

from __future__ import annotations

import re

_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\ufffe\uffff]")


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """`text` with every control character (but tab and newline) and lone surrogate written as its escape."""
    return _UNPRINTABLE.sub(_escape, text)
