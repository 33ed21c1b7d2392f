"""Concurrency sweeps: what a sweep is (its settings and steps), and a step's summary from raw records.

How it works: docs/methods/side-by-side.md (workloads/loadgen/sweep.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from kvcore.files import read_jsonl
from kvcore.percent import format_percent
from kvcore.rundata import read_records
from workloads.loadgen.live import LiveStep, format_ms
from workloads.loadgen.load import run_load
from workloads.loadgen.steady import SteadyRule, order_segment
from workloads.probes.tier_hits import tier_line
from workloads.traffic.errors import StopRule, describe_errors, summarize_errors
from workloads.traffic.requests import Workload, of_pass
from workloads.traffic.target import Target

PERCENTILES = (50, 90, 99)
# the share of a step's requests that may come in fewer text chunks than tokens (ITL stands) or whose counts of
# tokens disagree, client's and server's (the step stands): a server may do either now and then
TOLERATED_SHARE = 0.05


RATE_USERS = 32     # users an open-loop step has to send its arrivals (each waits for its due time)


@dataclass
class SweepSettings:
    levels: tuple[int, ...] = (2, 4, 8)
    rates: tuple[float, ...] = ()          # requests (sessions) per second, open loop
    multipliers: tuple[float, ...] = ()    # a trace replayed open loop at m x its arrival rate
    rate_users: int = RATE_USERS           # users available to a rate step
    duration_s: float = 30.0
    warmup_s: float = 5.0
    min_duration_s: float = 10.0
    min_requests: int = 10
    workers: int = 0
    max_client_cpu_percent: float = 90.0
    max_loop_lag_s: float = 0.05
    max_error_share: float = 0.01          # a step whose measured requests failed more than this is invalid
    stop_rule: Optional[StopRule] = field(default_factory=StopRule)  # None: a step always runs to its end
    out_dir: Path = field(default_factory=lambda: Path("reports/runs/sweep"))
    on_step: Optional[Callable[[str], None]] = None   # told one line as each step starts and ends (progress)
    on_live: Optional[Callable[[LiveStep], None]] = None   # told the running step's figures so far
    live_every_s: float = 2.0
    # (target, concurrency) -> the sizing model's TTFT p50 (s), shown beside the live one
    predicted_ttft_p50_s: Mapping[tuple[str, float], float] = field(default_factory=dict)
    # read before and after each step: a target's hit blocks per tier so far (workloads.probes.tier_hits); the step's
    # difference is its row's `hit_blocks_by_tier` (None: not read)
    tier_hits: Optional[Callable[[Target], Optional[dict]]] = None
    send_once: bool = False                # a concurrency step sends each request at most once (never cycles)
    tier_unit: str = "blocks"              # what `tier_hits` counts (kvgate's servers: blocks; an adapter: tokens)
    # blocks (workloads.loadgen.blocks): a step runs as pairs of blocks of the two targets side by side, ABBA...
    min_blocks: int = 1                    # blocks per target per step, at least
    max_blocks: int = 1                    # at most (a trace step's part is cut into this many sub-parts)
    level_budget_s: Optional[float] = None  # seconds a step may take before no further pair starts (None: no limit)
    # told a workloads.loadgen.blocks.LevelSampling: takes the step's pairs, says how many and why it stopped
    # ({"pairs", "decided", "why"}); None: `min_blocks` pairs (workloads.loadgen.blocks.fixed_pairs)
    sample_level: Optional[Callable[[Any], dict]] = None
    # matched pairs (workloads.loadgen.steady): both blocks of a pair serve the same requests, each sent once, measured
    # from the first (no warm-up inside a block, no least duration); a block ends when its part is served, or
    # after matched_cap x duration_s (the requests one block did not finish are left out of both)
    matched: bool = False
    matched_cap: float = 3.0
    steady: Optional[SteadyRule] = None    # a level's warm-up pairs run until the candidate settles (None: none)
    block_tokens: Optional[int] = None     # the candidate engine's tokens per cache block (steady: its cached share)


def percentiles(values: list[float]) -> dict[int, Optional[float]]:
    if not values:
        return {p: None for p in PERCENTILES}
    found = np.percentile(np.asarray(values, dtype=float), PERCENTILES)
    return dict(zip(PERCENTILES, (float(v) for v in found)))


def read_client_samples(directory: Path) -> list[dict]:
    """The load processes' once-a-second CPU and event-loop lag samples."""
    return read_jsonl(directory, "client-*.jsonl")


