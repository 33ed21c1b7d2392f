"""Inputs that cannot be meant are refused at load, exit 2 naming the field, before any work.

Each case is checked twice: `load_config` (or the loader it uses) raises ConfigError with the field path,
and the real `kvgate plan --config F` exits 2 saying so, in a subprocess with a generous timeout (before these
checks, several of them ran for minutes with memory growing).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cache_impl.cache.config import CacheConfig, ConfigError
from gates.config import load_config
from kvcore.settings import load_yaml_file
from tests.servers import REPO
from workloads.traffic.datasets import load_spec

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


# -- 5. g2.contexts beyond the model's context --------------------------------------------------------------

TINY_TOO_LONG = "g2.contexts: expected context lengths the model serves (preset tiny: 4096 tokens, less the 1 token " \
                "each G2 request generates: at most 4095), found 100000"


def test_a_g2_context_longer_than_the_embedded_presets_context_is_refused_naming_the_limit(tmp_path):
    path = _file(tmp_path, {"targets": {"embedded": {"preset": "tiny"}}, "g2": {"contexts": [1024, 100000]},
                            "storage": {"path": str(tmp_path / "storage")}})
    with pytest.raises(ConfigError) as error:
        load_config(path).check_g2_contexts()
    assert str(error.value) == TINY_TOO_LONG
    done = _plan(path)
    assert done.returncode == 2 and TINY_TOO_LONG in done.stderr, done.stdout + done.stderr
    run = subprocess.run([sys.executable, "-m", "gates.cli", "run", "g2", "--config", str(path), "--out",
                          str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and TINY_TOO_LONG in run.stderr, run.stdout + run.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "storage").exists()   # refused before any work


def test_g2s_contexts_bind_only_where_g2_runs_and_the_longest_that_fits_is_accepted(tmp_path):
    tiny = load_config(_file(tmp_path, {"targets": {"embedded": {"preset": "tiny"}}}))   # the quick profile's 8192
    with pytest.raises(ConfigError, match=r"g2.contexts: expected .* \(preset tiny: 4096 tokens.*found 8192"):
        tiny.check_g2_contexts()
    assert tiny.g3.levels    # loads: a run of G3 alone does not depend on G2's contexts
    load_config(_file(tmp_path, {"targets": {"embedded": {"preset": "tiny"}},
                                 "g2": {"contexts": [1024, 4095]}})).check_g2_contexts()


def test_an_absurd_context_is_refused_at_load_for_an_external_target_too(tmp_path):
    external = {"kind": "external", "baseline": {"url": "http://127.0.0.1:9/v1", "model": "m"},
                "candidate": {"url": "http://127.0.0.1:9/v1", "model": "m"}}
    _refused(tmp_path, {"targets": external, "g2": {"contexts": [10**30]}},
             "g2.contexts[0]: expected a value <= 10000000, found 1000000000000000000000000000000")


# -- 6. workload sizes a run cannot mean ----------------------------------------------------------------------

@pytest.mark.parametrize("field, value, message", [
    ("system_prompt_tokens", 10**9, "g3.workload.system_prompt_tokens: expected a value <= 10000000, found 1000000000"),
    ("document_tokens", 10**9, "g3.workload.document_tokens: expected a value <= 10000000, found 1000000000"),
    ("users", 10**9, "g3.workload: expected at most 1,000,000 requests (users × rounds), found 4,000,000,000"),
    ("rounds", 10**6, "g3.workload: expected at most 1,000,000 requests (users × rounds), found 16,000,000"),
])
def test_a_workload_too_large_to_build_is_refused_before_it_is_built(tmp_path, field, value, message):
    _refused(tmp_path, {"g3": {"workload": {**MULTI_ROUND, field: value}}}, message)


def test_a_workload_whose_prompts_grow_past_any_context_or_sum_past_a_run_is_refused(tmp_path):
    long_history = {**MULTI_ROUND, "users": 1, "rounds": 2000, "question_tokens": 10_000}
    with pytest.raises(ConfigError, match=r"g3.workload: expected prompts of at most 10,000,000 tokens .* found "
                                          r"20,129,728 tokens in the last round"):
        load_config(_file(tmp_path, {"g3": {"workload": long_history}}))
    many_long = {"kind": "long_doc_qa", "documents": 1000, "document_tokens": 2_000_000,
                 "questions_per_document": 1, "question_tokens": 8, "output_tokens": 8}
    with pytest.raises(ConfigError, match=r"g3.workload: expected at most 1,000,000,000 prompt tokens over all "
                                          r"requests .* found 2,000,008,000"):
        load_config(_file(tmp_path, {"g3": {"workload": many_long}}))


def test_a_random_workloads_lengths_are_bounded_like_any_prompt(tmp_path):
    spec = {"kind": "random", "requests": 10, "input_tokens": {"distribution": "fixed", "mean": 1e12},
            "output_tokens": {"distribution": "fixed", "mean": 8}}
    with pytest.raises(ConfigError, match=r"workload.input_tokens.mean: expected a value <= 10000000"):
        load_spec(spec)


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
    assert config.g3.workload.users == 16 and config.g4.workload.users == 4


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


# -- 9. one checker for byte sizes and counts --------------------------------------------------------------

@pytest.mark.parametrize("data, message", [
    ({"sizing": {"target": {"disk_capacity": 10**30}}},
     "sizing.target.disk_capacity: expected a byte size of at most 1 EiB, found 1000000000000000000000000000000"),
    ({"sizing": {"target": {"disk_capacity": "1e30 bytes"}}},
     "sizing.target.disk_capacity: expected a byte size (integer or string like '4GiB'), found '1e30 bytes'"),
    ({"sizing": {"target": {"host_capacity": "2000000TiB"}}},
     "sizing.target.host_capacity: expected a byte size of at most 1 EiB, found '2000000TiB'"),
    ({"sizing": {"target": {"kv_layout": {"layers": 10**30, "dtype": "bf16", "kv_heads": 8, "head_dim": 128}}}},
     "sizing.target.kv_layout.layers: expected a value <= 1000000000000000, found "
     "1000000000000000000000000000000"),
    ({"sizing": {"target": {"device_kv_tokens": 10**30}}},
     "sizing.target.device_kv_tokens: expected a value <= 1000000000000000, found 1000000000000000000000000000000"),
    ({"targets": {"embedded": {"disk_capacity": 10**30}}},
     "targets.embedded.disk_capacity: expected a byte size of at most 1 EiB"),
    ({"targets": {"embedded": {"device_capacity_blocks": 10**30}}},
     "targets.embedded.device_capacity_blocks: expected a value <= 1000000000000000"),
    ({"sizing": {"roofline": {"device_tflops": 900, "params": "1e30", "attention_dim": 4096}}},
     "sizing.roofline.params: expected a value <= 1000000000000000"),
])
def test_every_byte_size_and_count_has_one_sane_upper_bound(tmp_path, data, message):
    _refused(tmp_path, data, message)


def test_the_caches_own_settings_share_the_bound():
    with pytest.raises(ConfigError, match="cache.disk.capacity_bytes: expected a byte size of at most 1 EiB"):
        CacheConfig.from_dict({"disk": {"path": "/tmp/x", "capacity_bytes": 10**30}})
    with pytest.raises(ConfigError, match="cache.device_capacity_blocks: expected a value <= 1000000000000000"):
        CacheConfig.from_dict({"device_capacity_blocks": 10**30})


# -- 10. G2's model directory and checkpoint size --------------------------------------------------------------

def test_a_model_load_path_that_is_not_a_checkpoint_directory_is_refused_at_load(tmp_path):
    _refused(tmp_path, {"g2": {"model_load": {"path": "/nonexistent"}}},
             "g2.model_load.path: /nonexistent: expected a checkpoint directory, found nothing")
    (tmp_path / "empty-model").mkdir()
    with pytest.raises(ConfigError, match=r"g2.model_load.path: .*empty-model: expected model.safetensors.index.json"):
        load_config(_file(tmp_path, {"g2": {"model_load": {"path": str(tmp_path / "empty-model")}}}))


def test_a_checkpoint_of_absurd_size_is_refused_at_load_with_one_line(tmp_path):
    _refused(tmp_path, {"g2": {"checkpoint": {"parameters": 10**30}}},
             "g2.checkpoint.parameters: expected a parameter count (an integer in 1..1000000000000000) or a model "
             "size (8B, 32B, 70B, 405B, 1T, adapter), found 1000000000000000000000000000000")
    assert load_config(_file(tmp_path, {"g2": {"checkpoint": {"parameters": "70B"}}})).g2.checkpoint.parameters == "70B"


@pytest.mark.parametrize("read_size, message", [
    ("10000B", "g2.model_load.read_size: expected a multiple of 4096 bytes (O_DIRECT's alignment), found '10000B'"),
    ("0KiB", "g2.model_load.read_size: expected a byte size > 0, found '0KiB'"),
])
def test_a_loader_read_size_o_direct_cannot_take_is_refused_at_load(tmp_path, read_size, message):
    _refused(tmp_path, {"g2": {"model_load": {"read_size": read_size}}}, message)
    reads = load_config(_file(tmp_path, {"g2": {"model_load": {"read_size": "16KiB", "parallel": 1}}})).g2.model_load
    assert (reads.reads.parallel, reads.reads.read_bytes) == (1, 16 << 10)


# -- the judged loader and checkpoint writer are among those measured ------------------------------------------

@pytest.mark.parametrize("section, data, message", [
    ("model_load", {"loaders": ["safetensors"]},
     "g2.model_load.judged: expected one of the loaders measured (safetensors), found 'kvgate'"),
    ("checkpoint", {"writers": ["dcp"]},
     "g2.checkpoint.judged: expected one of the writers measured (dcp), found 'kvgate'"),
    ("checkpoint", {"writers": ["kvgate", "kvgate"]}, "g2.checkpoint.writers: expected each writer once"),
    ("checkpoint", {"judged": "fast"}, "g2.checkpoint.judged"),
])
def test_a_judged_path_that_is_not_measured_is_refused_naming_the_field(tmp_path, section, data, message):
    _refused(tmp_path, {"g2": {section: data}, "storage": {"path": str(tmp_path / "storage")}}, message)


def test_a_profile_may_leave_unjudged_only_the_latency_and_throughput_drift(tmp_path):
    _refused(tmp_path, {"g4": {"measured_only": ["memory_drift_fraction"]},
                        "storage": {"path": str(tmp_path / "storage")}}, "g4.measured_only[0]")


def test_a_workload_given_in_part_changes_the_profiles_fields_of_its_kind_and_another_kind_replaces_it(tmp_path):
    path = tmp_path / "gates.yaml"
    path.write_text(yaml.safe_dump({"g3": {"workload": {"users": 4}}}))
    workload = load_config(path).g3.workload
    assert (workload.kind, workload.users, workload.rounds) == ("multi_round_qa", 4, 4)    # the profile's rounds
    path.write_text(yaml.safe_dump({"g3": {"workload": {"users": 0}}}))
    with pytest.raises(ConfigError) as caught:                     # the bad value named, no field said missing
        load_config(path)
    assert str(caught.value) == "g3.workload.users: expected a value >= 1, found 0"
    path.write_text(yaml.safe_dump({"g3": {"workload": {"kind": "random", "requests": 10,
                                                        "input_tokens": {"distribution": "fixed", "mean": 64},
                                                        "output_tokens": {"distribution": "fixed", "mean": 8}}}}))
    assert load_config(path).g3.workload.kind == "random"


@pytest.mark.parametrize("g2_g3, message", [
    ({"g3": {"levels": [2, 100_000_000]}}, "g3.levels: expected concurrencies (integers in 1..100,000) for replay: "
                                            "closed_loop, found [100000000]"),
    ({"g2": {"contexts": [600, 1100, 600]}}, "g2.contexts: expected each context once, found [600] repeated"),
])
def test_a_level_no_harness_makes_or_a_context_given_twice_is_refused(tmp_path, g2_g3, message):
    (tmp_path / "gates.yaml").write_text(yaml.safe_dump(g2_g3))
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path / "gates.yaml")
    assert message in str(caught.value)


def test_a_config_that_is_a_device_a_fifo_or_huge_is_refused_before_it_is_read(tmp_path):
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.yaml"
    with open(huge, "wb") as file:
        file.truncate((16 << 20) + 1)
    for path, found in ((Path("/dev/zero"), "a device"), (fifo, "a FIFO"), (huge, "a file of 16,777,217 bytes")):
        with pytest.raises(ConfigError, match=f"expected a YAML file, found {found}"):
            load_config(path)          # a FIFO would block, /dev/zero read without end: refused at once


def test_kvgate_plan_into_a_reader_that_stops_early_exits_quietly(tmp_path):
    done = subprocess.run(f"{sys.executable} -m gates.cli plan | head -c 20 > /dev/null; exit ${{PIPESTATUS[0]}}",
                          shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0 and "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


def test_resume_of_a_run_whose_config_no_longer_loads_names_the_runs_file(tmp_path, capsys):
    from gates.cli import main

    (tmp_path / "run.json").write_text('{"run_id": "x", "gates": ["g4"]}')
    (tmp_path / "config.yaml").write_text("g3:\n  levels: [0]\n")
    assert main(["run", "--resume", str(tmp_path)]) == 2
    assert f"--resume: the run's {tmp_path / 'config.yaml'} does not load: g3.levels" in capsys.readouterr().err


# -- G2's rounds: a number, or at least min then more within a budget ---------------------------------------

def test_g2_rounds_are_a_number_or_min_max_and_budget_and_a_bad_one_names_its_field(tmp_path):
    exact = load_config(_file(tmp_path, {"g2": {"rounds": 4}})).g2.rounds
    assert (exact.min, exact.max, exact.budget_s) == (4, 4, None)
    quick = load_config(_file(tmp_path, {})).g2.rounds          # the quick profile: short contexts repeat more
    assert quick.min == 3 and quick.max > quick.min and quick.budget_s > 0
    for data, message in (({"min": 3, "max": 2}, "max: expected at least min (3), found 2"),
                          ({"min": 0}, "g2.rounds.min"), ({"min": 3, "budget_s": -1}, "g2.rounds.budget_s")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(_file(tmp_path, {"g2": {"rounds": data}}))
