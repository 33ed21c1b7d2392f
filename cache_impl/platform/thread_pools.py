"""Thread pools whose every worker is started, and has set itself up, before the first task.

A `ThreadPoolExecutor` starts a worker only when a task finds none idle, so a pool of 16 disk
readers served by 3 while reads are fast grows to 16 the first time they are slow. Each new worker
brings its stack, its thread-local staging buffers and, under glibc, a malloc arena of its own: in
G4 soaks of the embedded candidate the server's memory outside the cache pools stepped up 15-20
MiB and its threads from 15 to 17 at the first slow_disk and disk_full faults, then held (a bounded
step, but one that a 30-minute soak reads as a leak of 40 MiB/h); the event loop's default executor
(`asyncio.to_thread`) added a thread at each of the first faults' admin calls, 23 to 27 in 45 minutes,
which projected over 72 h is hundreds. Started at once, a pool's threads and memory are spent while
the server starts and stay level through faults. Each worker's torch operations run on that worker
alone (`cache_impl.platform.openmp`): a pool thread starts no OpenMP team of its own.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Optional

from cache_impl.platform.openmp import one_openmp_thread_here

START_TIMEOUT_S = 60.0


def started_pool(workers: int, name: str, set_up: Optional[Callable[[], object]] = None) -> ThreadPoolExecutor:
    """A pool of `workers` threads named `name`-N, all running, each having called `set_up()` (its
    thread-local buffers) before this returns. RuntimeError when they do not all start in time."""
    pool = ThreadPoolExecutor(workers, thread_name_prefix=name)
    ready = threading.Barrier(workers + 1, timeout=START_TIMEOUT_S)

    def start() -> None:                       # each waits for the others: the pool must start a new worker
        try:
            one_openmp_thread_here()
            if set_up is not None:
                set_up()
        except BaseException:
            ready.abort()                      # the others (and the caller) stop waiting at once
            raise
        ready.wait()

    started = [pool.submit(start) for _ in range(workers)]
    try:
        ready.wait()
    except threading.BrokenBarrierError:
        pool.shutdown(wait=False)
        wait(started, timeout=5.0)             # the barrier is broken: each worker ends at once (but a hung one)
        failed = [f.exception() for f in started if f.done()
                  and f.exception() is not None and not isinstance(f.exception(), threading.BrokenBarrierError)]
        if failed:
            raise RuntimeError(f"{name}: a pool thread's set-up failed: {failed[0]}") from failed[0]
        raise RuntimeError(f"{name}: {workers} pool threads did not start within {START_TIMEOUT_S:g} s") from None
    for future in started:
        future.result()
    return pool


def loop_offload_pool() -> ThreadPoolExecutor:
    """An event loop's default executor (`asyncio.to_thread`), started whole: as many threads as asyncio's own
    default would make one at a time (min(32, CPUs + 4))."""
    return started_pool(min(32, (os.cpu_count() or 1) + 4), "kv-loop-offload")
