"""G3 verdicts on recorded data: pass, fail below the band, pass above it with a note, inconclusive."""

import numpy as np
import pytest

from kvcore.g3_analysis import level_figures, throughput_windows
from kvcore.rules import Band, Threshold
from kvcore.verdict import judge

REDUCTION = Threshold("ttft_p50_reduction", ">=", 0.25)
GAIN = Band("throughput_gain", 0.29, 0.40)


def _step(ttft_s: float, tokens_per_request: int, requests_per_s: float, seconds: float = 60, valid=True,
          seed: int = 0):
    """Recorded requests: TTFTs around `ttft_s`, completions at a steady rate."""
    rng = np.random.default_rng(seed)
    n = int(requests_per_s * seconds)
    records = [{"sent_at": 1000 + i / requests_per_s, "e2e_s": 0.5, "ttft_s": float(ttft_s * rng.uniform(0.9, 1.1)),
                "completion_tokens": tokens_per_request} for i in range(n)]
    summary = {"valid": valid, "invalid_reasons": "" if valid else "client saturated: CPU p90 99% > 90%"}
    return {"summary": summary, "records": records}


def _verdicts(base, cand):
    figures = level_figures(base, cand)
    return (
        judge("g3", "c8", "G3 TTFT p50 reduction at c=8", figures.ttft_reduction, REDUCTION, unit="%",
              interval=figures.ttft_interval, valid=figures.valid, invalid_reason=figures.invalid_reason),
        judge("g3", "c8", "G3 throughput gain at c=8", figures.throughput_gain, GAIN, unit="%",
              interval=figures.throughput_interval, valid=figures.valid, invalid_reason=figures.invalid_reason),
        figures,
    )


def test_a_candidate_inside_the_band_passes_both_checks():
    reduction, gain, figures = _verdicts(_step(1.0, 100, 4.0), _step(0.5, 100, 4.0 * 1.35, seed=1))
    assert figures.ttft_reduction == pytest.approx(0.5, abs=0.05)
    assert figures.throughput_gain == pytest.approx(0.35, abs=0.03)
    assert (reduction.status, gain.status) == ("PASS", "PASS") and gain.note == ""


def test_a_gain_below_the_band_fails_even_with_a_good_ttft():
    reduction, gain, _ = _verdicts(_step(1.0, 100, 4.0), _step(0.5, 100, 4.0 * 1.10, seed=1))
    assert reduction.status == "PASS" and gain.status == "FAIL"
    assert "below" in gain.reason


def test_a_gain_above_the_band_passes_with_a_note():
    _, gain, figures = _verdicts(_step(1.0, 100, 4.0), _step(0.5, 100, 4.0 * 1.8, seed=1))
    assert figures.throughput_gain == pytest.approx(0.8, abs=0.05)
    assert gain.status == "PASS" and gain.note


def test_a_small_ttft_reduction_fails():
    reduction, _, _ = _verdicts(_step(1.0, 100, 4.0), _step(0.9, 100, 4.0 * 1.35, seed=1))
    assert reduction.status == "FAIL"


def test_an_invalid_step_or_an_interval_across_the_threshold_is_inconclusive():
    reduction, gain, _ = _verdicts(_step(1.0, 100, 4.0), _step(0.5, 100, 4.0 * 1.35, valid=False, seed=1))
    assert reduction.status == gain.status == "INCONCLUSIVE" and "client saturated" in reduction.reason
    # TTFTs spread so widely that the reduction's interval straddles 25%
    rng = np.random.default_rng(3)
    base, cand = _step(1.0, 100, 1.0, seconds=12), _step(0.75, 100, 1.35, seconds=12, seed=1)
    for r in base["records"] + cand["records"]:
        r["ttft_s"] *= float(rng.lognormal(0, 0.8))
    assert _verdicts(base, cand)[0].status == "INCONCLUSIVE"


def test_throughput_windows_count_tokens_by_completion_and_drop_the_partial_last_window():
    records = [{"sent_at": 0.0 + i, "e2e_s": 0.5, "completion_tokens": 10} for i in range(7)]  # done at 0.5 .. 6.5
    assert throughput_windows(records, window_s=2.0) == [10.0, 10.0, 10.0]                # [0,2) [2,4) [4,6)
    assert throughput_windows([]) == []
