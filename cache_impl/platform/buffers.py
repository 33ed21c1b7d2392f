"""Host memory the disk tier can read into directly: aligned tensors and a tensor's bytes as spans.

O_DIRECT reads need every buffer's address and length aligned (4096 bytes is safe on every
device), and `os.preadv` takes a list of contiguous buffers. `aligned_empty` makes tensors whose
data starts on such a boundary (pinned when asked and CUDA is present, so device copies are
fast; from 2 MiB up, in transparent huge pages). Huge pages because a read request's size is bounded
by how many physically separate pieces of memory it lands in (a queue's `max_segments`: 254 on the
development VM's virtio disk, ~1 MiB of 4 KiB pages), and that storage's rate follows its request
size: O_DIRECT reads of 16 and 64 MiB block files into 4 KiB pages made 0.6-1.7 MiB requests and read
at 0.5-1.4 GB/s, into huge pages 3.2-3.8 MiB requests at 2.3-2.9 GB/s (fio's best buffered job beside
them: 1.5-2.0). And `byte_spans` gives a CPU tensor's bytes as contiguous memoryviews in logical order,
so a block-shaped view of a request's KV, [layers, 2, kv_heads, total, head_dim][..., i*bs:(i+1)*bs, :],
is read with one preadv of layers * 2 * kv_heads spans instead of through a scratch buffer.
"""

from __future__ import annotations

import ctypes
import math
import mmap
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

ALIGN = 4096
HUGE_PAGE = 2 * 2**20


def aligned_empty(shape: Sequence[int], dtype: torch.dtype, device, pin_memory: bool = False,
                  align: int = ALIGN) -> torch.Tensor:
    """An uninitialised contiguous tensor whose data pointer is a multiple of `align` (host memory).

    A device tensor is returned as torch allocates it; host memory is pinned only when asked and
    CUDA is present (pinning needs a driver).
    """
    device = torch.device(device)
    if device.type != "cpu":
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    pin = pin_memory and torch.cuda.is_available()
    if not pin and nbytes >= HUGE_PAGE:
        return huge_page_empty(nbytes).view(dtype).view(tuple(shape))
    raw = torch.empty(nbytes + align, dtype=torch.uint8, pin_memory=pin)
    start = -raw.data_ptr() % align
    return raw[start : start + nbytes].view(dtype).view(tuple(shape))


def huge_page_empty(nbytes: int) -> torch.Tensor:
    """`nbytes` of private anonymous memory starting on a 2 MiB boundary, asked to be backed by
    transparent huge pages (madvise MADV_HUGEPAGE; the kernel may still give 4 KiB pages, e.g. when
    THP is off: the memory works the same, only slower to read into). As a flat uint8 tensor that
    keeps the mapping alive; the mapping is unmapped when the tensor's storage goes."""
    try:
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as error:  # said as torch's allocator says it
        raise MemoryError(f"can't allocate memory: you tried to allocate {nbytes} bytes ({error.strerror})") from None
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    return raw[start : start + nbytes]


@dataclass(frozen=True)
class Spans:
    """A tensor's bytes as contiguous buffers in logical order; `aligned`: every address and length is
    a multiple of the alignment asked for (what O_DIRECT needs). The views point into the tensor's
    memory: they are valid while `owner` (the tensor) lives, so keep this object while using them."""

    views: list[memoryview]
    nbytes: int
    aligned: bool
    owner: torch.Tensor
    regions: list[tuple[int, int]]  # (address, length) per view, for calls that take raw memory


def _collapsed(shape: Sequence[int], strides: Sequence[int]) -> list[tuple[int, int]]:
    """(size, stride) per dimension, merging a dimension into the next inner one when they are one run."""
    dims: list[tuple[int, int]] = []
    for size, stride in reversed([(s, st) for s, st in zip(shape, strides) if s != 1]):
        if dims and stride == dims[-1][0] * dims[-1][1]:
            inner_size, inner_stride = dims.pop()
            dims.append((size * inner_size, inner_stride))
        else:
            dims.append((size, stride))
    return list(reversed(dims)) or [(1, 1)]


def _memory(address: int, nbytes: int) -> memoryview:
    # A view of raw memory (numpy has no bfloat16, and going through it costs tens of microseconds a block).
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def byte_spans(tensor: torch.Tensor, align: int = ALIGN) -> Spans | None:
    """A CPU tensor's bytes as spans, or None when its innermost run is not contiguous (or it is
    not on the CPU)."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return None
    address, itemsize = tensor.data_ptr(), tensor.element_size()
    if tensor.is_contiguous():
        nbytes = tensor.numel() * itemsize
        return Spans([_memory(address, nbytes)], nbytes, address % align == 0 and nbytes % align == 0, tensor,
                     [(address, nbytes)])
    dims = _collapsed(tensor.shape, tensor.stride())
    if dims[-1][1] != 1 or any(stride < 0 for _, stride in dims):
        return None
    span = dims[-1][0] * itemsize
    outer_strides = [stride * itemsize for _, stride in dims[:-1]]
    offsets = np.zeros((), dtype=np.int64)
    for size, stride in zip((size for size, _ in dims[:-1]), outer_strides):
        offsets = np.add.outer(offsets, np.arange(size, dtype=np.int64) * stride)
    starts = offsets.ravel().tolist()
    memory = _memory(address, max(starts) + span)
    views = [memory[start : start + span] for start in starts]
    aligned = address % align == 0 and all(x % align == 0 for x in (span, *outer_strides))
    return Spans(views, span * len(views), aligned, tensor, [(address + start, span) for start in starts])
