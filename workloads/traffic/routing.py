"""Which node of a multi-node target serves a request.

- `round-robin`: request after request across the nodes, so consecutive turns of
  a conversation land on different nodes and the shared pool carries the reuse;
- `prefix-affinity`: a stable hash of the conversation's opening (system prompt
  and first user message, the prefix its turns share) picks the node, so a
  conversation stays where its KV is.
"""

from __future__ import annotations

import itertools
import json
from typing import Literal

import xxhash

from workloads.traffic.requests import WorkloadRequest

Routing = Literal["round-robin", "prefix-affinity"]
ROUTINGS = ("round-robin", "prefix-affinity")


class Router:
    def __init__(self, nodes: int, routing: Routing = "round-robin") -> None:
        if nodes < 1:
            raise ValueError(f"nodes: expected at least 1, found {nodes}")
        if routing not in ROUTINGS:
            raise ValueError(f"routing: expected one of {', '.join(ROUTINGS)}, found {routing!r}")
        self.nodes, self.routing = nodes, routing
        self._turn = itertools.count()

    def pick(self, request: WorkloadRequest) -> int:
        if self.nodes == 1:
            return 0
        if self.routing == "round-robin":
            return next(self._turn) % self.nodes
        opening = json.dumps(list(request.messages[:2]), sort_keys=True)
        return xxhash.xxh3_64_intdigest(opening.encode()) % self.nodes
