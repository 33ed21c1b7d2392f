"""The OpenAI-compatible server of the embedded engine, over real HTTP on loopback.

Each server is a real `kvgate serve --preset tiny --mode tiered --admin` subprocess
on a free 127.0.0.1 port with its own cache directory. The tests speak to it with
the official `openai` client, with raw `httpx` requests (SSE, bad input, /metrics,
API key, admin token, client disconnects) and with raw sockets where the bytes on
the wire matter (a body announced but never sent, a chunked body). The byte
tokenizer makes one token per ASCII character plus <|bos|>; the cache works in
blocks of 256 tokens and the tiny preset has a context of 4096 tokens.
"""

from __future__ import annotations

import hmac
import json
import os
import random
import socket
import string
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPResponse

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cache_impl.server import auth
from cache_impl.server.auth import ADMIN_TOKEN_ENV, ADMIN_TOKEN_HEADER
from tests.servers import (
    ADMIN_TOKEN,
    REPO,
    SHUTDOWN_TIMEOUT_S,
    ServerProcess,
    free_port,
    http_client,
    metric_value,
    metrics,
    started_server,
)
from workloads.probes.faults import AdminClient

MODEL = "kvgate-tiny"
BLOCK_SIZE = 256
CONTEXT = 4096

DEFAULT_BODY_LIMIT = 4 * 2**20
KEYED_BODY_LIMIT = 64 * 2**10
API_KEY = "secret-key-of-24-chars!!"  # at least 16 printable characters, as kvgate serve requires


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from started_server(tmp_path_factory.mktemp("kvgate-serve"), admin=True)


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    """Every guard set: an API key, admin routes, and a body limit of 64 KiB."""
    yield from started_server(tmp_path_factory.mktemp("kvgate-serve-key"), api_key=API_KEY, admin=True,
                              extra_args=("--max-request-bytes", "64KiB"))


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


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


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
    # bodies Python's JSON parser cannot take whole (RecursionError) or the tokenizer cannot encode
    _case("array-nested-1e5-deep", COMPLETIONS, b"[" * 10**5 + b"]" * 10**5, code="invalid_json"),
    _case("object-nested-1e5-deep", COMPLETIONS, b'{"a":' * 10**5 + b"1" + b"}" * 10**5, code="invalid_json"),
    _case("ignored-field-nested-40-deep", COMPLETIONS, {"model": MODEL, "prompt": "hi", "user": _nested(40)},
          code="invalid_json"),
    _case("lone-surrogate-in-prompt", COMPLETIONS, b'{"model": "kvgate-tiny", "prompt": "\\ud800"}',
          param="prompt", code="invalid_unicode"),
    _case("lone-surrogate-in-model", COMPLETIONS, b'{"model": "\\udfff", "prompt": "hi"}', param="model",
          code="invalid_unicode"),
    _case("lone-surrogate-in-chat", CHAT, b'{"model": "kvgate-tiny", "messages": [{"role": "user", '
                                          b'"content": "a\\ud83d"}]}', param="messages.0.content",
          code="invalid_unicode"),
    _case("lone-surrogate-in-a-key", COMPLETIONS, b'{"model": "kvgate-tiny", "prompt": "hi", "\\ud800": 1}',
          code="invalid_unicode"),
    _case("encoded-surrogate-bytes", COMPLETIONS, b'{"model": "kvgate-tiny", "prompt": "\xed\xa0\x80"}',
          code="invalid_json"),
    _case("nan-temperature", COMPLETIONS, b'{"model": "kvgate-tiny", "prompt": "hi", "temperature": NaN}',
          code="invalid_json"),
    # out of the ranges vLLM accepts (vllm/sampling_params.py), or of the wrong type
    *(_case(f"{field}-{value}", COMPLETIONS, {"model": MODEL, "prompt": "hi", field: value}, param=field,
            code="invalid_value")
      for field, value in (("top_p", 5), ("top_p", -1), ("top_p", 0), ("presence_penalty", 100),
                           ("presence_penalty", -2.5), ("frequency_penalty", 3), ("repetition_penalty", 0),
                           ("top_k", -2), ("min_p", 1.5), ("temperature", 2.5), ("n", 0),
                           ("logprobs", -1), ("best_of", 0), ("min_tokens", -1),
                           # torch's generators take -2**63 .. 2**64-1; past them the engine would fail
                           ("seed", 2**64), ("seed", -2**63 - 1))),
    *(_case(f"{field}-{value}", path, {"model": MODEL, **prompt, field: value}, param=field, code="invalid_type")
      for path, prompt, field, value in (
          (COMPLETIONS, {"prompt": "hi"}, "top_p", "x"), (COMPLETIONS, {"prompt": "hi"}, "n", "2"),
          (COMPLETIONS, {"prompt": "hi"}, "echo", "yes"), (COMPLETIONS, {"prompt": "hi"}, "stop", 5),
          (COMPLETIONS, {"prompt": "hi"}, "suffix", 1), (COMPLETIONS, {"prompt": "hi"}, "logit_bias", [1]),
          (CHAT, {"messages": HI}, "tools", "all"), (CHAT, {"messages": HI}, "parallel_tool_calls", "yes"),
          (CHAT, {"messages": HI}, "response_format", "json"),
          # fields kvgate ignores, typed as vLLM types them (`user: 5` was served)
          (COMPLETIONS, {"prompt": "hi"}, "user", 5), (CHAT, {"messages": HI}, "user", ["someone"]),
          (COMPLETIONS, {"prompt": "hi"}, "use_beam_search", "no"), (CHAT, {"messages": HI}, "priority", "high"),
          (COMPLETIONS, {"prompt": "hi"}, "include_stop_str_in_output", 3),
          (CHAT, {"messages": HI}, "skip_special_tokens", "no"),
          (COMPLETIONS, {"prompt": "hi"}, "spaces_between_special_tokens", 1),
          (CHAT, {"messages": HI}, "request_id", 5), (COMPLETIONS, {"prompt": "hi"}, "cache_salt", 5))),
    _case("stream-options-continuous-usage-stats-x", COMPLETIONS,
          {"model": MODEL, "prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": "x"}},
          param="stream_options.continuous_usage_stats", code="invalid_type"),
    # a JSON value that is not an object
    *(_case(f"body-is-{raw.decode()}-{'chat' if path == CHAT else 'completions'}", path, raw)
      for raw in (b"null", b"1", b"1.5", b"true") for path in (COMPLETIONS, CHAT)),
    _case("chat-max-completion-tokens-0", CHAT, {"model": MODEL, "messages": HI, "max_completion_tokens": 0},
          param="max_completion_tokens", code="invalid_value"),
    _case("chat-top-logprobs-21", CHAT, {"model": MODEL, "messages": HI, "top_logprobs": 21},
          param="top_logprobs", code="invalid_value"),
    # valid values the engine would have to ignore: said so, naming the field
    *(_case(f"unsupported-{field}-{value}", path, {"model": MODEL, **prompt, field: value}, param=field,
            code="unsupported_value")
      for path, prompt, field, value in (
          (COMPLETIONS, {"prompt": "hi"}, "logprobs", True), (COMPLETIONS, {"prompt": "hi"}, "logprobs", 0),
          (CHAT, {"messages": HI}, "logprobs", True), (CHAT, {"messages": HI}, "top_logprobs", 3),
          (COMPLETIONS, {"prompt": "hi"}, "n", 2), (COMPLETIONS, {"prompt": "hi"}, "best_of", 2),
          (COMPLETIONS, {"prompt": "hi"}, "echo", True), (CHAT, {"messages": HI}, "presence_penalty", 0.5),
          (COMPLETIONS, {"prompt": "hi"}, "frequency_penalty", -1), (CHAT, {"messages": HI}, "top_p", 0.9),
          (COMPLETIONS, {"prompt": "hi"}, "top_k", 5), (COMPLETIONS, {"prompt": "hi"}, "stop", "\n"),
          (CHAT, {"messages": HI}, "stop", ["a"]), (COMPLETIONS, {"prompt": "hi"}, "stop_token_ids", [1]),
          (COMPLETIONS, {"prompt": "hi"}, "suffix", "z"), (COMPLETIONS, {"prompt": "hi"}, "logit_bias", {"1": 5}),
          (CHAT, {"messages": HI}, "min_tokens", 3),
          (CHAT, {"messages": HI}, "response_format", {"type": "json_object"}),
          (CHAT, {"messages": HI}, "tools", [{"type": "function", "function": {"name": "f"}}]),
          (CHAT, {"messages": HI}, "tool_choice", "required"),
          (CHAT, {"messages": HI}, "functions", [{"name": "f"}]),
          (COMPLETIONS, {"prompt": "hi"}, "use_beam_search", True), (CHAT, {"messages": HI}, "priority", 1),
          (CHAT, {"messages": HI}, "cache_salt", "tenant-a"))),
    _case("empty-prompt", COMPLETIONS, {"model": MODEL, "prompt": ""}, param="prompt"),
    _case("empty-prompt-in-a-list", COMPLETIONS, {"model": MODEL, "prompt": [""]}, param="prompt"),
    _case("no-such-route", "/v1/embeddings", {"model": MODEL, "input": "hi"}, status=404),
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


