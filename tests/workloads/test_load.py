"""Locust drives workloads through the streaming client against the real embedded server."""

import itertools
import json
import re
import selectors
import socket
import struct
import threading
import time
from collections import defaultdict
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional, cast

import pytest

from kvcore.rundata import read_records
from tests.servers import started_server
from workloads.loadgen.blocks import run_sweep
from workloads.loadgen.load import run_load
from workloads.loadgen.sweep import SweepSettings, paced, prime_targets, read_client_samples, summarize_step
from workloads.traffic.client import StreamingClient
from workloads.traffic.requests import Workload, WorkloadRequest
from workloads.traffic.target import Target

SYSTEM = "You answer questions about the document. " * 12


def _workload(sessions: int = 6, turns: int = 3, tag: str = "Document") -> Workload:
    """Sessions whose turns extend the previous turn's messages (a growing shared prefix)."""
    built = []
    for s in range(sessions):
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"{tag} {s}: " + "facts and figures " * 20}]
        turns_of_session = []
        for t in range(turns):
            messages = messages + [{"role": "user", "content": f"Question {t} about document {s}?"}]
            turns_of_session.append(WorkloadRequest(f"s{s}-t{t}", f"s{s}", t, tuple(messages), 8,
                                                    sum(len(m["content"]) for m in messages)))
            messages = messages + [{"role": "assistant", "content": "An answer. " * 3}]
        built.append(tuple(turns_of_session))
    return Workload("test-sessions", tuple(built))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from started_server(tmp_path_factory.mktemp("kvgate-load"))


@pytest.fixture
def target(server):
    return Target("embedded", f"{server.base_url}/v1", "kvgate-tiny")


def _by_session(records):
    sessions = defaultdict(list)
    for r in sorted(records, key=lambda r: r["sent_at"]):
        sessions[(r["worker"], r["session_id"])].append(r["turn"])
    return sessions


def test_a_headless_locust_run_records_every_request_in_session_order(target, tmp_path):
    run = run_load(_workload(), target, users=3, duration_s=6, out_dir=tmp_path)
    records = read_records(run.records_dir)
    assert run.returncode == 0, run.log
    assert len(records) >= 10 and all(r["ok"] for r in records), records[:3]
    for turns in _by_session(records).values():      # a user runs a session's turns in order
        assert turns[: len(turns) // 3 * 3] == [0, 1, 2] * (len(turns) // 3)
    assert all(r["ttft_s"] > 0 and r["completion_tokens"] == 8 and r["tokens_from_usage"] for r in records)
    later_turns = [r for r in records if r["turn"] > 0]
    assert later_turns and all(r["cached_tokens"] >= 256 for r in later_turns)   # the prefix really was reused
    samples = read_client_samples(run.records_dir)
    assert samples and all(0 <= s["cpu_percent"] for s in samples)


def test_a_request_budget_stops_the_run_early(target, tmp_path):
    run = run_load(_workload(), target, users=2, duration_s=60, out_dir=tmp_path, max_requests=5)
    assert len(read_records(run.records_dir)) == 5
    assert run.ended_at - run.started_at < 45


def test_an_interleaved_workload_takes_every_sessions_turn_round_robin_one_at_a_time(target, tmp_path):
    workload = replace(_workload(sessions=4, tag="Interleaved"), interleaved=True)
    run = run_load(workload, target, users=1, duration_s=30, out_dir=tmp_path / "one", max_requests=12)
    order = [(r["session_id"], r["turn"]) for r in sorted(read_records(run.records_dir), key=lambda r: r["sent_at"])]
    assert order == [(f"s{s}", t) for t in range(3) for s in range(4)]   # turn-major: every user, then again
    run = run_load(workload, target, users=3, duration_s=6, out_dir=tmp_path / "three")
    records = read_records(run.records_dir)
    assert run.returncode == 0 and len(records) >= 12 and all(r["ok"] for r in records)
    by_session = defaultdict(list)
    for r in records:
        by_session[r["session_id"]].append((r["sent_at"], r["sent_at"] + r["e2e_s"], r["turn"]))
    for turns in by_session.values():
        turns.sort()
        assert [t for *_, t in turns] == [i % 3 for i in range(len(turns))]   # in order, cycling
        assert all(prev_end <= start for (_, prev_end, _), (start, _, _) in zip(turns, turns[1:]))  # never overlapping


def test_requests_sent_together_go_out_in_the_order_the_users_took_them(order_recorder, tmp_path):
    """A block's users start together; each connects as it starts, so it sends a turn the moment it takes it and
    the turns reach the target in the order taken. Connecting at its first request, a user yielded to the others
    between taking a turn and sending it, and the eight connects completed in any order (mostly the reverse)."""
    workload = replace(_workload(sessions=8, turns=1, tag="Order"), interleaved=True)
    for attempt in range(3):
        run = run_load(workload, order_recorder.target, users=8, duration_s=30, out_dir=tmp_path / f"wave{attempt}",
                       max_requests=8, stop_rule=None)
        taken = [r["session_id"] for r in sorted(read_records(run.records_dir), key=lambda r: r["sent_at"])]
        assert taken == [f"s{s}" for s in range(8)], run.log          # the users took the turns in order
        assert order_recorder.take() == list(range(8))                # and they arrived in that order


# Linux's SO_TIMESTAMPNS (asm-generic/socket.h): each read's ancillary data carries when the kernel received its first
# bytes; an accepted socket inherits it from its listener, so it covers bytes that came before the accept
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)


