"""A multi-node embedded run's defaults, derived in one place from the single-node ones.

With `targets.embedded.candidate_nodes: N` > 1 the single-node defaults stop measuring what a fleet
is for: N device tiers (the baseline) hold most of the single-node workload, so the baseline hits
almost as often as the candidate, and each candidate node's host and disk tiers keep their own copy
of every conversation after its first load, so the shared pool serves almost nothing. A
disaggregated deployment is sized the other way round: the fleet's users grow with its nodes, and
each node's local tiers hold a part of the fleet's working set, so a conversation's KV written by
one node is read from the pool by another. `fleet_defaults` gives the values below for the fields
the user's file does not set (an explicit setting always wins); the baseline fleet keeps the
candidate's node count, routing and per-node device tier (gates/targets.py starts both from one
engine setting).

The arithmetic, for the single-node G3 workload of U users (`users`; `documents` or `groups` for the
other kinds that have them) and closed-loop levels L, with B the bytes of one block of KV
(`KVShape.bytes_per_token` × the block size)::

    users   U_N = the smallest count >= N × U with gcd(U_N, N) = 1
                  (interleaved turns round-robin over N nodes: with U_N a multiple of N the same
                  conversation would come back to the same node every round)
    levels  L_N = N × L                      (each node sees the single-node concurrency)
    W       = distinct block keys of the U_N-user workload, prompts and outputs
              (sizing.sequences.workload_block_keys, as the embedded engine keys them)
    S       = ⌈W / N⌉ blocks per node        (the node's share of the fleet's working set, < W)
    disk    = min(its default, S × file_nbytes(B)) bytes   S blocks (a file: a 4 KiB header, the payload padded
                                                           to 4 KiB)
    host    = min(its default, ⌈S / 2⌉ × B) bytes
    device  = min(its default, ⌈S / 4⌉) blocks             (the baseline's nodes get the same)
    pool    = max(its default, 2 × W × B) bytes            (the whole working set, and room for the store's
                                                           overhead)

A local tier is only ever made smaller than its single-node default, the pool only larger. Each
local tier holds more than the one above it: the cache writes through, so a lower tier as small as
the one above holds the same blocks and never serves a hit.

The quick profile on two nodes: U = 16 → U_N = 33, L = 2, 4, 8 → 4, 8, 16; the small preset's
B = 2 (K, V) × 4 layers × 2 KV heads × 64 dims × 4 bytes × 256 tokens = 1 MiB; W = 232 blocks,
S = 116: per node disk 116 × (4 KiB + 1 MiB) (was 8 GiB), host 58 MiB (was 1 GiB), device 29 blocks
(was 64); pool 512 MiB (2 × 232 MiB is less than its default). Between two turns of one
conversation every other conversation has a turn, and round-robin routing spreads those turns
over the nodes, so a node touches up to about W blocks before a conversation returns to it: more
than the S its tiers hold, and the returning turn's KV comes mostly from the pool (or, with
prefix-affinity routing, from the node's own tiers, which then hold its share of the conversations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from cache_impl.cache import integrity
from cache_impl.cache.config import DEFAULT_BLOCK_SIZE
from kvcore.settings import ConfigError, parse_size
from sizing.layout import KVShape
from sizing.sequences import workload_block_keys

SESSION_FIELDS = {"multi_round_qa": "users", "long_doc_qa": "documents", "shared_prefix": "groups"}
POOL_HEADROOM = 2          # the pool holds this many working sets (a store's own per-value overhead, eviction slack)
SHARE_DIVISORS = {"disk_capacity": 1, "host_capacity": 2, "device_capacity_blocks": 4}   # tier: S / this


@dataclass(frozen=True)
class FleetSizing:
    """A fleet's working set beside each node's tier capacities, in blocks (the module docstring's W, S)."""

    nodes: int
    working_set_blocks: int      # W
    node_share_blocks: int       # S = ⌈W / N⌉
    block_nbytes: int            # B
    device_blocks: int           # per node, the baseline's nodes too
    host_blocks: int             # per candidate node
    disk_blocks: int             # per candidate node
    pool_blocks: int             # the shared pool (its payload; a store adds its own overhead)

    def line(self) -> str:
        return (f"{self.nodes} nodes: the fleet's working set is {self.working_set_blocks} blocks of "
                f"{self.block_nbytes / 2**20:g} MiB (each node's share {self.node_share_blocks}); each node's tiers "
                f"hold device {self.device_blocks}, host {self.host_blocks}, disk {self.disk_blocks} blocks; the pool "
                f"{self.pool_blocks}")


def _given(data: Mapping, *path: str) -> bool:
    """Whether the user's file sets the field at `path`."""
    for key in path:
        if not isinstance(data, Mapping) or data.get(key) is None:
            return False
        data = data[key]
    return True


def _size_text(nbytes: int) -> str:
    """A byte count as a config writes it: whole MiB as "116MiB", else the bytes."""
    return f"{nbytes // 2**20}MiB" if nbytes % 2**20 == 0 else str(nbytes)


def fleet_users(single: int, nodes: int) -> int:
    """The smallest count >= nodes × single that shares no factor with nodes."""
    users = nodes * single
    while math.gcd(users, nodes) != 1:
        users += 1
    return users


def working_set_blocks(workload: Mapping[str, Any], block_tokens: int = DEFAULT_BLOCK_SIZE) -> int:
    """Distinct block keys (prompts and outputs) of every request of a workload spec, as the embedded engine keys them."""
    keys = set()
    try:
        requests = workload_block_keys(dict(workload), block_tokens=block_tokens)
    except ConfigError as error:  # a workload that cannot be built: named where the config holds it
        raise ConfigError(f"g3.{error}" if str(error).startswith("workload") else str(error)) from None
    for request in requests:
        keys.update(request.prompt)
        keys.update(request.output)
    return len(keys)


def _block_nbytes(embedded) -> int:
    return KVShape.from_preset(embedded.preset).bytes_per_block(DEFAULT_BLOCK_SIZE)


def _is_fleet(config) -> bool:
    return config.targets.kind == "embedded" and config.targets.embedded.candidate_nodes > 1


def fleet_sizing(config) -> Optional[FleetSizing]:
    """A validated config's (`GatesConfig`) G3 working set beside its per-node tiers; None unless several embedded nodes."""
    if not _is_fleet(config):
        return None
    embedded = config.targets.embedded
    block, nodes = _block_nbytes(embedded), embedded.candidate_nodes
    total = working_set_blocks(config.g3.workload)
    return FleetSizing(nodes, total, math.ceil(total / nodes), block, embedded.device_capacity_blocks,
                       parse_size(embedded.host_capacity) // block,
                       parse_size(embedded.disk_capacity) // integrity.file_nbytes(block),
                       parse_size(embedded.pool_capacity) // block)


def fleet_defaults(config, given: Mapping) -> dict:
    """The multi-node defaults of a validated config (`GatesConfig`) whose file was `given`, as config fields to
    merge over the profile's values; empty unless several embedded nodes.

    Only fields `given` does not set change: g3.workload (a workload in the file is the user's, whole),
    g3.levels (closed loop), and targets.embedded's device_capacity_blocks, host_capacity, disk_capacity and
    pool_capacity (kept when the workload has no whole block to cache: nothing to size them by).
    """
    if not _is_fleet(config):
        return {}
    embedded, nodes = config.targets.embedded, config.targets.embedded.candidate_nodes
    g3, workload = {}, dict(config.g3.workload)
    count_field = SESSION_FIELDS.get(workload.get("kind"))
    if count_field and not _given(given, "g3", "workload"):
        workload[count_field] = fleet_users(workload[count_field], nodes)
        g3["workload"] = workload
    if config.g3.replay == "closed_loop" and not _given(given, "g3", "levels"):
        g3["levels"] = [nodes * level for level in config.g3.levels]
    block = _block_nbytes(embedded)
    total = working_set_blocks(workload)
    share = math.ceil(total / nodes)
    single = {"device_capacity_blocks": embedded.device_capacity_blocks,
              **{name: parse_size(getattr(embedded, name)) for name in ("host_capacity", "disk_capacity",
                                                                          "pool_capacity")}}
    blocks = {name: math.ceil(share / divisor) for name, divisor in SHARE_DIVISORS.items()}
    sized = {"device_capacity_blocks": min(single["device_capacity_blocks"], blocks["device_capacity_blocks"]),
             "host_capacity": min(single["host_capacity"], blocks["host_capacity"] * block),
             "disk_capacity": min(single["disk_capacity"], blocks["disk_capacity"] * integrity.file_nbytes(block)),
             "pool_capacity": max(single["pool_capacity"], POOL_HEADROOM * total * block)}
    tiers = {name: value if name == "device_capacity_blocks" else _size_text(value)
             for name, value in sized.items()
             if value != single[name] and not _given(given, "targets", "embedded", name)} if total else {}
    return {**({"g3": g3} if g3 else {}), **({"targets": {"embedded": tiers}} if tiers else {})}
