"""Where a disk tier keeps its block files and what it calls them.

One definition, shared by the writer, the re-index on start, eviction and scrub:

    <path>/<fingerprint hex>/<kk>/<key hex>.kvb                     a block (kk: the key's first two hex digits)
    <path>/<fingerprint hex>/<kk>/.<key hex>.kvb.<pid>.<thread>.<n>.tmp   a write in flight

Hex digits are lowercase, as written. Nothing else below `<path>` is the tier's: it is never
read, judged or removed, only reported as skipped. Nothing here follows a symbolic link: a
fingerprint directory and its `kk` directories are opened with O_NOFOLLOW and every file is
reached relative to its directory's descriptor (openat, unlinkat, renameat), so a link planted
anywhere below `<path>`, or swapped in while we look, leads nowhere. (`<path>` itself is the
user's choice and may be a link.)
"""

from __future__ import annotations

import os
import re
import stat
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Iterator, Sequence

from cache_impl.cache import integrity
from cache_impl.cache.keys import KEY_BYTES, Key

SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
_HEX = f"[0-9a-f]{{{2 * KEY_BYTES}}}"
_FINGERPRINT_DIR = re.compile(_HEX)
_SUBDIR = re.compile("[0-9a-f]{2}")
_BLOCK = re.compile(f"({_HEX}){re.escape(SUFFIX)}")
_TEMP = re.compile(rf"\.({_HEX}){re.escape(SUFFIX)}\.\d+\.\d+\.\d+{re.escape(TEMP_SUFFIX)}")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # O_NONBLOCK: a planted FIFO cannot hang a reader

# What a walk finds.
BLOCK = "block"
TEMP = "temp"
SKIPPED = "skipped"
# Why an entry was skipped.
SYMLINK = "symbolic link"
NOT_A_FILE = "not a regular file"
FOREIGN_NAME = "not a name the tier writes"


def subdir_name(key: Key) -> str:
    return key.hex()[:2]


def block_name(key: Key) -> str:
    return f"{key.hex()}{SUFFIX}"


def temp_name(final_name: str) -> str:
    """A unique sibling temp name for a block file (same directory, so rename is atomic)."""
    return f".{final_name}.{os.getpid()}.{threading.get_ident()}.{next(_temp_counter)}{TEMP_SUFFIX}"


_temp_counter = count()


def is_fingerprint_dir_name(name: str) -> bool:
    return _FINGERPRINT_DIR.fullmatch(name) is not None


def is_tier_dir(path: Path) -> bool:
    """Whether `path` is a disk tier's directory: it holds a fingerprint directory (not a link), which a tier
    makes in its directory when it starts; a directory without one has never been a tier's."""
    with os.scandir(path) as entries:
        return any(is_fingerprint_dir_name(e.name) and e.is_dir(follow_symlinks=False) for e in entries)


def parse_name(sub: str, name: str) -> tuple[str, Key | None]:
    """What a file called `name` in directory `sub` is to the tier: (BLOCK, key), (TEMP, None) or (SKIPPED, None)."""
    for kind, pattern in ((BLOCK, _BLOCK), (TEMP, _TEMP)):
        match = pattern.fullmatch(name)
        if match and match.group(1)[:2] == sub:
            return kind, bytes.fromhex(match.group(1)) if kind == BLOCK else None
    return SKIPPED, None


@dataclass(frozen=True)
class StagedFile:
    """A block written to a temp file in its `kk` directory, not yet renamed to its block name."""

    sub: str
    temp: str
    final: str


@dataclass(frozen=True)
class Found:
    """One entry met by `BlockDir.walk`: a block, a temp file, or something skipped (with why)."""

    kind: str
    path: Path
    sub: str
    name: str
    key: Key | None = None
    mtime: float = 0.0
    why: str | None = None

    @property
    def block_key(self) -> Key:
        """The key of a block file; ValueError for a temp file or a skipped entry, which have none."""
        if self.key is None:
            raise ValueError(f"{self.path}: a {self.kind} entry has no block key")
        return self.key

    @property
    def skip_reason(self) -> str:
        """Why a skipped entry was skipped; ValueError for a block or a temp file, which were not."""
        if self.why is None:
            raise ValueError(f"{self.path}: a {self.kind} entry was not skipped")
        return self.why


def _lstat_kind(entry: os.DirEntry) -> str | None:
    """None for a regular file, else why it is skipped (never following a link)."""
    if entry.is_symlink():
        return SYMLINK
    return None if entry.is_file(follow_symlinks=False) else NOT_A_FILE


