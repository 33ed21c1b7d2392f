"""Files that a crash cannot tear: atomic replacement and append-only JSON lines."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Iterable

from .settings import ConfigError

_append_lock = threading.Lock()


def write_text_atomic(path: Path, text: str) -> None:
    """Replace a file's text atomically (a temp file beside it, then rename): readers see old or new."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        temp.write_text(text, encoding="utf-8")
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)      # a write that failed leaves nothing behind it
        raise


def write_json(path: Path, data: Any) -> None:
    """Replace a JSON file atomically."""
    write_text_atomic(path, json.dumps(data, indent=2, default=str))


def append_jsonl(path: Path, row: dict) -> None:
    """Append one JSON line with a single write (a crash loses nothing already written)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(row, separators=(",", ":"), default=str) + "\n").encode()
    with _append_lock:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def fsync_directory(directory: Path) -> None:
    """Make the directory's entries (new files, renames, removals) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_jsonl_file(path: Path) -> list[dict]:
    """Every complete JSON line of a file ([] when absent); a bad line (torn by a crash mid-write, not JSON, not
    UTF-8) is skipped."""
    return _parsed(_jsonl_bytes(path).splitlines())


def _jsonl_bytes(path: Path) -> bytes:
    """A JSON-lines file's bytes (empty when absent); ConfigError naming it when it is a directory or unreadable."""
    path = Path(path)
    if not path.exists():
        return b""
    try:
        return path.read_bytes()
    except OSError as error:
        found = "a directory" if isinstance(error, IsADirectoryError) else f"it unreadable ({error.strerror or error})"
        raise ConfigError(f"{path}: expected a JSON-lines file, found {found}") from None


TORN = object()   # a line read_jsonl_lines could not parse


def read_jsonl_lines(path: Path) -> list[Any]:
    """Each line of a JSON-lines file in order ([] when absent): its JSON value, or `TORN` where it does not parse
    (torn by a crash mid-write, damaged, not UTF-8), so a reader can say which line it left out."""
    return _values(_jsonl_bytes(path).splitlines())


def _values(lines: Iterable[bytes]) -> list[Any]:
    """The JSON value of each line, `TORN` for one that does not parse or whose bytes are not UTF-8 (json.loads
    decodes bytes itself: a UnicodeDecodeError is a ValueError)."""
    values: list[Any] = []
    for line in lines:
        try:
            values.append(json.loads(line))
        except ValueError:
            values.append(TORN)
    return values


def _parsed(lines: Iterable[bytes]) -> list[dict]:
    """The JSON value of each line; a line that does not parse is skipped."""
    return [value for value in _values(lines) if value is not TORN]


def read_jsonl(directory: Path, pattern: str) -> list[dict]:
    """Every JSON line of the files matching `pattern` in `directory`."""
    return [row for path in sorted(Path(directory).glob(pattern)) for row in read_jsonl_file(path)]


class JsonlTail:
    """The JSON lines appended to the files matching `pattern` in `directory` since the last `read_new`.

    Each file is read from where the previous call stopped (an offset per file), so a poll costs what was
    appended, not the whole file; files that appear later are picked up. A line is taken only once its
    newline has landed, so one caught mid-write is read whole by the next call.
    """

    def __init__(self, directory: Path, pattern: str) -> None:
        self.directory, self.pattern = Path(directory), pattern
        self._offsets: dict[Path, int] = {}

    def read_new(self) -> list[dict]:
        rows = []
        for path in sorted(self.directory.glob(self.pattern)):
            offset = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as handle:
                    handle.seek(offset)
                    data = handle.read()
            except FileNotFoundError:
                continue
            whole = data.rfind(b"\n") + 1
            self._offsets[path] = offset + whole
            rows += _parsed(data[:whole].splitlines())
        return rows


def drop_cached_pages(paths: Iterable[Path]) -> int:
    """Write back and drop each file's pages from the page cache (`posix_fadvise(DONTNEED)`), so that
    the next read of it reads the device. Returns how many files it dropped; a file that is gone is
    skipped. (Dirty pages cannot be dropped, hence the fdatasync first.)"""
    dropped = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            dropped += 1
        finally:
            os.close(fd)
    return dropped


def process_read_bytes(pid: int | str = "self") -> int:
    """Bytes the process (all its threads) has caused to be read from storage so far: `read_bytes` of
    /proc/PID/io. A read served by the page cache does not count, so its growth over a load says how
    much of the load really came from the device."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/io: expected a read_bytes line, found none")
