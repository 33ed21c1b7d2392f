"""G4's judged figures from the soak's rows: which windows the injected faults touched, and drift.

How it works: docs/methods/soak-trends.md (gates/g4_soak/analysis.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from gates.config import FULL_SOAK_S
from kvcore.percent import format_percent
from kvcore.predictions import format_figure
from kvcore.stats import mann_kendall, sen_slope_ci
from workloads.traffic.errors import describe_errors

DEFAULT_RECOVERY_TIMEOUT_S = 60.0  # FaultSchedule's, for rows written before they carried their own
WORSE = ("increasing", "decreasing")


@dataclass(frozen=True)
class FaultSpan:
    """One fault on the soak's clock, from its injection to its recovery (or the recovery timeout)."""

    kind: str
    at_s: float
    start_s: float
    end_s: float
    recovered: bool

    def describe(self) -> str:
        ending = "recovered" if self.recovered else "not recovered: recovery timeout"
        return f"{self.kind} at {self.at_s:g} s (s {self.start_s:.1f} to {self.end_s:.1f}, {ending})"


def fault_span(row: dict) -> FaultSpan:
    """The span of one `faults.jsonl` row (see fault_schedule); older rows fall back to `at_s`."""
    start = float(row.get("injected_s", row["at_s"]))
    ended = row.get("ended_s")
    if ended is None:  # a failed injection, or a row from before `ended_s`: the fault's planned end
        ended = start + float((row.get("detail") or {}).get("duration_s", 0.0))
    recovered = row.get("recovered_after_s")
    tail = recovered if recovered is not None else row.get("recovery_timeout_s", DEFAULT_RECOVERY_TIMEOUT_S)
    return FaultSpan(row["kind"], float(row["at_s"]), start, float(ended) + float(tail), recovered is not None)


def fault_facts(row: dict) -> dict:
    """A `faults.jsonl` row's outcome as typed fields (the `fault` measurement's context, which the report's
    faults table reads): the counter that should detect the fault and how far it moved, whether the probe
    asked during the fault answered unchanged (and how much of it came from cache), and the injection's
    error (None when it ran), and how often the probe was asked again past an upper tier's whole copy of a
    damaged block. A failed injection has no counter and no probe: those are None."""
    counter, during = row.get("detected_by"), row.get("probe_during") or {}
    return {"detected_by": counter, "detected_count": (row.get("detected") or {}).get(counter) if counter else None,
            "reprobes": len(row.get("reprobes") or []),
            "answer_unchanged": during.get("identical"), "probe_cached_tokens": during.get("cached_tokens"),
            "probe_prompt_tokens": during.get("prompt_tokens"), "error": row.get("error")}


def fault_outcome(row: dict) -> tuple[bool, str]:
    """Whether the system handled the fault, and what it did, in words."""
    if row.get("error"):
        return False, f"the injection failed: {row['error']}"
    counter, moved = row["detected_by"], row["detected"].get(row["detected_by"], 0)
    during = row["probe_during"]
    recovered = row.get("recovered_after_s")
    words = [f"detected ({moved:g} {counter.replace('_', ' ')})" if moved else f"NOT detected (no {counter})",
             f"probe {'identical' if during['identical'] else 'CHANGED'} with "
             f"{during['cached_tokens'] or 0} of {during['prompt_tokens'] or 0} prompt tokens from cache",
             f"served whole from cache again after {recovered:.1f} s" if recovered is not None
             else "NOT served from cache again before the soak ended"]
    reprobes = row.get("reprobes") or []
    if reprobes:
        words.insert(1, _reprobed(reprobes))
    return bool(moved) and during["identical"] and recovered is not None, "; ".join(words)


