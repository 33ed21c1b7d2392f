"""Live figures while a long step runs: records tailed as they land, the console's lines, CI logs' plain lines."""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time

import pytest

from gates.benches.client_bench import _process
from gates.g4_soak.soak import LiveWindow, WindowFeed, finished_at
from gates.run import plain_progress_lines
from kvcore.files import JsonlTail, append_jsonl
from kvcore.rundata import RunStore, read_records
from workloads.loadgen.blocks import run_sweep
from workloads.loadgen.live import LiveFigures, LiveStep
from workloads.loadgen.load import run_load
from workloads.loadgen.sweep import SweepSettings, prime_targets
from workloads.traffic.processes import free_port
from workloads.traffic.requests import Workload, WorkloadRequest
from workloads.traffic.target import Target


def _workload(sessions: int = 6) -> Workload:
    return Workload("live", tuple((WorkloadRequest(f"s{s}", f"s{s}", 0, ({"role": "user", "content": f"hi {s}"},),
                                                   4, 4),) for s in range(sessions)))


@pytest.fixture(scope="module")
def reference():
    port = free_port()
    command = [sys.executable, "-m", "workloads.servers.reference_server", "--port", str(port), "--ttft-ms", "20",
               "--itl-ms", "5", "--tokens", "4"]
    with _process(command, port, "/health"):
        yield Target("reference", f"http://127.0.0.1:{port}/v1", "reference")


def _in_file_order(records_dir) -> list[dict]:
    """The records of a one-process load in the order they landed (its one records file, line by line)."""
    files = list(records_dir.glob("records-*.jsonl"))
    assert len(files) == 1, files
    return [json.loads(line) for line in files[0].read_text().splitlines()]


def _median_ttft_of_first(records: list[dict], count: int) -> float:
    return statistics.median(r["ttft_s"] for r in records[:count] if r["ok"])


# ---------------------------------------------------------------------------- reading records as they land


def test_a_tail_reads_only_what_was_appended_and_a_line_caught_mid_write_once_it_is_whole(tmp_path):
    append_jsonl(tmp_path / "records-a.jsonl", {"n": 1})
    append_jsonl(tmp_path / "records-a.jsonl", {"n": 2})
    (tmp_path / "other.jsonl").write_text('{"n": 99}\n')
    tail = JsonlTail(tmp_path, "records-*.jsonl")
    assert [r["n"] for r in tail.read_new()] == [1, 2]
    assert tail.read_new() == []
    with open(tmp_path / "records-a.jsonl", "a") as handle:
        handle.write('{"n": 3}\n{"n": ')                   # the second line is still being written
    append_jsonl(tmp_path / "records-b.jsonl", {"n": 10})   # a file that appeared since
    assert sorted(r["n"] for r in tail.read_new()) == [3, 10]
    with open(tmp_path / "records-a.jsonl", "a") as handle:
        handle.write('4}\n')
    assert [r["n"] for r in tail.read_new()] == [4]


def test_live_figures_count_a_window_by_send_time_and_take_percentiles_of_its_successful_ttfts():
    figures = LiveFigures(since=10.0, until=20.0)
    figures.add([{"sent_at": 9.9, "ok": True, "ttft_s": 5.0},                  # before the window: left out
                 {"sent_at": 10.0, "ok": True, "ttft_s": 0.1},
                 {"sent_at": 12.0, "ok": False, "ttft_s": None},
                 {"sent_at": 20.0, "ok": True, "ttft_s": 7.0}])                # the next window's
    figures.add([{"sent_at": 15.0, "ok": True, "ttft_s": 0.3}, {"sent_at": 16.0, "ok": True, "ttft_s": 0.2}])
    assert (figures.requests, figures.errors) == (4, 1)
    assert figures.ttft_s(50) == pytest.approx(0.2)                           # median of 0.1, 0.2, 0.3
    # p99, linear between the sorted 0.1, 0.2, 0.3: at rank 0.99 * 2 = 1.98, so 0.2 + 0.98 * (0.3 - 0.2)
    assert figures.ttft_s(99) == pytest.approx(0.2 + 0.98 * 0.1)
    assert LiveFigures().ttft_s(50) is None


# ---------------------------------------------------------------------------- the lines


def test_a_live_step_line_names_the_step_and_shows_the_prediction_only_when_there_is_one():
    step = LiveStep(4, 9, "c=4", "baseline", 12.3, 26.0, False, 38, 0, 0.2124, 0.230)
    assert step.line() == ("step 4 / 9, c=4, baseline: 12 / 26 s, 38 requests, 0 errors, TTFT p50 212 ms, "
                           "predicted 230 ms")
    unpredicted = LiveStep(4, 9, "c=4", "baseline", 12.3, 26.0, False, 38, 2, 0.2124)
    assert unpredicted.line() == "step 4 / 9, c=4, baseline: 12 / 26 s, 38 requests, 2 errors, TTFT p50 212 ms"
    assert LiveStep(1, 9, "c=2", "candidate", 3.0, 26.0, True, 0, 0, None, 0.1).line() == (
        "step 1 / 9, c=2, candidate: 3 / 26 s, warming up")


