"""Hit ratio per tier of a workload: its block-key sequence replayed through the tiers' capacities.

How it works: docs/methods/sizing-model.md (sizing/replay.py).
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass
from typing import Hashable, Iterable, Literal, Optional, Sequence, Union

from cache_impl.cache import integrity
from cache_impl.cache.config import CacheConfig
from cache_impl.cache.lru import LRUAccount
from cache_impl.cache.metrics import TierMetrics
from cache_impl.cache.placement import Level, Placement
from kvcore.settings import ConfigError

Key = Hashable              # a block's key (the cache's are bytes; any hashable replays the same)
WritePolicy = Literal["write-through", "write-back"]
WRITE_POLICIES = ("write-through", "write-back")
POOL_TIER = "remote"        # the shared pool's tier name (cache_impl.cache.tiers.remote)


@dataclass(frozen=True)
class TierCapacity:
    """One level, top-down: its name, whole blocks it holds (None: unbounded), and whether the cache
    accounts for it (False: a pool shared by nodes that manages its own capacity; last level only)."""

    name: str
    blocks: Optional[int]
    accounted: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"tiers.name: expected a tier name, found {self.name!r}")
        if self.blocks is not None and (type(self.blocks) is not int or self.blocks < 0):
            raise ConfigError(f"tiers.{self.name}.blocks: expected an integer >= 0 or None (unbounded), "
                              f"found {self.blocks!r}")


@dataclass(frozen=True)
class RequestKeys:
    """A request's block keys: its prompt's full blocks (looked up, then stored) and the blocks its
    generated tokens fill (stored after the first token; never looked up by this request)."""

    prompt: tuple[Key, ...]
    output: tuple[Key, ...] = ()


def tier_capacities(config: CacheConfig, block_nbytes: int, pool_blocks: Optional[int] = None) -> list[TierCapacity]:
    """The levels `TieredKVCache` builds from `config` for blocks of `block_nbytes` (its KV layout's):
    the device's slots; the host's slots (present when it holds one block); the disk's block files
    (4 KiB header + payload padded to 4 KiB each); the pool, unbounded unless `pool_blocks`."""
    levels = [TierCapacity("device", config.device_capacity_blocks)]
    if config.host_capacity_bytes >= block_nbytes:
        levels.append(TierCapacity("host", config.host_capacity_bytes // block_nbytes))
    if config.disk is not None:
        levels.append(TierCapacity("disk", config.disk.capacity_bytes // integrity.file_nbytes(block_nbytes)))
    if config.remote is not None:
        levels.append(TierCapacity(POOL_TIER, pool_blocks, accounted=False))
    return levels


# --------------------------------------------------------------------------- the cache on keys


UNBOUNDED = sys.maxsize     # the capacity, in blocks, of a level without one


class KeysOnlyTier:
    """A tier that records which keys it holds and their sizes, no bytes: one block is one unit of
    `stored_nbytes`, so a level of n blocks is an `LRUAccount` of n. An accounted tier's capacity is
    the cache's to keep (`Placement`); a pool (`accounted=False`, shared by nodes) keeps its own:
    `put` evicts its least recently put or read key, and its evictions count in `metrics`."""

    stored_nbytes = 1

    def __init__(self, name: str, accounted: bool = True, blocks: Optional[int] = None,
                 metrics: Optional[TierMetrics] = None) -> None:
        self.name, self.accounted, self.shared = name, accounted, not accounted
        self.keys: LRUAccount[Key] = LRUAccount(UNBOUNDED if accounted or blocks is None else blocks)
        self.metrics = metrics if metrics is not None else TierMetrics()

    def __contains__(self, key: Key) -> bool:
        return key in self.keys

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        """Which keys the tier holds (a lookup: refreshes none, as Redis's EXISTS)."""
        return [key in self.keys for key in keys]

    def put(self, key: Key) -> bool:
        """Hold a key (a put of one it holds refreshes it); False when it cannot fit at all."""
        if key in self.keys:
            self.keys.touch(key)
            return True
        if not self.accounted:  # an accounted tier's room was made by the cache
            victims = self.keys.victims(self.stored_nbytes, _unprotected)
            if victims is None:
                return False
            for victim in victims:
                self.keys.remove(victim)
                self.metrics.add("evictions")
        self.keys.add(key, self.stored_nbytes)
        return True

    def read(self, key: Key) -> None:
        self.keys.touch(key)

    def delete(self, key: Key) -> None:
        self.keys.remove(key)


def _unprotected(key: Key) -> bool:
    return False


SimLevel = Level[Key, KeysOnlyTier]     # a level of the cache on keys


class CacheSimulator:
    """`TieredKVCache`'s operations on keys: `load`, `store`, `promote`, each deciding with the cache's
    own `Placement` (index, LRU accounts, victims, demotion targets) over `KeysOnlyTier`s."""

    def __init__(self, capacities: Sequence[TierCapacity], write_policy: WritePolicy = "write-through",
                 _pool: Optional[SimLevel] = None) -> None:
        _check_levels(capacities, write_policy)
        through = write_policy == "write-through"
        self.write_policy = write_policy
        levels = [
            _level(rank, tier, rank == 0 or through or not tier.accounted) for rank, tier in enumerate(capacities)
        ]
        if _pool is not None and levels[-1].lru is None:
            levels[-1] = _pool               # a fleet's one pool, shared by every node's cache
        self.placement = Placement(levels)
        self.levels = self.placement.levels
        self.pool = levels[-1] if levels[-1].lru is None else None

    @classmethod
    def fleet(cls, nodes: int, capacities: Sequence[TierCapacity],
              write_policy: WritePolicy = "write-through") -> list["CacheSimulator"]:
        """`nodes` caches with their own local levels of `capacities` and, when its last level is a
        pool, that one pool shared by all (as kvgate's candidate nodes share the store it starts)."""
        if type(nodes) is not int or nodes < 1:
            raise ConfigError(f"nodes: expected an integer >= 1, found {nodes!r}")
        first = cls(capacities, write_policy)
        return [first] + [cls(capacities, write_policy, first.pool) for _ in range(nodes - 1)]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(level.name for level in self.levels)

    @property
    def blocks_written(self) -> int:
        """Blocks copied into a level so far (stored, promoted, demoted), every level's together (a pool shared
        by a fleet: every node's writes to it)."""
        return sum(level.metrics.counters["blocks_written"] for level in self.levels)

    def holders(self, key: Key) -> list[str]:
        """The levels that hold the block, top-down (`TieredKVCache.where`, the pool included)."""
        pool = [self.pool.name] if self.pool is not None and key in self.pool.tier else []
        return self.placement.where(key) + pool

    def _accounts(self) -> list[LRUAccount[Key]]:
        """Each level's keys in order of use: the cache's LRU account, or a pool's own."""
        return [level.lru if level.lru is not None else level.tier.keys for level in self.levels]

    def state(self) -> tuple[tuple[Key, ...], ...]:
        """What each level holds, least recently used first (a pool: least recently put or read first)."""
        return tuple(tuple(account) for account in self._accounts())

    def full(self) -> bool:
        """Every level holds as many blocks as it can (an unbounded one never does)."""
        return all(len(account) >= account.capacity_bytes for account in self._accounts())

    def load(self, keys: Sequence[Key]) -> list[int]:
        """Hit blocks per level (in level order) of the longest held prefix; refreshes each source."""
        hits = [0] * len(self.levels)
        for key, level in zip(keys, self._plan(keys)):
            hits[level.rank] += 1
            if level.lru is None:
                level.tier.read(key)
            else:
                self.placement.touch(level, key)
        return hits

    def _plan(self, keys: Sequence[Key]) -> list[SimLevel]:
        """The source level of each block of the longest prefix (`TieredKVCache._plan_load`): the pool
        is asked for its leading run of the blocks after the local prefix."""
        extra: dict[Key, int] = {}
        if self.pool is not None:
            rest = keys[len(self.placement.prefix(keys)):]
            held = sum(1 for _ in itertools.takewhile(bool, self.pool.tier.contains(rest)))
            extra = dict.fromkeys(rest[:held], self.pool.bit)
        return [self.placement.best(mask) for mask in self.placement.prefix(keys, extra)]

    def serve(self, request: RequestKeys) -> list[int]:
        """One request as the engine makes it: load its prompt's longest held prefix, store the rest of
        the prompt, promote the hits, store the blocks its output fills; its hit blocks per level."""
        row = self.load(request.prompt)
        self.after_prefill(request, sum(row))
        self.store(request.output)
        return row

    def after_prefill(self, request: RequestKeys, loaded: int) -> None:
        """What the engine does once a request's prompt is computed: store the blocks after its `loaded` prefix,
        then promote the loaded ones."""
        self.store(request.prompt[loaded:])
        if loaded:
            self.promote(request.prompt[:loaded])

    def store(self, keys: Iterable[Key]) -> int:
        """Store each block (`TieredKVCache._store_one`); returns how many were new."""
        stored = 0
        top, lower = self.levels[0], self.levels[1:]
        for key in keys:
            if self.placement.known(key):
                self.placement.touch_everywhere(key)
                continue
            fallback = not self._put(top, key)  # a block the device cannot take goes below at once
            for level in lower:
                if level.on_store or (fallback and level.lru is not None):
                    self._put(level, key)
            stored += 1
        return stored

    def promote(self, keys: Iterable[Key]) -> int:
        """Copy just-loaded blocks to every accounted level the policy stores to that lacks them
        (`TieredKVCache.promote`)."""
        placed = 0
        for key in keys:
            for level in self.levels:
                if level.on_store and level.lru is not None and not self.placement.holds(level, key):
                    placed += self._put(level, key)
            self.placement.touch_everywhere(key)
        return placed

    def _put(self, level: SimLevel, key: Key) -> bool:
        """Place a block on one level, evicting the victims placement picks first (`TieredKVCache._put`);
        False when it cannot fit. Each block the level did not hold counts in its metrics' "blocks_written"
        (the engine copied it there)."""
        if level.lru is None:
            new = key not in level.tier
            placed = level.tier.put(key)
            if placed and new:
                level.metrics.add("blocks_written")
            return placed
        victims = self.placement.victims(level, level.tier.stored_nbytes)
        if victims is None:
            level.metrics.add("stores_refused")
            return False
        for victim in victims:
            self._evict(level, victim)
        level.tier.put(key)
        self.placement.add(level, key)
        level.metrics.add("blocks_written")
        return True

    def _evict(self, level: SimLevel, key: Key) -> None:
        """Remove a block from a level, first demoting it to the nearest lower level that has or takes it
        (`TieredKVCache._evict`)."""
        level.metrics.add("evictions")
        for lower in self.placement.lower(level):
            if self.placement.holds(lower, key):
                break
            if self._put(lower, key):
                level.metrics.add("demotions")
                break
        level.tier.delete(key)
        self.placement.remove(level, key)


def _level(rank: int, capacity: TierCapacity, on_store: bool) -> SimLevel:
    """One level of the cache on keys: a keys-only tier and, when the cache accounts for it, its LRU account."""
    metrics = TierMetrics()
    tier = KeysOnlyTier(capacity.name, capacity.accounted, capacity.blocks, metrics)
    lru: Optional[LRUAccount[Key]] = (LRUAccount(UNBOUNDED if capacity.blocks is None else capacity.blocks)
                                      if capacity.accounted else None)
    return Level(rank, tier, metrics, lru, None, on_store)


# --------------------------------------------------------------------------- replay


@dataclass(frozen=True)
class ReplayResult:
    """Per counted request: prompt blocks, hit blocks per tier (in `tiers` order), and the blocks an
    infinite cache would hit. Evictions and demotions per tier count the whole replay, warm-up included."""

    tiers: tuple[str, ...]
    write_policy: str
    prompt_blocks: tuple[int, ...]
    hits: tuple[tuple[int, ...], ...]
    seen_blocks: tuple[int, ...]
    evictions: dict[str, int]           # a fleet: summed over its nodes (the pool's once)
    demotions: dict[str, int]
    nodes: tuple[int, ...] = ()         # a fleet: the node of each counted request

    @property
    def requests(self) -> int:
        return len(self.prompt_blocks)

    @property
    def total_prompt_blocks(self) -> int:
        return sum(self.prompt_blocks)

    @property
    def total_hits(self) -> dict[str, int]:
        return {name: sum(row[i] for row in self.hits) for i, name in enumerate(self.tiers)}

    @property
    def hit_ratio(self) -> dict[str, float]:
        """Per tier: blocks read from it / prompt blocks."""
        total = self.total_prompt_blocks
        return {name: (hits / total if total else 0.0) for name, hits in self.total_hits.items()}

    @property
    def overall_hit_ratio(self) -> float:
        total = self.total_prompt_blocks
        return sum(self.total_hits.values()) / total if total else 0.0

    @property
    def infinite_cache_bound(self) -> float:
        total = self.total_prompt_blocks
        return sum(self.seen_blocks) / total if total else 0.0

    @property
    def pool_share_of_hits(self) -> Optional[float]:
        """The share of hit blocks read from the pool (G3's cross-node hit ratio); None without a pool or hits."""
        hits = self.total_hits
        total = sum(hits.values())
        return hits.get(POOL_TIER, 0) / total if POOL_TIER in hits and total else None

    def summary(self) -> dict:
        """The figures as plain data (for results.json and `kvgate plan --json`)."""
        return {"requests": self.requests, "write_policy": self.write_policy,
                "prompt_blocks": self.total_prompt_blocks, "hits": self.total_hits, "hit_ratio": self.hit_ratio,
                "overall_hit_ratio": self.overall_hit_ratio, "infinite_cache_bound": self.infinite_cache_bound,
                "evictions": self.evictions, "demotions": self.demotions,
                "pool_share_of_hits": self.pool_share_of_hits}


def replay(requests: Iterable[Union[RequestKeys, Sequence[Key]]], capacities: Sequence[TierCapacity],
           write_policy: WritePolicy = "write-through", warmup: int = 0,
           nodes: Optional[Sequence[int]] = None) -> ReplayResult:
    """Replay requests (RequestKeys, or a prompt's key list) in order through the levels; the first
    `warmup` requests fill the caches (the infinite one too) but are not counted. With `nodes` (one
    node index per request, warm-up included), a fleet of max(nodes) + 1 nodes, each with the local
    levels of `capacities`, sharing its pool level (the module's fleet)."""
    requests = list(requests)
    if nodes is not None:
        nodes = list(nodes)
        if len(nodes) != len(requests) or any(type(n) is not int or n < 0 for n in nodes):
            raise ConfigError(f"nodes: expected a node index >= 0 per request ({len(requests)}), found "
                              f"{len(nodes)} values {sorted(set(map(repr, nodes)))[:5]}")
    routed = nodes or [0] * len(requests)
    sims = CacheSimulator.fleet(max(routed, default=0) + 1, capacities, write_policy)
    seen: set[Key] = set()
    prompt_blocks, hits, seen_blocks = [], [], []
    for n, (request, node) in enumerate(zip(requests, routed)):
        sim = sims[node]
        prompt, output = (request.prompt, request.output) if isinstance(request, RequestKeys) else (request, ())
        prompt = tuple(prompt)
        known = infinite_cache_hits(seen, RequestKeys(prompt, tuple(output)))
        row = sim.serve(RequestKeys(prompt, tuple(output)))
        if n >= warmup:
            prompt_blocks.append(len(prompt))
            hits.append(tuple(row))
            seen_blocks.append(known)
    levels = {id(level): level for sim in sims for level in sim.levels}.values()   # the pool once
    counts = {name: {"evictions": 0, "demotions": 0} for name in sims[0].names}
    for level in levels:
        counts[level.name]["evictions"] += level.metrics.counters["evictions"]
        counts[level.name]["demotions"] += level.metrics.counters["demotions"]
    return ReplayResult(sims[0].names, write_policy, tuple(prompt_blocks), tuple(hits), tuple(seen_blocks),
                        {name: c["evictions"] for name, c in counts.items()},
                        {name: c["demotions"] for name, c in counts.items()},
                        tuple(routed[warmup:]) if nodes is not None else ())


def infinite_cache_hits(seen: set, request: RequestKeys) -> int:
    """The prompt blocks an infinite cache would serve this request (its longest prefix of blocks that
    an earlier request stored: `seen`), then `seen` gains the request's own blocks, prompt and output."""
    known = sum(1 for _ in itertools.takewhile(seen.__contains__, request.prompt))
    seen.update(request.prompt)
    seen.update(request.output)
    return known


def _check_levels(capacities: Sequence[TierCapacity], write_policy: str) -> None:
    if write_policy not in WRITE_POLICIES:
        raise ConfigError(f"write_policy: expected one of {', '.join(WRITE_POLICIES)}, found {write_policy!r}")
    if not capacities:
        raise ConfigError("tiers: expected at least one tier (the device), found none")
    names = [tier.name for tier in capacities]
    if len(set(names)) != len(names):
        raise ConfigError(f"tiers: expected distinct names, found {names}")
    if not capacities[0].accounted:
        raise ConfigError(f"tiers.{names[0]}.accounted: expected the top tier (the device) accounted, found False")
    late = [tier.name for tier in capacities[:-1] if not tier.accounted]
    if late:
        raise ConfigError(f"tiers.{late[0]}.accounted: expected only the last tier (a pool) unaccounted, found "
                          f"{late[0]!r} above {names[-1]!r}")
