"""Fixtures for the cache tests: a small KV layout and blocks whose bytes follow from their tokens."""

from __future__ import annotations

import hashlib

import pytest
import torch

from cache_impl import CacheConfig, Fingerprint, KVLayout, TieredKVCache
from cache_impl.auth import ADMIN_TOKEN_ENV
from tests.servers import ADMIN_TOKEN

BLOCK = 4


@pytest.fixture(scope="session", autouse=True)
def admin_token_in_environment():
    """The test servers' admin token where AdminClient reads it, as `kvgate run` hands it to a gate suite."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ADMIN_TOKEN_ENV, ADMIN_TOKEN)
        yield ADMIN_TOKEN


@pytest.fixture
def layout() -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=BLOCK)


@pytest.fixture
def fingerprint(layout) -> Fingerprint:
    return Fingerprint(weights_digest="seed-0", tokenizer_id="test-tokenizer", layout=layout)


def block_for(layout: KVLayout, tokens: list[int], index: int) -> torch.Tensor:
    """The KV a deterministic 'model' would compute for block `index` of `tokens` (depends on the whole prefix)."""
    prefix = tokens[: (index + 1) * layout.block_size]
    seed = int.from_bytes(hashlib.blake2b(repr(prefix).encode(), digest_size=8).digest(), "little") >> 1
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(layout.block_shape, generator=generator).to(layout.torch_dtype)


def blocks_for(layout: KVLayout, tokens: list[int]) -> list[torch.Tensor]:
    return [block_for(layout, tokens, i) for i in range(len(tokens) // layout.block_size)]


@pytest.fixture
def make_cache(tmp_path, fingerprint):
    """Build caches on one disk directory; closes them all at the end of the test."""
    made = []

    def make(fp: Fingerprint | None = None, **settings) -> TieredKVCache:
        fp = fp or fingerprint
        nbytes = fp.layout.block_nbytes
        config = {
            "block_size": fp.layout.block_size,
            "device": "cpu",
            "device_capacity_blocks": 4,
            "host_capacity_bytes": 4 * nbytes,
            "disk": {"path": str(tmp_path / "disk"), "capacity_bytes": 64 * (nbytes + 8192)},
        }
        for name, value in settings.items():
            if name.startswith("disk_"):
                config["disk"][name.removeprefix("disk_")] = value
            elif value is None and name == "disk":
                config["disk"] = None
            else:
                config[name] = value
        cache = TieredKVCache(CacheConfig.from_dict(config), fp)
        made.append(cache)
        return cache

    yield make
    for cache in made:
        cache.close()
