"""Requests through a real `TieredKVCache` as the embedded engine makes them, and the block keys the sizing
replay takes for them: shared by the replay's and the fleet's tests."""

from __future__ import annotations

import hashlib
import random

import torch

from sizing.replay import RequestKeys
from tests.blocks import BLOCK, blocks_for


def conversations(n_requests: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, generated tokens) per request: shared documents, continued conversations, exact repeats,
    fresh prompts; the output is a function of the prompt (greedy decoding)."""
    rng = random.Random(seed)
    docs = [[rng.randrange(256) for _ in range(rng.randint(1, 6) * BLOCK + rng.randrange(BLOCK))] for _ in range(12)]
    made: list[tuple[list[int], list[int]]] = []
    for _ in range(n_requests):
        draw = rng.random()
        if draw < 0.1 and made:
            prompt = list(rng.choice(made[-30:])[0])                        # the same prompt again
        else:
            if draw < 0.4 and made:
                base = rng.choice(made[-30:])[0]                           # a conversation's next turn
            elif draw < 0.85:
                base = docs[min(int(rng.expovariate(0.4)), len(docs) - 1)]  # a popular document
            else:
                base = []
            suffix = [rng.randrange(256) for _ in range(rng.randint(1, 3 * BLOCK))]
            prompt = (base + suffix)[: 10 * BLOCK + rng.randrange(BLOCK)]
        out = random.Random(hashlib.blake2b(repr(prompt).encode()).digest())
        made.append((prompt, [out.randrange(256) for _ in range(out.randint(1, 2 * BLOCK))]))
    return made


def serve_request(cache, layout, prompt: list[int], generated: list[int]) -> list[str]:
    """One request as the engine makes it; the tier each loaded block came from."""
    full_prompt = len(prompt) // BLOCK
    out = torch.empty((max(full_prompt, 1), *layout.block_shape), dtype=layout.torch_dtype)
    loaded = cache.load_into(prompt, out.__getitem__)
    hit = loaded.num_blocks
    if full_prompt > hit:
        cache.store(prompt[: full_prompt * BLOCK], blocks_for(layout, prompt)[hit:], first_block=hit)
    if hit:
        cache.promote(prompt[: hit * BLOCK], [out[i] for i in range(hit)])
    tokens = prompt + generated
    full = (len(tokens) - 1) // BLOCK  # the last generated token's KV is never computed
    if full > full_prompt:
        cache.store(tokens[: full * BLOCK], blocks_for(layout, tokens[: full * BLOCK])[full_prompt:],
                    first_block=full_prompt)
    cache.flush()
    return list(loaded.sources)


def request_keys(cache, prompt: list[int], generated: list[int]) -> RequestKeys:
    """The keys of a request's prompt blocks and of the blocks its output fills (the replay's input)."""
    full_prompt = len(prompt) // BLOCK
    tokens = prompt + generated
    full = (len(tokens) - 1) // BLOCK
    return RequestKeys(tuple(cache.keys_for(prompt)), tuple(cache.keys_for(tokens[: full * BLOCK])[full_prompt:]))
