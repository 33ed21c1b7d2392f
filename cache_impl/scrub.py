"""Scrub: verify every stored block of a disk tier directory and remove the bad ones.

Works on the directory alone, for every model's fingerprint in it: a block file
`<fingerprint hex>/<kk>/<key hex>.kvb` must carry that fingerprint and key in
its header, be whole, and match its payload checksum. Temp files are writes in
flight (or orphans of a crash, which the next server start removes); scrub
counts them and leaves them alone, so it is safe while servers run.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from . import integrity
from .keys import KEY_BYTES
from .tiers.disk import SUFFIX


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

    def as_dict(self) -> dict:
        return {"root": self.root, "checked": self.checked, "bad": self.bad, "removed": self.removed,
                "bytes_checked": self.bytes_checked, "temp_files": self.temp_files,
                "fingerprints": self.fingerprints, "bad_by_reason": dict(self.bad_by_reason),
                "bad_files": self.bad_files}


def _hex_bytes(text: str, size: int) -> bytes | None:
    try:
        value = bytes.fromhex(text)
    except ValueError:
        return None
    return value if len(value) == size else None


def scrub(root: Path, remove: bool = True) -> ScrubSummary:
    """Verify every block file under a disk tier directory; remove the bad ones unless `remove` is off."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such disk tier directory")
    summary = ScrubSummary(str(root))
    for fp_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        fingerprint = _hex_bytes(fp_dir.name, KEY_BYTES)
        if fingerprint is None:
            continue  # not a cache directory of ours
        summary.fingerprints += 1
        for path in sorted(fp_dir.glob("*/*")):
            if path.name.endswith(integrity.TEMP_SUFFIX):
                summary.temp_files += 1
                continue
            if not path.name.endswith(SUFFIX):
                continue
            key = _hex_bytes(path.name[: -len(SUFFIX)], KEY_BYTES)
            reason, nbytes = (integrity.BAD_HEADER, 0) if key is None else integrity.verify_file(
                path, fingerprint, key)
            if reason == integrity.MISSING:
                continue  # evicted while we looked
            summary.checked += 1
            summary.bytes_checked += nbytes
            if reason is None:
                continue
            summary.bad += 1
            summary.bad_by_reason[reason] += 1
            summary.bad_files.append(str(path))
            if remove:
                try:
                    os.unlink(path)
                    summary.removed += 1
                except FileNotFoundError:
                    pass
    return summary
