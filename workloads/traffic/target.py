"""The target a load goes to: an OpenAI-compatible endpoint, one node or several."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, Optional

from workloads.traffic.client import StreamingClient


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

    @property
    def api_key(self) -> Optional[str]:
        """The key the variable `api_key_env` holds (None when it names none, or holds nothing)."""
        return os.environ.get(self.api_key_env or "", "") or None

    def client(self, **options) -> StreamingClient:
        """A streaming client of the first node with the target's API key, at temperature 0 (probes, single
        requests; the load's temperature is the locustfile's); `options`: StreamingClient's (its `target` label
        defaults to the target's name)."""
        return StreamingClient(self.url, self.model, self.api, api_key=self.api_key, **{"target": self.name, **options})