def summarize_step(records: list[dict], samples: list[dict], step_start: float, step_end: float,
                   settings: SweepSettings, stopped: Optional[str] = None, unanswered: Sequence[dict] = ()) -> dict:
    """Figures and validity of one step from its raw records and client samples.

    `stopped`: why the step ended early (its target stopped answering), the first invalid reason.
    `unanswered`: the due requests with no record (`LoadRun.unanswered`); with the records they give the
    window's `due`, `sent` and `finished` counts (every due request counts: `unanswered_in_window`).
    """
    window_start = step_start + settings.warmup_s
    measured = [r for r in records if r["sent_at"] >= window_start]
    ok = [r for r in measured if r["ok"]]
    last_done = max((r["sent_at"] + r["e2e_s"] for r in ok), default=window_start)
    span = max(last_done - window_start, 1e-9)
    out_tokens = sum(r["completion_tokens"] or 0 for r in ok)
    summary = {"window_start": window_start, "requests": len(measured), "completed": len(ok), "window_s": span,
               "requests_per_s": len(ok) / span, "output_tokens_per_s": out_tokens / span,
               "error_rate": 1 - len(ok) / len(measured) if measured else None,
               **due_counts(measured, unanswered_in_window(unanswered, window_start))}
    summary.update(request_figures(ok))
    errors = summarize_errors(records)
    reasons = ([stopped] if stopped else []) + _error_share_reasons(measured, settings) \
        + _invalid_reasons(ok, samples, window_start, step_end, settings, last_done)
    if reasons and errors:
        reasons.append("errors: " + describe_errors(errors))
    summary.update(valid=not reasons, invalid_reasons="; ".join(reasons), errors_by_type=errors,
                   stopped_reason=stopped)
    return summary


def unanswered_in_window(unanswered: Sequence[dict], window_start: float) -> list[dict]:
    """The due requests without a record that belong to the measured window: sent in it (unfinished at the
    step's end), or never sent and due in it."""
    return [u for u in unanswered
            if (u["sent_at"] if u.get("sent_at") is not None else u["scheduled_at"]) >= window_start]


DUE_COUNTS = ("due", "sent", "finished", "not_sent", "unfinished")


def due_counts(measured: list[dict], unanswered: list[dict]) -> dict:
    """The window's requests due, sent and finished (answered, or failed with an answer), and the difference."""
    not_sent = sum(u.get("state") == "not_sent" for u in unanswered)
    return {"due": len(measured) + len(unanswered), "sent": len(measured) + len(unanswered) - not_sent,
            "finished": len(measured), "not_sent": not_sent, "unfinished": len(unanswered) - not_sent}


def _error_share_reasons(measured: list[dict], settings: SweepSettings) -> list[str]:
    """The step's failed share of its measured requests, when above `max_error_share` (its errors by type follow)."""
    failed = sum(not r["ok"] for r in measured)
    if not measured or failed <= settings.max_error_share * len(measured):
        return []
    return [f"{failed} of {len(measured)} measured requests failed ({format_percent(failed / len(measured))} > "
            f"{format_percent(settings.max_error_share, 4, trim=True)} allowed): not a measurement of the target"]


