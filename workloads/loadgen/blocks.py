"""Running a sweep: every step as alternating short blocks of the two targets side by side.

How it works: docs/methods/side-by-side.md (workloads/loadgen/blocks.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import pandas as pd

from kvcore.rundata import read_records
from workloads.loadgen.live import LiveFigures, LiveStep, step_name
from workloads.loadgen.load import LoadProgress, LoadRun, run_load
from workloads.loadgen.steady import LAG, Settled, cached_share, order_segment, requests_per_part, warm_up_end
from workloads.loadgen.sweep import (
    DUE_COUNTS,
    Step,
    SweepSettings,
    plan_steps,
    read_client_samples,
    request_figures,
    step_line,
    summarize_step,
)
from workloads.probes.tier_hits import tier_difference
from workloads.traffic.errors import merge_error_summaries
from workloads.traffic.requests import Workload
from workloads.traffic.target import Target


def block_order(pair: int) -> tuple[int, int]:
    """The order of (A, B) in pair `pair`: A then B for even pairs, B then A for odd ones (ABBA...)."""
    return (0, 1) if pair % 2 == 0 else (1, 0)


@dataclass
class LevelSampling:
    """One step's pairs as they are taken: what `SweepSettings.sample_level` is told.

    `take_pair(k)` runs pair k and appends its (A's block row, B's block row) to `pairs`."""

    kind: str
    level: float
    take_pair: Callable[[int], None]
    pairs: list[tuple[dict, dict]]
    minimum: int
    maximum: int
    budget_s: float


def fixed_pairs(sampling: LevelSampling) -> dict:
    """The sampling without a rule to decide: `minimum` pairs."""
    for pair in range(sampling.minimum):
        sampling.take_pair(pair)
    return {"pairs": sampling.minimum, "decided": False, "why": f"{sampling.minimum} blocks per target (fixed)"}


class _TargetDied(Exception):
    """A block's target stopped answering: its step samples no further pair."""


@dataclass
class _Block:
    """A block that ran: its load, records and client samples, and its target's tier hits over it."""

    target: str
    pair: int
    position: int                 # 0: first of its pair, 1: second
    directory: Path
    run: LoadRun
    records: list[dict]
    samples: list[dict]
    hits: Optional[dict]
    where: str                    # the console's name of it ("step 1 / 3, c=2, block 1 of 3, baseline")
    max_requests: Optional[int] = None  # its part's requests, each sent once (None: as many as its time allows)
    matched: bool = False  # its pair serves the same requests, measured from the first (workloads.loadgen.steady)

    @property
    def first_sent_at(self) -> float:
        """When the block's first request was sent (its start when it sent none): its warm-up starts there."""
        return min((r["sent_at"] for r in self.records), default=self.run.started_at)

    def measured_ids(self, warmup_s: float) -> set:
        return {r["request_id"] for r in self.records if r["sent_at"] >= self.first_sent_at + warmup_s}


def run_sweep(targets: Sequence[Target], workload: Workload, settings: SweepSettings,
              references: Sequence[Target] = ()) -> pd.DataFrame:
    """Every step × target, as blocks: `targets` is one target, or the pair side by side (A, B: the
    baseline first); `references` run one block per step. One row per (target, step), pooled over its
    blocks (docs/methods/side-by-side.md); the raw records stay in out_dir."""
    if not 1 <= len(targets) <= 2:
        raise ValueError(f"targets: expected one target or a pair side by side, found {len(targets)}")
    return pd.DataFrame(_Sweep(list(targets), list(references), settings, plan_steps(workload, settings)).run())


