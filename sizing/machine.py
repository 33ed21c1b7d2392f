"""The engine predicted before any G2 has measured it, from the run's probes (gates/machine_probe.py, recorded in
the run as machine_probe.json), standing in where a calibration's constants would go: kvgate's own engine from the
machine probe and its servers' probes; an external engine from its servers' probes alone::

How it works: docs/methods/sizing-model.md (sizing/machine.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from kvcore.rundata import RunStore

from .calibration import Calibration, fit_decode, fit_fixed_overhead, fit_g2_ttfts, fit_stall, prefill_points
from .queueing import DecodeCost
from .timing import RecomputeCurve, TierBandwidths, TimingModel

SOURCE = "the pre-flight's machine probe"
PROBES_SOURCE = "this run's probes of the machine and its servers"
SERVER_PROBES_SOURCE = "this run's probes of its servers"
PREFILL_SOURCE = "the prefill probe"
HITS_SOURCE = "the prefill and hit probes"
DECODE_SOURCE = "the decode probe before G3"
LOAD_SOURCE = "the load probe before G3"
PROBE_SOURCES = (PROBES_SOURCE, SERVER_PROBES_SOURCE)   # a decode cost from these is refitted under load


def probe_line(probe: dict) -> str:
    """The probes' figures in one line (or why there are none): the machine's, the servers', the decode's, the
    load's."""
    if "error" in probe:
        return machine_words(probe)
    return (f"{machine_words(probe)}; {server_probe_words(probe)}"
            + (f"; {decode_words(probe['server_decode'])}" if "server_decode" in probe else "")
            + "".join(f"; {load_words(load)}" for load in server_loads(probe).values()))


def machine_words(probe: dict) -> str:
    """The pre-flight's machine probe in words (or why there is none)."""
    if "error" in probe:
        return f"machine probe: none ({probe['error']}): the sizing model waits for G2's measurements"
    if not machine_ran(probe):
        return "machine probe: none (external targets: their model is not the one the probe times)"
    decode = probe["decode"]
    return (f"machine probe ({probe['device']}, {probe['dtype']}, the {probe['preset']} preset's shapes, "
            f"{probe['threads']} threads): matmul {probe['matmul_flops'] / 1e9:.1f} GFLOP/s, attention "
            f"{probe['attention_flops'] / 1e9:.1f} GFLOP/s, decode {decode['step_s'] * 1e3:.2f} ms + "
            f"{decode['per_sequence_s'] * 1e3:.2f} ms per sequence, host copy {probe['host_copy_gbps']:.2f} GB/s "
            f"({probe['seconds']:.1f} s)")


def server_probe_words(probe: dict) -> str:
    """The prefill and hit probes in words (or why there are none)."""
    return (f"{_prefill_words(probe.get('prefill'))}; "
            f"{_probe_words('hit', probe.get('hits'), ' (no tiered server)', _hit_words)}")


def decode_words(decode: Optional[dict]) -> str:
    """The decode probe's figures in words (or why there are none)."""
    return _probe_words("decode", decode, "", lambda d: (
        f"the {d['role']} server's gaps between tokens at {d['context_tokens']:,} tokens: {d['batch_1_s'] * 1e3:.2f} "
        f"ms with one sequence, {d['batch_max_s'] * 1e3:.2f} ms with {d['max_batch']} ({d['seconds']:.1f} s)"))


def _prefill_words(prefill: Optional[dict]) -> str:
    return _probe_words("prefill", prefill, " (no recompute server)", lambda p: (
        f"the {p['role']} server's first token: "
        + ", ".join(f"{q['prompt_tokens']:,} tokens {q['seconds'] * 1e3:.0f} ms" for q in p["points"])
        + f" ({p['seconds']:.1f} s)"))


def _probe_words(name: str, figures: Optional[dict], absent: str, words) -> str:
    """A server probe's figures in words, or why there are none (`absent` when it did not run; or its error)."""
    if not figures:
        return f"no {name} probe{absent}"
    if "error" in figures:
        return f"no {name} probe ({figures['error']})"
    return words(figures)


