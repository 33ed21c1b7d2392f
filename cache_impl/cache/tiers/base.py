"""The interface every tier implements: a store of immutable blocks by key.

How it works: docs/methods/cache-and-engines.md (cache_impl/cache/tiers/base.py).
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Protocol, Sequence

import torch

from cache_impl.cache.keys import Key

Discovered = tuple[Optional[Key], Optional[str], float]


class Tier(Protocol):
    name: str
    stored_nbytes: int
    accounted: bool
    shared: bool

    def stage(self, key: Key, block: torch.Tensor) -> Any: ...

    def commit(self, staged: Any) -> None: ...

    def abort(self, staged: Any) -> None: ...

    def read_into(self, keys: Sequence[Key], outs: Sequence[torch.Tensor]) -> list[Optional[str]]: ...

    def view(self, key: Key) -> Optional[torch.Tensor]: ...

    def contains(self, keys: Sequence[Key]) -> list[bool]: ...

    def discover(self) -> Iterator[Discovered]: ...

    def delete(self, key: Key) -> None: ...

    def free_bytes(self) -> Optional[int]: ...

    def drop_page_cache(self) -> None: ...

    def snapshot(self) -> dict: ...

    def close(self) -> None: ...


def write_block(tier: Tier, key: Key, block: torch.Tensor) -> None:
    """Stage and commit one block; on any error the staged bytes are discarded and the error raised."""
    staged = tier.stage(key, block)
    try:
        tier.commit(staged)
    except BaseException:
        tier.abort(staged)
        raise


def cpu_bytes(block: torch.Tensor):
    """The block's bytes as a flat uint8 numpy array on the CPU (no copy when already there and contiguous)."""
    cpu = block.detach().to("cpu").contiguous()
    return cpu.view(-1).view(torch.uint8).numpy()
