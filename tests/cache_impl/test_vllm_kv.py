"""kvgate's connector inside vLLM, the parts without vLLM: settings, fingerprint, the request book, vLLM's paged KV
as kvgate blocks, and the scheduler's lookups answered by a real cache over a real Unix socket."""

from __future__ import annotations

import os

import pytest
import torch

from cache_impl.cache.config import CacheConfig
from cache_impl.cache.keys import Fingerprint, KVLayout
from cache_impl.cache.manager import TieredKVCache
from cache_impl.vllm.vllm_kv import (
    BlockRun,
    ConnectorSettings,
    LookupClient,
    LookupServer,
    Matched,
    PagedKV,
    RequestBook,
    StepPlan,
    files_digest,
    instance_fingerprint,
    lookup_address,
)
from kvcore.settings import ConfigError

BS = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=3, dtype="float32", block_size=BS)


# -- settings -----------------------------------------------------------------------------------------------

def test_a_bad_extra_config_names_the_field_what_was_expected_and_found():
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.disk\.read_workers.*0"):
        ConnectorSettings.from_extra_config({"disk": {"path": "/tmp/x", "read_workers": 0}})
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.admin_prot"):
        ConnectorSettings.from_extra_config({"admin_prot": 8000})
    with pytest.raises(ConfigError, match="expected a JSON object, found list"):
        ConnectorSettings.from_extra_config([1])
    with pytest.raises(ConfigError, match="expected at least one tier"):
        ConnectorSettings.from_extra_config({"host_capacity_bytes": 0}).cache_config(BS)


def test_the_cache_under_vllm_has_no_device_tier_and_vllms_block_size(tmp_path):
    settings = ConnectorSettings.from_extra_config({"host_capacity_bytes": "1MiB", "disk": {"path": str(tmp_path)}})
    config = settings.cache_config(128)
    assert (config.block_size, config.device_capacity_blocks) == (128, 0)
    with TieredKVCache(config, Fingerprint("w", "t", KVLayout(1, 1, 4, "float32", 128))) as cache:
        assert cache.tiers == ["host", "disk"]


# -- fingerprint ---------------------------------------------------------------------------------------------

def test_the_fingerprint_follows_the_weight_files_the_tokenizer_and_vllms_layout(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"weights-1")
    (tmp_path / "tokenizer.json").write_text("{}")
    settings = ConnectorSettings()
    first = instance_fingerprint(str(tmp_path), str(tmp_path), LAYOUT, "blockdim0:2x4x6:float32", settings)
    assert first == instance_fingerprint(str(tmp_path), str(tmp_path), LAYOUT, "blockdim0:2x4x6:float32", settings)
    assert first != instance_fingerprint(str(tmp_path), str(tmp_path), LAYOUT, "blockdim1:2x4x2x3:float32", settings)
    (tmp_path / "model.safetensors").write_bytes(b"weights-2")    # same size, other values: a fine-tune
    assert first != instance_fingerprint(str(tmp_path), str(tmp_path), LAYOUT, "blockdim0:2x4x6:float32", settings)
    assert files_digest(tmp_path / "absent") is None


def test_a_model_that_is_not_a_local_directory_needs_weights_id():
    with pytest.raises(ConfigError, match=r"weights_id: expected a name for the weights.*org/model"):
        instance_fingerprint("org/model", "org/model", LAYOUT, "x", ConnectorSettings())
    named = instance_fingerprint("org/model", "org/model", LAYOUT, "x", ConnectorSettings(weights_id="org/model@abc"))
    assert named.weights_digest.startswith("org/model@abc|vllm-kv:x")


# -- the request book --------------------------------------------------------------------------------------

