"""The embedded model's sizes: `ModelArgs` and the named presets, torch-free.

`cache_impl.engine.model` builds a model from them; configs read them without importing torch (the gates
refuse a G2 context longer than the preset's `max_seq_len` at load).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int = 262  # the byte tokenizer: 256 bytes + 6 specials
    max_seq_len: int = 16384
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    # Random weights give flat logits; a larger output scale gives greedy decoding
    # clear winners, so that tiny float differences cannot flip an argmax in practice.
    logit_scale: float = 16.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def __post_init__(self) -> None:
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model: expected dim divisible by n_heads and n_heads by n_kv_heads, "
                f"found dim={self.dim} n_heads={self.n_heads} n_kv_heads={self.n_kv_heads}"
            )


PresetName = Literal["tiny", "small", "base"]   # the names of PRESETS, for a setting that names one
PRESETS: dict[str, ModelArgs] = {
    # For the project's own tests: milliseconds per request.
    "tiny": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=4096),
    # The default: recompute of an 8k-token prompt costs seconds on two cores while its KV
    # stays tens of MB (4 KiB per token in float32: 32 MiB at 8k, 1 MiB per 256-token block).
    "small": ModelArgs(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=512),
    # Heavier recompute for machines with more cores (8 KiB of KV per token).
    "base": ModelArgs(dim=512, n_layers=8, n_heads=8, n_kv_heads=2, ffn_dim=1024),
}
DEFAULT_PRESET: PresetName = "small"


# A weights seed: torch's generators take at most 2**64 - 1; kvgate holds seeds to a signed 64-bit integer's range
# (what every config field and JSON reader keeps exact)
MAX_WEIGHTS_SEED = 2**63 - 1
