"""kvgate's tiered cache under a vLLM: what the KV connector (cache_impl/vllm/vllm_connector.py) decides, without vLLM.

The connector's settings (`kv_connector_extra_config`), the fingerprint that scopes a vLLM instance's
blocks, which blocks of a request to load and to save at each scheduler step (`RequestBook`), and the
copies between vLLM's paged KV and kvgate's blocks (`PagedKV`). vLLM itself is imported only by the
connector module, so all of this is tested in kvgate's own environment.

One kvgate block is one vLLM block (the cache's block size is vLLM's): kvgate block i of a prompt is
the request's vLLM block `block_ids[i]`. A request's keys are scoped by its `cache_salt` as vLLM scopes its
own prefix cache (keys.salted_digest): requests with different salts never share a block. A block holds, per attention
layer, the bytes of that vLLM
block exactly as vLLM lays them out (the CPU backend's [heads, block, 2 x head_dim], FlashAttention's
[2, block, heads, head_dim], ...), so loads and saves are plain copies; the layout's name is part of
the fingerprint, so an instance with another layout never reads them.
"""

from __future__ import annotations

import hashlib
import socket
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

import xxhash
from pydantic import Field, ValidationError, field_validator

from cache_impl.cache.config import CacheConfig, DiskTierConfig, RemoteTierConfig
from cache_impl.cache.keys import Fingerprint, Key, KVLayout, block_keys, salted_digest
from kvcore.settings import ConfigError, StrictModel, format_validation_error, parse_size

EXTRA = "kv_connector_extra_config"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "chat_template.jinja")


class ConnectorSettings(StrictModel):
    """The connector's `kv_connector_extra_config`: kvgate's tiers below vLLM's KV cache, and its admin sidecar."""

    host_capacity_bytes: int = Field(default=2 * 2**30, description="the host DRAM tier; 0: none")
    disk: Optional[DiskTierConfig] = Field(default=None, description="the disk tier; none when absent")
    remote: Optional[RemoteTierConfig] = Field(default=None, description="the shared pool; none when absent")
    write_policy: Literal["write-through", "write-back"] = "write-through"
    max_pending_write_bytes: int = Field(default=512 * 2**20, ge=0)
    admin_port: Optional[int] = Field(default=None, ge=1, le=65535, description=(
        "serve kvgate's admin routes (/admin/cache/*, /admin/faults) and /metrics on this port; none: no sidecar"))
    admin_host: str = Field(default="127.0.0.1", description="the sidecar's address")
    admin_token_env: str = Field(default="KVGATE_ADMIN_TOKEN", description="the environment variable holding "
                                 "the sidecar's admin token (the sidecar refuses to start without it)")
    weights_id: Optional[str] = Field(default=None, min_length=1, description=(
        "names the weights in the fingerprint instead of a digest of the model directory's weight files "
        "(for a model that is not a local directory, or to skip reading a large one)"))
    tenant_salt: str = Field(default="", description="isolates tenants that share a disk or pool")

    _parse_sizes = field_validator("host_capacity_bytes", "max_pending_write_bytes", mode="before")(
        lambda cls, v: parse_size(v))

    @classmethod
    def from_extra_config(cls, extra: Any) -> "ConnectorSettings":
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise ConfigError(f"{EXTRA}: expected a JSON object, found {type(extra).__name__}")
        try:
            return cls.model_validate(extra)
        except ValidationError as error:
            raise ConfigError(format_validation_error(error, EXTRA)) from None

    def cache_config(self, block_size: int) -> CacheConfig:
        """The cache under vLLM: no device tier (vLLM's own KV cache is the device tier), vLLM's block size."""
        if self.host_capacity_bytes == 0 and self.disk is None and self.remote is None:
            raise ConfigError(f"{EXTRA}: expected at least one tier (host_capacity_bytes > 0, disk or remote), "
                              f"found none")
        return CacheConfig.from_dict({
            "block_size": block_size, "device": "cpu", "device_capacity_blocks": 0,
            "host_capacity_bytes": self.host_capacity_bytes,
            "disk": self.disk.model_dump() if self.disk else None,
            "remote": self.remote.model_dump() if self.remote else None,
            "write_policy": self.write_policy, "max_pending_write_bytes": self.max_pending_write_bytes,
        }, root=EXTRA)


