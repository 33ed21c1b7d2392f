"""KV bytes per token and per block, against hand computations; configs read from HF's config.json shapes."""

from __future__ import annotations

import json
import re

import pytest

from cache_impl.cache.keys import KVLayout
from kvcore.settings import ConfigError
from sizing.layout import EMBEDDED_PRESETS, KVShape

KIB, MIB, GIB = 2**10, 2**20, 2**30

# Excerpts of the models' published config.json files (the fields the formula reads, and a few it must ignore).
LLAMA_3_70B = {"model_type": "llama", "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
               "hidden_size": 8192, "torch_dtype": "bfloat16", "vocab_size": 128256}
LLAMA_3_8B = {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "hidden_size": 4096, "torch_dtype": "bfloat16"}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128,
               "num_key_value_heads": 128, "hidden_size": 7168, "kv_lora_rank": 512, "q_lora_rank": 1536,
               "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "torch_dtype": "bfloat16"}


def test_llama_3_70b_in_bf16_is_320_kib_per_token():
    shape = KVShape.from_hf_config(LLAMA_3_70B)
    # 2 (K, V) x 80 layers x 8 KV heads x 128 (8192 / 64) x 2 bytes
    assert shape.bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680 == 320 * KIB
    assert shape.bytes_per_block(256) == 327_680 * 256 == 80 * MIB
    assert shape.attention == "gqa" and shape.head_dim == 128


def test_a_gqa_8b_is_128_kib_per_token():
    shape = KVShape.from_hf_config(LLAMA_3_8B)
    assert shape.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072 == 128 * KIB


def test_deepseek_v3_mla_caches_one_latent_and_the_rope_key_per_layer_without_a_factor_two():
    shape = KVShape.from_hf_config(DEEPSEEK_V3)
    assert shape.attention == "mla"
    assert shape.bytes_per_token == 61 * (512 + 64) * 2 == 70_272      # not 2 x 61 x 128 heads x ...


def test_tokens_and_blocks_a_tier_holds_are_whole():
    shape = KVShape.from_hf_config(LLAMA_3_70B)
    assert shape.tokens_in(80 * GIB) == 80 * GIB // 327_680 == 262_144    # 80 GiB of HBM: 256 Ki tokens
    assert shape.blocks_in(80 * GIB, 256) == 1024                        # of 80 MiB each
    assert shape.blocks_in(80 * MIB - 1, 256) == 0 and shape.tokens_in(327_679) == 0


def test_the_embedded_presets_equal_the_engines_layout():
    from cache_impl.engine.model import PRESETS  # imports torch: only this test needs the model's own figures

    assert set(EMBEDDED_PRESETS) == set(PRESETS)
    for name, args in PRESETS.items():
        shape = KVShape.from_preset(name)
        layout = KVLayout(args.n_layers, args.n_kv_heads, args.head_dim, "float32", 256)
        assert (shape.layers, shape.kv_heads, shape.head_dim, shape.dtype_bytes) == \
            (args.n_layers, args.n_kv_heads, args.head_dim, 4)
        assert shape.bytes_per_block(256) == layout.block_nbytes
        assert shape.bytes_per_token == layout.block_nbytes // layout.block_size
    # the default "small": 2 x 4 layers x 2 KV heads x 64 x 4 bytes = 4 KiB per token, 1 MiB per block
    assert KVShape.from_preset("small").bytes_per_token == 2 * 4 * 2 * 64 * 4 == 4 * KIB
    assert KVShape.from_preset("small").bytes_per_block(256) == MIB


def test_defaults_kv_heads_from_attention_heads_and_head_dim_from_hidden_size():
    mha = {"num_hidden_layers": 12, "num_attention_heads": 12, "hidden_size": 768, "torch_dtype": "float16"}
    assert KVShape.from_hf_config(mha).bytes_per_token == 2 * 12 * 12 * 64 * 2
    qwen3 = {"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
             "hidden_size": 2560, "torch_dtype": "bfloat16"}    # head_dim given: not 2560 / 32
    assert KVShape.from_hf_config(qwen3).bytes_per_token == 2 * 36 * 8 * 128 * 2


