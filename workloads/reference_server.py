"""A trivial OpenAI-style streaming server with fixed timing, to measure the load engine itself.

It answers POST /v1/chat/completions and /v1/completions with `tokens`
content chunks: the first after `ttft_ms`, then one every `itl_ms`, then the
finish chunk, a usage chunk and `data: [DONE]`. Plain asyncio, HTTP/1.1 with
keep-alive and chunked encoding, so that it costs as little as possible and
whatever latency a client adds above `ttft_ms` is the client's (or the
machine's). Run: `python -m workloads.reference_server --port 8010`.
"""

from __future__ import annotations

import argparse
import asyncio
import json


class ReferenceServer:
    def __init__(self, ttft_ms: float, itl_ms: float, tokens: int) -> None:
        self.ttft_s, self.itl_s, self.tokens = ttft_ms / 1000, itl_ms / 1000, tokens

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    break
                path, _ = request
                if path.endswith("/health"):
                    await self._plain(writer, b'{"status":"ok"}')
                else:
                    await self._stream(writer, chat=path.endswith("/chat/completions"))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _plain(self, writer: asyncio.StreamWriter, body: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()

    async def _stream(self, writer: asyncio.StreamWriter, chat: bool) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        await asyncio.sleep(self.ttft_s)
        for i in range(self.tokens):
            if i:
                await asyncio.sleep(self.itl_s)
            choice = {"index": 0, "delta": {"content": "x"}} if chat else {"index": 0, "text": "x"}
            await _event(writer, {"choices": [choice]})
        done = {"index": 0, "delta": {}, "finish_reason": "length"} if chat else {"index": 0, "text": "",
                                                                                   "finish_reason": "length"}
        await _event(writer, {"choices": [done]})
        await _event(writer, {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": self.tokens,
                                                       "total_tokens": self.tokens + 1}})
        writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()


async def _read_request(reader: asyncio.StreamReader):
    head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
    if not head:
        return None
    lines = head.decode("latin-1").split("\r\n")
    _, path, _ = lines[0].split(" ", 2)
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    body = await reader.readexactly(length) if length else b""
    return path, body


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _event(writer: asyncio.StreamWriter, payload: dict) -> None:
    writer.write(_chunk(b"data: " + json.dumps(payload).encode() + b"\n\n"))
    await writer.drain()


async def serve(host: str, port: int, server: ReferenceServer) -> None:
    listener = await asyncio.start_server(server.handle, host, port, backlog=1024)
    async with listener:
        await listener.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8010)
    parser.add_argument("--ttft-ms", type=float, default=100.0)
    parser.add_argument("--itl-ms", type=float, default=50.0)
    parser.add_argument("--tokens", type=int, default=10)
    args = parser.parse_args()
    try:
        asyncio.run(serve(args.host, args.port, ReferenceServer(args.ttft_ms, args.itl_ms, args.tokens)))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
