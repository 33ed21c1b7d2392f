"""The console `kvgate run` prints to: target text made printable, lines unbroken outside a terminal.

Outside a terminal (a file, a pipe, a CI log) rich would hard-wrap each line at 80 columns, mid-sentence;
there this console soft-wraps (a line is written whole, as long as it is). Every string printed, and
the spinner's text, goes through kvcore.printable first, so an ESC sequence or a NUL from a target is
shown as its escape. Text from a target that is put into markup is escaped with `target_text`.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape

from kvcore.printable import printable


class GateConsole(Console):
    """A rich Console that writes target text printable and wraps only on a terminal."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        if not self.is_terminal:
            self.soft_wrap = True

    def print(self, *objects: Any, **options: Any) -> None:
        super().print(*(printable(o) if isinstance(o, str) else o for o in objects), **options)

    def status(self, status: Any, **options: Any):
        return super().status(printable(status) if isinstance(status, str) else status, **options)


def target_text(text: Any) -> str:
    """Text that came from a target, to put into a console line with markup: printable, its brackets escaped
    (a model id "[/x]" is shown, not read as a closing tag)."""
    return escape(printable(str(text)))
