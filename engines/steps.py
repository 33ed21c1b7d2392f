"""The calls a cache-control ability makes: an HTTP request, a command, or dropping a local directory's pages.

Each step says what it will do (`describe`, shown in the report and in an error) and does it
(`run`), raising ControlError with the call and what came back when it fails: a gate that asked
for a flush and did not get one must not measure as if it had.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from kvcore.files import drop_cached_pages


class ControlError(RuntimeError):
    """A cache-control call was made and failed; the message names the call and what it answered."""


@dataclass(frozen=True)
class StepResult:
    """What a step did and what it answered (a response body, a command's output, a file count)."""

    action: str
    answer: Any = None


def http_call(method: str, url: str, body: Optional[Any] = None, headers: Optional[Mapping[str, str]] = None,
              timeout_s: float = 120.0) -> tuple[int, str]:
    """One HTTP request (JSON body when given); (status, text). No proxy from the environment: these are
    calls to the engine under test, which a proxy would answer for."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=timeout_s) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise ControlError(f"{method} {url}: no answer ({reason})") from None


def with_query(url: str, params: Mapping[str, Union[str, Sequence[str]]]) -> str:
    """`url` with query parameters added (a sequence value repeats the parameter, as LMCache's `locations`)."""
    if not params:
        return url
    return url + ("&" if "?" in url else "?") + urllib.parse.urlencode(params, doseq=True)


@dataclass(frozen=True)
class HttpStep:
    """An HTTP call that must answer 2xx; `check` may refuse a 2xx body (vLLM answers {"success": false})."""

    method: str
    url: str
    body: Optional[Any] = None
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    check: Optional[Callable[[str], Optional[str]]] = None  # the body -> None, or why it is a failure
    hints: Mapping[int, str] = field(default_factory=dict)  # status -> what it usually means (404: route off)
    timeout_s: float = 120.0

    def describe(self) -> str:
        return f"{self.method} {self.url}" + (f" {json.dumps(self.body)}" if self.body is not None else "")

    def run(self) -> StepResult:
        status, text = http_call(self.method, self.url, self.body, self.headers, self.timeout_s)
        if not 200 <= status < 300:
            hint = f" ({self.hints[status]})" if status in self.hints else ""
            raise ControlError(f"{self.describe()}: HTTP {status}{hint}: {text.strip()[:300]}")
        refused = self.check(text) if self.check is not None else None
        if refused:
            raise ControlError(f"{self.describe()}: {refused}")
        return StepResult(self.describe(), _json_or_text(text))


@dataclass(frozen=True)
class CommandStep:
    """A command run by the shell (e.g. `ssh storage01 'sync; echo 1 > /proc/sys/vm/drop_caches'`); exit 0 or fail."""

    command: str
    timeout_s: float = 300.0

    def describe(self) -> str:
        return f"command: {self.command}"

    def run(self) -> StepResult:
        try:
            done = subprocess.run(self.command, shell=True, capture_output=True, text=True, timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            raise ControlError(f"{self.describe()}: still running after {self.timeout_s:g} s") from None
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip()[-300:]
            raise ControlError(f"{self.describe()}: exit {done.returncode}: {said or 'no output'}")
        return StepResult(self.describe(), done.stdout.strip()[-2000:])


@dataclass(frozen=True)
class DropLocalPages:
    """Drop every file under a local directory from the page cache (fdatasync + posix_fadvise DONTNEED,
    as the embedded disk tier does), so the next read of it reads the device."""

    directory: Path

    def describe(self) -> str:
        return f"fadvise(DONTNEED) every file under {self.directory}"

    def run(self) -> StepResult:
        if not self.directory.is_dir():
            raise ControlError(f"{self.describe()}: {self.directory} is not a directory on this host")
        files = [Path(root) / name for root, _, names in os.walk(self.directory) for name in names]
        regular = [path for path in files if path.is_file() and not path.is_symlink()]
        try:
            dropped = drop_cached_pages(regular)
        except PermissionError as error:
            raise ControlError(f"{self.describe()}: {error}") from None
        return StepResult(self.describe(), {"files": dropped})


@dataclass(frozen=True)
class StepChain:
    """Steps run in order (e.g. kvgate: publish queued writes, then evict); the first failure stops it."""

    steps: tuple

    def describe(self) -> str:
        return " then ".join(step.describe() for step in self.steps)

    def run(self) -> StepResult:
        return StepResult(self.describe(), [step.run().answer for step in self.steps])


Step = Union[HttpStep, CommandStep, DropLocalPages, StepChain]


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text.strip()
