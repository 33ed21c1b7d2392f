"""G3's figures from the raw records of the baseline and candidate steps.

Closed loop (every workload): per concurrency level, the TTFT p50 reduction and the throughput
gain (`level_figures`). Rate multipliers (a trace, open loop): per multiplier the TTFT p50
reduction, and over the whole ladder the gain in the highest rate each target sustains within a
TTFT objective (`sustained_rate_gain`), as MLPerf's server scenario and GuideLLM's sweep judge
an open-loop server: below saturation every target serves the offered rate, so a throughput
gain there is 0 by construction and says nothing.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from kvcore.percent import format_percent
from kvcore.stats import gain_ci, percentile_interval, reduction_ci

THROUGHPUT_WINDOW_S = 2.0


def run_seed(run_id: str) -> int:
    """A workload seed of this run, so no earlier run's cache contents help either side."""
    return int.from_bytes(hashlib.blake2b(run_id.encode(), digest_size=4).digest(), "little")


def throughput_windows(records: list[dict], window_s: float = THROUGHPUT_WINDOW_S) -> list[float]:
    """Output tokens per second in consecutive windows of the measured period (by completion time).

    The last, partial window is dropped; a period shorter than one window gives one figure.
    """
    if not records:
        return []
    done = np.array([r["sent_at"] + r["e2e_s"] for r in records])
    tokens = np.array([r["completion_tokens"] or 0 for r in records], dtype=float)
    start = min(r["sent_at"] for r in records)
    edges = np.arange(start, done.max() + window_s, window_s)
    if len(edges) < 2:
        edges = np.array([start, start + window_s])
    sums, _ = np.histogram(done, bins=edges, weights=tokens)
    full = sums[:-1] if len(sums) > 1 else sums
    return list(full / window_s)


@dataclass(frozen=True)
class LevelFigures:
    ttft_reduction: Optional[float]
    ttft_interval: Optional[tuple[float, float]]
    throughput_gain: Optional[float]
    throughput_interval: Optional[tuple[float, float]]
    valid: bool
    invalid_reason: str


def level_figures(baseline: dict, candidate: dict) -> LevelFigures:
    """TTFT p50 reduction (requests) and throughput gain (windows) of two one-shot steps, with bootstrap intervals
    (the no-reuse control's and the sizing model's simulated steps; G3's sweep judges block pairs instead,
    gates/g3_main/blocks.py: resampling requests within one step each leaves the drift between them out).

    `baseline` and `candidate` are steps: {"summary": sweep row, "records": measured ok records}.
    An invalid step's reasons (its errors by type among them) reach the verdict, each named by its target.
    """
    reasons = [f"{s['summary'].get('target', role)}: {s['summary']['invalid_reasons']}"
               for role, s in (("baseline", baseline), ("candidate", candidate)) if s["summary"]["invalid_reasons"]]
    valid = bool(baseline["summary"]["valid"] and candidate["summary"]["valid"])
    b_ttft = [r["ttft_s"] for r in baseline["records"] if r["ttft_s"] is not None]
    c_ttft = [r["ttft_s"] for r in candidate["records"] if r["ttft_s"] is not None]
    b_windows, c_windows = throughput_windows(baseline["records"]), throughput_windows(candidate["records"])
    if not (b_ttft and c_ttft and b_windows and c_windows):
        return LevelFigures(None, None, None, None, False, "; ".join(reasons) or "no completed requests in a step")
    reduction, r_interval = reduction_ci(b_ttft, c_ttft)
    if not any(b_windows):      # the baseline finished nothing inside a whole window: no gain over it to take
        reasons.append("baseline: no output tokens in any whole throughput window (its requests outlast the step)")
        return LevelFigures(reduction, r_interval, None, None, False, "; ".join(reasons))
    gain, g_interval = gain_ci(b_windows, c_windows, statistic=np.mean)
    return LevelFigures(reduction, r_interval, gain, g_interval, valid, "; ".join(reasons))


# --------------------------------------------------------------------------- rate multipliers

SLO_PERCENTILE = 90           # a step sustains its rate when this percentile of its TTFTs meets the objective
_UNKNOWN_TOLERANCE = 0.025    # resamples whose gain is undefined, beyond which the interval is not trusted


def slo_latencies(records: list[dict]) -> list[float]:
    """Per measured request: seconds from its scheduled arrival to its first token; a failure never meets an SLO.

    Open loop, a request that waited in the client was late for the target as much as one queued in
    it, so the wait counts (no coordinated omission).
    """
    return [r["client_wait_s"] + r["ttft_s"] if r["ok"] and r["ttft_s"] is not None else math.inf for r in records]


def due_latencies(slo_latencies_of_records: list[float], summary: dict) -> tuple[float, ...]:
    """A step's SLO latencies over every request due in its window: a due request that was never sent, or
    still unfinished at the step's end, has no first token and never meets the objective (infinity)."""
    missing = max(0, int(summary.get("due") or 0) - int(summary.get("finished") or 0))
    return tuple(slo_latencies_of_records) + (math.inf,) * missing


def goodput(latencies: list[float], slo_s: float) -> Optional[float]:
    """The share of due requests that met the objective (met ÷ due); None with none due."""
    return sum(latency <= slo_s for latency in latencies) / len(latencies) if latencies else None