def _reprobed(reprobes: list[dict]) -> str:
    """Why the probe was asked again after a stored-block fault, in words."""
    held = sorted({tier for r in reprobes for tier in r.get("held_by") or []})
    replaced = sum(bool(r.get("damage_replaced")) for r in reprobes)
    why = []
    if held:
        why.append(f"after evicting {' and '.join(held)}, which held a whole copy of the damaged block")
    if replaced:
        why.append("after damaging it again where a store had replaced the damaged file with a whole one"
                   + (f" ({replaced} times)" if replaced > 1 else ""))
    times = len(reprobes)
    return f"asked again {times} time{'s' if times > 1 else ''} " + ("; ".join(why) or "after evicting the upper tiers")


def faults_summary(rows: Iterable[dict]) -> str:
    """Every fault's outcome in words, the ones not handled first (a reviewer reads the reason for a FAIL
    first), each group by kind, then time."""
    outcomes = sorted((ok, row["kind"], float(row["at_s"]), words)
                      for row in rows for ok, words in [fault_outcome(row)])
    return "; ".join(f"{kind} at {at:g} s: {words}" for _, kind, at, words in outcomes)


@dataclass(frozen=True)
class WarmUp:
    """The soak's first `end_s` seconds: caches filling and memory ramping, not the system's course."""

    end_s: float
    kind: str = "warm-up"

    def describe(self) -> str:
        return f"warm-up (the soak's first {self.end_s:g} s, g4.warmup_s)"


@dataclass(frozen=True)
class FailedRequests:
    """A window whose requests failed more than `g4.max_error_share`: a window of failures is not a measurement
    of the system's course (its TTFT and throughput are the failures'); the error-rate check judges them."""

    failed: int
    requests: int
    max_share: float
    errors: str                      # by type, each with a sample (workloads.traffic.errors.describe_errors)
    kind: str = "errors"

    def describe(self) -> str:
        return (
            f"{self.failed} of {self.requests} requests failed ({format_percent(self.failed / self.requests)} > "
            f"{format_percent(self.max_share, 4, trim=True)} allowed, g4.max_error_share)"
            + (f": {self.errors}" if self.errors else "")
        )


def failed_requests(window: dict, max_share: float) -> Optional[FailedRequests]:
    """The window's failures when more than `max_share` of its requests failed, else None."""
    requests, failed = int(window.get("requests") or 0), int(window.get("errors") or 0)
    if not requests or failed <= max_share * requests:
        return None
    return FailedRequests(failed, requests, max_share, describe_errors(window.get("errors_by_type") or {}))


def windows_touched(windows: Sequence[dict], rows: Sequence[dict], window_s: float,
                    warmup_s: float = 0.0, max_error_share: Optional[float] = None) -> dict[int, list]:
    """The index of each window left out of the trends: those starting within the warm-up, those whose
    requests failed more than `max_error_share` (None: none judged so), and those overlapping a fault's
    span, each with why (a WarmUp, FailedRequests or FaultSpans)."""
    spans = [fault_span(row) for row in rows]
    touched: dict[int, list] = {}
    for window in windows:
        if float(window["start_s"]) < warmup_s:
            touched[int(window["index"])] = [WarmUp(warmup_s)]
        failed = None if max_error_share is None else failed_requests(window, max_error_share)
        if failed is not None:
            touched.setdefault(int(window["index"]), []).append(failed)
    for window in windows:
        start = float(window["start_s"])
        # its requests ran until start + window_s; its server figures were read a moment later (`sampled_s`): a
        # fault injected in that moment, as one due at a window's end is, is in the window's memory figure
        end = max(start + window_s, float(window.get("sampled_s") or 0.0))
        hits = [span for span in spans if start <= span.end_s and span.start_s < end]
        if hits:
            touched.setdefault(int(window["index"]), []).extend(hits)
    return touched


JUDGED_FIGURES = ("ttft_p99_ms", "output_tokens_per_s", "rss_minus_cache_mib")


