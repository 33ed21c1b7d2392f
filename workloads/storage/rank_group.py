"""A group of rank processes driven over pipes: one JSON line per command, one JSON line per answer.

Distributed training code runs as one process per rank (as `torchrun` starts it); a harness that
times it must never hang on it. `RankGroup` starts the ranks with the usual environment
(MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK), sends each command to every rank's
stdin and waits for one answer line from each on its stdout, with a deadline. A rank that exits,
or does not answer in time, is a `RankFailure` naming the rank and the end of its stderr, and the
whole group is stopped (its other ranks would wait for it in a collective forever).

Each rank's stderr goes to a file (a pipe nobody reads would fill and block the rank).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, NoReturn, Optional, Sequence

from workloads.traffic.processes import die_with_parent, free_port

PROJECT_ROOT = Path(__file__).resolve().parents[2]
STDERR_TAIL_CHARS = 1500
EXIT_GRACE_S = 10.0
PEER_EXIT_GRACE_S = 1.0


class RankFailure(RuntimeError):
    """A rank exited or stopped answering; the message names it and quotes its stderr's end."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


def _pipe(stream: Optional[IO[bytes]], process: subprocess.Popen, name: str) -> IO[bytes]:
    """A rank's stdin or stdout: a pipe, as `RankGroup` starts every rank (Popen types them as maybe absent)."""
    if stream is None:
        raise RuntimeError(f"rank process {process.pid}: its {name} is not a pipe")
    return stream


