"""A fixed pool of block-sized slots in one preallocated tensor (used by the device and host tiers)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..buffers import aligned_empty
from ..keys import Key, KVLayout


class SlotPool:
    """`num_slots` blocks as one tensor [slots, layers, 2, kv_heads, block, head_dim]; pages are
    touched (and counted in RSS) as slots are first used.

    One allocation keeps copies large and regular (and pins host memory once,
    not per block); it is page-aligned, so the disk tier can read into a slot with O_DIRECT.
    A slot is reserved for a key, filled, and freed on delete.
    """

    name: str

    def __init__(self, layout: KVLayout, num_slots: int, device: torch.device, pin_memory: bool = False) -> None:
        self.pool = aligned_empty((num_slots, *layout.block_shape), layout.torch_dtype, device, pin_memory=pin_memory)
        self.stored_nbytes = layout.block_nbytes
        self._slot_of: dict[Key, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def reserve(self, key: Key) -> Optional[torch.Tensor]:
        """The slot tensor to copy the key's block into, or None when no slot is free."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._slot_of[key] = slot
        return self.pool[slot]

    def view(self, key: Key) -> torch.Tensor:
        return self.pool[self._slot_of[key]]

    def write(self, key: Key, block: torch.Tensor) -> None:
        slot = self.reserve(key)
        if slot is None:
            raise MemoryError(f"{self.name} tier: no free slot (the manager evicts before writing)")
        slot.copy_(block)

    def read_into(self, keys: Sequence[Key], outs: Sequence[torch.Tensor]) -> list[Optional[str]]:
        for key, out in zip(keys, outs):
            out.copy_(self.view(key), non_blocking=True)
        if self.pool.is_cuda or any(out.is_cuda for out in outs):
            torch.cuda.current_stream().synchronize()
        return [None] * len(keys)

    def delete(self, key: Key) -> None:
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._free.append(slot)
