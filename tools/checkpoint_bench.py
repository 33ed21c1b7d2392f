"""Checkpoint save and cold restore on one storage, a few rounds: `workloads.storage.checkpoint` from the shell.

`python3 tools/checkpoint_bench.py DIR [--state 512MiB | --preset adapter] [--ranks 2] [--rounds 3]
[--thread-count 1] [--json]`
saves the state into DIR/round-N (each round a checkpoint of its own), restores it with its pages
dropped, prints one line per round (save and restore GB/s, the slowest rank's seconds, bytes,
equal, cold) and the rounds' spread ((max - min) / median, MLPerf's 5% rule), then removes what it
wrote.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from kvcore.percent import format_percent
from kvcore.settings import parse_size
from workloads.storage.checkpoint import STATE_PRESETS, CheckpointJob, CheckpointSpec, rounds_agree, spread


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="where the checkpoints go (on the storage under test)")
    parser.add_argument("--state", default="512MiB", help="state bytes in all (default 512MiB)")
    parser.add_argument("--preset", choices=sorted(STATE_PRESETS), help="a preset's parameters instead of --state")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--thread-count", type=int, default=1, help="DCP writer threads per rank")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    args = parser.parse_args()
    spec = (CheckpointSpec.from_preset(args.preset, ranks=args.ranks) if args.preset
            else CheckpointSpec.for_state_bytes(parse_size(args.state), ranks=args.ranks))
    rows = []
    with CheckpointJob(spec, thread_count=args.thread_count, round_timeout_s=3600) as job:
        for n in range(args.rounds):
            where = args.directory / f"round-{n}"
            try:
                save = job.save(where)
                restore = job.restore(where) if save.ok else None
            finally:
                shutil.rmtree(where, ignore_errors=True)
            rows.append({"round": n, "save": save.context(), "restore": restore.context() if restore else None})
            if not args.json:
                line = (f"round {n}: save {save.gbps:.3f} GB/s ({save.seconds:.2f} s, {save.nbytes / 1e9:.3f} GB)"
                        if save.ok else f"round {n}: save FAILED: {save.error}")
                if restore:
                    line += (f"  restore {restore.gbps:.3f} GB/s ({restore.seconds:.2f} s) equal={restore.equal}"
                             f" cold={restore.cold}")
                print(line, flush=True)
    saves = [r["save"]["gbps"] for r in rows if r["save"]["ok"]]
    restores = [r["restore"]["gbps"] for r in rows if r["restore"] and r["restore"]["ok"]]
    summary = {"state_bytes": spec.total_bytes, "ranks": spec.ranks, "thread_count": args.thread_count,
               "rounds": rows, "save_spread": spread(saves) if saves else None,
               "restore_spread": spread(restores) if restores else None,
               "save_agree": rounds_agree(saves) if saves else None,
               "restore_agree": rounds_agree(restores) if restores else None}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"spread: save {format_percent(summary['save_spread'])} (agree: {summary['save_agree']}), "
              f"restore {format_percent(summary['restore_spread'])} (agree: {summary['restore_agree']})")
    return 0 if saves and len(saves) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
