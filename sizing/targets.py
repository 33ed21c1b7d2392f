"""What the sizing model reads of the targets: the model's KV layout, the block size, each tier's capacity,
the nodes of each fleet and how requests are routed to them.

How it works: docs/methods/sizing-model.md (sizing/targets.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from cache_impl.cache import integrity
from cache_impl.cache.config import CacheConfig
from kvcore.settings import parse_size
from workloads.traffic.routing import Routing

from .layout import KVShape
from .replay import TierCapacity, tier_capacities
from .settings import SizedRun, TargetSizing

EMBEDDED_BLOCK_TOKENS = 256
# the pool kvgate starts for its embedded fleet (workloads/servers/stores.py: Redis maxmemory 512mb, Mooncake's
# segment 512MB); a store also spends memory on its own keeping, so it holds somewhat fewer blocks
EMBEDDED_POOL_BYTES = 512 * 2**20
# what a node loads from the pool at when nothing says: `kvgate pool-bench` on loopback, 2-core VM (docs/results.md)
LOOPBACK_POOL_GBPS = {"redis": 0.15, "mooncake": 0.29, "external": 0.15}
EXTERNAL_BLOCK_TOKENS = 16          # vLLM's default block size
# tokens of prompts an external engine prefills a step when sizing.target.prefill_budget does not say (vLLM's chunked
# prefill: its CPU server's default --max-num-batched-tokens)
EXTERNAL_PREFILL_BUDGET = 2048


def prefill_budget(external: bool, given: Optional[int] = None) -> Optional[int]:
    """Tokens of prompts the target's engine prefills a step: an external engine's `sizing.target.prefill_budget`,
    else EXTERNAL_PREFILL_BUDGET; None for kvgate's own engine (one block a step)."""
    return (given or EXTERNAL_PREFILL_BUDGET) if external else None


@dataclass(frozen=True)
class TargetInputs:
    """The targets as the plan models them."""

    shape: KVShape
    block_tokens: int
    device_blocks: int
    host_bytes: int
    disk_bytes: int
    pool: str                       # "none", "redis", "mooncake", or "external" (a pool the config sizes)
    pool_bytes: Optional[int]       # None: unbounded
    pool_gbps: Optional[float]
    candidate_nodes: int
    baseline_nodes: int
    routing: Routing
    max_running: int
    embedded: bool
    baseline_device_blocks: Optional[int] = None   # None: the candidate's device (the same engine, no offload)
    prefill_budget: Optional[int] = None           # tokens a step prefills (None: one block, kvgate's engine)

    @property
    def block_nbytes(self) -> int:
        return self.shape.bytes_per_block(self.block_tokens)

    @property
    def fleet(self) -> bool:
        return self.candidate_nodes > 1

    def capacities(self) -> dict[str, list[TierCapacity]]:
        """Each node's levels: the candidate's device, host, disk (and the pool below them), the
        baseline's device alone (`replay.tier_capacities`, the cache's own arithmetic)."""
        disk = {"path": "unused", "capacity_bytes": self.disk_bytes} if self.disk_bytes > 0 else None
        remote = {"backend": "redis" if self.pool == "external" else self.pool} if self.pool != "none" else None
        cache = CacheConfig.from_dict({"block_size": self.block_tokens, "device_capacity_blocks": self.device_blocks,
                                       "host_capacity_bytes": self.host_bytes, "disk": disk, "remote": remote})
        pool = None if self.pool_bytes is None else pool_blocks(self.pool_bytes, self.block_nbytes)
        baseline = self.device_blocks if self.baseline_device_blocks is None else self.baseline_device_blocks
        return {"candidate": tier_capacities(cache, self.block_nbytes, pool),
                "baseline": [TierCapacity("device", baseline)]}


def engine_facts(preflight: list[dict]) -> dict[str, dict]:
    """What a run's pre-flight read from each external role's engine (preflight.json rows), by role."""
    return {row["role"]: row for row in preflight if "absent_tiers" in row or "device_kv_tokens" in row}


def pool_blocks(pool_bytes: int, block_nbytes: int) -> int:
    """Blocks a pool of `pool_bytes` holds: each value is the block file's 4 KiB header and the payload
    (cache_impl/cache/tiers/remote.py), not padded."""
    return pool_bytes // (integrity.HEADER_BYTES + block_nbytes)