def test_values_that_ask_for_nothing_the_engine_lacks_are_accepted(http):
    neutral = {"top_p": 1, "top_k": -1, "min_p": 0, "presence_penalty": 0, "frequency_penalty": 0.0,
               "repetition_penalty": 1, "n": 1, "logprobs": None, "best_of": 1, "echo": False, "stop": [],
               "stop_token_ids": None, "suffix": "", "logit_bias": {}, "min_tokens": 0, "ignore_eos": False,
               "response_format": {"type": "text"}, "user": "someone", "seed": 2**64 - 1, "use_beam_search": False,
               "include_stop_str_in_output": True, "skip_special_tokens": False, "spaces_between_special_tokens": True,
               "priority": 0, "request_id": "r-1", "cache_salt": None,
               "stream_options": {"include_usage": None, "continuous_usage_stats": False}}
    response = http.post(COMPLETIONS, json={"model": MODEL, "prompt": "hi", "max_tokens": 2, **neutral})
    assert response.status_code == 200, response.text
    no_tools = {"tools": [], "tool_choice": "none", "parallel_tool_calls": True, "functions": None, "stop": None,
                "response_format": {}, "seed": -2**63}
    response = http.post(CHAT, json={"model": MODEL, "messages": HI, "max_tokens": 2, **no_tools})
    assert response.status_code == 200, response.text
    # greedy decoding takes the top token whatever top_p and top_k say (vLLM ignores them too)
    greedy = {"model": MODEL, "messages": HI, "max_tokens": 2, "temperature": 0, "top_p": 0.5, "top_k": 3,
              "logprobs": False}
    response = http.post(CHAT, json=greedy)
    assert response.status_code == 200, response.text


