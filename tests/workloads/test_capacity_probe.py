"""The capacity search against reference servers of known capacity, over real HTTP with locust."""

import sys

import pytest

from gates.benches.client_bench import _process
from kvcore.attainment import MEETS, MISSES, UNDECIDED
from workloads.loadgen.capacity_probe import SLO, ProbeSettings, decide, run_probe, search_capacity
from workloads.loadgen.steady import order_segment
from workloads.loadgen.sweep import rate_multiplied, trace_segment
from workloads.servers.server_behaviour import Behaviour
from workloads.traffic.processes import free_port
from workloads.traffic.requests import Workload, WorkloadRequest
from workloads.traffic.target import Target

TTFT_MS, ITL_MS, TOKENS = 40.0, 10.0, 8
# 15 ms over the TTFT, below the limit at which one user more than 4 slots (110 ms a service) could meet it in some
# phase of the users (58.3 ms: Behaviour.capacity_at)
SLO_TTFT_S = 0.055
SETTINGS = ProbeSettings(max_requests=240, budget_s=20)


def _workload(sessions: int = 8, rounds: int = 2) -> Workload:
    return Workload("capacity", tuple(tuple(
        WorkloadRequest(f"s{s}-t{t}", f"s{s}", t, ({"role": "user", "content": f"hello {s} {t}"},), TOKENS, 3)
        for t in range(rounds)) for s in range(sessions)))


@pytest.fixture(scope="module")
def slotted():
    """Two reference servers of fixed timing: 2 service slots (the baseline) and 4 (the candidate)."""
    ports = [free_port(), free_port()]
    command = [
        sys.executable,
        "-m",
        "workloads.servers.reference_server",
        "--ttft-ms",
        str(TTFT_MS),
        "--itl-ms",
        str(ITL_MS),
        "--tokens",
        str(TOKENS),
    ]
    with _process(command + ["--port", str(ports[0]), "--slots", "2"], ports[0], "/health"), \
            _process(command + ["--port", str(ports[1]), "--slots", "4"], ports[1], "/health"):
        yield [Target(role, f"http://127.0.0.1:{port}/v1", "reference")
               for role, port in zip(("baseline", "candidate"), ports)]


@pytest.mark.slow
def test_the_search_finds_each_servers_known_capacity_probing_in_turn(slotted, tmp_path):
    truth = {name: Behaviour(ttft_ms=TTFT_MS, itl_ms=ITL_MS, tokens=TOKENS, slots=slots).capacity_at(
        SLO_TTFT_S * 1e3, TOKENS) for name, slots in (("baseline", 2), ("candidate", 4))}
    assert truth == {"baseline": 2, "candidate": 4}
    said = []
    found = search_capacity(slotted, _workload(), SLO(SLO_TTFT_S), SETTINGS, 1, 16, tmp_path, say=said.append)
    assert {name: s.capacity for name, s in found.searches.items()} == truth
    assert [p.probe.load for p in found.probes if p.target == "baseline"] == [1, 2, 4, 3]
    assert [p.probe.load for p in found.probes if p.target == "candidate"] == [1, 2, 4, 8, 6, 5]
    # in turn, the order alternating round by round while both search
    assert [p.target for p in found.probes][:6] == ["baseline", "candidate", "candidate", "baseline", "baseline",
                                                    "candidate"]
    for result in found.probes:   # every probe decided and stopped there, before its requests or budget ran out
        assert result.probe.decision in (MEETS, MISSES) and result.ended_early, result.to_dict()
        # judged on the requests that decided it: those in flight at the stop are sent, not counted
        assert result.probe.requests <= result.sent < SETTINGS.max_requests
    met = [p for p in found.probes if p.probe.decision == MEETS]
    assert all(p.ttft_p90_ms <= SLO_TTFT_S * 1e3 and p.goodput >= 0.9 for p in met)
    assert any("capacity: candidate at 5 users: misses" in line for line in said), said


def _trace(requests: int, gap_s: float) -> Workload:
    """A trace of one-request sessions arriving every `gap_s`."""
    return Workload("trace", tuple((WorkloadRequest(f"r{i}", f"r{i}", 0, ({"role": "user", "content": f"hi {i}"},),
                                                    TOKENS, 3, arrival_s=i * gap_s),) for i in range(requests)),
                    trace=True)


