"""G3 on a trace: priming never sends a measured request, and levels offer different loads."""

from __future__ import annotations

import json
import math
import sys

import pytest
import yaml

from cache_impl.cache.config import ConfigError
from gates.benches.client_bench import _peak_concurrency, _process
from gates.cli import main
from gates.config import load_config
from kvcore.g3_analysis import Ladder, due_latencies, goodput, sustained_rate_gain
from kvcore.rundata import read_records
from tests.traces import TRACE_PATH, needs_real_trace, write_trace
from workloads.loadgen.blocks import run_sweep
from workloads.loadgen.sweep import SweepSettings, describe_replay, plan_steps, primer
from workloads.traffic.datasets import ByteSizer, build_workload
from workloads.traffic.processes import free_port
from workloads.traffic.requests import load_order
from workloads.traffic.target import Target

BYTES = ByteSizer()

# 12 requests, 512 tokens per hash id, one every 250 ms; every request shares block 1 with the first.
ROWS = [{"timestamp": 250 * i, "input_length": 1024, "output_length": 4, "hash_ids": [1, 100 + i]}
        for i in range(12)]


def _trace(tmp_path, **spec):
    return build_workload({"kind": "trace", "path": str(write_trace(tmp_path, ROWS)), "length_scale": 0.25,
                           **spec}, BYTES, seed=0)


def _prompts(workload) -> set[str]:
    return {"".join(m["content"] for m in r.messages) for r in workload.requests}


# --------------------------------------------------------------------------- warm-up


def test_priming_a_trace_sends_its_warm_up_requests_never_a_measured_one(tmp_path):
    workload = _trace(tmp_path, warmup_requests=4, limit=6)
    primed, measured = primer(workload), workload
    assert [r.request_id for r in primed.requests] == [f"trace-{i}" for i in range(4)]
    assert [r.request_id for r in measured.requests] == [f"trace-{i}" for i in range(4, 10)]
    assert not _prompts(primed) & _prompts(measured)                  # disjoint: no measured prompt is primed
    assert all(r.arrival_s is None for r in primed.requests)          # sent as fast as the target answers
    assert [r.arrival_s for r in measured.requests] == [0.25 * i for i in range(6)]   # from the first measured


def test_a_trace_without_warm_up_primes_nothing_and_other_workloads_prime_every_turn_once(tmp_path):
    assert primer(_trace(tmp_path)).sessions == ()
    rounds = build_workload({"kind": "multi_round_qa", "users": 3, "rounds": 2, "document_tokens": 50,
                             "question_tokens": 5, "answer_tokens": 5}, BYTES, seed=0)
    primed = primer(rounds)        # every turn of every session once, in the workload's (interleaved) load order
    assert [r.request_id for r in primed.requests] == [r.request_id for r in load_order(rounds)]
    assert all(len(session) == 1 for session in primed.sessions) and not primed.warmup


def test_warm_up_as_long_as_the_trace_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="workload.warmup_requests: expected fewer than the trace's 12 requests"):
        _trace(tmp_path, warmup_requests=12)


@needs_real_trace
def test_on_the_real_trace_the_primed_requests_are_disjoint_from_the_measured_ones():
    workload = build_workload({"kind": "trace", "path": str(TRACE_PATH), "warmup_requests": 50, "limit": 100,
                               "length_scale": 0.05}, BYTES, seed=0)
    rows = [json.loads(line) for _, line in zip(range(150), TRACE_PATH.open())]
    primed = primer(workload)
    assert len(primed.requests) == 50 and len(workload.requests) == 100
    assert not {r.request_id for r in primed.requests} & {r.request_id for r in workload.requests}
    assert workload.requests[0].arrival_s == 0
    assert workload.requests[-1].arrival_s == (rows[149]["timestamp"] - rows[50]["timestamp"]) / 1000


# --------------------------------------------------------------------------- levels