# -- the fingerprint of a vLLM instance ---------------------------------------------------------------------

def files_digest(directory: Path, names: Sequence[str] | None = None, suffixes: Sequence[str] = ()) -> Optional[str]:
    """xxh3-128 over the names and contents of a directory's files (those named, or with one of the suffixes),
    in name order; None when there are none."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    found = sorted(p for p in directory.iterdir() if p.is_file() and
                   ((names is not None and p.name in names) or (suffixes and p.name.endswith(tuple(suffixes)))))
    if not found:
        return None
    digest = xxhash.xxh3_128()
    for path in found:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as handle:
            while chunk := handle.read(8 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def instance_fingerprint(model: str, tokenizer: str, layout: KVLayout, kv_layout_name: str,
                         settings: ConnectorSettings) -> Fingerprint:
    """The fingerprint of a vLLM instance's KV: its weights (a digest of the weight files, or `weights_id`), its
    tokenizer (a digest of its files, else its name), vLLM's KV layout and the block layout, the tenant salt."""
    weights = settings.weights_id or files_digest(Path(model), suffixes=WEIGHT_SUFFIXES)
    if weights is None:
        raise ConfigError(f"{EXTRA}.weights_id: expected a name for the weights, since the model {model!r} is not a "
                          f"local directory of weight files; found none")
    tokenizer_id = files_digest(Path(tokenizer), names=TOKENIZER_FILES) or f"name:{tokenizer}"
    return Fingerprint(f"{weights}|vllm-kv:{kv_layout_name}", tokenizer_id, layout,
                       tenant_salt=settings.tenant_salt)


# -- which blocks move at each scheduler step --------------------------------------------------------------

@dataclass(frozen=True)
class BlockRun:
    """Blocks `first` .. `end` - 1 of a request's prompt (kvgate block i is vLLM block `block_ids[i - first]`)."""

    req_id: str
    tokens: Sequence[int]
    first: int
    end: int
    block_ids: tuple[int, ...]
    salt: str = ""

    @property
    def num_blocks(self) -> int:
        return self.end - self.first

    def keys(self, fingerprint_digest: bytes, block_size: int) -> list[Key]:
        """The keys of blocks `first` .. `end` - 1, scoped by the request's cache salt."""
        tokens = self.tokens[: self.end * block_size]
        return block_keys(tokens, salted_digest(fingerprint_digest, self.salt), block_size)[self.first:]


@dataclass
class StepPlan:
    """What the worker does in one step: loads before the forward pass, saves after it."""

    loads: list[BlockRun] = field(default_factory=list)
    saves: list[BlockRun] = field(default_factory=list)


@dataclass
class _Tracked:
    tokens: Sequence[int]
    block_ids: list[int]
    saved: int          # blocks 0 .. saved - 1 are in the cache already (loaded, hit, or saved)
    salt: str = ""


@dataclass(frozen=True)
class Matched:
    """A lookup's answer for one request: blocks the cache holds from the start, and the tier of each."""

    blocks: int
    tiers: tuple[str, ...]


