"""Request KV buffers, kept for reuse, so a long prompt's KV does not fault its pages in afresh.

A request's KV is tens of MiB (the small preset's 8k-token prompt: 33 MiB). A fresh tensor that
large is a fresh mapping: its pages fault in as the load and the prefill first touch them, and
freeing it hands them back, on every request. `KVBuffers` keeps up to `max_idle` finished
buffers and hands out the smallest one that holds a new request (at most twice its size), so a
returning prompt length reuses memory already in place. What it holds is bounded: `max_idle`
buffers, each at most the model's context.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Optional

import torch

POSITIONS_DIM = 3  # [layers, 2, kv_heads, positions, head_dim]


class KVBuffers:
    """`take(positions)` a buffer with room for at least `positions`; `give` it back when done."""

    def __init__(self, allocate: Callable[[int], torch.Tensor], max_idle: int) -> None:
        self._allocate = allocate
        self.max_idle = max_idle
        self._idle: deque[torch.Tensor] = deque()
        self._lock = threading.Lock()
        self.reused = 0
        self.allocated = 0

    def take(self, positions: int) -> torch.Tensor:
        """A buffer whose positions dimension holds `positions` or more (view `[..., :positions, :]`)."""
        with self._lock:
            fitting = [i for i, b in enumerate(self._idle) if positions <= b.shape[POSITIONS_DIM] <= 2 * positions]
            if fitting:
                chosen = min(fitting, key=lambda i: self._idle[i].shape[POSITIONS_DIM])
                buffer = self._idle[chosen]
                del self._idle[chosen]  # by place: tensors compare element by element
                self.reused += 1
                return buffer
            self.allocated += 1
        return self._allocate(positions)

    def give(self, buffer: torch.Tensor) -> Optional[int]:
        """Keep a finished request's buffer; returns the bytes of one let go to stay within `max_idle`."""
        with self._lock:
            self._idle.append(buffer)
            if len(self._idle) <= self.max_idle:
                return None
            return self._idle.popleft().nbytes

    def idle(self) -> list[torch.Tensor]:
        """The buffers kept for reuse now."""
        with self._lock:
            return list(self._idle)

    @property
    def idle_bytes(self) -> int:
        return sum(b.nbytes for b in self.idle())
