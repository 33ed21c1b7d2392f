"""G2's no-reuse control: what offload costs when nothing is reused.

How it works: docs/methods/side-by-side.md (gates/g2_baseline/test_g2_no_reuse.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gates.no_reuse import reuse_found, unjudged_reason
from kvcore.stats import ratio_ci
from workloads.traffic.datasets import sizer_for
from workloads.traffic.requests import WorkloadRequest

ROLES = ("candidate", "baseline")


@dataclass(frozen=True)
class ControlRound:
    """One unique prompt sent to one side."""

    role: str
    pair: int
    ttft_s: float
    e2e_s: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int

    @property
    def output_rate(self) -> float:
        """Output tokens per second of the whole request (what one user gets)."""
        return self.output_tokens / self.e2e_s


def _prompt(tokens: int, max_tokens: int, tag: str, endpoint) -> WorkloadRequest:
    sizer = sizer_for(endpoint.tokenizer)
    text = sizer.text(tokens - 8, f"g2/no-reuse/{tag}")     # its own seed: no prefix shared with any other
    return WorkloadRequest(tag, tag, 0, ({"role": "user", "content": text},), max_tokens, tokens)


@pytest.fixture(scope="module")
def control_rounds(gate_context, endpoints) -> list[ControlRound]:
    config = gate_context.config.g2.no_reuse
    if not config.enabled:
        pytest.skip("g2.no_reuse.enabled is false")
    if gate_context.config.aa:      # as G3's control: offload against none has no A/A form
        pytest.skip("A/A run: the control weighs the tiered candidate against the baseline, which an A/A run does "
                    "not use")
    missing = [role for role in ROLES if role not in endpoints]
    if missing:
        pytest.skip(f"the no-reuse control needs a candidate and a baseline endpoint; none for {missing}")
    run_id = gate_context.store.run_info().get("run_id", "run")
    clients = {role: endpoints[role].target().client() for role in ROLES}
    rounds = []
    try:
        for pair in range(config.pairs):
            gate_context.store.set_progress(gate_context.gate, f"no-reuse control: pair {pair + 1} / {config.pairs}")
            for role in (ROLES if pair % 2 == 0 else ROLES[::-1]):
                request = _prompt(config.context_tokens, config.max_tokens, f"{run_id}/{pair}/{role}",
                                  endpoints["candidate"])
                record = clients[role].send(request)
                if not record.ok:
                    pytest.fail(f"G2 no-reuse control: the {role}'s request failed: {record.error_type}: "
                                f"{record.error_message}", pytrace=False)
                if record.ttft_s is None or record.e2e_s is None:
                    pytest.fail(f"G2 no-reuse control: the {role}'s stream ended without a token (no TTFT)",
                                pytrace=False)
                rounds.append(ControlRound(role, pair, record.ttft_s, record.e2e_s, record.completion_tokens or 1,
                                           record.prompt_tokens or 0, record.cached_tokens or 0))
    finally:
        for client in clients.values():
            client.close()
    return rounds


def _sides(rounds: list[ControlRound]) -> tuple[list[ControlRound], list[ControlRound]]:
    by_role = {role: sorted((r for r in rounds if r.role == role), key=lambda r: r.pair) for role in ROLES}
    return by_role["candidate"], by_role["baseline"]


def test_offload_costs_little_in_ttft_when_nothing_is_reused(gate_context, control_rounds, record, verdict):
    candidate, baseline = _sides(control_rounds)
    for r in control_rounds:
        record("no_reuse_round", r.ttft_s * 1e3, "ms", target=r.role, pair=r.pair, e2e_ms=r.e2e_s * 1e3,
               output_tokens=r.output_tokens, cached_tokens=r.cached_tokens, prompt_tokens=r.prompt_tokens)
    ratio, (lo, hi) = ratio_ci([r.ttft_s for r in candidate], [r.ttft_s for r in baseline], paired=True)
    reused = reuse_found((r.role, r.cached_tokens, r.prompt_tokens) for r in control_rounds)
    config = gate_context.config.g2.no_reuse
    record("no_reuse_ttft_cost", ratio - 1.0, "%", interval=[lo - 1.0, hi - 1.0], pairs=len(candidate),
           context_tokens=config.context_tokens)
    verdict(f"G2 no-reuse control: tiered TTFT p50 / baseline's − 1 at {config.context_tokens} tokens "
            f"({len(candidate)} pairs of unique prompts)", "no_reuse_ttft_cost", ratio - 1.0, unit="%",
            interval=(lo - 1.0, hi - 1.0), valid=not reused, invalid_reason=reused,
            unjudged_reason=unjudged_reason("g2", "no_reuse_ttft_cost"),
            context={"context_tokens": config.context_tokens})


def test_offload_costs_little_in_throughput_when_nothing_is_reused(gate_context, control_rounds, record, verdict):
    candidate, baseline = _sides(control_rounds)
    ratio, (lo, hi) = ratio_ci([r.output_rate for r in candidate], [r.output_rate for r in baseline], paired=True)
    reused = reuse_found((r.role, r.cached_tokens, r.prompt_tokens) for r in control_rounds)
    config = gate_context.config.g2.no_reuse
    record("no_reuse_throughput_cost", 1.0 - ratio, "%", interval=[1.0 - hi, 1.0 - lo], pairs=len(candidate),
           context_tokens=config.context_tokens, max_tokens=config.max_tokens)
    verdict(f"G2 no-reuse control: 1 − tiered output rate / baseline's ({config.max_tokens} output tokens per "
            "request)", "no_reuse_throughput_cost", 1.0 - ratio, unit="%", interval=(1.0 - hi, 1.0 - lo),
            valid=not reused, invalid_reason=reused,
            unjudged_reason=unjudged_reason("g2", "no_reuse_throughput_cost"),
            context={"context_tokens": config.context_tokens})
