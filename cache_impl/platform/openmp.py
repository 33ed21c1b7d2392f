"""One OpenMP thread for a helper thread's torch operations, so that helper threads start no thread teams.

How it works: docs/methods/cache-and-engines.md (cache_impl/platform/openmp.py).
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
