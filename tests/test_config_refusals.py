"""Inputs that cannot be meant are refused at load, exit 2 naming the field, before any work (issue 26, 5-10).

Each case is checked twice: `load_config` (or the loader it uses) raises ConfigError with the field path,
and the real `kvgate plan --config F` exits 2 saying so, in a subprocess with a generous timeout (before these
checks, several of them ran for minutes with memory growing).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cache_impl.config import ConfigError
from gates.config import load_config
from kvcore.settings import load_yaml_file
from tests.servers import REPO
from workloads.datasets import load_spec

MULTI_ROUND = {"kind": "multi_round_qa", "users": 16, "rounds": 4, "system_prompt_tokens": 256,
               "document_tokens": 1536, "question_tokens": 32, "answer_tokens": 64, "output_tokens": 16}


def _file(tmp_path: Path, data, name: str = "gates.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def _plan(path: Path) -> subprocess.CompletedProcess:
    """`kvgate plan --config path` as a user runs it; the timeout only stops a hang (it would take minutes)."""
    return subprocess.run([sys.executable, "-m", "gates.cli", "plan", "--config", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def _refused(tmp_path: Path, data, message: str) -> None:
    path = _file(tmp_path, data)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert message in str(error.value)
    done = _plan(path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr


# -- 7. one YAML loader, no alias bombs -------------------------------------------------------------------------

def _alias_bomb(tail: str) -> str:
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    return "\n".join(lines) + "\n" + tail


def test_an_alias_bomb_is_refused_by_the_loader_before_anything_is_expanded(tmp_path):
    path = _file(tmp_path, _alias_bomb("g2:\n  contexts: *a8\n"))
    with pytest.raises(ConfigError, match=r"expected YAML whose aliases expand to at most 10,000 values, found "
                                          r"more \(aliases of the anchor at line 4 bring them to 15,670\)"):
        load_yaml_file(path, str(path))
    done = _plan(path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "expected YAML whose aliases expand to at most 10,000 values" in done.stderr


def test_a_workload_spec_file_is_read_by_the_same_loader(tmp_path):
    path = _file(tmp_path, _alias_bomb("kind: random\n"), "spec.yaml")
    with pytest.raises(ConfigError, match=r"g3.workload: expected YAML whose aliases expand"):
        load_spec(path, root="g3.workload")


def test_a_recursive_alias_is_refused(tmp_path):
    path = _file(tmp_path, "g2:\n  contexts: &a [1024, *a]\n")
    with pytest.raises(ConfigError, match=r"expected YAML without a recursive alias, found one at line 2"):
        load_yaml_file(path, "x")


def test_aliases_used_as_configs_use_them_still_load(tmp_path):
    path = _file(tmp_path, "g3:\n  workload: &w\n" + "".join(f"    {k}: {v}\n" for k, v in MULTI_ROUND.items()) +
                 "g4:\n  workload:\n    <<: *w\n    users: 4\n")
    config = load_config(path)
    assert config.g3.workload["users"] == 16 and config.g4.workload["users"] == 4


# -- 8. an empty file and a key given twice -------------------------------------------------------------------

def test_an_empty_config_file_is_refused_saying_how_to_get_the_defaults(tmp_path):
    _refused(tmp_path, "# nothing here yet\n",
             "expected a mapping at the top level, found an empty file (no settings: leave out --config to run on "
             "the defaults)")


@pytest.mark.parametrize("text, message", [
    ("profile: quick\nprofile: full\n", "profile: expected each key once, found it at lines 1 and 2"),
    ("g2:\n  rounds: 2\n  contexts: [1024]\n  rounds: 3\n", "g2.rounds: expected each key once, found it at lines 2 "
                                                           "and 4"),
])
def test_a_key_given_twice_is_refused_naming_its_path_and_both_lines(tmp_path, text, message):
    _refused(tmp_path, text, message)


