"""`answering`: a real HTTP server on 127.0.0.1 that lists the models it is told and answers every POST as told
(a target that serves another model, refuses every request, or holds a hostile model id)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


class _Answers(BaseHTTPRequestHandler):
    """GET /v1/models lists `models`; every POST gets `status` with `body`."""

    models: tuple[str, ...] = ()
    status, body = 200, b""
    max_model_len = None   # listed beside each model when set, as vLLM does

    def do_GET(self):
        listed = [{"id": m, **({"max_model_len": self.max_model_len} if self.max_model_len else {})}
                  for m in self.models]
        self._reply(200, json.dumps({"object": "list", "data": listed}).encode())

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._reply(self.status, self.body)

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def answering():
    """Start a real HTTP server on loopback answering as told; its base URL (…/v1)."""
    servers = []

    def start(models, status=200, body=b"", max_model_len=None) -> str:
        handler = type("Handler", (_Answers,), {"models": tuple(models), "status": status, "body": body,
                                                "max_model_len": max_model_len})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}/v1"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()
