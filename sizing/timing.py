"""Seconds the sizing model predicts: a prompt's prefill, a request's TTFT with part of its prompt cached
in some tier, G2's figures, and model-load and checkpoint times.

How it works: docs/methods/sizing-model.md (sizing/timing.py).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np

from kvcore.rundata import RunStore
from kvcore.settings import ConfigError

TIERS = ("device", "host", "disk", "remote")
# Memcpy-like defaults for the two memory tiers (one copy thread on a server CPU moves ~10 GB/s; a
# device-to-device copy far more); `kvgate cache-bench` measures this machine's, config overrides.
DEFAULT_DEVICE_GBPS = 50.0
DEFAULT_HOST_GBPS = 10.0
# gates/g2_baseline/test_g2_baseline.py asks for a context of n tokens with a text of n − 8 bytes,
# which the chat template frames with 4 tokens: its prompts are n − 4 tokens long.
G2_PROMPT_SHORTFALL = 4


def nonnegative_least_squares(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    """x ≥ 0 minimising |design·x − target|², exactly, for the few columns used here.

    The optimum is the unconstrained least-squares solution on its own support, so every subset of
    columns is solved (2^k of them, k ≤ 5 here) and the best one whose coefficients are all ≥ 0
    kept. Columns are scaled to unit norm first (n² is ~10⁸ times n), which changes nothing else.
    """
    design, target = np.asarray(design, dtype=float), np.asarray(target, dtype=float)
    norms = np.linalg.norm(design, axis=0)
    norms[norms == 0] = 1.0
    scaled = design / norms
    best, best_residual = np.zeros(design.shape[1]), float(np.sum(target ** 2))
    for size in range(1, design.shape[1] + 1):
        for support in itertools.combinations(range(design.shape[1]), size):
            columns = list(support)
            solution, *_ = np.linalg.lstsq(scaled[:, columns], target, rcond=None)
            if np.any(solution < 0):
                continue
            residual = float(np.sum((scaled[:, columns] @ solution - target) ** 2))
            if residual < best_residual - 1e-15 * max(1.0, best_residual):
                best_residual, best = residual, np.zeros(design.shape[1])
                best[columns] = solution
    return best / norms


def check_number(name: str, value: float, allow_zero: bool = False) -> float:
    """`value` as a float when it is a finite number > 0 (≥ 0 with allow_zero), else a ConfigError naming `name`."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and (
        value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ConfigError(f"{name}: expected a finite number {'>= 0' if allow_zero else '> 0'}, found {value!r}")
    return float(value)


