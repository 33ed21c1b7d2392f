"""The OpenAI-compatible server of the embedded engine, over real HTTP on loopback.

Each server is a real `kvgate serve --preset tiny --mode tiered` subprocess on a
free 127.0.0.1 port with its own cache directory. The tests speak to it with
the official `openai` client and with raw `httpx` requests (SSE, bad input,
/metrics, API key, client disconnects). The byte tokenizer makes one token per
ASCII character plus <|bos|>; the cache works in blocks of 256 tokens and the
tiny preset has a context of 4096 tokens.
"""

from __future__ import annotations

import json
import random
import string
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.servers import SHUTDOWN_TIMEOUT_S, ServerProcess, http_client, started_server

MODEL = "kvgate-tiny"
BLOCK_SIZE = 256
CONTEXT = 4096

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from started_server(tmp_path_factory.mktemp("kvgate-serve"))


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    yield from started_server(tmp_path_factory.mktemp("kvgate-serve-key"), api_key="secret")


@pytest.fixture
def http(server):
    with http_client(server.port) as client:
        yield client


@pytest.fixture
def client(server):
    with httpx.Client(timeout=30, trust_env=False) as transport:
        yield openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                            http_client=transport)


# -- helpers -------------------------------------------------------------------------


def text_prompt(length: int, seed: int) -> str:
    """`length` printable ASCII characters (one token each), different for each seed."""
    rng = random.Random(seed)
    return "".join(rng.choice(string.ascii_letters + " ") for _ in range(length))


def metrics(http: httpx.Client) -> dict[str, list]:
    """Prometheus samples of GET /metrics by sample name (e.g. `kvgate_cache_hits_total`)."""
    response = http.get("/metrics")
    assert response.status_code == 200
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def metric_value(samples: dict[str, list], name: str, **labels: str) -> float:
    """The value of one sample; 0 for a labelled sample not exported yet (a counter never incremented)."""
    matching = [s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    if not matching and labels:
        return 0.0
    assert len(matching) == 1, f"expected one sample {name}{labels}, found {matching}"
    return matching[0]


def sse_events(response: httpx.Response) -> list[str]:
    """The payloads of a complete SSE stream; every non-empty line must be a `data: ` line."""
    events = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        events.append(line.removeprefix("data: "))
    return events


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    """`response` is `status` with an OpenAI error body; returns the body's `error` object."""
    assert response.status_code == status, f"{response.status_code}: {response.text[:300]}"
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error
    return error


# -- 1. the official openai client ------------------------------------------------------


def test_openai_client_completion_has_requested_tokens(client):
    completion = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0)
    choice = completion.choices[0]
    assert completion.model == MODEL and completion.object == "text_completion"
    assert isinstance(choice.text, str) and choice.text
    assert choice.finish_reason == "length"
    assert completion.usage.completion_tokens == 8
    assert completion.usage.prompt_tokens == len("The quick brown fox") + 1  # + <|bos|>
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 8


def test_openai_client_chat_stream_matches_non_streamed_text(client):
    request = dict(model=MODEL, messages=[{"role": "user", "content": "Say something, please."}],
                   temperature=0, max_tokens=6)
    whole = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))

    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content and streamed == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6 == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_openai_client_models_list_has_the_model(client):
    assert MODEL in [model.id for model in client.models.list()]


# -- 2. raw SSE -------------------------------------------------------------------------------


