"""kvgate's tiered KV cache inside vLLM: a v1 KV connector (host DRAM, disk and shared-pool tiers below vLLM's KV).

How it works: docs/methods/cache-and-engines.md (cache_impl/vllm/vllm_connector.py).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from cache_impl.cache.keys import token_array
from cache_impl.cache.manager import LoadResult, TieredKVCache
from cache_impl.vllm.vllm_kv import (
    EXTRA,
    ConnectorSettings,
    LookupClient,
    LookupServer,
    Matched,
    PagedKV,
    RequestBook,
    StepPlan,
    instance_fingerprint,
    lookup_address,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from cache_impl.vllm.connector_sidecar import Sidecar

log = init_logger(__name__)  # vLLM's log format and level
SOURCES = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK, "remote": CacheHitSource.P2P}


@dataclass
class KvgateMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=StepPlan)


class _Counters:
    """The connector's own counters, served by the sidecar's /metrics."""

    HELP = {"kvgate_connector_loaded_tokens": ("prompt tokens loaded into vLLM's KV, by the tier they came from",
                                               ("tier",)),
            "kvgate_connector_load_error_blocks": ("blocks vLLM was told to recompute (refused or vanished)", ()),
            "kvgate_connector_saved_blocks": ("vLLM blocks copied out and newly stored", ())}

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values: dict[str, dict[tuple, float]] = {name: {} for name in self.HELP}

    def add(self, name: str, labels: tuple = (), by: float = 1) -> None:
        with self.lock:
            self.values[name][labels] = self.values[name].get(labels, 0) + by

    def families(self) -> dict:
        with self.lock:
            return {name: (help_text, dict(self.values[name]), labels)
                    for name, (help_text, labels) in self.HELP.items()}


class KvgateConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector backed by kvgate's `TieredKVCache`."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "Optional[KVCacheConfig]" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._check_parallel(vllm_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.settings = ConnectorSettings.from_extra_config(extra)
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning("kvgate connector: kv_load_failure_policy is %r: a block that fails verification fails "
                        "its request instead of being recomputed; set \"recompute\"",
                        self._kv_transfer_config.kv_load_failure_policy)
        self.block_size = vllm_config.cache_config.block_size
        self.model = vllm_config.model_config.model
        self.tokenizer = vllm_config.model_config.tokenizer or self.model
        self.address = lookup_address(str(self._kv_transfer_config.engine_id))
        self.book = RequestBook(self.block_size)
        self.lookups = LookupClient(self.address)
        self.cache: Optional[TieredKVCache] = None
        self.paged: Optional[PagedKV] = None
        self.counters = _Counters()
        self._lookup_server: Optional[LookupServer] = None
        self._sidecar: Optional[Sidecar] = None
        self._load_errors: set[int] = set()
        self._groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else None
        self._num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else None

    @staticmethod
    def _check_parallel(vllm_config: "VllmConfig") -> None:
        parallel = vllm_config.parallel_config
        if parallel.world_size != 1:
            raise ValueError(f"{EXTRA}: kvgate's connector expected one worker per instance (tensor and pipeline "
                             f"parallel size 1), found world size {parallel.world_size}")

    # -- worker side ------------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._groups is None or len(self._groups) != 1:
            raise ValueError(f"kvgate's connector expected one KV cache group (a model with one kind of attention), "
                             f"found {0 if self._groups is None else len(self._groups)}")
        if self._num_blocks is None:  # given with the groups, by the same KV cache config
            raise ValueError("kvgate's connector expected the number of vLLM's KV blocks, found none")
        group = self._groups[0]
        spec = group.kv_cache_spec
        layer_names = list(group.layer_names)
        dtype = str(spec.dtype).removeprefix("torch.")
        cache_config = self.settings.cache_config(self.block_size)       # vLLM's block size, given once
        layout = cache_config.layout(len(layer_names), int(spec.num_kv_heads), int(spec.head_size), dtype)
        self.paged = paged = PagedKV(kv_caches, layer_names, int(self._num_blocks), layout)
        fingerprint = instance_fingerprint(self.model, self.tokenizer, layout, paged.name(), self.settings)
        self.cache = cache = TieredKVCache(cache_config, fingerprint, device=torch.device("cpu"))
        self._lookup_server = LookupServer(self.address, fingerprint.digest, self.block_size, cache.lookup_keys)
        log.info("kvgate connector: tiers %s, fingerprint %s, vLLM KV %s", cache.tiers, fingerprint.hex,
                 paged.name())
        self._start_sidecar(cache)

    def _start_sidecar(self, cache: TieredKVCache) -> None:
        settings = self.settings
        if settings.admin_port is None:
            return
        token = os.environ.get(settings.admin_token_env)
        if not token:
            raise ValueError(f"{EXTRA}.admin_port: expected the admin token in ${settings.admin_token_env} "
                             f"(the sidecar's admin routes refuse requests without it), found it unset")
        # deferred: the sidecar's server stack (fastapi, uvicorn) only when an admin port is set
        from cache_impl.vllm.connector_sidecar import ConnectorOwner, Sidecar, sidecar_app

        app = sidecar_app(ConnectorOwner(cache, self.tokenizer), token, self.counters.families)
        self._sidecar = Sidecar(app, settings.admin_host, settings.admin_port)

    def _step_plan(self) -> Optional[tuple[StepPlan, TieredKVCache, PagedKV]]:
        """This step's plan from the scheduler, with the cache and vLLM's KV it moves blocks between; None before
        the cache is open (nothing to move yet)."""
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, KvgateMetadata) or self.cache is None or self.paged is None:
            return None
        return metadata.plan, self.cache, self.paged

    @staticmethod
    def _blocks(n: int, cache: TieredKVCache, paged: PagedKV) -> torch.Tensor:
        """Room for `n` kvgate blocks beside vLLM's KV."""
        layout = cache.layout
        return torch.empty((n, *layout.block_shape), dtype=layout.torch_dtype, device=paged.device)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        step = self._step_plan()
        if step is None:
            return
        plan, cache, paged = step
        for run in plan.loads:
            staging = self._blocks(run.num_blocks, cache, paged)
            result: Optional[LoadResult]
            try:
                result = cache.load_keys_into(run.keys(cache.fingerprint.digest, self.block_size),
                                              staging.__getitem__)
                loaded = result.num_blocks
            except Exception:  # noqa: BLE001 - a failed read is a recompute, never a failed request
                log.exception("kvgate connector: loading %d blocks for %s failed", run.num_blocks, run.req_id)
                loaded, result = 0, None
            if result is not None and loaded:
                paged.scatter(staging[:loaded], run.block_ids[:loaded])
                for source in result.sources:
                    self.counters.add("kvgate_connector_loaded_tokens", (source,), cache.block_size)
            failed = run.block_ids[loaded:]
            if failed:
                self._load_errors.update(failed)
                self.counters.add("kvgate_connector_load_error_blocks", (), len(failed))
                log.warning("kvgate connector: %d of %d blocks of %s not loaded (refused or gone): vLLM recomputes "
                            "them", len(failed), run.num_blocks, run.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish in start_load_kv, before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks are saved once every layer has its KV: wait_for_save

    def wait_for_save(self) -> None:
        step = self._step_plan()
        if step is None:
            return
        plan, cache, paged = step
        for run in plan.saves:
            blocks = self._blocks(run.num_blocks, cache, paged)
            paged.gather(run.block_ids, blocks)
            stored = cache.store_keys(run.keys(cache.fingerprint.digest, self.block_size), list(blocks))
            self.counters.add("kvgate_connector_saved_blocks", (), stored)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._load_errors = self._load_errors, set()
        return failed

    def shutdown(self) -> None:
        self.lookups.close()
        if self._lookup_server is not None:
            self._lookup_server.close()
        if self._sidecar is not None:
            self._sidecar.stop()
        if self.cache is not None:
            self.cache.close()  # publishes queued disk writes: a restart finds them
            self.cache = None

    # -- scheduler side --------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        prompt = request.prompt_token_ids or []
        if len(prompt) <= self.block_size:
            return 0, False
        tiers = self.lookups.lookup(token_array(prompt[: (len(prompt) - 1) // self.block_size * self.block_size]),
                                    self.book.salt(request.request_id))
        if not tiers:
            return 0, False
        return self.book.loadable_tokens(request.request_id, len(prompt), Matched(len(tiers), tuple(tiers)),
                                         num_computed_tokens), False

    def on_new_request(self, request: "Request") -> None:
        self.book.salted(request.request_id, getattr(request, "cache_salt", None))

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self.book.allocated(request.request_id, num_external_tokens)

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict:
        counts = self.book.hit_tiers(request.request_id, num_external_tokens)
        if not counts:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return {SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED): n for tier, n in counts.items()}

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        plan = StepPlan()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self.book.new_request(new.req_id, new.prompt_token_ids or [], new.block_ids[0],
                                  new.num_computed_tokens, scheduled.get(new.req_id, 0), plan)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            self.book.cached_request(req_id, new_ids[0] if new_ids is not None else None,
                                     req_id in cached.resumed_req_ids, cached.num_computed_tokens[i],
                                     scheduled.get(req_id, 0), plan)
        for req_id in scheduler_output.finished_req_ids:
            self.book.finished(req_id)
        return KvgateMetadata(plan)

    def update_connector_output(self, connector_output: Any) -> None:
        failed = getattr(connector_output, "invalid_block_ids", None)
        if failed:
            self.book.load_failed(set(failed))

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        self.book.finished(request.request_id)
        return False, None  # saved blocks are copies already: vLLM may free its blocks now
