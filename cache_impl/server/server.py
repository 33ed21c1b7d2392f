"""OpenAI-compatible streaming server for the embedded engine (FastAPI + uvicorn).

Routes: POST /v1/completions, POST /v1/chat/completions (stream or not),
GET /v1/models, GET /health (with the start-up timeline: process start, weights
loaded and how, ready), GET /metrics (Prometheus text), and with an admin
token the /admin routes (cache_impl/server/admin.py). With an API key, /v1 and /admin
need `Authorization: Bearer KEY`; /health and /metrics never need a secret.
Every client mistake gets a 4xx with OpenAI's error body, a body over
`max_request_bytes` a 413 before it is read whole (cache_impl/server/http_body.py).
Backpressure: when `max_waiting` requests already wait, a new one gets 429
(OpenAI's rate-limit shape); clients retry. A client that disconnects
before its answer is complete, streamed or not, cancels its request, which
frees its batch slot and KV.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from typing import AsyncIterator, Awaitable, Optional, TypeVar

import psutil
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from cache_impl.engine.engine import Engine, FinishEvent, GenerationRequest, QueueFullError, TokenEvent
from cache_impl.platform.thread_pools import loop_offload_pool
from cache_impl.server.admin import EngineOwner, add_admin_routes
from cache_impl.server.auth import secret_matches
from cache_impl.server.http_body import JsonBody
from cache_impl.server.http_errors import add_error_handlers
from cache_impl.server.metrics_export import EngineCollector, RuntimeCollector
from cache_impl.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest, chat_tokens, parse_request

DEFAULT_MAX_TOKENS = 16
T = TypeVar("T")


def create_app(engine: Engine, api_key: Optional[str] = None, admin_token: Optional[str] = None,
               process_start: Optional[float] = None, imports_done: Optional[float] = None) -> FastAPI:
    """The ASGI app; it starts the engine on startup and drains and flushes it on shutdown.

    `admin_token` adds the admin routes (cache_impl/server/admin.py), which refuse requests without it.
    `process_start` (epoch seconds; default: the OS's start time of this process) opens the start-up
    timeline that /health reports: process start, imports done (`imports_done`: Python, torch and the
    engine's modules loaded, when the caller says), weights loaded, ready.
    """
    startup = {"process_start": process_start if process_start is not None else psutil.Process().create_time(),
               "imports_done": imports_done, "weights_loaded": engine.weights_load.finished_at, "ready": None,
               "weights": engine.weights_load.as_dict()}
    app = FastAPI(title="kvgate embedded engine", lifespan=_lifespan(engine, startup))
    add_error_handlers(app, "kvgate.server")
    app.middleware("http")(_api_key_check(api_key))
    routes = _Routes(engine, startup)
    app.get("/health")(routes.health)
    app.get("/v1/models")(routes.models)
    app.get("/metrics")(routes.metrics)
    if admin_token is not None:
        add_admin_routes(app, EngineOwner(engine), admin_token, routes.read_json)
    app.post("/v1/completions")(routes.completions)
    app.post("/v1/chat/completions")(routes.chat_completions)
    return app


def _lifespan(engine: Engine, startup: dict):
    """Start the engine (the timeline's `ready`), then drain it and flush its cache on shutdown."""

    async def lifespan(app: FastAPI):
        # asyncio.to_thread's threads (request bodies decoded off the loop, admin evictions and flushes) started
        # whole now, as many as asyncio's own default makes lazily (cache_impl/platform/thread_pools.py)
        asyncio.get_running_loop().set_default_executor(loop_offload_pool())
        engine.start()
        startup["ready"] = time.time()
        yield
        await asyncio.to_thread(engine.stop)

    return lifespan


def _api_key_check(api_key: Optional[str]):
    """The middleware that refuses /v1 and /admin requests without `api_key` as their bearer token (401)."""

    async def check_api_key(request: Request, call_next):
        if api_key and request.url.path.startswith(("/v1/", "/admin/")):
            bearer = request.headers.get("authorization", "")
            if not (bearer.startswith("Bearer ") and secret_matches(bearer.removeprefix("Bearer "), api_key)):
                error = ApiError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")
                return JSONResponse(error.body(), status_code=401)
        return await call_next(request)

    return check_api_key


class _Routes:
    """One handler per route; what the two generation routes share is `_generate` (checks, submit, answer)."""

    def __init__(self, engine: Engine, startup: dict) -> None:
        self.engine, self.startup = engine, startup
        self.read_json = JsonBody(engine.config.max_request_bytes)
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        ProcessCollector(registry=self.registry)
        self.registry.register(RuntimeCollector())

    async def health(self) -> dict:
        cache = self.engine.cache
        remote = cache.tier("remote").snapshot() if cache is not None and "remote" in cache.tiers else None
        return {"status": "ok", "model": self.engine.model_name, "mode": self.engine.config.mode,
                "pid": os.getpid(), "fingerprint": cache.fingerprint.hex if cache is not None else None,
                "remote": remote, "startup": self.startup}

    async def models(self) -> dict:
        return {"object": "list", "data": [
            {"id": self.engine.model_name, "object": "model", "created": 0, "owned_by": "kvgate",
             "max_model_len": self.engine.max_context},
        ]}

    async def metrics(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def completions(self, request: Request):
        body = parse_request(CompletionRequest, await self.read_json(request))
        return await self._generate(request, body, _prompt_tokens(self.engine.tokenizer, body.prompt), chat=False)

    async def chat_completions(self, request: Request):
        body = parse_request(ChatCompletionRequest, await self.read_json(request))
        return await self._generate(request, body, chat_tokens(self.engine.tokenizer, body.messages), chat=True)

    async def _generate(self, request: Request, body, tokens: list[int], chat: bool):
        max_tokens = self._checked_max_tokens(body, tokens, chat)
        stream = _EventStream()
        job = GenerationRequest(tokens, max_tokens, stream.push_threadsafe, body.temperature, body.seed,
                                ignore_eos=bool(body.ignore_eos))
        self._submit(job, chat)
        shape = _ResponseShape(self.engine.model_name, chat)
        if body.stream:
            return StreamingResponse(shape.sse(stream, job, body.include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _whole_answer(request, stream, job, shape)

    def _checked_max_tokens(self, body, tokens: list[int], chat: bool) -> int:
        """The request's max_tokens, once its model, its options and its length are checked (4xx otherwise)."""
        engine = self.engine
        if body.model != engine.model_name:
            raise ApiError(404, f"model: the model '{body.model}' does not exist (this server has "
                                f"'{engine.model_name}')", param="model", code="model_not_found")
        body.check_supported()
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens or DEFAULT_MAX_TOKENS
        if len(tokens) + max_tokens > engine.max_context:
            raise ApiError(400, f"this model's maximum context length is {engine.max_context} tokens; the "
                                f"prompt has {len(tokens)} and max_tokens is {max_tokens}",
                           param="messages" if chat else "prompt", code="context_length_exceeded")
        return max_tokens

    def _submit(self, job: GenerationRequest, chat: bool) -> None:
        """Queue `job`: a prompt the engine refuses is a 400, a full queue a 429."""
        try:
            self.engine.submit(job)
        except ValueError as error:  # an empty prompt, or one that cannot fit
            raise ApiError(400, f"prompt: {error}", param="messages" if chat else "prompt") from None
        except QueueFullError as error:
            raise ApiError(429, f"the server is busy ({error}); retry later", "rate_limit_error",
                           code="rate_limit_exceeded") from None


def _prompt_tokens(tokenizer, prompt) -> list[int]:
    """A completion request's prompt as token ids: text (a string, or a list of one) or ids."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise ApiError(400, "prompt: only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt) if prompt else []  # "" is as empty as []
    return list(prompt)   # ids outside the vocabulary: the scheduler refuses them at admission (400)


async def _whole_answer(request: Request, stream: "_EventStream", job: GenerationRequest, shape: "_ResponseShape"):
    """A non-streamed answer: the whole response, 499 when the client went away first (its request cancelled)."""
    try:
        answer = await _unless_disconnected(request, stream.collect())
    finally:
        job.cancelled.set()  # a no-op when finished; frees the slot when the client went away
    if answer is None:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it
    text, finish = answer
    if finish.finish_reason == "error":
        raise ApiError(500, f"the engine failed: {finish.error}", "server_error")
    return shape.full(text, finish)


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> Optional[T]:
    """`work`'s result, or None (`work` cancelled) as soon as the client disconnects, its body read: a
    non-streamed answer is not waited for by anyone then (a streamed one is cancelled by its response)."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    working, watching = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((working, watching), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not working.done():
            working.cancel()
    return working.result() if working.done() and not working.cancelled() else None


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
            # the finish chunk carries its text even when empty, as vLLM's does: an answer whose first token was
            # end-of-text still shows a client when that token came (its first-token time)
            content = ({"role": "assistant", "content": ""} if role else
                       {"content": text or ""} if text or finish_reason else {})
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
