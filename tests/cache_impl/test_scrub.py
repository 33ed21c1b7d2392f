"""`kvgate scrub`: every stored block verified, the bad ones removed, a summary printed."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import yaml

from cache_impl.cache import blockfiles, integrity
from cache_impl.cache.faults import damage_block
from cache_impl.cache.scrub import scrub
from gates.cli import main
from tests.blocks import BLOCK, blocks_for, files_below, plant_links_and_strays
from tests.servers import REPO


@pytest.fixture
def stored(make_cache, fingerprint, tmp_path):
    """Blocks of two models in one disk directory: 4 of this model's, 2 of another's."""
    cache = make_cache(host_capacity_bytes=0)
    other = make_cache(fp=replace(fingerprint, weights_digest="seed-1"), host_capacity_bytes=0)
    for store, n in ((cache, 4), (other, 2)):
        tokens = list(range(n * BLOCK))
        store.store(tokens, blocks_for(store.layout, tokens))
        store.flush()
    paths = [cache.tier("disk").path_for(k) for k in cache.keys_for(list(range(4 * BLOCK)))]
    return tmp_path / "disk", paths


def test_scrub_removes_exactly_the_damaged_blocks_of_every_model(stored):
    root, paths = stored
    damage_block("flip_byte", paths[0])
    damage_block("truncate", paths[1])
    damage_block("swap", paths[2], donor=paths[3])
    temp = paths[3].with_name(blockfiles.temp_name(paths[3].name))
    temp.write_bytes(b"a write in flight")
    summary = scrub(root)
    assert (summary.checked, summary.bad, summary.removed, summary.fingerprints) == (6, 3, 3, 2)
    assert summary.bad_by_reason == {integrity.BAD_CHECKSUM: 1, integrity.SHORT_READ: 1, integrity.WRONG_KEY: 1}
    assert [p.exists() for p in paths] == [False, False, False, True]
    assert temp.exists() and summary.temp_files == 1       # in-flight writes are left to their writer
    again = scrub(root)
    assert (again.checked, again.bad) == (3, 0)


def test_a_dry_run_reports_and_removes_nothing(stored):
    root, paths = stored
    damage_block("flip_byte", paths[1])
    summary = scrub(root, remove=False)
    assert (summary.bad, summary.removed) == (1, 0) and paths[1].exists()
    assert summary.bad_files == [str(paths[1])]


def test_the_command_exits_1_when_it_removed_bad_blocks_then_0(stored, tmp_path, capsys):
    root, paths = stored
    damage_block("flip_byte", paths[0])
    config = tmp_path / "engine.yaml"
    config.write_text(yaml.safe_dump({"engine": {"cache": {"disk": {"path": str(root)}}}}))
    assert main(["scrub", "--config", str(config)]) == 1
    out = capsys.readouterr().out
    assert "checked 6 blocks" in out and "bad 1 (1 checksum)" in out and "removed 1" in out
    assert main(["scrub", "--cache-dir", str(root), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["checked"], summary["bad"]) == (5, 0)


def test_the_command_finds_the_embedded_targets_directories_from_a_gates_yaml(stored, tmp_path, capsys):
    root, _ = stored
    storage = tmp_path / "storage"
    storage.mkdir()
    root.rename(storage / "kv-tiered")
    config = tmp_path / "gates.yaml"
    config.write_text(yaml.safe_dump({"storage": {"path": str(storage)}}))
    assert main(["scrub", "--config", str(config)]) == 0
    assert f"{storage / 'kv-tiered'}: checked 6 blocks" in capsys.readouterr().out


def test_scrub_follows_no_link_and_judges_only_the_tiers_own_files(stored, tmp_path, capsys):
    root, paths = stored
    outside = tmp_path / "outside"
    strays = plant_links_and_strays(paths[0].parent.parent, outside)
    before, strays_before = files_below(outside), {s: s.read_bytes() for s in strays}
    damage_block("flip_byte", paths[1])                  # one bad block of ours, so scrub does remove
    assert main(["scrub", "--cache-dir", str(root), "--json"]) == 1
    summary = json.loads(capsys.readouterr().out)
    assert files_below(outside) == before                # nothing outside read as a block, nothing removed
    assert {s: s.read_bytes() for s in strays} == strays_before
    assert (summary["checked"], summary["bad"], summary["removed"]) == (6, 1, 1) and not paths[1].exists()
    assert summary["skipped_by_reason"] == {blockfiles.SYMLINK: 3, blockfiles.FOREIGN_NAME: 5}
    skipped = {entry["path"] for entry in summary["skipped_files"]}
    assert {str(s) for s in strays[1:]} <= skipped and str(strays[0].parent) in skipped
    assert all(str(root) in path for path in skipped)    # reported where it was met, not where a link leads


def test_the_command_names_what_it_skipped(stored, tmp_path, capsys):
    root, paths = stored
    plant_links_and_strays(paths[0].parent.parent, tmp_path / "outside")
    assert main(["scrub", "--cache-dir", str(root), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "skipped 8 not the tier's own" in out
    assert f"skipped (symbolic link): {root / ('12' * 16)}" in out


def test_a_missing_directory_or_a_bad_config_exits_2(tmp_path, capsys):
    assert main(["scrub", "--cache-dir", str(tmp_path / "nowhere")]) == 2
    assert "--cache-dir: expected a disk tier directory, found no such directory" in capsys.readouterr().err
    (tmp_path / "afile").write_text("x")
    assert main(["scrub", "--cache-dir", str(tmp_path / "afile")]) == 2
    assert "--cache-dir: expected a disk tier directory, found a file" in capsys.readouterr().err
    config = tmp_path / "engine.yaml"
    config.write_text(yaml.safe_dump({"engine": {"cache": {"disk": {"path": str(tmp_path), "read_workers": 0}}}}))
    assert main(["scrub", "--config", str(config)]) == 2
    assert "engine.cache.disk.read_workers" in capsys.readouterr().err


def test_a_directory_that_is_not_a_disk_tiers_is_refused_before_anything_is_checked(tmp_path, capsys):
    stray = tmp_path / "home"
    (stray / "projects").mkdir(parents=True)
    (stray / "notes.kvb").write_text("not a block")
    for directory in (stray, tmp_path / "home" / "projects"):   # foreign entries; an empty directory
        assert main(["scrub", "--cache-dir", str(directory)]) == 2
        err = capsys.readouterr().err
        assert (f"--cache-dir: expected a disk tier's directory (a <fingerprint hex>/ directory of block files in "
                f"it, which a tier makes when it starts), found none in {directory}") in err
    assert (stray / "notes.kvb").exists()


def test_kvgate_scrub_of_the_root_directory_exits_2_saying_it_is_no_tiers(tmp_path):
    done = subprocess.run([sys.executable, "-m", "gates.cli", "scrub", "--cache-dir", "/", "--dry-run"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "kvgate scrub: --cache-dir: expected a disk tier's directory" in done.stderr
    assert "found none in /" in done.stderr and "checked" not in done.stdout
