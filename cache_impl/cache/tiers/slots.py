"""A fixed pool of block-sized slots in one preallocated tensor (the device and host tiers)."""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

import torch

from cache_impl.cache.keys import Key, KVLayout
from cache_impl.cache.tiers.base import Discovered
from cache_impl.platform.buffers import aligned_empty


class SlotPool:
    """`num_slots` blocks as one tensor [slots, layers, 2, kv_heads, block, head_dim]; pages are
    touched (and counted in RSS) as slots are first used.

    One allocation keeps copies large and regular (and pins host memory once, not per block).
    A write takes a free slot and copies into it; the manager indexes the block once it is
    there, so a staged slot is invisible until then.
    """

    name: str
    accounted = True
    shared = False

    def __init__(self, layout: KVLayout, num_slots: int, device: torch.device, pin_memory: bool = False) -> None:
        self.pool = aligned_empty((num_slots, *layout.block_shape), layout.torch_dtype, device, pin_memory=pin_memory)
        self.num_slots = num_slots
        self.stored_nbytes = layout.block_nbytes
        self._slot_of: dict[Key, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))   # a stack: freed slots are taken again first
        # slots whose pages are resident: pinned memory is resident whole; else the slots used so far, which
        # (the free list being a stack taken lowest first) are the slots below the highest one ever taken
        self._resident_slots = num_slots if pin_memory else 0
        self._in_process = self.pool.device.type == "cpu"

    def stage(self, key: Key, block: torch.Tensor) -> Key:
        if not self._free:
            raise MemoryError(f"{self.name} tier: no free slot (the manager makes room before writing)")
        slot = self._free.pop()
        self._resident_slots = max(self._resident_slots, slot + 1)
        self._slot_of[key] = slot
        self.pool[slot].copy_(block)
        return key

    def commit(self, staged: Key) -> None:
        """Nothing to publish: the block is visible once the manager indexes it."""

    def abort(self, staged: Key) -> None:
        self.delete(staged)

    def read_into(self, keys: Sequence[Key], outs: Sequence[torch.Tensor]) -> list[Optional[str]]:
        """Copy each key's slot into its out: one copy per run of consecutive slots whose outs follow one
        another in one contiguous piece of memory (a prefix stored in order and loaded into one tensor
        is one copy, not a copy per block: at 1 MiB blocks 256 copies ran at 0.84 of one)."""
        slots = [self._slot_of[key] for key in keys]
        for first, count in _runs(slots, outs):
            self._copy_run(slots[first], count, outs[first])
        if self.pool.is_cuda or any(out.is_cuda for out in outs):
            torch.cuda.current_stream().synchronize()
        return [None] * len(keys)

    def _copy_run(self, slot: int, count: int, first_out: torch.Tensor) -> None:
        if count == 1:
            first_out.copy_(self.pool[slot], non_blocking=True)
            return
        run = torch.empty(0, dtype=first_out.dtype, device=first_out.device)
        shape = (count, *first_out.shape)
        run.set_(first_out.untyped_storage(), first_out.storage_offset(), shape, _contiguous_strides(shape))
        run.copy_(self.pool[slot : slot + count], non_blocking=True)

    def view(self, key: Key) -> Optional[torch.Tensor]:
        slot = self._slot_of.get(key)
        return None if slot is None else self.pool[slot]

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        return [key in self._slot_of for key in keys]

    def discover(self) -> Iterator[Discovered]:
        return iter(())  # memory starts empty

    def delete(self, key: Key) -> None:
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def free_bytes(self) -> Optional[int]:
        return None

    def drop_page_cache(self) -> None:
        """Memory has no page cache."""

    def snapshot(self) -> dict:
        """`resident_bytes`: the server's memory the pool holds now (its pages touched so far, which an eviction
        does not give back; none for a pool on a GPU): what G4 subtracts from the RSS, not the bytes in use."""
        return {"resident_bytes": self._resident_slots * self.stored_nbytes if self._in_process else 0}

    def close(self) -> None:
        """The pool is freed with the object."""


def _runs(slots: Sequence[int], outs: Sequence[torch.Tensor]) -> Iterator[tuple[int, int]]:
    """(first index, length) of each run where slot i+1 follows slot i and out i+1 starts where out i
    ends in the same storage, every out contiguous; a block on its own is a run of 1."""
    first = 0
    for i in range(1, len(slots) + 1):
        if i < len(slots) and slots[i] == slots[i - 1] + 1 and _follows(outs[i - 1], outs[i]):
            continue
        yield first, i - first
        first = i


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """C-contiguous strides of `shape`, as torch makes them (Tensor.set_'s default, which its stubs lack)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _follows(before: torch.Tensor, after: torch.Tensor) -> bool:
    return (before.is_contiguous() and after.is_contiguous() and before.dtype == after.dtype
            and before.device == after.device
            and before.untyped_storage().data_ptr() == after.untyped_storage().data_ptr()
            and after.data_ptr() == before.data_ptr() + before.numel() * before.element_size())
