"""Write-behind: blocks are written to a lower tier on background threads (one class for every such tier).

A queued block is a private CPU copy (the caller's slot may be reused at once). It stays
queued until the tier has published it whole or the write failed; `on_done` then tells the
cache which, under the cache's lock. A write that fails because the medium is full (ENOSPC)
asks `make_room` to free space and is tried once more.
"""

from __future__ import annotations

import errno
import threading
from typing import Callable, Optional

import torch

from cache_impl.cache.keys import Key
from cache_impl.cache.tiers.base import Tier, write_block
from cache_impl.platform.thread_pools import started_pool

WORKERS = 2


class WriteBehind:
    """Queued writes to one tier. `lock` is the cache's condition: state changes happen under it."""

    def __init__(self, tier: Tier, lock: threading.Condition,
                 on_done: Callable[[Key, Optional[BaseException]], None],
                 make_room: Callable[[Key], bool]) -> None:
        self.tier = tier
        self._lock = lock
        self._on_done = on_done
        self._make_room = make_room
        self._pending: dict[Key, int] = {}
        self.pending_bytes = 0
        self.retried = 0
        self._pool = started_pool(WORKERS, f"kv-{tier.name}-write")

    def __contains__(self, key: object) -> bool:     # placement asks with its own key type (any hashable)
        return key in self._pending

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, key: Key, block: torch.Tensor) -> None:
        """Queue a write of a private CPU copy of `block` (call with the lock held)."""
        private = block.detach().to("cpu", copy=True)
        self._pending[key] = private.nbytes
        self.pending_bytes += private.nbytes
        self._pool.submit(self._write, key, private)

    def _write(self, key: Key, block: torch.Tensor) -> None:
        error = self._attempt(key, block)
        if isinstance(error, OSError) and error.errno == errno.ENOSPC and self._make_room(key):
            self.retried += 1
            error = self._attempt(key, block)
        with self._lock:
            self.pending_bytes -= self._pending.pop(key)
            self._on_done(key, error)
            self._lock.notify_all()

    def _attempt(self, key: Key, block: torch.Tensor) -> Optional[BaseException]:
        try:
            write_block(self.tier, key, block)
        except Exception as error:  # ENOSPC, EIO, an unavailable pool: the block is simply not there
            return error
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=True)
