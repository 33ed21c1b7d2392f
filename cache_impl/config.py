"""One validated configuration object for the tiered KV cache.

Validation happens once, here, at the edge. A bad value raises `ConfigError`
whose message names the field path, what was expected and what was found::

    cache.disk.read_workers: expected an integer >= 1, found 0
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# 256 tokens per block: large enough that one block of a real model's KV is
# a megabyte or more (large sequential I/O on the disk tier, few keys per
# prompt: a 128k-token prompt is 512 keys), small enough that a shared prefix
# is reused up to at most 255 tokens short of its end. LMCache uses the same
# chunk size by default.
DEFAULT_BLOCK_SIZE = 256

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


class ConfigError(ValueError):
    """A configuration value is wrong; the message names field, expectation and finding."""


def parse_size(value: Any) -> int:
    """Parse a byte size: an integer, or a string such as "512MiB" or "4GB"."""
    if isinstance(value, bool):
        raise ValueError(f"expected a byte size (integer or string like '4GiB'), found {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"expected a byte size >= 0, found {value}")
        return value
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match and match.group(2).lower() in _UNITS:
            return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    raise ValueError(f"expected a byte size (integer or string like '4GiB'), found {value!r}")


_EXPECTATIONS = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number",
    "bool_type": "true or false", "bool_parsing": "true or false",
    "string_type": "a string", "path_type": "a path",
    "model_type": "a mapping", "dict_type": "a mapping", "model_attributes_type": "a mapping",
    "list_type": "a list",
}


def _expected(item: dict) -> str:
    kind, ctx = item["type"], item.get("ctx", {})
    if kind in _EXPECTATIONS:
        return _EXPECTATIONS[kind]
    if kind == "greater_than_equal":
        return f"a value >= {ctx['ge']}"
    if kind == "greater_than":
        return f"a value > {ctx['gt']}"
    if kind == "less_than_equal":
        return f"a value <= {ctx['le']}"
    if kind == "less_than":
        return f"a value < {ctx['lt']}"
    if kind == "literal_error":
        return f"one of {ctx['expected']}"
    return item["msg"].removeprefix("Value error, ").removeprefix("expected ")


def format_validation_error(error: ValidationError, root: str) -> str:
    """Turn a pydantic error into lines of `path: expected ..., found ...`."""
    lines = []
    for item in error.errors():
        path = ".".join([root, *(str(p) for p in item["loc"])])
        if item["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown field (no such setting here), found {item.get('input')!r}")
        elif item["type"] == "missing":
            lines.append(f"{path}: expected a value (required), found nothing")
        elif item["type"] == "value_error" and "found" in item["msg"]:
            lines.append(f"{path}: {item['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"{path}: expected {_expected(item)}, found {item.get('input')!r}")
    return "\n".join(lines)


def load_yaml_file(path: Any, root: str) -> Any:
    """Parsed YAML of a file; unreadable or malformed files raise ConfigError under `root`."""
    import yaml

    try:
        return yaml.safe_load(Path(path).read_text())
    except OSError as error:
        raise ConfigError(f"{root}: expected a readable YAML file, found {error.strerror or error} ({path})") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{root}: expected valid YAML, found {error}") from None


class StrictModel(BaseModel):
    """Settings models: unknown keys are errors, values are frozen once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class DiskTierConfig(StrictModel):
    """The disk tier: a directory on local NVMe or a shared mount (NVMe-oF)."""

    path: Path
    capacity_bytes: int = Field(default=8 * 2**30, description="bytes of block files kept")
    read_workers: int = Field(default=4, ge=1, le=256, description="parallel block reads")
    io_mode: Literal["buffered", "direct"] = Field(
        default="buffered", description="buffered page-cache reads, or O_DIRECT"
    )
    cold_reads: bool = Field(
        default=False, description="drop a file's cached pages before reading it (posix_fadvise DONTNEED)"
    )
    fsync: bool = Field(default=False, description="fsync each block before publishing it (power-loss durability)")
    verify_on_start: bool = Field(default=True, description="checksum every block when re-indexing on start")
    shared: bool = Field(default=False, description="other nodes write into this directory too (an NVMe-oF "
                         "array): on a local miss, look for their block files")

    _parse_capacity = field_validator("capacity_bytes", mode="before")(lambda cls, v: parse_size(v))


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
        from urllib.parse import parse_qs, urlsplit

        url = urlsplit(text)
        if url.scheme in ("redis", "rediss"):
            return cls(backend="redis", url=text)
        if url.scheme == "mooncake" and url.netloc:
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            known = {"metadata": "metadata_server", "segment": "segment_bytes", "hostname": "local_hostname"}
            unknown = sorted(set(query) - set(known))
            if unknown:
                raise ConfigError(f"remote: unknown option {unknown[0]!r} in {text!r} (known: {', '.join(known)})")
            return cls(backend="mooncake", master=url.netloc, **{known[k]: v for k, v in query.items()})
        raise ConfigError(f"remote: expected redis://host:port/db or mooncake://host:port?metadata=URL, "
                          f"found {text!r}")


class CacheConfig(StrictModel):
    """Capacities, block size, write policy and the disk tier of one `TieredKVCache`."""

    block_size: int = Field(default=DEFAULT_BLOCK_SIZE, ge=1, le=65536, description="tokens per block")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="auto: CUDA when present, else the CPU")
    device_capacity_blocks: int = Field(default=64, ge=1, description="slots in the device pool")
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

    def replace(self, **changes: Any) -> "CacheConfig":
        """A validated copy with some fields changed."""
        return CacheConfig.from_dict({**self.model_dump(), **changes})
