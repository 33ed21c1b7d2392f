"""A running request's state: its tokens so far, its KV and how much of it is computed, loaded and stored.

Torch-free (the tensors are only held): the scheduler reads `prefilling` and the request; the model runner
and the prefix cache fill the rest.
"""

from __future__ import annotations

import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from cache_impl.cache.keys import token_array
from cache_impl.engine.generation import GenerationRequest

if TYPE_CHECKING:
    import torch


@dataclass
class Sequence:
    request: GenerationRequest
    tokens: list[int]
    kv: "torch.Tensor"                  # [layers, 2, kv_heads, prompt + max_tokens (whole blocks), head_dim]
    buffer: "torch.Tensor"              # what `kv` is a view of (from the runner's KVBuffers)
    computed: int = 0                   # positions whose KV is in `kv`
    cached_tokens: int = 0              # of those, loaded from the cache
    stored_blocks: int = 0              # full blocks already offered to the cache
    loaded_blocks: int = 0              # leading blocks loaded from the cache, promoted after the first token
    generated: int = 0
    decoder: Any = None
    generator: Optional["torch.Generator"] = None
    prompt_ids: array.array = field(default_factory=lambda: array.array("I"))  # the prompt as the cache reads it

    def token_ids(self, n: int) -> array.array:
        """The first n tokens as a uint32 array (the prompt's converted once, at the start)."""
        return self.prompt_ids[:n] if n <= len(self.prompt_ids) else token_array(self.tokens[:n])

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_tokens)

    @property
    def prefilling(self) -> bool:
        """The first token is not out yet (prompt chunks, or the logits pass, remain)."""
        return len(self.tokens) == self.prompt_len
