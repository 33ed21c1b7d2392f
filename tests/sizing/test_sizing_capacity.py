from kvcore.attainment import MEETS, MISSES
from sizing.capacity import OpenLoop, predicted_capacity, predicted_search, simulated_record
from sizing.g3_figures import TargetReplay
from sizing.queueing import DecodeCost, EngineModel, ServedRequest
from sizing.timing import RecomputeCurve, TierBandwidths, TimingModel
from tests.recorded_runs import KV
from workloads.loadgen.capacity_probe import SLO


def _engine() -> EngineModel:
    timing = TimingModel(RecomputeCurve(0.01, 1e-4, 0.0), TierBandwidths(), KV, block_size=256)
    return EngineModel(timing, DecodeCost(0.004, 0.001), 8)


def _replay(cached: int) -> TargetReplay:
    return TargetReplay([ServedRequest(1024, 8, {"device": cached} if cached else {}) for _ in range(64)])


def test_the_predicted_capacity_is_where_the_simulation_meets_the_slo_and_one_more_user_misses():
    slo = SLO(0.5)
    search = predicted_search(_replay(0), _engine(), slo, 1, 64)
    capacity = search.capacity
    assert capacity is not None and capacity >= 1
    decided = {p.load: p.decision for p in search.probes}
    assert decided[capacity] == MEETS and decided[capacity + 1] == MISSES
    # a target whose prompts are cached serves more users within the same SLO; a looser SLO, more users
    assert predicted_capacity(_replay(768), _engine(), slo, 1, 64) > capacity
    assert predicted_capacity(_replay(0), _engine(), SLO(1.0), 1, 64) > capacity


def test_a_search_that_meets_up_to_the_most_is_open_and_predicts_nothing():
    assert predicted_capacity(_replay(0), _engine(), SLO(60.0), 1, 4) is None


def test_a_simulated_request_reads_as_a_record_with_its_tpot_after_the_first_token():
    class Request:
        sent_s, first_token_s, done_s, output_tokens, ttft_s, client_wait_s = 0.0, 0.2, 0.9, 8, 0.2, 0.0
    record = simulated_record(Request())
    assert record["ok"] and record["ttft_s"] == 0.2 and abs(record["tpot_s"] - 0.1) < 1e-12


def test_open_loop_the_predicted_capacity_is_the_highest_rate_step_the_simulation_serves_within_the_slo():
    arrivals = [i * 0.5 for i in range(64)]                  # the trace at 1x: two requests a second
    open_loop = OpenLoop(arrivals, users=32, unit=0.25)
    search = predicted_search(_replay(0), _engine(), SLO(0.5), 0.25, 64, open_loop=open_loop)
    capacity = search.capacity
    assert capacity is not None and capacity >= 0.25
    decided = {p.load: p.decision for p in search.probes}
    assert decided[capacity] == MEETS and decided[capacity + 0.25] == MISSES
    # cached prompts serve a higher rate within the same SLO
    assert predicted_capacity(_replay(768), _engine(), SLO(0.5), 0.25, 64, open_loop=open_loop) > capacity
