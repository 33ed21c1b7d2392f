"""What the reference server does with each request: its latencies, errors and usage, as pure functions.

How it works: docs/methods/measurement.md (workloads/servers/server_behaviour.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Behaviour:
    """A reference server's behaviour; the defaults are the plain reference server's fixed timing."""

    ttft_ms: float = 100.0
    itl_ms: float = 50.0
    tokens: int = 10
    ttft_end_ms: Optional[float] = None       # with drift_s: the TTFT reached at drift_s seconds of uptime
    drift_s: float = 0.0
    fast_above_inflight: Optional[int] = None  # with fast_ttft_ms: the TTFT while more requests than this run
    fast_ttft_ms: Optional[float] = None
    every: tuple[tuple[int, int], ...] = ()    # (n, HTTP status): every n-th request fails with that status
    fraction: float = 0.0                      # this share of requests fails with fraction_status
    fraction_status: int = 500
    usage_token_offset: int = 0                # reported completion tokens = streamed tokens + this
    cached_tokens: Optional[int] = None        # usage.prompt_tokens_details.cached_tokens (None: no details)
    cached_tokens_as_string: bool = False
    leak_fd_every: int = 0                     # every n-th request keeps a descriptor open for good (0: none)
    slots: int = 0                             # requests served at once, the rest queue (0: no limit)

    def __post_init__(self) -> None:
        if self.leak_fd_every < 0:
            raise ValueError(f"leak_fd_every: expected 0 (no leak) or a request count >= 1, found {self.leak_fd_every}")
        if self.slots < 0:
            raise ValueError(f"slots: expected 0 (no limit) or a count >= 1, found {self.slots}")
        if not 0 <= self.fraction < 1:
            raise ValueError(f"fraction: expected a share in [0, 1), found {self.fraction}")
        if (self.ttft_end_ms is None) != (self.drift_s <= 0):
            raise ValueError("ttft_end_ms and drift_s: expected both (a drift) or neither, found "
                             f"ttft_end_ms={self.ttft_end_ms} drift_s={self.drift_s}")
        if (self.fast_above_inflight is None) != (self.fast_ttft_ms is None):
            raise ValueError("fast_above_inflight and fast_ttft_ms: expected both or neither, found "
                             f"{self.fast_above_inflight} and {self.fast_ttft_ms}")
        bad = [pair for pair in self.every if pair[0] < 1 or not 400 <= pair[1] <= 599]
        if bad:
            raise ValueError(f"every: expected (n >= 1, HTTP status 400-599) pairs, found {bad}")

    def ttft_s(self, uptime_s: float, in_flight: int = 1) -> float:
        """The TTFT of a request that arrives `uptime_s` after the server started, with `in_flight` running
        (itself included)."""
        if (self.fast_above_inflight is not None and self.fast_ttft_ms is not None
                and in_flight > self.fast_above_inflight):   # both or neither, as __post_init__ checked
            return self.fast_ttft_ms / 1000
        if self.ttft_end_ms is None:
            return self.ttft_ms / 1000
        progress = min(max(uptime_s / self.drift_s, 0.0), 1.0)
        return (self.ttft_ms + (self.ttft_end_ms - self.ttft_ms) * progress) / 1000

    def service_s(self, tokens: int) -> float:
        """How long a request of `tokens` output tokens holds its slot: its TTFT and the ITLs after it."""
        return (self.ttft_ms + self.itl_ms * max(tokens - 1, 0)) / 1000

    def capacity_at(self, ttft_limit_ms: float, tokens: int, percentile: float = 90.0) -> Optional[int]:
        """The most closed-loop users (no think time) at which a TTFT at `percentile` <= `ttft_limit_ms` holds, for a
        server with `slots` and a fixed TTFT (no drift), whatever the users' phases: `slots` when the limit lies at
        or above the TTFT and below `phase_free_limit_ms`. Up to `slots` users no request waits. At slots + 1 the
        slots stay busy, so a request waits service / slots on average: all of them that long when the users'
        phases are spread (the field's tools, which start users apart, see that), or one in `slots` a whole service
        when they are in step (kvgate's load, whose users finish together at the same slots, sees that). Below the
        bound the percentile misses in every mix of the two. None when the server has no slot limit or the limit
        is outside that range."""
        if not self.slots or self.ttft_end_ms is not None or self.fast_above_inflight is not None:
            return None
        bound = self.phase_free_limit_ms(tokens, percentile)
        if bound is None or not self.ttft_ms <= ttft_limit_ms < bound:
            return None
        return self.slots

    def phase_free_limit_ms(self, tokens: int, percentile: float = 90.0) -> Optional[float]:
        """The TTFT limit below which slots + 1 closed-loop users miss the percentile in every phase: with a mean wait
        of service / slots and no wait over one service, a share `allowed` = 1 - percentile / 100 may wait up to a
        service, so the rest wait at least (service / slots - allowed x service) / (1 - allowed). None when that
        is no wait (slots >= 1 / allowed)."""
        service_ms, allowed = 1000 * self.service_s(tokens), 1 - percentile / 100
        least_wait_ms = (service_ms / self.slots - allowed * service_ms) / (1 - allowed)
        return self.ttft_ms + least_wait_ms if least_wait_ms > 0 else None

    def rate_capacity_per_s(self, tokens: int) -> Optional[float]:
        """The most requests per second the slots serve (open loop): `slots` / the service time. Evenly spaced
        arrivals below it never wait; above it the queue grows without end, so every TTFT limit is soon missed.
        None when the server has no slot limit or its timing drifts."""
        if not self.slots or self.ttft_end_ms is not None or self.fast_above_inflight is not None:
            return None
        return self.slots / self.service_s(tokens)

    def error_status(self, number: int) -> Optional[int]:
        """The HTTP status request `number` (from 1) fails with, or None when it is answered."""
        for every_n, status in self.every:
            if number % every_n == 0:
                return status
        if self.fraction and math.floor(number * self.fraction) > math.floor((number - 1) * self.fraction):
            return self.fraction_status
        return None

    def leaks(self, number: int) -> bool:
        """Whether request `number` (from 1) leaks a descriptor."""
        return bool(self.leak_fd_every) and number % self.leak_fd_every == 0

    def usage(self, prompt_tokens: int, streamed: int) -> dict:
        """The usage chunk's payload for a request that streamed `streamed` tokens."""
        completion = streamed + self.usage_token_offset
        usage: dict = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                       "total_tokens": prompt_tokens + completion}
        if self.cached_tokens is not None:
            cached = min(self.cached_tokens, prompt_tokens)
            usage["prompt_tokens_details"] = {"cached_tokens": str(cached) if self.cached_tokens_as_string
                                              else cached}
        return usage


def parse_every(text: str) -> tuple[tuple[int, int], ...]:
    """"3:500,7:400" as ((3, 500), (7, 400)); ValueError naming what was found otherwise."""
    pairs = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        every_n, _, status = part.partition(":")
        try:
            pairs.append((int(every_n), int(status)))
        except ValueError:
            raise ValueError(f"expected N:STATUS pairs, comma-separated (3:500,7:400), found {part!r}") from None
    return tuple(pairs)


def prompt_tokens_of(body: dict) -> int:
    """A request's prompt size as the server counts it: whitespace-separated words of its messages or prompt."""
    messages = body.get("messages")
    if isinstance(messages, list):
        text = " ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
    else:
        text = str(body.get("prompt", ""))
    return max(1, len(text.split()))