def check_tokens(name: str, value: int, minimum: int = 0) -> int:
    """`value` when it is an integer ≥ `minimum` (a token count), else a ConfigError naming `name`."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name}: expected an integer >= {minimum}, found {value!r}")
    return int(value)


@dataclass(frozen=True)
class RecomputeCurve:
    """Prefill seconds of a prompt computed from scratch: `a + b·n + c·n²` (n tokens)."""

    a: float                    # s, per request
    b: float                    # s per token
    c: float                    # s per token²
    source: str = ""            # where the coefficients came from

    def seconds(self, tokens: float) -> float:
        """Recompute TTFT of a prompt of `tokens` tokens (the intercept included)."""
        return self.a + self.compute(tokens)

    def compute(self, tokens: float) -> float:
        """The token-dependent part, b·n + c·n²: what a cached prefix saves is compute(h)."""
        return self.b * tokens + self.c * tokens * tokens

    def tail(self, prompt: int, cached: int) -> float:
        """Compute of the uncached tail of a prompt, attention over the cached part included; a full
        hit's one-token pass when nothing is left."""
        if cached >= prompt:
            return self.compute(prompt) - self.compute(prompt - 1)
        return self.compute(prompt) - self.compute(cached)

    @classmethod
    def fit(cls, points: Iterable[tuple[int, float]]) -> "RecomputeCurve":
        """Least squares, coefficients ≥ 0, over (prompt tokens, recompute seconds) points, in relative
        terms (each point weighted by 1/seconds: a 5 ms miss at 1k tokens counts like 50 ms at 8k)."""
        rows = [(check_tokens(f"recompute points[{i}].tokens", n, 1), check_number(f"recompute points[{i}].seconds", s))
                for i, (n, s) in enumerate(points)]
        distinct = sorted({n for n, _ in rows})
        if len(distinct) < 3:
            raise ConfigError(f"recompute points: expected at least 3 distinct context lengths (a + b·n + c·n² "
                              f"has three coefficients), found {len(distinct)} ({distinct})")
        n = np.array([r[0] for r in rows], dtype=float)
        y = np.array([r[1] for r in rows])
        design = np.column_stack([np.ones_like(n), n, n * n]) / y[:, None]
        a, b, c = nonnegative_least_squares(design, np.ones_like(y))
        return cls(float(a), float(b), float(c), f"fit of {len(rows)} recompute TTFTs at {distinct} tokens")

    @classmethod
    def roofline(cls, params: float, layers: int, dim: int, device_flops: float,
                 overhead_s: float = 0.0, attention_flops: Optional[float] = None,
                 chunk_tokens: int = 0) -> "RecomputeCurve":
        """FLOPs of a prefill of n tokens ÷ the device's achievable FLOP/s.

        FLOPs = 2·params·n + 2·layers·n²·dim. The first term: each parameter takes part in one
        multiply-add (2 FLOPs) per token (Kaplan et al. 2020, "Scaling Laws for Neural Language
        Models", Table 1: C_forward ≈ 2N per token). The second: per layer a token at position i
        computes its query against i keys (2·i·dim FLOPs) and mixes i values (2·i·dim); over the
        n(n+1)/2 causal pairs that is ≈ 2·n²·dim (Kaplan's 2·n_layer·n_ctx·d_attn per token, with n_ctx
        = n). `dim` is n_heads × head_dim (GQA shares keys, not the FLOPs); `device_flops` the
        achievable rate (peak × a utilisation), not the peak. `attention_flops`: the attention's own
        rate when it differs (default `device_flops`). `chunk_tokens`: an engine that prefills in chunks
        of T tokens, each masked against every key up to its end (kvgate's), computes n(n+T)/2 pairs,
        adding 2·layers·dim·T·n attention FLOPs to the linear term.
        """
        flops = check_number("device_flops", device_flops)
        attention = flops if attention_flops is None else check_number("attention_flops", attention_flops)
        attention_per_pair = 2.0 * check_tokens("layers", layers, 1) * check_tokens("dim", dim, 1) / attention
        per_token = (2.0 * check_number("params", params) / flops
                     + attention_per_pair * check_tokens("chunk_tokens", chunk_tokens))
        rates = f"{flops:.3g} FLOP/s" + ("" if attention_flops is None else f", attention {attention:.3g} FLOP/s")
        chunks = f", {chunk_tokens}-token chunks" if chunk_tokens else ""
        return cls(check_number("overhead_s", overhead_s, allow_zero=True), per_token, attention_per_pair,
                   f"roofline: {params:.3g} params, {layers} layers, dim {dim}{chunks}, {rates}")