def excluded_window_rows(windows: Sequence[dict], touched: dict[int, list[FaultSpan]], window_s: float) -> list[dict]:
    """One row per window left out: where it lies, the faults in it and why, and its judged figures."""
    rows = []
    for window in windows:
        spans = touched.get(int(window["index"]))
        if spans:
            rows.append({"window": window["index"], "window_start_s": window["start_s"],
                         "window_end_s": window["start_s"] + window_s,
                         "kind": ", ".join(span.kind for span in spans),
                         "reason": "; ".join(span.describe() for span in spans),
                         **{name: window.get(name) for name in JUDGED_FIGURES}})
    return rows


@dataclass(frozen=True)
class Drift:
    """A windowed figure's trend over the judged windows, as a fraction of its level (positive: worse)."""

    metric: str
    worse: str
    windows: int
    excluded: int
    level: Optional[float] = None
    sen_slope: Optional[float] = None
    intercept: Optional[float] = None
    change: Optional[float] = None
    fraction: Optional[float] = None
    interval: Optional[tuple[float, float]] = None
    p_value: Optional[float] = None
    trend: str = "too few windows"
    slope_interval: Optional[tuple[float, float]] = None   # the Sen slope's, per window (holds 0 if not significant)
    noise: Optional[float] = None     # the residuals' standard deviation about the line (2 degrees used)

    @property
    def invalid_reason(self) -> str:
        if self.windows < 3:
            return (f"{self.windows} windows to judge outside the warm-up and fault windows: the trend needs at "
                    "least 3")
        return "" if self.fraction is not None else f"the level (median window) is {self.level:g}: no relative change"

    def words(self, unit: str = "") -> str:
        """What the figure rests on, for the verdict's label (`unit`: the windowed figure's)."""
        plural = "s" if self.excluded != 1 else ""
        left_out = f"; {self.excluded} window{plural} of warm-up, faults or errors left out" if self.excluded else ""
        head = f"Theil-Sen over {self.windows} windows{left_out}"
        if self.p_value is None:
            return head
        level = f"{self.level:.3g} {unit}".rstrip()
        return (f"{head}; level {level}, slope {self.sen_slope:+.3g}/window, "
                f"Mann-Kendall p{_p_text(self.p_value)}")

    def trend_at(self, index: float) -> Optional[float]:
        """The Theil-Sen line at a window index (the line drawn beside the figure)."""
        return None if self.sen_slope is None or self.intercept is None else self.intercept + self.sen_slope * index

    def context(self) -> dict:
        return {"windows": self.windows, "excluded_windows": self.excluded, "level": self.level,
                "sen_slope": self.sen_slope, "intercept": self.intercept, "change": self.change,
                "interval": self.interval, "slope_interval": self.slope_interval, "p_value": self.p_value,
                "trend": self.trend, "noise": self.noise}


def drift(windows: Sequence[dict], metric: str, worse: str = "increasing", excluded: Sequence[int] = (),
          confidence: float = 0.95) -> Drift:
    """The drift of `metric` over the windows not in `excluded` (by index) that hold the figure."""
    if worse not in WORSE:
        raise ValueError(f"worse: expected one of {', '.join(WORSE)}, found {worse!r}")
    left_out = set(excluded)
    kept = [w for w in windows if w.get(metric) is not None and int(w["index"]) not in left_out]
    excluded_windows = sum(1 for w in windows if int(w["index"]) in left_out)
    if len(kept) < 3:
        return Drift(metric, worse, len(kept), excluded_windows)
    values = [float(w[metric]) for w in kept]
    positions = [float(w["index"]) for w in kept]
    test = mann_kendall(values, alpha=1.0 - confidence, positions=positions)
    slope, (lo, hi) = sen_slope_ci(values, positions, confidence)
    if test["trend"] == "no trend":  # not significant: the interval holds "no change"
        lo, hi = min(lo, 0.0), max(hi, 0.0)
    span = positions[-1] - positions[0]
    level = float(np.median(values))
    intercept = float(np.median(np.asarray(values) - slope * np.asarray(positions)))
    residuals = np.asarray(values) - (intercept + slope * np.asarray(positions))
    noise = float(np.std(residuals, ddof=2))
    found = Drift(metric, worse, len(kept), excluded_windows, level=level, sen_slope=slope, intercept=intercept,
                  change=slope * span, p_value=test["p_value"], trend=test["trend"], slope_interval=(lo, hi),
                  noise=noise)
    if level <= 0:
        return found
    sign = (1.0 if worse == "increasing" else -1.0) * span / level
    ends = sorted((sign * lo, sign * hi))
    return replace(found, fraction=sign * slope, interval=(ends[0], ends[1]))