def _slo_percentile(latencies: np.ndarray, axis=None):
    """The SLO percentile as an observed value (no interpolation: a failure's infinity stays infinite, never NaN)."""
    return np.percentile(latencies, SLO_PERCENTILE, axis=axis, method="higher")


@dataclass(frozen=True)
class Ladder:
    """One target's steps in ascending multiplier order: (multiplier, step valid, invalid reasons, SLO latencies)."""

    steps: tuple[tuple[float, bool, str, tuple[float, ...]], ...]

    def sustained(self, slo_s: float) -> tuple[Optional[float], str]:
        """The highest multiplier up to which every step was valid and met the SLO, and why the ladder ended:
        an invalid step's own reasons ("" when it ended on a valid step that missed the objective)."""
        best = None
        for multiplier, valid, reasons, latencies in self.steps:
            if not valid:
                return best, f"the {multiplier:g}x step was invalid ({reasons or 'no reason given'})"
            if not latencies or _slo_percentile(np.asarray(latencies, dtype=float)) > slo_s:
                return best, ""
            best = multiplier
        return best, ""

    def missed_lowest(self, slo_s: float) -> str:
        """How the lowest step, valid, missed the objective: its SLO percentile and goodput, in words."""
        multiplier, _, _, latencies = self.steps[0]
        if not latencies:
            return f"no request was due in its {multiplier:g}x step"
        p = float(_slo_percentile(np.asarray(latencies, dtype=float)))
        met = goodput(list(latencies), slo_s)
        never = sum(math.isinf(latency) for latency in latencies)
        late = "no first token (failed, never sent or unfinished)" if math.isinf(p) else f"{p * 1e3:.0f} ms"
        return (f"its TTFT p{SLO_PERCENTILE} at {multiplier:g}x was {late} > {slo_s * 1e3:g} ms (goodput "
                f"{'-' if met is None else format_percent(met, 0)} of {len(latencies)} due requests, "
                f"{never} without a first token)")

    def resampled(self, slo_s: float, rng: np.random.Generator, resamples: int) -> np.ndarray:
        """The highest sustained multiplier (NaN: none) in each of `resamples` resamples of every step's requests."""
        ok = np.ones(resamples, dtype=bool)
        best = np.full(resamples, np.nan)
        for multiplier, valid, _, latencies in self.steps:
            sample = np.asarray(latencies, dtype=float)
            if not valid or sample.size == 0:
                break
            draws = sample[rng.integers(0, sample.size, size=(resamples, sample.size))]
            ok &= _slo_percentile(draws, axis=1) <= slo_s
            best = np.where(ok, multiplier, best)
        return best


@dataclass(frozen=True)
class SustainedFigures:
    baseline: Optional[float]               # highest sustained multiplier (None: not even the lowest)
    candidate: Optional[float]
    gain: Optional[float]                   # candidate / baseline - 1
    interval: Optional[tuple[float, float]]
    valid: bool
    invalid_reason: str


def sustained_rate_gain(baseline: Ladder, candidate: Ladder, slo_s: float, resamples: int = 2000,
                        seed: int = 0) -> SustainedFigures:
    """How much higher a rate the candidate sustains within the TTFT objective than the baseline, with an interval.

    Side by side: at every multiplier both targets were offered the same requests at the same
    arrival times, one step after the other. The point figure is the ratio of the highest
    multipliers each sustains; its 95% interval comes from resampling every step's requests
    (the same resample count for both ladders, independently), which gives how sure each step's
    pass or fail against the objective is. The figure moves in the ladder's steps (1x, 2x, 4x:
    gains of -50%, 0, +100%, ...), and a candidate that sustains the top multiplier is censored
    there (its true gain is at least the figure). A ladder that ended on an invalid step, or a
    baseline that sustains no multiplier, makes it INCONCLUSIVE.
    """
    b_best, b_reason = baseline.sustained(slo_s)
    c_best, c_reason = candidate.sustained(slo_s)
    reasons = [f"{role}: {why}" for role, why in (("baseline", b_reason), ("candidate", c_reason)) if why]
    if b_best is None:
        if not b_reason:  # a valid lowest step that missed the objective (an invalid one said why above)
            reasons.append(f"baseline: not even the lowest multiplier met the TTFT objective: "
                           f"{baseline.missed_lowest(slo_s)}; a lower multiplier or a looser g3.ttft_slo_ms "
                           "would measure it")
        return SustainedFigures(b_best, c_best, None, None, False, "; ".join(reasons))
    gain = (c_best or 0.0) / b_best - 1.0
    rng = np.random.default_rng(seed)
    b_reps, c_reps = baseline.resampled(slo_s, rng, resamples), candidate.resampled(slo_s, rng, resamples)
    replicates = np.nan_to_num(c_reps, nan=0.0) / b_reps - 1.0
    unknown = float(np.mean(np.isnan(replicates)))
    if unknown > _UNKNOWN_TOLERANCE:
        reasons.append(f"the baseline sustained no multiplier in {format_percent(unknown, 0)} of resamples")
    interval = percentile_interval(replicates)
    return SustainedFigures(b_best, c_best, gain, interval, not reasons, "; ".join(reasons))
