"""G2 on an external candidate: `kvgate serve` started by the test and named an unknown engine (`engine:
generic`, no admin route), placed by pressure and checked by the tier accounting of its own /metrics
(a configured metric map), beside the embedded path on the same settings."""

from __future__ import annotations

import shutil

import pytest
import yaml

from gates.cli import main
from kvcore.rundata import RunStore
from tests.servers import TINY_SWEEP, ServerProcess, started_server

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (Debian package 'fio')")]

BLOCK_BYTES = 131072                 # one 256-token block of the tiny preset's KV (512 bytes per token)
DEVICE_BLOCKS, HOST_BLOCKS = 16, 64
EMBEDDED = {"preset": "tiny", "max_running": 2, "device_capacity_blocks": DEVICE_BLOCKS,
            "host_capacity": f"{HOST_BLOCKS * BLOCK_BYTES // 2**20}MiB", "disk_capacity": "256MiB"}
G2 = {"contexts": [600, 1100], "rounds": 1, "model_load": {"enabled": False}, "checkpoint": {"enabled": False},
      "no_reuse": {"enabled": False}}
KVGATE_METRICS = {tier: {"metric": "kvgate_cache_hits_total", "labels": {"tier": tier}, "scale": 256}
                  for tier in ("device", "host", "disk", "remote")}


def _server(tmp_path_factory, mode: str):
    engine = {"preset": "tiny", "max_running": 2,
              "cache": {"device_capacity_blocks": DEVICE_BLOCKS, "host_capacity_bytes": HOST_BLOCKS * BLOCK_BYTES,
                        "disk": {"path": "unused", "capacity_bytes": 256 * 2**20}}}
    return started_server(tmp_path_factory.mktemp(f"ext-{mode}"), mode=mode, engine=engine)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """A tiered candidate, a device-only baseline and a recompute reference, none with admin routes."""
    made = {mode: _server(tmp_path_factory, mode) for mode in ("tiered", "device-only", "recompute")}
    started = {mode: next(gen) for mode, gen in made.items()}
    yield started
    for gen in made.values():
        next(gen, None)


def _run(work, config: dict) -> RunStore:
    (work / "gates.yaml").write_text(yaml.safe_dump({**config, "storage": {"path": str(work / "storage")},
                                                     "g2": G2, "fio": {"sweep": TINY_SWEEP}}))
    assert main(["run", "g2", "--config", str(work / "gates.yaml"), "--out", str(work / "run")]) in (0, 1)
    return RunStore(work / "run")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, servers):
    candidate: ServerProcess = servers["tiered"]
    url = lambda server: f"{server.base_url}/v1"      # noqa: E731
    external = {"targets": {"kind": "external", "candidate": {
        "url": url(candidate), "model": "kvgate-tiny", "engine": "generic", "tokenizer": "kvgate-byte-v1",
        "metric_map": {**KVGATE_METRICS, "prompt_tokens": [{"metric": "kvgate_prompt_tokens_computed_total"},
                                                           {"metric": "kvgate_prompt_tokens_reused_total"}]},
        "device_kv_tokens": DEVICE_BLOCKS * 256, "host_kv_tokens": HOST_BLOCKS * 256,
        "cache_dir": str(candidate.cache_dir)},
        "baseline": {"url": url(servers["device-only"]), "model": "kvgate-tiny", "tokenizer": "kvgate-byte-v1"},
        "recompute": {"url": url(servers["recompute"]), "model": "kvgate-tiny", "tokenizer": "kvgate-byte-v1"}}}
    # the same engine with nothing to read its hits by: placed by pressure all the same, never judged as checked
    unchecked = {"targets": {**external["targets"], "candidate": {
        k: v for k, v in external["targets"]["candidate"].items() if k != "metric_map"}}}
    return {"external": _run(tmp_path_factory.mktemp("g2-external"), external),
            "unchecked": _run(tmp_path_factory.mktemp("g2-unchecked"), unchecked),
            "embedded": _run(tmp_path_factory.mktemp("g2-embedded"), {"targets": {"embedded": EMBEDDED}})}


def _verdicts(store: RunStore) -> dict:
    return {v["metric"]: v for v in store.verdicts("g2")}


def test_an_unknown_engine_is_placed_by_pressure_and_its_hits_checked_by_its_metrics(runs):
    store = runs["external"]
    placed = {m["context"]["mode"]: m["context"]["placement"] for m in store.measurements("g2")
              if m["metric"] == "ttft_ms" and "placement" in (m["context"] or {})}
    # host: past the device, 4096 x 1.25 = 5120 tokens in fillers of 1024 (4 whole blocks <= 1100) -> 5
    assert placed["host-hit"].startswith("by pressure: host: 5 distinct fillers of 1024 tokens")
    # disk: past device + host, (4096 + 16384) x 1.25 = 25600 tokens -> 25 fillers; pages dropped from cache_dir
    assert placed["disk-cold"].startswith("by pressure: disk: 25 distinct fillers of 1024 tokens")
    assert placed["disk-cold"].endswith("page cache dropped")
    hits = [m for m in store.measurements("g2") if m["metric"] == "placed_hit"]
    assert len(hits) == 4 and all(m["value"] is True for m in hits)          # 2 contexts x host, disk
    assert {m["context"]["tier"] for m in hits} == {"host", "disk"}
    for hit in hits:        # the accounting saw the hit on the placed tier alone
        tiers = hit["context"]["tier_tokens"]
        assert tiers[hit["context"]["tier"]] > 0 and sum(tiers.values()) == tiers[hit["context"]["tier"]]


def test_the_external_path_gives_the_embedded_paths_verdicts(runs):
    external, embedded = _verdicts(runs["external"]), _verdicts(runs["embedded"])
    for metric in ("cached_fraction_min", "placed_tier_verified"):
        assert external[metric]["status"] == embedded[metric]["status"] == "PASS", (external[metric]["reason"],
                                                                                  embedded[metric]["reason"])
    # the TTFT ratio is judged on both (its status may differ with the machine's minute, its basis may not)
    for verdicts in (external, embedded):
        assert verdicts["disk_hit_ttft_vs_recompute"]["value"] is not None
        assert "may be warm" not in verdicts["disk_hit_ttft_vs_recompute"]["reason"]
    # the cold-read ratio needs kvgate's own disk counters: said, not skipped
    assert external["cold_read_vs_storage_best"]["status"] == "INCONCLUSIVE"
    assert "does not export its disk tier's read bytes" in external["cold_read_vs_storage_best"]["reason"]
    assert embedded["cold_read_vs_storage_best"]["value"] is not None


def test_hits_nothing_can_check_are_inconclusive_naming_what_was_missing(runs):
    verdicts = _verdicts(runs["unchecked"])
    placed = verdicts["placed_tier_verified"]
    assert placed["status"] == "INCONCLUSIVE" and "no tier accounting" in placed["reason"]
    assert "metric_map" in placed["reason"] or "generic" in placed["reason"]
    disk = verdicts["disk_hit_ttft_vs_recompute"]
    assert disk["status"] == "INCONCLUSIVE" and "no tier accounting" in disk["reason"]
    # the response's own cached tokens still say the hits were whole
    assert verdicts["cached_fraction_min"]["status"] == "PASS"