def request_figures(ok: list[dict]) -> dict:
    """Percentiles of TTFT, TPOT, E2E and ITL, and the hit ratio, from completed requests' raw records; ITL's are
    None when more than a few requests came in fewer text chunks than tokens (`itl_note` says so, else "")."""
    figures: dict[str, Any] = {}
    for metric in ("ttft_s", "tpot_s", "e2e_s"):
        for p, value in percentiles([r[metric] for r in ok if r[metric] is not None]).items():
            figures[f"{metric[:-2]}_p{p}_s"] = value
    fewer = sum(not text_per_token(r) for r in ok)
    figures["itl_note"] = "" if fewer <= TOLERATED_SHARE * len(ok) else (
        f"ITL not measured: {fewer} of {len(ok)} requests came in fewer text chunks than tokens (several tokens in "
        "a chunk, or tokens streamed without text; TTFT, TPOT and throughput count the server's tokens and stand)")
    for p, value in percentiles([gap for r in ok for gap in r["itl_s"]]).items():
        figures[f"itl_p{p}_s"] = None if figures["itl_note"] else value
    reported = [r for r in ok if r["cached_tokens"] is not None and r["prompt_tokens"]]
    figures["hit_ratio"] = (sum(r["cached_tokens"] for r in reported) / sum(r["prompt_tokens"] for r in reported)
                            if reported else None)
    return figures


def text_per_token(record: dict) -> bool:
    """Whether every token came in a text chunk of its own, so that the gaps between text chunks (ITL) are gaps
    between tokens. A server that streams a token whose bytes do not decode yet as an empty content (vLLM with
    kvgate's byte-level model: 0-10 text chunks of 16 tokens in most requests) sends fewer, its chunks still one a
    token (TTFT, TPOT and throughput stand); so does one that puts several tokens in one chunk, now and then (more
    often makes the step invalid: `_counts_disagree`). True for a record without chunk counts (a load probe's,
    which times every token chunk) or without the server's count of tokens."""
    if "content_chunks" not in record or not record.get("tokens_from_usage", True):
        return True
    return record["content_chunks"] >= (record.get("completion_tokens") or 0)


def _counts_disagree(record: dict) -> bool:
    """Fewer chunks carrying a token than the server's count of tokens, or more text chunks than it. A server that
    puts several tokens in one chunk (vLLM, now and then) and one whose count is too high (a miscount: its
    throughput would be too) send the same stream and the same count, so both make it disagree; a token streamed
    without text (bytes not yet decoded) is a chunk still, and a closing chunk with no token is no batching."""
    if not record["tokens_from_usage"]:
        return False
    tokens = record["completion_tokens"] or 0
    chunks = record.get("token_chunks", record["content_chunks"])
    return max(chunks, record["content_chunks"]) < tokens or record["content_chunks"] > tokens


def _invalid_reasons(ok: list[dict], samples: list[dict], start: float, end: float,
                     settings: SweepSettings, last_done: float) -> list[str]:
    reasons = []
    if end - start < settings.min_duration_s:
        reasons.append(f"measured {end - start:.1f} s < minimum {settings.min_duration_s:.0f} s")
    if len(ok) < settings.min_requests:
        reasons.append(f"{len(ok)} completed requests < minimum {settings.min_requests}")
    # a sample's lag is how late the loop woke at its `t`: it counts when that stall began before the last answer
    # (the load process's shutdown after it, ~50 ms of stopping its users on a busy VM, measured nothing)
    in_window = [s for s in samples if s["t"] >= start and s["t"] - s["loop_lag_s"] <= last_done]
    cpu = [s["cpu_percent"] for s in in_window]
    lag = [s["loop_lag_s"] for s in in_window]
    if cpu and np.percentile(cpu, 90) > settings.max_client_cpu_percent:
        reasons.append(
            f"client saturated: CPU p90 {np.percentile(cpu, 90):.0f}% > {settings.max_client_cpu_percent:.0f}%"
        )
    if lag and max(lag) > settings.max_loop_lag_s:
        reasons.append(
            f"client saturated: event-loop lag {max(lag) * 1e3:.0f} ms > {settings.max_loop_lag_s * 1e3:.0f} ms"
        )
    # The client's count of token chunks and the server's count of tokens: tolerate a few requests that disagree
    # (tokens streamed without text only leave ITL unmeasured: request_figures)
    disagree = sum(_counts_disagree(r) for r in ok)
    if ok and disagree > TOLERATED_SHARE * len(ok):
        reasons.append(f"client and server token counts disagree in {disagree} of {len(ok)} requests")
    unflagged = [r for r in ok if not r["tokens_from_usage"]]
    if unflagged:
        reasons.append(f"{len(unflagged)} requests without server usage (client counts used)")
    return reasons


