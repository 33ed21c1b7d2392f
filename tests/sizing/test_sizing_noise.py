"""The measurement's own noise beside the model's error (sizing/noise.py): each compared figure's samples are the
rounds or blocks the gate made it of, at its own place, and their mean relative deviation from it."""

from __future__ import annotations

import pytest

from sizing.noise import group_spread, samples, spread


def _round(mode: str, context: int, value: float) -> dict:
    return {"gate": "g2", "metric": "ttft_round_ms", "value": value,
            "context": {"mode": mode, "context_tokens": context, "round": 0}}


def test_a_g2_ttfts_samples_are_its_own_rounds_at_its_own_mode_and_length():
    rows = [_round("host-hit", 1024, 60.0), _round("host-hit", 1024, 100.0), _round("disk-cold", 1024, 500.0),
            _round("host-hit", 4096, 900.0), {"gate": "g2", "metric": "ttft_ms", "value": 80.0,
                                             "context": {"mode": "host-hit", "context_tokens": 1024}}]
    prediction = {"gate": "g2", "metric": "ttft_ms", "context": {"mode": "host-hit", "context_tokens": 1024}}
    assert samples(rows, prediction) == [60.0, 100.0]
    assert spread([60.0, 100.0], 80.0) == pytest.approx(0.25)
    # a figure the module has no samples for, one sample, or no figure: no spread
    assert samples(rows, {**prediction, "metric": "disk_hit_ttft_vs_recompute"}) == []
    assert spread([60.0], 80.0) is None and spread([60.0, 100.0], 0.0) is None


def test_a_g3_figures_samples_are_its_steps_valid_blocks():
    def block(target: str, level: int, tokens_per_s: float, valid: bool = True) -> dict:
        return {"gate": "g3", "metric": "g3_block", "value": 1,
                "context": {"target": target, "concurrency": level, "output_tokens_per_s": tokens_per_s,
                            "ttft_p50_ms": 50.0, "valid": valid}}

    rows = [block("candidate", 2, 90.0), block("candidate", 2, 110.0), block("candidate", 2, 5.0, valid=False),
            block("baseline", 2, 30.0), block("candidate", 4, 200.0)]
    prediction = {"gate": "g3", "metric": "output_tokens_per_s", "context": {"target": "candidate", "concurrency": 2}}
    assert samples(rows, prediction) == [90.0, 110.0]
    assert group_spread([{"spread": 0.1}, {"spread": None}, {"spread": 0.3}]) == pytest.approx(0.2)
    assert group_spread([{"spread": None}]) is None
