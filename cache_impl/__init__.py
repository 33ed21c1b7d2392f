"""The tiered KV cache (device -> host DRAM -> disk), usable on its own by an inference engine.

    from cache_impl import CacheConfig, Fingerprint, KVLayout, TieredKVCache

    layout = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, dtype="bfloat16", block_size=256)
    fp = Fingerprint(weights_digest="...", tokenizer_id="byte-v1", layout=layout)
    cache = TieredKVCache(CacheConfig.from_dict({"disk": {"path": "/nvme/kv"}}), fp)
    with cache.load(prompt_tokens) as prefix:     # longest cached prefix, pinned on the device
        ...                                       # prefix.blocks[i]: [layers, 2, kv_heads, 256, head_dim]
    cache.store(prompt_tokens, new_blocks, first_block=prefix.num_blocks)
"""

from .config import CacheConfig, ConfigError, DiskTierConfig
from .keys import Fingerprint, KVLayout, block_keys
from .manager import LoadedPrefix, PrefixMatch, TieredKVCache

__all__ = [
    "CacheConfig", "ConfigError", "DiskTierConfig", "Fingerprint", "KVLayout", "LoadedPrefix",
    "PrefixMatch", "TieredKVCache", "block_keys",
]
