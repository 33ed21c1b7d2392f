"""A disk tier that can store nothing says so: what its filesystem really leaves it (checked as a function
of the filesystem's size and free room, the reserve and the capacity), and a real `kvgate serve` on a real
small filesystem: a reserve the filesystem cannot hold is exit 2, a filesystem others filled is a warning at
start, and the blocks the tier refuses are counted in /metrics.

The `kvgate serve` tests mount a tmpfs (root); they skip, saying so, where that is refused.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest

from cache_impl.cache.disk_room import DiskRoom, check_reserve
from kvcore.settings import ConfigError
from tests.servers import REPO, ServerProcess, ask, distinct_prompt, free_port, http_client, metric_value, metrics

MiB = 2**20
GiB = 2**30


def room(**changes) -> DiskRoom:
    """A tier of 8 GiB with a 16 MiB reserve on a filesystem with 64 MiB free, holding nothing yet."""
    return DiskRoom(**{"path": "/kv", "capacity_bytes": 8 * GiB, "held_bytes": 0, "free_bytes": 64 * MiB,
                       "min_free_bytes": 16 * MiB, "block_bytes": MiB, **changes})


def test_usable_bytes_are_what_the_filesystem_leaves_above_the_reserve_at_most_the_capacity():
    assert room().usable_bytes == 48 * MiB
    assert room(held_bytes=10 * MiB, free_bytes=20 * MiB).usable_bytes == 14 * MiB  # its own blocks count
    assert room(capacity_bytes=4 * MiB).usable_bytes == 4 * MiB
    assert room(free_bytes=8 * MiB).usable_bytes == 0                                # others took the room


def test_a_tier_with_no_room_now_gets_a_warning_naming_the_free_room_and_the_reserve():
    assert room().warning() is None
    assert room(free_bytes=17 * MiB).warning() is None                               # one block fits
    assert room(free_bytes=8 * MiB).warning() == (
        "the disk tier can store no block now: the filesystem beneath /kv has 8.0 MiB free and the tier keeps "
        "cache.disk.min_free_bytes (16.0 MiB) free; it stores again once there is room (the blocks it refuses "
        "are counted in kvgate_cache_stores_refused_total)")


def test_a_reserve_the_filesystem_cannot_hold_is_a_configuration_error_naming_the_field():
    with pytest.raises(ConfigError) as refused:
        check_reserve("/kv", filesystem_bytes=64 * MiB, min_free_bytes=256 * MiB, capacity_bytes=8 * GiB,
                      block_bytes=MiB)
    assert str(refused.value) == (
        "cache.disk.min_free_bytes: expected at most the size of the filesystem beneath /kv (64.0 MiB) less one "
        "block (1.0 MiB), found 256.0 MiB: the disk tier could never store a block")
    check_reserve("/kv", filesystem_bytes=64 * MiB, min_free_bytes=63 * MiB, capacity_bytes=8 * GiB,
                  block_bytes=MiB)                                                   # one block fits
    with pytest.raises(ConfigError, match=r"^cache\.disk\.capacity_bytes: expected at least one block "
                                          r"\(1\.0 MiB\), found 512\.0 KiB$"):
        check_reserve("/kv", filesystem_bytes=64 * MiB, min_free_bytes=0, capacity_bytes=512 * 2**10,
                      block_bytes=MiB)


# -- a real kvgate serve on a real 64 MiB filesystem ------------------------------------------------------


def test_kvgate_serve_exits_2_when_the_default_reserve_is_larger_than_the_filesystem(small_tmpfs):
    """Before: it served, stored 0 blocks with 0 write errors and reported capacity_bytes{disk} 8 GiB."""
    filesystem = small_tmpfs(64)
    result = subprocess.run([sys.executable, "-m", "gates.cli", "serve", "--preset", "tiny", "--port",
                             str(free_port()), "--cache-dir", str(filesystem)], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        f"kvgate serve: cache.disk.min_free_bytes: expected at most the size of the filesystem beneath "
        f"{filesystem} (64.0 MiB) less one block (132.0 KiB), found 256.0 MiB: the disk tier could never store "
        f"a block")


def _leave_free(directory, nbytes: int) -> None:
    """Another writer takes all but `nbytes` of the filesystem's free room."""
    with open(directory / "foreign.bin", "wb") as foreign:
        foreign.write(bytes(shutil.disk_usage(directory).free - nbytes))


def test_kvgate_serve_on_a_filled_filesystem_warns_at_start_and_counts_the_stores_it_refuses(small_tmpfs, tmp_path):
    filesystem = small_tmpfs(64)
    _leave_free(filesystem, 8 * MiB)                                    # under the 16 MiB reserve
    server = ServerProcess(tmp_path / "serve", cache_dir=filesystem,
                           engine={"cache": {"disk": {"path": str(filesystem), "min_free_bytes": "16MiB"}}})
    try:
        server.wait_healthy()
        log = server.log()
        assert (f"kvgate serve: warning: the disk tier can store no block now: the filesystem beneath {filesystem} "
                f"has 8.0 MiB free") in log, log
        assert f"disk tier {filesystem} (0 B usable of 8.0 GiB)" in log, log
        ask(server, distinct_prompt("refused", 600))                    # two full blocks of 256 tokens
        with http_client(server.port) as http:
            refused = metrics(http)
        assert metric_value(refused, "kvgate_cache_stores_refused_total", tier="disk") >= 2
        assert metric_value(refused, "kvgate_cache_blocks", tier="disk") == 0
        assert metric_value(refused, "kvgate_cache_write_errors_total", tier="disk") == 0
        assert metric_value(refused, "kvgate_cache_capacity_bytes", tier="disk") == 0   # not the 8 GiB configured

        (filesystem / "foreign.bin").unlink()                           # room again: the tier stores again
        ask(server, distinct_prompt("stored", 600))
        deadline = time.monotonic() + 60
        with http_client(server.port) as http:
            while metric_value(metrics(http), "kvgate_cache_blocks", tier="disk") < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            stored = metrics(http)
        assert metric_value(stored, "kvgate_cache_blocks", tier="disk") >= 2
        usable = metric_value(stored, "kvgate_cache_capacity_bytes", tier="disk")
        assert 40 * MiB < usable <= 48 * MiB                            # 64 MiB less the reserve, not 8 GiB
    finally:
        assert server.stop() == 0, server.log()
