"""The tiered KV cache (device -> host DRAM -> disk), usable on its own by an inference engine.

    from cache_impl import CacheConfig, Fingerprint, KVLayout, TieredKVCache

    layout = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, dtype="bfloat16", block_size=256)
    fp = Fingerprint(weights_digest="...", tokenizer_id="byte-v1", layout=layout)
    cache = TieredKVCache(CacheConfig.from_dict({"disk": {"path": "/nvme/kv"}}), fp)
    prefix = cache.load_into(prompt_tokens, lambda i: kv[:, :, :, i * 256:(i + 1) * 256])
    ...                                           # the longest cached prefix is in the request's KV
    cache.store(prompt_tokens, new_blocks, first_block=prefix.num_blocks)
    cache.promote(prompt_tokens, loaded_blocks)   # after the first token: keep the prefix on the device

The names are imported on first use, so `import cache_impl.cache.config` (what configs and the CLI
read) does not import torch.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "CacheConfig": "cache.config", "ConfigError": "cache.config", "DiskTierConfig": "cache.config",
    "Fingerprint": "cache.keys", "KVLayout": "cache.keys", "block_keys": "cache.keys",
    "LoadResult": "cache.manager", "LoadedPrefix": "cache.manager", "PrefixMatch": "cache.manager",
    "TieredKVCache": "cache.manager",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
