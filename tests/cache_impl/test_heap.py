"""cache_impl.platform.heap: freed heap memory goes back to the OS once enough has been released (glibc)."""

import json
import os
import subprocess
import sys

import pytest

from cache_impl.platform.heap import HeapTrimmer, fix_mmap_threshold

# Both child processes' start: 96 blocks of 1 MiB through glibc's malloc, touched, then all freed but
# the last (which keeps the arena's top in use); the resident MiB.
CHILD_PRELUDE = """
import ctypes, json, os, threading
from cache_impl.platform.heap import HeapTrimmer, fix_mmap_threshold
MiB, CHUNKS = 2**20, 96
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
resident = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // MiB
def touch_then_free_all_but_last(out):
    blocks = [libc.malloc(MiB) for _ in range(CHUNKS)]
    for block in blocks:
        ctypes.memset(block, 1, MiB)
    out["in_use"] = resident()
    for block in blocks[:-1]:
        libc.free(block)
"""

# Run in a child process (the mmap threshold it sets stays set): in a fresh thread, with its own arena,
# 96 touched 1 MiB blocks from the arena (the threshold raised past them, as glibc does itself once
# it frees a larger block), all freed but the last, which keeps the arena's top in use so glibc's
# own trimming on free cannot return the rest; then released to a HeapTrimmer in two steps.
FRAGMENT = CHILD_PRELUDE + """
libc.mallopt(-3, 64 * MiB)  # M_MMAP_THRESHOLD
out = {}
def work():
    touch_then_free_all_but_last(out)
thread = threading.Thread(target=work)
thread.start()
thread.join()
out["after_free"] = resident()
trimmer = HeapTrimmer(every_bytes=(CHUNKS - 1) * MiB)
out["first_trimmed"] = trimmer.released((CHUNKS - 2) * MiB)
out["after_first"] = resident()
out["second_trimmed"] = trimmer.released(MiB)
out["after_second"] = resident()
out["trims"] = trimmer.trims
print(json.dumps(out))
"""


def test_freed_blocks_stay_resident_until_enough_is_released_then_the_trim_returns_them():
    if not HeapTrimmer().available:
        pytest.skip("no glibc malloc_trim on this system")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    child = subprocess.run([sys.executable, "-c", FRAGMENT], capture_output=True, text=True, timeout=60, env=env)
    assert child.returncode == 0, child.stderr
    mib = json.loads(child.stdout)
    assert mib["after_free"] > mib["in_use"] - 16, mib                  # freed, yet resident: the arena kept them
    assert not mib["first_trimmed"] and mib["after_first"] > mib["in_use"] - 16, mib   # not enough released yet
    assert mib["second_trimmed"] and mib["trims"] == 1
    assert mib["after_second"] < mib["after_free"] - 64, mib            # most of the 95 MiB went back


def test_the_count_starts_again_after_each_trim():
    trimmer = HeapTrimmer(every_bytes=100)
    results = [trimmer.released(40) for _ in range(6)]
    expected = [False, False, True, False, False, True] if trimmer.available else [False] * 6
    assert results == expected


def test_every_bytes_must_be_positive():
    with pytest.raises(ValueError, match="every_bytes: expected at least 1, found 0"):
        HeapTrimmer(every_bytes=0)


# The same blocks with the threshold pinned as `kvgate serve` pins it: each is its own mapping, so
# the frees return them at once, although a larger block freed first would have raised glibc's
# sliding threshold past them.
PINNED = CHILD_PRELUDE + """
out = {"pinned": fix_mmap_threshold() if os.environ["PIN"] == "1" else False}
def work():
    libc.free(libc.malloc(8 * MiB))    # glibc slides its threshold up to this size (unless pinned)
    touch_then_free_all_but_last(out)
    out["after_free"] = resident()
thread = threading.Thread(target=work)
thread.start()
thread.join()
print(json.dumps(out))
"""


def _run_pinned(pin: bool) -> dict:
    env = {**os.environ, "PIN": "1" if pin else "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    child = subprocess.run([sys.executable, "-c", PINNED], capture_output=True, text=True, timeout=60, env=env)
    assert child.returncode == 0, child.stderr
    return json.loads(child.stdout)


def test_a_pinned_mmap_threshold_returns_freed_blocks_at_once_where_the_sliding_one_keeps_them():
    if not HeapTrimmer().available:
        pytest.skip("no glibc malloc on this system")
    sliding, pinned = _run_pinned(False), _run_pinned(True)
    assert pinned["pinned"] and not sliding["pinned"]
    assert sliding["after_free"] > sliding["in_use"] - 16, sliding   # the arena kept them
    assert pinned["after_free"] < pinned["in_use"] - 64, pinned      # each was its own mapping: gone


def test_a_threshold_below_one_byte_is_refused():
    with pytest.raises(ValueError, match="nbytes"):
        fix_mmap_threshold(0)