class _OrderRecorder:
    """A one-thread HTTP/1.1 target that notes the order in which whole requests reached it: each by when the kernel
    received its first bytes (not when this loop got round to reading them), answering each with a 503."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        self.listener.setblocking(False)
        self.target = Target("recorder", f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1", "m")
        self.arrived: list[tuple[float, int]] = []          # (received at, the session's number)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.lock, self.stopping = threading.Lock(), False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def take(self) -> list[int]:
        """The sessions of the requests received since the last take, in the order they reached this host."""
        with self.lock:
            arrived, self.arrived = self.arrived, []
        return [session for _, session in sorted(arrived)]

    def stop(self) -> None:
        self.stopping = True
        self.thread.join(timeout=5)
        self.listener.close()

    def _serve(self) -> None:
        pending: dict[socket.socket, tuple[Optional[float], bytes]] = {}
        while not self.stopping:
            for key, _ in self.selector.select(timeout=0.1):
                if key.fileobj is self.listener:
                    connection, _ = self.listener.accept()
                    self.selector.register(connection, selectors.EVENT_READ)
                    pending[connection] = (None, b"")
                    continue
                connection = cast(socket.socket, key.fileobj)
                data, ancillary, _, _ = connection.recvmsg(1 << 16, socket.CMSG_SPACE(16))
                if not data:
                    self.selector.unregister(connection)
                    connection.close()
                    continue
                received, buffered = pending[connection]
                if received is None:
                    seconds, nanoseconds = struct.unpack("qq", ancillary[0][2]) if ancillary else (time.time(), 0)
                    received = seconds + nanoseconds / 1e9
                pending[connection] = self._answered(connection, received, buffered + data)

    def _answered(self, connection: socket.socket, received: float,
                  data: bytes) -> tuple[Optional[float], bytes]:
        head, separator, body = data.partition(b"\r\n\r\n")
        length = re.search(rb"(?i)content-length: *(\d+)", head)
        if not separator or length is None or len(body) < int(length[1]):
            return received, data
        session = re.search(rb"Order (\d+): ", body)
        with self.lock:
            self.arrived.append((received, int(session[1]) if session else -1))
        answer = b'{"error": {"message": "noted", "type": "server_error"}}'
        connection.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(answer), answer))
        return None, body[int(length[1]):]


@pytest.fixture
def order_recorder():
    recorder = _OrderRecorder()
    try:
        yield recorder
    finally:
        recorder.stop()


def test_distributed_locust_with_two_workers_collects_the_records_of_both(target, tmp_path):
    run = run_load(_workload(sessions=8), target, users=4, duration_s=8, out_dir=tmp_path, workers=2)
    records = read_records(run.records_dir)
    assert run.returncode == 0, run.log
    processes = {r["worker"] for r in records}
    assert len(processes) == 2 and len(records) >= 8 and all(r["ok"] for r in records)
    first_pass = defaultdict(set)
    for r in records:
        first_pass[r["worker"]].add(r["session_id"])
    a, b = first_pass.values()
    assert not a & b                                   # each worker takes its own sessions
    assert len(list(run.records_dir.glob("records-*.jsonl"))) == 2


def test_a_sweep_returns_one_valid_row_per_level_and_target(target, tmp_path):
    said = []
    settings = SweepSettings(levels=(1, 3), duration_s=6, warmup_s=1, min_duration_s=3, min_requests=3,
                             out_dir=tmp_path, on_step=said.append)
    frame = run_sweep([target], _workload(), settings)
    # progress: a line as each step starts and one with its figures as it ends
    assert said[0] == "step 1 / 2, c=1, embedded: running for 6 s" and said[1].startswith(
        "step 1 / 2, c=1, embedded: done, "
    )
    assert "TTFT p50" in said[1] and "errors 0.0%" in said[1] and len(said) == 4
    assert list(frame["concurrency"]) == [1, 3] and list(frame["target"]) == ["embedded", "embedded"]
    _valid_unless_the_machine_is_busy(frame)
    assert (
        (frame["completed"] > 0).all() and (frame["ttft_p50_s"] > 0).all() and (frame["output_tokens_per_s"] > 0).all()
    )
    assert (frame["hit_ratio"] > 0).all() and (frame["error_rate"] == 0).all()


# What a step on a busy machine may be refused for: too little measured, or a saturated client. A step is
# valid exactly when it has no reason; no other reason (errors, token counts, usage) may appear here.
LOAD_DEPENDENT = ("measured ", "completed requests < minimum", "client saturated: ")


def _valid_unless_the_machine_is_busy(frame):
    for valid, reasons in zip(frame["valid"], frame["invalid_reasons"]):
        assert valid == (reasons == "")
        assert all(reason.startswith(LOAD_DEPENDENT) or LOAD_DEPENDENT[1] in reason
                   for reason in filter(None, reasons.split("; "))), reasons


def test_priming_sends_every_turn_once_and_the_prefix_then_returns_as_a_hit(target, tmp_path):
    workload = _workload(sessions=5, tag="Primed record")
    fresh = StreamingClient(target.url, target.model, target="probe")
    unseen = fresh.send(workload.sessions[4][0]).cached_tokens      # at most the shared system prompt hits
    assert unseen < workload.sessions[4][0].prompt_tokens // 256 * 256
    rows = prime_targets([target], workload, users=2, out_dir=tmp_path)
    assert rows[0]["requests"] == rows[0]["expected"] == 15 and rows[0]["errors"] == 0
    sent = read_records(tmp_path / "embedded" / "prime" / "records")
    assert sorted((r["session_id"], r["turn"]) for r in sent) == [(f"s{s}", t) for s in range(5) for t in range(3)]
    again = fresh.send(workload.sessions[0][2])
    fresh.close()
    assert again.ok and again.cached_tokens > unseen                    # primed: the whole history hits too


def _record(sent_at, ttft, e2e, tokens=4, chunks=4, ok=True, cached=0, **extra):
    return {"sent_at": sent_at, "ok": ok, "ttft_s": ttft, "e2e_s": e2e, "tpot_s": (e2e - ttft) / (tokens - 1),
            "itl_s": [(e2e - ttft) / (tokens - 1)] * (tokens - 1), "completion_tokens": tokens,
            "content_chunks": chunks, "prompt_tokens": 100, "cached_tokens": cached, "tokens_from_usage": True,
            **extra}


def test_step_summary_excludes_warm_up_by_time_and_takes_percentiles_of_raw_records():
    records = [_record(100.5, 9.0, 9.5)] + [_record(102 + i, 0.1 * (i + 1), 1.0 + i * 0.01, cached=50)
                                             for i in range(10)]
    summary = summarize_step(records, [], 100.0, 130.0,
                             SweepSettings(warmup_s=1.0, min_duration_s=5, min_requests=5))
    assert summary["requests"] == 10                       # the warm-up request is excluded
    assert summary["ttft_p50_s"] == pytest.approx(0.55)    # median of 0.1 .. 1.0
    assert summary["hit_ratio"] == pytest.approx(0.5)
    assert summary["output_tokens_per_s"] == pytest.approx(40 / (102 + 9 + 1.09 - 101.0))  # to the last completion
    assert summary["valid"], summary["invalid_reasons"]


def test_a_step_is_invalid_with_too_few_requests_a_saturated_client_or_disagreeing_token_counts():
    settings = SweepSettings(warmup_s=0, min_duration_s=5, min_requests=5)
    few = summarize_step([_record(1, 0.1, 0.5)], [], 0.0, 30.0, settings)
    assert not few["valid"] and "1 completed requests < minimum 5" in few["invalid_reasons"]
    records = [_record(1 + i, 0.1, 0.5) for i in range(10)]
    busy = summarize_step(records, [{"t": 2, "cpu_percent": 99.0, "loop_lag_s": 0.2}], 0.0, 30.0, settings)
    assert "client saturated: CPU" in busy["invalid_reasons"] and "event-loop lag" in busy["invalid_reasons"]
    # the last answer at 10.5 s: a stall that began after it (the load process stopping its users) measured nothing,
    # one that began before it did (a G3 block was once invalid for the 55 ms its process took to stop)
    stopping = {"t": 10.56, "cpu_percent": 30.0, "loop_lag_s": 0.055}
    assert summarize_step(records, [stopping], 0.0, 30.0, settings)["valid"]
    stalled = {**stopping, "t": 10.54}
    assert "event-loop lag 55 ms > 50 ms" in summarize_step(records, [stalled], 0.0, 30.0, settings)["invalid_reasons"]
    skewed = [_record(1 + i, 0.1, 0.5, tokens=4, chunks=2) for i in range(10)]
    assert "token counts disagree" in summarize_step(skewed, [], 0.0, 30.0, settings)["invalid_reasons"]
    batched = [_record(1 + i, 0.1, 0.5, tokens=4, chunks=2, token_chunks=2) for i in range(10)]
    assert "token counts disagree" in summarize_step(batched, [], 0.0, 30.0, settings)["invalid_reasons"]
    short = [_record(1 + i, 0.1, 0.5, tokens=4, chunks=6) for i in range(10)]     # the server's count is short
    assert "token counts disagree in 10 of 10" in summarize_step(short, [], 0.0, 30.0, settings)["invalid_reasons"]
    # vLLM: 4 tokens in 4 chunks, 2 of them empty (bytes not yet decoded); an OpenAI-style closing chunk: 5 chunks
    textless = [_record(1 + i, 0.1, 0.5, tokens=4, chunks=2, token_chunks=4 + i % 2) for i in range(10)]
    assert summarize_step(textless, [], 0.0, 30.0, settings)["valid"]


def test_tokens_streamed_without_text_leave_the_step_valid_and_drop_only_its_itl():
    """vLLM streams a token whose bytes do not decode yet as an empty content: with kvgate's byte-level model most
    of its requests came in 0-10 text chunks of 16 tokens, every token its own chunk. TTFT, TPOT and throughput
    count the server's tokens and stand; the gaps between texts are no gaps between tokens. A few requests with
    tokens batched in one chunk leave ITL standing; more make the step invalid (a server whose count is too high
    sends the same stream: the selftest's d-invalid-only)."""
    settings = SweepSettings(warmup_s=0, min_duration_s=5, min_requests=5)
    whole = [_record(1 + i, 0.1, 0.5) for i in range(20)]
    textless = [_record(1 + i, 0.1, 0.5, tokens=4, chunks=2, token_chunks=4) for i in range(20)]
    plain, step = summarize_step(whole, [], 0.0, 30.0, settings), summarize_step(textless, [], 0.0, 30.0, settings)
    assert step["valid"], step["invalid_reasons"]
    assert step["itl_p50_s"] is None and "20 of 20 requests came in fewer text chunks than tokens" in step["itl_note"]
    assert plain["itl_p50_s"] is not None and plain["itl_note"] == ""
    for figure in ("ttft_p50_s", "tpot_p50_s", "output_tokens_per_s"):
        assert step[figure] == plain[figure]
    one = [_record(1, 0.1, 0.5, tokens=4, chunks=2, token_chunks=2)] + whole[1:]      # 1 of 20: within 5%
    kept = summarize_step(one, [], 0.0, 30.0, settings)
    assert kept["valid"] and kept["itl_p50_s"] is not None
    two = [_record(1 + i, 0.1, 0.5, tokens=4, chunks=2, token_chunks=2) for i in range(2)] + whole[2:]
    assert "token counts disagree in 2 of 20" in summarize_step(two, [], 0.0, 30.0, settings)["invalid_reasons"]


def _failed(sent_at, error_type, message):
    return {"sent_at": sent_at, "ok": False, "error_type": error_type, "error_message": message, "ttft_s": None,
            "e2e_s": None, "tpot_s": None, "itl_s": [], "completion_tokens": None, "content_chunks": 0,
            "prompt_tokens": None, "cached_tokens": None, "tokens_from_usage": False}


def test_a_step_whose_errors_pass_the_error_share_is_invalid_with_its_errors_by_type_and_a_sample():
    """A hostile server: 500 to every 3rd request, 400 to every 7th (43% failed) was a valid step."""
    records = []
    for i in range(1, 43):
        if i % 3 == 0:
            records.append(_failed(i, "http_500", "internal_error: boom"))
        elif i % 7 == 0:
            records.append(_failed(i, "http_400", "bad_request: no"))
        else:
            records.append(_record(i, 0.1, 0.5))
    settings = SweepSettings(warmup_s=0, min_duration_s=5, min_requests=5)
    summary = summarize_step(records, [], 0.0, 60.0, settings)
    assert summary["error_rate"] == pytest.approx(18 / 42) and not summary["valid"]
    reasons = summary["invalid_reasons"]
    assert reasons.startswith("18 of 42 measured requests failed (42.9% > 1% allowed)")
    assert "errors: 14 http_500 (e.g. 'internal_error: boom'), 4 http_400 (e.g. 'bad_request: no')" in reasons
    one_in_a_hundred = [_record(i, 0.1, 0.5) for i in range(99)] + [_failed(100, "timeout", "timed out")]
    assert summarize_step(one_in_a_hundred, [], 0.0, 120.0, settings)["valid"]          # 1%: allowed
    strict = SweepSettings(warmup_s=0, min_duration_s=5, min_requests=5, max_error_share=0.0)
    assert "1 of 100 measured requests failed" in summarize_step(one_in_a_hundred, [], 0.0, 120.0, strict)[
        "invalid_reasons"]


class _HostileHandler(BaseHTTPRequestHandler):
    """500 to every 3rd request, 400 to every 7th, a string cached_tokens in every 5th stream, else a good stream."""

    protocol_version = "HTTP/1.1"
    served = itertools.count(1)

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        n = next(self.served)
        if n % 3 == 0 or n % 7 == 0:
            status = 500 if n % 3 == 0 else 400
            self._send(status, "application/json", json.dumps({"error": {"code": f"e{status}", "message": "no"}}))
            return
        cached = "64" if n % 5 == 0 else 64
        chunks = [{"choices": [{"index": 0, "delta": {"content": "x"}}]} for _ in range(4)]
        chunks.append({"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 4,
                                                "prompt_tokens_details": {"cached_tokens": cached}}})
        self._send(200, "text/event-stream", "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n")

    def _send(self, status, kind, body):
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def hostile_target():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HostileHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Target("hostile", f"http://127.0.0.1:{server.server_address[1]}/v1", "m")
    finally:
        server.shutdown()
        server.server_close()


