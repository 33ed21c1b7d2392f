"""The no-reuse control's rule that nothing was reused: a side serving part of a prompt from its cache
voids the control (its verdicts INCONCLUSIVE, saying how much was cached)."""

from __future__ import annotations

from gates.g2_baseline.test_g2_no_reuse import ControlRound, _sides
from gates.no_reuse import reuse_found


def _round(role: str, pair: int, cached: int = 0) -> ControlRound:
    return ControlRound(role, pair, ttft_s=0.2, e2e_s=0.5, output_tokens=8, prompt_tokens=2048, cached_tokens=cached)


def test_prompts_with_no_cached_block_hold_the_control_and_a_reused_one_voids_it():
    clean = [_round(role, pair) for pair in range(5) for role in ("candidate", "baseline")]
    def reused(rounds):
        return reuse_found((r.role, r.cached_tokens, r.prompt_tokens) for r in rounds)

    assert reused(clean) == ""
    # a chat template's few shared tokens (under one block) do not count as reuse
    assert reused(clean + [_round("candidate", 5, cached=200)]) == ""
    reason = reused(clean + [_round("baseline", 5, cached=1536)])
    assert "1 of 11" in reason and "the baseline cached 1536 of 2048 tokens" in reason


def test_the_sides_are_paired_by_pair_number_whatever_order_they_ran_in():
    rounds = [_round("baseline", 1), _round("candidate", 1), _round("candidate", 0), _round("baseline", 0)]
    candidate, baseline = _sides(rounds)
    assert [r.pair for r in candidate] == [r.pair for r in baseline] == [0, 1]
    assert candidate[0].output_rate == 16.0          # 8 tokens over 0.5 s
