"""Pools started whole: every worker running and set up before the first task (cache_impl/platform/thread_pools.py)."""

import json
import os
import subprocess
import sys
import threading

import pytest

from cache_impl.platform.thread_pools import started_pool


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


# In a child (a process's OpenMP teams outlive the test): a large torch operation on each of 3 pool
# threads, counting the process's threads before and after; a plain ThreadPoolExecutor beside it.
TEAMS = """
import json, os, sys, threading, torch
from concurrent.futures import ThreadPoolExecutor
from cache_impl.platform.thread_pools import started_pool
threads = lambda: len(os.listdir("/proc/self/task"))
x = torch.randn(4_000_000)
(x * 2).sum()                                   # the main thread's own team, before counting
pool = started_pool(3, "kv-test-omp") if sys.argv[1] == "started" else ThreadPoolExecutor(3)
barrier = threading.Barrier(3)
def work():
    barrier.wait()                              # one task on each of the 3 threads
    return float((torch.randn(4_000_000) * 2).sum())
for f in [pool.submit(lambda: None) for _ in range(3)]:
    f.result()
before = threads()
for f in [pool.submit(work) for _ in range(3)]:
    f.result()
print(json.dumps({"before": before, "after": threads(), "omp": torch.get_num_threads()}))
"""


def _teams(kind: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    env.pop("OMP_NUM_THREADS", None)
    child = subprocess.run([sys.executable, "-c", TEAMS, kind], capture_output=True, text=True, timeout=120, env=env)
    assert child.returncode == 0, child.stderr
    return json.loads(child.stdout)


def test_a_pool_thread_starts_no_openmp_team_of_its_own_where_a_plain_thread_does():
    plain, started = _teams("plain"), _teams("started")
    if plain["omp"] < 2:
        pytest.skip("torch runs one OpenMP thread here: there is no team to start")
    assert plain["after"] > plain["before"], plain       # each plain thread got a team of its own
    assert started["after"] == started["before"], started
