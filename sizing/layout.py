"""A model's KV cache layout: bytes per token and per block, and how many tokens a tier holds.

How it works: docs/methods/sizing-model.md (sizing/layout.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from kvcore.settings import ConfigError, check_count

# Bytes per element of the dtype names configs use (Hugging Face's `torch_dtype`, kvgate's KVLayout).
DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1,
}


def dtype_bytes(name: Any, field: str = "dtype") -> int:
    """Bytes per element of a dtype name ("bfloat16", "torch.float16", ...); ConfigError naming `field`."""
    key = name.removeprefix("torch.").lower() if isinstance(name, str) else None
    if key not in DTYPE_BYTES:
        raise ConfigError(f"{field}: expected a dtype, one of {', '.join(sorted(DTYPE_BYTES))}, found {name!r}")
    return DTYPE_BYTES[key]


@dataclass(frozen=True)
class KVShape:
    """What one token of KV costs: either `kv_heads` × `head_dim` per layer (MHA/GQA) or, for MLA,
    `kv_lora_rank` + `qk_rope_head_dim` per layer. `source` says where the figures came from."""

    layers: int
    dtype_bytes: int
    kv_heads: int = 0
    head_dim: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("layers", "dtype_bytes"):
            _positive_int(getattr(self, name), name)
        gqa = (self.kv_heads, self.head_dim)
        mla = (self.kv_lora_rank, self.qk_rope_head_dim)
        if any(gqa) and any(mla):
            raise ConfigError(f"kv_lora_rank: expected either kv_heads and head_dim (attention heads) or "
                              f"kv_lora_rank and qk_rope_head_dim (a latent), found both ({gqa}, {mla})")
        if any(mla):
            _positive_int(self.kv_lora_rank, "kv_lora_rank")
            _positive_int(self.qk_rope_head_dim, "qk_rope_head_dim")
        else:
            _positive_int(self.kv_heads, "kv_heads")
            _positive_int(self.head_dim, "head_dim")

    @property
    def attention(self) -> str:
        """"mla" (one latent per token per layer) or "gqa" (K and V per KV head; MHA is the case kv_heads = heads)."""
        return "mla" if self.kv_lora_rank else "gqa"

    @property
    def bytes_per_token(self) -> int:
        if self.attention == "mla":
            return self.layers * (self.kv_lora_rank + self.qk_rope_head_dim) * self.dtype_bytes
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def bytes_per_block(self, block_tokens: int) -> int:
        return self.bytes_per_token * _positive_int(block_tokens, "block_tokens")

    def tokens_in(self, nbytes: int) -> int:
        """Whole tokens of KV that `nbytes` hold (no block rounding)."""
        return _non_negative_int(nbytes, "bytes") // self.bytes_per_token

    def blocks_in(self, nbytes: int, block_tokens: int) -> int:
        """Whole blocks that `nbytes` hold; the tokens a tier holds are this × block_tokens."""
        return _non_negative_int(nbytes, "bytes") // self.bytes_per_block(block_tokens)

    # -- constructors ----------------------------------------------------------

    @classmethod
    def from_preset(cls, name: str) -> "KVShape":
        """The embedded engine's preset ("tiny", "small", "base"): float32 KV (see `cache_impl.engine.model`)."""
        if name not in EMBEDDED_PRESETS:
            raise ConfigError(f"preset: expected one of {', '.join(EMBEDDED_PRESETS)}, found {name!r}")
        return EMBEDDED_PRESETS[name]

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any], root: str = "model") -> "KVShape":
        """Explicit figures: layers, dtype (a name) or dtype_bytes, and kv_heads + head_dim or
        kv_lora_rank + qk_rope_head_dim. ConfigError naming `root.field` on a missing or wrong one."""
        known = {"layers", "dtype", "dtype_bytes", "kv_heads", "head_dim", "kv_lora_rank", "qk_rope_head_dim"}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ConfigError(f"{root}.{unknown[0]}: expected one of {', '.join(sorted(known))}, found an unknown key")
        if "dtype" in fields and "dtype_bytes" in fields \
                and dtype_bytes(fields["dtype"], f"{root}.dtype") != fields["dtype_bytes"]:
            raise ConfigError(f"{root}.dtype_bytes: expected {dtype_bytes(fields['dtype'])} for dtype "
                              f"{fields['dtype']!r}, found {fields['dtype_bytes']!r}")
        if "dtype" in fields:
            size = dtype_bytes(fields["dtype"], f"{root}.dtype")
        elif "dtype_bytes" in fields:
            size = fields["dtype_bytes"]
        else:
            raise ConfigError(f"{root}.dtype: expected a dtype (or dtype_bytes), found nothing")
        ints = {k: fields[k] for k in ("kv_heads", "head_dim", "kv_lora_rank", "qk_rope_head_dim") if k in fields}
        if "layers" not in fields:
            raise ConfigError(f"{root}.layers: expected an integer >= 1, found nothing")
        return _shape(root, layers=fields["layers"], dtype_bytes=size, source=root, **ints)

    @classmethod
    def from_hf_config(cls, config: Union[str, Path, Mapping[str, Any]], kv_dtype: Optional[str] = None) -> "KVShape":
        """From a Hugging Face `config.json` (a path or its parsed mapping).

        MHA/GQA (Llama, Qwen, Mistral, ...): layers = num_hidden_layers, kv_heads =
        num_key_value_heads (default num_attention_heads), head_dim = head_dim (default
        hidden_size / num_attention_heads). MLA (DeepSeek-V2/V3: kv_lora_rank present):
        kv_lora_rank + qk_rope_head_dim per layer. The KV dtype is `kv_dtype` when given (an fp8 KV
        cache), else the config's torch_dtype (or dtype). A multimodal config's `text_config` is used
        when the top level has no layers. ConfigError naming the field when one is missing or they
        contradict each other.
        """
        root, cfg = _read_config(config)
        if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), Mapping):
            root, cfg = f"{root}: text_config", cfg["text_config"]
        layers = _required(cfg, "num_hidden_layers", root)
        size = _hf_dtype_bytes(cfg, kv_dtype, root)
        fields = _hf_latent(cfg, root) if cfg.get("kv_lora_rank") is not None else _hf_heads(cfg, root)
        return _shape(root, ": ", layers=layers, dtype_bytes=size, source=root, **fields)


