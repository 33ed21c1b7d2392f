"""Device tier: a fixed pool of block tensors on the engine's device."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..keys import Key, KVLayout


class DeviceTier:
    """`num_slots` blocks preallocated as one tensor [slots, layers, 2, kv_heads, block, head_dim].

    A slot is reserved for a key (the load or store is copying into it), then
    committed (readable) or aborted (freed).
    """

    name = "device"
    persistent = False

    def __init__(self, layout: KVLayout, num_slots: int, device: torch.device) -> None:
        self.device = device
        self.pool = torch.zeros((num_slots, *layout.block_shape), dtype=layout.torch_dtype, device=device)
        self.stored_nbytes = layout.block_nbytes
        self._slot_of: dict[Key, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def holds(self, key: Key) -> bool:
        """True when a slot is reserved or committed for the key."""
        return key in self._slot_of

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
            raise MemoryError("device tier: no free slot (the manager evicts before writing)")
        slot.copy_(block, non_blocking=False)

    def read_into(self, keys: Sequence[Key], outs: Sequence[torch.Tensor]) -> list[Optional[str]]:
        for key, out in zip(keys, outs):
            out.copy_(self.view(key))
        return [None] * len(keys)

    def delete(self, key: Key) -> None:
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._free.append(slot)
