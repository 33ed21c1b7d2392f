"""Whether a piece of code imports torch, run in a fresh interpreter (torch takes seconds and a GiB to import)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.servers import REPO


def imports_torch(code: str, cwd: Path) -> bool:
    """Whether running `code` in a fresh interpreter (the worktree on its path, nothing else) imports torch."""
    probe = code + "\nimport sys\nprint('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n"
    done = subprocess.run([sys.executable, "-c", probe], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    last = done.stdout.strip().splitlines()[-1:]
    assert last in (["TORCH"], ["NO-TORCH"]), done.stdout + done.stderr
    return last == ["TORCH"]
