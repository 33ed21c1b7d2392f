"""DCP's FileSystemWriter, keeping the operating system's error when a write fails.

`torch.save` writes each tensor through its C++ zip writer, which turns a failed `write()` of the
Python stream into "[enforce fail at inline_container.cc] unexpected pos 704 vs 598": a full disk
(ENOSPC) or a failing one (EIO) would be reported as a serialisation bug. The writer here is DCP's
own `FileSystemWriter` (same planning, files, fsync and `.metadata` rename); only its streams
remember the first OSError they raised, with the file's path, so a failed save can say
"[Errno 28] No space left on device: '/ckpt/__1_0.distcp'".
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem


class _Stream:
    """A file object whose write, flush and close record an OSError (with the path) before raising it."""

    def __init__(self, raw, path: Path, fs: "ErrorKeepingFileSystem") -> None:
        self._raw, self._path, self._fs = raw, path, fs

    def write(self, data) -> int:
        return self._fs.recorded(self._path, self._raw.write, data)

    def flush(self) -> None:
        self._fs.recorded(self._path, self._raw.flush)

    def close(self) -> None:
        self._fs.recorded(self._path, self._raw.close)

    def __getattr__(self, name: str):
        return getattr(self._raw, name)   # tell, seek, fileno (for DCP's fsync), ...


class ErrorKeepingFileSystem(FileSystem):
    """DCP's local FileSystem whose streams keep the first OSError of any write (writer threads too)."""

    def __init__(self) -> None:
        super().__init__()
        self.first_error: Optional[OSError] = None
        self._lock = threading.Lock()

    def recorded(self, path: Path, call, *args):
        try:
            return call(*args)
        except OSError as error:
            with self._lock:
                if self.first_error is None:
                    self.first_error = OSError(error.errno, error.strerror, str(error.filename or path))
            raise

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator:
        path = Path(path)
        if "r" in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        raw = self.recorded(path, open, path, mode)
        try:
            yield _Stream(raw, path, self)
        finally:
            self.recorded(path, raw.close)


class ErrorKeepingWriter(FileSystemWriter):
    """FileSystemWriter (sync_files, thread_count, ... as DCP's) whose `first_error` says why a write failed."""

    fs: ErrorKeepingFileSystem     # DCP's writer makes a plain FileSystem; __init__ replaces it with this

    def __init__(self, path, **options) -> None:
        super().__init__(path, **options)
        self.fs = ErrorKeepingFileSystem()

    @property
    def first_error(self) -> Optional[OSError]:
        return self.fs.first_error
