"""Pools started whole: every worker running and set up before the first task (cache_impl/thread_pools.py)."""

import threading

import pytest

from cache_impl.thread_pools import started_pool


def test_every_worker_is_running_and_set_up_before_the_pool_is_returned():
    set_up: list[str] = []
    lock = threading.Lock()

    def record() -> None:
        with lock:
            set_up.append(threading.current_thread().name)

    pool = started_pool(6, "kv-test-read", record)
    try:
        running = [t.name for t in threading.enumerate() if t.name.startswith("kv-test-read")]
        assert len(set(set_up)) == 6 and sorted(set_up) == sorted(running)
        names = {pool.submit(lambda: threading.current_thread().name).result() for _ in range(50)}
        assert names <= set(set_up)                          # the tasks run on the threads already started
    finally:
        pool.shutdown()


def test_a_set_up_that_fails_is_an_error_naming_the_pool_at_once_not_after_the_start_timeout():
    calls = []

    def fail_on_the_third() -> None:
        calls.append(1)
        if len(calls) == 3:
            raise OSError("no memory for the staging buffer")

    with pytest.raises(RuntimeError, match="kv-test-bad: a pool thread's set-up failed: no memory for the staging"):
        started_pool(4, "kv-test-bad", fail_on_the_third)