def prefill_fit(probe: dict) -> Optional[RecomputeCurve]:
    """The recompute curve fitted to the prefill probe's first tokens, None when it has under 3 lengths."""
    points = prefill_points(probe)
    if len({n for n, _ in points}) < 3:
        return None
    fit = RecomputeCurve.fit(points)
    return RecomputeCurve(fit.a, fit.b, fit.c, f"{PREFILL_SOURCE}: {fit.source}")


def server_decode(probe: dict) -> tuple[Optional[DecodeCost], str]:
    """The decode cost through the decode probe's two medians and its words; None (and why) when it did not run."""
    server = probe.get("server_decode") or {}
    if "step_s" not in server:
        return None, "no decode probe of the server (it runs just before G3)"
    decode = DecodeCost(server["step_s"], server["per_sequence_s"])
    return decode, (f"decode from {DECODE_SOURCE}: {decode.step_s * 1e3:.2f} ms a step + "
                    f"{decode.per_sequence_s * 1e3:.2f} ms a sequence")


def roofline_curve(probe: dict) -> RecomputeCurve:
    """The model's FLOPs over the probed FLOP/s, the prefill probe's shortest request as its intercept."""
    points = prefill_points(probe)
    overhead = min(points)[1] if points else 0.0
    curve = RecomputeCurve.roofline(probe["matmul_params"], probe["layers"], probe["attention_dim"],
                                    probe["matmul_flops"], overhead, attention_flops=probe["attention_flops"],
                                    chunk_tokens=probe["chunk_tokens"])
    return RecomputeCurve(curve.a, curve.b, curve.c, f"{SOURCE}: {curve.source}")


def probe_curve(probe: dict) -> tuple[RecomputeCurve, str]:
    """The recompute curve fitted to the prefill probe (the roofline when it has under 3 lengths), and a note
    setting the roofline beside the fit at the longest length probed."""
    roofline, fit = roofline_curve(probe), prefill_fit(probe)
    if fit is None:
        return roofline, f"recompute from the model's FLOPs alone ({roofline.source}): no prefill probe to fit"
    longest = max(n for n, _ in prefill_points(probe))
    return fit, (f"recompute from {fit.source}; the model's FLOPs alone ({roofline.source}) give "
                 f"{roofline.seconds(longest) * 1e3:.0f} ms of its {fit.seconds(longest) * 1e3:.0f} ms at "
                 f"{longest:,} tokens: the rest is the engine's work beyond its matmuls")


def probe_decode(probe: dict) -> tuple[DecodeCost, str]:
    """The decode cost through the decode probe's two medians (the in-process pass when it did not run), and a
    note setting the in-process pass beside it."""
    model = DecodeCost(probe["decode"]["step_s"], probe["decode"]["per_sequence_s"])
    decode, words = server_decode(probe)
    if decode is None:
        return model, f"decode from the model's decode pass alone ({SOURCE}): {words}"
    batch = probe["server_decode"]["max_batch"]
    return decode, (f"{words}; the model's decode pass alone gives {model.seconds(batch) * 1e3:.2f} ms of its "
                    f"{decode.seconds(batch) * 1e3:.2f} ms at a batch of {batch}: the rest is the server's work per "
                    "step (sampling, streaming, the step loop)")


def load_words(load: Optional[dict]) -> str:
    """The load probe's figures in words (or why there are none)."""
    return _probe_words("load", load, "", lambda d: (
        f"the {d['role']} server under load: " + ", ".join(
            f"{len(records)} requests at {level} users, gaps {_mean_ms(records)} ms" for level, records in
            d["levels"].items()) + f" ({d['prompts']} {'' if d.get('returns', True) else 'new '}prompts of "
        f"{d['context_tokens']:,} tokens, "
        f"{d['output_tokens']} tokens out, {d['seconds']:.1f} s)"))


def _mean_ms(records: list[dict]) -> str:
    gaps = [g for r in records for g in r["itl_s"]]
    return f"{sum(gaps) / len(gaps) * 1e3:.1f}" if gaps else "none"


def server_loads(probe: dict) -> dict[str, dict]:
    """The load probe's records per target ({"candidate": …, "baseline": …}; a run recorded before the baseline was
    probed holds the candidate's alone), {} when it did not run."""
    load = probe.get("server_load") or {}
    return {load["role"]: load} if "role" in load else dict(load)


