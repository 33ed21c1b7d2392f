"""The no-reuse controls' one rule (G2's and G3's): a control measures what offload costs only when
neither side reused anything.

A control's prompts share no prefix, so every request's cached tokens should be 0. A chat template
may open every prompt with the same few tokens, which an engine with small blocks (vLLM's 16) can
reuse; anything up to one embedded block (256 tokens) is allowed for that. More than that means the
prompts did share a prefix (or a cycling workload came back to one), and a cost near zero could
then come from hits: the control is void, and its verdicts INCONCLUSIVE with the reason.
"""

from __future__ import annotations

from typing import Iterable

TEMPLATE_TOKENS = 256      # cached tokens a request may have without counting as reuse


def reuse_found(requests: Iterable[tuple[str, int, int]]) -> str:
    """Why a control does not hold ("" when it does). `requests`: (target, cached tokens, prompt tokens)."""
    rows = list(requests)
    reused = [row for row in rows if row[1] > TEMPLATE_TOKENS]
    if not reused:
        return ""
    target, cached, prompt = max(reused, key=lambda row: row[1])
    return (f"{len(reused)} of {len(rows)} control requests were served partly from a cache (the {target} "
            f"cached {cached} of {prompt} tokens): its prompts shared a prefix, or came back")


def unjudged_reason(gate: str, metric: str) -> str:
    """Why a control's figure is shown but not judged when no threshold names it (the quick profile)."""
    return (f"no threshold for it in {gate}.thresholds: the quick profile shows the no-reuse control without judging "
            f"it (its few pairs and short steps swing more than 5% on a small machine); the full profile judges it, "
            f"as does {{metric: {metric}, op: '<=', value: 0.05}} in {gate}.thresholds")