def test_a_request_loads_the_cached_blocks_beyond_vllms_own_and_saves_the_rest_as_computed():
    book = RequestBook(BS)
    prompt = list(range(22))   # 5 whole blocks and 2 tokens
    # the cache holds blocks 0..3 (host, host, disk, disk); vLLM itself holds block 0
    assert book.loadable_tokens("r", len(prompt), Matched(4, ("host", "host", "disk", "disk")), 4) == 12
    book.allocated("r", 12)
    assert book.hit_tiers("r", 12) == {"host": 4, "disk": 8}
    plan = StepPlan()
    book.new_request("r", prompt, [10, 11, 12, 13, 14, 15], computed=16, scheduled=4, plan=plan)
    [load] = plan.loads
    assert (load.first, load.end, load.block_ids) == (1, 4, (11, 12, 13))
    [save] = plan.saves                  # block 4 completes this step (tokens 16..19); 0..3 are cached
    assert (save.first, save.end, save.block_ids) == (4, 5, (14,))
    later = StepPlan()
    book.cached_request("r", [16], resumed=False, computed=20, scheduled=2, plan=later)
    assert later.saves == [] and later.loads == []      # the prompt's tail is no whole block


def test_the_last_prompt_token_is_never_loaded_and_vllms_own_prefix_is_not_reloaded():
    book = RequestBook(BS)
    assert book.loadable_tokens("a", 8, Matched(2, ("host", "host")), 0) == 4     # 7 tokens usable: 1 block
    assert book.loadable_tokens("b", 12, Matched(2, ("disk", "disk")), 8) == 0    # vLLM holds both already


def test_chunked_prefill_saves_each_whole_block_once_as_its_chunk_completes():
    book, plan = RequestBook(BS), StepPlan()
    book.loadable_tokens("r", 16, Matched(0, ()), 0)
    book.new_request("r", list(range(16)), [1, 2], computed=0, scheduled=6, plan=plan)
    assert [(s.first, s.end) for s in plan.saves] == [(0, 1)]
    plan = StepPlan()
    book.cached_request("r", [3, 4], resumed=False, computed=6, scheduled=10, plan=plan)
    assert [(s.first, s.end, s.block_ids) for s in plan.saves] == [(1, 4, (2, 3, 4))]


def test_blocks_that_failed_to_load_are_saved_again_once_vllm_recomputes_them():
    book, plan = RequestBook(BS), StepPlan()
    book.loadable_tokens("r", 13, Matched(3, ("disk",) * 3), 0)
    book.allocated("r", 12)
    book.new_request("r", list(range(13)), [7, 8, 9, 5], computed=12, scheduled=1, plan=plan)
    assert plan.saves == []
    book.load_failed({8})               # block 1 was refused: vLLM recomputes blocks 1 and 2
    plan = StepPlan()
    book.cached_request("r", None, resumed=False, computed=4, scheduled=9, plan=plan)
    assert [(s.first, s.end, s.block_ids) for s in plan.saves] == [(1, 3, (8, 9))]


def test_a_resumed_request_takes_its_new_blocks():
    book, plan = RequestBook(BS), StepPlan()
    book.loadable_tokens("r", 9, Matched(0, ()), 0)
    book.new_request("r", list(range(9)), [1, 2, 3], computed=0, scheduled=4, plan=plan)
    book.loadable_tokens("r", 9, Matched(1, ("host",)), 0)       # preempted; asked again when resumed
    book.allocated("r", 4)
    plan = StepPlan()
    book.cached_request("r", [20, 21, 22], resumed=True, computed=4, scheduled=5, plan=plan)
    assert [(load.first, load.end, load.block_ids) for load in plan.loads] == [(0, 1, (20,))]
    assert [(s.first, s.end, s.block_ids) for s in plan.saves] == [(1, 2, (21,))]
    book.finished("r")
    assert len(book) == 0


# -- vLLM's paged KV as kvgate blocks ----------------------------------------------------------------------------

@pytest.mark.parametrize("shape,dim", [((6, 2, BS, 2 * 3), 0),        # the CPU backend: [blocks, heads, block, 2 x D]
                                       ((2, 6, BS, 2, 3), 1)])       # FlashAttention: [2, blocks, block, heads, D]
