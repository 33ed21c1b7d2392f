"""Whatever a target answers, a field of the wrong type is a clear error naming it, never a traceback:
the admin/metrics reader (workloads/probes/faults.py) and pre-flight (gates/preflight.py) over real HTTP on loopback."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gates.preflight import check_node
from gates.targets import Endpoint
from workloads.probes.faults import AdminClient, AdminError
from workloads.traffic.target_json import BadResponse, optional_count, required_text

# path -> (content type, body) that a hostile target answers
HOSTILE = {
    "/v1/models": ("application/json", json.dumps({"object": "list", "data": [{"id": 7}]})),
    "/admin/cache/locate": ("application/json", json.dumps({"blocks": [{"index": 0, "key": "ab", "tiers": "disk"}]})),
    "/admin/cache/evict": ("text/html", "<html>proxy error</html>"),
    "/admin/cache/flush": ("application/json", "[1, 2, 3]"),
    "/metrics": ("text/plain", 'kvgate_cache_hits_total{tier="disk"} many\n'),
}


class _Hostile(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _answer(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        kind, body = HOSTILE.get(self.path, ("text/plain", "not found"))
        data = body.encode()
        self.send_response(200 if self.path in HOSTILE else 404)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def hostile_root():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_helpers_name_the_field_what_was_expected_and_what_was_found():
    with pytest.raises(BadResponse, match=r"^usage.prompt_tokens: expected a count \(an integer >= 0\), found "
                                          r"'12' \(str\)$"):
        optional_count({"prompt_tokens": "12"}, "prompt_tokens", "usage.prompt_tokens")
    with pytest.raises(BadResponse, match=r"^data\[0\].id: expected a string, found nothing$"):
        required_text({}, "id", "data[0].id")
    assert optional_count({"n": None}, "n", "n") is None and optional_count({}, "n", "n") is None


def test_admin_answers_of_the_wrong_shape_are_admin_errors_naming_the_field(hostile_root):
    admin = AdminClient(hostile_root, timeout_s=5, token="t")
    with pytest.raises(AdminError, match=r"blocks\[0\]\.tiers: expected a JSON array, found 'disk' \(str\)"):
        admin.locate("some prompt")
    with pytest.raises(AdminError, match="POST /admin/cache/evict: expected a JSON object, found b'<html>"):
        admin.evict()
    with pytest.raises(AdminError, match=r"POST /admin/cache/flush: expected a JSON object, found \[1, 2, 3\]"):
        admin.flush()
    with pytest.raises(AdminError, match="GET /metrics: expected Prometheus text exposition"):
        admin.metrics()


def test_preflight_of_a_model_list_with_a_number_for_an_id_fails_saying_so(hostile_root):
    endpoint = Endpoint("candidate", f"{hostile_root}/v1", "m")
    result = check_node("candidate", endpoint.url, endpoint, timeout_s=5)
    assert not result.ok and result.error_type == "bad_response"
    assert result.problem == "GET /models: bad_response: data[0].id: expected a string, found 7 (int)"