def test_a_sweep_against_a_hostile_server_over_http_does_not_crash_and_its_step_is_invalid(hostile_target, tmp_path):
    settings = SweepSettings(levels=(2,), duration_s=4, warmup_s=0.5, min_duration_s=1, min_requests=3,
                             out_dir=tmp_path, stop_rule=None)
    row = run_sweep([hostile_target], _workload(sessions=4, turns=2), settings).iloc[0]
    records = read_records(tmp_path / "hostile" / "c2" / "records")
    kinds = {r["error_type"] for r in records if not r["ok"]}
    assert {"http_500", "http_400", "bad_response"} <= kinds          # the path ran: every hostile answer seen
    assert not row["valid"] and "measured requests failed" in row["invalid_reasons"]
    assert "bad_response (e.g. 'usage.prompt_tokens_details.cached_tokens: expected a count" in row["invalid_reasons"]
    assert all(isinstance(r["cached_tokens"], int) for r in records if r["ok"])
    assert row["hit_ratio"] == pytest.approx(0.64)                  # from the good answers alone


def test_paced_sessions_arrive_as_a_poisson_process_at_the_requested_rate():
    from workloads.loadgen.sweep import paced

    workload = paced(_workload(sessions=3), rate_per_s=5.0, duration_s=40, seed=1)
    starts = [s[0].arrival_s for s in workload.sessions]
    assert len(starts) == int(5 * 40 * 1.2) + 1 and starts == sorted(starts)
    assert len(starts) / starts[-1] == pytest.approx(5.0, rel=0.15)
    assert all(r.arrival_s is None for s in workload.sessions for r in s[1:])   # later turns follow at once
    assert len({r.request_id for r in workload.requests}) == len(workload.requests)


