"""Block keys and the fingerprint that scopes them.

A token sequence is cut into blocks of `block_size` tokens; only full blocks
get keys. The key of block i is

    key_i = xxh3_128( fingerprint_digest || key_{i-1} || token_ids_i as little-endian uint32 )

with key_{-1} = 16 zero bytes. Keys are 16 raw bytes (`Key`), shown as 32
lowercase hex digits. Because a key chains its parent, equal keys mean equal
whole prefixes, and because it includes the fingerprint digest, a change of
weights, tokenizer, KV layout, format version or tenant salt makes every
older block unreachable. The test suite publishes conformance vectors.
"""

from __future__ import annotations

import array
import hashlib
import json
import sys
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Hashable, Sequence, TypeVar

if TYPE_CHECKING:
    import torch

import numpy as np
import xxhash

FORMAT_VERSION = 1
KEY_BYTES = 16
ROOT_PARENT = bytes(KEY_BYTES)

Key = bytes
# What the cache's bookkeeping (LRU accounts, block index, placement) keys blocks by: the cache's own `Key`s,
# or any hashable in the sizing model's replay of it (sizing/replay.py).
BlockKey = TypeVar("BlockKey", bound=Hashable)

# bytes per element; torch itself is imported only by code that builds tensors (keys stay torch-free)
_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one block of KV: [layers, 2 (k, v), kv_heads, block_size, head_dim]."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    block_size: int = 256

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"layout.{name}: expected an integer >= 1, found {value!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"layout.dtype: expected one of {sorted(_DTYPES)}, found {self.dtype!r}")

    @property
    def torch_dtype(self) -> "torch.dtype":
        import torch  # deferred: torch, for the one caller that hands in tensors; keys stay torch-free

        return getattr(torch, self.dtype)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def block_nbytes(self) -> int:
        return int(np.prod(self.block_shape)) * _DTYPES[self.dtype]


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """Everything that makes stored KV valid for a model; part of every key and block file."""

    weights_digest: str
    tokenizer_id: str
    layout: KVLayout
    format_version: int = FORMAT_VERSION
    tenant_salt: str = ""
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        canonical = json.dumps(
            {
                "weights_digest": self.weights_digest,
                "tokenizer_id": self.tokenizer_id,
                "layout": asdict(self.layout),
                "format_version": self.format_version,
                "tenant_salt": self.tenant_salt,
            },
            sort_keys=True,
            separators=(",", ":"),
        )
        object.__setattr__(self, "digest", hashlib.blake2b(canonical.encode(), digest_size=KEY_BYTES).digest())

    @property
    def hex(self) -> str:
        return self.digest.hex()


def salted_digest(fingerprint_digest: bytes, salt: str) -> bytes:
    """The digest that scopes a request's block keys: the fingerprint's, or, for a request with a cache salt
    (vLLM's `cache_salt`: requests that must not share KV with others, e.g. tenants), one derived from it and
    the salt, so that only requests with the same salt find each other's blocks."""
    if not salt:
        return fingerprint_digest
    return hashlib.blake2b(fingerprint_digest + b"cache-salt:" + salt.encode(), digest_size=KEY_BYTES).digest()


def token_array(tokens: Sequence[int]) -> array.array:
    """Token ids as the uint32 array `block_keys` reads without a copy (array.array("I") is the fastest
    way from a Python list: ~14 ns a token, 1.4-2 ms for a 128k-token prompt, which is most of a lookup's
    time when it is redone per call; an engine converts a prompt once and hands the cache this)."""
    ids = array.array("I", tokens)  # 4-byte unsigned on every supported platform; OverflowError outside uint32
    if sys.byteorder == "big":
        ids.byteswap()
    return ids


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> memoryview:
    """Token ids as little-endian uint32 bytes: without a copy from a `token_array` or a uint32 ndarray."""
    if isinstance(tokens, array.array) and tokens.typecode == "I" and tokens.itemsize == 4:
        return memoryview(tokens).cast("B")
    if isinstance(tokens, np.ndarray):
        # .data: the array's memoryview (numpy's stubs give ndarray the buffer protocol from Python 3.12 only)
        return np.ascontiguousarray(tokens, dtype="<u4").data.cast("B")
    return memoryview(token_array(tokens)).cast("B")


def block_keys(tokens: Sequence[int] | np.ndarray, fingerprint_digest: bytes, block_size: int) -> list[Key]:
    """Keys of every full block of `tokens`, in order (a partial last block has none)."""
    raw = _token_bytes(tokens)
    step = block_size * 4
    full = (len(raw) // step) * step
    keys: list[Key] = []
    parent = ROOT_PARENT
    digest = xxhash.xxh3_128_digest
    for start in range(0, full, step):
        parent = digest(fingerprint_digest + parent + raw[start : start + step])
        keys.append(parent)
    return keys