def test_closed_loop_levels_replay_their_own_part_in_order_with_their_own_number_of_users(tmp_path):
    workload = _trace(tmp_path, warmup_requests=2)
    steps = plan_steps(workload, SweepSettings(levels=(2, 4)))
    assert [(s.kind, s.users, s.max_requests) for s in steps] == [("concurrency", 2, 5), ("concurrency", 4, 5)]
    ids = [[r.request_id for r in s.workload.requests] for s in steps]
    assert ids == [[f"trace-{i}" for i in range(2, 7)], [f"trace-{i}" for i in range(7, 12)]]
    assert all(r.arrival_s is None for s in steps for r in s.workload.requests)   # closed loop: no clock


def test_rate_multipliers_scale_the_trace_arrival_times_of_their_part(tmp_path):
    workload = _trace(tmp_path)
    steps = plan_steps(workload, SweepSettings(levels=(), multipliers=(1, 2, 4), rate_users=8))
    assert [(s.kind, s.value, s.users, s.max_requests) for s in steps] == [
        ("multiplier", 1, 8, 4), ("multiplier", 2, 8, 4), ("multiplier", 4, 8, 4)]
    for step in steps:                          # each part's gaps are the trace's 250 ms, divided by m
        assert [r.arrival_s for r in step.workload.requests] == pytest.approx(
            [0.25 * i / step.value for i in range(4)])


def test_rate_multipliers_need_a_trace(tmp_path):
    rounds = build_workload({"kind": "random", "requests": 4, "input_tokens": {"distribution": "fixed", "mean": 8},
                             "output_tokens": {"distribution": "fixed", "mean": 2}}, BYTES, seed=0)
    with pytest.raises(ValueError, match="rate multipliers replay a trace's arrival times"):
        plan_steps(rounds, SweepSettings(levels=(), multipliers=(1,)))


def test_the_replay_sentence_says_which_replay_ran(tmp_path):
    workload = _trace(tmp_path, warmup_requests=2)
    assert describe_replay(workload, SweepSettings(levels=(2, 4)), primed=True) == (
        "G3 replayed the trace closed loop at concurrency 2, 4 over its requests in order; each level its own 5 "
        "consecutive requests, after 2 warm-up requests that priming sent and no step measured.")
    assert describe_replay(workload, SweepSettings(levels=(), multipliers=(1, 2), rate_users=8), primed=False) == (
        "G3 replayed the trace open loop at 1×, 2× its arrival rate (8 users); each level its own 5 consecutive "
        "requests, with no warm-up.")


@pytest.fixture(scope="module")
def reference():
    port = free_port()
    command = [sys.executable, "-m", "workloads.servers.reference_server", "--port", str(port), "--ttft-ms", "30",
               "--itl-ms", "5", "--tokens", "4"]
    with _process(command, port, "/health"):
        yield Target("reference", f"http://127.0.0.1:{port}/v1", "reference")


def test_a_closed_loop_trace_sweep_sends_each_request_once_at_each_levels_concurrency(reference, tmp_path):
    workload = _trace(tmp_path)                                       # 12 requests: 6 per level
    settings = SweepSettings(levels=(1, 3), duration_s=3, warmup_s=0, min_duration_s=0, min_requests=1,
                             out_dir=tmp_path / "sweep")
    frame = run_sweep([reference], workload, settings)
    assert list(frame["replay"]) == ["concurrency", "concurrency"] and list(frame["level"]) == [1, 3]
    sent = [read_records(tmp_path / "sweep" / "reference" / f"c{c}" / "records") for c in (1, 3)]
    ids = [sorted(r["request_id"] for r in records) for records in sent]
    assert ids == [sorted(f"trace-{i}" for i in range(6)), sorted(f"trace-{i}" for i in range(6, 12))]
    assert _peak_concurrency(sent[0]) == 1 and 1 < _peak_concurrency(sent[1]) <= 3


def test_a_rate_multiplier_step_replays_its_part_open_loop(reference, tmp_path):
    settings = SweepSettings(levels=(), multipliers=(4,), rate_users=4, duration_s=2, warmup_s=0, min_duration_s=0,
                             min_requests=1, out_dir=tmp_path / "sweep")
    frame = run_sweep([reference], _trace(tmp_path), settings)
    row = frame.iloc[0]
    assert row["replay"] == "multiplier" and row["multiplier"] == 4 and row["concurrency"] is None
    assert row["completed"] == 12 and row["users"] == 4


