"""The embedded inference engine: continuous batching over the small model, KV reuse through the cache.

One thread owns the model. Each step it admits waiting requests (loading their longest cached
prefix), runs one prefill chunk of one request, then one decode step for every request that is
generating, so long prefills never stall running decodes. Requests join and leave between steps.

`Engine` is the façade the server and the benches use; the pieces behind it, as in nano-vllm:
- `engine_loop.py`: the engine's thread, step by step (start, prefill, decode, emit, finish; failures);
- `scheduler.py`: which requests run next (admission, cancel, the step's batch): decisions, no tensors;
- `model_runner.py`: forward passes, sampling and the KV buffers (`kvbuffers.py`) they run in;
- `prefix_cache.py`: a sequence's KV loaded from and stored to the tiered cache;
- `generation.py`, `sequence.py`: what a caller asks and is answered, and a running request's state.
Greedy output is bit-for-bit the same in every cache mode (see `model_runner.py`).
"""

from __future__ import annotations

import collections
import threading
import time
from pathlib import Path
from typing import Any, Literal, Optional

import torch
from pydantic import Field, ValidationError, field_validator, model_validator

from cache_impl.cache.config import CacheConfig, ConfigError, Count, StrictModel, format_validation_error, parse_size
from cache_impl.cache.keys import Fingerprint, KVLayout
from cache_impl.cache.manager import TieredKVCache, resolve_device
from cache_impl.engine.engine_loop import EngineLoop
from cache_impl.engine.generation import FinishEvent, Generation, GenerationRequest, QueueFullError, TokenEvent
from cache_impl.engine.model import DEFAULT_PRESET, Transformer, weights_digest
from cache_impl.engine.model_runner import ModelRunner
from cache_impl.engine.prefix_cache import PrefixCache
from cache_impl.engine.presets import MAX_WEIGHTS_SEED, ModelArgs, PresetName
from cache_impl.engine.resident import resident_bytes
from cache_impl.engine.scheduler import Scheduler
from cache_impl.engine.tokenizer import ByteTokenizer
from cache_impl.engine.weights import WeightsLoad, load_weights, seeded_weights
from kvcore.loader_names import KVGATE_LOADER, LoaderName

__all__ = ["Engine", "EngineConfig", "FinishEvent", "Generation", "GenerationRequest", "QueueFullError",
           "TokenEvent"]

CacheMode = Literal["recompute", "device-only", "tiered"]
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "kvgate" / "kv"
KV_DTYPE = "float32"        # the embedded model computes, and keeps its KV, in float32


def kv_layout(cache: CacheConfig, args: ModelArgs) -> KVLayout:
    """The embedded model's KV in `cache`'s blocks: the layout the engine keys and stores."""
    return cache.layout(args.n_layers, args.n_kv_heads, args.head_dim, KV_DTYPE)


class EngineConfig(StrictModel):
    """The engine: model preset and seed, cache mode, batching limits and the cache itself."""

    mode: CacheMode = Field(default="tiered", description="recompute, device-only (device tier only) or tiered")
    preset: PresetName = Field(default=DEFAULT_PRESET, description="model size preset")
    seed: int = Field(default=0, ge=0, le=MAX_WEIGHTS_SEED, description="weights seed (part of the cache fingerprint)")
    weights: Optional[Path] = Field(default=None, description="a safetensors directory to load the weights from "
                                    "(kvgate export-weights writes one; its metadata names the preset); "
                                    "default: weights from the seed")
    load_format: LoaderName = Field(default=KVGATE_LOADER, description="the loader of `weights`: kvgate (its own, "
                                    "parallel O_DIRECT reads at the storage's best), safetensors (what engines do by "
                                    "default), runai_streamer or fastsafetensors")
    load_concurrency: int = Field(default=16, ge=1, le=256, description="the loaders' reads in flight (kvgate) or "
                                  "read threads (the streamers)")
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

    def __init__(self, config: EngineConfig, device: torch.device | None = None,
                 threads: Optional[int] = None) -> None:
        """`threads`: torch's thread count on the engine's thread (default: the caller's)."""
        self.config = config
        threads = threads or torch.get_num_threads()
        self.device = device or resolve_device(config.cache.device)
        self.tokenizer = ByteTokenizer()
        self.model, self.weights_load = self._weights(config)
        args = self.model.args
        self.model_name = f"kvgate-{self.weights_load.preset}"
        self.max_context = args.max_seq_len
        self.layout = kv_layout(config.cache, args)
        self.block_size = self.layout.block_size
        self.fingerprint = Fingerprint(weights_digest(self.model), self.tokenizer.id, self.layout)
        cache_config = config.cache_for_mode()
        self.cache = TieredKVCache(cache_config, self.fingerprint, self.device) if cache_config else None
        self.counters: collections.Counter[str] = collections.Counter()
        self.scheduler = Scheduler(config.max_running, config.max_waiting, self.max_context, args.vocab_size)
        self.runner = ModelRunner(self.model, self.device, self.block_size, max_idle_buffers=config.max_running)
        self.prefix_cache = PrefixCache(self.cache, self.block_size, self.counters)
        self._loop = EngineLoop(self.scheduler, self.runner, self.prefix_cache, self.tokenizer, self.counters,
                                threads)
        self._thread = threading.Thread(target=self._loop.run, name="kvgate-engine", daemon=True)

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

    def _kv_buffer_figures(self) -> dict:
        """The KV buffers of the running requests, of the one being started and those kept for reuse (a buffer
        that outlived its request without coming back, a leak, is in none): their bytes, their pages in RAM now,
        and the most they may hold by design."""
        # read from another thread while the engine moves a buffer kept -> starting -> running -> kept: read in
        # that order, so a buffer moving on is seen again further on rather than missed, and counted once
        starting = self._loop.starting
        in_use = [seq.buffer for seq in (starting, *self.scheduler.running) if seq is not None]
        buffers = list({id(b): b for b in (*in_use, *self.runner.kv_buffers.idle())}.values())
        return {"kv_buffer_bytes": sum(b.nbytes for b in buffers),
                "kv_buffer_resident_bytes": resident_bytes(buffers),
                "kv_buffer_limit_bytes": self.runner.kv_buffers_limit(self.scheduler.max_running, self.max_context)}

    def snapshot(self) -> dict:
        return {
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "counters": dict(self.counters),
            **self._kv_buffer_figures(),
            "cache": self.cache.snapshot() if self.cache is not None else None,
        }
