"""Which requests run next: the waiting queue, the running set and each step's decisions (no tensors, no model).

Admission: a request that cannot fit the model's context, or whose prompt holds a token id outside
the vocabulary, is refused (ValueError: on a CUDA device such an id would trip a device-side assert
that fails every later request of the process); one that finds
`max_waiting` requests waiting while `max_running` run is refused too (QueueFullError: HTTP 429).
Each step the engine's thread takes the waiting requests in arrival order while fewer than
`max_running` run, starts them, drops the cancelled ones, runs one prefill chunk of the first
running sequence still prefilling (arrival order: long prefills never stall decodes, and never
pass each other) and one decode step of every other. Once stopped, no request is added and the
waiting ones are handed back unstarted when nothing runs any more. There is no preemption: each
running sequence owns its KV for its whole life.
"""

from __future__ import annotations

import collections
import threading
from typing import Optional

from cache_impl.engine.generation import GenerationRequest, QueueFullError
from cache_impl.engine.sequence import Sequence


class Scheduler:
    """`add` from any thread; the rest from the engine's thread (`running` is read by snapshots)."""

    def __init__(self, max_running: int, max_waiting: int, max_context: int,
                 vocab_size: Optional[int] = None) -> None:
        self.max_running, self.max_waiting, self.max_context = max_running, max_waiting, max_context
        self.vocab_size = vocab_size
        self.waiting: collections.deque[GenerationRequest] = collections.deque()
        self.running: list[Sequence] = []
        self._wake = threading.Condition()
        self._stopping = False

    def add(self, request: GenerationRequest) -> None:
        """Queue a request; raises ValueError for a prompt that cannot fit, QueueFullError when full or stopped."""
        total = len(request.prompt_tokens) + request.max_tokens
        if not request.prompt_tokens:
            raise ValueError("the prompt is empty")
        prompt = request.prompt_tokens
        if self.vocab_size is not None and (min(prompt) < 0 or max(prompt) >= self.vocab_size):
            outside = [t for t in prompt if not 0 <= t < self.vocab_size]
            raise ValueError(f"token ids must be in [0, {self.vocab_size}), found {outside[0]} "
                             f"({len(outside)} outside)")
        if total > self.max_context:
            raise ValueError(
                f"prompt ({len(request.prompt_tokens)} tokens) plus max_tokens ({request.max_tokens}) "
                f"exceeds the model's context of {self.max_context} tokens"
            )
        with self._wake:
            if self._stopping:
                raise QueueFullError("the engine is shutting down")
            if len(self.waiting) >= self.max_waiting and len(self.running) >= self.max_running:
                raise QueueFullError(f"{len(self.waiting)} requests are already waiting")
            self.waiting.append(request)
            self._wake.notify()

    def stop(self) -> None:
        """Refuse new requests; `next_admitted` returns None once the running ones are done."""
        with self._wake:
            self._stopping = True
            self._wake.notify()

    def next_admitted(self) -> Optional[list[GenerationRequest]]:
        """Wait for work, then the requests to start this step (oldest first, while fewer than `max_running`
        run); None once stopped with nothing running (`drain` then gives the requests still waiting)."""
        with self._wake:
            while not self.waiting and not self.running and not self._stopping:
                self._wake.wait()
            if self._stopping and not self.running:
                return None
            admitted: list[GenerationRequest] = []
            while self.waiting and len(self.running) + len(admitted) < self.max_running:
                admitted.append(self.waiting.popleft())
            return admitted

    def drain(self) -> list[GenerationRequest]:
        """Take every waiting request off the queue (they are finished unstarted)."""
        with self._wake:
            drained = list(self.waiting)
            self.waiting.clear()
            return drained

    def start(self, seq: Sequence) -> None:
        self.running.append(seq)

    def finish(self, seq: Sequence) -> bool:
        """Take `seq` out of the running set; False when it was not in it (never started, or finished already)."""
        if seq not in self.running:
            return False
        self.running.remove(seq)
        return True

    def cancelled(self) -> list[Sequence]:
        """The running sequences whose caller cancelled them (to finish as cancelled before the step)."""
        return [s for s in self.running if s.request.cancelled.is_set()]

    def next_prefill(self) -> Optional[Sequence]:
        """The sequence whose prompt chunk runs this step: the first one still prefilling."""
        return next((s for s in self.running if s.prefilling), None)

    def decode_batch(self) -> list[Sequence]:
        """The sequences that decode one token together this step: every one past its first token."""
        return [s for s in self.running if not s.prefilling]