def test_blocks_gathered_from_vllms_kv_scatter_back_byte_for_byte(shape, dim):
    layers = {f"l{i}": torch.randn(shape) for i in range(2)}
    paged = PagedKV(layers, ["l0", "l1"], 6, LAYOUT)
    assert paged.name().startswith(f"blockdim{dim}:")
    blocks = torch.empty((2, *LAYOUT.block_shape))
    paged.gather([4, 1], blocks)
    before = {name: t.clone() for name, t in layers.items()}
    for t in layers.values():
        t.zero_()
    paged.scatter(blocks, [2, 5])
    for name, t in layers.items():
        assert torch.equal(t.select(dim, 2), before[name].select(dim, 4))
        assert torch.equal(t.select(dim, 5), before[name].select(dim, 1))
        assert not t.select(dim, 0).any()                                   # other blocks untouched


def test_a_kv_tensor_of_another_size_is_refused_naming_the_layer():
    with pytest.raises(ValueError, match="layer l0: expected 192 bytes of float32 per block, found 128"):
        PagedKV({"l0": torch.zeros(6, 2, BS, 4)}, ["l0"], 6, LAYOUT)
    with pytest.raises(ValueError, match="none for"):
        PagedKV({}, ["l0"], 6, LAYOUT)


# -- the scheduler's lookups ----------------------------------------------------------------------------------

def test_the_scheduler_asks_the_workers_cache_over_its_socket(tmp_path):
    settings = ConnectorSettings.from_extra_config({"host_capacity_bytes": "1MiB", "disk": {"path": str(tmp_path)}})
    fingerprint = Fingerprint("w", "t", LAYOUT)
    address = lookup_address(f"engine-{os.getpid()}-{tmp_path.name}")
    client = LookupClient(address)
    tokens = list(range(3 * BS + 1))
    assert client.lookup(tokens) is None                      # no worker yet: nothing can be loaded
    with TieredKVCache(settings.cache_config(BS), fingerprint) as cache:
        server = LookupServer(address, fingerprint.digest, BS, cache.lookup_keys)
        try:
            assert client.lookup(tokens) == []
            cache.store(tokens, [torch.full(LAYOUT.block_shape, float(i)) for i in range(2)])
            assert client.lookup(tokens) == ["host", "host"]
            cache.flush()
            cache.evict("host")
            assert client.lookup(tokens) == ["disk", "disk"]      # the cache's state of now, not of the store
            assert client.digest == fingerprint.digest and client.block_size == BS
        finally:
            server.close()
            client.close()


def test_a_load_by_keys_from_a_first_block_reads_only_the_blocks_after_it(tmp_path):
    config = CacheConfig.from_dict({"block_size": BS, "device_capacity_blocks": 0, "host_capacity_bytes": "1MiB"})
    with TieredKVCache(config, Fingerprint("w", "t", LAYOUT)) as cache:
        tokens = list(range(3 * BS))
        cache.store(tokens, [torch.full(LAYOUT.block_shape, float(i)) for i in range(3)])
        out = torch.zeros((2, *LAYOUT.block_shape))
        run = BlockRun("r", tokens, 1, 3, (7, 8))
        result = cache.load_keys_into(run.keys(cache.fingerprint.digest, BS), out.__getitem__)
        assert result.num_blocks == 2 and result.sources == ["host", "host"]
        assert out[0].eq(1).all() and out[1].eq(2).all()


