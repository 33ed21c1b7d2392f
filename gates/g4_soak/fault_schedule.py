"""The G4 fault schedule: faults injected into the embedded candidate during the soak, each followed up.

At its time a fault is injected through the server's admin routes; then the
first consistency probe is asked at once (its answer must not change), the
cache's detection counters are compared with those before the fault, and the
probe is asked until it is again served whole from the cache ("recovered
after N s"). One row per fault is appended to `faults.jsonl` as it completes,
so a resumed soak skips the faults already done. A row places the fault on the
soak's clock (the windows' `start_s`): `injected_s` when it was injected,
`ended_s` when its effect ended (the damage done, or the I/O fault disarmed),
then `recovered_after_s` from that end (None: not within `recovery_timeout_s`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

from cache_impl.cache.faults import BLOCK_FAULTS
from kvcore.files import append_jsonl
from kvcore.files import read_jsonl_file as read_jsonl
from workloads.probes.faults import (
    CacheAdmin,
    damage_in_place,
    damage_prompt_blocks,
    detection_counts,
    evict_until_on_disk_only,
)
from workloads.probes.settings import FaultSpec
from workloads.traffic.client import StreamingClient
from workloads.traffic.requests import WorkloadRequest
from workloads.traffic.target import Target

# What each kind of fault should move among the cache's counters.
DETECTED_BY = {"flip_byte": "corrupt_blocks", "truncate": "corrupt_blocks", "delete": "corrupt_blocks",
               "swap": "corrupt_blocks", "read_error": "read_errors", "disk_full": "write_errors",
               "write_error": "write_errors", "slow_disk": "faults_injected"}


WRITE_FAULTS = ("disk_full", "write_error")
UPPER_TIERS = ("device", "host")
MAX_REPROBES = 3             # a stored-block fault whose probe read no damaged copy: asked again
# About 330 characters with the question's head: at least one new 256-token block for a byte-level tokenizer,
# so the writes meet the fault, and no longer: the engine keeps a finished request's KV buffer for reuse, and
# one sized past the workload's longest prompts stayed resident as a 13 MiB step in the soak's memory (160
# words, ~2,830 tokens, in the 2-hour soak of 2026-12-04)
FRESH_WORDS = 40


class FaultSchedule:
    """Runs the faults due in the rest of a soak in a background thread."""

    def __init__(self, faults: list[FaultSpec], cache: CacheAdmin, target: Target, probe: WorkloadRequest,
                 expected: str, log_path: Path, recovery_timeout_s: float = 60.0) -> None:
        self.faults = sorted(faults, key=lambda f: f.at_s)
        self.cache, self.admin = cache, cache.admin
        self.target, self.probe, self.expected = target, probe, expected
        self.log_path, self.recovery_timeout_s = log_path, recovery_timeout_s
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()

    def done(self) -> list[dict]:
        return read_jsonl(self.log_path)

    def start(self, begin: float, offset_s: float, end: float) -> None:
        """`begin`: wall time of soak second `offset_s` (a resumed soak starts past 0); `end`: its last second."""
        finished = {(row["kind"], row["at_s"]) for row in self.done()}
        due = [f for f in self.faults if f.at_s >= offset_s and (f.kind, f.at_s) not in finished]
        if due:
            self._thread = threading.Thread(target=self._run, args=(due, begin - offset_s, end),
                                            name="g4-faults", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self, due: list[FaultSpec], zero: float, end: float) -> None:
        client = self.target.client(target="fault-probe")
        try:
            for fault in due:
                if self._stop.wait(max(0.0, zero + fault.at_s - time.time())):
                    return
                append_jsonl(self.log_path, self._inject(fault, client, zero, end))
        finally:
            client.close()

    def _ask(self, client: StreamingClient) -> dict:
        record = client.send(self.probe, keep_text=True)
        return {"ok": record.ok, "identical": record.ok and record.text == self.expected,
                "cached_tokens": record.cached_tokens, "prompt_tokens": record.prompt_tokens}

    def _inject(self, fault: FaultSpec, client: StreamingClient, zero: float, end: float) -> dict:
        """`zero`: the wall time of soak second 0; `end`: the soak's last wall second."""
        now = time.time()
        row = {"kind": fault.kind, "at_s": fault.at_s, "injected_at": now, "injected_s": now - zero,
               "recovery_timeout_s": self.recovery_timeout_s, "error": None}
        try:
            whole = self._ask(client)                       # the probe served from cache before the fault
            before = detection_counts(self.admin.metrics())
            if fault.kind in BLOCK_FAULTS:
                messages = list(self.probe.messages)
                row["detail"] = damage_prompt_blocks(self.admin, fault.kind, messages=messages,
                                                     token_ids=self.cache.token_ids(messages))
                fault_ends = time.time()
            else:
                self.admin.arm(fault.kind, fault.duration_s, fault.delay_ms if fault.kind == "slow_disk" else None)
                self.admin.evict(("device", "host"))        # the next loads go to the faulty disk
                row["detail"] = {"duration_s": fault.duration_s}
                fault_ends = time.time() + fault.duration_s
            self.cache.clear_engine()                       # ... and not to the engine's own device cache
            row["ended_s"] = fault_ends - zero
            if fault.kind in BLOCK_FAULTS:
                self._probe_past_upper_copies(client, row, before)
            else:
                row["probe_during"] = self._ask(client)
            if fault.kind in WRITE_FAULTS:                  # new blocks to store, so the writes meet the fault
                fresh = self._fresh_request(fault)
                row["fresh_request_ok"] = client.send(fresh).ok
            if fault.kind not in BLOCK_FAULTS:
                self._stop.wait(max(0.0, fault_ends - time.time()))
            after = detection_counts(self.admin.metrics())
            row["detected"] = {name: after[name] - before[name] for name in after if name != "disk_hits"}
            row["detected_by"] = DETECTED_BY[fault.kind]
            row["recovered_after_s"] = self._recovery(client, whole["cached_tokens"] or 0, fault_ends, end)
        except Exception as error:  # the soak goes on; the row says what went wrong
            row["error"] = f"{type(error).__name__}: {error}"
        return row

    def _probe_past_upper_copies(self, client: StreamingClient, row: dict, before: dict) -> None:
        """Ask the probe after a stored-block fault. A read of the damaged copy is counted, so when the counter
        did not move the probe read none: either an upper tier served it a whole copy (a request that had
        computed the block published it between the eviction and the probe: evict the upper tiers again), or a
        store of the block replaced the damaged file with a whole one (the disk tier evicted it and a request
        stored it again: damage it again). Then ask again, at most MAX_REPROBES times; `row["reprobes"]` says
        which tiers held the block each time and whether its damaged file had been replaced."""
        counter = DETECTED_BY[row["kind"]]
        messages = list(self.probe.messages)
        token_ids = self.cache.token_ids(messages)
        row["reprobes"] = []
        while True:
            row["probe_during"] = self._ask(client)
            after = detection_counts(self.admin.metrics())
            if after[counter] > before[counter] or len(row["reprobes"]) >= MAX_REPROBES:
                return
            key = row["detail"]["key"]
            held: list[str] = next((b["tiers"] for b in self.admin.locate(messages=messages, token_ids=token_ids)
                                    if b["key"] == key), [])
            replaced = not damage_in_place(row["detail"])
            row["reprobes"].append({"held_by": [tier for tier in held if tier in UPPER_TIERS],
                                    "damage_replaced": replaced, "probe": row["probe_during"]})
            if replaced:
                row["detail"] = damage_prompt_blocks(self.admin, row["kind"], messages=messages, token_ids=token_ids)
            else:
                evict_until_on_disk_only(self.admin, key, messages=messages, token_ids=token_ids)
            self.cache.clear_engine()

    def _fresh_request(self, fault: FaultSpec) -> WorkloadRequest:
        """The probe's conversation with a new question of a few blocks: its KV is not stored yet."""
        question = {"role": "user", "content": f"Fault check {fault.kind} at {fault.at_s:g} s: "
                    + " ".join(f"item-{i}" for i in range(FRESH_WORDS))}
        return replace(self.probe, request_id=f"fault-{fault.kind}-{fault.at_s:g}",
                       messages=(*self.probe.messages, question))

    def _recovery(self, client: StreamingClient, whole_cached: int, since: float, end: float) -> Optional[float]:
        """Seconds from the fault's end until the probe is again answered identically and wholly from cache."""
        deadline = min(end, since + self.recovery_timeout_s)
        while not self._stop.is_set() and time.time() < deadline:
            answer = self._ask(client)
            if answer["identical"] and (answer["cached_tokens"] or 0) >= whole_cached:
                return max(0.0, time.time() - since)
            self._stop.wait(0.5)
        return None
