"""The engine's thread: each step starts the admitted requests, runs one prefill chunk and one decode step,
streams each new token to its caller and finishes the requests that are done.

A failure while starting or stepping one sequence fails that request alone (its finish event says
"error"); a failure outside any one sequence fails what is running, and the engine keeps serving.
Every request taken off the queue gets exactly one finish event.
"""

from __future__ import annotations

import collections
import functools
import logging
from typing import Callable, Optional

import torch

from cache_impl.engine.generation import FinishEvent, FinishReason, GenerationRequest, TokenEvent
from cache_impl.engine.model_runner import ModelRunner
from cache_impl.engine.prefix_cache import PrefixCache
from cache_impl.engine.scheduler import Scheduler
from cache_impl.engine.sequence import Sequence
from cache_impl.engine.tokenizer import ByteTokenizer

_log = logging.getLogger("kvgate.engine")


class EngineLoop:
    """`run()` is the engine thread's body: steps until the scheduler is stopped and idle."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, prefix_cache: PrefixCache,
                 tokenizer: ByteTokenizer, counters: collections.Counter[str], threads: int) -> None:
        self.scheduler, self.runner, self.prefix_cache = scheduler, runner, prefix_cache
        self.threads = threads  # torch's thread count on the engine's thread
        self.tokenizer, self.counters = tokenizer, counters
        self.starting: Optional[Sequence] = None  # the sequence being started (`_start`), if any

    def run(self) -> None:
        torch.set_num_threads(self.threads)   # a new thread starts at the machine's default, not the caller's
        while (admitted := self.scheduler.next_admitted()) is not None:
            try:
                self._step(admitted)
            except Exception as exc:  # outside any one sequence: fail what is running, keep serving
                self._count_error(exc)
                for seq in list(self.scheduler.running):
                    self._finish(seq, "error", error=repr(exc))
                for request in admitted:  # taken off the queue: each one is answered, started or not
                    if not request.finished:
                        self._finish_unstarted(request, "error", error=repr(exc))
        for request in self.scheduler.drain():
            self._finish_unstarted(request, "cancelled")

    def _step(self, admitted: list[GenerationRequest]) -> None:
        """Start the admitted requests, then one prefill chunk and one decode step.

        An exception while starting or stepping one sequence fails that request alone.
        """
        for request in admitted:
            try:
                self._start(request)
            except Exception as exc:
                self._count_error(exc)
                self._finish_unstarted(request, "error", error=repr(exc))
        for seq in self.scheduler.cancelled():
            self._finish(seq, "cancelled")
        prefilling = self.scheduler.next_prefill()
        if prefilling is not None:
            self._guarded(prefilling, self._prefill)
        self._decode_step()

    def _guarded(self, seq: Sequence, action: Callable[[Sequence], None]) -> None:
        try:
            action(seq)
        except Exception as exc:
            self._count_error(exc)
            self._finish(seq, "error", error=repr(exc))

    def _count_error(self, exc: Exception) -> None:
        self.counters["engine_errors"] += 1
        _log.error("the engine failed a request: %r", exc, exc_info=exc)

    def _start(self, request: GenerationRequest) -> None:
        if request.cancelled.is_set():
            self._finish_unstarted(request, "cancelled")
            return
        seq = self.runner.new_sequence(request, decoder=self.tokenizer.stream_decoder())
        self.starting = seq  # while the cache loads into its KV buffer, that buffer is neither running nor kept
        try:
            self.prefix_cache.load(seq)
            self.scheduler.start(seq)
        finally:
            self.starting = None

    def _prefill(self, seq: Sequence) -> None:
        """One chunk of the prompt; after the last one, the first token (storing the blocks can wait for it)."""
        start = seq.computed
        logits = self.runner.prefill_chunk(seq)
        if seq.computed > start:
            self.counters["prompt_tokens_computed"] += seq.computed - start
        if logits is None:
            self.prefix_cache.store_full_blocks(seq)
        else:
            self._emit_next(seq, logits, then=self._after_prefill)

    def _after_prefill(self, seq: Sequence) -> None:
        self.prefix_cache.store_full_blocks(seq)
        self.prefix_cache.promote_loaded(seq)

    def _decode_step(self) -> None:
        batch = self.scheduler.decode_batch()
        if not batch:
            return
        try:
            logits = self.runner.decode(batch)
        except Exception:
            if len(batch) == 1:
                raise
            for seq in batch:  # which one failed the batch? each alone: only that one fails
                self._guarded(seq, self._decode_alone)
            return
        for i, seq in enumerate(batch):
            self._guarded(seq, functools.partial(self._advance, logits=logits[i : i + 1]))

    def _decode_alone(self, seq: Sequence) -> None:
        self._advance(seq, self.runner.decode([seq]))

    def _advance(self, seq: Sequence, logits: torch.Tensor) -> None:
        seq.computed += 1
        self.prefix_cache.store_full_blocks(seq)
        self._emit_next(seq, logits)

    def _emit_next(self, seq: Sequence, logits: torch.Tensor,
                   then: Optional[Callable[[Sequence], None]] = None) -> None:
        """Sample the next token from logits [1, vocab] and emit it; run `then` (after the token,
        before the finish, so a finished request's blocks are in the cache); finish when done."""
        token = self.runner.sample(logits, seq)
        # not counted: usage counts the tokens that were streamed (with ignore_eos it is one of them, as vLLM's)
        stop = token == self.tokenizer.eos_id and not seq.request.ignore_eos
        if not stop:
            seq.generated += 1
            self.counters["generation_tokens"] += 1
            seq.tokens.append(token)
            seq.request.on_event(TokenEvent(token, seq.decoder.feed(token)))
        if then is not None:
            then(seq)
        if stop:
            self._finish(seq, "stop")
        elif seq.generated >= seq.request.max_tokens:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: FinishReason, error: str = "") -> None:
        if self.scheduler.finish(seq):
            self.runner.release(seq)
        try:
            text = seq.decoder.flush()
        except Exception:  # a sequence that failed mid-character still gets its finish event
            text = ""
        self._send_finish(seq.request, FinishEvent(
            reason, seq.prompt_len, seq.generated, seq.cached_tokens, text=text, error=error,
        ))

    def _finish_unstarted(self, request: GenerationRequest, reason: FinishReason, error: str = "") -> None:
        self._send_finish(request, FinishEvent(reason, len(request.prompt_tokens), 0, 0, error=error))

    def _send_finish(self, request: GenerationRequest, event: FinishEvent) -> None:
        if request.finished:
            return  # one finish event per request, whatever failed after it
        request.finished = True
        self.counters[f"requests_{event.finish_reason}"] += 1
        try:
            request.on_event(event)
        except Exception:  # the caller's callback: its failure must not stop the engine
            _log.exception("delivering a finish event failed")
