"""A multi-node embedded run's defaults, derived in one place from the single-node ones.

How it works: docs/methods/cache-and-engines.md (gates/fleet.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from cache_impl.cache import integrity
from cache_impl.cache.config import DEFAULT_BLOCK_SIZE
from kvcore.settings import ConfigError, parse_size
from sizing.layout import KVShape
from sizing.replay import Key
from sizing.sequences import workload_block_keys
from workloads.traffic.datasets import WorkloadSpec

SESSION_FIELDS = {"multi_round_qa": "users", "long_doc_qa": "documents", "shared_prefix": "groups"}
POOL_HEADROOM = 2          # the pool holds this many working sets (a store's own per-value overhead, eviction slack)
SHARE_DIVISORS = {"disk_capacity": 1, "host_capacity": 2, "device_capacity_blocks": 4}   # tier: S / this


@dataclass(frozen=True)
class FleetSizing:
    """A fleet's working set beside each node's tier capacities, in blocks (W, S: docs/methods/cache-and-engines.md)."""

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


def working_set_blocks(workload: Union[WorkloadSpec, Mapping[str, Any]], block_tokens: int = DEFAULT_BLOCK_SIZE) -> int:
    """Distinct block keys (prompts and outputs) of every request of a workload spec, as the embedded engine
    keys them."""
    keys: set[Key] = set()
    try:
        requests = workload_block_keys(workload, block_tokens=block_tokens)
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
    """A validated config's (`GatesConfig`) G3 working set beside its per-node tiers; None unless several embedded
    nodes."""
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
    g3, workload = {}, config.g3.workload.model_dump(mode="json", exclude_none=True)
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