def paced(workload: Workload, rate_per_s: float, duration_s: float, seed: int = 0) -> Workload:
    """Sessions starting as a Poisson process at `rate_per_s` (open loop), enough of them for `duration_s`.

    Sessions are reused in order (with new ids) when the workload has fewer than the run needs;
    later turns of a session follow its first one back to back.
    """
    rng = np.random.default_rng(seed)
    needed = max(1, int(rate_per_s * duration_s * 1.2) + 1)
    sessions, clock = [], 0.0
    for i in range(needed):
        clock += float(rng.exponential(1.0 / rate_per_s))
        source = workload.sessions[i % len(workload.sessions)]
        sessions.append(tuple(
            replace(r, request_id=f"{r.request_id}#{i}", session_id=f"{r.session_id}#{i}",
                    arrival_s=clock if r is source[0] else None)
            for r in source
        ))
    return Workload(f"{workload.name}@{rate_per_s:g}rps", tuple(sessions))


def primer(workload: Workload) -> Workload:
    """What priming sends: a trace's warm-up requests (never its measured ones), else every turn of every session
    once, in the workload's load order (interleaved: round by round), each its own one-request session so none is
    sent twice, whatever the users: every prefix a block sends is then a return."""
    if workload.trace:
        return Workload(f"{workload.name}:warm-up", workload.warmup)
    return replace(order_segment(workload, 0, len(workload.requests)), name=f"{workload.name}:every-turn")


def trace_parts(workload: Workload, parts: int) -> list[Workload]:
    """A trace's measured requests cut into `parts` consecutive parts of equal size (the remainder dropped)."""
    size = len(workload.sessions) // parts
    if size < 1:
        raise ValueError(f"a trace of {len(workload.sessions)} measured requests cannot give {parts} steps one each")
    return [replace(workload, name=f"{workload.name}[{i * size}:{(i + 1) * size}]",
                    sessions=workload.sessions[i * size:(i + 1) * size], warmup=()) for i in range(parts)]


def trace_segment(trace: Workload, start: int, count: int) -> Workload:
    """`count` of a trace's measured sessions from `start`, wrapping around it: a later pass's sessions are sent
    again under their ids with the pass added ("r12~1"), arriving one trace span (plus its mean gap) later."""
    sessions = trace.sessions
    if not sessions:
        raise ValueError("a trace with no measured requests has no segment")
    arrivals = [r.arrival_s for s in sessions for r in s if r.arrival_s is not None]
    span = (max(arrivals) - min(arrivals)) if arrivals else 0.0
    period = span + (span / (len(arrivals) - 1) if len(arrivals) > 1 else 1.0)
    picked = []
    for i in range(start, start + count):
        number = i // len(sessions)
        picked.append(tuple(replace(of_pass(r, number), arrival_s=None if r.arrival_s is None
                                    else r.arrival_s + number * period) for r in sessions[i % len(sessions)]))
    return replace(trace, name=f"{trace.name}[{start % len(sessions)}:+{count}]", sessions=tuple(picked), warmup=())


def closed_loop(part: Workload) -> Workload:
    """A trace part with its arrival times dropped: users send its requests in order, back to back."""
    return replace(part, sessions=tuple(tuple(replace(r, arrival_s=None) for r in s) for s in part.sessions))


def rate_multiplied(part: Workload, multiplier: float) -> Workload:
    """A trace part arriving at `multiplier` x the trace's rate: (arrival - the part's first arrival) / multiplier."""
    origin = min(r.arrival_s for r in part.requests if r.arrival_s is not None)
    return replace(part, name=f"{part.name}@{multiplier:g}x", sessions=tuple(
        tuple(replace(r, arrival_s=None if r.arrival_s is None else (r.arrival_s - origin) / multiplier) for r in s)
        for s in part.sessions))