class _Sweep:
    def __init__(self, targets: list[Target], references: list[Target], settings: SweepSettings,
                 steps: list[Step]) -> None:
        self.targets, self.references, self.settings, self.steps = targets, references, settings, steps
        self.dead: dict[str, str] = {}       # target name -> why its later steps are not run
        self.baseline_rate: Optional[float] = None   # the first target's latest completed requests per second
        self.next_request = 0                # matched pairs: where the next segment of the load order starts
        self.part_sizes: dict[str, int] = {}  # a matched step's requests per pair (sized at its first pair)
        self.say = settings.on_step or (lambda text: None)

    def run(self) -> list[dict]:
        rows = []
        for number, step in enumerate(self.steps, 1):
            rows += self._step(number, step)
        return rows

    def _step(self, number: int, step: Step) -> list[dict]:
        """A step's rows: each target's blocks pooled, the pairs taken as the sampling says (after the warm-up
        pairs, when `settings.steady` asks for them)."""
        everyone = self.targets + self.references
        blocks: dict[str, list[tuple[dict, list[dict], list[dict]]]] = {t.name: [] for t in everyone}
        dead_before = {t.name: self.dead[t.name] for t in everyone if t.name in self.dead}
        for reference in self.references:
            if reference.name not in dead_before:
                self._keep(blocks, self._rows([self._block(number, step, reference, 0, 0, reference=True)], step))
        pairs: list[tuple[dict, dict]] = []
        taken: list[list[tuple[dict, list[dict], list[dict]]]] = []   # every pair's block rows, warm-up included

        def run_pair(pair: int) -> None:
            order = [self.targets[i] for i in block_order(pair)[:len(self.targets)]]
            part = self._part(step, pair)
            ran = [self._block(number, step, target, pair, position, part=part)
                   for position, target in enumerate(order) if target.name not in self.dead]
            taken.append(self._rows(ran, step))
            if any(t.name in self.dead for t in self.targets):
                raise _TargetDied(next(self.dead[t.name] for t in self.targets if t.name in self.dead))

        def keep(rows: list[tuple[dict, list[dict], list[dict]]]) -> None:
            self._keep(blocks, rows)
            by_target = {row.get("target"): row for row, _, _ in rows}
            if len(self.targets) == 2 and all(t.name in by_target for t in self.targets):
                first, second = self.targets
                pairs.append((by_target[first.name], by_target[second.name]))

        started = time.monotonic()
        warm, died = None, None
        try:
            warm = self._warm_up(run_pair, taken, any(t.name in dead_before for t in self.targets))
        except _TargetDied as stopped:
            died = stopped
        first_kept = warm.warmup_pairs if warm is not None else 0
        for rows in taken[first_kept:]:
            keep(rows)

        def take_pair(index: int) -> None:
            pair = first_kept + index
            if pair < len(taken):          # a settled warm-up pair, measured already
                return
            try:
                run_pair(pair)
            finally:                       # a block whose target died is kept: its row says why
                if pair < len(taken):
                    keep(taken[pair])

        if died is not None:
            sampling = {"pairs": len(pairs), "decided": False, "why": f"stopped: {died}"}
        else:
            sampling = self._sampling(step, take_pair, pairs, any(t.name in dead_before for t in self.targets),
                                      time.monotonic() - started)
        if warm is not None:
            sampling = {**sampling, "warmup": warm.to_dict()}
            self.say(f"step {number} / {len(self.steps)}, {step.label}: {warm.line()}")
        if self.settings.max_blocks > 1:
            self.say(f"step {number} / {len(self.steps)}, {step.label}: {sampling['why']}")
        return [self._step_row(step, target, blocks[target.name], sampling, dead_before.get(target.name))
                for target in everyone]

    def _warm_up(self, run_pair: Callable[[int], None], taken: list, someone_dead: bool) -> Optional[Settled]:
        """Warm-up pairs until a candidate block agrees with its block `LAG` pairs later (`settings.steady`), at most
        `max_pairs` of them left out; None when there is no warm-up (no rule, one target, a dead one)."""
        rule = self.settings.steady
        if rule is None or len(self.targets) != 2 or someone_dead:
            return None
        candidate = self.targets[1].name

        def candidate_rows() -> list[dict]:      # each with its cached share of whole blocks, where it is known
            return [{**row, "cached_share": cached_share(measured, self.settings.block_tokens)}
                    for rows in taken for row, measured, _ in rows if row["target"] == candidate]

        while True:
            run_pair(len(taken))
            end = warm_up_end(candidate_rows(), len(taken), rule)
            if end is not None:
                left_out, settled = end
                rows = candidate_rows()
                return Settled(left_out, settled, tuple(rows[:left_out + LAG + 1] if settled else rows), rule)

    def _part(self, step: Step, pair: int) -> Optional[tuple[Workload, Optional[int]]]:
        """What pair `pair` serves: a trace step's sub-part, a matched segment of the load order (`settings.matched`),
        or None: the step's own workload, for `duration_s`."""
        if step.parts:
            return step.pair_part(pair)
        if not self.settings.matched or step.kind != "concurrency" or step.workload.trace:
            return None
        if step.dir_name not in self.part_sizes:      # one size per step, from the baseline's latest rate
            self.part_sizes[step.dir_name] = requests_per_part(step.workload, step.users, self.baseline_rate,
                                                               self.settings.duration_s)
        count = self.part_sizes[step.dir_name]
        part = order_segment(step.workload, self.next_request, count)
        self.next_request += count         # the load order goes on across pairs and steps, as after priming
        return part, len(part.requests)

    def _sampling(self, step: Step, take_pair: Callable[[int], None], pairs: list, someone_dead: bool,
                  spent_s: float = 0.0) -> dict:
        settings = self.settings
        budget = settings.level_budget_s - spent_s if settings.level_budget_s is not None else math.inf
        judge = settings.sample_level if len(self.targets) == 2 and not someone_dead else None
        minimum = 1 if someone_dead else settings.min_blocks
        sampling = LevelSampling(step.kind, step.value, take_pair, pairs, minimum,
                                 max(minimum, settings.max_blocks), budget)
        try:
            return (fixed_pairs if judge is None else judge)(sampling)
        except _TargetDied as died:
            return {"pairs": len(pairs), "decided": False, "why": f"stopped: {died}"}

    @staticmethod
    def _keep(blocks: dict, rows: list[tuple[dict, list[dict], list[dict]]]) -> None:
        for row, measured, records in rows:
            blocks[row["target"]].append((row, measured, records))

    def _block_label(self, step: Step, pair: int, reference: bool = False) -> str:
        settings = self.settings
        if settings.max_blocks <= 1 and settings.min_blocks <= 1:
            return step.label
        if reference:
            return f"{step.label}, its one reference block"
        most = (f"{settings.min_blocks}" if settings.max_blocks <= settings.min_blocks
                else f"{settings.min_blocks} to {settings.max_blocks}")
        if settings.steady is not None and len(self.targets) == 2:   # warm-up pairs come first, then those measured
            return f"{step.label}, pair {pair + 1} ({most} measured after the warm-up)"
        return f"{step.label}, block {pair + 1} of {most}"

    def _block(self, number: int, step: Step, target: Target, pair: int, position: int,
               reference: bool = False, part: Optional[tuple[Workload, Optional[int]]] = None) -> _Block:
        """Run one block of `target` (pair `pair`, `position` in it): one locust process for `duration_s`, or,
        matched, until its part is served (at most `matched_cap` x `duration_s`)."""
        settings = self.settings
        directory = settings.out_dir / target.name / (step.dir_name + (f"-block{pair + 1}" if pair else ""))
        where = step_name(number, len(self.steps), self._block_label(step, pair, reference), target.name)
        matched = part is not None and settings.matched
        seconds = settings.duration_s * (settings.matched_cap if matched else 1.0)
        workload, max_requests = part if part is not None else step.pair_part(pair)
        self.say(f"{where}: " + (f"serving its {max_requests} requests (at most {seconds:g} s)" if matched
                                 else f"running for {seconds:g} s"))
        hits_before = settings.tier_hits(target) if settings.tier_hits else None
        run = run_load(workload, target, step.users, seconds, directory, workers=settings.workers,
                       max_requests=max_requests, stop_rule=settings.stop_rule,
                       on_progress=self._live_teller(number, step, self._block_label(step, pair, reference),
                                                     target.name),
                       progress_every_s=settings.live_every_s)
        hits = tier_difference(hits_before, settings.tier_hits(target)) if settings.tier_hits else None
        if run.stopped:
            self.dead[target.name] = f"not run: at {step.dir_name}, {run.stopped['reason']}"
        return _Block(target.name, pair, position, directory, run, read_records(run.records_dir),
                      read_client_samples(run.records_dir), hits, where, max_requests, matched)

    def _rows(self, ran: list[_Block], step: Step) -> list[tuple[dict, list[dict], list[dict]]]:
        """The blocks' rows, measured records and all records; a pair of parts sent once (a trace's, a matched
        one) measured on the requests both blocks measured."""
        left_out: list[set[str]] = [set() for _ in ran]
        if len(ran) == 2 and all(block.max_requests is not None for block in ran):
            measured = [block.measured_ids(self._settings_of(block).warmup_s) for block in ran]
            common = measured[0] & measured[1]
            left_out = [ids - common for ids in measured]
        found = []
        for block, leave in zip(ran, left_out):
            row, measured_records = self._block_row(block, step, leave)
            if block.target == self.targets[0].name and row["completed"]:   # what sizes the next step's segments
                self.baseline_rate = row["requests_per_s"]
            self.say(f"{block.where}: done, {step_line(row)}")
            found.append((row, measured_records, block.records))
        return found

    def _settings_of(self, block: _Block) -> SweepSettings:
        """A block's window rules: a matched block is measured from its first request, with no least duration."""
        return replace(self.settings, warmup_s=0.0, min_duration_s=0.0) if block.matched else self.settings

    def _block_row(self, block: _Block, step: Step, left_out: set) -> tuple[dict, list[dict]]:
        settings = self._settings_of(block)
        records = [r for r in block.records if r["request_id"] not in left_out] if left_out else block.records
        stopped = block.run.stopped["reason"] if block.run.stopped else None
        summary = summarize_step(records, block.samples, block.first_sent_at, block.run.ended_at, settings, stopped,
                                 block.run.unanswered)
        max_requests = block.max_requests
        if max_requests is not None and len(block.records) >= max_requests and not summary["valid"]:
            summary["invalid_reasons"] += (f"; its {max_requests} requests, each sent once, ran out after "
                                           f"{block.run.ended_at - block.run.started_at:.1f} s (a workload with "
                                           "more of them (a trace: a larger limit), or a shorter duration)")
        row = {"target": block.target, "level": step.value, "block": block.pair, "position": block.position,
               "started_at": block.run.started_at, "first_sent_at": block.first_sent_at,
               "step_dir": str(block.directory), "left_out": len(left_out), "left_out_ids": sorted(left_out),
               "locust_exit_code": block.run.returncode,
               "client_wait_p99_s": _p99([r["client_wait_s"] for r in records]), **summary,
               "hit_blocks_by_tier": block.hits, "tier_unit": settings.tier_unit}
        return row, [r for r in records if r["sent_at"] >= summary["window_start"]]

    def _step_row(self, step: Step, target: Target, blocks: list, sampling: dict, dead: Optional[str]) -> dict:
        row = {"target": target.name, "replay": step.kind, "level": step.value,
               "concurrency": step.users if step.kind == "concurrency" else None,
               "rate_per_s": step.value if step.kind == "rate" else None,
               "multiplier": step.value if step.kind == "multiplier" else None, "users": step.users,
               "offered_requests": step.max_requests, "not_run": False, "reference": target in self.references,
               "sampling": sampling}
        if dead is not None or not blocks:
            return {**row, **not_run_summary(dead or "not run", self.settings)}
        return {**row, **pooled_summary(blocks, self.settings)}

    def _live_teller(self, number: int, step: Step, label: str,
                     target: str) -> Optional[Callable[[LoadProgress], None]]:
        """What tells `settings.on_live` a running block's figures: its measured window's requests so far
        (the window starts `warmup_s` after the first request sent, as in the block's summary)."""
        settings, on_live = self.settings, self.settings.on_live
        if on_live is None:
            return None
        seen: list[dict] = []
        predicted = settings.predicted_ttft_p50_s.get((target, step.value)) if step.kind == "concurrency" else None

        def tell(progress: LoadProgress) -> None:
            seen.extend(progress.new_records)
            first = min((r["sent_at"] for r in seen), default=None)
            figures = LiveFigures(since=math.inf if first is None else first + settings.warmup_s)
            figures.add(seen)
            warming = first is None or time.time() < first + settings.warmup_s
            on_live(LiveStep(number, len(self.steps), label, target, progress.elapsed_s,
                             settings.duration_s, warming, figures.requests, figures.errors,
                             figures.ttft_s(50), predicted))

        return tell


