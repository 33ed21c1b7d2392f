"""gates.yaml's section of an external target (`targets.baseline`, `candidate`, `recompute`: TargetSettings) and
its engine's settings (`.control`, `.metric_map`), validated at the edge like the rest of the config: an unknown
key or a bad value names its field path. Composed by gates/config.py."""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Protocol, get_args
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from kvcore.settings import Float, Positive, StrictModel, absolute_path
from workloads.traffic.datasets import BYTE_TOKENIZER_ID, TokenizerError, is_tokenizer_path, sizer_for

from .metrics import TIER_NAMES, TIERS

if TYPE_CHECKING:
    Tier = str                  # the checker cannot read a Literal built from a tuple
else:
    Tier = Literal[TIERS]       # one of TIERS, checked by pydantic
EngineName = Literal["kvgate", "vllm", "sglang", "generic"]
ENGINES: tuple[EngineName, ...] = get_args(EngineName)
CacheLayerName = Literal["lmcache", "hicache", "mooncake", "kvgate"]
# each cache layer and the engines it runs under
CACHE_LAYERS: dict[CacheLayerName, tuple[EngineName, ...]] = {
    "lmcache": ("vllm",), "hicache": ("sglang",), "mooncake": ("vllm", "sglang"), "kvgate": ("vllm",)}
DEFAULT_CLEARS = {"clear_device_cache": ["device"], "clear_lower_tiers": ["host"], "drop_disk_page_cache": []}


class HttpCall(StrictModel):
    method: Literal["GET", "POST", "PUT", "DELETE"] = "POST"
    url: str = Field(pattern=r"^https?://")
    body: Optional[Any] = Field(default=None, alias="json", description="a JSON body to send")


class ControlStep(StrictModel):
    """One cache-control step of an engine: an HTTP call or a shell command (e.g. on the storage host over ssh)."""

    http: Optional[HttpCall] = None
    command: Optional[str] = Field(default=None, min_length=1)
    clears: Optional[list[Tier]] = Field(default=None, description="the tiers the step empties (default: the "
                                         "ability's own: device; host; none for a page-cache drop)")

    @model_validator(mode="after")
    def _one_way(self) -> "ControlStep":
        if (self.http is None) == (self.command is None):
            raise ValueError("expected exactly one of http ({method, url, json}) or command, found "
                             f"{'both' if self.http is not None else 'neither'}")
        return self


class ControlConfig(StrictModel):
    clear_device_cache: Optional[ControlStep] = None
    clear_lower_tiers: Optional[ControlStep] = None
    drop_disk_page_cache: Optional[ControlStep] = None

    @field_validator("drop_disk_page_cache")
    @classmethod
    def _drop_clears_nothing(cls, step: Optional[ControlStep]) -> Optional[ControlStep]:
        if step is not None and step.clears:
            raise ValueError(f"clears: expected none (dropping the page cache leaves the tier's files), found "
                             f"{step.clears}")
        return step

    def steps(self) -> dict[str, tuple[ControlStep, list[str]]]:
        """The configured steps, each with the tiers it empties."""
        found = {name: getattr(self, name) for name in DEFAULT_CLEARS}
        return {name: (step, list(step.clears if step.clears is not None else DEFAULT_CLEARS[name]))
                for name, step in found.items() if step is not None}


def _series_list(value: Any) -> Any:
    return [value] if isinstance(value, dict) else value


class MetricSeries(StrictModel):
    metric: str = Field(description="a sample name as /metrics shows it (counters end in _total)")
    labels: dict[str, str] = Field(default_factory=dict, description="only samples with these labels")
    scale: Float = Field(default=1.0, gt=0, description="tokens per unit (e.g. the block size for a block counter)")

    @field_validator("metric")
    @classmethod
    def _sample_name(cls, name: str) -> str:
        if not re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", name):
            raise ValueError(f"expected a Prometheus sample name (letters, digits, _ and :), found {name!r}")
        return name