@dataclass(frozen=True)
class TierBandwidths:
    """Each tier's read GB/s (raw), the share of it a cache load reaches (efficiency, default 1), and
    what a hit from it costs beyond its bytes (overhead seconds, default 0)."""

    device_gbps: float = DEFAULT_DEVICE_GBPS
    host_gbps: float = DEFAULT_HOST_GBPS
    disk_gbps: Optional[float] = None           # G1's fio seq_read_gbps, else the spec sheet
    remote_gbps: Optional[float] = None         # from config
    efficiency: Mapping[str, float] = field(default_factory=dict)
    overhead_s: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for tier in TIERS:
            raw = getattr(self, f"{tier}_gbps")
            if raw is not None:
                check_number(f"tiers.{tier}_gbps", raw)
        for name, values in (("efficiency", self.efficiency), ("overhead_s", self.overhead_s)):
            for tier, value in values.items():
                if tier not in TIERS:
                    raise ConfigError(f"tiers.{name}: expected tiers among {list(TIERS)}, found {tier!r}")
                check_number(f"tiers.{name}.{tier}", value, allow_zero=name == "overhead_s")

    def effective_gbps(self, tier: str) -> float:
        """The GB/s a load from the tier reaches: raw × efficiency."""
        if tier not in TIERS:
            raise ConfigError(f"cached tier: expected one of {list(TIERS)}, found {tier!r}")
        raw = getattr(self, f"{tier}_gbps")
        if raw is None:
            raise ConfigError(f"tiers.{tier}_gbps: expected the {tier} tier's read GB/s (a hit comes from it), "
                              f"found none")
        return raw * self.efficiency.get(tier, 1.0)

    def load_seconds(self, tier: str, nbytes: float) -> float:
        """Seconds to load `nbytes` from the tier (0 when nothing is loaded from it)."""
        if nbytes <= 0:
            return 0.0
        return self.overhead_s.get(tier, 0.0) + nbytes / (self.effective_gbps(tier) * 1e9)

    @staticmethod
    def disk_source(store: Optional[RunStore]) -> str:
        """Where `from_run` takes the disk's GB/s from."""
        if store is not None and (store.latest_figure("g1", "storage_best_read_gbps") or {}).get("value"):
            return "G1's storage sweep (the storage's best read)"
        if store is not None and (store.latest_figure("g1", "seq_read_gbps") or {}).get("value"):
            return "G1's fio sequential read"
        return "the spec sheet (g1 seq_read_gbps threshold)"

    @classmethod
    def from_run(cls, store: RunStore, **settings) -> "TierBandwidths":
        """The disk tier's raw GB/s from G1's storage sweep (the storage's best read, what G2's cold-read ratio
        divides by) when the run has it, else G1's fio sequential read, else `disk_gbps`."""
        g1 = store.latest_figure("g1", "storage_best_read_gbps") or store.latest_figure("g1", "seq_read_gbps")
        if g1 is not None and g1.get("value"):
            settings["disk_gbps"] = float(g1["value"])
        return cls(**settings)


@dataclass(frozen=True)
class TimingModel:
    """TTFT of one request from its prompt, its cached tokens per tier and the costs (the module's formula)."""

    curve: RecomputeCurve
    tiers: TierBandwidths
    kv_bytes_per_token: int
    block_size: int = 256
    fixed_overhead_s: Optional[float] = None    # default: the curve's intercept

    @property
    def overhead(self) -> float:
        return self.curve.a if self.fixed_overhead_s is None else self.fixed_overhead_s

    def checked(self, prompt: int, cached: Mapping[str, int]) -> int:
        """The cached total; ConfigError when a count is not a token count or exceeds the prompt."""
        check_tokens("prompt_tokens", prompt, 1)
        for tier, tokens in cached.items():
            if tier not in TIERS:
                raise ConfigError(f"cached: expected tiers among {list(TIERS)}, found {tier!r}")
            check_tokens(f"cached.{tier}", tokens)
        total = sum(cached.values())
        if total > prompt:
            raise ConfigError(f"cached: expected at most the prompt's {prompt} tokens in all, found {total}")
        return total

    def load_seconds(self, cached: Mapping[str, int]) -> float:
        return sum(self.tiers.load_seconds(tier, tokens * self.kv_bytes_per_token) for tier, tokens in cached.items())

    def ttft(self, prompt: int, cached: Mapping[str, int] | None = None) -> float:
        return sum(self.terms(prompt, cached).values())

    def terms(self, prompt: int, cached: Mapping[str, int] | None = None) -> dict[str, float]:
        """The TTFT's seconds term by term ({"fixed", "per-token", "attention", "load <tier>"...}, summing to
        `ttft`): the fixed overhead, the uncached tail's linear work and its attention (its b and c parts), and
        each tier's load."""
        cached = dict(cached or {})
        total = self.checked(prompt, cached)
        start = prompt - 1 if total >= prompt else total      # a full hit computes its last token's pass
        terms = {"fixed": self.overhead, "per-token": self.curve.b * (prompt - start),
                 "attention": self.curve.c * (prompt * prompt - start * start)}
        for tier, tokens in cached.items():
            if tokens:
                terms[f"load {tier}"] = self.tiers.load_seconds(tier, tokens * self.kv_bytes_per_token)
        return terms


