"""The embedded inference engine: continuous batching over the small model, KV reuse through the cache.

One thread owns the model. Each step it admits waiting requests (loading their longest cached
prefix), runs one prefill chunk of one request, then one decode step for every request that is
generating, so long prefills never stall running decodes. Requests join and leave between steps.

`Engine` is the façade the server and the benches use; the pieces behind it, as in nano-vllm:
- `scheduler.py`: which requests run next (admission, cancel, the step's batch): decisions, no tensors;
- `model_runner.py`: forward passes, sampling and the KV buffers (`kvbuffers.py`) they run in;
- `prefix_cache.py`: a sequence's KV loaded from and stored to the tiered cache;
- `requests.py`, `sequence.py`: what a caller asks and is answered, and a running request's state.
Greedy output is bit-for-bit the same in every cache mode (see `model_runner.py`).
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import torch
from pydantic import Field, ValidationError, field_validator, model_validator

from .config import CacheConfig, ConfigError, Count, StrictModel, format_validation_error, parse_size
from .keys import Fingerprint
from .manager import TieredKVCache, resolve_device
from .model import DEFAULT_PRESET, PRESETS, Transformer, weights_digest
from .model_runner import ModelRunner
from .prefix_cache import PrefixCache
from .requests import FinishEvent, Generation, GenerationRequest, QueueFullError, TokenEvent
from .scheduler import Scheduler
from .sequence import Sequence
from .tokenizer import ByteTokenizer
from .weights import WeightsLoad, load_weights, seeded_weights

__all__ = ["Engine", "EngineConfig", "FinishEvent", "Generation", "GenerationRequest", "QueueFullError",
           "TokenEvent"]

CacheMode = Literal["recompute", "device-only", "tiered"]
LoadFormat = Literal["safetensors", "runai_streamer", "fastsafetensors"]
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "kvgate" / "kv"
_log = logging.getLogger("kvgate.engine")


class EngineConfig(StrictModel):
    """The engine: model preset and seed, cache mode, batching limits and the cache itself."""

    mode: CacheMode = Field(default="tiered", description="recompute, device-only (device tier only) or tiered")
    preset: Literal[tuple(PRESETS)] = Field(default=DEFAULT_PRESET, description="model size preset")
    seed: int = Field(default=0, ge=0, description="weights seed (part of the cache fingerprint)")
    weights: Optional[Path] = Field(default=None, description="a safetensors directory to load the weights from "
                                    "(kvgate export-weights writes one; its metadata names the preset); "
                                    "default: weights from the seed")
    load_format: LoadFormat = Field(default="safetensors", description="the loader of `weights`: safetensors "
                                    "(what engines do by default), runai_streamer or fastsafetensors")
    load_concurrency: int = Field(default=16, ge=1, le=256, description="the streaming loaders' read threads")
    require_checksums: bool = Field(default=False, description="refuse `weights` without their checksum sidecar "
                                    "and index (what verifies each tensor's bytes and finds every shard); "
                                    "otherwise they are served with a warning on the start line")
    max_running: Count = Field(default=8, ge=1, description="requests decoding at once")
    max_waiting: Count = Field(default=64, ge=0, description="queued requests before new ones get 429")
    # The longest prompt a preset takes (16,384 tokens) is at most ~100 KiB of JSON (a byte token
    # escaped as \u00XX is 6 bytes), chat framing included well under 1 MiB: 4 MiB refuses only
    # bodies no model here could take, before they are read and tokenized (HTTP 413).
    max_request_bytes: int = Field(default=4 * 2**20, ge=1024,
                                   description="largest request body the server reads; larger ones get 413")
    cache: CacheConfig = Field(default_factory=CacheConfig, description="the tiered KV cache")

    _parse_sizes = field_validator("max_request_bytes", mode="before")(lambda cls, v: parse_size(v))

    @model_validator(mode="after")
    def _tiered_needs_disk(self) -> "EngineConfig":
        if self.mode == "tiered" and self.cache.disk is None:
            disk = {"path": str(DEFAULT_CACHE_DIR)}
            object.__setattr__(self, "cache", self.cache.replace(disk=disk))
        return self

    @classmethod
    def from_dict(cls, data: Any, root: str = "engine") -> "EngineConfig":
        try:
            return cls.model_validate(data or {})
        except ValidationError as error:
            raise ConfigError(format_validation_error(error, root)) from None

    def cache_for_mode(self) -> Optional[CacheConfig]:
        """The cache each mode uses: none, the device tier alone, or every configured tier."""
        if self.mode == "recompute":
            return None
        if self.mode == "device-only":
            return self.cache.replace(host_capacity_bytes=0, disk=None, remote=None)
        return self.cache


class Engine:
    """Continuous-batching engine. `submit()` from any thread; events arrive on the request's callback."""

    def __init__(self, config: EngineConfig, device: torch.device | None = None) -> None:
        self.config = config
        self.device = device or resolve_device(config.cache.device)
        self.tokenizer = ByteTokenizer()
        self.model, self.weights_load = self._weights(config)
        args = self.model.args
        self.model_name = f"kvgate-{self.weights_load.preset}"
        self.max_context = args.max_seq_len
        self.layout = config.cache.layout(args.n_layers, args.n_kv_heads, args.head_dim, "float32")
        self.block_size = self.layout.block_size
        self.fingerprint = Fingerprint(weights_digest(self.model), self.tokenizer.id, self.layout)
        cache_config = config.cache_for_mode()
        self.cache = TieredKVCache(cache_config, self.fingerprint, self.device) if cache_config else None
        self.counters = collections.Counter()
        self.scheduler = Scheduler(config.max_running, config.max_waiting, self.max_context)
        self.runner = ModelRunner(self.model, self.device, self.block_size, max_idle_buffers=config.max_running)
        self.prefix_cache = PrefixCache(self.cache, self.block_size, self.counters)
        self._thread = threading.Thread(target=self._loop, name="kvgate-engine", daemon=True)

    def _weights(self, config: EngineConfig) -> tuple[Transformer, WeightsLoad]:
        """The seeded model, or the weights of `config.weights` (whose metadata may name the preset: an
        explicit preset must agree with it)."""
        if config.weights is None:
            return seeded_weights(config.preset, config.seed, self.device)
        asked = config.preset if "preset" in config.model_fields_set else None
        return load_weights(config.weights, asked, config.load_format, self.device, config.load_concurrency,
                            config.require_checksums)

    # -- public ---------------------------------------------------------------

    def start(self) -> "Engine":
        self._thread.start()
        return self

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request; raises ValueError for a prompt that cannot fit, QueueFullError when full."""
        self.scheduler.add(request)

    def generate(self, prompt_tokens: list[int], max_tokens: int, temperature: float = 0.0,
                 seed: Optional[int] = None, timeout: float = 600.0) -> Generation:
        """Run one request to the end from a caller's thread; also records time to first token."""
        done = threading.Event()
        result = Generation()
        start = time.perf_counter()

        def on_event(event: TokenEvent | FinishEvent) -> None:
            if result.ttft_s is None:
                result.ttft_s = time.perf_counter() - start
            if isinstance(event, TokenEvent):
                result.token_ids.append(event.token_id)
                result.text += event.text
            else:
                result.text += event.text
                result.finish = event
                done.set()

        self.submit(GenerationRequest(list(prompt_tokens), max_tokens, on_event, temperature, seed))
        if not done.wait(timeout):
            raise TimeoutError(f"no answer within {timeout} s")
        return result

    def stop(self, timeout: float = 30.0) -> None:
        """Finish what is running, refuse new work, persist and flush the cache."""
        self.scheduler.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.cache is not None:
            self.cache.close()

    def snapshot(self) -> dict:
        return {
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "counters": dict(self.counters),
            "cache": self.cache.snapshot() if self.cache is not None else None,
        }

    # -- the engine's thread ----------------------------------------------------

    def _loop(self) -> None:
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
        seq = self.scheduler.next_prefill()
        if seq is not None:
            self._guarded(seq, self._prefill)
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
        self.prefix_cache.load(seq)
        self.scheduler.start(seq)

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

    def _finish(self, seq: Sequence, reason: str, error: str = "") -> None:
        if self.scheduler.finish(seq):
            self.runner.release(seq)
        try:
            text = seq.decoder.flush()
        except Exception:  # a sequence that failed mid-character still gets its finish event
            text = ""
        self._send_finish(seq.request, FinishEvent(
            reason, seq.prompt_len, seq.generated, seq.cached_tokens, text=text, error=error,
        ))

    def _finish_unstarted(self, request: GenerationRequest, reason: str, error: str = "") -> None:
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