class MetricMapConfig(StrictModel):
    """Per tier, the counters whose growth is that tier's hit tokens (one series or a list, summed)."""

    device: Optional[list[MetricSeries]] = None
    host: Optional[list[MetricSeries]] = None
    disk: Optional[list[MetricSeries]] = None
    remote: Optional[list[MetricSeries]] = None
    lower: Optional[list[MetricSeries]] = Field(default=None, description="below the device, tier not said")
    any: Optional[list[MetricSeries]] = Field(default=None, description="a cache hit, tier not said")
    prompt_tokens: Optional[list[MetricSeries]] = None

    _lists = field_validator(*TIER_NAMES, "prompt_tokens", mode="before")(lambda cls, v: _series_list(v))

    @model_validator(mode="after")
    def _some_tier(self) -> "MetricMapConfig":
        if not any(getattr(self, tier) for tier in TIER_NAMES):
            raise ValueError(f"expected at least one tier ({', '.join(TIER_NAMES)}) with its series, found none")
        return self

    def tiers(self) -> dict[str, list[MetricSeries]]:
        return {tier: getattr(self, tier) for tier in TIER_NAMES if getattr(self, tier)}


class TargetSettings(StrictModel):
    """One external target's section of gates.yaml (`targets.baseline`, `candidate`, `recompute`): what the user
    says of it. A run resolves it into the one runtime `Endpoint` (gates/targets.py: Endpoint.from_settings)."""

    url: str = Field(examples=["http://10.0.0.6:8000/v1"], pattern=r"^https?://", description="base URL ending in /v1")
    model: str = Field(min_length=1, description="the model name its API serves", examples=["my-model"])
    api_key_env: Optional[str] = Field(
        examples=["MY_API_KEY"], default=None, description="environment variable holding the API key")
    api: Literal["chat", "completions"] = Field(default="chat", description=(
        "chat: /v1/chat/completions; completions: /v1/completions"))
    engine: EngineName = Field(default="generic", description=(
        "the engine serving it (engines/): its cache controls and metric names. generic (default): kvgate "
        "assumes nothing; each control and the metric map come from this section"))
    cache_layer: Optional[CacheLayerName] = Field(examples=["lmcache"], default=None, description=(
        "the KV cache layer under the engine: lmcache (vllm), hicache (sglang), mooncake (vllm, sglang), kvgate "
        "(vllm: kvgate's connector, cache_impl/vllm/vllm_connector.py)"))
    cache_layer_url: Optional[str] = Field(
        examples=["http://10.0.0.6:7000"], default=None, pattern=r"^https?://", description=(
        "lmcache: its internal API server (clears the host tier); kvgate: the connector's sidecar (admin_port)"))
    metrics_url: Optional[str] = Field(
        examples=["http://10.0.0.6:8000/metrics"], default=None, pattern=r"^https?://", description=(
        "the engine's Prometheus page (default: the URL without /v1, + /metrics)"))
    cache_dir: Optional[Path] = Field(examples=["/mnt/nvme/lmcache"], default=None, description=(
        "the disk tier's directory when it is on this host: its page cache is dropped by fadvise"))
    device_kv_tokens: Optional[Positive] = Field(examples=[500000], default=None, description=(
        "device KV capacity in tokens (default: from the engine's metrics where it says)"))
    host_kv_tokens: Optional[Positive] = Field(
        examples=[2000000], default=None, description="host tier KV capacity in tokens")
    control: ControlConfig = Field(default_factory=ControlConfig, description=(
        "cache-control steps, each an HTTP call or a command; they replace the engine's own"))
    metric_map: Optional[MetricMapConfig] = Field(default=None, description="generic: per tier, its hit counters")
    tokenizer: Optional[str] = Field(examples=["/models/my-model"], default=None, description=(
        "how prompts are sized in its tokens: a tokenizer.json or the model's directory (loaded with Hugging Face "
        "tokenizers), or kvgate-byte-v1 (a `kvgate serve`); none or another name: in words, an approximation"))

    _cache_dir = field_validator("cache_dir", mode="before")(lambda cls, v: absolute_path(v))

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_loads(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and value != BYTE_TOKENIZER_ID and difflib.get_close_matches(
                value, [BYTE_TOKENIZER_ID], n=1, cutoff=0.8):     # a typo would size prompts in words, silently
            raise ValueError(f"expected {BYTE_TOKENIZER_ID} (did you mean it?), a tokenizer.json or a model's "
                             f"directory, found {value!r}")
        if value is None or not is_tokenizer_path(value):
            return value
        try:
            sizer_for(value)
        except TokenizerError as error:
            raise ValueError(str(error)) from None
        return str(Path(value).expanduser().resolve())

    @property
    def metrics_endpoint(self) -> str:
        return self.metrics_url or f"{self.url.rstrip('/').removesuffix('/v1')}/metrics"

    @model_validator(mode="after")
    def _engine_settings_fit(self) -> "TargetSettings":
        if self.cache_layer is not None and self.engine not in CACHE_LAYERS[self.cache_layer]:
            raise ValueError(f"cache_layer: expected {self.cache_layer} only with engine "
                             f"{' or '.join(CACHE_LAYERS[self.cache_layer])}, found engine {self.engine}")
        if self.cache_layer_url is not None and self.cache_layer not in ("lmcache", "kvgate"):
            raise ValueError(f"cache_layer_url: expected only with cache_layer: lmcache (its internal API server) "
                             f"or kvgate (the connector's sidecar), found cache_layer {self.cache_layer}")
        if self.metric_map is not None and self.engine != "generic":
            raise ValueError(f"metric_map: expected only with engine: generic ({self.engine}'s metric names are "
                             f"known), found engine {self.engine}")
        return self

    @field_validator("url")
    @classmethod
    def _host_and_port(cls, url: str) -> str:
        parts = urlsplit(url)
        try:
            parts.port
        except ValueError:
            raise ValueError(f"expected a port in 1-65535 in the URL, found {url!r}") from None
        if not parts.hostname:
            raise ValueError(f"expected http(s)://host[:port]/v1 with a host, found {url!r}")
        return url

    @field_validator("api_key_env")
    @classmethod
    def _key_is_set(cls, name: Optional[str]) -> Optional[str]:
        if name is not None and not os.environ.get(name):
            raise ValueError(f"expected the environment variable {name!r} to hold the API key, found it "
                             f"{'empty' if name in os.environ else 'unset'}")
        return name


class RoleSettings(Protocol):
    """What the engines read of gates.yaml's `targets` section (gates.config.TargetsConfig): each external role's
    settings, None where the config gives none."""

    @property
    def baseline(self) -> Optional[TargetSettings]: ...

    @property
    def candidate(self) -> Optional[TargetSettings]: ...

    @property
    def recompute(self) -> Optional[TargetSettings]: ...


class TargetsOf(Protocol):
    """A validated config, as far as the engines read it (gates.config.GatesConfig)."""

    @property
    def targets(self) -> RoleSettings: ...


class RunEndpoint(Protocol):
    """One of a run's endpoints, as far as the engines read it (gates.targets.Endpoint)."""

    @property
    def role(self) -> str: ...

    @property
    def admin(self) -> bool: ...

    @property
    def server_root(self) -> str: ...

    @property
    def cache_dir(self) -> Optional[str]: ...

    @property
    def node_roots(self) -> list[str]: ...


def role_settings(config: TargetsOf, role: str) -> TargetSettings:
    """The settings of an external role (`targets.<role>`); ValueError naming the role when the config has none."""
    settings = getattr(config.targets, role, None)
    if not isinstance(settings, TargetSettings):
        raise ValueError(f"targets.{role}: expected an external target's settings, found none")
    return settings
