"""Scrub: verify every stored block of a disk tier directory and remove the bad ones.

Works on the directory alone, for every model's fingerprint in it: a block file
`<fingerprint hex>/<kk>/<key hex>.kvb` must carry that fingerprint and key in
its header, be whole, and match its payload checksum. Temp files are writes in
flight (or orphans of a crash, which the next server start removes); scrub
counts them and leaves them alone, so it is safe while servers run.

Only the tier's own files are judged (names and places as `cache_impl.cache.blockfiles`
defines them); links are never followed and, like every foreign name, are left
alone and reported as skipped.
"""

from __future__ import annotations

import errno
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from cache_impl.cache import blockfiles, integrity


@dataclass
class ScrubSummary:
    root: str
    checked: int = 0
    bad: int = 0
    removed: int = 0
    bytes_checked: int = 0
    temp_files: int = 0
    fingerprints: int = 0
    bad_by_reason: Counter = field(default_factory=Counter)
    bad_files: list[str] = field(default_factory=list)
    skipped_by_reason: Counter = field(default_factory=Counter)
    skipped_files: list[tuple[str, str]] = field(default_factory=list)  # (path, why), never touched

    @property
    def skipped(self) -> int:
        return len(self.skipped_files)

    def skip(self, path: Path, why: str) -> None:
        self.skipped_by_reason[why] += 1
        self.skipped_files.append((str(path), why))

    def as_dict(self) -> dict:
        return {"root": self.root, "checked": self.checked, "bad": self.bad, "removed": self.removed,
                "bytes_checked": self.bytes_checked, "temp_files": self.temp_files,
                "fingerprints": self.fingerprints, "bad_by_reason": dict(self.bad_by_reason),
                "bad_files": self.bad_files, "skipped": self.skipped,
                "skipped_by_reason": dict(self.skipped_by_reason),
                "skipped_files": [{"path": p, "why": w} for p, w in self.skipped_files]}


def scrub(root: Path, remove: bool = True) -> ScrubSummary:
    """Verify every block file under a disk tier directory; remove the bad ones unless `remove` is off."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such disk tier directory")
    summary = ScrubSummary(str(root))
    with os.scandir(root) as entries:
        tops = sorted(entries, key=lambda e: e.name)
    for top in tops:
        if top.is_symlink():
            summary.skip(root / top.name, blockfiles.SYMLINK)
        elif not top.is_dir(follow_symlinks=False) or not blockfiles.is_fingerprint_dir_name(top.name):
            summary.skip(root / top.name, blockfiles.FOREIGN_NAME)
        else:
            _scrub_fingerprint(root / top.name, summary, remove)
    return summary


def _scrub_fingerprint(path: Path, summary: ScrubSummary, remove: bool) -> None:
    try:
        directory = blockfiles.BlockDir(path)
    except OSError as e:  # swapped for a link (ELOOP) or removed since we listed it
        summary.skip(path, blockfiles.SYMLINK if os.path.islink(path) else e.strerror or "unreadable")
        return
    summary.fingerprints += 1
    fingerprint = bytes.fromhex(path.name)
    try:
        for found in directory.walk():
            if found.kind == blockfiles.SKIPPED:
                summary.skip(found.path, found.skip_reason)
            elif found.kind == blockfiles.TEMP:
                summary.temp_files += 1
            else:
                _scrub_block(directory, found, fingerprint, summary, remove)
    finally:
        directory.close()


def _scrub_block(directory: blockfiles.BlockDir, found: blockfiles.Found, fingerprint: bytes,
                 summary: ScrubSummary, remove: bool) -> None:
    try:
        fd = directory.open_file(found.sub, found.name)
    except FileNotFoundError:
        return  # evicted while we looked
    except OSError as e:  # swapped for a link or another kind of file since it was listed
        summary.skip(found.path, blockfiles.SYMLINK if e.errno == errno.ELOOP else blockfiles.NOT_A_FILE)
        return
    try:
        reason, nbytes = integrity.verify_open_file(fd, fingerprint, found.block_key)
    finally:
        os.close(fd)
    summary.checked += 1
    summary.bytes_checked += nbytes
    if reason is None:
        return
    summary.bad += 1
    summary.bad_by_reason[reason] += 1
    summary.bad_files.append(str(found.path))
    if remove and directory.unlink(found.sub, found.name):
        summary.removed += 1
