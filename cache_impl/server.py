"""OpenAI-compatible streaming server for the embedded engine (FastAPI + uvicorn).

Routes: POST /v1/completions, POST /v1/chat/completions (stream or not),
GET /v1/models, GET /health, GET /metrics (Prometheus text).
Backpressure: when `max_waiting` requests already wait, a new one gets 429
(OpenAI's rate-limit shape); clients retry. A client that disconnects
mid-stream cancels its request, which frees its batch slot and KV.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .engine import Engine, FinishEvent, GenerationRequest, QueueFullError, TokenEvent
from .metrics_export import EngineCollector
from .protocol import ApiError, ChatCompletionRequest, CompletionRequest, parse_request
from .tokenizer import ChatMessage

DEFAULT_MAX_TOKENS = 16


def create_app(engine: Engine, api_key: Optional[str] = None, admin: bool = False) -> FastAPI:
    """The ASGI app; it starts the engine on startup and drains and flushes it on shutdown.

    `admin` adds POST /admin/cache/{evict,drop-page-cache,flush,locate}, which the gates use to
    place a prefix in a known tier before measuring (e.g. a cold disk hit) and to find its stored
    blocks, and /admin/faults (GET, POST to arm, DELETE to clear) for disk I/O fault injection.
    """

    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="kvgate embedded engine", lifespan=lifespan)
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    ProcessCollector(registry=registry)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if api_key and request.url.path.startswith(("/v1/", "/admin/")):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                error = ApiError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")
                return JSONResponse(error.body(), status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict:
        fingerprint = engine.cache.fingerprint.hex if engine.cache is not None else None
        pooled = engine.cache is not None and "remote" in engine.cache.tiers
        remote = engine.cache.tier("remote").snapshot() if pooled else None
        return {"status": "ok", "model": engine.model_name, "mode": engine.config.mode, "pid": os.getpid(),
                "fingerprint": fingerprint, "remote": remote}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [
            {"id": engine.model_name, "object": "model", "created": 0, "owned_by": "kvgate",
             "max_model_len": engine.max_context},
        ]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    if admin:
        _add_admin_routes(app, engine)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse_request(CompletionRequest, await _json(request))
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, "prompt: only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            tokens = engine.tokenizer.encode(prompt)
        else:
            tokens = list(prompt)
            if any(t < 0 or t >= engine.tokenizer.vocab_size for t in tokens):
                raise ApiError(400, f"prompt: token ids must be in [0, {engine.tokenizer.vocab_size})", param="prompt")
        return await _generate(request, body, tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = parse_request(ChatCompletionRequest, await _json(request))
        return await _generate(request, body, _chat_tokens(engine, body.messages), chat=True)

    async def _generate(request: Request, body, tokens: list[int], chat: bool):
        if body.model != engine.model_name:
            raise ApiError(404, f"model: the model '{body.model}' does not exist (this server has "
                                f"'{engine.model_name}')", param="model", code="model_not_found")
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens or DEFAULT_MAX_TOKENS
        if len(tokens) + max_tokens > engine.max_context:
            raise ApiError(400, f"this model's maximum context length is {engine.max_context} tokens; the "
                                f"prompt has {len(tokens)} and max_tokens is {max_tokens}",
                           param="messages" if chat else "prompt", code="context_length_exceeded")
        stream = _EventStream()
        job = GenerationRequest(tokens, max_tokens, stream.push_threadsafe, body.temperature, body.seed)
        try:
            engine.submit(job)
        except ValueError as error:  # an empty prompt, or one that cannot fit
            raise ApiError(400, f"prompt: {error}", param="messages" if chat else "prompt") from None
        except QueueFullError as error:
            raise ApiError(429, f"the server is busy ({error}); retry later", "rate_limit_error",
                           code="rate_limit_exceeded") from None
        shape = _ResponseShape(engine.model_name, chat)
        if body.stream:
            return StreamingResponse(shape.sse(stream, job, body.include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            text, finish = await stream.collect()
        except asyncio.CancelledError:
            job.cancelled.set()
            raise
        if finish.finish_reason == "error":
            raise ApiError(500, f"the engine failed: {finish.error}", "server_error")
        return shape.full(text, finish)

    return app


def _add_admin_routes(app: FastAPI, engine: Engine) -> None:
    def cache():
        if engine.cache is None:
            raise ApiError(409, f"mode {engine.config.mode} has no cache", code="no_cache")
        return engine.cache

    @app.post("/admin/cache/evict")
    async def evict(request: Request) -> dict:
        body = await _json(request)
        tiers = body.get("tiers") if isinstance(body, dict) else None
        if not isinstance(tiers, list) or not all(t in ("device", "host") for t in tiers):
            raise ApiError(400, "tiers: expected a list of 'device' and/or 'host'", param="tiers")
        evicted = {}
        for tier in tiers:
            if tier in cache().tiers:
                evicted[tier] = await asyncio.to_thread(cache().evict, tier)
        return {"evicted": evicted}

    @app.post("/admin/cache/flush")
    async def flush() -> dict:
        return {"flushed": await asyncio.to_thread(cache().flush, 60.0)}

    @app.post("/admin/cache/drop-page-cache")
    async def drop_page_cache() -> dict:
        if "disk" not in cache().tiers:
            raise ApiError(409, "no disk tier", code="no_disk_tier")
        await asyncio.to_thread(cache().flush, 60.0)
        await asyncio.to_thread(cache().tier("disk").drop_page_cache)
        return {"dropped": True}


    @app.post("/admin/cache/locate")
    async def locate(request: Request) -> dict:
        body = await _json(request)
        if isinstance(body, dict) and isinstance(body.get("prompt"), str):
            tokens = engine.tokenizer.encode(body["prompt"])
        elif isinstance(body, dict) and isinstance(body.get("messages"), list):
            chat = parse_request(ChatCompletionRequest, {"model": engine.model_name, "messages": body["messages"]})
            tokens = _chat_tokens(engine, chat.messages)
        else:
            raise ApiError(400, "expected a JSON object with 'prompt' (a string) or 'messages' (a list)",
                           param="prompt")
        store = cache()
        disk = store.tier("disk") if "disk" in store.tiers else None
        blocks = [{"index": i, "key": key.hex(), "tiers": store.where(key),
                   "path": str(disk.path_for(key)) if disk is not None else None}
                  for i, key in enumerate(store.keys_for(tokens))]
        return {"prompt_tokens": len(tokens), "block_size": store.block_size, "blocks": blocks}

    def faults():
        if engine.cache is None or "disk" not in engine.cache.tiers:
            raise ApiError(409, "no disk tier to inject faults into", code="no_disk_tier")
        return engine.cache.tier("disk").faults

    @app.get("/admin/faults")
    async def show_faults() -> dict:
        return faults().snapshot()

    @app.post("/admin/faults")
    async def arm_fault(request: Request) -> dict:
        body = await _json(request)
        if not isinstance(body, dict) or set(body) - {"kind", "duration_s", "delay_ms"}:
            raise ApiError(400, "expected a JSON object with kind, and optionally duration_s and delay_ms, found "
                                f"{sorted(body) if isinstance(body, dict) else type(body).__name__}", param="kind")
        numbers = {k: body.get(k) for k in ("duration_s", "delay_ms")}
        for name, value in numbers.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ApiError(400, f"{name}: expected a number, found {value!r}", param=name)
        if body.get("kind") == "slow_disk" and not (numbers["delay_ms"] or 0) > 0:
            raise ApiError(400, f"delay_ms: expected a delay > 0 for slow_disk, found {numbers['delay_ms']!r}",
                           param="delay_ms")
        try:
            faults().arm(str(body.get("kind")), numbers["duration_s"], (numbers["delay_ms"] or 0) / 1e3)
        except ValueError as error:
            raise ApiError(400, str(error), param=str(error).split(":")[0]) from None
        return faults().snapshot()

    @app.delete("/admin/faults")
    async def clear_faults() -> dict:
        faults().clear()
        return faults().snapshot()


def _chat_tokens(engine: Engine, messages) -> list[int]:
    """The prompt tokens of validated chat messages (a developer message counts as the system's)."""
    turns = [ChatMessage("system" if m.role == "developer" else m.role, m.text()) for m in messages]
    return engine.tokenizer.apply_chat_template(turns)


async def _json(request: Request) -> object:
    try:
        return json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as error:
        raise ApiError(400, f"the request body is not valid JSON ({error})", code="invalid_json") from None


class _EventStream:
    """Engine events (from the engine thread) handed to the request's event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def push_threadsafe(self, event: TokenEvent | FinishEvent) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def events(self) -> AsyncIterator[TokenEvent | FinishEvent]:
        while True:
            event = await self.queue.get()
            yield event
            if isinstance(event, FinishEvent):
                return

    async def collect(self) -> tuple[str, FinishEvent]:
        pieces = []
        async for event in self.events():
            if isinstance(event, TokenEvent):
                pieces.append(event.text)
            else:
                pieces.append(event.text)
                return "".join(pieces), event
        raise RuntimeError("event stream ended without a finish event")


class _ResponseShape:
    """OpenAI response objects for completions and chat completions, whole or as SSE chunks."""

    def __init__(self, model: str, chat: bool) -> None:
        self.model, self.chat = model, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _envelope(self, choices: list, usage: Optional[dict] = None, chunk: bool = False) -> dict:
        obj = self.object + (".chunk" if chunk and self.chat else "")
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None or not chunk:
            out["usage"] = usage
        return out

    def _choice(self, text: Optional[str], finish_reason: Optional[str], delta: bool, role: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        if delta:
            content = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            return {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}

    @staticmethod
    def usage(finish: FinishEvent) -> dict:
        return {
            "prompt_tokens": finish.prompt_tokens, "completion_tokens": finish.completion_tokens,
            "total_tokens": finish.prompt_tokens + finish.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": finish.cached_tokens},
        }

    @staticmethod
    def _reason(finish: FinishEvent) -> str:
        return finish.finish_reason if finish.finish_reason in ("stop", "length") else "abort"

    def full(self, text: str, finish: FinishEvent) -> dict:
        return self._envelope([self._choice(text, self._reason(finish), delta=False)], self.usage(finish))

    async def sse(self, stream: _EventStream, job: GenerationRequest, include_usage: bool) -> AsyncIterator[str]:
        try:
            if self.chat:
                yield _sse(self._envelope([self._choice(None, None, delta=True, role=True)], chunk=True))
            async for event in stream.events():
                if isinstance(event, TokenEvent):
                    if event.text:
                        yield _sse(self._envelope([self._choice(event.text, None, delta=True)], chunk=True))
                    continue
                if event.finish_reason == "error":
                    yield _sse(ApiError(500, f"the engine failed: {event.error}", "server_error").body())
                    break
                yield _sse(self._envelope([self._choice(event.text, self._reason(event), delta=True)], chunk=True))
                if include_usage:
                    yield _sse(self._envelope([], self.usage(event), chunk=True))
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled.set()  # a no-op when finished; frees the slot when the client went away


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
