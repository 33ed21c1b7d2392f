"""Host tier: a DRAM pool of blocks (pinned when CUDA is present, for fast device copies)."""

from __future__ import annotations

import torch

from cache_impl.cache.keys import KVLayout
from cache_impl.cache.tiers.slots import SlotPool


class HostTier(SlotPool):
    name = "host"

    def __init__(self, layout: KVLayout, capacity_bytes: int, pin_memory: bool) -> None:
        super().__init__(layout, capacity_bytes // layout.block_nbytes, torch.device("cpu"), pin_memory=pin_memory)
