"""One OpenMP thread for a helper thread's torch operations, so that helper threads start no thread teams.

On the CPU torch parallelises an operation over OpenMP, and OpenMP keeps a team of worker
threads for every thread that has entered a parallel region: a disk reader or write-behind worker
that copies a large tensor once gets a team of its own (cores - 1 threads) that lives as long as
the process. In a 2-hour G4 soak of the embedded candidate the server's threads went 29 -> 30 at
about 1,400 s, a libgomp worker (gdb: gomp_thread_start) under a pool thread that had just run its
first large copy: a step a soak reads as a leak (1 per 2 hours projects to 36 over 72 h), and on
a 64-core host a step of 63. The engine's thread, which runs the model, keeps torch's setting.

The engine's thread must also be the only thread with a team: libgomp counts every team's workers, and once
they outnumber the cores its workers sleep between parallel regions instead of spinning. A server whose main
thread ran one parallel operation (building the model) prefilled 8k tokens in 1.42 s where the same thread
alone took 1.17 s (2 cores: 14,000 context switches against 120). `hand_threads_to_engine` keeps the main
thread out of it.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Optional

import torch

OPENMP_LIBRARIES = ("libgomp", "libiomp5", "libomp")   # GNU (torch's Linux wheels), Intel, LLVM


@functools.lru_cache(maxsize=1)
def _loaded_openmp() -> Optional[ctypes.CDLL]:
    """The OpenMP runtime torch has loaded (the one its parallel regions use), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if any(name in line for name in OPENMP_LIBRARIES)}
    except OSError:
        return None  # no /proc (macOS): torch's OpenMP is left as it is
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0))
        except OSError:
            continue
    return None


def one_openmp_thread_here() -> bool:
    """This thread's torch operations run on it alone from now on (no OpenMP team started for it).
    False where no OpenMP runtime is loaded (nothing to limit)."""
    torch.get_num_threads()   # torch sets each thread's OpenMP count on its first use: let it, then lower it
    omp = _loaded_openmp()
    if omp is None:
        return False
    omp.omp_set_num_threads(1)
    return True


def hand_threads_to_engine() -> int:
    """Called on a server's main thread before it builds the engine: returns torch's thread count here (the
    engine thread takes it, `Engine(threads=...)`), and from now on this thread's own torch operations run on it
    alone, so the engine's team is the process's only one."""
    threads = torch.get_num_threads()
    one_openmp_thread_here()
    return threads
