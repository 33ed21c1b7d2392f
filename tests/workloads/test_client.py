"""The one definition of TTFT, ITL, TPOT and E2E, checked on hand-made SSE streams; records survive a crash."""

import json

import pytest

from kvcore.rundata import read_records
from workloads.traffic.client import RecordWriter, RequestRecord, measure_stream


def _data(payload) -> str:
    return "data: " + (payload if isinstance(payload, str) else json.dumps(payload))


def _chat(text=None, role=False, finish=None):
    delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 3, "total_tokens": 103,
                                  "prompt_tokens_details": {"cached_tokens": 64}}}


def test_ttft_skips_role_only_and_empty_chunks_and_itl_tpot_e2e_follow_the_definitions():
    lines = [
        (10.05, _data(_chat(role=True))),     # role-only: not a token
        (10.06, _data(_chat(""))),            # empty content: not a token
        (10.20, _data(_chat("Hel"))),         # first text: TTFT = 0.20
        (10.30, _data(_chat("lo"))),
        (10.50, _data(_chat("!"))),
        (10.51, _data(_chat(finish="length"))),
        (10.52, _data(USAGE)),
        (10.53, "data: [DONE]"),
    ]
    m = measure_stream(lines, sent=10.0)
    assert m.ttft_s == pytest.approx(0.20)
    assert m.itl_s == pytest.approx([0.10, 0.20])
    assert m.e2e_s == pytest.approx(0.50)                    # to the last content chunk
    assert m.tpot_s == pytest.approx((0.50 - 0.20) / (3 - 1))
    assert (m.prompt_tokens, m.completion_tokens, m.cached_tokens) == (100, 3, 64)
    assert m.tokens_from_usage and m.done and m.finish_reason == "length" and m.content_chunks == 3


def test_completions_chunks_count_by_text_and_missing_usage_falls_back_to_a_flagged_client_count():
    lines = [(1.1, _data({"choices": [{"text": "a"}]})), (1.2, _data({"choices": [{"text": ""}]})),
             (1.4, _data({"choices": [{"text": "b", "finish_reason": "stop"}]})), (1.5, "data: [DONE]")]
    m = measure_stream(lines, sent=1.0)
    assert m.ttft_s == pytest.approx(0.1) and m.completion_tokens == 2 and not m.tokens_from_usage
    assert m.prompt_tokens is None and m.cached_tokens is None
    assert m.tpot_s == pytest.approx(0.3)


def test_a_stream_whose_tokens_carry_no_text_takes_its_first_token_chunk_as_ttft():
    # vLLM streams a token whose bytes do not decode yet (random weights: often) as an empty content; with
    # max_tokens 1 no text ever comes, and the TTFT is that token's chunk, not the role's announcement
    lines = [(5.02, _data(_chat(role=True))), (5.40, _data(_chat("", finish="length"))), (5.41, _data(USAGE)),
             (5.42, "data: [DONE]")]
    m = measure_stream(lines, sent=5.0)
    assert m.ttft_s == pytest.approx(0.40) and m.content_chunks == 0 and m.token_chunks == 1
    lines = [(5.02, _data(_chat(role=True))), (5.41, _data(USAGE)), (5.42, "data: [DONE]")]
    assert measure_stream(lines, sent=5.0).ttft_s is None        # no token at all: no TTFT


def test_token_times_are_every_token_chunks_arrival_text_or_not():
    # vLLM streams each token at its step, an empty text where its bytes do not decode yet: the gaps between text
    # chunks span two steps there, the token times (kept for the decode probe) one each
    lines = [(2.01, _data(_chat(role=True))), (2.30, _data(_chat("a"))), (2.35, _data(_chat(""))),
             (2.40, _data(_chat("b"))), (2.45, _data(_chat("", finish="length"))), (2.46, "data: [DONE]")]
    m = measure_stream(lines, sent=2.0)
    assert m.token_times == pytest.approx([0.30, 0.35, 0.40, 0.45]) and m.token_chunks == 4
    assert m.itl_s == pytest.approx([0.10]) and m.ttft_s == pytest.approx(0.30)


def test_a_single_token_answer_has_no_tpot_and_no_itl():
    m = measure_stream([(0.3, _data(_chat("x"))), (0.4, "data: [DONE]")], sent=0.0)
    assert m.ttft_s == pytest.approx(0.3) and m.tpot_s is None and m.itl_s == []


def test_stream_errors_and_streams_without_done_are_reported():
    m = measure_stream([(0.1, _data(_chat("x"))), (0.2, _data({"error": {"message": "engine failed"}}))], sent=0.0)
    assert m.error == "engine failed" and not m.done
    cut = measure_stream([(0.1, _data(_chat("x")))], sent=0.0)
    assert cut.error is None and not cut.done
    assert measure_stream([(0.1, ": keep-alive comment"), (0.2, "")], sent=0.0).ttft_s is None