def pooled_summary(blocks: list[tuple[dict, list[dict], list[dict]]], settings: SweepSettings) -> dict:
    """A (target, step)'s figures over its blocks: percentiles from their measured records together,
    throughput and requests/s over their measured windows together; valid when every block was."""
    rows = [row for row, _, _ in blocks]
    measured = [r for _, records, _ in blocks for r in records]
    ok = [r for r in measured if r["ok"]]
    span = sum(row["window_s"] for row in rows)
    reasons = [f"block {row['block'] + 1}: {row['invalid_reasons']}" if len(rows) > 1 else row["invalid_reasons"]
               for row in rows if row["invalid_reasons"]]
    hits = [row["hit_blocks_by_tier"] for row in rows]
    first = rows[0]
    return {"window_start": first["window_start"], "step_dir": first["step_dir"], "requests": len(measured),
            "completed": len(ok), "window_s": span, "requests_per_s": len(ok) / span if span else 0.0,
            "output_tokens_per_s": sum(r["completion_tokens"] or 0 for r in ok) / span if span else 0.0,
            "error_rate": 1 - len(ok) / len(measured) if measured else None, **request_figures(ok),
            **{count: sum(row[count] for row in rows) for count in DUE_COUNTS},
            "valid": all(row["valid"] for row in rows), "invalid_reasons": "; ".join(reasons),
            "errors_by_type": merge_error_summaries(row["errors_by_type"] for row in rows),
            "stopped_reason": next((row["stopped_reason"] for row in rows if row["stopped_reason"]), None),
            "locust_exit_code": next((row["locust_exit_code"] for row in rows if row["locust_exit_code"]), 0),
            "client_wait_p99_s": _p99([r["client_wait_s"] for _, _, records in blocks for r in records]),
            "hit_blocks_by_tier": None if any(h is None for h in hits) else _summed(hits),
            "tier_unit": first["tier_unit"], "blocks": rows}


def not_run_summary(reason: str, settings: SweepSettings) -> dict:
    """The summary of a step the sweep did not run: no requests, invalid, and why."""
    now = time.time()
    return {**summarize_step([], [], now, now, settings), "locust_exit_code": None, "client_wait_p99_s": None,
            "valid": False, "invalid_reasons": reason, "not_run": True, "blocks": [], "step_dir": None}


def step_measured_records(row: dict) -> list[dict]:
    """A (target, step) row's measured records, every block's window (failed requests too), read from disk;
    a trace pair's left-out requests stay out."""
    found = []
    for block in row.get("blocks") or []:
        left_out = set(block.get("left_out_ids") or ())
        records = read_records(Path(block["step_dir"]) / "records")
        found += [r for r in records if r["sent_at"] >= block["window_start"] and r["request_id"] not in left_out]
    return found


def _summed(hits: list[dict]) -> dict:
    total: dict = {}
    for by_tier in hits:
        for tier, count in by_tier.items():
            total[tier] = total.get(tier, 0) + count
    return total


def _p99(values: list[float]) -> Optional[float]:
    return float(np.percentile(values, 99)) if values else None