# -- helpers -------------------------------------------------------------------


def _positive_int(value: Any, field: str) -> int:
    return check_count(value, field)


def _non_negative_int(value: Any, field: str) -> int:
    if type(value) is not int or value < 0:
        raise ConfigError(f"{field}: expected an integer >= 0, found {value!r}")
    return value


def _shape(root: str, sep: str = ".", **fields: Any) -> KVShape:
    """A KVShape whose errors name the field under `root` (`root.field`, or `file: field` with sep ": ")."""
    try:
        return KVShape(**fields)
    except ConfigError as error:
        raise ConfigError(f"{root}{sep}{error}") from None


def _read_config(config: Union[str, Path, Mapping[str, Any]]) -> tuple[str, Mapping[str, Any]]:
    if isinstance(config, Mapping):
        return "config.json", config
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"hf_config: expected a readable config.json, found {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return str(path), data


def _checked(value: Any, field: str, root: str) -> int:
    return check_count(value, f"{root}: {field}")


def _required(cfg: Mapping[str, Any], field: str, root: str, why: str = "") -> int:
    if cfg.get(field) is None:
        raise ConfigError(f"{root}: {field}: expected an integer >= 1{why}, found nothing")
    return _checked(cfg[field], field, root)


def _hf_latent(cfg: Mapping[str, Any], root: str) -> dict[str, int]:
    """MLA: the latent's rank and the RoPE key's dims."""
    return {"kv_lora_rank": _required(cfg, "kv_lora_rank", root),
            "qk_rope_head_dim": _required(cfg, "qk_rope_head_dim", root)}


def _hf_heads(cfg: Mapping[str, Any], root: str) -> dict[str, int]:
    """MHA/GQA: KV heads (default: every attention head) and head_dim (default: hidden_size / heads)."""
    if str(cfg.get("model_type", "")).startswith(("deepseek_v2", "deepseek_v3")):
        raise ConfigError(f"{root}: kv_lora_rank: expected an integer >= 1 (model_type "
                          f"{cfg['model_type']!r} caches a compressed latent), found nothing")
    heads = _required(cfg, "num_attention_heads", root)
    kv_heads = cfg.get("num_key_value_heads")
    kv_heads = heads if kv_heads is None else _checked(kv_heads, "num_key_value_heads", root)
    if kv_heads > heads or heads % kv_heads:
        raise ConfigError(f"{root}: num_key_value_heads: expected a divisor of num_attention_heads ({heads}), "
                          f"found {kv_heads}")
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        hidden = _required(cfg, "hidden_size", root, why=" (head_dim is absent)")
        if hidden % heads:
            raise ConfigError(f"{root}: hidden_size: expected a multiple of num_attention_heads ({heads}) "
                              f"when head_dim is absent, found {hidden}")
        head_dim = hidden // heads
    return {"kv_heads": kv_heads, "head_dim": _checked(head_dim, "head_dim", root)}


def _hf_dtype_bytes(cfg: Mapping[str, Any], kv_dtype: Optional[str], root: str) -> int:
    """`kv_dtype` when given, else torch_dtype / dtype (both present: they must agree)."""
    if kv_dtype is not None:
        return dtype_bytes(kv_dtype, "kv_dtype")
    named = {k: cfg[k] for k in ("torch_dtype", "dtype") if cfg.get(k) is not None}
    if not named:
        raise ConfigError(f"{root}: torch_dtype: expected the model's dtype (or give the KV dtype), found nothing")
    sizes = {k: dtype_bytes(v, f"{root}: {k}") for k, v in named.items()}
    if len(set(sizes.values())) > 1:
        raise ConfigError(f"{root}: dtype: expected the same dtype as torch_dtype ({named['torch_dtype']!r}), "
                          f"found {named['dtype']!r}")
    return next(iter(sizes.values()))


# The embedded engine's presets (cache_impl.engine.model.PRESETS: n_layers, n_kv_heads, dim // n_heads), float32 KV.
EMBEDDED_PRESETS: dict[str, KVShape] = {
    "tiny": KVShape(layers=2, dtype_bytes=4, kv_heads=2, head_dim=16, source="preset tiny"),
    "small": KVShape(layers=4, dtype_bytes=4, kv_heads=2, head_dim=64, source="preset small"),
    "base": KVShape(layers=8, dtype_bytes=4, kv_heads=2, head_dim=64, source="preset base"),
}
