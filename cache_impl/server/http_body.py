"""Request bodies as the server takes them: bounded in size, UTF-8 JSON, shallow, valid Unicode.

Each failure is a client's mistake answered as OpenAI does (`ApiError`), never a 500:
- larger than the limit: 413, decided from Content-Length before any byte is read, and
  while reading a body without one (chunked), so a huge body is never read whole; the
  connection closes after the answer, rather than reading the rest to keep it;
- not UTF-8, not JSON, or JSON's non-standard NaN / Infinity: 400 `invalid_json`;
- a JSON value other than an object (`null`, `1`, `[]`): 400, as every route takes an object;
- nested deeper than `MAX_DEPTH` (Python's parser recurses; past ~1,000 levels it raises
  RecursionError): 400 `invalid_json`;
- a string holding a lone surrogate (`"\\ud800"`: JSON's escapes allow it, UTF-8 cannot
  encode it, so it would fail later in the tokenizer or in the reply): 400 `invalid_unicode`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Optional

from starlette.requests import Request

from cache_impl.server.protocol import ApiError, expect_object

# A request kvgate understands is 5 levels deep (body > messages > message > content > part);
# 32 leaves room for the fields it ignores (tools' JSON schemas) and keeps every later step shallow.
MAX_DEPTH = 32
_DECODE_INLINE_BYTES = 256 * 2**10


class JsonBody:
    """Reads a request's body as JSON, refusing bodies over `limit` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    async def __call__(self, request: Request) -> dict:
        raw = await self.read(request)
        if len(raw) < _DECODE_INLINE_BYTES:
            return expect_object(decode_json(raw))
        return expect_object(await asyncio.to_thread(decode_json, raw))  # tens of ms: let the loop stream

    async def read(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            raise self._too_large(f"Content-Length is {int(declared)} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.limit:
                raise self._too_large(f"more than {self.limit} bytes were sent")
            chunks.append(chunk)
        return b"".join(chunks)

    def _too_large(self, found: str) -> ApiError:
        return ApiError(413, f"the request body is too large: expected at most {self.limit} bytes "
                             f"(the server's max_request_bytes), {found}", code="request_too_large",
                        headers={"Connection": "close"})  # rather than read the rest to keep the connection


def decode_json(raw: bytes) -> object:
    """The JSON document in `raw`, checked for depth and Unicode (see the module's docstring)."""
    try:
        document = json.loads(raw.decode("utf-8"), parse_constant=_no_constants)
    except UnicodeDecodeError as error:
        raise _invalid(f"the request body is not UTF-8 ({error})") from None
    except RecursionError:
        raise _invalid(f"the request body is nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as error:
        raise _invalid(f"the request body is not valid JSON ({error})") from None
    _check_shape(document)
    return document


def _no_constants(name: str) -> None:
    raise ValueError(f"{name} is not a JSON value")


def _invalid(message: str) -> ApiError:
    return ApiError(400, message, code="invalid_json")


_SCALARS = frozenset({int, float, bool, type(None)})


def _check_shape(document: object) -> None:
    """Depth and strings of a parsed document, walked without recursion.

    A stack entry is (value, its parent's entry, its key or index there, depth): the field's
    path is put together only when it is needed for an error.
    """
    stack: list[tuple] = [(document, None, None, 1)]
    while stack:
        entry = stack.pop()
        value, _, _, depth = entry
        if isinstance(value, str):
            _check_text(value, entry)
            continue
        if depth > MAX_DEPTH:
            raise _invalid(f"the request body is nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, entry)
                if type(item) not in _SCALARS:
                    stack.append((item, entry, key, depth + 1))
        elif (
            isinstance(value, list) and not set(map(type, value)) <= _SCALARS
        ):  # a list of token ids is passed over at C speed
            stack.extend((item, entry, index, depth + 1) for index, item in enumerate(value)
                         if type(item) not in _SCALARS)


def _check_text(text: str, entry: tuple) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        param = _param(entry)
        where = f"{param}: " if param else ""
        raise ApiError(400, f"{where}expected valid Unicode text, found a lone surrogate "
                            f"{text[error.start]!r} at character {error.start}",
                       param=param, code="invalid_unicode") from None


def _param(entry: tuple) -> Optional[str]:
    """The dotted path of a stack entry's value (`messages.0.content`), None for the document itself."""
    parts = []
    while entry[1] is not None:
        parts.append(str(entry[2]))
        entry = entry[1]
    return ".".join(reversed(parts)) or None
