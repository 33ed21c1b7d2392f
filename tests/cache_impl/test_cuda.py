"""The cache and the engine on a CUDA device: device tier in GPU memory, host tier pinned.

Skipped where there is no CUDA device (these machines); run on a GPU machine with
`python3 -m pytest -q -m cuda tests/cache_impl/test_cuda.py`.
"""

from __future__ import annotations

import pytest
import torch

from cache_impl import CacheConfig, Fingerprint, KVLayout, TieredKVCache
from cache_impl.engine.engine import Engine, EngineConfig
from tests.blocks import blocks_for

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)"),
]

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_size=256)


def _only_on(cache: TieredKVCache, tier: str) -> None:
    cache.flush()
    for above in cache.tiers[: cache.tiers.index(tier)]:
        cache.evict(above)


@pytest.mark.parametrize("tier", ["device", "host", "disk"])
@pytest.mark.parametrize("io_mode", ["buffered", "direct"])
def test_round_trip_through_every_tier_on_cuda_is_bitwise_equal(tmp_path, tier, io_mode):
    config = CacheConfig.from_dict({
        "block_size": LAYOUT.block_size, "device": "cuda", "device_capacity_blocks": 8,
        "host_capacity_bytes": 8 * LAYOUT.block_nbytes, "write_policy": "write-through",
        "disk": {"path": str(tmp_path / "kv"), "io_mode": io_mode},
    })
    with TieredKVCache(config, Fingerprint("cuda", "t", LAYOUT)) as cache:
        assert cache.device.type == "cuda" and cache.tier("host").pool.is_pinned()
        tokens = list(range(3 * LAYOUT.block_size))
        blocks = [b.cuda() for b in blocks_for(LAYOUT, tokens)]
        cache.store(tokens, blocks)
        _only_on(cache, tier)
        kv = torch.empty((LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, 4 * LAYOUT.block_size, LAYOUT.head_dim),
                         dtype=LAYOUT.torch_dtype, device="cuda")
        view = lambda i: kv[:, :, :, i * LAYOUT.block_size:(i + 1) * LAYOUT.block_size]  # noqa: E731
        prefix = cache.load_into(tokens, view)
        assert prefix.sources == [tier] * 3                       # the hit really came from that tier
        assert all(torch.equal(view(i), blocks[i]) for i in range(3))


def test_an_engine_hit_on_cuda_equals_recompute(tmp_path):
    prompt = [1 + i % 250 for i in range(3 * 256 + 39)]          # ids inside the byte tokenizer's vocabulary
    recompute = Engine(EngineConfig.from_dict({"mode": "recompute", "preset": "tiny"})).start()
    tiered = Engine(EngineConfig.from_dict({
        "mode": "tiered", "preset": "tiny", "cache": {"device": "cuda", "disk": {"path": str(tmp_path / "kv")}},
    })).start()
    try:
        assert tiered.device.type == "cuda"
        expected = recompute.generate(prompt, max_tokens=8).token_ids
        tiered.generate(prompt, max_tokens=8)
        tiered.cache.flush()
        tiered.cache.evict("device")
        hit = tiered.generate(prompt, max_tokens=8)
        assert hit.finish.cached_tokens == 3 * 256                # served from the host tier
        assert tiered.cache.snapshot()["tiers"]["host"]["hits"] == 3
        assert hit.token_ids == expected
    finally:
        recompute.stop()
        tiered.stop()


def test_kvgates_loader_fills_device_tensors_through_a_pinned_staging_buffer(tmp_path, monkeypatch):
    from cache_impl.weights import loaders
    from cache_impl.weights.safetensors_dir import write_random_checkpoint

    staging = []
    real = loaders._pinned_buffer

    def recorded(nbytes: int) -> torch.Tensor:
        buffer = real(nbytes)
        staging.append(buffer.is_pinned())
        return buffer

    monkeypatch.setattr(loaders, "_pinned_buffer", recorded)
    checkpoint = write_random_checkpoint(tmp_path / "weights", 48 << 20, shard_bytes=16 << 20)
    result = loaders.load_checkpoint(checkpoint, "kvgate", "cuda", concurrency=4)
    assert all(tensor.is_cuda for tensor in result.tensors.values())
    assert staging and all(staging)              # every reading thread staged its chunks in pinned memory
    assert loaders.verify_loaded(result, checkpoint) == "the checksum sidecar"
