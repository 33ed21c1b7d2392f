"""A target that is not there or stops answering: the client backs off, the step ends early and says why."""

import subprocess
import sys
import threading
import time

import pytest

from kvcore.g3_analysis import level_figures
from kvcore.rundata import read_records
from tests.servers import free_port
from workloads.loadgen.blocks import run_sweep
from workloads.loadgen.load import run_load
from workloads.loadgen.sweep import SweepSettings, summarize_step
from workloads.traffic.client import Backoff, StreamingClient
from workloads.traffic.errors import DeadTargetDetector, StopRule, describe_errors, summarize_errors
from workloads.traffic.requests import Workload, WorkloadRequest
from workloads.traffic.target import Target


def _workload(sessions: int = 4) -> Workload:
    return Workload("short", tuple((WorkloadRequest(f"s{s}", f"s{s}", 0, ({"role": "user", "content": f"hi {s}"},),
                                                    4, 4),) for s in range(sessions)))


def _failed(error_type, message, sent_at=1.0):
    return {"sent_at": sent_at, "ok": False, "error_type": error_type, "error_message": message, "ttft_s": None,
            "e2e_s": None, "tpot_s": None, "itl_s": [], "completion_tokens": None, "content_chunks": 0,
            "prompt_tokens": None, "cached_tokens": None, "tokens_from_usage": False}


def test_the_backoff_doubles_from_50_ms_to_a_2_s_cap_and_an_answer_resets_it():
    backoff = Backoff()
    delays = []
    for _ in range(8):
        backoff.failed()
        delays.append(backoff.delay_s)
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    backoff.reset()
    assert backoff.delay_s == 0.0


def test_a_client_against_a_refused_port_backs_off_instead_of_spinning():
    client = StreamingClient(f"http://127.0.0.1:{free_port()}/v1", "m")
    deadline, records = time.monotonic() + 3.0, []
    while time.monotonic() < deadline:
        records.append(client.send(_workload().sessions[0][0]))
    assert {(r.error_type, r.error_message) for r in records} == {("connection_refused", "Connection refused")}
    assert len(records) <= 10          # 50 ms doubling: about 6 in 3 s (without the backoff: thousands)


def test_locust_users_against_a_refused_port_make_a_few_attempts_a_second(tmp_path):
    target = Target("dead", f"http://127.0.0.1:{free_port()}/v1", "m")
    run = run_load(_workload(), target, users=2, duration_s=4, out_dir=tmp_path)
    records = read_records(run.records_dir)
    assert records and all(r["error_type"] == "connection_refused" for r in records)
    assert len(records) <= 100, len(records)   # two users: about 15 (the busy loop made ~3,000 a second)
    assert run.stopped is None                 # no stop rule: the load runs on, backing off


def test_the_detector_judges_a_target_dead_after_connection_errors_in_a_row_and_an_answer_resets_it():
    clock = [0.0]
    detector = DeadTargetDetector(StopRule(errors_in_a_row=3, silent_s=10), clock=lambda: clock[0])
    assert not detector.observe("connection_refused", "Connection refused")
    assert not detector.observe("http_400", "bad request")            # an answer: the target is there
    assert not detector.observe("connection_refused") and not detector.observe("connection_reset", "x")
    assert detector.observe("connection_refused", "Connection refused")
    assert detector.reason() == "target stopped answering: connection refused (3 in a row)"
    detector = DeadTargetDetector(StopRule(errors_in_a_row=100, silent_s=5), clock=lambda: clock[0])
    assert not detector.observe("timeout", "timed out")
    clock[0] = 5.5
    assert detector.observe("timeout", "timed out")                   # silent for long enough
    assert detector.reason() == "target stopped answering: timed out (2 in a row over 5.5 s)"


def test_an_invalid_step_summarises_its_errors_by_type_with_a_sample_message():
    records = ([_failed("connection_refused", "Connection refused") for _ in range(412)]
               + [_failed("http_400", "context_length_exceeded: the prompt has 9000 tokens") for _ in range(3)])
    summary = summarize_step(records, [], 0.0, 30.0, SweepSettings(warmup_s=0, min_duration_s=5, min_requests=10))
    assert summary["invalid_reasons"] == (
        "415 of 415 measured requests failed (100.0% > 1% allowed): not a measurement of the target; "
        "0 completed requests < minimum 10; errors: 412 connection_refused (e.g. 'Connection refused'), "
        "3 http_400 (e.g. 'context_length_exceeded: the prompt has 9000 tokens')")
    assert summary["errors_by_type"]["http_400"]["count"] == 3
    assert describe_errors(summarize_errors([_failed(f"t{i}", "m") for i in range(6)]), limit=4).endswith(
        "2 more (2 other types)")


