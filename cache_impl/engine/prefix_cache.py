"""A sequence's KV to and from the tiered cache, a block at a time.

At the start its longest cached prefix is loaded straight into its KV (every full block of the
prompt may come from the cache); its full blocks are offered to the cache as they fill; once the
first token is out, the loaded prefix is promoted to the upper tiers (off the TTFT path). With no
cache (recompute mode) each is a no-op.
"""

from __future__ import annotations

import collections
import functools
from typing import TYPE_CHECKING, Optional

from cache_impl.engine.sequence import Sequence

if TYPE_CHECKING:
    import torch

    from cache_impl.cache.manager import TieredKVCache


class PrefixCache:
    def __init__(self, cache: Optional["TieredKVCache"], block_size: int, counters: collections.Counter[str]) -> None:
        self.cache, self.block_size, self.counters = cache, block_size, counters

    def load(self, seq: Sequence) -> None:
        """Load the longest cached prefix into the sequence's KV; it counts as computed."""
        if self.cache is None:
            return
        prefix = self.cache.load_into(seq.prompt_ids, functools.partial(self._block_view, seq))
        seq.computed = seq.cached_tokens = prefix.num_tokens
        seq.stored_blocks = seq.loaded_blocks = prefix.num_blocks
        self.counters["prompt_tokens_reused"] += seq.cached_tokens

    def store_full_blocks(self, seq: Sequence) -> None:
        """Offer the cache every full block computed since the last call."""
        if self.cache is None:
            return
        full = seq.computed // self.block_size
        if full <= seq.stored_blocks:
            return
        blocks = [self._block_view(seq, i) for i in range(seq.stored_blocks, full)]
        self.cache.store(seq.token_ids(full * self.block_size), blocks, first_block=seq.stored_blocks)
        seq.stored_blocks = full

    def promote_loaded(self, seq: Sequence) -> None:
        """Once the first token is out: keep the loaded prefix on the upper tiers (once)."""
        if self.cache is None or not seq.loaded_blocks:
            return
        n, seq.loaded_blocks = seq.loaded_blocks, 0
        self.cache.promote(seq.token_ids(n * self.block_size), [self._block_view(seq, i) for i in range(n)])

    def _block_view(self, seq: Sequence, i: int) -> "torch.Tensor":
        """Block i of the sequence's KV, [layers, 2, kv_heads, block, head_dim] (a view)."""
        return seq.kv[:, :, :, i * self.block_size : (i + 1) * self.block_size]