@dataclass(frozen=True)
class UnderLoad:
    """A target's costs fitted to its load probe: its decode step, and a request's fixed seconds (the candidate's:
    None where not fitted, the TTFT model's own standing)."""

    decode: DecodeCost
    fixed_overhead_s: Optional[float] = None
    stall_s: float = 0.0        # what the server's stalls cost a request on average (EngineModel.stall_s)

    def timing(self, timing: TimingModel) -> TimingModel:
        """`timing` with these fixed seconds, where fitted."""
        return timing if self.fixed_overhead_s is None else replace(timing, fixed_overhead_s=self.fixed_overhead_s)


def load_costs(probe: dict, timing: TimingModel, max_running: int, returns_from: str = "device",
               decodes: Optional[dict[str, DecodeCost]] = None, prefill_budget: Optional[int] = None
               ) -> tuple[dict[str, UnderLoad], list[str]]:
    """Each target's G3 costs fitted to its load probe (the words for each, or why there are none); with `decodes`
    (the calibration's own, from a G3), the fixed seconds alone, with those decode costs.

    The decode cost to its gaps between tokens (calibration.fit_decode, as a calibration fits G3's own): each level's
    closed loop simulated with `timing`'s prefill chunks for each request's tail and its loads, the candidate's
    returns from `returns_from` (the tier the probe's cycle outgrows the others to, as G3's simulation charges its
    hits' loads), the baseline's cached tokens resident, so a step costs what the probe's steps cost beyond what the
    simulation charges them (the candidate's blocks stored and promoted, the baseline's prompts computed beside its
    decodes, their answers sent). The candidate's returns also give a request's fixed seconds under load
    (calibration.fit_fixed_overhead, to their first tokens, the decode cost refitted with it), which G3's candidate
    is simulated with: G2 times each hit alone on a new connection after the caches were dropped, G3's returns come
    on kept connections, one after another."""
    loads, idle = server_loads(probe), server_decode(probe)[0]
    if not loads:
        return {}, ["G3's decode cost from the decode probe alone: no load probe ran"]
    found, words = {}, []
    for role, load in loads.items():
        levels = {int(level): [records] for level, records in (load.get("levels") or {}).items() if records}
        tier = returns_from if role == "candidate" else "device"
        given = (decodes or {}).get(role)
        decode = given or (fit_decode(levels, timing, max_running, tier, prefill_budget) if levels else None)
        if decode is None:
            why = load.get("error") or "the load probe timed no gaps between tokens"
            words.append(f"the {role}'s G3 decode cost from the decode probe alone: {why}")
            continue
        fixed = (fit_fixed_overhead(levels, timing, decode, max_running, tier, prefill_budget)
                 if role == "candidate" else None)
        if fixed is not None and given is None:
            decode = fit_decode(levels, replace(timing, fixed_overhead_s=fixed), max_running, tier,
                                prefill_budget) or decode
        stall = (fit_stall(levels, replace(timing, fixed_overhead_s=fixed), decode, max_running, tier,
                           prefill_budget) or 0.0) if fixed is not None else 0.0
        found[role] = UnderLoad(decode, fixed, stall)
        under = "" if fixed is None else (f"a request's fixed cost {fixed * 1e3:.2f} ms under load (the TTFT model's "
                                          f"{timing.overhead * 1e3:.2f} ms, from idle requests; its first tokens' "
                                          f"trimmed mean), the server's stalls {stall * 1e3:.2f} ms a request (their "
                                          "mean beyond it)")
        if given is not None:
            if fixed is not None:
                words.append(f"the {role}'s G3 steps from {LOAD_SOURCE}: {under}")
            continue
        beside = "" if idle is None else f", the decode probe's {idle.seconds(max_running) * 1e3:.2f} ms"
        words.append(f"the {role}'s G3 decode cost from {LOAD_SOURCE}: {decode.step_s * 1e3:.2f} ms a step + "
                     f"{decode.per_sequence_s * 1e3:.2f} ms a sequence ({decode.seconds(max_running) * 1e3:.2f} ms "
                     f"at {max_running}{beside}, whose steps only decode)" + (f"; {under}" if under else ""))
    return found, words


