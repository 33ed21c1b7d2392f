"""Pre-flight: before the gates that need targets, every target answers, serves its model and streams.

For each role (and each node of a role served by several) two short calls, each with a
timeout of a few seconds: GET `<url>/models` must list the configured model, then one streamed
request of two tokens, sent by the streaming client the load uses (same client, same timing
path), must yield a first token. A failure names the role, the URL and what happened
("baseline http://127.0.0.1:9/v1: connection refused"); `kvgate run` then stops with exit 2
before any gate runs, instead of sweeping a target that is not there.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Optional

from engines import Unavailable, endpoint_adapter
from engines.metrics import MetricsError
from workloads.traffic.client import StreamingClient, TargetError
from workloads.traffic.datasets import sizer_for
from workloads.traffic.errors import CONNECTION_ERRORS, describe_error
from workloads.traffic.requests import WorkloadRequest

from .config import g2_contexts_problem
from .targets import Endpoint

TIMEOUT_S = 10.0
PROBE = WorkloadRequest("preflight", "preflight", 0, ({"role": "user", "content": "Say OK."},), 2, 8)


@dataclass
class PreflightResult:
    """One node of one role: did it answer, serve the model and stream a first token."""

    role: str                        # "baseline", or "candidate node 1" when the role has several nodes
    url: str
    model: str
    ok: bool = False
    problem: str = ""                # what happened, when not ok
    error_type: str = ""             # its kind, when not ok: "connection_refused", "http_404", "bad_response", …
    served: list[str] = field(default_factory=list)
    ttft_s: Optional[float] = None
    seconds: float = 0.0
    sizer: str = ""                  # how prompts are sized in its tokens (workloads.traffic.datasets.sizer_for)
    max_model_len: Optional[int] = None   # the model's context as GET /models gives it, where it does

    def line(self) -> str:
        return f"{self.role} {self.url}: {self.problem or 'ok'}" + (f" (prompts sized: {self.sizer})"
                                                                      if self.sizer and not self.problem else "")

    def to_dict(self) -> dict:
        return asdict(self)


def _nodes(role: str, endpoint: Endpoint) -> list[tuple[str, str]]:
    urls = endpoint.nodes or (endpoint.url,)
    return [(role if len(urls) == 1 else f"{role} node {i}", url) for i, url in enumerate(urls)]


def check_node(role: str, url: str, endpoint: Endpoint, timeout_s: float = TIMEOUT_S,
               contexts: Optional[list[int]] = None) -> PreflightResult:
    """The two calls against one node; the result says what happened. With `contexts` (G2's, when it runs),
    a model whose listing gives its max_model_len must hold the longest (gates.config.g2_contexts_problem)."""
    result = PreflightResult(role, url, endpoint.model, sizer=sizer_description(endpoint.tokenizer))
    started = time.monotonic()
    api_key = os.environ.get(endpoint.api_key_env or "", "") or None
    client = StreamingClient(url, endpoint.model, endpoint.api, api_key, target=f"preflight-{role}",
                             timeout_s=timeout_s)
    try:
        result.problem = _check(client, result, contexts)
    finally:
        client.close()
        result.seconds = time.monotonic() - started
    result.ok = not result.problem
    return result


def sizer_description(tokenizer: Optional[str]) -> str:
    """How a target's prompts are sized, for the pre-flight line and the report."""
    name = sizer_for(tokenizer).name
    if name == "byte":
        return "kvgate's byte tokenizer"
    if name == "word":
        return ("in words, an approximation (targets.<role>.tokenizer not given)" if tokenizer is None else
                f"in words, an approximation ({tokenizer!r} is not a file kvgate can load)")
    return name


def _check(client: StreamingClient, result: PreflightResult, contexts: Optional[list[int]]) -> str:
    try:
        listed = client.model_contexts()
    except TargetError as error:
        what = describe_error(error.error_type, error.message)
        result.error_type = error.error_type or ""
        return what if error.error_type in CONNECTION_ERRORS else f"GET /models: {what}"
    result.served = list(listed)
    if result.model not in result.served:
        return f"model {result.model!r} not served (serves: {', '.join(result.served) or 'none'})"
    result.max_model_len = listed[result.model]
    if contexts and result.max_model_len is not None:
        problem = g2_contexts_problem(contexts, result.max_model_len, f"{result.model} by its max_model_len at "
                                                                      "GET /models")
        if problem:
            return problem
    record = client.send(PROBE)
    if not record.ok:
        result.error_type = record.error_type or ""
        return describe_error(record.error_type, record.error_message)
    if record.ttft_s is None:
        return f"the streamed answer carried no text (finish_reason {record.finish_reason})"
    result.ttft_s = record.ttft_s
    return ""


def run_preflight(endpoints: dict[str, Endpoint], timeout_s: float = TIMEOUT_S,
                  contexts: Optional[list[int]] = None) -> list[PreflightResult]:
    """Every node of every role, checked side by side (a dead one costs its timeout once, not once per role);
    `contexts`: G2's, when it runs (check_node)."""
    nodes = [(role, url, endpoint) for role, endpoint in endpoints.items() for role, url in _nodes(role, endpoint)]

    def check(node: tuple[str, str, Endpoint]) -> PreflightResult:
        role, url, endpoint = node
        return check_node(role, url, endpoint, timeout_s=timeout_s, contexts=contexts)

    with ThreadPoolExecutor(max_workers=max(1, len(nodes))) as pool:
        return list(pool.map(check, nodes))


def probe_engines(config, endpoints: dict[str, Endpoint]) -> dict[str, dict]:
    """What each external role's engine really allows and has, {role: {"abilities": {ability: {available, how}},
    "absent_tiers": {tier: why}, "device_kv_tokens": tokens or None, "device_kv_source": str}}: its controls
    are called once (engines: EngineAdapter.probe; they empty caches, before any gate measures), the
    tiers it lacks and its reusable device KV read from its own metrics. The gate suites' adapters take away
    what the probe found unavailable; the sizing model takes the tiers and capacities. The harness's own
    `kvgate serve` processes are not probed: their admin routes are kvgate's, and only the suites hold their
    token."""
    found = {}
    for role, endpoint in endpoints.items():
        if endpoint.admin:
            continue
        adapter = endpoint_adapter(config, endpoint)
        probed = adapter.probe()
        try:
            device = adapter.device_kv_tokens()
        except (Unavailable, MetricsError):
            device = None
        found[role] = {"abilities": {name: {"available": a.available, "how": a.how} for name, a in probed.items()},
                       "absent_tiers": adapter.absent_tiers(), "device_kv_tokens": device and device.tokens,
                       "device_kv_source": device.source if device else ""}
    return found


def ability_line(role: str, abilities: dict[str, dict]) -> str:
    """"candidate abilities: clear_device_cache, tier_accounting; not: clear_lower_tiers (not applicable: …)"."""
    have = [name for name, a in abilities.items() if a["available"]]
    lack = [f"{name} ({a['how']})" for name, a in abilities.items() if not a["available"]]
    return f"{role} abilities: {', '.join(have) or 'none'}" + (f"; not: {'; '.join(lack)}" if lack else "")


def failure_message(results: list[PreflightResult]) -> str:
    """'pre-flight failed: baseline http://…/v1: connection refused; candidate …' ('' when all passed)."""
    failed = [r.line() for r in results if not r.ok]
    return "pre-flight failed: " + "; ".join(failed) if failed else ""
