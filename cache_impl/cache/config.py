"""One validated configuration object for the tiered KV cache.

Validation happens once, here, at the edge. A bad value raises `ConfigError`
whose message names the field path, what was expected and what was found::

    cache.disk.read_workers: expected an integer >= 1, found 0
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional
from urllib.parse import parse_qs, urlsplit

from pydantic import Field, ValidationError, field_validator

from cache_impl.cache.keys import KVLayout
from cache_impl.platform import kernel_aio
from kvcore.settings import ConfigError, Count, StrictModel, format_validation_error, parse_size

# 256 tokens per block: large enough that one block of a real model's KV is
# a megabyte or more (large sequential I/O on the disk tier, few keys per
# prompt: a 128k-token prompt is 512 keys), small enough that a shared prefix
# is reused up to at most 255 tokens short of its end. LMCache uses the same
# chunk size by default.
DEFAULT_BLOCK_SIZE = 256
# the disk tier's reads in flight: an NVMe device or array reaches its best sequential read at 32 or more reads of
# 1 MiB in flight (G2's sweep finds iodepth 32 best on the development VMs); with 16 the tier read 65-90% of it there
DEFAULT_READ_WORKERS = 32


class DiskTierConfig(StrictModel):
    """The disk tier: a directory on local NVMe or a shared mount (NVMe-oF)."""

    path: Path
    capacity_bytes: int = Field(default=8 * 2**30, description="bytes of block files kept")
    min_free_bytes: int = Field(default=256 * 2**20, ge=0, description="room to leave free on the filesystem: "
                                "below it, the tier evicts its oldest blocks before it writes")
    read_workers: int = Field(
        default=DEFAULT_READ_WORKERS,
        ge=1,
        le=256,
        description="parallel block reads (the tier's queue depth: reads wait on the device, not the CPU)",
    )
    io_mode: Literal["buffered", "direct", "auto"] = Field(
        default="buffered", description="buffered page-cache reads, O_DIRECT, or auto: whichever a start-up probe "
        "on this storage, at this block size, finds faster"
    )
    read_engine: Literal["auto", "aio", "threads"] = Field(
        default="auto", description="how O_DIRECT reads into host memory are issued: aio, one thread handing the "
        "kernel read_workers reads at a time (Linux's native AIO, as fio's libaio engine); threads, a thread per "
        "read in flight (what buffered reads and reads into a device always use); auto: aio where the kernel has it"
    )
    cold_reads: bool = Field(
        default=False, description="drop a file's cached pages before reading it (posix_fadvise DONTNEED)"
    )
    fsync: bool = Field(default=False, description="fsync each block before publishing it (power-loss durability)")
    verify_on_start: bool = Field(default=True, description="checksum every block when re-indexing on start")
    shared: bool = Field(default=False, description="other nodes write into this directory too (an NVMe-oF "
                         "array): on a local miss, look for their block files")

    _parse_sizes = field_validator("capacity_bytes", "min_free_bytes", mode="before")(lambda cls, v: parse_size(v))

    @field_validator("read_engine")
    @classmethod
    def _aio_where_the_kernel_has_it(cls, value: str) -> str:
        if value == "aio" and not kernel_aio.supported():
            raise ValueError(f"expected auto or threads on this machine (native AIO needs Linux on x86_64 or "
                             f"aarch64, this is {kernel_aio.machine()}), found 'aio'")
        return value


class RemoteTierConfig(StrictModel):
    """The shared pool below the disk tier: Mooncake Store or Redis, reached over TCP."""

    backend: Literal["redis", "mooncake"] = Field(description="the distributed store")
    url: str = Field(default="redis://127.0.0.1:6379/0", description="redis: the server's URL")
    master: str = Field(default="127.0.0.1:50051", description="mooncake: the master's host:port")
    metadata_server: str = Field(default="http://127.0.0.1:8080/metadata",
                                 description="mooncake: the metadata server's URL")
    local_hostname: str = Field(default="127.0.0.1", description="mooncake: this node's address for transfers")
    segment_bytes: int = Field(default=0, ge=0, description="mooncake: memory this node lends to the pool")
    local_buffer_bytes: int = Field(default=64 * 2**20, ge=0, description="mooncake: this node's transfer buffer")
    timeout_s: float = Field(default=2.0, gt=0, description="a call that takes longer makes the tier unavailable")
    retry_s: float = Field(default=2.0, gt=0, description="seconds between attempts to reach an unavailable pool")
    read_workers: int = Field(default=8, ge=1, le=256, description="parallel block gets")

    _parse_sizes = field_validator("segment_bytes", "local_buffer_bytes", mode="before")(
        lambda cls, v: parse_size(v)
    )

    @classmethod
    def from_url(cls, text: str) -> "RemoteTierConfig":
        """`redis://host:port/db`, or `mooncake://master-host:port?metadata=http://...&segment=256MiB`."""
        url = urlsplit(text)
        if url.scheme in ("redis", "rediss"):
            return cls(backend="redis", url=text)
        if url.scheme == "mooncake" and url.netloc:
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            known = {"metadata": "metadata_server", "segment": "segment_bytes", "hostname": "local_hostname"}
            unknown = sorted(set(query) - set(known))
            if unknown:
                raise ConfigError(f"remote: unknown option {unknown[0]!r} in {text!r} (known: {', '.join(known)})")
            # the query's values are text: validation parses them as any setting's text is (sizes, numbers)
            return cls.model_validate({"backend": "mooncake", "master": url.netloc,
                                       **{known[k]: v for k, v in query.items()}})
        raise ConfigError(f"remote: expected redis://host:port/db or mooncake://host:port?metadata=URL, "
                          f"found {text!r}")


class CacheConfig(StrictModel):
    """Capacities, block size, write policy and the disk tier of one `TieredKVCache`."""

    block_size: int = Field(default=DEFAULT_BLOCK_SIZE, ge=1, le=65536, description="tokens per block")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="auto: CUDA when present, else the CPU")
    device_capacity_blocks: Count = Field(default=64, ge=0, description="slots in the device pool; 0: no device "
                                        "tier (an engine that keeps its own device KV, e.g. vLLM with kvgate's "
                                        "connector, uses the cache for the tiers below it)")
    host_capacity_bytes: int = Field(default=2 * 2**30, description="DRAM tier size in bytes; 0 disables it")
    disk: Optional[DiskTierConfig] = Field(default=None, description="the disk tier; none when absent")
    remote: Optional[RemoteTierConfig] = Field(default=None, description="the shared pool; none when absent")
    write_policy: Literal["write-through", "write-back"] = Field(
        default="write-through",
        description="write-through stores a new block in every tier; write-back only on the device, "
        "lower tiers receive it when it is evicted from above",
    )
    max_pending_write_bytes: int = Field(default=512 * 2**20, description="disk writes queued before stores wait")

    _parse_sizes = field_validator("host_capacity_bytes", "max_pending_write_bytes", mode="before")(
        lambda cls, v: parse_size(v)
    )

    @classmethod
    def from_dict(cls, data: Any, root: str = "cache") -> "CacheConfig":
        """Validate a plain mapping (from YAML or the CLI); raise ConfigError on any bad field."""
        if data is None:
            data = {}
        try:
            return cls.model_validate(data)
        except ValidationError as error:
            raise ConfigError(format_validation_error(error, root)) from None

    def layout(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> KVLayout:
        """The KV layout of this cache's blocks for a model of these shapes: its block size is `block_size`, the
        one place the block size is given (the engine, the vLLM connector and the benches derive theirs here,
        so the cache's fingerprint and its block files always agree with it)."""
        return KVLayout(num_layers, num_kv_heads, head_dim, dtype, self.block_size)

    def replace(self, **changes: Any) -> "CacheConfig":
        """A validated copy with some fields changed."""
        return CacheConfig.from_dict({**self.model_dump(), **changes})