def test_a_greedy_stream_survives_a_seed_past_torchs_range(server, http):
    """Before: the seed raised in the engine, which failed every running stream and never answered the request."""
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 64, "temperature": 0, "stream": True}
    with http.stream("POST", COMPLETIONS, json=body) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")  # the stream is running
        with http_client(server.port, timeout=10) as other:
            bad = other.post(COMPLETIONS, json={"model": MODEL, "prompt": "x", "max_tokens": 2, "temperature": 1,
                                                "seed": 2**64})
        assert assert_openai_error(bad, 400)["param"] == "seed"
        events = [line.removeprefix("data: ") for line in lines if line]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length", events[-2]


def test_null_means_the_default_as_openai_clients_send_it(http):
    nulls = {"temperature": None, "top_p": None, "top_k": None, "n": None, "stream": None, "echo": None,
             "presence_penalty": None, "seed": 7}
    response = http.post(COMPLETIONS, json={"model": MODEL, "prompt": "hi", "max_tokens": 2, **nulls})
    assert response.status_code == 200, response.text  # temperature 1, top_p 1: sampled with the seed
    again = http.post(COMPLETIONS, json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "seed": 7})
    assert again.json()["choices"][0]["text"] == response.json()["choices"][0]["text"]


def test_a_temperature_below_vllms_sampling_eps_is_greedy(http):
    def text(temperature: float) -> str:
        response = http.post(COMPLETIONS, json={"model": MODEL, "prompt": "The quick", "max_tokens": 6,
                                                "temperature": temperature, "top_p": 0.5})
        assert response.status_code == 200, response.text  # top_p too: greedy ignores it, as vLLM
        return response.json()["choices"][0]["text"]

    assert text(1e-300) == text(9e-6) == text(0)


