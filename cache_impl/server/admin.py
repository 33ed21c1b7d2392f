"""The admin routes the gates use to place a prefix in a known tier and to inject disk faults.

POST /admin/cache/{evict,flush,drop-page-cache,locate}: place a prefix before measuring (e.g. a
cold disk hit) and find its stored blocks; /admin/faults (GET, POST to arm, DELETE to clear):
disk I/O fault injection. Every route needs the admin token in the `X-Kvgate-Admin-Token`
header (cache_impl/server/auth.py): 401 without it, 403 with another.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Awaitable, Callable, Optional, Protocol

from fastapi import APIRouter, Depends, FastAPI, Request

from cache_impl.cache.faults import FAULT_LIMITS
from cache_impl.server.auth import ADMIN_TOKEN_HEADER, secret_matches
from cache_impl.server.http_body import JsonBody
from cache_impl.server.protocol import ApiError, ChatCompletionRequest, chat_tokens, parse_request

if TYPE_CHECKING:
    from cache_impl.cache.manager import TieredKVCache
    from cache_impl.engine.engine import Engine


class CacheOwner(Protocol):
    """What the admin routes act on: a cache (None when there is none, `no_cache` says why) and the token ids of
    a request body's prompt (the embedded engine; vLLM with kvgate's connector)."""

    @property
    def cache(self) -> Optional["TieredKVCache"]: ...

    def no_cache(self) -> str: ...

    def prompt_tokens(self, body: dict) -> list[int]: ...


class EngineOwner:
    """The embedded engine as the owner of the admin routes' cache."""

    def __init__(self, engine: "Engine") -> None:
        self.engine = engine

    @property
    def cache(self) -> Optional["TieredKVCache"]:
        return self.engine.cache

    def no_cache(self) -> str:
        return f"mode {self.engine.config.mode} has no cache"

    def prompt_tokens(self, body: dict) -> list[int]:
        engine = self.engine
        if isinstance(body.get("prompt"), str):
            return engine.tokenizer.encode(body["prompt"])
        if isinstance(body.get("messages"), list):
            chat = parse_request(ChatCompletionRequest, {"model": engine.model_name, "messages": body["messages"]})
            return chat_tokens(engine.tokenizer, chat.messages)
        raise ApiError(400, "expected a JSON object with 'prompt' (a string) or 'messages' (a list)", param="prompt")


def add_admin_routes(app: FastAPI, owner: CacheOwner, token: str, read_json: JsonBody) -> None:
    """Add the admin routes to `app`, each refusing a request without `token`."""
    routes = _AdminRoutes(owner, read_json)
    router = APIRouter(prefix="/admin", dependencies=[Depends(_token_check(token))])
    router.post("/cache/evict")(routes.evict)
    router.post("/cache/flush")(routes.flush)
    router.post("/cache/drop-page-cache")(routes.drop_page_cache)
    router.post("/cache/locate")(routes.locate)
    router.get("/faults")(routes.show_faults)
    router.post("/faults")(routes.arm_fault)
    router.delete("/faults")(routes.clear_faults)
    app.include_router(router)


def _token_check(token: str) -> Callable[[Request], Awaitable[None]]:
    """The dependency every admin route has: 401 without the token's header, 403 with another token. A
    coroutine: FastAPI runs a plain function dependency on AnyIO's worker threads, one more thread for each
    admin call that overlaps another (a G4 fault's calls made the server's threads climb)."""

    async def require_token(request: Request) -> None:
        given = request.headers.get(ADMIN_TOKEN_HEADER)
        if given is None:
            raise ApiError(401, f"the admin routes need the admin token in the {ADMIN_TOKEN_HEADER} header",
                           "authentication_error", code="missing_admin_token")
        if not secret_matches(given, token):
            raise ApiError(403, f"the {ADMIN_TOKEN_HEADER} header does not hold this server's admin token",
                           "permission_error", code="invalid_admin_token")

    return require_token


class _AdminRoutes:
    """One handler per admin route; `_cache` and `_faults` are the 409s of a server without what a route acts on."""

    def __init__(self, owner: CacheOwner, read_json: JsonBody) -> None:
        self.owner, self.read_json = owner, read_json

    def _cache(self) -> "TieredKVCache":
        if self.owner.cache is None:
            raise ApiError(409, self.owner.no_cache(), code="no_cache")
        return self.owner.cache

    def _faults(self):
        if self.owner.cache is None or "disk" not in self.owner.cache.tiers:
            raise ApiError(409, "no disk tier to inject faults into", code="no_disk_tier")
        return self.owner.cache.faults

    async def evict(self, request: Request) -> dict:
        tiers = (await self.read_json(request)).get("tiers")
        if not isinstance(tiers, list) or not all(t in ("device", "host") for t in tiers):
            raise ApiError(400, "tiers: expected a list of 'device' and/or 'host'", param="tiers")
        evicted = {}
        for tier in tiers:
            if tier in self._cache().tiers:
                evicted[tier] = await asyncio.to_thread(self._cache().evict, tier)
        return {"evicted": evicted}

    async def flush(self) -> dict:
        return {"flushed": await asyncio.to_thread(self._cache().flush, 60.0)}

    async def drop_page_cache(self) -> dict:
        cache = self._cache()
        if "disk" not in cache.tiers:
            raise ApiError(409, "no disk tier", code="no_disk_tier")
        await asyncio.to_thread(cache.flush, 60.0)
        await asyncio.to_thread(cache.drop_page_cache)
        return {"dropped": True}

    async def locate(self, request: Request) -> dict:
        tokens = self.owner.prompt_tokens(await self.read_json(request))
        store = self._cache()
        disk = store.disk_tier()
        blocks = [{"index": i, "key": key.hex(), "tiers": store.where(key),
                   "path": str(disk.path_for(key)) if disk is not None else None}
                  for i, key in enumerate(store.keys_for(tokens))]
        return {"prompt_tokens": len(tokens), "block_size": store.block_size, "blocks": blocks}

    async def show_faults(self) -> dict:
        return self._faults().snapshot()

    async def arm_fault(self, request: Request) -> dict:
        kind, duration_s, delay_ms = _fault_arguments(await self.read_json(request))
        try:
            self._faults().arm(kind, duration_s, delay_ms / 1e3)
        except ValueError as error:
            raise ApiError(400, str(error), param=str(error).split(":")[0]) from None
        return self._faults().snapshot()

    async def clear_faults(self) -> dict:
        self._faults().clear()
        return self._faults().snapshot()


def _fault_arguments(body: dict) -> tuple[str, Optional[float], float]:
    """A POST /admin/faults body as (kind, duration_s or None, delay_ms), each checked (400 naming the field)."""
    if set(body) - {"kind", "duration_s", "delay_ms"}:
        raise ApiError(400, "expected a JSON object with kind, and optionally duration_s and delay_ms, found "
                            f"{sorted(body)}", param="kind")
    numbers = {k: body.get(k) for k in ("duration_s", "delay_ms")}
    for name, value in numbers.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ApiError(400, f"{name}: expected a number, found {value!r}", param=name)
        if value is not None and value > FAULT_LIMITS[name]:
            raise ApiError(400, f"{name}: expected at most {FAULT_LIMITS[name]}, found {value!r}", param=name)
    if body.get("kind") == "slow_disk" and not (numbers["delay_ms"] or 0) > 0:
        raise ApiError(400, f"delay_ms: expected a delay > 0 for slow_disk, found {numbers['delay_ms']!r}",
                       param="delay_ms")
    return str(body.get("kind")), numbers["duration_s"], numbers["delay_ms"] or 0