# (a chunk with one field of the wrong type, the field the error must name, what was found)
BAD_FIELDS = [
    ({"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 3,
                               "prompt_tokens_details": {"cached_tokens": "64"}}},
     "usage.prompt_tokens_details.cached_tokens", "'64' (str)"),
    ({"choices": [], "usage": {"prompt_tokens": 1.5, "completion_tokens": 3}}, "usage.prompt_tokens", "1.5 (float)"),
    ({"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": True}}, "usage.completion_tokens",
     "True (bool)"),
    ({"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": -2}}, "usage.completion_tokens", "-2 (int)"),
    ({"choices": [], "usage": ["prompt_tokens", 100]}, "usage", "(list)"),
    ({"choices": [], "usage": {"prompt_tokens": 1, "prompt_tokens_details": 7}}, "usage.prompt_tokens_details",
     "7 (int)"),
    ({"choices": "hello"}, "choices", "'hello' (str)"),
    ({"choices": ["hello"]}, "choices[0]", "'hello' (str)"),
    ({"choices": [{"delta": "hello"}]}, "choices[0].delta", "'hello' (str)"),
    ({"choices": [{"delta": {"content": ["a", "b"]}}]}, "choices[0].delta.content", "['a', 'b'] (list)"),
    ({"choices": [{"text": 42}]}, "choices[0].text", "42 (int)"),
    ({"choices": [{"delta": {"content": "a"}, "finish_reason": 1}]}, "choices[0].finish_reason", "1 (int)"),
]


@pytest.mark.parametrize("chunk, field, found", BAD_FIELDS, ids=[f for _, f, _ in BAD_FIELDS])
def test_a_field_of_the_wrong_type_makes_the_request_a_bad_response_naming_the_field(chunk, field, found):
    lines = [(0.1, _data(_chat("Hi"))), (0.2, _data(chunk)), (0.3, _data(USAGE)), (0.4, "data: [DONE]")]
    m = measure_stream(lines, sent=0.0)
    assert m.error_type == "bad_response"
    assert m.error.startswith(f"{field}: expected ") and found in m.error
    assert m.done                          # read on to its end: the connection stays usable


def test_a_bad_response_record_is_an_error_and_good_fields_still_read_as_before():
    from workloads.traffic.client import _apply

    record = RequestRecord("r", "s", 0, "t", 1.0, 1.0, 0.0)
    bad = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1,
                                    "prompt_tokens_details": {"cached_tokens": "64"}}}
    _apply(record, measure_stream([(0.1, _data(_chat("x"))), (0.2, _data(bad)), (0.3, "data: [DONE]")], sent=0.0))
    assert not record.ok and record.error_type == "bad_response"
    assert "cached_tokens: expected a count" in record.error_message
    nulls = {"choices": [{"delta": {"content": None}, "finish_reason": None}],
             "usage": {"prompt_tokens": 9, "completion_tokens": 1, "prompt_tokens_details": None}}
    m = measure_stream([(0.1, _data(_chat("x"))), (0.2, _data(nulls)), (0.3, "data: [DONE]")], sent=0.0)
    assert m.error is None and m.cached_tokens is None and m.prompt_tokens == 9   # null is "not said", not wrong


def test_a_chunk_that_is_not_an_object_and_an_error_given_as_a_string_are_stream_errors_not_tracebacks():
    m = measure_stream([(0.1, _data([1, 2])), (0.2, "data: [DONE]")], sent=0.0)
    assert m.error_type == "bad_response" and m.error.startswith("SSE data: expected a JSON object")
    m = measure_stream([(0.1, _data({"error": "overloaded"})), (0.2, "data: [DONE]")], sent=0.0)
    assert m.error_type == "stream_error" and m.error == "overloaded"


def test_records_are_appended_as_they_complete_and_a_torn_last_line_is_skipped(tmp_path):
    writer = RecordWriter(tmp_path, "w0")
    for i in range(3):
        writer.write(RequestRecord(f"r{i}", "s", i, "t", 1.0, 1.0, 0.0, ok=True, ttft_s=0.1 * i))
        assert len(read_records(tmp_path)) == i + 1        # on disk at once, nothing buffered
    writer.close()
    with open(writer.path, "a") as f:
        f.write('{"request_id": "r3", "sess')              # a crash mid-write
    assert [r["request_id"] for r in read_records(tmp_path)] == ["r0", "r1", "r2"]


def test_a_keep_alive_connection_the_server_closed_is_replaced_once(tmp_path):
    """A real server with a 1 s keep-alive timeout closes the idle connection; the next send reconnects."""
    import socket
    import subprocess
    import sys
    import time

    from workloads.traffic.client import StreamingClient
    from workloads.traffic.requests import WorkloadRequest

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = tmp_path / "app.py"
    app.write_text(
        "from fastapi import FastAPI\nfrom fastapi.responses import StreamingResponse\napp = FastAPI()\n"
        "@app.post('/v1/completions')\nasync def c():\n"
        "    async def gen():\n"
        "        yield 'data: {\"choices\": [{\"text\": \"x\"}]}\\n\\n'\n"
        "        yield 'data: [DONE]\\n\\n'\n"
        "    return StreamingResponse(gen(), media_type='text/event-stream')\n")
    server = subprocess.Popen([sys.executable, "-m", "uvicorn", "app:app", "--port", str(port),
                               "--timeout-keep-alive", "1", "--log-level", "warning"], cwd=tmp_path)
    try:
        client = StreamingClient(f"http://127.0.0.1:{port}/v1", "m", api="completions")
        request = WorkloadRequest("r", "s", 0, ({"role": "user", "content": "hi"},), 1, 2)
        deadline = time.monotonic() + 30
        while not client.send(request).ok:
            assert time.monotonic() < deadline, "the test server did not start"
            time.sleep(0.2)
        time.sleep(2.5)                      # the server drops the idle connection
        record = client.send(request)
        assert record.ok, record.error_message
        client.close()
    finally:
        server.terminate()
        server.wait(10)
