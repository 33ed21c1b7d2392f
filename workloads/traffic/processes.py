"""Local processes and ports: children that end with their parent, so a killed harness never leaves servers or
load running, and a free port on loopback."""

from __future__ import annotations

import ctypes
import signal
import socket
import sys

_PR_SET_PDEATHSIG = 1
# Looked up once, here: between fork and exec the child only calls the function (no dlopen, no allocation).
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def die_with_parent() -> None:
    """preexec_fn: ask the kernel to SIGTERM this child when its parent dies (Linux; a no-op elsewhere).

    Linux ties this to the thread that started the child: start children from a long-lived thread.
    """
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