class RankGroup:
    """`world_size` processes of `python -m module *args`, one per rank, answering commands in step."""

    def __init__(self, module: str, args: Sequence[str], world_size: int, env: Optional[dict] = None) -> None:
        self.world_size = world_size
        self._stderr_dir = Path(tempfile.mkdtemp(prefix="kvgate-ranks-"))
        self._buffers = [b""] * world_size
        self._closed = False
        port = free_port()
        base = {**os.environ, **(env or {})}
        base["PYTHONPATH"] = os.pathsep.join([str(PROJECT_ROOT)] + [p for p in [base.get("PYTHONPATH")] if p])
        base.setdefault("GLOO_SOCKET_IFNAME", "lo")
        base.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size),
                     "PYTHONUNBUFFERED": "1"})
        self.processes: list[subprocess.Popen] = []
        for rank in range(world_size):
            stderr = open(self.stderr_path(rank), "wb")
            try:
                self.processes.append(subprocess.Popen(
                    [sys.executable, "-m", module, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=stderr, env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    preexec_fn=die_with_parent))
            finally:
                stderr.close()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def stderr_path(self, rank: int) -> Path:
        return self._stderr_dir / f"rank{rank}.stderr"

    def stderr_tail(self, rank: int) -> str:
        """The last lines of the rank's stderr (what it said before it died or hung)."""
        try:
            text = self.stderr_path(rank).read_bytes()[-STDERR_TAIL_CHARS:].decode(errors="replace")
        except OSError:
            return ""
        return text.strip()

    def ask(self, command: Optional[dict], what: str, timeout_s: float) -> list[dict]:
        """Send `command` to every rank (None: send nothing, e.g. to wait for start-up) and return
        each rank's one answer, in rank order. Raises RankFailure (and stops the group) when a rank
        exits or the answers do not all come within `timeout_s`."""
        if self._closed:
            raise RankFailure(-1, f"{what}: the ranks are stopped")
        if command is not None:
            line = (json.dumps(command) + "\n").encode()
            for rank, process in enumerate(self.processes):
                try:
                    stdin = _pipe(process.stdin, process, "stdin")
                    stdin.write(line)
                    stdin.flush()
                except (BrokenPipeError, OSError):
                    self._fail_exited(rank, what)
        return self._collect(what, timeout_s)

    def _collect(self, what: str, timeout_s: float) -> list[dict]:
        answers: dict[int, dict] = {}
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as selector:
            for rank, process in enumerate(self.processes):
                selector.register(_pipe(process.stdout, process, "stdout"), selectors.EVENT_READ, rank)
            while len(answers) < self.world_size:
                for rank in range(self.world_size):       # a whole line may already be buffered
                    if rank not in answers and b"\n" in self._buffers[rank]:
                        answers[rank] = self._take_line(rank, what)
                if len(answers) == self.world_size:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    self._fail_silent([r for r in range(self.world_size) if r not in answers], what, timeout_s)
                for key, _ in selector.select(timeout=min(left, 1.0)):
                    rank = key.data
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        selector.unregister(key.fileobj)
                        if rank not in answers and b"\n" not in self._buffers[rank]:
                            self._fail_exited(rank, what)
                    self._buffers[rank] += chunk
        return [answers[rank] for rank in range(self.world_size)]

    def _take_line(self, rank: int, what: str) -> dict:
        line, _, self._buffers[rank] = self._buffers[rank].partition(b"\n")
        try:
            answer = json.loads(line)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            self._fail(rank, f"rank {rank} answered {what} with {line[:200]!r}, expected one JSON object"
                             f"{self._tail_note(rank)}")
        return answer

    def _exit_message(self, rank: int, what: str) -> str:
        process = self.processes[rank]
        try:
            code = process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            how = "closed its answer pipe"
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        return f"rank {rank} {how} during {what}{self._tail_note(rank)}"

    def _tail_note(self, rank: int) -> str:
        tail = self.stderr_tail(rank)
        return f"; its stderr ends: {tail}" if tail else "; its stderr is empty"

    def _fail_exited(self, first_seen: int, what: str) -> NoReturn:
        """A rank is gone. Its peers may follow it within moments (a collective with a dead peer
        fails), so wait a little, then blame a rank killed by a signal if there is one, else the
        first one seen, and name the others after it."""
        deadline = time.monotonic() + PEER_EXIT_GRACE_S
        while time.monotonic() < deadline and any(p.poll() is None for p in self.processes):
            time.sleep(0.05)
        gone = [r for r, p in enumerate(self.processes) if p.poll() is not None or r == first_seen]
        signalled = [r for r in gone if (self.processes[r].returncode or 0) < 0]
        blamed = signalled[0] if signalled else first_seen
        others = [r for r in gone if r != blamed]
        message = self._exit_message(blamed, what)
        if others:
            message += "; then " + "; ".join(self._exit_message(r, what) for r in others)
        self._fail(blamed, message)

    def _fail_silent(self, silent: list[int], what: str, timeout_s: float) -> NoReturn:
        """No answer in time. A rank waiting in a collective for a hung peer is silent too, so every
        silent rank is named, each with its stderr's end."""
        names = ", ".join(f"rank {r}" for r in silent)
        notes = "".join(f"; rank {r}'s stderr " + (f"ends: {t}" if (t := self.stderr_tail(r)) else "is empty")
                        for r in silent)
        self._fail(silent[0], f"no answer to {what} within {timeout_s:g} s from {names}{notes}")

    def _fail(self, rank: int, message: str) -> NoReturn:
        self.kill()
        raise RankFailure(rank, message)

    def close(self, command: Optional[dict] = None, timeout_s: float = EXIT_GRACE_S) -> list[Optional[int]]:
        """Ask every rank to exit (`command` on its stdin, then end of input), wait for them, kill the
        ones still running after `timeout_s`; returns their exit codes. Idempotent."""
        if not self._closed:
            for process in self.processes:
                try:
                    stdin = _pipe(process.stdin, process, "stdin")
                    if command is not None:
                        stdin.write((json.dumps(command) + "\n").encode())
                    stdin.close()
                except (BrokenPipeError, OSError):
                    pass
            deadline = time.monotonic() + timeout_s
            for process in self.processes:
                try:
                    process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            self.kill()
        return [p.returncode for p in self.processes]

    def kill(self) -> None:
        """Stop every rank now (SIGKILL; also a stopped or hung one) and reap it."""
        self._closed = True
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            process.wait()
            for stream in (process.stdin, process.stdout):
                try:
                    if stream is not None:
                        stream.close()
                except (BrokenPipeError, OSError):
                    pass

    def remove_logs(self) -> None:
        """Remove the ranks' stderr files (their tails are in any RankFailure already raised)."""
        if self._stderr_dir.is_dir():
            for path in self._stderr_dir.glob("*"):
                path.unlink(missing_ok=True)
            self._stderr_dir.rmdir()
