"""gates.yaml's settings of an external target's engine (`targets.<role>.control`, `.metric_map`), validated at
the edge like the rest of the config: an unknown key or a bad value names its field path."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from kvcore.settings import Float, StrictModel

from .metrics import TIER_NAMES, TIERS

if TYPE_CHECKING:
    Tier = str                  # the checker cannot read a Literal built from a tuple
else:
    Tier = Literal[TIERS]       # one of TIERS, checked by pydantic
ENGINES = ("kvgate", "vllm", "sglang", "generic")
CACHE_LAYERS = {"lmcache": ("vllm",), "hicache": ("sglang",), "mooncake": ("vllm", "sglang"), "kvgate": ("vllm",)}
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
