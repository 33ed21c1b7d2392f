"""`kvgate scrub`: every stored block verified, the bad ones removed, a summary printed."""

import json
from dataclasses import replace

import pytest
import yaml

from cache_impl import integrity
from cache_impl.scrub import scrub
from gates.cli import main
from tests.conftest import BLOCK, blocks_for
from workloads.faults import damage_block


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
    temp = integrity.temp_path_for(paths[3])
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


def test_a_missing_directory_or_a_bad_config_exits_2(tmp_path, capsys):
    assert main(["scrub", "--cache-dir", str(tmp_path / "nowhere")]) == 2
    assert "no such directory" in capsys.readouterr().err
    config = tmp_path / "engine.yaml"
    config.write_text(yaml.safe_dump({"engine": {"cache": {"disk": {"path": str(tmp_path), "read_workers": 0}}}}))
    assert main(["scrub", "--config", str(config)]) == 2
    assert "engine.cache.disk.read_workers" in capsys.readouterr().err