@pytest.mark.slow
def test_open_loop_the_search_finds_each_servers_known_rate_capacity_in_steps_of_the_traces_rate(slotted, tmp_path):
    base_rate, step = 10.0, 0.125                 # the trace's arrivals: 10 a second, evenly; loads in 0.125x steps
    truth = {name: Behaviour(ttft_ms=TTFT_MS, itl_ms=ITL_MS, tokens=TOKENS, slots=slots).rate_capacity_per_s(TOKENS)
             / base_rate for name, slots in (("baseline", 2), ("candidate", 4))}
    assert truth == pytest.approx({"baseline": 2 / 0.11 / 10, "candidate": 4 / 0.11 / 10})   # 1.82x and 3.64x
    settings = ProbeSettings(max_requests=240, budget_s=20, open_loop_users=16)
    said = []
    found = search_capacity(slotted, _trace(100, 1 / base_rate), SLO(SLO_TTFT_S), settings, 1, 8, tmp_path,
                            say=said.append, unit=step)
    for name, search in found.searches.items():
        # the highest step below the rate the slots serve, or one step lower (a probe just below saturation can
        # queue on the machine's jitter)
        assert search.closed and truth[name] - 2 * step < search.capacity < truth[name], (name, search.describe())
    assert [p.probe.load for p in found.probes if p.target == "baseline"][:2] == [1, 2]
    assert any("capacity: baseline at 2x the trace's rate: misses" in line for line in said), said
    for result in found.probes:
        assert result.probe.decision in (MEETS, MISSES), result.to_dict()
    # a probe longer than the trace went round it, arrivals going on at the probe's rate
    assert max(p.sent for p in found.probes) > 100


def test_a_trace_segment_wraps_with_each_pass_under_its_own_ids_and_arrivals_going_on():
    segment = trace_segment(_trace(3, 0.5), 2, 4)
    assert [s[0].request_id for s in segment.sessions] == ["r2", "r0~1", "r1~1", "r2~1"]
    assert [s[0].arrival_s for s in segment.sessions] == [1.0, 1.5, 2.0, 2.5]
    assert [s[0].arrival_s for s in rate_multiplied(segment, 2.0).sessions] == [0.0, 0.25, 0.5, 0.75]


def test_a_probe_whose_budget_ends_first_is_undecided(slotted, tmp_path):
    # one user, every request meeting the limit, for 1 s: fewer than the 34 requests that decide a 10% allowance
    result = run_probe(_workload(), slotted[1], 1, 0, SLO(0.090), ProbeSettings(max_requests=400, budget_s=1),
                       tmp_path / "probe")
    assert result.probe.decision == UNDECIDED and not result.ended_early, result.to_dict()
    assert 0 < result.probe.requests < 34 and result.probe.misses == result.late
    assert result.probe.interval[0] <= 0.10 <= result.probe.interval[1]


def test_errors_decided_above_their_share_miss_whatever_the_latencies():
    slo = SLO(0.1, max_error_share=0.001)
    assert decide(200, 3, 0, slo, 0.95)[0] == MEETS
    assert decide(200, 20, 20, slo, 0.95)[0] == MISSES       # 10% failed: far above 0.1%
    assert decide(40, 0, 0, SLO(0.1), 0.95)[0] == MEETS


def test_a_record_misses_on_either_limit_or_a_failure():
    slo = SLO(0.1, 0.02)
    assert not slo.misses({"ok": True, "ttft_s": 0.09, "tpot_s": 0.019})
    assert slo.misses({"ok": True, "ttft_s": 0.11, "tpot_s": 0.01})
    assert slo.misses({"ok": True, "ttft_s": 0.05, "tpot_s": 0.03})
    assert slo.misses({"ok": False, "ttft_s": None, "tpot_s": None})
    assert not slo.misses({"ok": True, "ttft_s": 0.05, "tpot_s": None})     # one token: no TPOT
    # open loop, the time a request waited in the client for a user counts: its TTFT is from its arrival
    assert slo.misses({"ok": True, "ttft_s": 0.05, "tpot_s": 0.01, "client_wait_s": 0.06})
    assert SLO(0.1).describe() == "TTFT p90 ≤ 100 ms, errors ≤ 0.1%"
    assert slo.longest_s(11) == pytest.approx(0.3)


def test_a_probe_segment_goes_round_the_load_order_with_each_pass_under_its_own_ids():
    workload = _workload(sessions=2, rounds=2)              # load order: s0-t0, s0-t1, s1-t0, s1-t1
    segment = order_segment(workload, 3, 6, passes=True)
    assert [s[0].request_id for s in segment.sessions] == ["s1-t1", "s0-t0~1", "s0-t1~1", "s1-t0~1", "s1-t1~1",
                                                          "s0-t0~2"]
    assert len(order_segment(workload, 3, 6).sessions) == 4  # a matched pair's: one pass at most, ids unchanged
    assert [s[0].request_id for s in order_segment(workload, 3, 6).sessions] == ["s1-t1", "s0-t0", "s0-t1", "s1-t0"]