def test_the_error_summary_reaches_the_g3_verdict_reason_named_by_target():
    settings = SweepSettings(warmup_s=0, min_duration_s=5, min_requests=10)
    dead = summarize_step([_failed("connection_refused", "Connection refused")] * 5, [], 0.0, 30.0, settings)
    figures = level_figures({"summary": {**dead, "target": "baseline"}, "records": []},
                            {"summary": {**dead, "target": "candidate"}, "records": []})
    assert not figures.valid
    assert figures.invalid_reason.startswith("baseline: 5 of 5 measured requests failed (100.0% > 1% allowed): not a "
                                             "measurement of the target; 0 completed requests < minimum 10; "
                                             "errors: 5 connection_refused (e.g. 'Connection refused'); candidate: ")


@pytest.fixture
def reference_server():
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "workloads.servers.reference_server", "--port", str(port),
                               "--ttft-ms", "20", "--itl-ms", "5", "--tokens", "4"])
    client = StreamingClient(f"http://127.0.0.1:{port}/v1", "m")
    deadline = time.monotonic() + 30
    while not client.send(_workload().sessions[0][0]).ok:
        assert time.monotonic() < deadline and server.poll() is None, "the reference server did not start"
    client.close()
    yield server, port
    server.kill()
    server.wait(10)


def _kill_once_answered(server, records_dir, answered: int) -> None:
    """Kill the server once the step has `answered` completed requests (the target dies mid-step)."""
    deadline = time.monotonic() + 60
    while sum(r["ok"] for r in read_records(records_dir)) < answered and time.monotonic() < deadline:
        time.sleep(0.1)
    server.kill()


def test_a_target_killed_mid_step_ends_the_step_with_the_reason_and_its_later_levels_are_not_run(
        reference_server, tmp_path):
    server, port = reference_server
    target = Target("candidate", f"http://127.0.0.1:{port}/v1", "m")
    settings = SweepSettings(levels=(2, 4), duration_s=40, warmup_s=0, min_duration_s=1, min_requests=1,
                             out_dir=tmp_path)
    killer = threading.Thread(target=_kill_once_answered, args=(server, tmp_path / "candidate" / "c2" / "records", 20))
    killer.start()
    rows = run_sweep([target], _workload(), settings).to_dict("records")
    killer.join()
    first, second = rows
    assert first["stopped_reason"].startswith("target stopped answering: connection refused (")
    assert first["invalid_reasons"].startswith(first["stopped_reason"])
    assert "errors: " in first["invalid_reasons"] and "connection_refused" in first["invalid_reasons"]
    records = read_records(tmp_path / "candidate" / "c2" / "records")
    refused = [r for r in records if r["error_type"] == "connection_refused"]
    assert 1 <= len(refused) <= 20                                  # stopped after 10 in a row, not hammered
    assert max(r["sent_at"] for r in records) - min(r["sent_at"] for r in records) < settings.duration_s / 2
    assert second["not_run"] and second["concurrency"] == 4 and not second["valid"]
    assert second["invalid_reasons"] == f"not run: at c2, {first['stopped_reason']}"
    assert not (tmp_path / "candidate" / "c4").exists()            # nothing was sent at the next level


def test_a_g4_window_counts_its_errors_by_type():
    from gates.g4_soak.soak import _window_row

    records = [_failed("http_500", "server_error: the engine failed")] * 2 + [_failed("connection_reset", "reset")]
    row = _window_row(0, 0.0, records, {}, [], 10.0)
    assert row["errors"] == 3
    assert row["errors_by_type"] == {"http_500": {"count": 2, "example": "server_error: the engine failed"},
                                     "connection_reset": {"count": 1, "example": "reset"}}


def test_the_g4_windows_error_summaries_merge_into_one_by_type():
    from workloads.traffic.errors import describe_errors, merge_error_summaries

    windows = [{"connection_refused": {"count": 3, "example": "Connection refused"}},
               {}, None,
               {"http_400": {"count": 5, "example": "context_length_exceeded: too long"},
                "connection_refused": {"count": 1, "example": "later"}}]
    merged = merge_error_summaries(windows)
    assert list(merged) == ["http_400", "connection_refused"]
    assert merged["connection_refused"] == {"count": 4, "example": "Connection refused"}
    assert describe_errors(merged) == ("5 http_400 (e.g. 'context_length_exceeded: too long'), "
                                       "4 connection_refused (e.g. 'Connection refused')")