def probe_ran(probe: dict) -> bool:
    """Whether a run's probes (machine_probe.json) ran and gave figures: neither absent nor failed (the machine's,
    or against external targets the servers' alone)."""
    return bool(probe) and "error" not in probe


def machine_ran(probe: dict) -> bool:
    """Whether the probes include the pre-flight's machine probe (embedded targets), not the servers' alone."""
    return probe_ran(probe) and "matmul_flops" in probe


def hit_points(probe: dict) -> list[tuple[str, int, float]]:
    """(mode, context tokens, median first-token seconds) of the hit probe's points served from their placed tier
    alone (a probe from before the check: every point), [] when it did not run."""
    hits = probe.get("hits") or {}
    return [(p["mode"], p["context_tokens"], p["seconds"]) for p in hits.get("points", [])
            if p.get("from_placed_tier", True)]


def probe_calibration(probe: dict, disk_gbps: Optional[float] = None) -> Optional[Calibration]:
    """The module's constants from the probes' figures (gates/machine_probe.py's `run_machine_probe` and
    `probe_servers`); None when the machine probe failed. With the hit probe's points (and `disk_gbps`, the
    storage's read its disk hits' loads are taken at, for the disk hit's overhead) the curve, the fixed cost and
    the disk hit's overhead are G2's joint fit (calibration.fit_g2_ttfts) of the prefill and hit probes' first
    tokens, at lengths other than G2's."""
    if not probe_ran(probe):
        return None
    if not machine_ran(probe):
        return server_calibration(probe)
    curve, note = probe_curve(probe)
    decode, decode_note = probe_decode(probe)
    fixed, overhead = None, {}
    hits, kv_bytes = hit_points(probe), probe.get("kv_bytes_per_token")
    if hits and kv_bytes and len({n for n, _ in prefill_points(probe)}) >= 3:
        rows = [("recompute", p["context_tokens"], p["seconds"]) for p in probe["prefill"]["points"]] + hits
        fit, fixed, disk_overhead = fit_g2_ttfts(rows, kv_bytes, probe["host_copy_gbps"], disk_gbps,
                                                 what="first tokens")
        curve = RecomputeCurve(fit.a, fit.b, fit.c, f"{HITS_SOURCE}: {fit.source}")
        if disk_overhead is not None:
            overhead["disk"] = disk_overhead
        note = (f"recompute, fixed cost{' and disk hit overhead' if overhead else ''} from {curve.source}"
                + ("" if overhead else " (no disk GB/s yet: disk hits left out)"))
    return Calibration(curve=curve, fixed_overhead_s=fixed, tier_overhead_s=overhead, decode=decode,
                       host_gbps=probe["host_copy_gbps"], source=PROBES_SOURCE,
                       notes=(probe_line(probe), note, decode_note))


def server_calibration(probe: dict) -> Optional[Calibration]:
    """The constants from the server probes alone (external targets: no machine probe of their model): the
    recompute curve fitted to the prefill probe, the decode cost through the decode probe's two medians once it
    has run; None when the prefill probe has under 3 lengths."""
    curve = prefill_fit(probe)
    if curve is None:
        return None
    decode, decode_note = server_decode(probe)
    return Calibration(curve=curve, decode=decode, source=SERVER_PROBES_SOURCE,
                       notes=(probe_line(probe), f"recompute from {curve.source}", decode_note))


def _hit_words(hits: dict) -> str:
    return (f"the {hits['role']} server's hits: "
            + ", ".join(f"{p['mode']} at {p['context_tokens']:,} tokens {p['seconds'] * 1e3:.1f} ms"
                        + ("" if p.get("from_placed_tier", True) else
                           f" (served by {', '.join(sorted(p['tiers']))}: left out of the fit)")
                        for p in hits["points"]) + f" ({hits['seconds']:.1f} s)")


def run_probe_calibration(store: RunStore) -> Optional[Calibration]:
    """`probe_calibration` of what a run recorded (None when it has no probe, as a run of an external engine), its
    disk hits' loads taken at G1's storage read when G1 has run."""
    return probe_calibration(store.machine_probe(), TierBandwidths.from_run(store).disk_gbps)