def test_an_fp8_kv_cache_and_the_text_config_of_a_multimodal_model(tmp_path):
    assert KVShape.from_hf_config(LLAMA_3_70B, kv_dtype="fp8").bytes_per_token == 2 * 80 * 8 * 128 * 1
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": LLAMA_3_8B}))
    assert KVShape.from_hf_config(tmp_path).bytes_per_token == 128 * KIB     # a model directory is read too


def test_explicit_fields():
    shape = KVShape.from_fields({"layers": 80, "kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"})
    assert shape.bytes_per_token == 320 * KIB
    mla = KVShape.from_fields({"layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "dtype_bytes": 2})
    assert mla.bytes_per_token == 70_272


@pytest.mark.parametrize("config, message", [
    ({**LLAMA_3_8B, "num_hidden_layers": None}, "num_hidden_layers: expected an integer >= 1, found nothing"),
    ({k: v for k, v in LLAMA_3_8B.items() if k != "torch_dtype"}, "torch_dtype: expected the model's dtype"),
    ({**LLAMA_3_8B, "torch_dtype": "complex64"}, "torch_dtype: expected a dtype"),
    ({**LLAMA_3_8B, "dtype": "float32"}, "dtype: expected the same dtype as torch_dtype ('bfloat16')"),
    ({**LLAMA_3_8B, "num_key_value_heads": 5}, "num_key_value_heads: expected a divisor of num_attention_heads (32)"),
    ({**LLAMA_3_8B, "num_key_value_heads": 64}, "num_key_value_heads: expected a divisor"),
    ({**LLAMA_3_8B, "hidden_size": 4100}, "hidden_size: expected a multiple of num_attention_heads (32)"),
    ({k: v for k, v in LLAMA_3_8B.items() if k != "hidden_size"}, "hidden_size: expected an integer >= 1 "
                                                                    "(head_dim is absent), found nothing"),
    ({**LLAMA_3_8B, "num_attention_heads": "32"}, "num_attention_heads: expected an integer >= 1, found '32'"),
    ({**LLAMA_3_8B, "num_hidden_layers": True}, "num_hidden_layers: expected an integer >= 1, found True"),
    ({k: v for k, v in DEEPSEEK_V3.items() if k != "qk_rope_head_dim"}, "qk_rope_head_dim: expected an integer"),
    ({k: v for k, v in DEEPSEEK_V3.items() if k != "kv_lora_rank"}, "kv_lora_rank: expected an integer >= 1 "
                                                                     "(model_type 'deepseek_v3' caches"),
])
def test_missing_or_contradictory_config_fields_name_the_field(config, message):
    with pytest.raises(ConfigError, match="^config.json: " + re.escape(message)):
        KVShape.from_hf_config(config)


@pytest.mark.parametrize("fields, message", [
    ({"kv_heads": 8, "head_dim": 128, "dtype": "bf16"}, "model.layers: expected an integer >= 1, found nothing"),
    ({"layers": 2, "kv_heads": 8, "head_dim": 128}, "model.dtype: expected a dtype (or dtype_bytes), found nothing"),
    ({"layers": 2, "kv_heads": 8, "dtype": "bf16"}, "model.head_dim: expected an integer >= 1, found 0"),
    ({"layers": 2, "kv_heads": 8, "head_dim": 64, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "dtype": "bf16"},
     "model.kv_lora_rank: expected either kv_heads and head_dim"),
    ({"layers": 2, "kv_heads": 8, "head_dim": 64, "dtype": "bf16", "dtype_bytes": 4},
     "model.dtype_bytes: expected 2 for dtype 'bf16', found 4"),
    ({"layers": 2, "heads": 8, "head_dim": 64, "dtype": "bf16"}, "model.heads: expected one of"),
])
def test_explicit_fields_missing_or_contradictory_name_the_field(fields, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        KVShape.from_fields(fields)


def test_an_unknown_preset_and_an_unreadable_file_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="^preset: expected one of tiny, small, base, found 'huge'"):
        KVShape.from_preset("huge")
    with pytest.raises(ConfigError, match="^hf_config: expected a readable config.json"):
        KVShape.from_hf_config(tmp_path / "missing.json")
