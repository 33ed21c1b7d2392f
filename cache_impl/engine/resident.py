"""How much of some host tensors' memory is in RAM now: mincore(2) over the pages of their storages.

A tensor's bytes are not its resident memory: a fresh mapping has none until its pages are first
touched, and a buffer used only in part holds only that part. What a server reports as memory it
holds by design (and a soak leaves out of its growth) must be the pages, or a new, still untouched
buffer reads as memory the process does not have. Tensors that share pages count them once; a
tensor that is not in host memory (on a GPU) holds none.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from typing import Iterable

import numpy as np
import torch

PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
if _libc is not None:
    _libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
    _libc.mincore.restype = ctypes.c_int


def _storage_span(tensor: torch.Tensor) -> tuple[int, int]:
    """The [start, end) addresses of the memory that holds a tensor: its whole storage, which a view keeps
    alive (and whose pages beyond the view the kernel may have backed too, a huge page's worth)."""
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _page_ranges(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """The page-aligned [start, end) address ranges the host tensors span, merged where they overlap."""
    spans = sorted(
        (start // PAGE * PAGE, -(-end // PAGE) * PAGE)
        for start, end in map(_storage_span, (t for t in tensors if t.device.type == "cpu" and t.nbytes > 0))
    )
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def resident_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the pages under `tensors`' storages that are in RAM now (whole pages: a storage smaller than a
    page counts its page). Off Linux, where mincore is not at hand, the storages' page spans in full."""
    ranges = _page_ranges(tensors)
    if _libc is None:
        return sum(end - start for start, end in ranges)
    total = 0
    for start, end in ranges:
        pages = (end - start) // PAGE
        vector = (ctypes.c_ubyte * pages)()
        if _libc.mincore(start, end - start, vector) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"mincore over {end - start} bytes at {start:#x}: {os.strerror(error)}")
        # through a memoryview: numpy's stubs take a ctypes array as a buffer from Python 3.12 only
        total += PAGE * int(np.count_nonzero(np.frombuffer(memoryview(vector), dtype=np.uint8) & 1))
    return total
