"""A standalone soak of `kvgate serve` (tiered, small preset, the embedded candidate's settings) under
G4's quick-profile load, sampling the server's memory every interval.

`python3 tools/memory_soak.py OUT_DIR [--minutes 9] [--interval 60] [--tracemalloc FRAMES] [--trim-every S]
[--evict-at S ...] [--faults-every S [--fault-kinds KIND ...]] [--env K=V ...]`
writes OUT_DIR/memory.jsonl (tools/memprobe.py's rows, inside the server) and OUT_DIR/gate.jsonl
(the gate's own figure, `rss_minus_cache_mib`, from /metrics as gates/g4_soak/soak.py reads it),
then prints one line per sample. `--faults-every S` injects G4's five faults (flip_byte, read_error,
slow_disk, truncate, disk_full) through the admin routes as G4 does (gates/g4_soak/fault_schedule.py),
one every S/5 seconds, repeated until the end; their rows go to OUT_DIR/faults.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import yaml

from cache_impl.server.auth import ADMIN_TOKEN_ENV
from gates.config import EmbeddedTargets, profile_defaults
from gates.g4_soak.fault_schedule import FaultSchedule
from gates.g4_soak.soak import probe_requests, server_figures
from gates.targets import engine_settings
from workloads.loadgen.load import run_load
from workloads.probes.faults import AdminClient, CacheAdmin
from workloads.probes.settings import FaultSpec
from workloads.traffic.client import StreamingClient
from workloads.traffic.datasets import build_workload, sizer_for
from workloads.traffic.processes import free_port
from workloads.traffic.target import Target

ENGINE = engine_settings(EmbeddedTargets())   # the embedded candidate's settings
G4_FAULTS = ("flip_byte", "read_error", "slow_disk", "truncate", "disk_full")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--minutes", type=float, default=9)
    parser.add_argument("--interval", type=float, default=60)
    parser.add_argument("--tracemalloc", type=int, default=0)
    parser.add_argument("--trim-every", type=float, default=0, help="malloc_trim(0) from a side thread every N s")
    parser.add_argument("--evict-at", type=float, action="append", default=[],
                        help="seconds into the load: evict the device and host tiers, as each G4 fault does")
    parser.add_argument("--faults-every", type=float, default=0,
                        help="seconds per cycle of G4's five faults (one every S/5 s, from S/5 s into the load)")
    parser.add_argument("--fault-kinds", nargs="+", default=list(G4_FAULTS), choices=G4_FAULTS,
                        help="the faults --faults-every cycles through (default: G4's five)")
    parser.add_argument("--env", action="append", default=[])
    args = parser.parse_args()
    args.out.mkdir(parents=True)
    (args.out / "engine.yaml").write_text(yaml.safe_dump({"engine": ENGINE}))
    port = free_port()
    env = {**os.environ, ADMIN_TOKEN_ENV: secrets.token_urlsafe(16), **dict(item.split("=", 1) for item in args.env)}
    command = [sys.executable, str(Path(__file__).with_name("memprobe.py")), str(args.out / "memory.jsonl"),
               str(args.interval), str(args.tracemalloc), str(args.trim_every), "--", "serve", "--config",
               str(args.out / "engine.yaml"), "--port", str(port), "--cache-dir", str(args.out / "kv"), "--admin",
               "--mode", "tiered"]
    server = subprocess.Popen(command, env=env, stdout=open(args.out / "server.log", "wb"), stderr=subprocess.STDOUT)
    root = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(root)
        g4 = profile_defaults("quick")["g4"]
        workload = build_workload(g4["workload"], sizer_for("kvgate-byte-v1"), seed=4)
        target = Target("candidate", root + "/v1", "kvgate-small")
        duration = args.minutes * 60
        load = threading.Thread(target=run_load, args=(workload, target, g4["concurrency"], duration + 5,
                                                       args.out / "load"), daemon=True)
        load.start()
        begin = time.time()
        admin = AdminClient(root, token=env[ADMIN_TOKEN_ENV])
        for at in args.evict_at:
            threading.Timer(at, lambda: print(json.dumps({"evicted": admin.evict()}), flush=True)).start()
        schedule = _fault_schedule(args, workload, target, admin, duration)
        if schedule is not None:
            schedule.start(begin, 0.0, begin + duration)
        for k in range(int(args.minutes * 60 / args.interval) + 1):
            time.sleep(max(0.0, begin + k * args.interval - time.time()))
            figures = server_figures(root)
            row = {"t_s": round(time.time() - begin, 1), "rss_mib": figures["rss_bytes"] / 2**20,
                   "cache_mib": figures["cache_memory_bytes"] / 2**20,
                   "rss_minus_cache_mib": (figures["rss_bytes"] - figures["cache_memory_bytes"]) / 2**20}
            with open(args.out / "gate.jsonl", "a") as out:
                out.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
        load.join(timeout=300)
        if schedule is not None:
            schedule.stop(timeout_s=120)
    finally:
        server.terminate()
        server.wait(timeout=120)
    return 0


def _fault_schedule(args, workload, target: Target, admin: AdminClient, duration: float):
    """G4's five faults, one every `--faults-every`/5 s until the end, against the first probe (None: no faults)."""
    if not args.faults_every:
        return None
    kinds = args.fault_kinds
    step = args.faults_every / len(kinds)
    faults = [FaultSpec(kind=kinds[k % len(kinds)], at_s=step * (k + 1))
              for k in range(int(duration / step) - 1)]
    probe = probe_requests(workload)[0]
    client = StreamingClient(target.url, target.model, target.api, target="probe")
    try:
        expected = client.send(probe, keep_text=True).text
    finally:
        client.close()
    return FaultSchedule(faults, CacheAdmin(admin), target, probe, expected, args.out / "faults.jsonl")


def _wait_healthy(root: str, timeout_s: float = 120) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            urllib.request.urlopen(root + "/health", timeout=5).read()
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{root}: not healthy within {timeout_s} s")


if __name__ == "__main__":
    sys.exit(main())