def test_a_live_soak_window_line_says_where_the_soak_is_and_its_figures_so_far():
    line = LiveWindow(2, 60, 120.0, 14.2, 60.0, 38, 1, 0.2121, 0.4033).line()
    assert line == "soak window 3 / 60 (120 s in): 14 / 60 s, 38 requests, 1 errors, TTFT p50 212 / p99 403 ms"
    assert LiveWindow(0, 6, 0.0, 1.0, 5.0, 0, 0, None, None).line() == (
        "soak window 1 / 6 (0 s in): 1 / 5 s, 0 requests, 0 errors, no TTFT yet")


# ---------------------------------------------------------------------------- a real locust step


def test_a_running_sweep_step_tells_its_figures_so_far_and_the_prediction_given_for_it(reference, tmp_path):
    told: list[LiveStep] = []
    settings = SweepSettings(levels=(1, 2), duration_s=4, warmup_s=1, min_duration_s=0, min_requests=1,
                             out_dir=tmp_path, on_live=told.append, live_every_s=0.5,
                             predicted_ttft_p50_s={("reference", 2): 0.0236})
    frame = run_sweep([reference], _workload(), settings)
    for number, row in enumerate(frame.to_dict("records"), 1):
        live = [t for t in told if t.step == number]
        counted = [t for t in live if not t.warming_up]
        assert counted, f"step {number}: no live figures after its warm-up"
        assert all(t.steps == 2 and t.target == "reference" and t.planned_s == 4 for t in live)
        assert [t.requests for t in counted] == sorted(t.requests for t in counted) and counted[-1].requests > 0
        assert counted[-1].requests <= row["requests"]       # the live count never runs past the step's summary
        # the window's records in the order they landed: each live p50 is the median of the first ones
        in_window = [r for r in _in_file_order(tmp_path / "reference" / f"c{number}" / "records")
                     if r["sent_at"] >= row["window_start"]]
        for t in counted:
            if t.requests:
                assert t.ttft_p50_s == pytest.approx(_median_ttft_of_first(in_window, t.requests))
        assert all(t.errors == 0 for t in counted)
        expected = 0.0236 if number == 2 else None                # a prediction only for c=2
        assert all(t.predicted_ttft_p50_s == expected for t in live)
        assert all(("predicted 24 ms" in t.line()) == (number == 2) for t in counted)


def test_a_master_and_two_workers_load_tells_each_landed_record_once_from_both_workers_files(reference, tmp_path):
    told: list = []
    run = run_load(_workload(sessions=8), reference, users=4, duration_s=5, out_dir=tmp_path, workers=2,
                   on_progress=told.append, progress_every_s=0.5)
    assert run.returncode == 0, run.log
    said = [(r["worker"], r["request_id"], r["sent_at"]) for progress in told for r in progress.new_records]
    landed = {(r["worker"], r["request_id"], r["sent_at"]) for r in read_records(run.records_dir)}
    assert len(said) == len(set(said)) and set(said) <= landed       # each record told once, none made up
    assert len({worker for worker, _, _ in said}) == 2                # both workers' files were read
    assert [p.elapsed_s for p in told] == sorted(p.elapsed_s for p in told)
    assert all(p.started_at == run.started_at for p in told)


def test_priming_says_a_line_as_each_targets_priming_starts_and_ends(reference, tmp_path):
    said: list[str] = []
    rows = prime_targets([reference], _workload(sessions=4), users=2, out_dir=tmp_path, on_step=said.append)
    assert rows[0]["requests"] == 4 and said == [
        "priming reference: sending 4 requests once, 2 at a time",
        f"priming reference: done, 4 requests, 0 errors, {rows[0]['seconds']:.0f} s"]


def test_a_soak_window_tells_its_figures_so_far_from_a_real_load(reference, tmp_path):
    records_dir = tmp_path / "records"
    load = threading.Thread(target=run_load, args=(_workload(), reference, 2, 8, tmp_path), daemon=True)
    load.start()
    deadline = time.monotonic() + 60
    while not read_records(records_dir):                           # the windows start once locust is sending
        assert load.is_alive() and time.monotonic() < deadline, "the load sent nothing"
        time.sleep(0.1)
    start = time.time()
    told: list[tuple[int, float | None]] = []
    feed = WindowFeed(records_dir)
    first = feed.wait(start, 1.5, 0.3, lambda figures, _: told.append((figures.requests, figures.ttft_s(50))))
    second = feed.wait(start + 1.5, 1.5, 0.3)
    load.join(30)
    assert told and [n for n, _ in told] == sorted(n for n, _ in told) and told[-1][0] > 0
    in_window = [r for r in _in_file_order(records_dir) if start <= r["sent_at"] < start + 1.5]
    for count, p50 in told:                  # the live figures: the requests sent in the window so far
        if count:
            assert p50 == pytest.approx(_median_ttft_of_first(in_window, count))
    # a window holds the requests that completed in it, each in one window only, none lost between them
    key = lambda r: (r["request_id"], r["sent_at"])  # noqa: E731
    landed = _in_file_order(records_dir)
    assert {key(r) for r in first.records} == {key(r) for r in landed if finished_at(r) < start + 1.5}
    assert first.records and second.records and not {key(r) for r in first.records} & {key(r) for r in second.records}
    assert {key(r) for r in second.records} == {key(r) for r in landed if finished_at(r) < start + 3.0} - {
        key(r) for r in first.records}
    # the spans tile the time from the first window's start to the second's last completion
    last_first = max(finished_at(r) for r in first.records)
    assert first.span_s == pytest.approx(last_first - start)
    assert second.span_s == pytest.approx(max(finished_at(r) for r in second.records) - last_first)


