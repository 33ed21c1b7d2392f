"""The embedded model as a Hugging Face Llama directory, so that another engine serves the same weights.

kvgate's model is a Llama (RMSNorm, rotate-half RoPE, grouped-query attention, SwiGLU), so
`export_hf` writes what `LlamaForCausalLM` loads: `config.json`, `model.safetensors` with Llama's
tensor names, and the byte tokenizer as `tokenizer.json` (a byte-level BPE with no merges: byte b is
id b, the six specials 256-261) with its chat template in `tokenizer_config.json`. vLLM or
transformers given that directory compute what `kvgate serve` computes: the fused projections are
split (`wqkv` into q/k/v, `w13` into gate/up) and the output scale is folded into `lm_head` (a power
of two: exact in every float format). Greedy decoding restricted to kvgate's generatable ids
(`generatable_ids`, vLLM's `allowed_token_ids`) then gives the same tokens as the embedded engine.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from cache_impl.engine.model import ModelArgs, Transformer, build_model
from cache_impl.engine.tokenizer import ASSISTANT, BOS, END, EOS, GENERATABLE, SPECIALS, SYSTEM, USER
from cache_impl.weights.safetensors_dir import clear_checkpoint

CHAT_TEMPLATE = ("<|bos|>{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
EXPORTED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def generatable_ids() -> list[int]:
    """The ids kvgate's engine samples from (printable ASCII, newline, end of text)."""
    return list(GENERATABLE)


def llama_config(args: ModelArgs, dtype: str) -> dict:
    """`config.json` of a LlamaForCausalLM with `args`' shape."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": args.dim, "intermediate_size": args.ffn_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.norm_eps, "vocab_size": args.vocab_size,
        "rope_theta": args.rope_base, "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_base},
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "bos_token_id": BOS, "eos_token_id": EOS, "torch_dtype": dtype, "dtype": dtype,
    }


def llama_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's parameters under Llama's names, the fused projections split, the output scale folded."""
    args = model.args
    kv = args.n_kv_heads * args.head_dim
    scale = args.logit_scale
    if scale <= 0 or math.frexp(scale)[0] != 0.5:
        raise ValueError(f"logit_scale: expected a power of two (folded into lm_head exactly), found {scale}")
    state = {name: tensor.detach().to("cpu") for name, tensor in model.state_dict().items()}
    out = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm.weight"],
           "lm_head.weight": state["output.weight"] * scale}
    for i in range(args.n_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = state[p + "wqkv.weight"].split([args.dim, kv, kv])
        gate, up = state[p + "w13.weight"].chunk(2)
        out.update({
            h + "input_layernorm.weight": state[p + "attn_norm.weight"],
            h + "self_attn.q_proj.weight": q, h + "self_attn.k_proj.weight": k, h + "self_attn.v_proj.weight": v,
            h + "self_attn.o_proj.weight": state[p + "wo.weight"],
            h + "post_attention_layernorm.weight": state[p + "ffn_norm.weight"],
            h + "mlp.gate_proj.weight": gate, h + "mlp.up_proj.weight": up,
            h + "mlp.down_proj.weight": state[p + "w2.weight"],
        })
    return {name: tensor.contiguous() for name, tensor in out.items()}


def byte_tokenizer_json() -> str:
    """kvgate's byte tokenizer as a `tokenizers` Tokenizer: byte b is id b, the specials 256-261, a leading
    <|bos|> when special tokens are added (as ByteTokenizer.encode does)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()          # the 256 printable stand-ins of the bytes
    stand_in = _bytes_to_unicode()
    if sorted(stand_in.values()) != sorted(alphabet):
        raise RuntimeError("tokenizers' byte-level alphabet differs from the byte map this export assumes")
    vocab = {stand_in[b]: b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = sorted(SPECIALS.items(), key=lambda item: item[1])
    tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False) for text, _ in specials])
    for text, token_id in specials:
        if tokenizer.token_to_id(text) != token_id:
            raise RuntimeError(f"special {text}: expected id {token_id}, found {tokenizer.token_to_id(text)}")
    tokenizer.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A $B",
                                                             special_tokens=[("<|bos|>", BOS)])
    return tokenizer.to_str()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level map: printable bytes stand for themselves, the rest for characters from U+0100."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def export_hf(directory: Path, preset: str, seed: int, dtype: str = "float32", overwrite: bool = False) -> Path:
    """Write the seeded model (`build_model(preset, seed)`) and the byte tokenizer as a Llama directory."""
    from safetensors.torch import save_file  # deferred: safetensors.torch imports torch

    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, found {dtype!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # one format in a directory: vLLM loads what an index names, so kvgate's shards beside these would be served
    clear_checkpoint(directory, overwrite, also=EXPORTED_FILES)
    model = build_model(preset, seed, torch.device("cpu"))
    tensors = {name: t.to(DTYPES[dtype]) for name, t in llama_tensors(model).items()}
    # written whole or not at all: every file into a staging directory beside them, moved in place at the end (a
    # full disk part-way leaves nothing a retry would refuse)
    staging = Path(tempfile.mkdtemp(prefix=".kvgate-export-", dir=directory))
    try:
        try:
            save_file(tensors, str(staging / "model.safetensors"),
                      metadata={"format": "pt", "kvgate.preset": preset, "kvgate.seed": str(seed)})
        except SafetensorError as error:     # a read-only or full filesystem, said as the OSError it is
            raise OSError(f"{directory / 'model.safetensors'}: {error}") from None
        _write_json(staging / "config.json", llama_config(model.args, dtype))
        _write_json(staging / "generation_config.json", {"bos_token_id": BOS, "eos_token_id": EOS})
        (staging / "tokenizer.json").write_text(byte_tokenizer_json(), encoding="utf-8")
        names = {token_id: text for text, token_id in SPECIALS.items()}
        _write_json(staging / "tokenizer_config.json", {
            "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
            "bos_token": names[BOS], "eos_token": names[EOS], "pad_token": names[EOS],
            "model_max_length": model.args.max_seq_len, "add_bos_token": True, "clean_up_tokenization_spaces": False,
            "extra_special_tokens": [names[i] for i in (SYSTEM, USER, ASSISTANT, END)],
        })
        _write_json(staging / "special_tokens_map.json",
                    {"bos_token": names[BOS], "eos_token": names[EOS], "pad_token": names[EOS]})
        # safetensors writes its file 0600: readable like the others, by an engine running as another user
        (staging / "model.safetensors").chmod((staging / "config.json").stat().st_mode & 0o777)
        for name in EXPORTED_FILES:
            os.replace(staging / name, directory / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