def test_raw_chat_sse_starts_role_only_and_ends_with_done(http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5,
            "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)

    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[0]["choices"][0]["finish_reason"] is None
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len("".join(c["choices"][0]["delta"].get("content", "") for c in chunks)) == 5  # ASCII: 1 token, 1 char


# -- 3. cache reuse -----------------------------------------------------------------------------


def test_repeated_prompt_reports_cached_tokens(http):
    prompt = text_prompt(1200, seed=3)  # 1201 tokens: 4 full blocks can come from the cache
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    reused_before = metric_value(metrics(http), "kvgate_prompt_tokens_reused_total")

    first = http.post("/v1/completions", json=body)
    second = http.post("/v1/completions", json=body)

    assert first.status_code == 200 and second.status_code == 200
    first, second = first.json(), second.json()
    assert first["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"] == 1201
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % BLOCK_SIZE == 0 and cached < 1201
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    reused = metric_value(metrics(http), "kvgate_prompt_tokens_reused_total")
    assert reused > 0 and reused - reused_before >= cached


# -- 4. bad input ---------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ANY = object()  # the error's param or code is not checked
HI = [{"role": "user", "content": "hi"}]


def _case(name, path, body, status=400, param=ANY, code=ANY):
    return pytest.param(path, body, status, param, code, id=name)


BAD_REQUESTS = [
    _case("malformed-json", COMPLETIONS, b'{"model": "kvgate-tiny", "prompt": ', code="invalid_json"),
    _case("body-is-a-list", COMPLETIONS, [{"model": MODEL, "prompt": "hi"}]),
    _case("missing-model", COMPLETIONS, {"prompt": "hi"}, param="model", code="missing_field"),
    _case("max-tokens-0", COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": 0}, param="max_tokens"),
    _case("max-tokens-string", COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": "ten"},
          param="max_tokens"),
    _case("negative-temperature", COMPLETIONS, {"model": MODEL, "prompt": "hi", "temperature": -1},
          param="temperature"),
    _case("no-messages", CHAT, {"model": MODEL, "messages": []}, param="messages"),
    _case("role-robot", CHAT, {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]},
          param="messages.0.role"),
    _case("unknown-model-completion", COMPLETIONS, {"model": "gpt-nope", "prompt": "hi"}, status=404,
          param="model", code="model_not_found"),
    _case("unknown-model-chat", CHAT, {"model": "gpt-nope", "messages": HI}, status=404, param="model",
          code="model_not_found"),
    _case("prompt-over-context", COMPLETIONS, {"model": MODEL, "prompt": "a" * 5000},
          param="prompt", code="context_length_exceeded"),
    _case("chat-over-context", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "a" * 5000}]},
          param="messages", code="context_length_exceeded"),
    _case("token-id-out-of-range", COMPLETIONS, {"model": MODEL, "prompt": [99999]}, param="prompt"),
    _case("stream-not-boolean", COMPLETIONS, {"model": MODEL, "prompt": "hi", "stream": "yes please"}),
    _case("empty-token-list", COMPLETIONS, {"model": MODEL, "prompt": []}, param="prompt"),
    _case("max-tokens-boolean", COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": True},
          param="max_tokens"),
]


@pytest.mark.parametrize("path, body, status, param, code", BAD_REQUESTS)
def test_bad_request_gets_openai_error_not_500(http, path, body, status, param, code):
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = http.post(path, json=body)
    error = assert_openai_error(response, status)
    if status < 500:
        assert error["type"] == "invalid_request_error", error
    if param is not ANY:
        assert error["param"] == param, error
    if code is not ANY:
        assert error["code"] == code, error


@pytest.mark.parametrize("field, body", [
    pytest.param("max_tokens", {"max_tokens": "ten"}, id="max_tokens"),
    pytest.param("temperature", {"temperature": "hot"}, id="temperature"),
    pytest.param("seed", {"seed": "abc"}, id="seed"),
    pytest.param("stream", {"stream": "yes please"}, id="stream"),
    pytest.param("stream_options.include_usage", {"stream": True, "stream_options": {"include_usage": "maybe"}},
                 id="stream_options"),
])
def test_wrong_type_error_names_the_field(http, field, body):
    response = http.post(COMPLETIONS, json={"model": MODEL, "prompt": "hi", **body})
    error = assert_openai_error(response, 400)
    assert error["param"] == field, error
    assert error["message"].startswith(f"{field}: "), error


# -- 5, 6. /metrics and /health ------------------------------------------------------------------


