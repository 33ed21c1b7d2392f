"""Fixtures for the cache tests: a small KV layout, caches on a temp disk directory, a small tmpfs (blocks:
tests/blocks.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from cache_impl import CacheConfig, Fingerprint, KVLayout, TieredKVCache
from cache_impl.server.auth import ADMIN_TOKEN_ENV
from tests.answering import answering  # noqa: F401  (the fixture: a real HTTP server on 127.0.0.1)
from tests.blocks import BLOCK
from tests.gate_runs import GateRun, run_g1_g2
from tests.live_vllm import LiveModel, VllmServer, vllm_python
from tests.servers import ADMIN_TOKEN


@pytest.fixture(scope="session", autouse=True)
def admin_token_in_environment():
    """The test servers' admin token where AdminClient reads it, as `kvgate run` hands it to a gate suite."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ADMIN_TOKEN_ENV, ADMIN_TOKEN)
        yield ADMIN_TOKEN


@pytest.fixture(scope="session")
def live_vllm_model(tmp_path_factory) -> LiveModel:
    """The live vLLM modules' model: kvgate's small one exported for vLLM (the venv installed on first use)."""
    from cache_impl.engine.hf_export import export_hf  # deferred: only the live modules need the exporter

    python = vllm_python()
    workdir = tmp_path_factory.mktemp("live-vllm")
    return LiveModel(python, export_hf(workdir / "kvgate-small", "small", 0), workdir)


@pytest.fixture(scope="session")
def live_vllm_recompute(live_vllm_model: LiveModel):
    """vLLM alone with prefix caching off, every prompt computed: the baseline and the reference answers of both
    live modules (test_live_vllm, test_live_vllm_connector), started once a session."""
    server = VllmServer(live_vllm_model.python, live_vllm_model.model, live_vllm_model.workdir, prefix_caching=False)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture
def layout() -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=BLOCK)


@pytest.fixture
def fingerprint(layout) -> Fingerprint:
    return Fingerprint(weights_digest="seed-0", tokenizer_id="test-tokenizer", layout=layout)


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


@pytest.fixture(scope="session")
def g1_g2_run(tmp_path_factory) -> GateRun:
    """One real `kvgate run g1 g2` on the tiny preset (minutes), shared by the modules that check it: the report
    against the raw data (test_run_e2e) and the sizing model's G2 from the machine probe (test_sizing_machine)."""
    return run_g1_g2(tmp_path_factory.mktemp("kvgate-g1-g2"))
