from dataclasses import replace

import pytest

from kvcore.settings import ConfigError
from sizing.queueing import DecodeCost, EngineModel, ServedRequest, simulate
from sizing.serving import PACE_RANGE, serving_pace, with_serving_pace
from sizing.timing import RecomputeCurve, TierBandwidths, TimingModel
from tests.recorded_runs import KV


def _engine(overhead_s: float = 0.01, **settings) -> EngineModel:
    timing = TimingModel(RecomputeCurve(0.01, 1e-4, 1e-8), TierBandwidths(), KV, block_size=256,
                         fixed_overhead_s=overhead_s)
    return EngineModel(timing, DecodeCost(0.004, 0.001), 8, **settings)


def _probe(pace: float, users: int = 2) -> dict:
    """A serving probe's figures as a server whose steps take `pace` times the model's would give them: 4 prompts
    of 1,900 tokens asked for 3 times over (each a hit of its whole blocks), 16 tokens each."""
    requests = [ServedRequest(1900, 16, {"device": 1792}) for _ in range(12)]
    done = simulate(requests, users, _engine(pace=pace))
    span = max(r.done_s for r in done) - min(r.sent_s for r in done)
    return {"role": "candidate", "context_tokens": 1900, "users": users, "span_s": span, "seconds": 1.0,
            "requests": [{"prompt_tokens": 1900, "cached_tokens": 1792, "output_tokens": 16, "sent_at": r.sent_s,
                          "ttft_s": r.ttft_s, "e2e_s": r.done_s - r.sent_s} for r in done]}


def test_a_pace_scales_every_step_of_the_target_that_has_it_and_no_other():
    requests = [ServedRequest(1900, 16, {"device": 1792 if i % 2 else 0}) for i in range(16)]

    def span(engine: EngineModel) -> float:
        done = simulate(requests, 4, engine)
        return max(r.done_s for r in done) - min(r.sent_s for r in done)

    engine = _engine(0.0, paces=(("candidate", 1.5),))     # no fixed cost before the engine takes a request
    assert engine.for_role("candidate").pace == 1.5 and engine.for_role("baseline").pace == 1.0
    assert span(engine.for_role("candidate")) == pytest.approx(1.5 * span(_engine(0.0)))
    assert span(engine.for_role("baseline")) == pytest.approx(span(_engine(0.0)))
    # a request's fixed cost before the engine takes it (the HTTP side) is not a step: it keeps its length
    assert span(_engine(0.01, pace=1.5)) < 1.5 * span(_engine(0.01))
    for wrong in ({"pace": 0.0}, {"pace": -1.0}, {"paces": (("candidate", 0.0),)}):
        with pytest.raises(ConfigError, match="pace"):
            _engine(**wrong)


@pytest.mark.parametrize("true_pace", [1.0, 1.3, 2.0])
def test_the_pace_is_the_probes_span_over_the_same_loop_simulated(true_pace):
    pace, note = serving_pace(_probe(true_pace), _engine())
    assert pace == pytest.approx(true_pace, rel=1e-4)
    assert note.startswith(f"the candidate's G3 steps at {pace:.2f}x the model's costs: the serving probe before G3")
    # the pace is measured against the model's own costs, whatever pace or noise the engine was given
    assert serving_pace(_probe(true_pace), _engine(jitter=0.3, paces=(("candidate", 9.0),)))[0] == pytest.approx(pace)
    engine, _ = with_serving_pace(_engine(), _probe(true_pace))
    assert engine.for_role("candidate").pace == pytest.approx(pace) and engine.for_role("baseline").pace == 1.0


def test_no_probe_a_failed_one_or_a_pace_out_of_range_leaves_the_model_as_it_is():
    engine = _engine()
    for serving, why in ((None, "it runs just before G3"), ({"role": "candidate", "error": "boom"}, "boom")):
        pace, note = serving_pace(serving, engine)
        assert pace is None and note.endswith(f"no serving probe ({why})")
        assert with_serving_pace(engine, serving)[0] is engine
    low, high = PACE_RANGE
    for far in (low / 2, high * 2):
        stalled = _probe(1.0)
        stalled = replace_span(stalled, stalled["span_s"] * far)
        pace, note = serving_pace(stalled, engine)
        assert pace is None and f"outside {low:g}-{high:g}" in note
        assert with_serving_pace(engine, stalled)[0] is engine


def replace_span(probe: dict, span_s: float) -> dict:
    return {**probe, "span_s": span_s}


def test_an_engine_with_a_pace_is_still_an_engine_model():
    engine = _engine()
    assert replace(engine, pace=2.0).for_role("anyone").pace == 1.0      # for_role sets the role's own, else 1
