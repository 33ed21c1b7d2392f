"""Fixtures for the cache tests: a small KV layout and blocks whose bytes follow from their tokens."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from cache_impl import CacheConfig, Fingerprint, KVLayout, TieredKVCache
from cache_impl.auth import ADMIN_TOKEN_ENV
from tests.servers import ADMIN_TOKEN

BLOCK = 4


@pytest.fixture(scope="session", autouse=True)
def admin_token_in_environment():
    """The test servers' admin token where AdminClient reads it, as `kvgate run` hands it to a gate suite."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ADMIN_TOKEN_ENV, ADMIN_TOKEN)
        yield ADMIN_TOKEN


@pytest.fixture
def layout() -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=BLOCK)


@pytest.fixture
def fingerprint(layout) -> Fingerprint:
    return Fingerprint(weights_digest="seed-0", tokenizer_id="test-tokenizer", layout=layout)


def block_for(layout: KVLayout, tokens: list[int], index: int) -> torch.Tensor:
    """The KV a deterministic 'model' would compute for block `index` of `tokens` (depends on the whole prefix)."""
    prefix = tokens[: (index + 1) * layout.block_size]
    seed = int.from_bytes(hashlib.blake2b(repr(prefix).encode(), digest_size=8).digest(), "little") >> 1
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(layout.block_shape, generator=generator).to(layout.torch_dtype)


def blocks_for(layout: KVLayout, tokens: list[int]) -> list[torch.Tensor]:
    return [block_for(layout, tokens, i) for i in range(len(tokens) // layout.block_size)]


@pytest.fixture
def make_cache(tmp_path, fingerprint):
    """Build caches on one disk directory; closes them all at the end of the test."""
    made = []

    def make(fp: Fingerprint | None = None, **settings) -> TieredKVCache:
        fp = fp or fingerprint
        nbytes = fp.layout.block_nbytes
        config = {
            "block_size": fp.layout.block_size,
            "device": "cpu",
            "device_capacity_blocks": 4,
            "host_capacity_bytes": 4 * nbytes,
            "disk": {"path": str(tmp_path / "disk"), "capacity_bytes": 64 * (nbytes + 8192)},
        }
        for name, value in settings.items():
            if name.startswith("disk_"):
                config["disk"][name.removeprefix("disk_")] = value
            elif value is None and name == "disk":
                config["disk"] = None
            else:
                config[name] = value
        cache = TieredKVCache(CacheConfig.from_dict(config), fp)
        made.append(cache)
        return cache

    yield make
    for cache in made:
        cache.close()


def files_below(root: Path) -> dict[str, bytes]:
    """Every regular file below `root` (links not followed) with its bytes, by relative path."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


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


@pytest.fixture
def small_tmpfs(tmp_path):
    """small_tmpfs(mib): a real tmpfs of `mib` MiB mounted under tmp_path (unmounted at the end), for tests of
    a full filesystem; the test skips, saying why, where mounting is refused (not root)."""
    mounted = []

    def mount(mib: int) -> Path:
        mount_point = tmp_path / f"small-fs-{len(mounted)}"
        mount_point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(mount_point)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"needs to mount a {mib} MiB tmpfs (root): {done.stderr.strip() or done.returncode}")
        mounted.append(mount_point)
        return mount_point

    yield mount
    for mount_point in mounted:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)
