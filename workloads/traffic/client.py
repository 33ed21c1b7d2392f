"""The streaming client: the one definition of TTFT, ITL, TPOT and E2E (vLLM's benchmark semantics).

How it works: docs/methods/measurement.md (workloads/traffic/client.py).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from http.client import HTTPConnection, HTTPException, HTTPSConnection
from pathlib import Path
from typing import Iterable, Literal, Optional
from urllib.parse import urlsplit

from workloads.traffic.errors import CONNECTION_ERRORS
from workloads.traffic.requests import WorkloadRequest
from workloads.traffic.target_json import (
    BadResponse,
    json_object,
    optional_count,
    optional_list,
    optional_object,
    optional_text,
    required_list,
    required_text,
)


@dataclass
class RequestRecord:
    """Everything measured about one request; appended to the run's raw data when it completes."""

    request_id: str
    session_id: str
    turn: int
    target: str
    scheduled_at: float              # wall clock (s) when the request was due
    sent_at: float                   # wall clock (s) when it was sent
    client_wait_s: float             # sent_at - scheduled_at: time the request waited in the client
    ok: bool = False
    error_type: Optional[str] = None  # see workloads.traffic.errors: http_<status> / connection_refused / timeout / …
    error_message: Optional[str] = None
    http_status: Optional[int] = None
    ttft_s: Optional[float] = None
    e2e_s: Optional[float] = None
    tpot_s: Optional[float] = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: Optional[int] = None
    completion_tokens: Optional[int] = None
    cached_tokens: Optional[int] = None
    content_chunks: int = 0
    token_chunks: int = 0  # chunks carrying a token, its text perhaps empty (vLLM streams undecoded bytes so)
    tokens_from_usage: bool = False
    finish_reason: Optional[str] = None
    worker: str = ""
    node: Optional[str] = None        # the node (base URL) that served it, when a target has several
    text: Optional[str] = None        # the generated text, only when asked for (consistency probes)
    # each token's chunk's arrival (s after sending), text or not, only when asked for (the decode probe: a server
    # that streams a token whose bytes do not decode yet as empty text still sends its chunk at its step)
    token_times_s: Optional[list[float]] = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


@dataclass
class StreamMetrics:
    ttft_s: Optional[float]
    e2e_s: Optional[float]
    itl_s: list[float]
    tpot_s: Optional[float]
    content_chunks: int
    prompt_tokens: Optional[int]
    completion_tokens: Optional[int]
    cached_tokens: Optional[int]
    tokens_from_usage: bool
    finish_reason: Optional[str]
    done: bool
    error: Optional[str]
    error_type: Optional[str] = None   # "stream_error" (an error chunk, unparseable data) or "bad_response"
    text: str = ""
    token_chunks: int = 0              # chunks carrying a token, text or not (not the role's announcement)
    token_times: list[float] = field(default_factory=list)   # their arrivals, s after sending


@dataclass(frozen=True)
class _Chunk:
    """What one SSE chunk says, its fields type-checked (`workloads.traffic.target_json`)."""

    text: str
    finish_reason: Optional[str]
    usage: Optional["_Usage"]
    error: Optional[str]
    token: bool = False          # carries a generated token, its text perhaps empty (not the role's announcement)


@dataclass(frozen=True)
class _Usage:
    prompt_tokens: Optional[int]
    completion_tokens: Optional[int]
    cached_tokens: Optional[int]


def _read_chunk(payload: object) -> _Chunk:
    """A chunk's generated text ("" for role-only, empty or usage-only chunks), finish reason, usage and error.

    BadResponse (naming the field) when a field has the wrong type: choices, delta, content / text,
    finish_reason, usage's counts and cached tokens.
    """
    payload = json_object(payload, "SSE data")
    choices = optional_list(payload, "choices", "choices")
    error = payload.get("error")
    if error is not None and not choices:
        message = error.get("message", error) if isinstance(error, dict) else error
        return _Chunk("", None, None, str(message)[:300])
    text, finish, token = "", None, False
    for i, choice in enumerate(choices or []):
        where = f"choices[{i}]"
        json_object(choice, where)
        delta = optional_object(choice, "delta", f"{where}.delta")
        piece = (optional_text(delta, "content", f"{where}.delta.content") if delta is not None
                 else optional_text(choice, "text", f"{where}.text"))
        text += piece or ""
        token = token or bool(piece) or (piece is not None and not (delta or {}).get("role"))
        finish = finish or optional_text(choice, "finish_reason", f"{where}.finish_reason")
    return _Chunk(text, finish, _read_usage(payload), None, token)


