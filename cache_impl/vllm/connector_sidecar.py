"""The admin sidecar of kvgate's connector inside vLLM: kvgate's admin routes and /metrics for that cache.

vLLM serves its own API; the cache under it lives in vLLM's engine process, so the connector serves,
on its own loopback port (`admin_port` in the connector's extra config), what `kvgate serve --admin`
serves for its cache: POST /admin/cache/{evict,flush,drop-page-cache,locate}, /admin/faults (behind
the admin token, cache_impl/server/admin.py), GET /metrics (kvgate_cache_* per tier, and the connector's
own counters, the process's memory) and GET /health. The gates reach it through the `vllm` engine profile with
`cache_layer: kvgate` (engines/kvgate_connector.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import TYPE_CHECKING, Callable, Optional

import uvicorn
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from tokenizers import Tokenizer

from cache_impl.platform.thread_pools import loop_offload_pool
from cache_impl.server.admin import add_admin_routes
from cache_impl.server.http_body import JsonBody
from cache_impl.server.http_errors import add_error_handlers
from cache_impl.server.metrics_export import CacheCollector, RuntimeCollector
from cache_impl.server.protocol import ApiError

if TYPE_CHECKING:
    from cache_impl.cache.manager import TieredKVCache

MAX_BODY_BYTES = 64 * 2**20


class ConnectorOwner:
    """The connector's cache as the admin routes' subject; prompts are token ids, or text by its tokenizer."""

    def __init__(self, cache: "TieredKVCache", tokenizer_dir: Optional[str]) -> None:
        self._cache = cache
        self._tokenizer_dir = tokenizer_dir
        self._tokenizer: Optional[Tokenizer] = None

    @property
    def cache(self) -> "TieredKVCache":
        return self._cache

    def no_cache(self) -> str:
        return "the connector has no cache"

    def prompt_tokens(self, body: dict) -> list[int]:
        ids = body.get("prompt_token_ids")
        if isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            return ids
        if isinstance(body.get("prompt"), str):
            return self._tokenize(body["prompt"])
        raise ApiError(400, "expected a JSON object with 'prompt_token_ids' (a list of token ids) or 'prompt' (a "
                            "string, tokenized as vLLM's completions route does)", param="prompt")

    def _tokenize(self, text: str) -> list[int]:
        if self._tokenizer is None:
            path = os.path.join(self._tokenizer_dir or "", "tokenizer.json")
            if not os.path.isfile(path):
                raise ApiError(409, f"no tokenizer.json in {self._tokenizer_dir!r}: send prompt_token_ids",
                               code="no_tokenizer")

            self._tokenizer = Tokenizer.from_file(path)
        return self._tokenizer.encode(text).ids


def sidecar_app(owner: ConnectorOwner, token: str, counters: Callable[[], dict]) -> FastAPI:
    app = FastAPI(title="kvgate connector sidecar")
    registry = CollectorRegistry()
    registry.register(CacheCollector(owner.cache.snapshot, counters))
    ProcessCollector(registry=registry)      # vLLM's worker process: its KV and the host tier live in it
    registry.register(RuntimeCollector())

    add_error_handlers(app, "kvgate.connector")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "pid": os.getpid(), "tiers": owner.cache.tiers,
                "fingerprint": owner.cache.fingerprint.hex}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    add_admin_routes(app, owner, token, JsonBody(MAX_BODY_BYTES))
    return app


class Sidecar:
    """uvicorn serving `sidecar_app` on a daemon thread of vLLM's engine process."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        # vLLM owns the process's signals: uvicorn (0.29 on) takes them only when it serves on the main thread
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self._serve, name="kvgate-sidecar", daemon=True)
        self.thread.start()
        logging.getLogger("kvgate.connector").info("kvgate connector sidecar on http://%s:%d", host, port)

    def _serve(self) -> None:
        """uvicorn on a loop of this thread's own, whose `asyncio.to_thread` threads are started whole."""
        loop = asyncio.new_event_loop()
        loop.set_default_executor(loop_offload_pool())
        try:
            loop.run_until_complete(self.server.serve())
        finally:
            loop.close()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
