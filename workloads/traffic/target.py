"""The target a load goes to: an OpenAI-compatible endpoint, one node or several."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass(frozen=True)
class Target:
    """An OpenAI-compatible endpoint to load."""

    name: str
    url: str                               # base URL ending in /v1
    model: str
    api: Literal["chat", "completions"] = "chat"
    api_key_env: Optional[str] = None      # name of the environment variable holding the key
    temperature: float = 0.0
    nodes: tuple[str, ...] = ()            # several nodes serving the target (base URLs); empty: `url` alone
    routing: str = "round-robin"           # how requests pick a node (workloads.traffic.routing)

    @property
    def node_urls(self) -> tuple[str, ...]:
        return self.nodes or (self.url,)