def describe_replay(workload: Workload, settings: SweepSettings, primed: bool,
                    primed_rows: Sequence[dict] = ()) -> str:
    """One sentence saying how a sweep replays its workload (the report shows it); `primed_rows`: prime_targets'
    rows, which say the turns each target was spared."""
    levels = ", ".join(f"{v:g}" for v in settings.levels)
    if not workload.trace:
        warm = "after priming every target with every turn of each session once" if primed else "without priming"
        warm += "".join(f" ({row['target']}: the last {row['expected']} of {row['expected'] + row['spared']} turns, "
                        f"as its caches hold no more: the first {row['spared']} would have left them as they are)"
                        for row in primed_rows if primed and row.get("spared"))
        matched = ("; both blocks of a pair served the same segment of the workload's load order, each request "
                   "once, measured from its first" if settings.matched else "")
        steady = (f", after warm-up pairs that ended with {settings.steady.describe()}" if settings.steady else "")
        return f"G3 ran closed loop at concurrency {levels} over the workload's sessions, {warm}{matched}{steady}."
    steps = len(settings.levels) + len(settings.rates) + len(settings.multipliers)
    part = len(workload.sessions) // max(1, steps)
    if settings.multipliers:
        how = (f"open loop at {', '.join(f'{m:g}×' for m in settings.multipliers)} its arrival rate "
               f"({settings.rate_users} users)")
    else:
        how = f"closed loop at concurrency {levels} over its requests in order"
    warm = (f"after {len(workload.warmup)} warm-up requests that priming sent and no step measured"
            if primed and workload.warmup else "with no warm-up")
    return f"G3 replayed the trace {how}; each level its own {part} consecutive requests, {warm}."


def prime_targets(targets: list[Target], workload: Workload, users: int, out_dir: Path,
                  timeout_s: float = 600.0, stop_rule: Optional[StopRule] = StopRule(),
                  on_step: Optional[Callable[[str], None]] = None,
                  spared: Optional[Mapping[str, int]] = None) -> list[dict]:
    """Send every target `primer(workload)` once, less the first `spared[target.name]` requests (those its caches
    would not keep: sizing.g3_inputs.primer_spared); a row per target (requests, errors, seconds, spared).

    `on_step` is told a line as each target's priming starts and ends (progress).
    """
    primer_workload = primer(workload)
    if not primer_workload.sessions:  # a trace without warm-up requests: nothing to send
        return [{"target": t.name, "requests": 0, "errors": 0, "seconds": 0.0, "expected": 0, "spared": 0,
                 "locust_exit_code": None, "error_summary": "", "stopped_reason": None} for t in targets]
    primer_workload = primer_workload if not workload.trace else closed_loop(primer_workload)
    whole = len(primer_workload.requests)
    rows, say = [], on_step or (lambda text: None)
    for target in targets:
        # spared: the first requests of the load order, which are the first sessions where each is one request
        skip = min(max(0, (spared or {}).get(target.name, 0)), whole - 1) if not workload.trace else 0
        sent = replace(primer_workload, sessions=primer_workload.sessions[skip:]) if skip else primer_workload
        expected = len(sent.requests)
        say(f"priming {target.name}: sending {expected} requests once, {users} at a time"
            + (f" (the last {expected} of the primer's {whole}: its caches hold no more, so the first {skip} would "
               f"leave them as they are)" if skip else ""))
        run = run_load(sent, target, users, timeout_s, out_dir / target.name / "prime",
                       max_requests=expected, stop_rule=stop_rule)
        records = read_records(run.records_dir)
        rows.append({"target": target.name, "requests": len(records), "errors": sum(not r["ok"] for r in records),
                     "seconds": run.ended_at - run.started_at, "expected": expected, "spared": skip,
                     "locust_exit_code": run.returncode, "error_summary": describe_errors(summarize_errors(records)),
                     "stopped_reason": run.stopped["reason"] if run.stopped else None})
        say(f"priming {target.name}: done, {rows[-1]['requests']} requests, {rows[-1]['errors']} errors, "
            f"{rows[-1]['seconds']:.0f} s")
    return rows