def test_every_request_due_in_an_open_loop_step_counts_never_sent_and_unfinished_ones_too(tmp_path):
    """A target too slow for the trace's rate: due requests that never went out, and those still in flight
    when the step ended, are counted (a 1x replay once recorded 53 of 107), and meet no objective."""
    port = free_port()
    command = [sys.executable, "-m", "workloads.servers.reference_server", "--port", str(port), "--ttft-ms", "9000",
               "--itl-ms", "5", "--tokens", "4"]
    with _process(command, port, "/health"):
        slow = Target("slow", f"http://127.0.0.1:{port}/v1", "reference")
        settings = SweepSettings(levels=(), multipliers=(1,), rate_users=2, duration_s=2, warmup_s=0,
                                 min_duration_s=0, min_requests=1, out_dir=tmp_path / "sweep", stop_rule=None)
        row = run_sweep([slow], _trace(tmp_path), settings).iloc[0]
    # arrivals every 250 ms: 0 .. 2.0 s are due within the 2-s step (9 of 12); 2 users hold one each for 9 s
    assert (row["due"], row["sent"], row["finished"]) == (9, 2, 0)
    assert (row["not_sent"], row["unfinished"]) == (7, 2)
    latencies = due_latencies([], row.to_dict())
    assert len(latencies) == 9 and goodput(list(latencies), slo_s=1.0) == 0.0


def test_the_due_counts_take_the_window_s_unanswered_requests_by_when_they_were_sent_or_due():
    from workloads.loadgen.sweep import summarize_step

    done = [{"sent_at": 10.0 + i, "ok": True, "ttft_s": 0.1, "e2e_s": 0.2, "tpot_s": 0.1, "itl_s": [0.1],
             "completion_tokens": 2, "content_chunks": 2, "prompt_tokens": 10, "cached_tokens": 0,
             "tokens_from_usage": True, "client_wait_s": 0.0} for i in range(5)]
    unanswered = [{"request_id": "a", "scheduled_at": 12.0, "sent_at": None, "state": "not_sent"},
                  {"request_id": "b", "scheduled_at": 3.0, "sent_at": None, "state": "not_sent"},   # warm-up
                  {"request_id": "c", "scheduled_at": 13.0, "sent_at": 14.5, "state": "unfinished"}]
    summary = summarize_step(done, [], 5.0, 20.0, SweepSettings(warmup_s=4.0, min_duration_s=1, min_requests=1),
                             unanswered=unanswered)
    assert (summary["due"], summary["sent"], summary["finished"]) == (7, 6, 5)
    latencies = due_latencies([0.1] * 5, summary)
    assert goodput(list(latencies), slo_s=0.5) == pytest.approx(5 / 7)                   # met ÷ due


# --------------------------------------------------------------------------- sustained rate


def _ladder(*steps):
    """(multiplier, TTFT seconds of its requests, valid) per step."""
    return Ladder(tuple((m, valid, "" if valid else "client saturated", tuple(ttfts)) for m, ttfts, valid in steps))


def test_sustained_rate_gain_is_the_ratio_of_the_highest_multipliers_within_the_slo_with_an_interval():
    fast, slow = [0.1] * 40, [5.0] * 40
    baseline = _ladder((1, fast, True), (2, fast, True), (4, slow, True))
    candidate = _ladder((1, fast, True), (2, fast, True), (4, fast, True))
    figures = sustained_rate_gain(baseline, candidate, slo_s=1.0)
    assert (figures.baseline, figures.candidate, figures.gain) == (2, 4, 1.0)
    assert figures.interval == (1.0, 1.0) and figures.valid                 # every resample agrees
    mixed = [0.1] * 36 + [5.0] * 4                                           # p90 right at the edge: unsure
    unsure = sustained_rate_gain(baseline, _ladder((1, fast, True), (2, fast, True), (4, mixed, True)), 1.0)
    assert unsure.interval[0] < 1.0 <= unsure.interval[1]


