"""Runs `kvgate serve` with a sampler thread that appends the process's memory figures to a JSONL file.

Diagnostic only: `python3 tools/memprobe.py OUT.jsonl INTERVAL_S [TRACEMALLOC_FRAMES [TRIM_EVERY_S]] -- serve ARGS`.
Each row: VmRSS and smaps_rollup (anonymous, file), glibc's mallinfo2 (arena bytes, mmapped
bytes, in use, free inside the arenas), and with tracemalloc on the traced total and the ten
source lines whose traced memory grew most since the previous row.
"""

from __future__ import annotations

import ctypes
import json
import sys
import threading
import time
import tracemalloc


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def mallinfo2() -> dict:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return {"arena_mib": info.arena / 2**20, "mmapped_mib": info.hblkhd / 2**20, "mmapped_chunks": info.hblks,
            "in_use_mib": info.uordblks / 2**20, "free_in_arenas_mib": info.fordblks / 2**20,
            "top_releasable_mib": info.keepcost / 2**20}


def proc_figures() -> dict:
    out = {}
    for line in open("/proc/self/smaps_rollup"):
        parts = line.split()
        if len(parts) == 3 and parts[2] == "kB":
            out[parts[0].rstrip(":")] = int(parts[1]) / 1024
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {"rss_mib": int(status["VmRSS"].split()[0]) / 1024, "anon_mib": out.get("Anonymous"),
            "rss_file_mib": int(status["RssFile"].split()[0]) / 1024, "threads": int(status["Threads"])}


def mappings() -> dict:
    """Resident MiB of the largest anonymous mapping (the cache pools: one allocation each, adjacent),
    of the main heap, and of every other anonymous mapping (thread arenas, scratch buffers, stacks)."""
    maps, current = [], None
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            start, end = (int(x, 16) for x in head[0].split("-"))
            current = {"size": (end - start) / 2**20, "name": head[5] if len(head) > 5 else "", "rss": 0.0}
            maps.append(current)
        elif head[0] == "Rss:":
            current["rss"] = int(head[1]) / 1024
    anon = [m for m in maps if m["name"] in ("", "[heap]")]
    pools = max(anon, key=lambda m: m["size"])
    return {"pools_rss_mib": pools["rss"], "main_heap_rss_mib": sum(m["rss"] for m in anon if m["name"] == "[heap]"),
            "other_anon_rss_mib": sum(m["rss"] for m in anon if m is not pools and m["name"] != "[heap]")}


def sample(path: str, interval_s: float, traced: bool) -> None:
    previous = None
    start = time.time()
    while True:
        row = {"t_s": round(time.time() - start, 1), **proc_figures(), **mappings(), **mallinfo2()}
        if traced:
            snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
            row["traced_mib"] = sum(s.size for s in snapshot.statistics("filename")) / 2**20
            if previous is not None:
                grown = [s for s in snapshot.compare_to(previous, "lineno") if s.size_diff > 0][:10]
                row["grown"] = [[str(s.traceback[0]), round(s.size_diff / 1024, 1), s.count_diff] for s in grown]
            previous = snapshot
        with open(path, "a") as out:
            out.write(json.dumps(row) + "\n")
        time.sleep(interval_s)


def trim_every(seconds: float) -> None:
    """The candidate fix tried without touching the engine: glibc's malloc_trim(0) from a side thread."""
    libc = ctypes.CDLL("libc.so.6")
    while True:
        time.sleep(seconds)
        libc.malloc_trim(0)


def main() -> int:
    split = sys.argv.index("--")
    path, interval = sys.argv[1], float(sys.argv[2])
    frames = int(sys.argv[3]) if split > 3 else 0
    trim = float(sys.argv[4]) if split > 4 else 0.0
    if trim:
        threading.Thread(target=trim_every, args=(trim,), daemon=True, name="memprobe-trim").start()
    if frames:
        tracemalloc.start(frames)
    threading.Thread(target=sample, args=(path, interval, bool(frames)), daemon=True, name="memprobe").start()
    from gates.cli import main as cli

    return cli(sys.argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main())
