"""The reference server's service slots give it a known capacity: checked over real HTTP in closed loop."""

import threading
import time

import pytest

from gates.selftest.controls import Server
from gates.selftest.runner import start_server, stop_server
from workloads.servers.server_behaviour import Behaviour
from workloads.traffic.client import StreamingClient
from workloads.traffic.requests import WorkloadRequest

TTFT_MS, ITL_MS, TOKENS, SLOTS = 40.0, 10.0, 8, 3          # 110 ms a service
REQUEST = WorkloadRequest("s", "u", 0, ({"role": "user", "content": "hello there"},), 2, TOKENS)


@pytest.fixture(scope="module")
def slotted(tmp_path_factory):
    server = start_server("slots", Server("mock", ("--model", "mock", "--tokens", str(TOKENS), "--ttft-ms",
                                                   str(TTFT_MS), "--itl-ms", str(ITL_MS), "--slots", str(SLOTS))),
                          "quick", tmp_path_factory.mktemp("slots"))
    yield server
    stop_server(server.process)


def _closed_loop(url: str, users: int, each: int, apart_s: float = 0.0) -> list[float]:
    """`users` threads, each sending `each` requests back to back, the i-th starting i x `apart_s` after the first:
    every request's TTFT in ms."""
    ttfts: list[float] = []

    def user(number: int) -> None:
        time.sleep(number * apart_s)
        client = StreamingClient(url, "mock", "chat", None, target="slots", timeout_s=30)
        try:
            for _ in range(each):
                record = client.send(REQUEST)
                assert record.ok, record.error_message
                ttfts.append(record.ttft_s * 1000)
        finally:
            client.close()

    threads = [threading.Thread(target=user, args=(number,)) for number in range(users)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return ttfts


def test_up_to_its_slots_no_request_waits_and_one_more_user_makes_the_p90_miss_in_any_phase(slotted):
    behaviour = Behaviour(ttft_ms=TTFT_MS, itl_ms=ITL_MS, tokens=TOKENS, slots=SLOTS)
    assert behaviour.phase_free_limit_ms(TOKENS) == pytest.approx(40 + (110 / 3 - 11) / 0.9)      # 68.5 ms
    limit = 55.0                                                    # 15 ms over the TTFT, below that bound
    assert behaviour.capacity_at(limit, TOKENS) == SLOTS
    at_capacity = _closed_loop(slotted.url, SLOTS, 20)
    share_at = sum(t > limit for t in at_capacity) / len(at_capacity)
    # one user more, its users starting together (in step: one request in `slots` waits a whole service) or spread
    # over a service (each waits about service / slots): the p90 misses either way
    for apart_s in (0.0, behaviour.service_s(TOKENS) / (SLOTS + 1)):
        over = _closed_loop(slotted.url, SLOTS + 1, 20, apart_s)
        share_over = sum(t > limit for t in over) / len(over)
        assert share_at < 0.10 < share_over, (apart_s, share_at, share_over)
        # the misses are waits for a slot: the first token itself is as fast as at capacity
        assert min(over) < TTFT_MS + 20 and min(at_capacity) < TTFT_MS + 20


def test_slots_are_refused_below_zero_and_a_capacity_is_known_only_in_its_range():
    with pytest.raises(ValueError, match="slots: expected 0"):
        Behaviour(slots=-1)
    assert Behaviour(slots=0).capacity_at(150, 10) is None
    slotted = Behaviour(ttft_ms=100, itl_ms=50, tokens=10, slots=4)
    assert slotted.service_s(10) == pytest.approx(0.55)
    assert slotted.capacity_at(99, 10) is None and slotted.capacity_at(100, 10) == 4
    # below 100 + (550 / 4 - 55) / 0.9 ms every phase of 5 users misses the p90; above, a spread one may not
    assert slotted.capacity_at(191, 10) == 4 and slotted.capacity_at(192, 10) is None
    assert Behaviour(ttft_ms=100, itl_ms=50, tokens=10, slots=10).capacity_at(101, 10) is None   # 1 in 10 may wait