def test_failed_requests_never_meet_the_slo():
    fast, failing = [0.1] * 20, [0.1] * 15 + [math.inf] * 5  # a quarter failed: p90 is a failure
    figures = sustained_rate_gain(
        _ladder((1, fast, True), (2, failing, True)), _ladder((1, fast, True), (2, fast, True)), slo_s=1.0
    )
    assert (figures.baseline, figures.candidate, figures.gain, figures.interval) == (1, 2, 1.0, (1.0, 1.0))


def test_sustained_rate_gain_is_inconclusive_on_an_invalid_step_or_a_baseline_that_sustains_nothing():
    fast, slow = [0.1] * 20, [5.0] * 20
    ended = sustained_rate_gain(_ladder((1, fast, True), (2, fast, False)), _ladder((1, fast, True), (2, fast, True)),
                                slo_s=1.0)
    assert not ended.valid and "baseline: the 2x step was invalid (client saturated)" in ended.invalid_reason
    nothing = sustained_rate_gain(_ladder((1, slow, True)), _ladder((1, fast, True)), slo_s=1.0)
    assert nothing.gain is None and "not even the lowest multiplier" in nothing.invalid_reason
    assert "its TTFT p90 at 1x was 5000 ms > 1000 ms (goodput 0% of 20 due requests" in nothing.invalid_reason


def test_a_lowest_step_invalid_for_client_lag_is_said_as_such_never_blamed_on_the_objective():
    fast = [0.1] * 20
    lagged = Ladder(((1, False, "client saturated: event-loop lag 180 ms > 50 ms", tuple(fast)),))
    figures = sustained_rate_gain(lagged, _ladder((1, fast, True)), slo_s=1.0)
    assert not figures.valid and figures.gain is None
    assert (
        figures.invalid_reason == "baseline: the 1x step was invalid (client saturated: event-loop lag 180 ms > 50 ms)"
    )


# --------------------------------------------------------------------------- config


# a 12-request trace fills one request per block at up to 3 levels of 3 + 1 warm-up pairs
SMALL_BLOCKS = {"min_requests": 1, "blocks": {"max": 3}, "steady": {"max_pairs": 1}}


def _gates_yaml(tmp_path, g3: dict):
    path = tmp_path / "gates.yaml"
    path.write_text(yaml.safe_dump({"g3": {**SMALL_BLOCKS, **g3}}))
    return path


