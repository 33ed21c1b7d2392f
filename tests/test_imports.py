"""Commands that only read configs, keys or run data never import torch (it takes seconds and a GiB)."""

from __future__ import annotations

import pytest

from tests.torch_probe import imports_torch


@pytest.mark.parametrize(
    "module",
    [
        "gates.cli",
        "gates.config",
        "kvcore.rundata",
        "kvcore.verdict",
        "reports.render",
        "cache_impl.cache.config",
        "cache_impl.cache.keys",
        "cache_impl.weights.loaders",
        "cache_impl.weights.safetensors_dir",
        "cache_impl.cache.placement",
        "cache_impl.cache.lru",
        "workloads.storage.checkpoint",
        "workloads.probes.service_load",
        "sizing.timing",
        "sizing.queueing",
        "sizing.calibration",
        "sizing.layout",
        "sizing.replay",
        "sizing.sequences",
        "kvcore.predictions",
        "workloads.loadgen.live",
        "gates.fleet",
        "workloads.probes.tier_hits",
        "sizing.targets",
        "sizing.g3_inputs",
        "sizing.g3_figures",
        "sizing.plan",
        "engines",
        "engines.kvgate",
        "engines.vllm",
        "engines.sglang",
        "engines.generic",
        "engines.placement",
        "engines.settings",
        "gates.selftest",
        "workloads.servers.reference_server",
        "kvcore.g3_analysis",
        "kvcore.loader_names",
        "gates.plan_command",
        "gates.machine_probe",
        "cache_impl.server.serve_command",
    ],
)
def test_reading_configs_keys_and_run_data_does_not_import_torch(module, tmp_path):
    assert not imports_torch(f"import {module}", tmp_path)


def test_help_init_and_report_do_not_import_torch(tmp_path):
    code = ("from gates.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "main(['init', 'gates.yaml'])\n"
            "from gates.config import load_config\nload_config(__import__('pathlib').Path('gates.yaml'))\n"
            "import os, json\nos.makedirs('run', exist_ok=True)\n"
            "open('run/run.json', 'w').write(json.dumps({'run_id': 'r', 'gates': ['g1']}))\n"
            "main(['report', 'run'])\n")
    assert not imports_torch(code, tmp_path)


def test_kvgate_serve_help_does_not_import_torch(tmp_path):
    code = ("from cache_impl.server.serve_command import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n")
    assert not imports_torch(code, tmp_path)


def test_the_probe_sees_torch_when_it_is_imported(tmp_path):
    assert imports_torch("import cache_impl.cache.manager", tmp_path)
