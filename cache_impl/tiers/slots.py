"""A fixed pool of block-sized slots in one preallocated tensor (the device and host tiers)."""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

import torch

from ..buffers import aligned_empty
from ..keys import Key, KVLayout
from .base import Discovered


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
        self._free = list(range(num_slots - 1, -1, -1))

    def stage(self, key: Key, block: torch.Tensor) -> Key:
        if not self._free:
            raise MemoryError(f"{self.name} tier: no free slot (the manager makes room before writing)")
        slot = self._free.pop()
        self._slot_of[key] = slot
        self.pool[slot].copy_(block)
        return key

    def commit(self, staged: Key) -> None:
        """Nothing to publish: the block is visible once the manager indexes it."""

    def abort(self, staged: Key) -> None:
        self.delete(staged)

    def read_into(self, keys: Sequence[Key], outs: Sequence[torch.Tensor]) -> list[Optional[str]]:
        for key, out in zip(keys, outs):
            out.copy_(self.pool[self._slot_of[key]], non_blocking=True)
        if self.pool.is_cuda or any(out.is_cuda for out in outs):
            torch.cuda.current_stream().synchronize()
        return [None] * len(keys)

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
        return {}

    def close(self) -> None:
        """The pool is freed with the object."""