def test_a_trace_too_short_for_every_block_to_be_valid_is_refused_at_load_saying_how_many_it_needs(tmp_path, capsys):
    """Each level replays its own part of the trace, each block pair its own slice once: a trace whose slices
    cannot hold min_requests would give invalid blocks only, minutes later."""
    config = _gates_yaml(tmp_path, {"workload": {"kind": "trace", "path": str(write_trace(tmp_path, ROWS))},
                                    "levels": [2, 4], "min_requests": 2})
    assert main(["run", "g3", "--config", str(config), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert ("g3.workload: expected a trace with at least 16 measured requests (2 levels x 4 block pairs (blocks.max 3 "
            "+ 1 warm-up) x min_requests 2: each block replays its own slice once), found 12") in err
    assert not (tmp_path / "run").exists()
    fits = _gates_yaml(tmp_path, {"workload": {"kind": "trace", "path": str(write_trace(tmp_path, ROWS))},
                                  "levels": [2, 4], "min_requests": 1})
    assert load_config(fits).g3.min_requests == 1


def test_a_missing_trace_file_is_exit_2_naming_g3_workload_path(tmp_path, capsys):
    config = _gates_yaml(tmp_path, {"workload": {"kind": "trace"}, "levels": [2]})
    assert main(["run", "g3", "--config", str(config), "--out", str(tmp_path / "run")]) == 2
    assert "g3.workload.path: expected an existing trace file (JSONL), found nothing" in capsys.readouterr().err
    assert main(["run", "g3", "--config", str(config), "--trace", str(tmp_path / "absent.jsonl"),
                 "--out", str(tmp_path / "run")]) == 2
    assert (f"g3.workload.path: expected an existing trace file (JSONL), found '{tmp_path / 'absent.jsonl'}'"
            in capsys.readouterr().err)
    assert not (tmp_path / "run").exists()                            # refused before anything started


def test_a_trace_path_is_relative_to_the_config_file_or_given_with_trace(tmp_path, monkeypatch):
    write_trace(tmp_path, ROWS, "mine.jsonl")
    config = _gates_yaml(tmp_path, {"workload": {"kind": "trace", "path": "mine.jsonl"}, "levels": [2]})
    monkeypatch.chdir("/")
    assert load_config(config).g3.workload.path == tmp_path / "mine.jsonl"
    other = write_trace(tmp_path, ROWS, "other.jsonl")
    assert load_config(config, trace=other).g3.workload.path == other
    with pytest.raises(ConfigError, match="--trace: expected a trace workload"):
        load_config(None, trace=other)


@pytest.mark.parametrize("g3, message", [
    ({"replay": "rate_multipliers", "levels": [1, 2], "ttft_slo_ms": 500},
     "g3.workload.kind: expected a trace workload (kind: trace) for replay: rate_multipliers, found 'multi_round_qa'"),
    ({"replay": "rate_multipliers", "levels": [1, 2], "trace": True}, "g3.ttft_slo_ms: expected the TTFT objective"),
    ({"replay": "rate_multipliers", "levels": [2, 1], "ttft_slo_ms": 500, "trace": True},
     "g3.levels: expected rate multipliers (numbers > 0, ascending)"),
    ({"levels": [2.5]},
     "g3.levels: expected concurrencies (integers in 1..100,000) for replay: closed_loop, found [2.5]"),
    ({"replay": "open_loop", "levels": [2]}, "g3.replay: expected one of 'closed_loop' or 'rate_multipliers'"),
])
def test_levels_must_mean_what_the_replay_says(tmp_path, g3, message):
    if g3.pop("trace", False):
        g3["workload"] = {"kind": "trace", "path": str(write_trace(tmp_path, ROWS))}
    with pytest.raises(ConfigError) as error:
        load_config(_gates_yaml(tmp_path, g3))
    assert message in str(error.value)


def test_rate_multipliers_on_a_trace_load(tmp_path):
    g3 = load_config(_gates_yaml(tmp_path, {"workload": {"kind": "trace", "path": str(write_trace(tmp_path, ROWS))},
                                            "replay": "rate_multipliers", "levels": [0.5, 1, 2],
                                            "ttft_slo_ms": 500})).g3
    assert (g3.replay, g3.levels, g3.ttft_slo_ms) == ("rate_multipliers", [0.5, 1, 2], 500)


def test_the_hit_ratio_bound_is_each_levels_own_part_of_the_trace(tmp_path):
    """The first part's requests share a prefix, the second's share nothing: one figure for both was wrong."""
    from gates.g3_main.test_g3_main import _workload_bound

    shared = [{"timestamp": 250 * i, "input_length": 1024, "output_length": 4, "hash_ids": [1, 100 + i]}
              for i in range(6)]
    unique = [{"timestamp": 250 * i, "input_length": 1024, "output_length": 4, "hash_ids": [200 + i, 300 + i]}
              for i in range(6, 12)]
    trace = write_trace(tmp_path, shared + unique)
    config = load_config(_gates_yaml(tmp_path, {"workload": {"kind": "trace", "path": str(trace)}, "levels": [1, 3],
                                                "prime": False}))
    workload = build_workload(config.g3.workload, BYTES, seed=0)
    bounds = _workload_bound(config, workload)
    assert set(bounds) == {1, 3}
    assert bounds[1] > 0.3 and bounds[3] == 0.0          # the second part reuses nothing of its own or the first's
    closed = load_config(_gates_yaml(tmp_path, {"levels": [1, 3]}))    # a workload, not a trace: one pass per level
    same = _workload_bound(closed, build_workload(closed.g3.workload, BYTES, seed=0))
    assert set(same) == {1, 3} and same[1] == same[3]