class RequestBook:
    """The scheduler half's bookkeeping: per request, its blocks, what it will load and what is saved already."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._matched: dict[str, Matched] = {}
        self._local: dict[str, int] = {}                 # req_id -> tokens vLLM holds itself, at the lookup
        self._loads: dict[str, tuple[int, int]] = {}     # req_id -> (first, end) blocks to load
        self._tracked: dict[str, _Tracked] = {}
        self._salts: dict[str, str] = {}                 # req_id -> its cache salt (vLLM's cache_salt), when given

    def salted(self, req_id: str, salt: Optional[str]) -> None:
        """A new request's cache salt (none: ""): its blocks are keyed with it."""
        if salt:
            self._salts[req_id] = salt

    def salt(self, req_id: str) -> str:
        return self._salts.get(req_id, "")

    def loadable_tokens(self, req_id: str, prompt_len: int, matched: Matched, local_tokens: int) -> int:
        """Tokens to load beyond the `local_tokens` vLLM holds: the cached whole blocks, never the prompt's last
        token (vLLM computes at least one), none when vLLM holds as much already."""
        self._matched[req_id] = matched
        self._local[req_id] = local_tokens
        usable = min(matched.blocks, max(prompt_len - 1, 0) // self.block_size) * self.block_size
        return max(usable - local_tokens, 0)

    def allocated(self, req_id: str, external_tokens: int) -> None:
        """vLLM allocated blocks for `external_tokens` to load after the tokens it holds itself."""
        local_tokens = self._local.pop(req_id, 0)
        if external_tokens > 0:
            first = local_tokens // self.block_size
            self._loads[req_id] = (first, first + external_tokens // self.block_size)

    def hit_tiers(self, req_id: str, external_tokens: int) -> dict[str, int]:
        """The tokens that will be loaded, by the tier each block comes from."""
        first, end = self._loads.get(req_id, (0, 0))
        tiers = self._matched.get(req_id, Matched(0, ())).tiers[first:end]
        counts: dict[str, int] = {}
        for tier in tiers:
            counts[tier] = counts.get(tier, 0) + self.block_size
        return counts if sum(counts.values()) == external_tokens else {}

    def new_request(self, req_id: str, prompt: Sequence[int], block_ids: Sequence[int], computed: int,
                    scheduled: int, plan: StepPlan) -> None:
        """A request scheduled for the first time: its load (if any) and the blocks this step completes."""
        matched = self._matched.pop(req_id, Matched(0, ()))
        tracked = _Tracked(prompt, list(block_ids), min(matched.blocks, len(prompt) // self.block_size),
                           self.salt(req_id))
        self._tracked[req_id] = tracked
        load = self._loads.pop(req_id, None)
        if load is not None and load[1] > load[0]:
            plan.loads.append(self._run(req_id, tracked, *load))
        self._save(req_id, tracked, computed + scheduled, plan)

    def cached_request(self, req_id: str, new_block_ids: Optional[Sequence[int]], resumed: bool, computed: int,
                       scheduled: int, plan: StepPlan, all_tokens: Optional[Sequence[int]] = None) -> None:
        """A request scheduled again: its new blocks (all of them when resumed after preemption), and the prompt
        blocks this step completes. A resumed request's blocks are new: what it held was freed."""
        tracked = self._tracked.get(req_id)
        if tracked is None:
            return
        if resumed:
            tracked.block_ids = list(new_block_ids or ())
            load = self._loads.pop(req_id, None)
            if load is not None and load[1] > load[0]:
                plan.loads.append(self._run(req_id, tracked, *load))
        elif new_block_ids:
            tracked.block_ids.extend(new_block_ids)
        self._save(req_id, tracked, computed + scheduled, plan)

    def load_failed(self, block_ids: set[int]) -> None:
        """The worker could not load these vLLM blocks (refused or gone): vLLM recomputes them, and they are saved
        again from the first of them on."""
        for tracked in self._tracked.values():
            bad = next((i for i, b in enumerate(tracked.block_ids[: tracked.saved]) if b in block_ids), None)
            if bad is not None:
                tracked.saved = bad

    def finished(self, req_id: str) -> None:
        self._tracked.pop(req_id, None)
        self._loads.pop(req_id, None)
        self._matched.pop(req_id, None)
        self._local.pop(req_id, None)
        self._salts.pop(req_id, None)

    def _save(self, req_id: str, tracked: _Tracked, computed_after: int, plan: StepPlan) -> None:
        """The prompt's whole blocks computed by the end of this step that the cache does not hold yet."""
        done = min(computed_after, len(tracked.tokens)) // self.block_size
        done = min(done, len(tracked.block_ids))
        if done > tracked.saved:
            plan.saves.append(self._run(req_id, tracked, tracked.saved, done))
            tracked.saved = done

    def _run(self, req_id: str, tracked: _Tracked, first: int, end: int) -> BlockRun:
        return BlockRun(req_id, tracked.tokens, first, end, tuple(tracked.block_ids[first:end]), tracked.salt)

    def __len__(self) -> int:
        return len(self._tracked)


# -- vLLM's paged KV, block by block ------------------------------------------------------------------------

class PagedKV:
    """vLLM's per-layer KV tensors as kvgate blocks: gather blocks out of them, scatter blocks into them.

    Each layer's tensor has one dimension of `num_blocks` (dim 0 on the CPU backend, [num_blocks, heads, block,
    2 x head_dim]; dim 1 under FlashAttention, [2, num_blocks, block, heads, head_dim]); one vLLM block of one
    layer is everything at one index of that dimension, which is one layer of a kvgate block, byte for byte.
    """

    def __init__(self, kv_caches: dict[str, Any], layer_names: Sequence[str], num_blocks: int,
                 layout: KVLayout) -> None:
        import torch  # deferred: torch; vLLM's process has it, the connector's config readers do not need it

        missing = [name for name in layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"register_kv_caches: expected a KV tensor for every attention layer, found none for "
                             f"{missing[:3]}")
        self.layers = [kv_caches[name] for name in layer_names]
        self.layout = layout
        self.block_dims = [self._block_dim(t, num_blocks) for t in self.layers]
        per_layer = layout.block_nbytes // layout.num_layers
        for name, tensor, dim in zip(layer_names, self.layers, self.block_dims):
            got = tensor[(slice(None),) * dim + (0,)].numel() * tensor.element_size()
            if got != per_layer or tensor.dtype != layout.torch_dtype:
                raise ValueError(f"register_kv_caches: layer {name}: expected {per_layer} bytes of "
                                 f"{layout.dtype} per block, found {got} bytes of {tensor.dtype}")
        self.device = self.layers[0].device if self.layers else torch.device("cpu")

    @staticmethod
    def _block_dim(tensor: Any, num_blocks: int) -> int:
        for dim in (0, 1):
            if tensor.dim() > dim and tensor.shape[dim] == num_blocks:
                return dim
        raise ValueError(f"register_kv_caches: expected {num_blocks} blocks in dim 0 or 1 of a layer's KV, found "
                         f"shape {tuple(tensor.shape)}")

    def name(self) -> str:
        """The layout's name in the fingerprint: each layer's per-block shape and where its block dim is."""
        tensor, dim = self.layers[0], self.block_dims[0]
        rest = [s for i, s in enumerate(tensor.shape) if i != dim]
        return f"blockdim{dim}:{'x'.join(map(str, rest))}:{tensor.dtype}".replace("torch.", "")

    def gather(self, block_ids: Sequence[int], out: Any) -> None:
        """Copy vLLM blocks `block_ids` into `out` ([n, *kvgate block shape])."""
        import torch  # deferred: torch; vLLM's process has it, the connector's config readers do not need it

        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        n = len(block_ids)
        for layer, (tensor, dim) in enumerate(zip(self.layers, self.block_dims)):
            picked = tensor.index_select(dim, index).movedim(dim, 0)
            out[:, layer].view(n, -1).copy_(picked.reshape(n, -1))

    def scatter(self, blocks: Any, block_ids: Sequence[int]) -> None:
        """Copy `blocks` ([n, *kvgate block shape]) into vLLM blocks `block_ids`."""
        import torch  # deferred: torch; vLLM's process has it, the connector's config readers do not need it

        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        n = len(block_ids)
        for layer, (tensor, dim) in enumerate(zip(self.layers, self.block_dims)):
            shape = [s for i, s in enumerate(tensor.shape) if i != dim]
            source = blocks[:, layer].reshape(n, *shape).to(tensor.device).movedim(0, dim)
            tensor.index_copy_(dim, index, source)


# -- the scheduler's lookups, answered by the worker's cache ----------------------------------------------------

TIER_CODES = ("device", "host", "disk", "remote")


def lookup_address(engine_id: str) -> str:
    """The worker's lookup socket: a Linux abstract Unix socket named after vLLM's engine id (nothing on disk)."""
    return "\0kvgate-connector-" + hashlib.blake2b(engine_id.encode(), digest_size=12).hexdigest()


def _recv_exact(sock: Any, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("the lookup peer closed the connection")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


class LookupServer:
    """Answers the scheduler's lookups from the worker's cache, on `lookup_address(engine_id)`.

    vLLM runs the scheduler and the worker in two processes (the CPU build always does); the cache and its
    index live in the worker, so the scheduler asks it, per waiting request, which leading blocks it holds
    and where. The scheduler computes the block keys itself (the fingerprint's digest is the first answer).
    Requests: b"F" -> digest (16 bytes) + block size (u32); b"L" + n (u32) + n keys of 16 bytes -> m (u32) +
    m tier codes (one byte each, an index in TIER_CODES) for the leading blocks held.
    """

    def __init__(self, address: str, digest: bytes, block_size: int, lookup: Any) -> None:
        self._digest, self._block_size, self._lookup = digest, block_size, lookup
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(address)
        self._sock.listen(8)
        self._closed = False
        threading.Thread(target=self._accept, name="kvgate-lookup", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="kvgate-lookup-conn", daemon=True).start()

    def _serve(self, conn: Any) -> None:
        pack, unpack = struct.pack, struct.unpack
        with conn:
            try:
                while True:
                    kind = _recv_exact(conn, 1)
                    if kind == b"F":
                        conn.sendall(self._digest + pack("<I", self._block_size))
                    elif kind == b"L":
                        (n,) = unpack("<I", _recv_exact(conn, 4))
                        raw = _recv_exact(conn, 16 * n)
                        tiers = self._lookup([raw[i:i + 16] for i in range(0, len(raw), 16)])
                        conn.sendall(pack("<I", len(tiers)) + bytes(TIER_CODES.index(t) for t in tiers))
                    else:
                        return
            except (ConnectionError, OSError):
                return

    def close(self) -> None:
        self._closed = True
        self._sock.close()


class LookupClient:
    """The scheduler's side: the fingerprint digest once, then one round trip per lookup; None while the worker's
    cache is not up (no blocks can be loaded then)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._sock: Optional[socket.socket] = None
        self.digest: Optional[bytes] = None
        self.block_size = 0

    def _connect(self) -> Optional[socket.socket]:
        """The connection to the worker (made once, when it also gives the digest and block size); None when the
        worker's cache is not up."""
        if self._sock is not None:
            return self._sock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.address)
            sock.sendall(b"F")
            answer = _recv_exact(sock, 20)
        except OSError:
            sock.close()
            return None
        self.digest, (self.block_size,) = answer[:16], struct.unpack("<I", answer[16:])
        self._sock = sock
        return sock

    def lookup(self, tokens: Sequence[int], salt: str = "") -> Optional[list[str]]:
        """The tier of each leading whole block of `tokens` (keyed with the request's cache `salt`) the worker's
        cache holds; None when it cannot answer."""
        sock = self._connect()
        if sock is None or self.digest is None:  # the digest comes with the connection: both or neither
            return None
        keys = block_keys(tokens, salted_digest(self.digest, salt), self.block_size)
        try:
            sock.sendall(b"L" + struct.pack("<I", len(keys)) + b"".join(keys))
            (m,) = struct.unpack("<I", _recv_exact(sock, 4))
            codes = _recv_exact(sock, m)
        except OSError:
            self.close()
            return None
        return [TIER_CODES[c] for c in codes]

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = None