def target_inputs(config: SizedRun, engines: Optional[dict] = None) -> tuple[TargetInputs, list[str]]:
    """The targets of `config` (a GatesConfig) as the plan models them, and notes on what stood in. `engines`:
    what a run's pre-flight read from each external role's engine ({role: {"device_kv_tokens", "absent_tiers",
    ...}}, gates.preflight.probe_engines): a capacity it says stands in for one the config does not give, and
    a baseline that reuses nothing (vLLM with prefix caching off) is modelled so."""
    targets, notes = config.targets, []
    engines = engines or {}
    inputs: dict[str, Any]      # TargetInputs' fields, read from the targets, then over them what sizing.target sets
    given = config.sizing.target
    embedded = targets.embedded
    if targets.kind == "embedded":
        pool = embedded.pool
        inputs = dict(shape=KVShape.from_preset(embedded.preset), block_tokens=EMBEDDED_BLOCK_TOKENS,
                      device_blocks=embedded.device_capacity_blocks, host_bytes=parse_size(embedded.host_capacity),
                      disk_bytes=parse_size(embedded.disk_capacity), pool=pool,
                      pool_bytes=EMBEDDED_POOL_BYTES if pool != "none" else None,
                      candidate_nodes=embedded.candidate_nodes, baseline_nodes=embedded.candidate_nodes)
    else:
        nodes = 1 + len(targets.candidate_nodes)
        inputs = dict(shape=KVShape.from_preset(embedded.preset), block_tokens=EXTERNAL_BLOCK_TOKENS,
                      device_blocks=embedded.device_capacity_blocks, host_bytes=0, disk_bytes=0,
                      pool="none", pool_bytes=None, candidate_nodes=nodes, baseline_nodes=1)
        if given is None or given.shape() is None:
            notes.append(f"targets.kind is external and sizing.target gives no KV layout (model_config or kv_layout): "
                         f"the embedded preset's ({embedded.preset}) stands in")
        said = engines.get("candidate", {}).get("device_kv_tokens")
        if (given is None or given.device_kv_tokens is None) and said:
            block = given.block_size if given is not None and given.block_size else EXTERNAL_BLOCK_TOKENS
            inputs["device_blocks"] = max(1, said // block)
            notes.append(f"the candidate's device KV: {said} tokens, as its engine says "
                         f"({engines['candidate'].get('device_kv_source') or 'its metrics'})")
        elif given is None or given.device_kv_tokens is None:
            notes.append(
                "targets.kind is external and sizing.target.device_kv_tokens is not given (the engine prints "
                f"it at start-up): the embedded device tier ({embedded.device_capacity_blocks} blocks) stands in"
            )
        baseline = engines.get("baseline", {})
        if baseline.get("device_kv_tokens") == 0:
            inputs["baseline_device_blocks"] = 0
            notes.append(f"the baseline reuses no prefix, as its engine says ({baseline.get('device_kv_source')}): "
                         "modelled with no cache at all")
        if given is None or given.block_size is None:
            notes.append(f"sizing.target.block_size is not given: {EXTERNAL_BLOCK_TOKENS} tokens (vLLM's default)")
        inputs["prefill_budget"] = prefill_budget(True, getattr(given, "prefill_budget", None))
        if given is None or given.prefill_budget is None:
            notes.append(f"sizing.target.prefill_budget is not given: {EXTERNAL_PREFILL_BUDGET} tokens of prompts a "
                         "step (vLLM's CPU server's default --max-num-batched-tokens)")
        if given is None or (given.host_capacity is None and given.disk_capacity is None):
            notes.append("targets.kind is external and sizing.target gives no host_capacity or disk_capacity: the "
                         "candidate is modelled as its device tier alone, like the baseline, so G3 is predicted to "
                         "gain nothing; give the candidate's tiers for a prediction that means something")
        if nodes > 1 and (given is None or given.pool_capacity is None):
            notes.append(f"the candidate has {nodes} nodes and sizing.target.pool_capacity is not given: modelled "
                         "without a shared pool (each node its own tiers)")
    if given is not None:
        inputs.update(_given(given, inputs))
    pool_gbps = getattr(given, "pool_gbps", None)
    if inputs["pool"] != "none" and pool_gbps is None:
        pool_gbps = LOOPBACK_POOL_GBPS[inputs["pool"]]
        notes.append(f"the pool's load bandwidth is not given (sizing.target.pool_gbps): {pool_gbps} GB/s, "
                     "`kvgate pool-bench` on loopback on a 2-core machine")
    return TargetInputs(**inputs, pool_gbps=pool_gbps, routing=targets.routing,
                        max_running=getattr(given, "max_running", None) or embedded.max_running,
                        embedded=targets.kind == "embedded"), notes


def steady_block_tokens(config: SizedRun) -> Optional[int]:
    """The candidate engine's tokens per cache block as far as the config says it (kvgate's own; an external
    engine's `sizing.target.block_size`), in which G3's steady rule reads the candidate's cached share of its
    prompts' whole blocks (workloads/loadgen/steady.py); None: it does not say, and the rule reads TTFT instead."""
    if config.targets.kind == "embedded":
        return EMBEDDED_BLOCK_TOKENS
    given = config.sizing.target
    return None if given is None else given.block_size


def _given(given: TargetSizing, inputs: dict[str, Any]) -> dict[str, Any]:
    """The fields `sizing.target` sets, over the ones read from the targets."""
    out: dict[str, Any] = {}
    shape = given.shape()
    if shape is not None:
        out["shape"] = shape
    if given.block_size is not None:
        out["block_tokens"] = given.block_size
    block_tokens: int = out.get("block_tokens", inputs["block_tokens"])
    if given.device_kv_tokens is not None:
        out["device_blocks"] = max(1, given.device_kv_tokens // block_tokens)
    for name in ("host", "disk"):
        value = getattr(given, f"{name}_capacity")
        if value is not None:
            out[f"{name}_bytes"] = parse_size(value)
    if given.pool_capacity is not None:
        out["pool_bytes"] = parse_size(given.pool_capacity)
        if inputs["pool"] == "none":
            out["pool"] = "external"
    return out
