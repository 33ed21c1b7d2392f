"""The embedded inference engine: continuous batching over the small model, KV reuse through the cache.

One scheduler thread owns the model. Each step it admits waiting requests
(loading their longest cached prefix), runs one prefill chunk of one request,
then one decode step for every request that is generating, so long prefills
never stall running decodes. Requests join and leave between steps.

Prefill runs in chunks of exactly one cache block, aligned to block
boundaries from position 0. A prompt whose first k blocks come from the cache
therefore computes the same chunks, with the same inputs, as a recompute
does from scratch, and greedy output is bit-for-bit the same in every mode.
A prompt that ends on a block boundary takes its first token's logits from a
one-token pass over the finished KV (`Transformer.logits_at`), in every mode:
when all its blocks are cached, that pass is all that is computed.
"""

from __future__ import annotations

import array
import collections
import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import torch
from pydantic import Field, ValidationError, field_validator, model_validator

from .buffers import aligned_empty
from .config import CacheConfig, ConfigError, Count, StrictModel, format_validation_error, parse_size
from .heap import HeapTrimmer
from .keys import Fingerprint, KVLayout, token_array
from .kvbuffers import KVBuffers
from .manager import TieredKVCache, resolve_device
from .model import DEFAULT_PRESET, PRESETS, Transformer, weights_digest
from .tokenizer import GENERATABLE, ByteTokenizer
from .weights import WeightsLoad, load_weights, seeded_weights

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


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_waiting`: the caller should retry later (HTTP 429)."""


@dataclass
class TokenEvent:
    """A generated token: its id and the text it completes (may be "" mid-character)."""

    token_id: int
    text: str


@dataclass
class FinishEvent:
    finish_reason: Literal["stop", "length", "cancelled", "error"]
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


@dataclass
class _Sequence:
    request: GenerationRequest
    tokens: list[int]
    kv: torch.Tensor                    # [layers, 2, kv_heads, prompt + max_tokens (whole blocks), head_dim]
    buffer: torch.Tensor                # what `kv` is a view of (from the engine's KVBuffers)
    computed: int = 0                   # positions whose KV is in `kv`
    cached_tokens: int = 0              # of those, loaded from the cache
    stored_blocks: int = 0              # full blocks already offered to the cache
    loaded_blocks: int = 0              # leading blocks loaded from the cache, promoted after the first token
    generated: int = 0
    decoder: Any = None
    generator: Optional[torch.Generator] = None
    prompt_ids: array.array = field(default_factory=lambda: array.array("I"))  # the prompt as the cache reads it

    def token_ids(self, n: int) -> array.array:
        """The first n tokens as a uint32 array (the prompt's converted once, at the start)."""
        return self.prompt_ids[:n] if n <= len(self.prompt_ids) else token_array(self.tokens[:n])

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_tokens)

    @property
    def prefilling(self) -> bool:
        """The first token is not out yet (prompt chunks, or the logits pass, remain)."""
        return len(self.tokens) == self.prompt_len


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
        self.block_size = config.cache.block_size
        self.layout = KVLayout(args.n_layers, args.n_kv_heads, args.head_dim, "float32", self.block_size)
        self.fingerprint = Fingerprint(weights_digest(self.model), self.tokenizer.id, self.layout)
        cache_config = config.cache_for_mode()
        self.cache = TieredKVCache(cache_config, self.fingerprint, self.device) if cache_config else None
        self._allowed = torch.full((args.vocab_size,), float("-inf"), device=self.device)
        self._allowed[GENERATABLE] = 0.0
        self._waiting: collections.deque[GenerationRequest] = collections.deque()
        self._running: list[_Sequence] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="kvgate-engine", daemon=True)
        self.counters = collections.Counter()
        self._kv_buffers = KVBuffers(self._allocate_kv, max_idle=config.max_running)
        self._heap = HeapTrimmer()  # what finished requests freed goes back to the OS, not to a fragmented arena

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
        total = len(request.prompt_tokens) + request.max_tokens
        if not request.prompt_tokens:
            raise ValueError("the prompt is empty")
        if total > self.max_context:
            raise ValueError(
                f"prompt ({len(request.prompt_tokens)} tokens) plus max_tokens ({request.max_tokens}) "
                f"exceeds the model's context of {self.max_context} tokens"
            )
        with self._wake:
            if self._stopping:
                raise QueueFullError("the engine is shutting down")
            if len(self._waiting) >= self.config.max_waiting and len(self._running) >= self.config.max_running:
                raise QueueFullError(f"{len(self._waiting)} requests are already waiting")
            self._waiting.append(request)
            self._wake.notify()

    def generate(self, prompt_tokens: list[int], max_tokens: int, temperature: float = 0.0,
                 seed: Optional[int] = None, timeout: float = 600.0) -> "Generation":
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
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.cache is not None:
            self.cache.close()

    def snapshot(self) -> dict:
        return {
            "waiting": len(self._waiting),
            "running": len(self._running),
            "counters": dict(self.counters),
            "cache": self.cache.snapshot() if self.cache is not None else None,
        }

    # -- scheduler --------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._waiting and not self._running and not self._stopping:
                    self._wake.wait()
                if self._stopping and not self._running:
                    for request in self._waiting:
                        self._finish_unstarted(request, "cancelled")
                    self._waiting.clear()
                    return
                admitted = self._admit_locked()
            try:
                self._step(admitted)
            except Exception as exc:  # outside any one sequence: fail what is running, keep serving
                self._count_error(exc)
                for seq in list(self._running):
                    self._finish(seq, "error", error=repr(exc))
                for request in admitted:  # taken off the queue: each one is answered, started or not
                    if not request.finished:
                        self._finish_unstarted(request, "error", error=repr(exc))

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
        self._drop_cancelled()
        seq = next((s for s in self._running if s.prefilling), None)
        if seq is not None:
            self._guarded(seq, self._prefill_one_chunk)
        self._decode_step()

    def _guarded(self, seq: _Sequence, action: Callable[[_Sequence], None]) -> None:
        try:
            action(seq)
        except Exception as exc:
            self._count_error(exc)
            self._finish(seq, "error", error=repr(exc))

    def _count_error(self, exc: Exception) -> None:
        self.counters["engine_errors"] += 1
        _log.error("the engine failed a request: %r", exc, exc_info=exc)

    def _admit_locked(self) -> list[GenerationRequest]:
        admitted = []
        while self._waiting and len(self._running) + len(admitted) < self.config.max_running:
            admitted.append(self._waiting.popleft())
        return admitted

    def _start(self, request: GenerationRequest) -> None:
        if request.cancelled.is_set():
            self._finish_unstarted(request, "cancelled")
            return
        total = len(request.prompt_tokens) + request.max_tokens
        capacity = -(-total // self.block_size) * self.block_size  # whole blocks: loads copy block-shaped views
        buffer = self._kv_buffers.take(capacity)
        seq = _Sequence(request, list(request.prompt_tokens), buffer[:, :, :, :capacity], buffer,
                        decoder=self.tokenizer.stream_decoder(), prompt_ids=token_array(request.prompt_tokens))
        if request.temperature > 0:
            seed = request.seed if request.seed is not None else torch.seed()
            seq.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._load_cached_prefix(seq)
        self._running.append(seq)

    def _allocate_kv(self, positions: int) -> torch.Tensor:
        """Page-aligned, with whole blocks of positions: the disk tier reads a block into it with O_DIRECT."""
        args = self.model.args
        return aligned_empty((args.n_layers, 2, args.n_kv_heads, positions, args.head_dim), torch.float32, self.device)

    def _load_cached_prefix(self, seq: _Sequence) -> None:
        """Load the longest cached prefix straight into the sequence's KV (every full block of the
        prompt may come from the cache)."""
        if self.cache is None:
            return
        prefix = self.cache.load_into(seq.prompt_ids, functools.partial(self._block_view, seq))
        seq.computed = seq.cached_tokens = prefix.num_tokens
        seq.stored_blocks = seq.loaded_blocks = prefix.num_blocks
        self.counters["prompt_tokens_reused"] += seq.cached_tokens

    def _block_view(self, seq: _Sequence, i: int) -> torch.Tensor:
        """Block i of the sequence's KV, [layers, 2, kv_heads, block, head_dim] (a view)."""
        return seq.kv[:, :, :, i * self.block_size : (i + 1) * self.block_size]

    def _promote_loaded(self, seq: _Sequence) -> None:
        """Once the first token is out: keep the loaded prefix on the upper tiers (off the TTFT path)."""
        if self.cache is None or not seq.loaded_blocks:
            return
        n, seq.loaded_blocks = seq.loaded_blocks, 0
        self.cache.promote(seq.token_ids(n * self.block_size), [self._block_view(seq, i) for i in range(n)])

    def _prefill_one_chunk(self, seq: _Sequence) -> None:
        """One block-aligned chunk of the prompt; after the last one, the first token."""
        if seq.computed < seq.prompt_len:
            start = seq.computed
            end = min((start // self.block_size + 1) * self.block_size, seq.prompt_len)
            chunk = torch.tensor(seq.tokens[start:end], device=self.device)
            logits = self.model.prefill(chunk, seq.kv, start)
            seq.computed = end
            self.counters["prompt_tokens_computed"] += end - start
            if seq.computed < seq.prompt_len:
                self._store_full_blocks(seq)
                return
        if seq.prompt_len % self.block_size == 0:  # on a boundary: every mode asks the finished KV
            last = seq.prompt_len - 1
            logits = self.model.logits_at(torch.tensor(seq.tokens[last], device=self.device), seq.kv, last)
        self._emit_next(seq, logits[None], then=self._after_prefill)  # the first token first: storing can wait

    def _after_prefill(self, seq: _Sequence) -> None:
        self._store_full_blocks(seq)
        self._promote_loaded(seq)

    def _decode_step(self) -> None:
        batch = [s for s in self._running if not s.prefilling]
        if not batch:
            return
        try:
            logits = self._decode(batch)
        except Exception:
            if len(batch) == 1:
                raise
            for seq in batch:  # which one failed the batch? each alone: only that one fails
                self._guarded(seq, self._decode_step_alone)
            return
        for i, seq in enumerate(batch):
            self._guarded(seq, functools.partial(self._advance, logits=logits[i : i + 1]))

    def _decode(self, batch: list[_Sequence]) -> torch.Tensor:
        tokens = torch.tensor([s.tokens[-1] for s in batch], device=self.device)
        return self.model.decode(tokens, [s.kv for s in batch], [len(s.tokens) - 1 for s in batch])

    def _decode_step_alone(self, seq: _Sequence) -> None:
        self._advance(seq, self._decode([seq]))

    def _advance(self, seq: _Sequence, logits: torch.Tensor) -> None:
        seq.computed += 1
        self._store_full_blocks(seq)
        self._emit_next(seq, logits)

    def _emit_next(self, seq: _Sequence, logits: torch.Tensor,
                   then: Optional[Callable[[_Sequence], None]] = None) -> None:
        """Sample the next token from logits [1, vocab] and emit it; run `then` (after the token,
        before the finish, so a finished request's blocks are in the cache); finish when done."""
        token = self._sample(logits, seq)
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

    def _sample(self, logits: torch.Tensor, seq: _Sequence) -> int:
        logits = logits[0] + self._allowed
        if seq.request.temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / seq.request.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=seq.generator))

    def _store_full_blocks(self, seq: _Sequence) -> None:
        if self.cache is None:
            return
        full = seq.computed // self.block_size
        if full <= seq.stored_blocks:
            return
        blocks = [self._block_view(seq, i) for i in range(seq.stored_blocks, full)]
        self.cache.store(seq.token_ids(full * self.block_size), blocks, first_block=seq.stored_blocks)
        seq.stored_blocks = full

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self._running if s.request.cancelled.is_set()]:
            self._finish(seq, "cancelled")

    def _finish(self, seq: _Sequence, reason: str, error: str = "") -> None:
        if seq in self._running:
            self._running.remove(seq)
            self._kv_buffers.give(seq.buffer)
            # its activations are freed (and maybe a KV buffer): their measure for the trimmer is its KV size
            self._heap.released(seq.kv.nbytes)
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