def _read_usage(payload: dict) -> Optional[_Usage]:
    usage = optional_object(payload, "usage", "usage")
    if not usage:
        return None
    details = optional_object(usage, "prompt_tokens_details", "usage.prompt_tokens_details")
    return _Usage(optional_count(usage, "prompt_tokens", "usage.prompt_tokens"),
                  optional_count(usage, "completion_tokens", "usage.completion_tokens"),
                  optional_count(details, "cached_tokens", "usage.prompt_tokens_details.cached_tokens")
                  if details is not None else None)


def measure_stream(lines: Iterable[tuple[float, str]], sent: float) -> StreamMetrics:
    """Figures from SSE lines, each with the monotonic time it arrived; `sent` is when the request left.

    A chunk with a field of the wrong type makes the stream a `bad_response` (its first such field
    named in `error`); an error chunk or unparseable data a `stream_error`. Either way the stream is
    read on to its end, so the connection can be reused.
    """
    content_times: list[float] = []
    first_token: Optional[float] = None
    token_times: list[float] = []
    pieces: list[str] = []
    last_time = sent
    usage: Optional[_Usage] = None
    finish, done, error, error_type = None, False, None, None
    for arrived, line in lines:
        line = line.strip()
        if not line.startswith("data:"):
            continue
        last_time = arrived
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        try:
            chunk = _read_chunk(json.loads(data))
        except BadResponse as bad:
            if error_type != "bad_response":
                error, error_type = str(bad)[:300], "bad_response"
            continue
        except ValueError:
            error, error_type = error or f"unparseable SSE data: {data[:80]!r}", error_type or "stream_error"
            continue
        if chunk.error is not None:
            error, error_type = error or chunk.error, error_type or "stream_error"
            continue
        if chunk.text:
            content_times.append(arrived)
            pieces.append(chunk.text)
        if chunk.token:
            token_times.append(arrived - sent)
            first_token = arrived if first_token is None else first_token
        finish = chunk.finish_reason or finish
        usage = chunk.usage or usage
    first = content_times[0] if content_times else first_token
    ttft = first - sent if first is not None else None
    e2e = (content_times[-1] if content_times else last_time) - sent
    itl = [b - a for a, b in zip(content_times, content_times[1:])]
    completion = usage.completion_tokens if usage else len(content_times)
    tpot = (e2e - ttft) / (completion - 1) if ttft is not None and completion and completion > 1 else None
    return StreamMetrics(
        ttft_s=ttft, e2e_s=e2e, itl_s=itl, tpot_s=tpot, content_chunks=len(content_times),
        prompt_tokens=usage.prompt_tokens if usage else None, completion_tokens=completion,
        cached_tokens=usage.cached_tokens if usage else None, tokens_from_usage=usage is not None,
        finish_reason=finish, done=done, error=error, error_type=error_type, text="".join(pieces),
        token_chunks=len(token_times), token_times=token_times,
    )


class _NoDelay(HTTPConnection):
    """Nagle's algorithm off, as aiohttp and other benchmark clients do: small writes go out at once."""

    def connect(self) -> None:
        super().connect()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _NoDelayHTTPConnection(_NoDelay, HTTPConnection):
    pass


class _NoDelayHTTPSConnection(_NoDelay, HTTPSConnection):
    pass


class Backoff:
    """The wait before the next request after connection errors: `initial_s` doubling up to `cap_s`.

    Reset to 0 by the first answered request (any HTTP response).
    """

    def __init__(self, initial_s: float = 0.05, cap_s: float = 2.0) -> None:
        if not 0 < initial_s <= cap_s:
            raise ValueError(f"backoff: expected 0 < initial_s <= cap_s, found {initial_s} and {cap_s}")
        self.initial_s, self.cap_s = initial_s, cap_s
        self.delay_s = 0.0

    def failed(self) -> None:
        self.delay_s = min(self.cap_s, self.delay_s * 2 if self.delay_s else self.initial_s)

    def reset(self) -> None:
        self.delay_s = 0.0

    def wait(self) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)  # gevent's sleep under locust


class TargetError(Exception):
    """A request that got no usable answer: its error type (workloads.traffic.errors) and message."""

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(f"{error_type}: {message}")
        self.error_type, self.message = error_type, message


