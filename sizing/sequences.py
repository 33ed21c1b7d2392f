"""Block-key sequences of workloads and traces, in the order a load sends them, as the cache sees them.

- `workload_block_keys`: any kvgate workload spec (or a built `Workload`) as the embedded engine
  sees it: each request's prompt tokens are its chat template (`cache_impl.server.protocol.chat_tokens`
  with the byte tokenizer, or another `PromptTokenizer`), cut into whole blocks and keyed by
  `cache_impl.cache.keys.block_keys`, in `load_order`.
- `requests_block_keys`: the same for requests in a given order (a segment of a load: a primer, a
  trace part); `word_chat_tokens`: an external engine's prompts as the word sizer counts them.
- `trace_block_keys`: a Mooncake trace's requests in the trace's order, keyed by their hash ids
  (no text, no template: the trace's own reuse).

Keys only need to be equal where the engine's are equal, so any fixed fingerprint digest serves
(`SIZING_DIGEST`); the engine's own digest names its weights, which are not needed here.
"""

from __future__ import annotations

import array
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import xxhash

from cache_impl.cache.keys import ROOT_PARENT, block_keys
from cache_impl.engine.tokenizer import ByteTokenizer
from cache_impl.server.protocol import Message, chat_tokens
from kvcore.settings import ConfigError
from workloads.traffic.datasets import (
    MOONCAKE_BLOCK_TOKENS,
    ByteSizer,
    TextSizer,
    TraceRecord,
    WordSizer,
    WorkloadSpec,
    build_workload,
)
from workloads.traffic.requests import Workload, WorkloadRequest, load_order

from .replay import RequestKeys

SIZING_DIGEST = bytes(range(16))

PromptTokenizer = Callable[[WorkloadRequest], Sequence[int]]
_BYTES = ByteTokenizer()
_WORDS = WordSizer()


def embedded_chat_tokens(request: WorkloadRequest) -> list[int]:
    """The embedded server's chat route: the byte tokenizer's chat template (`protocol.chat_tokens`)."""
    return chat_tokens(_BYTES, [Message.model_validate(m) for m in request.messages])


def embedded_completion_tokens(request: WorkloadRequest) -> list[int]:
    """The embedded server's completions route: BOS and the prompt text's bytes."""
    return _BYTES.encode(request.prompt_text())


def workload_block_keys(workload: Union[Workload, WorkloadSpec, Mapping[str, Any], str, Path],
                        tokenizer: PromptTokenizer = embedded_chat_tokens, *, seed: int = 0,
                        block_tokens: int = 256, passes: int = 1, outputs: bool = True,
                        sizer: Optional[TextSizer] = None) -> list[RequestKeys]:
    """Block keys of a workload (a spec, its mapping or file, or a built `Workload`) in load order.

    A spec is built with `sizer` (default: the embedded engine's `ByteSizer`) and `seed`. Prompt
    keys are `cache_impl.cache.keys.block_keys` of `tokenizer(request)` (default: the embedded chat
    route) over whole `block_tokens` blocks. With `outputs`, a request that generates all its
    max_tokens fills (prompt + max_tokens - 1) // B - prompt // B more blocks (the engine stores full
    blocks of computed positions; the last token's KV is never computed); their tokens are unknown,
    so their keys are made from the whole prompt: equal prompts, equal outputs, as greedy decoding gives.
    A trace's warm-up requests come first: count them out with `replay(..., warmup=len(workload.warmup))`.
    """
    for name, value in (("block_tokens", block_tokens), ("passes", passes)):
        if type(value) is not int or value < 1:
            raise ConfigError(f"{name}: expected an integer >= 1, found {value!r}")
    if not isinstance(workload, Workload):
        workload = build_workload(workload, sizer or ByteSizer(), seed)
    return requests_block_keys(load_order(workload, passes), tokenizer, block_tokens=block_tokens, outputs=outputs)


def requests_block_keys(requests: Sequence[WorkloadRequest], tokenizer: PromptTokenizer = embedded_chat_tokens, *,
                        block_tokens: int = 256, outputs: bool = True) -> list[RequestKeys]:
    """Block keys of requests in the order given (`workload_block_keys` of a load order, or part of one)."""
    done: dict[str, RequestKeys] = {}
    keyed = []
    for request in requests:
        if request.request_id not in done:
            done[request.request_id] = _request_keys(tokenizer(request), request.max_tokens, block_tokens, outputs)
        keyed.append(done[request.request_id])
    return keyed


def word_chat_tokens(request: WorkloadRequest) -> list[int]:
    """An external engine's prompt as `WordSizer` counts it (one token per word, the sizer G3 builds an
    external target's workload with): each message's words, each word a stable id. An approximation of
    the engine's tokenizer and chat template: equal prompts give equal ids, and a shared opening shares them."""
    words = []
    for message in request.messages:
        words.append(f"<{message.get('role', '')}>")
        words.extend(_WORDS.tokens(str(message.get("content") or "")))
    return [xxhash.xxh32_intdigest(word.encode()) for word in words]


def _request_keys(tokens: Sequence[int], max_tokens: int, block_tokens: int, outputs: bool) -> RequestKeys:
    prompt = tuple(block_keys(tokens, SIZING_DIGEST, block_tokens))
    if not outputs:
        return RequestKeys(prompt)
    extra = (len(tokens) + max_tokens - 1) // block_tokens - len(tokens) // block_tokens
    if extra <= 0:
        return RequestKeys(prompt)
    tail = array.array("I", tokens[len(prompt) * block_tokens:]).tobytes()
    origin = b"output" + (prompt[-1] if prompt else ROOT_PARENT) + tail
    return RequestKeys(prompt, tuple(xxhash.xxh3_128_digest(origin + j.to_bytes(4, "little")) for j in range(extra)))


def trace_block_keys(records: Sequence[TraceRecord], block_tokens: Optional[int] = None, *,
                     trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS, outputs: bool = True) -> list[RequestKeys]:
    """Block keys of a Mooncake trace's requests, in the trace's order, in blocks of `block_tokens`
    (default: the trace's own, one block per hash id).

    A hash id names a `trace_block_tokens`-token block together with its whole prefix (Mooncake
    remaps prefix block hashes), so the prefix that ends at token e is named by the id of the block
    holding token e-1 and e's offset in it: block j of B tokens ends at e = (j + 1) × B and its key is
    (hash_ids[(e - 1) // T], e - T × ((e - 1) // T)). Only whole blocks of the input count; tokens
    beyond the hash ids are the request's own (keys no other request has). With `outputs`, the
    blocks the output fills are stored too, as in `workload_block_keys` (keys of this request only).
    """
    size = trace_block_tokens if block_tokens is None else block_tokens
    if type(size) is not int or size < 1:
        raise ConfigError(f"block_tokens: expected an integer >= 1, found {block_tokens!r}")
    keyed = []
    for n, record in enumerate(records):
        ids, length = record.hash_ids, record.input_length
        covered = min(length, len(ids) * trace_block_tokens)
        prompt: list[tuple] = []         # a trace block's (hash id, tokens) or this request's own ("own", n, end)
        for end in range(size, length + 1, size):
            if end <= covered:
                at = (end - 1) // trace_block_tokens
                prompt.append((ids[at], end - at * trace_block_tokens))
            else:
                prompt.append(("own", n, end))
        extra = (length + max(1, record.output_length) - 1) // size - length // size if outputs else 0
        keyed.append(RequestKeys(tuple(prompt), tuple(("output", n, j) for j in range(extra))))
    return keyed
