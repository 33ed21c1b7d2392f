"""Real `kvgate run`s the end-to-end modules share: one run of a kind a session, each module checking its part."""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from pathlib import Path

import yaml

from gates.cli import main
from tests.servers import TINY_SWEEP

# G1 and G2 on the tiny preset, every G2 part on: what the report's checks and the sizing model's G2 read
SMALL = {
    "profile": "quick",
    "targets": {"embedded": {"preset": "tiny", "max_running": 2, "device_capacity_blocks": 16,
                             "host_capacity": "64MiB", "disk_capacity": "256MiB"}},
    "inventory": {"min_cpu_cores": 1, "min_memory_gib": 1},
    "fio": {"size": "32M", "runtime_s": 1, "verify_size": "8M", "sweep": TINY_SWEEP},
    "g2": {"contexts": [600, 1100], "rounds": 2,      # the second round places the first's prefix again
           # exactly 5 rounds (a plain number: min = max), so the counts below are fixed
           "model_load": {"size": "24MiB", "shard_size": "8MiB", "rounds": 5},
           "checkpoint": {"parameters": 1_500_000, "rounds": 5},   # 21 MB of state at 14 bytes per parameter
           "no_reuse": {"context_tokens": 600, "max_tokens": 8, "pairs": 5},
           # judged here as the full profile judges them (the quick profile shows them unjudged)
           "thresholds": [{"metric": "no_reuse_ttft_cost", "op": "<=", "value": 0.05},
                          {"metric": "no_reuse_throughput_cost", "op": "<=", "value": 0.05}]},
}


@dataclass(frozen=True)
class GateRun:
    code: int           # kvgate run's exit code
    run_dir: Path
    console: str        # what it printed


def run_g1_g2(work: Path) -> GateRun:
    """`kvgate run g1 g2` on SMALL: the model load beside a baseline storage (a directory on the same disk: no
    speed-up; the checkpoint has none, so its speed-up check is not run), both I/O modes in the sweep (G2's
    yardstick is each mode's winner, the faster of each round)."""
    config = {**SMALL, "storage": {"path": str(work / "storage")},
              "fio": {**SMALL["fio"], "sweep": {**TINY_SWEEP, "modes": ["direct", "buffered"],
                                                "write_modes": ["direct", "buffered"]}},
              "g2": {**SMALL["g2"], "model_load": {**SMALL["g2"]["model_load"], "baseline_path": str(work / "nfs")}}}
    (work / "gates.yaml").write_text(yaml.safe_dump(config))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["run", "g1", "g2", "--config", str(work / "gates.yaml"), "--out", str(work / "run")])
    return GateRun(code, work / "run", printed.getvalue())