@dataclass(frozen=True)
class GrowthProjection:
    """A windowed figure's Theil-Sen slope carried to a horizon: the growth a server would show by then.

    The growth is the slope (per window) times the horizon's windows, with the slope's interval
    carried the same way; a falling figure projects no growth (0), not a negative one.
    """

    horizon_s: float
    measured: float                      # the line's change over the judged windows (first to last)
    per_hour: float
    per_hour_interval: tuple[float, float]
    growth: float
    interval: tuple[float, float]

    def words(self, unit: str) -> str:
        lo, hi = (format_figure(v, "", signed=True) for v in self.per_hour_interval)
        return (f"{format_figure(self.measured, unit, signed=True)} measured, "
                f"{format_figure(self.per_hour, f'{unit}/h', signed=True)} [{lo}, {hi}], "
                f"projected over {_duration_text(self.horizon_s)}")

    def context(self) -> dict:
        return {"horizon_s": self.horizon_s, "measured_growth": self.measured, "slope_per_hour": self.per_hour,
                "slope_per_hour_interval": self.per_hour_interval, "projected_interval": self.interval}


def project_growth(result: Drift, window_s: float, horizon_s: float) -> Optional[GrowthProjection]:
    """`result`'s slope carried over `horizon_s` (None when the drift has no slope)."""
    if result.sen_slope is None or result.slope_interval is None or result.change is None:
        return None
    per_hour = 3600.0 / window_s
    windows = horizon_s / window_s
    lo, hi = result.slope_interval
    return GrowthProjection(horizon_s, result.change, result.sen_slope * per_hour, (lo * per_hour, hi * per_hour),
                            max(0.0, result.sen_slope) * windows, (max(0.0, lo) * windows, max(0.0, hi) * windows))


LONG_SOAK_S = 1800.0                 # a soak this long or longer certifies FULL_SOAK_S (72 h) unless configured


@dataclass(frozen=True)
class Horizon:
    """How far G4 projects a growth: the uptime the run certifies, and why that one."""

    seconds: float
    why: str

    def words(self) -> str:
        return f"projected over {_duration_text(self.seconds)} ({self.why})"


def growth_horizon(configured_s: Optional[float], duration_s: float) -> Horizon:
    """`g4.memory_growth_horizon_s` when set; else 72 h for a soak of 30 minutes or more, and the soak's own
    length for a shorter one (a smoke test, which certifies no uptime beyond itself)."""
    if configured_s is not None:
        return Horizon(configured_s, "the uptime this run certifies: g4.memory_growth_horizon_s")
    if duration_s >= LONG_SOAK_S:
        return Horizon(FULL_SOAK_S, "the uptime a soak of 30 min or more certifies, "
                                           "g4.memory_growth_horizon_s unset")
    return Horizon(duration_s, "the soak's own length: a soak under 30 min certifies no longer uptime")


# the server's runtime figures G4 projects like memory: (window figure, unit, judged metric, what it counts)
RUNTIME_GROWTH = (
    ("open_fds", "descriptors", "open_fds_growth", "open file descriptors"),
    ("threads", "threads", "threads_growth", "OS threads"),
    ("asyncio_tasks", "tasks", "asyncio_tasks_growth", "event-loop tasks"),
    ("disk_temp_files", "files", "disk_temp_files_growth", "disk-tier temp files"),
)