class StreamingClient:
    """Sends workload requests to one OpenAI-compatible target over one keep-alive connection.

    Built on the standard library's http.client: lean enough to time streams to
    a fraction of a millisecond, and it runs unchanged under locust's gevent.
    """

    def __init__(self, base_url: str, model: str, api: Literal["chat", "completions"] = "chat",
                 api_key: Optional[str] = None, target: str = "target", timeout_s: float = 600.0,
                 temperature: float = 0.0, extra_body: Optional[dict] = None) -> None:
        """`extra_body`: fields every request's body adds (say vLLM's `ignore_eos`)."""
        url = urlsplit(base_url.rstrip("/"))
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"target url: expected http(s)://host:port/v1, found {base_url!r}")
        self._connection_class = _NoDelayHTTPSConnection if url.scheme == "https" else _NoDelayHTTPConnection
        self._host, self._port, self._prefix = url.hostname, url.port, url.path
        self.model, self.api, self.target, self.temperature = model, api, target, temperature
        self.timeout_s, self.extra_body = timeout_s, dict(extra_body or {})
        self._headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._connection: Optional[HTTPConnection] = None
        self.worker = f"{os.uname().nodename}:{os.getpid()}"
        self.backoff = Backoff()

    def connect(self) -> bool:
        """Open the keep-alive connection now, not at the first request: a load user that connects as it
        starts sends each request the moment it takes it, so requests sent together reach the target in
        the order they were sent (under gevent a first request's connect yields, and the users' connects
        complete in any order), and no TTFT holds a TCP handshake. False when the target does not accept
        the connection: the first request tries again, and records what fails."""
        if self._connection is None:
            self._connection = self._connection_class(self._host, self._port, timeout=self.timeout_s)
        if self._connection.sock is None:
            try:
                self._connection.connect()
            except OSError:
                self.close()
                return False
        return True

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def body(self, request: WorkloadRequest) -> dict:
        body = {"model": self.model, "max_tokens": request.max_tokens, "temperature": self.temperature,
                "stream": True, "stream_options": {"include_usage": True}}
        if self.api == "chat":
            body["messages"] = list(request.messages)
        else:
            body["prompt"] = request.prompt_text()
        return {**body, **self.extra_body}

    def served_models(self) -> list[str]:
        """The model ids the target lists at GET <base>/models; TargetError when it does not answer them."""
        return list(self.model_contexts())

    def model_contexts(self) -> dict[str, Optional[int]]:
        """{model id: its context length in tokens where the listing gives one (`max_model_len`: vLLM, kvgate
        serve), else None} from GET <base>/models; TargetError when it does not answer them."""
        try:
            _, response = self._request("GET", self._prefix + "/models", None)
            body = response.read()
        except (OSError, HTTPException) as error:
            self.close()
            raise TargetError(*classify(error)) from None
        if response.status >= 400:
            raise TargetError(f"http_{response.status}", _error_message(body))
        try:
            listing = json_object(json.loads(body), "the answer")
        except ValueError:   # BadResponse among them
            raise TargetError("bad_response", f"expected an OpenAI model list (a JSON object), found "
                              f"{body[:120]!r}") from None
        try:
            models = [json_object(m, f"data[{i}]") for i, m in enumerate(required_list(listing, "data", "data"))]
            return {required_text(m, "id", f"data[{i}].id"): _context_length(m.get("max_model_len"))
                    for i, m in enumerate(models)}
        except BadResponse as bad:
            raise TargetError("bad_response", str(bad)) from None

    def _request(self, method: str, path: str, body: Optional[bytes]):
        """Send the request; (monotonic send time, response). A stale keep-alive connection is replaced once."""
        reused = self._connection is not None
        for attempt in (1, 2):
            if self._connection is None:
                self._connection = self._connection_class(self._host, self._port, timeout=self.timeout_s)
            sent = time.perf_counter()
            try:
                self._connection.request(method, path, body=body, headers=self._headers)
                return sent, self._connection.getresponse()
            except (BrokenPipeError, ConnectionResetError):  # RemoteDisconnected is a ConnectionResetError
                if not (reused and attempt == 1):
                    raise
                self.close()
        raise AssertionError("unreachable")

    def send(self, request: WorkloadRequest, scheduled_at: Optional[float] = None,
             keep_text: bool = False, keep_token_times: bool = False) -> RequestRecord:
        """Send one request, stream the answer, and return its record (errors are recorded, not raised).

        `keep_text` keeps the generated text in the record (for consistency probes; off for load);
        `keep_token_times` each token's chunk's arrival, text or not (for the decode probe; off for load).
        """
        path = self._prefix + ("/chat/completions" if self.api == "chat" else "/completions")
        body = json.dumps(self.body(request)).encode()
        self.backoff.wait()
        sent_at = time.time()
        scheduled_at = sent_at if scheduled_at is None else scheduled_at
        record = RequestRecord(request.request_id, request.session_id, request.turn, self.target,
                               scheduled_at, sent_at, max(0.0, sent_at - scheduled_at), worker=self.worker)
        record = self._exchange(path, body, record, keep_text, keep_token_times)
        if record.error_type in CONNECTION_ERRORS:
            self.backoff.failed()
        else:
            self.backoff.reset()
        return record

    def _exchange(self, path: str, body: bytes, record: RequestRecord, keep_text: bool,
                  keep_token_times: bool = False) -> RequestRecord:
        try:
            sent, response = self._request("POST", path, body)
            record.http_status = response.status
            if response.status >= 400:
                return _failed(record, f"http_{response.status}", _error_message(response.read()))
            metrics = measure_stream(_timed_lines(response), sent)
            if metrics.done:
                response.read()  # the end of the chunked body, so the connection can be reused
        except (OSError, HTTPException) as error:
            self.close()
            return _failed(record, *classify(error))
        _apply(record, metrics)
        if keep_text:
            record.text = metrics.text
        if keep_token_times:
            record.token_times_s = metrics.token_times
        if not metrics.done:
            self.close()  # the connection is in an unknown state
        return record