def test_requests_with_another_cache_salt_never_share_blocks(tmp_path):
    settings = ConnectorSettings.from_extra_config({"host_capacity_bytes": "1MiB"})
    fingerprint = Fingerprint("w", "t", LAYOUT)
    tokens = list(range(2 * BS + 1))
    with TieredKVCache(settings.cache_config(BS), fingerprint) as cache:
        salted = BlockRun("a", tokens, 0, 2, (1, 2), salt="tenant-a")
        cache.store_keys(salted.keys(fingerprint.digest, BS), [torch.zeros(LAYOUT.block_shape)] * 2)
        assert cache.lookup(tokens).num_blocks == 0                        # unsalted: nothing to share
        address = lookup_address(f"salt-{os.getpid()}-{tmp_path.name}")
        server = LookupServer(address, fingerprint.digest, BS, cache.lookup_keys)
        client = LookupClient(address)
        try:
            assert client.lookup(tokens, "tenant-a") == ["host", "host"]
            assert client.lookup(tokens, "tenant-b") == [] and client.lookup(tokens) == []
        finally:
            server.close()
            client.close()
    book, plan = RequestBook(BS), StepPlan()
    book.salted("r", "tenant-a")
    book.loadable_tokens("r", len(tokens), Matched(0, ()), 0)
    book.new_request("r", tokens, [5, 6, 7], computed=0, scheduled=len(tokens), plan=plan)
    assert [s.salt for s in plan.saves] == ["tenant-a"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
def test_blocks_move_between_vllms_cuda_kv_and_the_cache():
    layers = {f"l{i}": torch.randn((2, 6, BS, 2, 3), device="cuda") for i in range(2)}    # FlashAttention's layout
    paged = PagedKV(layers, ["l0", "l1"], 6, LAYOUT)
    blocks = torch.empty((1, *LAYOUT.block_shape), device="cuda")
    paged.gather([3], blocks)
    paged.scatter(blocks.cpu(), [0])
    assert all(torch.equal(t.select(1, 0), t.select(1, 3)) for t in layers.values())


# -- the connector's sidecar ----------------------------------------------------------------------------------

def test_the_sidecar_serves_kvgates_admin_routes_and_metrics_for_the_cache_and_answers_errors_as_openai(tmp_path):
    from fastapi.testclient import TestClient

    from cache_impl.server.auth import ADMIN_TOKEN_HEADER
    from cache_impl.vllm.connector_sidecar import ConnectorOwner, sidecar_app

    settings = ConnectorSettings.from_extra_config({"host_capacity_bytes": "1MiB", "disk": {"path": str(tmp_path)}})
    counters = {"kvgate_connector_saved_blocks": ("blocks stored", {(): 2.0}, ())}
    with TieredKVCache(settings.cache_config(BS), Fingerprint("w", "t", LAYOUT)) as cache:
        tokens = list(range(2 * BS))
        cache.store(tokens, [torch.zeros(LAYOUT.block_shape) for _ in range(2)])
        client = TestClient(sidecar_app(ConnectorOwner(cache, None), "tok", lambda: counters))
        admin = {ADMIN_TOKEN_HEADER: "tok"}
        missing = client.post("/admin/cache/evict", json={"tiers": ["host"]})
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_admin_token"
        assert client.post("/admin/cache/evict", json={"tiers": ["host"]}, headers={ADMIN_TOKEN_HEADER: "x"}) \
            .status_code == 403
        assert client.post("/admin/cache/flush", headers=admin).json() == {"flushed": True}
        assert client.post("/admin/cache/evict", json={"tiers": ["host"]}, headers=admin).json() == \
            {"evicted": {"host": 2}}
        located = client.post("/admin/cache/locate", json={"prompt_token_ids": tokens}, headers=admin).json()
        assert [b["tiers"] for b in located["blocks"]] == [["disk"], ["disk"]]
        text = client.post("/admin/cache/locate", json={"prompt": "abc"}, headers=admin)
        assert text.status_code == 409 and "send prompt_token_ids" in text.json()["error"]["message"]
        nowhere = client.get("/nope")
        assert nowhere.status_code == 404 and "GET /nope" in nowhere.json()["error"]["message"]
        metrics = client.get("/metrics").text
        assert 'kvgate_cache_evictions_total{tier="host"} 2.0' in metrics
        assert "kvgate_connector_saved_blocks_total 2.0" in metrics