class BlockDir:
    """One fingerprint's directory of block files, opened without following links.

    Raises OSError (ELOOP) when the directory is a symbolic link, FileNotFoundError when it is missing.
    """

    def __init__(self, path: Path, create: bool = False) -> None:
        self.path = Path(path)
        if create:
            self.path.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, _DIR_FLAGS)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def path_for(self, key: Key) -> Path:
        """Where the key's block file is (for messages and tests; file access goes through the verbs below)."""
        return self.path / subdir_name(key) / block_name(key)

    @contextmanager
    def _sub(self, sub: str, create: bool = False) -> Iterator[int]:
        if create:
            try:
                os.mkdir(sub, 0o755, dir_fd=self.fd)
            except FileExistsError:
                pass
        fd = os.open(sub, _DIR_FLAGS, dir_fd=self.fd)
        try:
            yield fd
        finally:
            os.close(fd)

    # -- verbs on one block ----------------------------------------------------

    def open_file(self, sub: str, name: str, flags: int = os.O_RDONLY) -> int:
        """Open a file of ours for reading; OSError when it is a link (ELOOP) or not a regular file."""
        with self._sub(sub) as dir_fd:
            fd = os.open(name, flags | _FILE_FLAGS, dir_fd=dir_fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise IsADirectoryError(f"{self.path / sub / name}: {NOT_A_FILE}")
        return fd

    def open_block(self, key: Key, flags: int = os.O_RDONLY) -> int:
        return self.open_file(subdir_name(key), block_name(key), flags)

    def contains(self, key: Key) -> bool:
        """Whether a regular file stands at the key's place (links and other kinds do not count)."""
        try:
            with self._sub(subdir_name(key)) as dir_fd:
                st = os.stat(block_name(key), dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode)

    def unlink(self, sub: str, name: str) -> bool:
        """Remove a regular file of ours; whether it did. Never raises, never removes a link or anything else."""
        try:
            with self._sub(sub) as dir_fd:
                if stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                    os.unlink(name, dir_fd=dir_fd)
                    return True
        except OSError:
            pass  # already gone, or not a file we may remove: it is not indexed either way
        return False

    def delete(self, key: Key) -> None:
        self.unlink(subdir_name(key), block_name(key))

    def stage(self, key: Key, buffers: Sequence, fsync: bool) -> "StagedFile":
        """Write buffers to a fresh temp file beside the key's place; nothing is visible yet.

        On any error the temp file is removed and the error raised.
        """
        sub, final = subdir_name(key), block_name(key)
        temp = temp_name(final)
        with self._sub(sub, create=True) as dir_fd:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
            try:
                try:
                    integrity.write_all(fd, buffers)
                    if fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
            except BaseException:
                _unlink_quietly(temp, dir_fd)
                raise
        return StagedFile(sub, temp, final)

    def publish(self, staged: "StagedFile") -> None:
        """Rename a staged temp file to its block name: the block appears whole, at once."""
        with self._sub(staged.sub) as dir_fd:
            os.rename(staged.temp, staged.final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)

    def discard(self, staged: "StagedFile") -> None:
        """Remove a staged temp file (after a failed or abandoned write); never raises."""
        try:
            with self._sub(staged.sub) as dir_fd:
                _unlink_quietly(staged.temp, dir_fd)
        except OSError:
            pass

    # -- every file ------------------------------------------------------------

    def temp_files(self) -> int:
        """Temp files below this directory now: writes in flight, or left behind by a write that never ended
        (names only: no file is opened or stat'ed, so it is cheap enough for every /metrics scrape)."""
        count = 0
        with self._sub(".") as dir_fd, os.scandir(dir_fd) as top:
            subs = [e.name for e in top if _SUBDIR.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
        for sub in subs:
            try:
                with self._sub(sub) as dir_fd, os.scandir(dir_fd) as entries:
                    count += sum(1 for e in entries if e.name.startswith(".") and e.name.endswith(TEMP_SUFFIX))
            except OSError:
                continue    # removed meanwhile
        return count

    def walk(self) -> Iterator[Found]:
        """Every entry below this directory, classified; descends only into real `kk` directories."""
        with self._sub(".") as dir_fd, os.scandir(dir_fd) as top:  # its own descriptor: scandir moves the offset
            subs = sorted(top, key=lambda e: e.name)
        for sub in subs:
            path = self.path / sub.name
            if sub.is_symlink():
                yield Found(SKIPPED, path, sub.name, "", why=SYMLINK)
            elif not sub.is_dir(follow_symlinks=False) or not _SUBDIR.fullmatch(sub.name):
                yield Found(SKIPPED, path, sub.name, "", why=FOREIGN_NAME)
            else:
                yield from self._walk_sub(sub.name)

    def _walk_sub(self, sub: str) -> Iterator[Found]:
        try:
            with self._sub(sub) as dir_fd, os.scandir(dir_fd) as entries:
                listed = sorted(((e.name, _lstat_kind(e), e) for e in entries), key=lambda t: t[0])
                found = []
                for name, bad_kind, entry in listed:
                    path = self.path / sub / name
                    kind, key = parse_name(sub, name)
                    if bad_kind is not None:
                        found.append(Found(SKIPPED, path, sub, name, why=bad_kind))
                    elif kind == SKIPPED:
                        found.append(Found(SKIPPED, path, sub, name, why=FOREIGN_NAME))
                    else:
                        mtime = _mtime(entry)
                        if mtime is not None:  # else removed while we looked
                            found.append(Found(kind, path, sub, name, key, mtime))
        except OSError:
            return  # the directory went away (or was swapped for a link) while we looked
        yield from found


def _unlink_quietly(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def _mtime(entry: os.DirEntry) -> float | None:
    try:
        return entry.stat(follow_symlinks=False).st_mtime
    except OSError:
        return None