def test_a_wrong_method_gets_an_openai_error(http):
    error = assert_openai_error(http.get(COMPLETIONS), 405)
    assert "GET /v1/completions" in error["message"], error


# -- 4b. the request body limit ---------------------------------------------------------------------


def _raw_exchange(port: int, head: str, *parts: bytes) -> tuple[HTTPResponse, dict]:
    """Send a request head and body parts as they are on one connection; the response and its JSON."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n")
        for part in parts:
            sock.sendall(part)
        response = HTTPResponse(sock)
        response.begin()
        return response, json.loads(response.read())


def test_a_body_announced_over_the_limit_gets_413_before_a_byte_of_it_is_sent(server):
    head = f"POST {COMPLETIONS} HTTP/1.1\nHost: 127.0.0.1\nContent-Type: application/json\n" \
           f"Content-Length: {200 * 10**6}\n"
    response, body = _raw_exchange(server.port, head)   # the server would wait forever for 200 MB
    assert response.status == 413 and response.getheader("connection") == "close"
    assert body["error"]["code"] == "request_too_large" and body["error"]["type"] == "invalid_request_error"
    assert f"at most {DEFAULT_BODY_LIMIT} bytes" in body["error"]["message"], body


def test_a_chunked_body_is_cut_off_at_the_configured_limit(keyed_server):
    head = f"POST {COMPLETIONS} HTTP/1.1\nHost: 127.0.0.1\nContent-Type: application/json\n" \
           f"Authorization: Bearer {API_KEY}\nTransfer-Encoding: chunked\n"
    data = b'{"model": "kvgate-tiny", "prompt": "' + b"a" * KEYED_BODY_LIMIT   # one byte per chunk too many
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece) for piece in (data[:1000], data[1000:])]
    response, body = _raw_exchange(keyed_server.port, head, *chunks)       # no last chunk: never ends
    assert response.status == 413, body
    assert body["error"]["code"] == "request_too_large"
    assert f"at most {KEYED_BODY_LIMIT} bytes" in body["error"]["message"], body


def test_a_body_under_the_limit_is_read_and_judged(keyed_server):
    body = {"model": MODEL, "prompt": "a" * (KEYED_BODY_LIMIT - 100)}
    with http_client(keyed_server.port) as http:
        response = http.post(COMPLETIONS, json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert assert_openai_error(response, 400)["code"] == "context_length_exceeded"


def test_a_body_limit_that_is_no_size_is_a_usage_error():
    result = subprocess.run([sys.executable, "-m", "gates.cli", "serve", "--preset", "tiny", "--mode", "recompute",
                             "--max-request-bytes", "lots"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "engine.max_request_bytes: expected a byte size" in result.stderr, result.stderr


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
    # what G4 trends besides memory: descriptors, OS threads, event-loop tasks, the disk tier's temp files
    assert metric_value(samples, "process_open_fds") > 0
    assert metric_value(samples, "kvgate_process_threads") >= 2             # the event loop's and the engine's
    assert metric_value(samples, "kvgate_asyncio_tasks") >= 1                # the scrape's own at least
    assert metric_value(samples, "kvgate_cache_temp_files") == 0
    assert {s.labels["tier"] for s in samples["kvgate_cache_resident_bytes"]} == {"device", "host", "disk"}
    assert families["kvgate_engine_kv_buffer_bytes"].type == "gauge"
    # what G4 leaves out of memory: the buffers' pages, at most their bound (after a request, one is kept)
    assert http.post(COMPLETIONS, json={"model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code == 200
    kept = metrics(http)
    assert 0 < metric_value(kept, "kvgate_engine_kv_buffer_resident_bytes") <= metric_value(
        kept, "kvgate_engine_kv_buffer_bytes") < metric_value(kept, "kvgate_engine_kv_buffer_limit_bytes")


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
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            error = assert_openai_error(http.post(COMPLETIONS, json=body, headers=headers), 401)
            assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key", error
        assert_openai_error(http.get("/v1/models"), 401)

        authorized = http.post(COMPLETIONS, json=body, headers={"Authorization": f"Bearer {API_KEY}"})
        assert authorized.status_code == 200 and authorized.json()["usage"]["completion_tokens"] == 2
        assert http.get("/health").status_code == 200
        assert http.get("/health").json()["status"] == "ok"

    with httpx.Client(timeout=30, trust_env=False) as transport:
        def openai_client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=f"{keyed_server.base_url}/v1", api_key=key, max_retries=0,
                                 http_client=transport)

        assert MODEL in [m.id for m in openai_client(API_KEY).models.list()]
        with pytest.raises(openai.AuthenticationError):
            openai_client("wrong").models.list()


# -- 7b. the admin token ------------------------------------------------------------------------------

ADMIN_ROUTES = [("POST", "/admin/cache/evict", {"tiers": ["device"]}), ("POST", "/admin/cache/flush", {}),
                ("POST", "/admin/cache/drop-page-cache", {}), ("POST", "/admin/cache/locate", {"prompt": "hi"}),
                ("GET", "/admin/faults", None), ("POST", "/admin/faults", {"kind": "read_error"}),
                ("DELETE", "/admin/faults", None)]


@pytest.mark.parametrize("method, path, body", ADMIN_ROUTES, ids=[f"{m} {p}" for m, p, _ in ADMIN_ROUTES])
def test_an_admin_route_refuses_a_request_without_the_right_token(http, method, path, body):
    for headers, status, code in (({}, 401, "missing_admin_token"),
                                  ({ADMIN_TOKEN_HEADER: "not-the-token-at-all"}, 403, "invalid_admin_token"),
                                  ({ADMIN_TOKEN_HEADER: ADMIN_TOKEN[:-1]}, 403, "invalid_admin_token"),
                                  ({ADMIN_TOKEN_HEADER: ""}, 403, "invalid_admin_token"),
                                  ({"Authorization": f"Bearer {ADMIN_TOKEN}"}, 401, "missing_admin_token")):
        response = http.request(method, path, json=body, headers=headers)
        error = assert_openai_error(response, status)
        assert error["code"] == code and error["type"] in ("authentication_error", "permission_error"), error
    assert http.get("/admin/faults", headers={ADMIN_TOKEN_HEADER: ADMIN_TOKEN}).json()["armed"] == [], \
        "a refused request armed a fault"


def test_an_admin_route_serves_the_right_token(server, http):
    response = http.post("/admin/cache/evict", json={"tiers": ["device", "host"]},
                         headers={ADMIN_TOKEN_HEADER: ADMIN_TOKEN})
    assert response.status_code == 200 and set(response.json()["evicted"]) == {"device", "host"}, response.text
    # the admin client of the gates finds the token in its environment (tests/conftest.py puts it there)
    assert os.environ[ADMIN_TOKEN_ENV] == ADMIN_TOKEN
    assert AdminClient(server.base_url).locate(prompt="x" * 600)[0]["index"] == 0
    assert AdminClient(server.base_url, token=ADMIN_TOKEN).flush() == {"flushed": True}


def test_concurrent_admin_calls_and_requests_start_no_thread_the_server_did_not_start_with(server, http):
    """G4 trends the server's threads: work sent off the event loop runs on threads started with the server
    (the loop's offload pool), so a burst of admin calls, as each G4 fault makes, adds none."""
    threads = metric_value(metrics(http), "kvgate_process_threads")
    admin = AdminClient(server.base_url, token=ADMIN_TOKEN)
    calls = [lambda: admin.evict(("device", "host")), admin.flush, admin.drop_page_cache] * 6
    with ThreadPoolExecutor(len(calls)) as pool:
        list(pool.map(lambda call: call(), calls))
    assert metric_value(metrics(http), "kvgate_process_threads") == threads


@pytest.mark.parametrize("path", ["/admin/faults", "/admin/cache/evict", "/admin/cache/locate"])
@pytest.mark.parametrize("raw", [b"null", b"1", b"1.5", b"true", b"[]"])
def test_an_admin_route_refuses_a_body_that_is_not_an_object(http, path, raw):
    response = http.post(path, content=raw, headers={ADMIN_TOKEN_HEADER: ADMIN_TOKEN,
                                                     "content-type": "application/json"})
    assert "expected a JSON object" in assert_openai_error(response, 400)["message"]


@pytest.mark.parametrize("fault, param", [
    ({"kind": "read_error", "duration_s": 1e308}, "duration_s"),
    ({"kind": "read_error", "duration_s": 86401}, "duration_s"),
    ({"kind": "slow_disk", "duration_s": 1, "delay_ms": 1e300}, "delay_ms"),
    ({"kind": "slow_disk", "delay_ms": 60001}, "delay_ms"),
])
def test_a_fault_past_its_bounds_is_refused_and_not_armed(http, fault, param):
    headers = {ADMIN_TOKEN_HEADER: ADMIN_TOKEN}
    response = http.post("/admin/faults", json=fault, headers=headers)
    assert assert_openai_error(response, 400)["param"] == param
    assert http.get("/admin/faults", headers=headers).json()["armed"] == []


def test_a_fault_at_its_bounds_is_armed(http):
    headers = {ADMIN_TOKEN_HEADER: ADMIN_TOKEN}
    try:
        response = http.post("/admin/faults", json={"kind": "slow_disk", "duration_s": 86400, "delay_ms": 60000},
                             headers=headers)
        assert response.status_code == 200 and response.json()["armed"] == ["slow_disk"], response.text
    finally:
        http.delete("/admin/faults", headers=headers)


def test_health_metrics_and_models_need_no_admin_token(http):
    for path in ("/health", "/metrics", "/v1/models"):
        assert http.get(path).status_code == 200, path


def test_with_an_api_key_an_admin_route_needs_both_secrets(keyed_server):
    with http_client(keyed_server.port) as http:
        only_token = http.post("/admin/cache/flush", headers={ADMIN_TOKEN_HEADER: ADMIN_TOKEN})
        assert assert_openai_error(only_token, 401)["code"] == "invalid_api_key"
        only_key = http.post("/admin/cache/flush", headers={"Authorization": f"Bearer {API_KEY}"})
        assert assert_openai_error(only_key, 401)["code"] == "missing_admin_token"
    both = AdminClient(keyed_server.base_url, api_key=API_KEY, token=ADMIN_TOKEN)
    assert both.flush() == {"flushed": True}


@pytest.mark.parametrize("host, token", [("0.0.0.0", None), ("127.0.0.1", None), ("127.0.0.1", "short")],
                         ids=["any-address-no-token", "loopback-no-token", "loopback-short-token"])
def test_serve_admin_without_a_usable_token_exits_2_before_it_listens(host, token):
    env = {k: v for k, v in os.environ.items() if k != ADMIN_TOKEN_ENV} | ({ADMIN_TOKEN_ENV: token} if token else {})
    result = subprocess.run([sys.executable, "-m", "gates.cli", "serve", "--preset", "tiny", "--mode", "recompute",
                             "--admin", "--host", host, "--port", "1"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "--admin: expected an admin token" in result.stderr and ADMIN_TOKEN_ENV in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "kvgate serve:" not in result.stdout


def _serve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "gates.cli", "serve", "--preset", "tiny", "--mode", "recompute", *args]


def _serve_env(**secrets: str) -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("KVGATE_API_KEY", ADMIN_TOKEN_ENV)} | secrets


@pytest.mark.parametrize("port", ["99999", "0", "-1", "http"])
def test_serve_port_out_of_range_is_a_usage_error(port):
    result = subprocess.run(_serve_command("--port", port), cwd=REPO, env=_serve_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "argument --port: expected a port number 1-65535" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_serve_on_a_port_in_use_exits_2_before_the_start_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(_serve_command("--port", str(port)), cwd=REPO, env=_serve_env(),
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"--port: expected a free port on 127.0.0.1, found {port} in use" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_serve_with_a_short_api_key_exits_2():
    with socket.socket() as taken:  # were the key taken, the server would stop at the port
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = subprocess.run(_serve_command("--port", str(taken.getsockname()[1])), cwd=REPO,
                                env=_serve_env(KVGATE_API_KEY="x"), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "--api-key-env: expected an API key of at least 16 printable" in result.stderr, result.stderr
    assert "KVGATE_API_KEY" in result.stderr and result.stdout == ""


def test_serve_open_to_the_network_without_an_api_key_warns(tmp_path):
    process = subprocess.Popen(_serve_command("--host", "0.0.0.0", "--port", str(free_port())), cwd=REPO,
                               env=_serve_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        started = process.stdout.readline()  # the start line, after any warning
    finally:
        process.kill()
        _, errors = process.communicate(timeout=30)
    assert started.startswith("kvgate serve: kvgate-tiny"), started
    assert "warning: the API is open to the network on 0.0.0.0 without an API key" in errors, errors
    assert "KVGATE_API_KEY" in errors


def test_the_token_is_compared_in_constant_time(monkeypatch):
    compared, compare_digest = [], hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return compare_digest(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    assert auth.secret_matches("s3cret-token", "s3cret-token")
    assert not auth.secret_matches("s3cret-tokem", "s3cret-token")
    assert not auth.secret_matches("s3cret-tok\u00e9n", "s3cret-token")    # any header bytes, no exception
    assert not auth.secret_matches(None, "s3cret-token")
    assert compared[:2] == [(b"s3cret-token", b"s3cret-token"), (b"s3cret-tokem", b"s3cret-token")]


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


def test_client_disconnect_before_a_non_streamed_answer_cancels_the_request(http, server):
    """Before: a non-streamed request kept its slot after its client went, generating all its max_tokens."""
    before = metrics(http)
    body = json.dumps({"model": MODEL, "prompt": "Once", "max_tokens": 3000, "ignore_eos": True,
                       "temperature": 0}).encode()
    sockets = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(2)]
    for sock in sockets:
        sock.sendall(f"POST {COMPLETIONS} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 60
    while metric_value(metrics(http), "kvgate_requests_running") < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    for sock in sockets:
        sock.close()  # the clients give up before the answer

    deadline = time.monotonic() + 120  # the requests would have finished by then: the counts tell which
    while True:
        samples = metrics(http)
        if metric_value(samples, "kvgate_requests_running") == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)

    def delta(name: str, **labels: str) -> float:
        return metric_value(samples, name, **labels) - metric_value(before, name, **labels)

    assert metric_value(samples, "kvgate_requests_running") == 0, "the disconnected requests still hold slots"
    assert delta("kvgate_requests_finished_total", reason="cancelled") == 2
    assert delta("kvgate_requests_finished_total", reason="length") == 0
    assert delta("kvgate_generation_tokens_total") < 2 * 3000


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


def test_ignore_eos_from_benchmark_clients_is_served(http):
    # GuideLLM and `vllm bench serve` send ignore_eos: true with every request (it was a 400 here)
    response = http.post(COMPLETIONS, json={"model": MODEL, "prompt": "hi", "max_tokens": 5, "ignore_eos": True,
                                            "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 5