def classify(error: BaseException) -> tuple[str, str]:
    """(error_type, message) of a failed exchange (see workloads.traffic.errors)."""
    if isinstance(error, ConnectionRefusedError):
        return "connection_refused", error.strerror or str(error)
    if isinstance(error, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)):
        return "connection_reset", f"{type(error).__name__}: {error}"  # RemoteDisconnected is a reset
    if isinstance(error, (TimeoutError, socket.timeout)):
        return "timeout", str(error) or "timed out"
    return "read", f"{type(error).__name__}: {error}"


def _timed_lines(response) -> Iterable[tuple[float, str]]:
    """Lines of an SSE response as they arrive, each with its monotonic arrival time."""
    while True:
        line = response.readline()
        if not line:
            return
        yield time.perf_counter(), line.decode("utf-8", errors="replace")


def _apply(record: RequestRecord, m: StreamMetrics) -> None:
    record.ttft_s, record.e2e_s, record.tpot_s, record.itl_s = m.ttft_s, m.e2e_s, m.tpot_s, m.itl_s
    record.prompt_tokens, record.completion_tokens, record.cached_tokens = (
        m.prompt_tokens,
        m.completion_tokens,
        m.cached_tokens,
    )
    record.content_chunks, record.tokens_from_usage, record.finish_reason = (
        m.content_chunks,
        m.tokens_from_usage,
        m.finish_reason,
    )
    record.token_chunks = m.token_chunks
    if m.error:
        _failed(record, m.error_type or "stream_error", m.error)
    elif not m.done:
        _failed(record, "incomplete_stream", "the stream ended without data: [DONE]")
    else:
        record.ok = True


def _failed(record: RequestRecord, error_type: str, message: str) -> RequestRecord:
    record.ok, record.error_type, record.error_message = False, error_type, message[:300]
    return record


def _context_length(value: object) -> Optional[int]:
    """A model listing's max_model_len when it is a positive integer (a listing's extra field: else None)."""
    return value if type(value) is int and value > 0 else None


def _error_message(body: bytes) -> str:
    """An OpenAI-style error body as 'code: message' (the message alone without a code)."""
    try:
        error = json.loads(body)["error"]
        message = str(error["message"])
    except (ValueError, KeyError, TypeError):
        return body[:300].decode("utf-8", errors="replace")
    code = error.get("code") if isinstance(error, dict) else None
    return f"{code}: {message}" if code and not message.startswith(str(code)) else message


class RecordWriter:
    """Appends records as JSON lines, one file per process, flushed as each request completes."""

    def __init__(self, directory: Path, name: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"records-{name}.jsonl"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def write(self, record: RequestRecord) -> None:
        line = (record.to_json() + "\n").encode()
        with self._lock:
            os.write(self._fd, line)

    def close(self) -> None:
        os.close(self._fd)