def step_line(summary: dict) -> str:
    """A step's figures in one line: requests (and the due ones that never finished), errors, TTFT p50,
    throughput, hit ratio."""
    ttft, hits = summary.get("ttft_p50_s"), summary.get("hit_ratio")
    errors = summary.get("error_rate")
    due, finished = summary.get("due"), summary.get("finished")
    missing = (f" ({due} due, {summary.get('sent')} sent, {finished} finished)"
               if due is not None and finished is not None and due != finished else "")
    return (
        f"{summary.get('requests', 0)} requests{missing}, errors {format_percent(errors or 0)}, "
        f"TTFT p50 {format_ms(ttft)}, "
        f"{summary.get('output_tokens_per_s') or 0:.1f} tokens/s, "
        f"hit ratio {'-' if hits is None else format_percent(hits, 0)}"
        + (
            ", " + tier_line(summary["hit_blocks_by_tier"], summary.get("tier_unit", "blocks"))
            if summary.get("hit_blocks_by_tier") is not None
            else ""
        )
    )


@dataclass(frozen=True)
class Step:
    """One step of a sweep: what it offers and what each of its block pairs replays (`parts[k]`, pair k).

    A trace step's part is cut into `max_blocks` sub-parts, each sent once (`part_requests`); any other
    step replays its whole workload in every block."""

    kind: str                       # "concurrency" | "rate" | "multiplier"
    value: float
    workload: Workload              # the step's whole part (a trace), or the workload
    users: int
    max_requests: Optional[int]     # a trace part: sent once, never cycled
    parts: tuple[Workload, ...] = ()   # per block pair (empty: `workload` in every pair)

    @property
    def dir_name(self) -> str:
        prefix = {"concurrency": "c", "rate": "r", "multiplier": "x"}[self.kind]
        return f"{prefix}{self.value:g}"

    @property
    def label(self) -> str:
        """"c=8", "2 req/s", "×1.5": the step as the console says it."""
        return {"concurrency": f"c={self.value:g}", "rate": f"{self.value:g} req/s",
                "multiplier": f"×{self.value:g}"}[self.kind]

    def pair_part(self, pair: int) -> tuple[Workload, Optional[int]]:
        """What pair `pair` replays, and how many requests it sends at most (None: until the block ends)."""
        if not self.parts:
            return self.workload, self.max_requests
        part = self.parts[pair % len(self.parts)]
        return part, len(part.sessions)


def plan_steps(workload: Workload, settings: SweepSettings) -> list[Step]:
    """The steps of a sweep, in order: levels, then rates, then multipliers (traces only)."""
    if settings.multipliers and not workload.trace:
        raise ValueError("rate multipliers replay a trace's arrival times; this workload is not a trace")
    plan = [("concurrency", level) for level in settings.levels] + [("rate", rate) for rate in settings.rates]
    plan += [("multiplier", m) for m in settings.multipliers]
    parts = trace_parts(workload, len(plan)) if workload.trace and plan else []
    steps = []
    for i, (kind, value) in enumerate(plan):
        if kind == "rate":
            steps.append(Step(kind, value, paced(parts[i] if parts else workload, value, settings.duration_s),
                              settings.rate_users, None))
        elif kind == "multiplier":
            steps.append(
                Step(
                    kind,
                    value,
                    rate_multiplied(parts[i], value),
                    settings.rate_users,
                    len(parts[i].sessions),
                    _pair_parts(parts[i], settings, lambda p: rate_multiplied(p, value)),
                )
            )
        elif parts:
            steps.append(Step(kind, value, closed_loop(parts[i]), int(value), len(parts[i].sessions),
                              _pair_parts(parts[i], settings, closed_loop)))
        else:
            once = sum(len(session) for session in workload.sessions) if settings.send_once else None
            steps.append(Step(kind, value, workload, int(value), once))
    return steps


def pairs_at_most(max_blocks: int, steady: Optional[SteadyRule]) -> int:
    """The most block pairs a step may take: `max_blocks` measured ones and the warm-up pairs left out before them."""
    return max_blocks + (steady.max_pairs if steady is not None else 0)


def _pair_parts(part: Workload, settings: SweepSettings, replay: Callable[[Workload], Workload]) -> tuple:
    """A trace step's part cut into one sub-part per block pair it may take (`pairs_at_most`), each replayed as the
    step is: no pair, warm-up or measured, sends a request another sent."""
    most = pairs_at_most(settings.max_blocks, settings.steady if settings.matched else None)
    if most <= 1:
        return ()
    return tuple(replay(sub) for sub in trace_parts(part, most))
