"""A load process of real locust, forked from a server process that has imported locust once.

Starting `python -m locust` costs ~1 s of imports (locust, gevent, flask) before the first request on a
2-core VM, and G3 starts a load process for every block: ~25 a main job. multiprocessing's forkserver is
started once per gate process with locust preloaded; each load process is forked from it and runs
locust's own `main()` with the command line `python -m locust` would get, its output in the load's log
(Python's random module reseeds itself in a forked child, so no two load processes draw alike). What it inherits
is frozen out of the garbage collector's sight, so a full collection never scans locust's own modules mid-load.

`ForkedLocust` answers as much of `subprocess.Popen` as the load's loop uses (wait, poll, send_signal,
kill, returncode). Where the forkserver is missing (not Linux or macOS) `start_locust` falls back to
`python -m locust` in a subprocess.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import types
from contextlib import contextmanager
from typing import IO, Iterator, Optional, Union, cast

from workloads.traffic.processes import die_with_parent

# what the locustfile imports, loaded once in the forkserver (never the locustfile itself: its event listeners
# would then be added twice, once by the preload and once by locust loading the file)
PRELOAD = ["locust", "locust.main", "gevent", "psutil", "workloads.traffic.client", "workloads.traffic.errors",
           "workloads.traffic.requests", "workloads.traffic.routing"]


class ForkedLocust:
    """A load process forked from the forkserver, answered as `subprocess.Popen` is."""

    def __init__(self, process: multiprocessing.process.BaseProcess, argv: list[str]) -> None:
        self.process, self.args = process, argv

    @property
    def pid(self) -> Optional[int]:
        return self.process.pid

    @property
    def returncode(self) -> Optional[int]:
        return self.process.exitcode

    def poll(self) -> Optional[int]:
        return self.process.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.process.exitcode is None and self.process.pid is not None:
            os.kill(self.process.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _context() -> Optional[multiprocessing.context.ForkServerContext]:
    try:
        context = cast(multiprocessing.context.ForkServerContext, multiprocessing.get_context("forkserver"))
    except ValueError:
        return None
    context.set_forkserver_preload(PRELOAD)
    return context


def _locust_main(argv: list[str], env: dict, log_path: str) -> None:
    """The forked process: its output to the log, the load's environment, what it inherited frozen, locust's main."""
    die_with_parent()                                   # the forkserver's child: gone with it
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(env)
    # the ~50,000 objects of the preloaded modules live as long as the process: out of the collector's sight, a
    # full collection during the load is ~0 ms, where scanning them took 30-57 ms (57 at the first, copying the
    # forkserver's pages), long enough to add to a measured first token
    gc.freeze()
    sys.argv = ["locust", *argv]
    from locust.main import main  # deferred: the forked load process runs it; the forkserver preloaded it

    main()


def start_locust(argv: list[str], env: dict, log: IO[str]) -> Union[ForkedLocust, subprocess.Popen]:
    """Start `python -m locust ARGV` with `env`, its output appended to `log` (a file open for writing)."""
    context = _context()
    if context is None:
        return subprocess.Popen([sys.executable, "-m", "locust", *argv], env=env, stdout=log,
                                stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    log.flush()
    process = context.Process(target=_locust_main, args=(argv, env, log.name), name="kvgate-locust")
    with _main_left_alone():
        process.start()
    return ForkedLocust(process, ["locust", *argv])


@contextmanager
def _main_left_alone() -> Iterator[None]:
    """multiprocessing runs the parent's __main__ module again (as __mp_main__) in the forkserver and in each process
    it forks, unless __main__ names no module and no file; a load process runs locust alone, so while one starts
    __main__ is a bare module (a script without a main guard would otherwise run again in every load process)."""
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = saved
