"""Blocks whose bytes follow from their tokens, and files planted around a disk tier: shared by the cache tests."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import torch

from cache_impl import KVLayout

BLOCK = 4   # tokens per block of the tests' small layout (conftest's `layout`)


def block_for(layout: KVLayout, tokens: list[int], index: int) -> torch.Tensor:
    """The KV a deterministic 'model' would compute for block `index` of `tokens` (depends on the whole prefix)."""
    prefix = tokens[: (index + 1) * layout.block_size]
    seed = int.from_bytes(hashlib.blake2b(repr(prefix).encode(), digest_size=8).digest(), "little") >> 1
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(layout.block_shape, generator=generator).to(layout.torch_dtype)


def blocks_for(layout: KVLayout, tokens: list[int]) -> list[torch.Tensor]:
    return [block_for(layout, tokens, i) for i in range(len(tokens) // layout.block_size)]


def files_below(root: Path) -> dict[str, bytes]:
    """Every regular file below `root` (links not followed) with its bytes, by relative path."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()
    }


def plant_links_and_strays(fp_dir: Path, outside: Path) -> list[Path]:
    """Plant, below a disk tier's fingerprint directory, links that lead outside it and files of foreign names.

    Outside: block-named junk, a temp-named file, a note, and a copy of a real block (valid if read).
    Returns the strays planted inside (files whose names or places are not the tier's own).
    """
    donor = next(p for p in sorted(fp_dir.glob("*/*.kvb")))
    free = next(f"{i:02x}" for i in range(256) if not (fp_dir / f"{i:02x}").exists())
    model = outside / "model" / free
    model.mkdir(parents=True)
    for place in (outside, model):
        (place / f"{free * 16}.kvb").write_bytes(b"junk under a block's name")
        (place / f".{free * 16}.kvb.1.2.3.tmp").write_bytes(b"junk under a temp file's name")
        (place / "notes.txt").write_text("someone's notes")
    shutil.copyfile(donor, outside / donor.name)
    (fp_dir / free).symlink_to(outside, target_is_directory=True)              # a key directory
    (fp_dir.parent / ("12" * 16)).symlink_to(outside / "model", target_is_directory=True)  # a fingerprint directory
    sub = donor.parent
    (sub / f"{sub.name}{'0' * 30}.kvb").symlink_to(outside / "notes.txt")        # a block name, a link to a file
    strays = [fp_dir / "zz" / f"{'77' * 16}.kvb",                                 # a directory name not the tier's
              sub / f"{'ff' if sub.name != 'ff' else 'ee'}{'1' * 30}.kvb",         # a block in another key's directory
              sub / f"{sub.name.upper()}{'A' * 30}.kvb",                          # upper-case hex: never written
              sub / "notes.kvb", fp_dir / "README"]
    for stray in strays:
        stray.parent.mkdir(exist_ok=True)
        stray.write_bytes(b"not the tier's")
    return strays
