"""The interface every tier implements: a store of immutable blocks by key.

Capacity, recency and placement are the manager's business (see
`cache_impl.lru` and `cache_impl.manager`); a tier only moves bytes, and
the tiers that store bytes outside this process (disk, remote pool) verify them. Verbs:

- `write(key, block)`: store a whole block; atomic (a failure leaves nothing visible).
- `read_into(keys, outs)`: copy blocks into caller tensors; returns, per key,
  None on success or the reason the block was refused (it is then a miss).
- `delete(key)`: forget a block.
- `stored_nbytes`: bytes one block occupies on this tier (capacity accounting).
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence

import torch

from ..keys import Key


class Tier(Protocol):
    name: str
    stored_nbytes: int

    def write(self, key: Key, block: torch.Tensor) -> None: ...

    def read_into(self, keys: Sequence[Key], outs: Sequence[torch.Tensor]) -> list[Optional[str]]: ...

    def delete(self, key: Key) -> None: ...
