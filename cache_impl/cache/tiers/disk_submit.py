"""The disk tier's O_DIRECT reads through native AIO: one thread keeps `depth` block reads in flight.

How it works: docs/methods/storage-best.md (cache_impl/cache/tiers/disk_submit.py). Each block file is
opened (as the tier opens it: no link followed), its read (the header into a slot of this reader's own
aligned buffer, the payload straight into the caller's spans) handed to the kernel at once, and every
completion verified as it is reaped, which frees its slot for the next block: a queue kept `depth` deep
as fio's libaio engine keeps it, with no thread woken per read.
"""

from __future__ import annotations

import os
from typing import Callable, Optional, Sequence

import torch

from cache_impl.cache import integrity
from cache_impl.cache.keys import Key
from cache_impl.platform.buffers import Spans, aligned_empty
from cache_impl.platform.kernel_aio import AioContext

# (key, header read, payload buffers, bytes read) -> None when the block is whole and ours, else why not
Check = Callable[[Key, memoryview, Sequence[memoryview], int], Optional[str]]


class SubmittedReads:
    """One thread's AIO context for a tier: `depth` slots, each with an aligned header buffer."""

    def __init__(self, depth: int) -> None:
        self.context = AioContext(depth, integrity.IOV_MAX)
        self._headers = aligned_empty((depth, integrity.HEADER_BYTES), torch.uint8, "cpu")
        base = self._headers.data_ptr()
        self.header_regions = [(base + slot * integrity.HEADER_BYTES, integrity.HEADER_BYTES)
                               for slot in range(depth)]
        self.header_views = [row.numpy().data for row in self._headers]

    def close(self) -> None:
        self.context.close()


def read_submitted(reads: SubmittedReads, open_block: Callable[[Key], int], keys: Sequence[Key],
                   spans_of: Callable[[int], Optional[Spans]], check: Check, reasons: list[Optional[str]]) -> list[int]:
    """Read each key's block into its spans, `reads.context.depth` in flight, setting `reasons[i]` to None (ok) or why
    block i was refused; returns the indices left to the caller: those whose `spans_of(i)` is None (an out
    this read cannot take).

    Each block's spans are asked for just before its read is submitted (the reads before it are in flight
    meanwhile). `open_block` opens a block file for O_DIRECT reading (FileNotFoundError: missing; other
    OSError: an I/O error). Returns only when no read is left in flight, on an exception too.
    """
    context = reads.context
    free = list(range(reads.context.depth))
    in_flight: dict[int, tuple[int, int, Spans]] = {}  # slot -> (index, fd, spans)
    left: list[int] = []
    following = 0
    try:
        while following < len(keys) or in_flight:
            while free and following < len(keys):
                index, following = following, following + 1
                spans = spans_of(index)
                if spans is None:
                    left.append(index)
                    continue
                try:
                    fd = open_block(keys[index])
                except FileNotFoundError:
                    reasons[index] = integrity.MISSING
                    continue
                except OSError:
                    reasons[index] = integrity.IO_ERROR
                    continue
                slot = free.pop()
                try:
                    context.submit_preadv(slot, fd, [reads.header_regions[slot], *spans.regions])
                except OSError:
                    os.close(fd)
                    free.append(slot)
                    reasons[index] = integrity.IO_ERROR
                    continue
                in_flight[slot] = (index, fd, spans)
            if not in_flight:
                break
            reaped = [(done, in_flight.pop(done.tag)) for done in context.reap()]  # none left behind by an error
            for _, (_, fd, _) in reaped:
                os.close(fd)
            for done, (index, _, spans) in reaped:
                reasons[index] = (integrity.IO_ERROR if done.result < 0 else
                                  check(keys[index], reads.header_views[done.tag], spans.views, done.result))
                free.append(done.tag)
    finally:
        while in_flight:  # an exception: the kernel still writes into these buffers until each read is reaped
            for done in context.reap():
                os.close(in_flight.pop(done.tag)[1])
    return left
