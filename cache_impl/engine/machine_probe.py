"""This machine's speed at the embedded model's shapes, measured in about a second: what the sizing model
divides the model's FLOPs and bytes by before any G2 has measured the engine (sizing/machine.py).

How it works: docs/methods/sizing-model.md (cache_impl/engine/machine_probe.py).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import torch
import torch.nn.functional as F

from cache_impl.cache.keys import KVLayout
from cache_impl.cache.manager import resolve_device
from cache_impl.engine.engine import KV_DTYPE
from cache_impl.engine.model import PRESETS, ModelArgs, _causal_mask, build_model

CHUNK_TOKENS = 256                  # the engine's block size: a prefill chunk
ATTENTION_KEYS = 4096               # the prefix a probed chunk attends over
DECODE_CONTEXT = 2048               # tokens each probed decode sequence already holds
HOST_COPY_BYTES = 64 * 2**20
BUDGET_S = 0.25                     # per figure: about a second in all
MIN_REPEATS = 20                    # however long that takes, up to MAX_S a figure: a few are bound to be undisturbed
MAX_S = 2.0


def layer_matrices(args: ModelArgs) -> list[tuple[int, int]]:
    """(in, out) of each weight matrix a token goes through in one layer (cache_impl.engine.model.Block)."""
    kv_dim = args.n_kv_heads * args.head_dim
    return [(args.dim, args.dim + 2 * kv_dim), (args.dim, args.dim), (args.dim, 2 * args.ffn_dim),
            (args.ffn_dim, args.dim)]


def matmul_params(args: ModelArgs) -> int:
    """The weights every prompt token is multiplied by (the output head runs on the last token only)."""
    return args.n_layers * sum(i * o for i, o in layer_matrices(args))


def timed(call: Callable[[], object], device: torch.device, budget_s: float = BUDGET_S) -> float:
    """The least of `call`'s seconds over as many repeats as fit in `budget_s` (at least MIN_REPEATS unless that
    takes longer than MAX_S), after one warm-up."""
    def once() -> float:
        started = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - started

    once()
    started = time.perf_counter()
    seconds: list[float] = []
    while (len(seconds) < MIN_REPEATS or time.perf_counter() < started + budget_s) and (
            not seconds or time.perf_counter() < started + MAX_S):
        seconds.append(once())
    return min(seconds)


def probe_matmul(args: ModelArgs, device: torch.device) -> float:
    """FLOP/s of one prefill chunk through a layer's weight matrices."""
    generator = torch.Generator().manual_seed(0)
    pairs = [(torch.randn(CHUNK_TOKENS, i, generator=generator).to(device),
              torch.randn(o, i, generator=generator).to(device)) for i, o in layer_matrices(args)]
    flops = sum(2 * CHUNK_TOKENS * i * o for i, o in layer_matrices(args))
    with torch.inference_mode():
        return flops / timed(lambda: [F.linear(x, w) for x, w in pairs], device)


def probe_attention(args: ModelArgs, device: torch.device) -> float:
    """FLOP/s of one chunk's attention over ATTENTION_KEYS keys, masked as the engine's prefill masks it."""
    generator = torch.Generator().manual_seed(1)
    keys = ATTENTION_KEYS
    q = torch.randn(1, args.n_heads, CHUNK_TOKENS, args.head_dim, generator=generator).to(device)
    k, v = (torch.randn(1, args.n_kv_heads, keys, args.head_dim, generator=generator).to(device) for _ in range(2))

    def chunk() -> torch.Tensor:
        mask = _causal_mask(keys - CHUNK_TOKENS, CHUNK_TOKENS, keys, device)     # [T, keys]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    with torch.inference_mode():
        return 4 * CHUNK_TOKENS * keys * args.dim / timed(chunk, device)


def probe_decode(preset: str, device: torch.device, max_batch: int) -> dict:
    """Seconds of the model's decode pass at batch 1 and `max_batch`: {step_s, per_sequence_s, ...}."""
    model = build_model(preset, 0, device)
    a = model.args
    kvs = [torch.randn(a.n_layers, 2, a.n_kv_heads, DECODE_CONTEXT + 1, a.head_dim).to(device)
           for _ in range(max_batch)]

    def step(batch: int) -> float:
        tokens = torch.zeros(batch, dtype=torch.long, device=device)
        return timed(lambda: model.decode(tokens, kvs[:batch], [DECODE_CONTEXT] * batch), device, BUDGET_S / 2)

    one = step(1)
    many = step(max_batch) if max_batch > 1 else one
    per_sequence = max(0.0, (many - one) / (max_batch - 1)) if max_batch > 1 else one
    return {"step_s": max(0.0, one - per_sequence), "per_sequence_s": per_sequence, "batch_1_s": one,
            "batch_max_s": many, "max_batch": max_batch, "context_tokens": DECODE_CONTEXT}


def probe_host_copy(device: torch.device) -> float:
    """GB/s of a copy from host memory to the engine's device (both touched first: no page faults timed)."""
    source = torch.ones(HOST_COPY_BYTES, dtype=torch.uint8, pin_memory=device.type == "cuda")
    target = torch.empty(HOST_COPY_BYTES, dtype=torch.uint8, device=device)
    return HOST_COPY_BYTES / timed(lambda: target.copy_(source, non_blocking=False), device) / 1e9


def kv_bytes_per_token(args: ModelArgs) -> int:
    """The KV the engine keeps (and its cache stores) per token of a prompt: its cache layout's one-token block."""
    return KVLayout(args.n_layers, args.n_kv_heads, args.head_dim, KV_DTYPE, block_size=1).block_nbytes


def probe(preset: str, device_setting: str = "auto", max_batch: int = 8) -> dict:
    """Every figure of the module, with the model's FLOPs terms and where it ran."""
    started = time.perf_counter()
    device = resolve_device(device_setting)
    args = PRESETS[preset]
    figures = {"preset": preset, "device": str(device), "dtype": "float32", "threads": torch.get_num_threads(),
               "matmul_params": matmul_params(args), "layers": args.n_layers, "attention_dim": args.dim,
               "chunk_tokens": CHUNK_TOKENS, "attention_keys": ATTENTION_KEYS,
               "kv_bytes_per_token": kv_bytes_per_token(args),
               "matmul_flops": probe_matmul(args, device), "attention_flops": probe_attention(args, device),
               "decode": probe_decode(preset, device, max_batch), "host_copy_gbps": probe_host_copy(device)}
    return {**figures, "seconds": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m cache_impl.engine.machine_probe", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--max-batch", type=int, default=8, help="the engine's max_running (default 8)")
    args = parser.parse_args(argv)
    if args.max_batch < 1:
        parser.error(f"--max-batch: expected an integer >= 1, found {args.max_batch}")
    print(json.dumps(probe(args.preset, args.device, args.max_batch)))


if __name__ == "__main__":
    main()