def test_a_rate_step_runs_open_loop_and_reports_its_rate(target, tmp_path):
    settings = SweepSettings(levels=(), rates=(4.0,), rate_users=4, duration_s=6, warmup_s=1, min_duration_s=3,
                             min_requests=3, out_dir=tmp_path)
    frame = run_sweep([target], _workload(sessions=4, turns=1), settings)
    row = frame.iloc[0]
    assert row["rate_per_s"] == 4.0 and row["users"] == 4
    _valid_unless_the_machine_is_busy(frame)
    # open loop: requests fall due on the step's Poisson schedule (seed 0: 10 arrivals in its 5 s window, a
    # sparse stretch of a 4/s process), however fast the server answers; requests_per_s is what it answered
    # and is the machine's to say. A late send can move a request across the window's start: a few either way.
    scheduled = paced(_workload(sessions=4, turns=1), 4.0, 6).sessions
    in_window = sum(1 <= session[0].arrival_s < 6 for session in scheduled)
    assert abs(row["due"] - in_window) <= 3 and row["due"] == row["sent"] + row["not_sent"]
    assert row["finished"] + row["unfinished"] == row["sent"] and row["completed"] > 0


def test_a_child_started_with_die_with_parent_ends_when_its_parent_is_killed(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "from workloads.traffic.processes import die_with_parent\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], preexec_fn=die_with_parent)\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n")])
    deadline = time.monotonic() + 20
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pid_file.read_text())
    parent.send_signal(signal.SIGKILL)
    parent.wait(10)
    deadline = time.monotonic() + 10
    while True:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break                                   # the child is gone
        with open(f"/proc/{child}/stat") as stat:
            if stat.read().split()[2] == "Z":       # ended, waiting to be reaped by init
                break
        assert time.monotonic() < deadline, "the child outlived its killed parent"
        time.sleep(0.05)
