"""Device tier: a fixed pool of block tensors on the engine's device (CUDA when present)."""

from __future__ import annotations

import torch

from cache_impl.cache.keys import KVLayout
from cache_impl.cache.tiers.slots import SlotPool


class DeviceTier(SlotPool):
    name = "device"

    def __init__(self, layout: KVLayout, num_slots: int, device: torch.device) -> None:
        super().__init__(layout, num_slots, device)
        self.device = device
