"""The interface every tier implements: a store of immutable blocks by key.

Capacity, recency and placement are the manager's business (`cache_impl.cache.placement`); a
tier only keeps and moves bytes, and the tiers that keep bytes outside this process (disk,
shared pool) verify every read. The manager talks to a tier through these verbs alone:

- `stage(key, block)` then `commit(staged)` or `abort(staged)`: a write in two steps. The
  staged bytes are invisible until `commit` publishes them whole (atomically); after a failed
  or aborted write nothing is visible. `write_block` does both.
- `read_into(keys, outs)`: copy blocks into caller tensors (any CPU or device tensors of the
  block's shape, views included); per key None on success or the reason it was refused.
- `view(key)`: the block's bytes in place when the tier holds them in this process's memory
  (a source for demotion without a copy), else None.
- `contains(keys)`: which keys the tier holds now (not verified; for a tier others write into).
- `discover()`: blocks the tier already holds when it opens: (key, None, mtime) per good one,
  (None, reason, 0.0) per block refused and removed.
- `delete(key)`: forget a block; never raises.
- `free_bytes()`: room left on the medium beneath the tier (a filesystem), None when the
  tier's capacity is all there is.
- `drop_page_cache()`: make the next reads cold (no-op where there is no page cache).
- `snapshot()`: the tier's own state for metrics (e.g. a pool's availability); `close()`.

Attributes: `name`; `stored_nbytes` (bytes one block occupies, for capacity accounting);
`accounted` (False: the tier manages its own capacity and what it holds cannot be known
here, e.g. a pool shared by nodes; the manager keeps no index or LRU for it); `shared`
(other nodes write into it: after the local prefix, the manager asks `contains`).
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
