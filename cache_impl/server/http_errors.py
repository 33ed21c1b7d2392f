"""Every error a kvgate HTTP app answers, in OpenAI's shape: the embedded server's and the connector's sidecar.

An `ApiError` is answered as raised (a client's mistake: 4xx, never a 500); routing's own answers (no such
route, wrong method) get the same body; anything else is logged and answered as a 500 naming its type.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException  # routing raises starlette's, which fastapi's subclasses

from cache_impl.server.protocol import ApiError


def add_error_handlers(app: FastAPI, logger: str) -> None:
    """Answer `app`'s errors in OpenAI's shape; an unexpected one is logged to `logger` with its traceback."""

    @app.exception_handler(ApiError)
    async def api_error(_: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        """Routing's own answers (no such route, wrong method) in OpenAI's shape too."""
        message = f"{error.detail}: {request.method} {request.url.path}"
        return JSONResponse(ApiError(error.status_code, message).body(), status_code=error.status_code,
                            headers=error.headers)

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception) -> JSONResponse:
        logging.getLogger(logger).exception("%s %s failed", request.method, request.url.path)
        body = ApiError(500, f"internal server error ({type(error).__name__})", "server_error").body()
        return JSONResponse(body, status_code=500)
