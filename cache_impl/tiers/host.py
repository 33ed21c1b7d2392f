"""Host tier: blocks in DRAM (pinned when CUDA is present, for fast device copies)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..keys import Key, KVLayout


class HostTier:
    name = "host"
    persistent = False

    def __init__(self, layout: KVLayout, pin_memory: bool) -> None:
        self.layout = layout
        self.pin_memory = pin_memory
        self.stored_nbytes = layout.block_nbytes
        self._blocks: dict[Key, torch.Tensor] = {}

    def get(self, key: Key) -> torch.Tensor:
        """The stored tensor itself (immutable by contract: never write into it)."""
        return self._blocks[key]

    def write(self, key: Key, block: torch.Tensor) -> None:
        copy = torch.empty(self.layout.block_shape, dtype=self.layout.torch_dtype, pin_memory=self.pin_memory)
        copy.copy_(block)
        self._blocks[key] = copy

    def read_into(self, keys: Sequence[Key], outs: Sequence[torch.Tensor]) -> list[Optional[str]]:
        for key, out in zip(keys, outs):
            out.copy_(self._blocks[key], non_blocking=self.pin_memory)
        if self.pin_memory and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()
        return [None] * len(keys)

    def delete(self, key: Key) -> None:
        self._blocks.pop(key, None)