def test_windows_by_completion_count_every_request_once_and_take_throughput_over_the_completions_span(tmp_path):
    """Synthetic records (a load of 2 users, 1-s requests, 16 tokens): wall-clock windows by send time lost the
    request running at each end; windows by completion count each once, over the span their completions tile."""
    records_dir = tmp_path / "records"
    start = time.time() + 0.3
    rows = [{"request_id": f"r{k}", "sent_at": start - 0.9 + 0.5 * k, "e2e_s": 1.0, "ok": True, "ttft_s": 0.1,
             "completion_tokens": 16} for k in range(7)]          # completing at start + 0.1, 0.6, ... 3.1
    for row in rows:
        append_jsonl(records_dir / "records-a.jsonl", row)
    feed = WindowFeed(records_dir)
    windows = [feed.wait(start + 1.5 * k, 1.5, 0.5) for k in range(2)]
    assert [[r["request_id"] for r in w.records] for w in windows] == [["r0", "r1", "r2"], ["r3", "r4", "r5"]]
    assert windows[0].span_s == pytest.approx(1.1) and windows[1].span_s == pytest.approx(1.5)
    assert [16 * len(w.records) / w.span_s for w in windows] == pytest.approx([48 / 1.1, 32.0])


# ---------------------------------------------------------------------------- the console


def test_ci_logs_get_one_plain_line_per_step_line_and_none_of_the_live_ones(tmp_path):
    store = RunStore(tmp_path)
    steps = store.progress_steps("g3")
    store.set_progress("g3", "step 1 / 2, c=1, baseline: running for 26 s")
    store.set_progress("g3", "step 1 / 2, c=1, baseline: 2 / 26 s, 5 requests", kind="live")
    assert store.progress("g3") == "step 1 / 2, c=1, baseline: 2 / 26 s, 5 requests"    # the spinner's
    store.set_progress("g3", "step 1 / 2, c=1, baseline: 4 / 26 s, 9 requests", kind="live")
    store.set_progress("g3", "step 1 / 2, c=1, baseline: done, 40 requests")
    store.set_progress("g3", "step 2 / 2, c=1, candidate: running for 26 s")          # at once after: both said
    new = steps.read_new()
    assert plain_progress_lines("G3 main gate", new, terminal=False) == [
        "  G3 main gate: step 1 / 2, c=1, baseline: running for 26 s",
        "  G3 main gate: step 1 / 2, c=1, baseline: done, 40 requests",
        "  G3 main gate: step 2 / 2, c=1, candidate: running for 26 s"]
    assert plain_progress_lines("G3 main gate", new, terminal=True) == []              # the spinner shows them
    store.set_progress("g3", "step 2 / 2, c=1, candidate: 2 / 26 s, 3 requests", kind="live")
    assert plain_progress_lines("G3 main gate", steps.read_new(), terminal=False) == []   # each said once
    with pytest.raises(ValueError, match="progress kind: expected one of step, live, found 'window'"):
        store.set_progress("g3", "x", kind="window")


def test_g3_looks_up_the_ttft_p50_predicted_before_it_for_each_target_and_level():
    from gates.g3_main.test_g3_main import predicted_ttft_p50_s

    rows = [{"gate": "g3", "metric": "ttft_p50_ms", "value": 230.0, "stage": "before g3",
             "context": {"target": "baseline", "concurrency": 4}},
            {"gate": "g3", "metric": "ttft_p50_ms", "value": 90.0, "stage": "before g3",
             "context": {"target": "candidate", "concurrency": 4}},
            {"gate": "g3", "metric": "hit_ratio", "value": 0.4, "stage": "before g3",
             "context": {"target": "candidate", "concurrency": 4}},
            {"gate": "g3", "metric": "ttft_p50_ms", "value": 999.0, "stage": "before g2",
             "context": {"target": "baseline", "concurrency": 8}},
            {"gate": "g3", "metric": "ttft_p50_reduction", "value": 0.6, "stage": "before g3",
             "context": {"concurrency": 4}}]
    assert predicted_ttft_p50_s(rows, ["baseline", "candidate", "recompute"], [4, 8]) == {
        ("baseline", 4): 0.230, ("candidate", 4): 0.090}                  # none for c=8 before G3, none for recompute
