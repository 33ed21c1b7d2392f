"""A run directory held by one `kvgate run` at a time: an exclusive lock on a file in it, held while the run lasts.

Two runs given the same `--out` (or two `--resume` of one run) cannot both get through a "new or empty" check
and then write into one directory: the second is refused naming the run that holds it. The lock is the
kernel's (flock), so a run that dies, even by SIGKILL, leaves the directory free again.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import IO, Optional

from kvcore.rundata import RUN_LOCK
from kvcore.settings import ConfigError


class RunClaim:
    """The held lock of one run directory; `release()` (or leaving the `with`) lets it go."""

    def __init__(self, run_dir: Path, handle: IO[str]) -> None:
        self.run_dir, self._handle = run_dir, handle

    def release(self) -> None:
        if not self._handle.closed:
            fcntl.flock(self._handle, fcntl.LOCK_UN)
            self._handle.close()

    def __enter__(self) -> "RunClaim":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def claim_run_dir(run_dir: Path, run_id: str, field: str = "--out", new: bool = True) -> RunClaim:
    """`run_dir` created if needed and locked for this run; ConfigError naming the run that holds it, or (`new`)
    the files a finished run left there."""
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        handle = open(run_dir / RUN_LOCK, "a+", encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"{field}: expected a directory kvgate can write, found {str(run_dir)!r}: "
                          f"{error.strerror or error}") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(handle)
        handle.close()
        raise ConfigError(f"{field}: expected a directory no other run is using, found {str(run_dir)!r} held by "
                          f"{holder}: wait for it to end, or give another {field}") from None
    left = sorted(p.name for p in run_dir.iterdir() if p.name != RUN_LOCK) if new else []
    if left:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()
        raise ConfigError(f"{field}: expected a new or empty directory for the run, found {str(run_dir)!r} holding "
                          f"files ({', '.join(left[:3])}{', …' if len(left) > 3 else ''}): another run wrote there")
    handle.seek(0)
    handle.truncate()
    json.dump({"run_id": run_id, "pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}, handle)
    handle.flush()
    return RunClaim(run_dir, handle)


def _holder(handle: IO[str]) -> str:
    """Who holds the lock, as its holder wrote it ("run ID (pid N on HOST, since HH:MM:SS)")."""
    handle.seek(0)
    try:
        info: Optional[dict] = json.loads(handle.read() or "null")
    except ValueError:
        info = None
    if not isinstance(info, dict):
        return "another run (it has not yet said which)"
    since = info.get("since")
    when = time.strftime(", since %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else ""
    return f"run {info.get('run_id')} (pid {info.get('pid')} on {info.get('host')}{when})"