Z_95 = 1.959964
SEN_WIDTH = 1.05         # Sen's interval over least squares' under normal noise, measured at 20-300 windows
MOST_WINDOWS = 10**7     # beyond this the estimate says "more than" (years of soak at any window)


@dataclass(frozen=True)
class Power:
    """The judged windows (and the soak) at which an interval would be narrower than `width`, at the noise
    measured; `windows` None when more than MOST_WINDOWS would be needed."""

    width: float                    # the tolerance or limit, in the judged figure's unit
    unit: str
    windows_now: int
    windows: Optional[int]
    soak_s: Optional[float]

    def words(self) -> str:
        width = format_percent(self.width, trim=True) if self.unit == "%" else f"{self.width:g} {self.unit}"
        if self.windows is None or self.soak_s is None:     # the soak is None exactly when the windows are
            return f"at this noise no soak under {MOST_WINDOWS:,} windows narrows the interval below {width}"
        if self.windows <= self.windows_now:
            return f"at this noise {self.windows} judged windows narrow the interval below {width} (this soak has " \
                   f"{self.windows_now})"
        return (f"at this noise an interval narrower than {width} needs ≈ {self.windows:,} judged windows, a soak of "
                f"≈ {_duration_text(self.soak_s)} (this one judged {self.windows_now})")

    def context(self) -> dict:
        return {"windows_to_decide": self.windows, "soak_s_to_decide": self.soak_s}


def _fewest_windows(width_at: Callable[[int], float], width: float) -> Optional[int]:
    """The fewest windows n >= 3 with width_at(n) < width (width_at falls with n), None beyond MOST_WINDOWS."""
    if width_at(MOST_WINDOWS) >= width:
        return None
    low, high = 3, MOST_WINDOWS
    if width_at(low) < width:
        return low
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if width_at(middle) < width else (middle, high)
    return high


def _soak_for(windows: int, result: Drift, window_s: float) -> float:
    """The soak that holds `windows` judged windows at this run's share of windows left out."""
    judged_share = result.windows / (result.windows + result.excluded)
    return windows / judged_share * window_s


def drift_power(result: Drift, tolerance: float, window_s: float) -> Optional[Power]:
    """Judged windows (and soak) at which the drift fraction's interval would be narrower than `tolerance`."""
    if result.noise is None or not result.level or result.level <= 0:
        return None
    relative = result.noise / result.level

    def width_at(n: int) -> float:
        return SEN_WIDTH * 2 * Z_95 * relative * (12.0 * (n - 1) / (n * (n + 1))) ** 0.5

    windows = _fewest_windows(width_at, tolerance)
    return Power(tolerance, "%", result.windows, windows,
                 None if windows is None else _soak_for(windows, result, window_s))


def growth_power(result: Drift, limit: float, unit: str, window_s: float, horizon_s: float) -> Optional[Power]:
    """Judged windows (and soak) at which the projected growth's interval would be narrower than `limit`."""
    noise = result.noise
    if noise is None:
        return None
    carried = horizon_s / window_s

    def width_at(n: int) -> float:
        return SEN_WIDTH * 2 * Z_95 * noise * (12.0 / (n * (n * n - 1))) ** 0.5 * carried

    windows = _fewest_windows(width_at, limit)
    return Power(limit, unit, result.windows, windows,
                 None if windows is None else _soak_for(windows, result, window_s))


def _duration_text(seconds: float) -> str:
    """"72 h", "2,440 h", "30 min", "45 s": three significant figures, never an exponent."""
    if seconds >= 3600:
        return format_figure(seconds / 3600, "h")
    return format_figure(seconds / 60, "min") if seconds >= 60 else format_figure(seconds, "s")


def _p_text(p_value: float) -> str:
    return f"={p_value:.3f}" if p_value >= 0.001 else "<0.001"
