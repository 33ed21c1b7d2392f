"""The serving pace: how much longer a target's whole request cycle takes than the model's terms add up to, from
the serving probe run just before G3 (gates/machine_probe.py's `serving_probe`: the tiered candidate serving a few
prompts of G3's shape to a closed loop of users).

The model times a request's parts each alone: its load (the hit probe), its tail chunk (the prefill probe's curve),
its decode steps (the decode probe's quiet window). Between them a tiered server also promotes the loaded prefix
and stores the new blocks after the first token, streams each token while the others decode, and finishes each
request; timed in the server's own engine loop (2026-12-06, two users on hits at G3's shape) that was 20-30% of
the cycle, and the candidate's G3 throughput was over-predicted by as much in most runs while the baseline's
(recompute-bound, long chunks) was not. So the probe's loop is simulated with the same costs G3's prediction
uses, and the pace at which the simulated loop's span is the measured one is the pace at which the candidate's
G3 steps are taken (queueing.EngineModel.pace: every step's seconds × it; a request's fixed cost before the engine
takes it is not a step); the baseline keeps its costs as they are.

How it works: docs/methods/sizing-model.md (sizing/serving.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Optional

from .queueing import EngineModel, ServedRequest, simulate

ROLE = "candidate"          # the target whose pace the probe measures (gates/machine_probe.py's SERVING_ROLE)
HIT_TIER = "device"         # the probe's prompts are few and fresh: the candidate serves them from its top tier
PACE_RANGE = (0.5, 3.0)     # a pace outside it is a probe gone wrong (a stall, a lost request), not the engine's
PACE_STEPS = 20             # bisections of PACE_RANGE: the pace to 3e-6
SOURCE = "the serving probe before G3"


def serving_pace(serving: Optional[Mapping], engine: EngineModel) -> tuple[Optional[float], str]:
    """The pace at which the probe's loop, simulated with `engine`'s costs, spans what it measured (None when
    there is no probe or the pace would be out of `PACE_RANGE`), and a note saying which, with the figures."""
    if not serving or "requests" not in serving:
        why = (serving or {}).get("error", "it runs just before G3")
        return None, f"the candidate's steps at the model's costs alone: no serving probe ({why})"
    rows = serving["requests"]
    requests = [ServedRequest(r["prompt_tokens"], r["output_tokens"],
                              {HIT_TIER: r["cached_tokens"]} if r["cached_tokens"] else {}) for r in rows]
    quiet = replace(engine, jitter=0.0, paces=())

    def span(pace: float) -> float:
        done = simulate(requests, serving["users"], replace(quiet, pace=pace))
        return max(r.done_s for r in done) - min(r.sent_s for r in done)

    measured, low, high = serving["span_s"], *PACE_RANGE
    figures = (f"{len(rows)} requests at {serving['context_tokens']:,} tokens, {serving['users']} users: "
               f"{measured:.2f} s measured, {span(1.0):.2f} s simulated at the model's costs")
    if not span(low) <= measured <= span(high):
        return None, (f"the candidate's steps at the model's costs alone: {SOURCE} ({figures}) needs a pace "
                      f"outside {low:g}-{high:g}")
    for _ in range(PACE_STEPS):     # the span grows with the pace: halve the bracket around the measured one
        middle = (low + high) / 2
        low, high = (middle, high) if span(middle) < measured else (low, middle)
    pace = (low + high) / 2
    return pace, (f"the candidate's G3 steps at {pace:.2f}x the model's costs: {SOURCE} ({figures}); the work "
                  "between the model's terms (promotes, stores, streams, finishes)")


def with_serving_pace(engine: EngineModel, serving: Optional[Mapping]) -> tuple[EngineModel, str]:
    """`engine` with the candidate's pace from the serving probe (`serving_pace`), and its note."""
    pace, note = serving_pace(serving, engine)
    if pace is None:
        return engine, note
    return replace(engine, paces=((ROLE, pace),)), note
