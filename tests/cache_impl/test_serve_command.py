"""The serve command has one home, cache_impl/server/serve_command.py, and two names: `kvgate-serve` (its own console
script, `python -m cache_impl.server.serve_command`) and `kvgate serve`. Both take the same options with the same help,
and each names itself in its messages."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

from cache_impl.server.serve_command import main
from tests.servers import REPO, TINY_MODEL, ServerProcess, ask, distinct_prompt


def _help(*command: str) -> tuple[str, str]:
    """The usage block and the rest (description and options) of `python -m COMMAND --help`."""
    env = os.environ | {"COLUMNS": "100"}   # both wrap to the same width
    result = subprocess.run([sys.executable, "-m", *command, "--help"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    usage, _, rest = result.stdout.partition("\n\n")
    return usage, rest


def test_kvgate_serve_and_kvgate_serve_entry_show_the_same_options_and_help():
    subcommand_usage, subcommand_rest = _help("gates.cli", "serve")
    entry_usage, entry_rest = _help("cache_impl.server.serve_command")
    assert subcommand_usage.startswith("usage: kvgate serve [-h] [--mode {tiered,device-only,recompute}]")
    assert entry_usage.startswith("usage: kvgate-serve [-h] [--mode {tiered,device-only,recompute}]")
    assert entry_usage.split()[2:] == subcommand_usage.split()[3:]
    assert entry_rest == subcommand_rest
    for option in ("--cache-dir CACHE_DIR", "--remote URL", "--weights DIR", "--require-checksums",
                   "--admin-token-env NAME", "--max-request-bytes SIZE"):
        assert option in entry_rest


def test_the_console_script_names_the_serve_command_main():
    tomllib = pytest.importorskip("tomllib")   # Python 3.11+
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kvgate-serve"] == "cache_impl.server.serve_command:main"
    module, _, function = scripts["kvgate-serve"].partition(":")
    assert getattr(importlib.import_module(module), function) is main


def test_a_port_out_of_range_is_a_usage_error_naming_the_entry():
    result = subprocess.run([sys.executable, "-m", "cache_impl.server.serve_command", "--port", "0"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "kvgate-serve: error: argument --port: expected a port number 1-65535, found 0" in result.stderr
    assert result.stdout == ""


def test_a_config_whose_engine_section_is_no_mapping_exits_2_naming_the_field(tmp_path, capsys):
    config = tmp_path / "engine.yaml"
    config.write_text("engine: 3\n")
    assert main(["--config", str(config)]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"kvgate-serve: {config}: engine: expected a mapping, found int\n"
    assert captured.out == ""


def test_the_entry_serves_completions_names_itself_on_its_start_line_and_stops_cleanly(tmp_path):
    server = ServerProcess(tmp_path, mode="recompute", entry=("cache_impl.server.serve_command",))
    try:
        server.wait_healthy()
        answer = ask(server, distinct_prompt("entry", length=300), max_tokens=4)
    finally:
        code = server.stop()
    assert code == 0, server.log()
    assert answer["cached"] == 0 and answer["text"] != ""
    start_line = next(line for line in server.log().splitlines() if line.startswith("kvgate-serve: "))
    assert start_line.startswith(f"kvgate-serve: {TINY_MODEL}, "), start_line
    assert "mode recompute" in start_line and start_line.endswith(f"http://127.0.0.1:{server.port}/v1")