@dataclass(frozen=True)
class G2Prediction:
    """G2 at one context length: recompute, a host hit and a cold disk hit of every whole block (None when
    the disk's GB/s is not known)."""

    context_tokens: int
    prompt_tokens: int
    cached_tokens: int
    recompute_s: float
    host_hit_s: float
    disk_hit_s: Optional[float]

    @property
    def disk_hit_vs_recompute(self) -> Optional[float]:
        return None if self.disk_hit_s is None else self.disk_hit_s / self.recompute_s


def predict_g2(model: TimingModel, contexts: Sequence[int],
               prompt_shortfall: int = G2_PROMPT_SHORTFALL) -> list[G2Prediction]:
    """G2's TTFTs per context, the way its suite measures them: a prompt of context − shortfall tokens,
    every whole block of it cached (the suite's hits reuse all of them), from host or from disk.
    G2's judged ratio is the last one's (the longest context) `disk_hit_vs_recompute`; its cold-read
    ratio is predicted by `cold_read_vs_storage_best`."""
    predictions = []
    for i, context in enumerate(sorted(contexts)):
        prompt = check_tokens(f"g2.contexts[{i}]", context, prompt_shortfall + 1) - prompt_shortfall
        cached = prompt // model.block_size * model.block_size
        disk = model.ttft(prompt, {"disk": cached}) if model.tiers.disk_gbps is not None else None
        predictions.append(G2Prediction(context, prompt, cached, model.ttft(prompt),
                                        model.ttft(prompt, {"host": cached}), disk))
    return predictions


def cold_read_vs_storage_best(tiers: TierBandwidths) -> float:
    """G2's cold-read ratio: the disk tier's bytes over its read seconds, ÷ the storage's best read job's GB/s.
    Bytes over read time is bandwidth alone, so this is the disk tier's efficiency (the hit overhead
    lies outside the reads the check times)."""
    return tiers.efficiency.get("disk", 1.0)


def transfer_seconds(nbytes: float, gbps: float, efficiency: float = 1.0) -> float:
    """bytes ÷ (GB/s · 10⁹ · efficiency): efficiency is the share of the storage's fio figure the
    reader or writer reaches (1: it reaches fio)."""
    return check_number("bytes", nbytes, allow_zero=True) / (check_number("gbps", gbps) * 1e9
                                                         * check_number("efficiency", efficiency))


def model_load_seconds(nbytes: float, read_gbps: float, loader_efficiency: float = 1.0,
                       service_start_s: float = 0.0) -> float:
    """Seconds to load a model's weights of `nbytes` from storage reading at `read_gbps` (fio's sequential
    read), with the loader's measured share of fio (G2's `model_load_loader`: loader GB/s / fio's, side
    by side), plus, for a service start, what it does besides reading the weights (imports, building
    the model, warming up: G2's `service_load` minus its weights seconds). 0 for a bare load."""
    return check_number("service_start_s", service_start_s, allow_zero=True) + transfer_seconds(
        nbytes, read_gbps, loader_efficiency)


def checkpoint_seconds(nbytes: float, write_gbps: float, efficiency: float = 1.0) -> float:
    """Seconds to save a checkpoint of `nbytes` to storage writing at `write_gbps` (fio's sequential write),
    with the saver's measured share of fio (G2's `checkpoint_write_vs_storage_best`, side by side).

    The efficiency is a share of the fio job it was measured beside, so `write_gbps` must be that
    job's figure: G2's checkpoint compares with the storage's best fsync'd write job (G1's sweep), run
    again beside each save; its figure there (`fio_gbps`), not G1's matrix, is the one to scale."""
    return transfer_seconds(nbytes, write_gbps, efficiency)
