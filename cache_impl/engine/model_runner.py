"""The model's side of the engine: forward passes over sequences, sampling, and the KV buffers they run in.

Prefill runs in chunks of exactly one cache block, aligned to block boundaries from position 0. A
prompt whose first k blocks come from the cache therefore computes the same chunks, with the same
inputs, as a recompute does from scratch, and greedy output is bit-for-bit the same in every mode.
A prompt that ends on a block boundary takes its first token's logits from a one-token pass over
the finished KV (`Transformer.logits_at`), in every mode: when all its blocks are cached, that pass
is all that is computed.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from cache_impl.cache.keys import token_array
from cache_impl.engine.generation import GenerationRequest
from cache_impl.engine.kvbuffers import KVBuffers
from cache_impl.engine.model import Transformer
from cache_impl.engine.sequence import Sequence
from cache_impl.engine.tokenizer import GENERATABLE
from cache_impl.platform.buffers import aligned_empty
from cache_impl.platform.heap import HeapTrimmer

KV_DTYPE = torch.float32


class ModelRunner:
    """Runs `model` on `device`; keeps up to `max_idle_buffers` finished requests' KV buffers for reuse."""

    def __init__(self, model: Transformer, device: torch.device, block_size: int, max_idle_buffers: int) -> None:
        self.model, self.device, self.block_size = model, device, block_size
        self.allowed = torch.full((model.args.vocab_size,), float("-inf"), device=device)  # added to the logits
        self.allowed[GENERATABLE] = 0.0
        self.kv_buffers = KVBuffers(self._allocate_kv, max_idle=max_idle_buffers)
        self.heap = HeapTrimmer()  # what finished requests freed goes back to the OS, not to a fragmented arena

    def new_sequence(self, request: GenerationRequest, decoder: Any) -> Sequence:
        """A sequence for `request` in a KV buffer of whole blocks (loads copy block-shaped views)."""
        total = len(request.prompt_tokens) + request.max_tokens
        capacity = -(-total // self.block_size) * self.block_size
        buffer = self.kv_buffers.take(capacity)
        seq = Sequence(request, list(request.prompt_tokens), buffer[:, :, :, :capacity], buffer,
                       decoder=decoder, prompt_ids=token_array(request.prompt_tokens))
        if request.temperature > 0:
            seed = request.seed if request.seed is not None else torch.seed()
            seq.generator = torch.Generator(device=self.device).manual_seed(seed)
        return seq

    def release(self, seq: Sequence) -> None:
        """A finished sequence's KV buffer back to the pool."""
        self.kv_buffers.give(seq.buffer)
        # its activations are freed (and maybe a KV buffer): their measure for the trimmer is its KV size
        self.heap.released(seq.kv.nbytes)

    def prefill_chunk(self, seq: Sequence) -> Optional[torch.Tensor]:
        """One block-aligned chunk of the prompt; the first token's logits [1, vocab] once the prompt is in
        the KV, else None."""
        if seq.computed < seq.prompt_len:
            start = seq.computed
            end = min((start // self.block_size + 1) * self.block_size, seq.prompt_len)
            chunk = torch.tensor(seq.tokens[start:end], device=self.device)
            logits = self.model.prefill(chunk, seq.kv, start)
            seq.computed = end
            if seq.computed < seq.prompt_len:
                return None
        if seq.prompt_len % self.block_size == 0:  # on a boundary: every mode asks the finished KV
            last = seq.prompt_len - 1
            logits = self.model.logits_at(torch.tensor(seq.tokens[last], device=self.device), seq.kv, last)
        return logits[None]

    def decode(self, batch: list[Sequence]) -> torch.Tensor:
        """One decode step of every sequence in `batch`: logits [len(batch), vocab]."""
        tokens = torch.tensor([s.tokens[-1] for s in batch], device=self.device)
        return self.model.decode(tokens, [s.kv for s in batch], [len(s.tokens) - 1 for s in batch])

    def sample(self, logits: torch.Tensor, seq: Sequence) -> int:
        """The next token from logits [1, vocab]: greedy, or drawn with the sequence's generator."""
        logits = logits[0] + self.allowed
        if seq.request.temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / seq.request.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=seq.generator))

    def _kv_shape(self, positions: int) -> tuple[int, ...]:
        args = self.model.args
        return (args.n_layers, 2, args.n_kv_heads, positions, args.head_dim)

    def _allocate_kv(self, positions: int) -> torch.Tensor:
        """Page-aligned, with whole blocks of positions: the disk tier reads a block into it with O_DIRECT."""
        return aligned_empty(self._kv_shape(positions), KV_DTYPE, self.device)

    def kv_buffers_limit(self, max_running: int, max_context: int) -> int:
        """The most the request KV buffers hold by design: `max_running` running and the kept ones, each at
        most the context's whole blocks."""
        positions = -(-max_context // self.block_size) * self.block_size
        per_buffer = math.prod(self._kv_shape(positions)) * torch.empty((), dtype=KV_DTYPE).element_size()
        return (max_running + self.kv_buffers.max_idle) * per_buffer
