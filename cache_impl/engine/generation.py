"""What a caller asks the embedded engine and what it answers: requests, their events, the queue-full error.

Torch-free, so the scheduler and its tests read it without the model.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Literal, Optional


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_waiting`: the caller should retry later (HTTP 429)."""


@dataclass
class TokenEvent:
    """A generated token: its id and the text it completes (may be "" mid-character)."""

    token_id: int
    text: str


FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass
class FinishEvent:
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    text: str = ""  # any text held back by the UTF-8 decoder
    error: str = ""


@dataclass
class GenerationRequest:
    prompt_tokens: list[int]
    max_tokens: int
    on_event: Callable[[TokenEvent | FinishEvent], None]
    temperature: float = 0.0
    seed: Optional[int] = None
    ignore_eos: bool = False   # end-of-text is a token like any other: generate to max_tokens (benchmark clients)
    cancelled: threading.Event = field(default_factory=threading.Event)
    finished: bool = False  # set by the engine thread when the finish event is sent


@dataclass
class Generation:
    """What `Engine.generate` returns."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish: Optional[FinishEvent] = None
    ttft_s: Optional[float] = None

    def finished(self) -> tuple[float, FinishEvent]:
        """(seconds to the first token, the finish event) of a finished generation, as `Engine.generate` returns
        one; RuntimeError for one still running."""
        if self.ttft_s is None or self.finish is None:
            raise RuntimeError("generation: expected a finished request, found one still running")
        return self.ttft_s, self.finish
