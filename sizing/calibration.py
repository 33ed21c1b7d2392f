"""The sizing model's free constants fitted to a recorded run, saved as JSON for a later plan to read.

How it works: docs/methods/sizing-model.md (sizing/calibration.py).
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

from kvcore.files import read_jsonl, write_json
from kvcore.percent import format_percent
from kvcore.rundata import RunStore, finite_number, left_out_note
from kvcore.settings import ConfigError, load_yaml_file
from workloads.loadgen.sweep import text_per_token

from .queueing import DecodeCost, EngineModel, ServedRequest, simulate_closed_loop
from .targets import prefill_budget
from .timing import (
    DEFAULT_HOST_GBPS,
    G2_PROMPT_SHORTFALL,
    TIERS,
    RecomputeCurve,
    TierBandwidths,
    TimingModel,
    check_number,
    nonnegative_least_squares,
)

FORMAT = 1
DECODE_ROUNDS = 4
# the share of the load probe's first tokens left out at each end before their mean gives a request's fixed cost: a
# server's stalls (vLLM's: 200-500 ms for two requests at once, 4 of 50 in vB6) move the mean 80% above the median
TRIMMED_SHARE = 0.1
FIXED_ROUNDS = 16       # bisection steps of a fixed overhead: 2^-16 of its range, well under a microsecond
# the tier a G3 target's cached tokens came from, for the decode fit (the records give the total only)
_TARGET_TIER = {"candidate": "host", "baseline": "device"}


# How a note of `calibrate` begins when it found no value for a constant; a constant taken from an earlier
# calibration answers it, and the note goes (`Calibration.filled_from`).
MISSING_NOTE = {"curve": "no recompute curve:", "decode": "no decode cost:"}

@dataclass(frozen=True)
class Calibration:
    """The fitted constants (None or empty: the run did not have what fits it)."""

    curve: Optional[RecomputeCurve] = None
    fixed_overhead_s: Optional[float] = None
    tier_efficiency: Mapping[str, float] = field(default_factory=dict)
    tier_overhead_s: Mapping[str, float] = field(default_factory=dict)
    decode: Optional[DecodeCost] = None
    jitter: Optional[float] = None          # the step noise (queueing.EngineModel.jitter), from G3's gaps
    loader_efficiency: Mapping[str, float] = field(default_factory=dict)
    checkpoint_efficiency: Optional[float] = None
    service_start_s: Optional[float] = None
    kv_bytes_per_token: Optional[int] = None
    source: str = ""
    notes: tuple[str, ...] = ()
    host_gbps: Optional[float] = None       # the host tier's copy GB/s as measured (a machine probe's)
    # the source of each constant taken from an earlier calibration (`filled_from`), where not `source`
    taken_from: Mapping[str, str] = field(default_factory=dict)
    # the baseline's own decode cost and step noise, from its G3 gaps (None: the candidate's stand in)
    baseline_decode: Optional[DecodeCost] = None
    baseline_jitter: Optional[float] = None

    def target_decode(self, role: str) -> Optional[DecodeCost]:
        """The decode cost G3's `role` (a target) steps at: the baseline's own where fitted, else `decode`."""
        return self.baseline_decode if role == "baseline" and self.baseline_decode is not None else self.decode

    def target_jitter(self, role: str) -> Optional[float]:
        """The step noise of G3's `role`: the baseline's own where fitted, else `jitter`."""
        return self.baseline_jitter if role == "baseline" and self.baseline_jitter is not None else self.jitter

    def source_of(self, name: str) -> str:
        """Where the constant `name` (a field's name) came from: the calibration it was taken from, else this one's."""
        return self.taken_from.get(name, self.source)

    def tiers(self, base: TierBandwidths) -> TierBandwidths:
        """`base` with the measured host copy GB/s, the fitted efficiencies and hit overheads over its own."""
        return replace(base, host_gbps=self.host_gbps or base.host_gbps,
                       efficiency={**base.efficiency, **self.tier_efficiency},
                       overhead_s={**base.overhead_s, **self.tier_overhead_s})

    def timing_model(self, tiers: TierBandwidths, kv_bytes_per_token: int, block_size: int = 256,
                     curve: Optional[RecomputeCurve] = None) -> TimingModel:
        """The TTFT model with these constants; `curve` (say a roofline) when the run fitted none."""
        chosen = self.curve or curve
        if chosen is None:
            raise ConfigError("calibration.curve: expected a recompute curve (G2's recompute TTFTs, or a roofline), "
                              "found none")
        return TimingModel(chosen, self.tiers(tiers), kv_bytes_per_token, block_size, self.fixed_overhead_s)

    def filled_from(self, earlier: "Calibration") -> "Calibration":
        """These constants, with what this run has not fitted yet taken from an `earlier` calibration (a run's
        own G2 gives the curve and the tiers' costs before its G3 gives a decode cost and step noise); the
        notes say which constants came from where."""
        taken = [name for name in ("curve", "fixed_overhead_s", "decode", "jitter", "baseline_decode",
                                   "baseline_jitter", "checkpoint_efficiency", "service_start_s", "host_gbps")
                 if getattr(self, name) is None and getattr(earlier, name) is not None]
        taken += [name for name in ("tier_efficiency", "tier_overhead_s", "loader_efficiency")
                  if not getattr(self, name) and getattr(earlier, name)]
        if not taken:
            return self
        source = earlier.source or "the configured calibration"
        note = f"{', '.join(taken)} from {source} (no gate of this run measured them)"
        answered = tuple(MISSING_NOTE[name] for name in taken if name in MISSING_NOTE)
        kept = tuple(n for n in self.notes if not n.startswith(answered))   # "no recompute curve: …" once one is taken
        taken_from = {**self.taken_from, **{name: earlier.source_of(name) or source for name in taken}}
        return replace(self, **{name: getattr(earlier, name) for name in taken}, notes=(*kept, note),
                       taken_from=taken_from)

    def to_dict(self) -> dict:
        return {"format": FORMAT, "source": self.source,
                "curve": None if self.curve is None else {"a": self.curve.a, "b": self.curve.b, "c": self.curve.c,
                                                          "source": self.curve.source},
                "fixed_overhead_s": self.fixed_overhead_s, "tier_efficiency": dict(self.tier_efficiency),
                "tier_overhead_s": dict(self.tier_overhead_s),
                "decode": _decode_dict(self.decode), "jitter": self.jitter,
                "baseline_decode": _decode_dict(self.baseline_decode), "baseline_jitter": self.baseline_jitter,
                "loader_efficiency": dict(self.loader_efficiency), "checkpoint_efficiency": self.checkpoint_efficiency,
                "service_start_s": self.service_start_s, "kv_bytes_per_token": self.kv_bytes_per_token,
                "host_gbps": self.host_gbps, "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, data: Any, root: str = "calibration") -> "Calibration":
        if not isinstance(data, dict):
            raise ConfigError(f"{root}: expected a JSON object, found {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise ConfigError(f"{root}.format: expected {FORMAT}, found {data.get('format')!r}")
        known = set(cls().to_dict())
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{root}.{unknown[0]}: unknown field (expected one of {sorted(known)}), "
                              f"found {data[unknown[0]]!r}")

        def number(path: str, value: Any, allow_zero: bool = True) -> Optional[float]:
            return None if value is None else check_number(f"{root}.{path}", value, allow_zero)

        def mapping(name: str, allow_zero: bool, keys: Optional[tuple[str, ...]] = None) -> dict:
            value = data.get(name) or {}
            if not isinstance(value, dict):
                raise ConfigError(f"{root}.{name}: expected a mapping, found {value!r}")
            for key in value:
                if keys is not None and key not in keys:
                    raise ConfigError(f"{root}.{name}: expected tiers among {list(keys)}, found {key!r}")
            return {str(k): number(f"{name}.{k}", v, allow_zero) for k, v in value.items()}

        def fields(name: str, keys: tuple[str, ...]) -> Optional[list[float]]:
            value = data.get(name)
            if value is None:
                return None
            if not isinstance(value, dict):
                raise ConfigError(f"{root}.{name}: expected a mapping of {', '.join(keys)}, found {value!r}")
            for key in keys:
                if value.get(key) is None:
                    raise ConfigError(f"{root}.{name}.{key}: expected a number, found nothing")
            return [check_number(f"{root}.{name}.{key}", value[key], True) for key in keys]

        curve = None
        curve_fields = fields("curve", ("a", "b", "c"))
        if curve_fields is not None:
            a, b, c = curve_fields
            curve = RecomputeCurve(a, b, c, source=str(data["curve"].get("source", "")))

        def decode_cost(name: str) -> Optional[DecodeCost]:
            found = fields(name, ("step_s", "per_sequence_s"))
            return None if found is None else DecodeCost(*found)

        decode = decode_cost("decode")
        kv_bytes = data.get("kv_bytes_per_token")
        if kv_bytes is not None and (not isinstance(kv_bytes, int) or isinstance(kv_bytes, bool) or kv_bytes < 1):
            raise ConfigError(f"{root}.kv_bytes_per_token: expected an integer >= 1, found {kv_bytes!r}")
        return cls(curve, number("fixed_overhead_s", data.get("fixed_overhead_s")),
                   mapping("tier_efficiency", False, TIERS), mapping("tier_overhead_s", True, TIERS), decode,
                   number("jitter", data.get("jitter")),
                   mapping("loader_efficiency", False),
                   number("checkpoint_efficiency", data.get("checkpoint_efficiency"), False),
                   number("service_start_s", data.get("service_start_s")), kv_bytes, str(data.get("source", "")),
                   tuple(str(n) for n in data.get("notes") or ()),
                   number("host_gbps", data.get("host_gbps"), False),
                   baseline_decode=decode_cost("baseline_decode"),
                   baseline_jitter=number("baseline_jitter", data.get("baseline_jitter")))

    def fitted(self) -> bool:
        """Whether any constant was fitted (a run with no gate's measurements gives none)."""
        return any(value not in (None, {}) for value in (
            self.curve, self.fixed_overhead_s, self.decode, self.baseline_decode, self.tier_efficiency,
            self.tier_overhead_s,
            self.loader_efficiency, self.checkpoint_efficiency, self.service_start_s))

    def readable(self) -> "Calibration":
        """These constants as a calibration file can hold them: one its reader would refuse (a negative efficiency
        or start time, fitted over odd rows) is left out, and a note says which and why."""
        data, notes = self.to_dict(), []
        for _ in range(len(data) + sum(len(v) for v in data.values() if isinstance(v, dict))):
            try:
                self.from_dict(data)
                break
            except ConfigError as error:
                field, _, why = str(error).partition(": ")
                path = field.split(".")[1:]
                if not path or path[0] not in data or path[0] in ("format", "kv_bytes_per_token"):
                    raise
                if len(path) == 2 and path[0] not in ("curve", "decode", "baseline_decode"):
                    data[path[0]].pop(path[1], None)        # one tier's or loader's constant
                else:
                    data[path[0]] = None                    # a constant, or a curve or decode cost whole
                notes.append(f"{'.'.join(path)} left out: {why} (fitted over this run's rows; a calibration file "
                             "cannot hold it)")
        return replace(self.from_dict(data), notes=(*self.notes, *notes)) if notes else self

    def save(self, path: Path) -> None:
        write_json(Path(path), self.to_dict())

    @classmethod
    def load(cls, path: Path) -> "Calibration":
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as error:
            raise ConfigError(f"calibration: expected a readable JSON file, found {error.strerror or error} "
                              f"({path})") from None
        except (ValueError, UnicodeDecodeError) as error:
            raise ConfigError(f"calibration: expected a JSON file, found unreadable JSON in {path} ({error})") from None
        return cls.from_dict(data)


def _decode_dict(decode: Optional[DecodeCost]) -> Optional[dict]:
    return None if decode is None else {"step_s": decode.step_s, "per_sequence_s": decode.per_sequence_s}


# --------------------------------------------------------------------------- G2


def _g2_rows(store: RunStore) -> list[tuple[str, int, float]]:
    """(mode, context tokens, TTFT seconds) of G2's per-context medians."""
    rows = []
    for m in store.figures("g2"):
        context = m.get("context") or {}
        if m["metric"] == "ttft_ms" and m.get("value") and "mode" in context and "context_tokens" in context:
            rows.append((context["mode"], int(context["context_tokens"]), float(m["value"]) / 1e3))
    return rows


def prefill_points(probe: dict) -> list[tuple[int, float]]:
    """(prompt tokens, median first-token seconds) of a run's prefill probe (machine_probe.json's "prefill"), []
    when it did not run."""
    prefill = probe.get("prefill") or {}
    return [(p["prompt_tokens"], p["seconds"]) for p in prefill.get("points", [])]


def _tail_terms(prompt: int, cached: int) -> tuple[float, float]:
    """(Δn, Δn²) of the uncached tail, or of the one-token pass of a full hit (RecomputeCurve.tail's terms)."""
    low = prompt - 1 if cached >= prompt else cached
    return float(prompt - low), float(prompt * prompt - low * low)


def fit_g2_ttfts(rows: list[tuple[str, int, float]], kv_bytes_per_token: Optional[int], host_gbps: float,
                 disk_gbps: Optional[float], block_size: int = 256,
                 shortfall: int = G2_PROMPT_SHORTFALL, what: str = "G2 TTFTs",
                 ) -> tuple[RecomputeCurve, float, Optional[float]]:
    """(curve, fixed overhead, disk hit overhead) from G2's TTFT rows (the module's joint fit); `what` the rows
    are, in the curve's source."""
    design, target, weights = [], [], []
    disk_rows = 0
    for mode, context, seconds in rows:
        n = context - shortfall
        if mode == "recompute":
            design.append([1.0, n, float(n) * n, 0.0])
            target.append(seconds)
        elif mode in ("host-hit", "disk-cold"):
            gbps = host_gbps if mode == "host-hit" else disk_gbps
            if gbps is None:        # a disk hit with no disk GB/s to take its load from
                continue
            h = n // block_size * block_size
            load = 0.0 if kv_bytes_per_token is None else h * kv_bytes_per_token / (gbps * 1e9)
            disk = mode == "disk-cold"
            disk_rows += disk
            design.append([1.0, *_tail_terms(n, h), float(disk)])
            target.append(seconds - load)
        else:
            continue
        weights.append(1.0 / seconds)
    w = np.array(weights)[:, None]
    f, b, c, disk_overhead = nonnegative_least_squares(np.array(design) * w, np.array(target) * w[:, 0])
    curve = RecomputeCurve(float(f), float(b), float(c), f"joint fit of {len(target)} {what} "
                                                         f"(recompute, host and disk hits)")
    return curve, float(f), float(disk_overhead) if disk_rows else None


def _kv_bytes_from_cold_reads(store: RunStore, config: dict, block_size: int) -> Optional[int]:
    """KV bytes per token from G2's cold-read rounds: the bytes a round read ÷ the tokens it loaded
    (g2.cold_read_prefixes prefixes of the longest context, every whole block)."""
    pairs = [m["context"] for m in store.figures("g2") if m["metric"] == "cold_read_pair"
             and (m.get("context") or {}).get("tier_bytes")]
    g2 = config.get("g2") or {}
    if not pairs or not g2.get("contexts"):
        return None
    prompt = max(g2["contexts"]) - G2_PROMPT_SHORTFALL
    tokens = int(g2.get("cold_read_prefixes", 1)) * (prompt // block_size * block_size)
    return round(statistics.median(p["tier_bytes"] for p in pairs) / tokens) if tokens else None


# --------------------------------------------------------------------------- G3


_LEVEL_DIR = re.compile(r"c(\d+)(?:-block(\d+))?")   # a level's load run: c4, or its block k of pairs: c4-block2


def _g3_levels(store: RunStore, target: str, warmup_s: float) -> dict[int, list[list[dict]]]:
    """Per level, the target's load runs after the warm-up, each its ok records in sending order: G3's matched
    blocks (c4, c4-block2, ...) after the warm-up pairs it left out (its g3_warmup_pairs figure), or one load
    run's records sent `warmup_s` after its first."""
    root = store.gate_dir("g3") / "raw" / "sweep" / target
    runs: dict[int, dict[int, list[dict]]] = {}
    for directory in root.glob("c*"):
        name = _LEVEL_DIR.fullmatch(directory.name)
        if name is None:
            continue
        records = sorted((r for r in read_jsonl(directory / "records", "records-*.jsonl") if r.get("ok")),
                         key=lambda r: r["sent_at"])
        runs.setdefault(int(name[1]), {})[int(name[2] or 1)] = records
    left_out = {int((m.get("context") or {}).get("concurrency", 0)): int(m["value"]) for m in store.figures("g3")
                if m["metric"] == "g3_warmup_pairs" and finite_number(m.get("value")) is not None}
    levels = {}
    for level, blocks in sorted(runs.items()):
        if len(blocks) > 1 or level in left_out:     # matched blocks: the warm-up is whole pairs
            kept = [blocks[k] for k in sorted(blocks) if k > left_out.get(level, 0)]
        else:
            first = blocks.get(1) or []
            kept = [[r for r in first if r["sent_at"] >= first[0]["sent_at"] + warmup_s]] if first else []
        kept = [run for run in kept if run]
        if kept:
            levels[level] = kept
    return levels


def _replay(records: list[dict], tier: Optional[str]) -> list[ServedRequest]:
    """A load run's recorded requests as the simulation takes them (the records give the cached total only)."""
    return [ServedRequest(int(r["prompt_tokens"]), max(1, int(r["completion_tokens"] or 1)),
                          {tier: min(int(r.get("cached_tokens") or 0), int(r["prompt_tokens"]))} if tier else {})
            for r in records]


def _simulated(runs: list[list[dict]], level: int, engine: EngineModel, tier: Optional[str]) -> list:
    """Each of a level's load runs simulated on its own (a block starts with its users at once and drains)."""
    return [r for records in runs for r in simulate_closed_loop(_replay(records, tier), level, engine)]


def fit_decode(levels: Mapping[int, list[list[dict]]], timing: TimingModel, max_running: int,
               tier: Optional[str], prefill_budget: Optional[int] = None) -> Optional[DecodeCost]:
    """(step_s, per_sequence_s) matching each level's measured mean gap between tokens (the module's fit), each
    level's load runs (G3's blocks) simulated one by one."""
    measured = {}
    for level, runs in levels.items():
        gap = _mean_token_gap([r for records in runs for r in records])
        if gap is not None:
            measured[level] = gap
    if not measured:
        return None
    decode = DecodeCost()
    for _ in range(DECODE_ROUNDS):
        engine = EngineModel(timing, decode, max_running, prefill_budget=prefill_budget)
        rows, target = [], []
        for level in measured:
            simulated = _simulated(levels[level], level, engine, tier)
            gaps = [g for r in simulated for g in r.itl_s]
            batches = [b for r in simulated for b in r.itl_batch]
            if not gaps:
                continue
            mean_batch = float(np.mean(batches))
            non_decode = float(np.mean(gaps)) - decode.seconds(mean_batch)   # decode(b) is linear in b
            rows.append([1.0, mean_batch])
            target.append(measured[level] - non_decode)
        step, per_sequence = nonnegative_least_squares(np.array(rows), np.array(target))
        decode = DecodeCost(float(step), float(per_sequence))
    return decode


def trimmed_mean(values: list[float], share: float = TRIMMED_SHARE) -> float:
    """The mean of `values` without the lowest and highest `share` of them."""
    ordered = np.sort(np.asarray(values, dtype=float))
    cut = int(len(ordered) * share)
    return float(np.mean(ordered[cut:len(ordered) - cut]))


def _lowest_first_tokens(levels: Mapping[int, list[list[dict]]]) -> Optional[list[float]]:
    """The first-token seconds of the lowest level's load runs (the least queueing, which the simulation models
    apart), None when there are none or one is missing."""
    first = [r.get("ttft_s") for records in levels[min(levels)] for r in records] if levels else []
    if not first or any(t is None for t in first):
        return None
    return [float(t) for t in first if t is not None]


def fit_fixed_overhead(levels: Mapping[int, list[list[dict]]], timing: TimingModel, decode: DecodeCost,
                       max_running: int, tier: Optional[str], prefill_budget: Optional[int] = None) -> Optional[float]:
    """The fixed seconds of a request (its overhead beyond its loads and prefill chunks) that put the simulated
    trimmed mean first token of the lowest level's load runs where the measured one is (bisection: it rises with
    the overhead); None when those records hold no first-token times, 0 when even no overhead leaves the simulation
    slower. The trimmed mean, not the median: a closed loop's simulated steps fall in step with each other, and its
    median first token moves in jumps of a step (at 8 users, 17 -> 46 -> 72 ms over 2 ms of overhead on m11); not
    the mean: a server's stalls move it far from the typical request (`fit_stall` gives them)."""
    first = _lowest_first_tokens(levels)
    if first is None:
        return None
    level, measured = min(levels), trimmed_mean(first)

    def excess(overhead: float) -> float:
        engine = EngineModel(replace(timing, fixed_overhead_s=overhead), decode, max_running,
                             prefill_budget=prefill_budget)
        return trimmed_mean([r.ttft_s for r in _simulated(levels[level], level, engine, tier)]) - measured

    low, high = 0.0, 2.0 * measured
    if excess(low) >= 0:
        return 0.0
    for _ in range(FIXED_ROUNDS):
        middle = (low + high) / 2
        low, high = (middle, high) if excess(middle) < 0 else (low, middle)
    return (low + high) / 2


def fit_stall(levels: Mapping[int, list[list[dict]]], timing: TimingModel, decode: DecodeCost, max_running: int,
              tier: Optional[str], prefill_budget: Optional[int] = None) -> Optional[float]:
    """What the server's stalls cost a request on average (EngineModel.stall_s): how far the lowest level's measured
    mean first token lies above the simulated one, with `timing`'s fixed cost fitted to their trimmed means (0 when
    it does not); None without first-token times."""
    first = _lowest_first_tokens(levels)
    if first is None:
        return None
    level = min(levels)
    engine = EngineModel(timing, decode, max_running, prefill_budget=prefill_budget)
    simulated = float(np.mean([r.ttft_s for r in _simulated(levels[level], level, engine, tier)]))
    return max(0.0, float(np.mean(first)) - simulated)


def _mean_token_gap(records: list[dict]) -> Optional[float]:
    """The mean gap between tokens of the records whose every token came in a text chunk of its own (their gaps
    between text chunks are gaps between tokens: `text_per_token`), None without one."""
    gaps = [g for r in records if text_per_token(r) for g in r.get("itl_s") or ()]
    return float(np.mean(gaps)) if gaps else None


def _gap_spread(gap_lists) -> Optional[float]:
    """The median over requests (with 3 gaps or more) of their gaps' coefficient of variation."""
    cvs = [float(np.std(gaps) / np.mean(gaps)) for gaps in gap_lists if len(gaps) >= 3 and np.mean(gaps) > 0]
    return float(np.median(cvs)) if cvs else None


def fit_jitter(levels: Mapping[int, list[list[dict]]], timing: TimingModel, decode: DecodeCost, max_running: int,
               tier: Optional[str], prefill_budget: Optional[int] = None) -> Optional[float]:
    """The machine's step noise (EngineModel.jitter): how much more a request's gaps between tokens
    spread in the run than in the simulation without noise, whose spread is the schedule's own (a
    decode step that also runs another request's prefill chunk is longer). With m and s the median
    per-request coefficients of variation, measured and simulated, over every level's requests::

        jitter = √max(0, m² − s²)

    (independent noise adds in variance; a lognormal factor's CV is about its log's σ when small)."""
    measured = _gap_spread([r.get("itl_s") or () for runs in levels.values() for records in runs for r in records
                            if text_per_token(r)])
    engine = EngineModel(timing, decode, max_running, prefill_budget=prefill_budget)
    simulated = _gap_spread([r.itl_s for level, runs in levels.items() for r in _simulated(runs, level, engine, tier)])
    if measured is None or simulated is None:
        return None
    return float(np.sqrt(max(0.0, measured ** 2 - simulated ** 2)))


# --------------------------------------------------------------------------- the whole run


def _ttft_constants(store: RunStore, kv_bytes_per_token: Optional[int], host_gbps: float, block_size: int,
                    notes: list[str]) -> tuple[Optional[RecomputeCurve], Optional[float], dict, dict, Optional[float]]:
    """(curve, fixed overhead, tier efficiency, tier overhead, disk GB/s the loads were taken at) from G2."""
    efficiency, overhead = {}, {}
    cold = store.latest_figure("g2", "cold_read_vs_storage_best")
    disk_gbps = None
    if cold is not None and cold.get("value"):
        efficiency["disk"] = float(cold["value"])
        disk_gbps = (cold.get("context") or {}).get("tier_gbps")
    if disk_gbps is None:
        g1 = store.latest_figure("g1", "storage_best_read_gbps") or store.latest_figure("g1", "seq_read_gbps")
        disk_gbps = float(g1["value"]) if g1 is not None and g1.get("value") else None
    share = store.latest_figure("g2", "cached_fraction_min")
    if share is not None and share.get("value") is not None and share["value"] < 1.0:
        notes.append(
            f"G2's hits reused {format_percent(share['value'], 0)} of the blocks at least, not every one: the fit "
            "takes every whole block as cached"
        )
    rows = _g2_rows(store)
    recompute = [(c - G2_PROMPT_SHORTFALL, s) for mode, c, s in rows if mode == "recompute"]
    contexts = len({n for n, _ in recompute})
    if contexts >= 2 and any(mode != "recompute" for mode, _, _ in rows):
        curve, fixed, disk_overhead = fit_g2_ttfts(rows, kv_bytes_per_token, host_gbps, disk_gbps, block_size)
        if disk_overhead is not None:
            overhead["disk"] = disk_overhead
        return curve, fixed, efficiency, overhead, disk_gbps
    if contexts >= 3:
        # with no hits to set it, the fixed cost is the intercept of G2's lengths alone (a few thousand tokens
        # apart: least squares put it at 0 for a live vLLM, its hits predicted at 3 ms against 81): the same
        # server's prefill probe, when the run has one, adds its short prompts
        probed = prefill_points(store.machine_probe())
        curve = RecomputeCurve.fit(recompute + probed)
        if probed:
            curve = replace(curve, source=f"{curve.source}: G2's {len(recompute)} and the prefill probe's "
                                          f"{len(probed)}")
        return curve, curve.a, efficiency, overhead, disk_gbps
    if not rows:
        notes.append(f"{MISSING_NOTE['curve']} this run has no G2 TTFTs (G2 did not run, or measured none)")
    else:
        notes.append(
            f"{MISSING_NOTE['curve']} G2 recorded recompute TTFTs at fewer than 3 context lengths (2 with hits)"
        )
    return None, None, efficiency, overhead, disk_gbps


def _storage_constants(store: RunStore) -> tuple[dict, Optional[float], Optional[float]]:
    """(loader efficiencies, checkpoint efficiency, service start seconds) from G2's model load and checkpoint."""
    loaders = {}
    for m in store.figures("g2"):
        if m["metric"] == "model_load_loader" and m.get("value"):
            loaders[(m.get("context") or {}).get("loader", "?")] = float(m["value"])
    checkpoint = store.latest_figure("g2", "checkpoint_write_vs_storage_best")
    starts = [m["value"] - m["context"]["weights"]["seconds"] for m in store.figures("g2")
              if m["metric"] == "service_load" and m.get("value") is not None
              and ((m.get("context") or {}).get("weights") or {}).get("seconds") is not None]
    return (loaders, float(checkpoint["value"]) if checkpoint and checkpoint.get("value") else None,
            statistics.median(starts) if starts else None)


def calibrate(run_dir: Path, kv_bytes_per_token: Optional[int] = None, host_gbps: Optional[float] = None,
              block_size: int = 256) -> Calibration:
    """Fit every constant the run's recorded G2 and G3 data allow (the module's fits); notes say what
    could not be fitted and why. `kv_bytes_per_token` (the model's KV layout) is read from G2's
    cold-read rounds when not given; `host_gbps` is the host tier's copy bandwidth the hits' loads
    are taken at: when not given, the run's machine probe's host copy (machine_probe.json), else
    timing.DEFAULT_HOST_GBPS (then not recorded as measured)."""
    store = RunStore(Path(run_dir))
    if not (store.root / "run.json").exists() and not (store.root / "gates").is_dir():
        raise ConfigError(f"run_dir: expected a run directory (run.json, gates/), found neither in {run_dir}")
    config_path = store.root / "config.yaml"
    config = (load_yaml_file(config_path, "run config") or {}) if config_path.exists() else {}
    notes: list[str] = []
    measured_host = host_gbps or store.machine_probe().get("host_copy_gbps")
    host_gbps = measured_host or DEFAULT_HOST_GBPS
    if kv_bytes_per_token is None:
        kv_bytes_per_token = _kv_bytes_from_cold_reads(store, config, block_size)
        if kv_bytes_per_token is None:
            notes.append("KV bytes per token unknown (no cold-read rounds): hit rows fitted without their loads")
    curve, fixed, efficiency, overhead, disk_gbps = _ttft_constants(store, kv_bytes_per_token, host_gbps,
                                                                    block_size, notes)
    steps: dict[str, tuple[Optional[DecodeCost], Optional[float]]] = {}
    if curve is None or kv_bytes_per_token is None:
        notes.append(
            f"{MISSING_NOTE['decode']} fitting it replays G3's requests, which needs the recompute curve and the "
            "KV bytes per token"
        )
    else:
        timing = TimingModel(curve, TierBandwidths(host_gbps=host_gbps, disk_gbps=disk_gbps, overhead_s=overhead),
                             kv_bytes_per_token, block_size, fixed)
        steps = {target: _target_steps(store, config, timing, target) for target in _TARGET_TIER}
        if steps["candidate"][0] is None:
            notes.append(f"{MISSING_NOTE['decode']} no G3 records of the candidate with gaps between tokens")
    decode, jitter = steps.get("candidate", (None, None))
    baseline_decode, baseline_jitter = steps.get("baseline", (None, None))
    loaders, checkpoint, service_start = _storage_constants(store)
    damaged = left_out_note(store)
    if damaged:
        notes.append(damaged)
    return Calibration(curve, fixed, efficiency, overhead, decode, jitter, loaders, checkpoint, service_start,
                       kv_bytes_per_token, str(store.root), tuple(notes), measured_host,
                       baseline_decode=baseline_decode, baseline_jitter=baseline_jitter).readable()


def _target_steps(store: RunStore, config: dict, timing: TimingModel, target: str
                  ) -> tuple[Optional[DecodeCost], Optional[float]]:
    """(decode cost, step noise) fitted to one G3 target's gaps between tokens (None, None: it has none): each target
    its own, as a step's costs beyond its prefill chunk differ between them (loads and stores on the candidate,
    prefill chunks beside the decodes on the baseline)."""
    targets = config.get("targets") or {}
    engine = targets.get("embedded") or {}
    levels = _g3_levels(store, target, float((config.get("g3") or {}).get("warmup_s", 0.0)))
    max_running, tier = int(engine.get("max_running", 8)), _TARGET_TIER[target]
    budget = prefill_budget(targets.get("kind", "embedded") != "embedded",
                            ((config.get("sizing") or {}).get("target") or {}).get("prefill_budget"))
    decode = fit_decode(levels, timing, max_running, tier, budget)
    return (None, None) if decode is None else (decode, fit_jitter(levels, timing, decode, max_running, tier, budget))
