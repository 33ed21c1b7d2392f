"""An OpenAI-style streaming server with controlled timing, to measure the load engine and to test the gates.

It answers GET /v1/models (one model, `--model`), GET /health, GET /metrics (its process's figures, the
Prometheus client's: open descriptors, memory), and POST /v1/chat/completions and
/v1/completions with as many content chunks as the request's max_tokens allows (at most `tokens`):
the first after the TTFT, then one every ITL, then the finish chunk, a usage chunk and
`data: [DONE]`. Plain asyncio, HTTP/1.1 with keep-alive and chunked encoding, so that it costs as
little as possible and whatever latency a client adds above the TTFT is the client's (or the
machine's). What it does with each request (drifting latency, an error schedule, usage that lies
or has a field of the wrong type, a descriptor leak) is a `workloads.servers.server_behaviour.Behaviour`, from the
flags; with
none it is the plain fixed-timing reference. Run: `python -m workloads.servers.reference_server --port 8010`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from http import HTTPStatus

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from workloads.servers.server_behaviour import Behaviour, parse_every, prompt_tokens_of


class ReferenceServer:
    def __init__(self, behaviour: Behaviour, model: str = "reference") -> None:
        self.behaviour, self.model = behaviour, model
        self.started = time.monotonic()
        self.requests = 0       # completion requests so far (the error schedule's numbering)
        self.in_flight = 0
        self.leaked: list = []  # descriptors kept open for good (Behaviour.leak_fd_every)
        self.slots = asyncio.Semaphore(behaviour.slots) if behaviour.slots else None   # FIFO: waiters in order

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    break
                method, path, body = request
                if path.endswith("/health"):
                    await _plain(writer, 200, {"status": "ok"})
                elif method == "GET" and path.endswith("/metrics"):   # the process's, as G4 reads a server's
                    await _text(writer, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
                elif method == "GET" and path.endswith("/models"):
                    await _plain(writer, 200, {"object": "list", "data": [{"id": self.model, "object": "model"}]})
                else:
                    await self._complete(writer, _json_body(body), chat=path.endswith("/chat/completions"))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _complete(self, writer: asyncio.StreamWriter, body: dict, chat: bool) -> None:
        self.requests += 1
        if self.behaviour.leaks(self.requests):
            self.leaked.append(open(os.devnull, "rb"))  # noqa: SIM115 (kept open: the leak is the point)
        status = self.behaviour.error_status(self.requests)
        if status is not None:
            await _plain(writer, status, {"error": {"message": f"scheduled error for request {self.requests}",
                                                    "type": "server_error" if status >= 500 else "invalid_request",
                                                    "code": HTTPStatus(status).phrase.lower().replace(" ", "_")}})
            return
        self.in_flight += 1
        try:
            ttft_s = self.behaviour.ttft_s(time.monotonic() - self.started, self.in_flight)
            await self._stream(writer, body, chat, ttft_s)
        finally:
            self.in_flight -= 1

    async def _stream(self, writer: asyncio.StreamWriter, body: dict, chat: bool, ttft_s: float) -> None:
        max_tokens = body.get("max_tokens")
        tokens = min(self.behaviour.tokens, max_tokens) if isinstance(max_tokens, int) and max_tokens > 0 \
            else self.behaviour.tokens
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        head = {"id": f"cmpl-{id(writer):x}", "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model}
        async with self.slots or contextlib.nullcontext():    # the wait for a slot is in the TTFT
            # each token at its time from the slot's start (not after the previous sleep: sleeps overrun, and a
            # service that grew with its tokens would serve fewer requests a second than its slots promise)
            clock = asyncio.get_running_loop()
            start = clock.time()
            for i in range(tokens):
                await asyncio.sleep(max(0.0, start + ttft_s + i * self.behaviour.itl_ms / 1000 - clock.time()))
                choice = {"index": 0, "delta": {"content": "x"}} if chat else {"index": 0, "text": "x"}
                await _event(writer, {**head, "choices": [choice]})
        done = {"index": 0, "delta": {}, "finish_reason": "length"} if chat else {"index": 0, "text": "",
                                                                                   "finish_reason": "length"}
        await _event(writer, {**head, "choices": [done]})
        await _event(writer, {**head, "choices": [], "usage": self.behaviour.usage(prompt_tokens_of(body), tokens)})
        writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()


async def _read_request(reader: asyncio.StreamReader):
    """(method, path, body) of the next request on the connection, or None at its end."""
    head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
    if not head:
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    body = await reader.readexactly(length) if length else b""
    return method, path, body


def _json_body(body: bytes) -> dict:
    try:
        parsed = json.loads(body) if body else {}
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


async def _plain(writer: asyncio.StreamWriter, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    writer.write(f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()


async def _text(writer: asyncio.StreamWriter, body: bytes, content_type: str) -> None:
    writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                 + body)
    await writer.drain()


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _event(writer: asyncio.StreamWriter, payload: dict) -> None:
    writer.write(_chunk(b"data: " + json.dumps(payload).encode() + b"\n\n"))
    await writer.drain()


async def serve(host: str, port: int, server: ReferenceServer) -> None:
    listener = await asyncio.start_server(server.handle, host, port, backlog=1024)
    async with listener:
        await listener.serve_forever()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8010)
    parser.add_argument("--model", default="reference", help="the model id it serves (default: %(default)s)")
    parser.add_argument("--ttft-ms", type=float, default=100.0)
    parser.add_argument("--itl-ms", type=float, default=50.0)
    parser.add_argument("--tokens", type=int, default=10, help="output tokens (a request's max_tokens caps them)")
    parser.add_argument("--ttft-end-ms", type=float, help="the TTFT drifts linearly to this over --drift-s of uptime")
    parser.add_argument("--drift-s", type=float, default=0.0, help="seconds of uptime the drift takes")
    parser.add_argument("--fast-above-inflight", type=int, metavar="N",
                        help="with --fast-ttft-ms: that TTFT while more than N requests are in flight")
    parser.add_argument("--fast-ttft-ms", type=float)
    parser.add_argument("--error-every", type=parse_every, default=(), metavar="N:STATUS,...",
                        help="every N-th request answered with STATUS, e.g. 3:500,7:400 (the first that divides wins)")
    parser.add_argument("--error-fraction", type=float, default=0.0, help="this share of requests fails, spread evenly")
    parser.add_argument("--error-status", type=int, default=500, help="the status of --error-fraction's failures")
    parser.add_argument("--usage-token-offset", type=int, default=0,
                        help="usage.completion_tokens = streamed tokens + this (nonzero: client and server disagree)")
    parser.add_argument("--cached-tokens", type=int,
                        help="usage.prompt_tokens_details.cached_tokens (capped at the prompt's tokens)")
    parser.add_argument("--cached-tokens-as-string", action="store_true",
                        help="send cached_tokens as a string, a field of the wrong type")
    parser.add_argument(
        "--slots",
        type=int,
        default=0,
        metavar="N",
        help="serve at most N requests at once, the rest wait their turn (a known capacity; 0: no limit)",
    )
    parser.add_argument("--leak-fd-every", type=int, default=0, metavar="N",
                        help="every N-th request keeps a file descriptor open for good (a leak G4 must catch)")
    return parser


def behaviour_from(args: argparse.Namespace) -> Behaviour:
    return Behaviour(ttft_ms=args.ttft_ms, itl_ms=args.itl_ms, tokens=args.tokens, ttft_end_ms=args.ttft_end_ms,
                     drift_s=args.drift_s, fast_above_inflight=args.fast_above_inflight,
                     fast_ttft_ms=args.fast_ttft_ms, every=args.error_every, fraction=args.error_fraction,
                     fraction_status=args.error_status, usage_token_offset=args.usage_token_offset,
                     cached_tokens=args.cached_tokens, cached_tokens_as_string=args.cached_tokens_as_string,
                     leak_fd_every=args.leak_fd_every, slots=args.slots)


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    try:
        behaviour = behaviour_from(args)
    except ValueError as error:
        parser.error(str(error))
    try:
        asyncio.run(serve(args.host, args.port, ReferenceServer(behaviour, args.model)))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