def test_metrics_is_prometheus_text_with_engine_cache_and_process_families(http):
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    samples = metrics(http)
    for name in ("kvgate_cache_hits_total", "kvgate_requests_running", "kvgate_requests_waiting",
                 "kvgate_prompt_tokens_computed_total", "process_resident_memory_bytes"):
        assert name in samples, f"{name} missing from /metrics"
    assert families["kvgate_cache_hits"].type == "counter"
    assert families["kvgate_requests_running"].type == "gauge"
    assert {s.labels["tier"] for s in samples["kvgate_cache_hits_total"]} == {"device", "host", "disk"}
    assert metric_value(samples, "process_resident_memory_bytes") > 0


def test_health_is_ok(http):
    response = http.get("/health")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["status"] == "ok"
    assert response.json()["model"] == MODEL


# -- 7. API key ------------------------------------------------------------------------------------


def test_api_key_is_required_on_v1_only(keyed_server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}
    with http_client(keyed_server.port) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "secret"}):
            error = assert_openai_error(http.post(COMPLETIONS, json=body, headers=headers), 401)
            assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key", error
        assert_openai_error(http.get("/v1/models"), 401)

        authorized = http.post(COMPLETIONS, json=body, headers={"Authorization": "Bearer secret"})
        assert authorized.status_code == 200 and authorized.json()["usage"]["completion_tokens"] == 2
        assert http.get("/health").status_code == 200
        assert http.get("/health").json()["status"] == "ok"

    with httpx.Client(timeout=30, trust_env=False) as transport:
        def openai_client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=f"{keyed_server.base_url}/v1", api_key=key, max_retries=0,
                                 http_client=transport)

        assert MODEL in [m.id for m in openai_client("secret").models.list()]
        with pytest.raises(openai.AuthenticationError):
            openai_client("wrong").models.list()


# -- 8. client disconnect ----------------------------------------------------------------------------


def test_client_disconnect_mid_stream_frees_the_slot(http):
    cancelled_before = metric_value(metrics(http), "kvgate_requests_finished_total", reason="cancelled")
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 2000, "temperature": 0, "stream": True}
    with http.stream("POST", COMPLETIONS, json=body) as response:
        assert response.status_code == 200
        received = 0
        for line in response.iter_lines():
            if line.startswith("data: "):
                assert json.loads(line.removeprefix("data: "))["choices"][0]["finish_reason"] is None
                received += 1
                if received == 3:
                    break
    assert received == 3  # leaving the block closed the connection mid-stream

    deadline = time.monotonic() + 10
    while True:
        samples = metrics(http)
        running = metric_value(samples, "kvgate_requests_running")
        cancelled = metric_value(samples, "kvgate_requests_finished_total", reason="cancelled")
        if (running == 0 and cancelled >= cancelled_before + 1) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert running == 0, "the disconnected request still holds a batch slot"
    assert cancelled >= max(1, cancelled_before + 1), "the disconnected request was not cancelled"
    assert metric_value(samples, "kvgate_requests_waiting") == 0


# -- shutdown ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sigterm_exit(tmp_path_factory):
    """A server that served one request and then got SIGTERM: (exit code or None if killed, seconds, log)."""
    server = ServerProcess(tmp_path_factory.mktemp("kvgate-serve-term"))
    try:
        server.wait_healthy()
        with http_client(server.port) as http:
            body = {"model": MODEL, "prompt": text_prompt(600, seed=8), "max_tokens": 4, "temperature": 0}
            assert http.post(COMPLETIONS, json=body).status_code == 200
        started = time.monotonic()
        code = server.stop()
        return code, time.monotonic() - started, server.log()
    finally:
        server.stop()


def test_sigterm_shuts_down_gracefully(sigterm_exit):
    code, seconds, log = sigterm_exit
    assert code is not None, f"kvgate serve did not exit within {SHUTDOWN_TIMEOUT_S} s of SIGTERM:\n{log}"
    assert seconds < SHUTDOWN_TIMEOUT_S
    assert "Traceback" not in log, log


def test_sigterm_exit_code_is_0(sigterm_exit):
    code, _, log = sigterm_exit
    assert code == 0, f"exit code {code}:\n{log}"
