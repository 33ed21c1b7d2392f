"""A small Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) with weights from a seed.

Nothing is downloaded: `build_model(preset, seed)` makes deterministic weights,
and `weights_digest` names them for the cache fingerprint. The KV of a
sequence is one tensor per request, [layers, 2, kv_heads, max_len, head_dim],
the same layout the cache stores block by block.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict
from typing import Iterable, cast

import torch
import torch.nn.functional as F
from torch import nn

from cache_impl.engine.presets import DEFAULT_PRESET, PRESETS, ModelArgs  # noqa: F401  (the model's settings, torch-free)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(args: ModelArgs, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [max_seq_len, head_dim // 2]."""
    inv_freq = 1.0 / args.rope_base ** (torch.arange(0, args.head_dim, 2, device=device).float() / args.head_dim)
    angles = torch.outer(torch.arange(args.max_seq_len, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, D]; cos, sin: [B, 1, T, D/2] (rotate pairs of the two halves)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Block(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        kv_dim = args.n_kv_heads * args.head_dim
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.wqkv = nn.Linear(args.dim, args.dim + 2 * kv_dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.w13 = nn.Linear(args.dim, 2 * args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # x: [B, T, dim] -> q: [B, H, T, D], k, v: [B, KH, T, D]
        a = self.args
        B, T, _ = x.shape
        q, k, v = self.wqkv(self.attn_norm(x)).split([a.dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim], -1)
        q = q.view(B, T, a.n_heads, a.head_dim).transpose(1, 2)
        k = k.view(B, T, a.n_kv_heads, a.head_dim).transpose(1, 2)
        v = v.view(B, T, a.n_kv_heads, a.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        # attn: [B, H, T, D] -> residual stream [B, T, dim]
        B, _, T, _ = attn.shape
        x = x + self.wo(attn.transpose(1, 2).reshape(B, T, self.args.dim))
        gate, up = self.w13(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)

    def blocks(self) -> Iterable[Block]:
        """The layers, each a Block (made so above; nn.ModuleList types its items as any Module)."""
        return cast("Iterable[Block]", self.layers)

    def setup_rope(self) -> None:
        self.rope_cos, self.rope_sin = rope_tables(self.args, self.embed.weight.device)

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, kv: torch.Tensor, start: int) -> torch.Tensor:
        """Run tokens at positions [start, start+T) of one sequence, writing their KV; logits of the last one.

        tokens: [T]; kv: [layers, 2, KH, max_len, D] holding positions [0, start) already.
        """
        T = tokens.shape[0]
        end = start + T
        x = self.embed(tokens)[None]                          # [1, T, dim]
        cos = self.rope_cos[start:end][None, None]            # [1, 1, T, D/2]
        sin = self.rope_sin[start:end][None, None]
        mask = _causal_mask(start, T, end, x.device)          # [T, end], additive
        for i, layer in enumerate(self.blocks()):
            q, k, v = layer.qkv(x, cos, sin)
            kv[i, 0, :, start:end] = k[0]
            kv[i, 1, :, start:end] = v[0]
            keys, values = kv[i, 0, :, :end][None], kv[i, 1, :, :end][None]   # [1, KH, end, D]
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
            x = layer.finish(x, attn)
        return self._logits(x[:, -1])[0]

    @torch.inference_mode()
    def logits_at(self, token: torch.Tensor, kv: torch.Tensor, pos: int) -> torch.Tensor:
        """Logits of the token at `pos` from a KV that already holds positions [0, pos]; nothing is written.

        token: [] (a 0-d tensor); kv: [layers, 2, KH, max_len, D]. The query is computed afresh; the keys
        and values, the token's own included, are the ones in `kv`.
        """
        x = self.embed(token.view(1))[None]                   # [1, 1, dim]
        cos = self.rope_cos[pos : pos + 1][None, None]        # [1, 1, 1, D/2]
        sin = self.rope_sin[pos : pos + 1][None, None]
        for i, layer in enumerate(self.blocks()):
            q, _, _ = layer.qkv(x, cos, sin)
            keys, values = kv[i, 0, :, : pos + 1][None], kv[i, 1, :, : pos + 1][None]
            x = layer.finish(x, F.scaled_dot_product_attention(q, keys, values, enable_gqa=True))
        return self._logits(x[:, -1])[0]

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, kvs: list[torch.Tensor], positions: list[int]) -> torch.Tensor:
        """One new token for each of B sequences; returns logits [B, vocab].

        tokens: [B]; kvs[b]: that sequence's KV; positions[b]: where its token goes.
        """
        x = self.embed(tokens)[:, None]                       # [B, 1, dim]
        pos = torch.tensor(positions, device=x.device)
        cos = self.rope_cos[pos][:, None, None]               # [B, 1, 1, D/2]
        sin = self.rope_sin[pos][:, None, None]
        for i, layer in enumerate(self.blocks()):
            q, k, v = layer.qkv(x, cos, sin)
            outs = []
            for b, (cache, p) in enumerate(zip(kvs, positions)):
                cache[i, 0, :, p] = k[b, :, 0]
                cache[i, 1, :, p] = v[b, :, 0]
                keys, values = cache[i, 0, :, : p + 1][None], cache[i, 1, :, : p + 1][None]
                outs.append(F.scaled_dot_product_attention(q[b : b + 1], keys, values, enable_gqa=True))
            x = layer.finish(x, torch.cat(outs))
        return self._logits(x[:, -1])

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(x)).float() * self.args.logit_scale


def _causal_mask(start: int, T: int, end: int, device: torch.device) -> torch.Tensor:
    """[T, end] additive float mask: query at position start+t sees keys at positions <= start+t.

    Built once per chunk: given a boolean mask, attention converts it to this in every layer
    (the same values, so the same results bit for bit, at a fifth of a long chunk's cost).
    """
    rows = torch.arange(start, end, device=device)[:, None]
    cols = torch.arange(end, device=device)[None, :]
    return torch.zeros((T, end), device=device).masked_fill_(cols > rows, float("-inf"))


def build_model(preset: str | ModelArgs, seed: int, device: torch.device) -> Transformer:
    """A model with deterministic weights from `seed` (the same bits on every machine for the CPU)."""
    args = PRESETS[preset] if isinstance(preset, str) else preset
    generator = torch.Generator().manual_seed(seed)
    model = Transformer(args)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                fan_in = param.shape[-1] if param.dim() > 1 and not name.startswith("embed") else args.dim
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(fan_in))
    model = model.to(device).eval()
    model.setup_rope()
    return model


def weights_digest(model: Transformer) -> str:
    """sha256 of the model's arguments and every parameter's bytes (the cache fingerprint uses it)."""
    digest = hashlib.sha256(repr(sorted(asdict(model.args).items())).encode())
    for name, param in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(param.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return "sha256:" + digest.hexdigest()
